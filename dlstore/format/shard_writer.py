"""Writes WebDataset-compatible tar shards (`TarShardWriter`), deterministically.

Every header field that could vary between runs is fixed: mtime 0, uid and gid 0, mode 0444, empty
user and group names. So the same samples in the same order give byte-identical shards. The writer
hashes while writing, with `checksum_algorithm` (XXH3-128 by default), and returns the shard's
`SampleIndex`. Names longer than 100 bytes and members of 8 GiB or more get a pax header.
`dlstore.format.shards` describes the format and reads it back.

>>> import io
>>> buffer = io.BytesIO()
>>> writer = TarShardWriter(buffer)
>>> writer.write("000000", {"jpg": b"...", "cls": b"3"})
SampleSpan(offset=0, size=2048)
>>> index = writer.close()   # `dlstore.format.shards` reads the samples back (its example)
>>> len(index), index.shard_size == len(buffer.getvalue()) == 10240
(1, True)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import BinaryIO

from dlstore.format.checksums import DEFAULT_ALGORITHM, new_hasher
from dlstore.format.sample_index import SampleIndex, SampleSpan, digest_field
from dlstore.format.shards import BLOCK

__all__ = ["TarShardWriter"]

RECORD = 20 * BLOCK  # GNU tar and tarfile pad archives to 10 KiB records; so do we
_ZERO_BLOCK = bytes(BLOCK)


def _octal(value: int, width: int) -> bytes:
    return b"%0*o\0" % (width - 1, value)


class TarShardWriter:
    """Writes one shard, sample by sample, to a binary file; byte-for-byte deterministic.

    >>> with open("shard-000000.tar", "wb") as f:                       # doctest: +SKIP
    ...     w = TarShardWriter(f)
    ...     w.write("00000000", {"jpg": jpeg_bytes, "cls": b"7"})
    ...     index = w.close(recipe=digest)
    """

    def __init__(self, file: BinaryIO, checksum_algorithm: str = DEFAULT_ALGORITHM) -> None:
        self._file = file
        self._algorithm = checksum_algorithm
        self._hash = new_hasher(checksum_algorithm)
        self._offset = 0
        self._offsets: list[int] = []
        self._closed = False
        self._end = 0

    @property
    def size(self) -> int:
        """Bytes written so far."""
        return self._offset

    @property
    def samples(self) -> int:
        return len(self._offsets)

    def _emit(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._hash.update(data)
        self._offset += len(data)

    def write(self, key: str, fields: Mapping[str, bytes]) -> SampleSpan:
        """Append one sample; `fields` maps extensions such as `"jpg"` to bytes, written in order.
        Entries whose name starts with `__`, such as a read sample's `__key__`, are left out."""
        if self._closed:
            raise ValueError("the shard is closed")
        if not key or "." in key.rsplit("/", 1)[-1] or key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"sample key {key!r} must be a relative name without a dot in its last part")
        members = [(ext, data) for ext, data in fields.items() if not ext.startswith("__")]
        if not members:
            raise ValueError(f"sample {key!r} has no fields")
        start = self._offset
        for ext, data in members:
            if not ext or "/" in ext:
                raise ValueError(f"field name {ext!r} of sample {key!r} is not a file extension")
            self._write_member(f"{key}.{ext}", data)
        self._offsets.append(start)
        return SampleSpan(start, self._offset - start)

    def _write_member(self, name: str, data: bytes | bytearray | memoryview) -> None:
        encoded = name.encode("utf-8")
        size = len(data)
        if len(encoded) > 100 or size >= 8**11:
            self._write_pax(name, size)
        self._emit(_header(encoded[:100], size, b"0"))
        self._emit(data)
        pad = -size % BLOCK
        if pad:
            self._emit(_ZERO_BLOCK[:pad])

    def _write_pax(self, name: str, size: int) -> None:
        records = b"".join(_pax_record(k, v) for k, v in (("path", name), ("size", str(size))))
        self._emit(_header(b"././@PaxHeader", len(records), b"x"))
        self._emit(records)
        pad = -len(records) % BLOCK
        if pad:
            self._emit(_ZERO_BLOCK[:pad])

    def close(self, recipe: bytes = bytes(32)) -> SampleIndex:
        """Write the end-of-archive blocks, padded to a 10 KiB record, and return the index."""
        if not self._closed:
            end = self._offset
            self._emit(_ZERO_BLOCK * 2)
            pad = -self._offset % RECORD
            if pad:
                self._emit(bytes(pad))
            self._closed = True
            self._end = end
        checksum = f"{self._algorithm}:{self._hash.hexdigest()}"
        return SampleIndex(self._offsets + [self._end], self._offset, digest_field(checksum), recipe)


def _pax_record(key: str, value: str) -> bytes:
    body = f" {key}={value}\n".encode()
    length = len(body) + 1
    while len(str(length)) + len(body) != length:
        length = len(str(length)) + len(body)
    return str(length).encode() + body


def _header_template() -> bytes:
    header = bytearray(BLOCK)
    header[100:108] = _octal(0o444, 8)  # mode
    header[108:116] = _octal(0, 8)  # uid
    header[116:124] = _octal(0, 8)  # gid
    header[136:148] = _octal(0, 12)  # mtime: fixed, so that shards are reproducible
    header[148:156] = b"        "  # the checksum counts its own field as spaces
    header[257:265] = b"ustar\x0000"
    header[329:337] = _octal(0, 8)  # devmajor
    header[337:345] = _octal(0, 8)  # devminor
    return bytes(header)


_TEMPLATE = _header_template()


def is_dlstore_header(header: bytes) -> bool:
    """Whether a tar header block has the fields every header of this writer has: mode, owner, mtime
    0, no user or group names. That tells a shard of ours from another tool's."""
    # mode, uid and gid; mtime; magic, version, user and group names
    fields = ((100, 124), (136, 148), (257, 329))
    return len(header) == BLOCK and all(header[a:b] == _TEMPLATE[a:b] for a, b in fields)


def _header(name: bytes, size: int, typeflag: bytes) -> bytes:
    header = bytearray(_TEMPLATE)
    header[0 : len(name)] = name
    header[124:136] = _octal(min(size, 8**11 - 1), 12)  # size; a pax record carries bigger ones
    header[156:157] = typeflag
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header)
