"""WebDataset-compatible tar shards: the format, and a safe, fast reader.

A shard is a POSIX (ustar) tar in which the files of one sample are consecutive and share a
basename: `00000042.jpg`, `00000042.cls`, `00000042.json`. The key/extension split is WebDataset's.
The key is everything up to the first dot of the file's basename; the extension is the rest,
lowercased. GNU tar and the `webdataset` package read these shards as they are.

The writer is `TarShardWriter` in `dlstore.format.shard_writer`: deterministic, byte for byte.

The reader is `iter_samples`, `parse_samples` and `read_sample_from_file`. It parses the 512-byte
headers itself, which is faster than `tarfile` and never touches the file system. It reads ustar,
GNU and pax headers, so shards from other tools work too. GNU brings `L` long names and base-256
sizes; pax brings `x` path and size. It raises `CorruptShard`, never anything else, for what a shard
must not hold. It refuses absolute or `..` names, links, devices, FIFOs, sparse or unknown member
types. It refuses negative or oversized sizes, bad header checksums, truncated headers or data, and
a field twice in one sample.

>>> import io
>>> from dlstore.format.shard_writer import TarShardWriter
>>> buffer = io.BytesIO()
>>> writer = TarShardWriter(buffer)
>>> writer.write("000000", {"jpg": b"...", "cls": b"3"})
SampleSpan(offset=0, size=2048)
>>> index = writer.close()
>>> [s["cls"] for s in iter_samples(buffer.getvalue())]
[b'3']
>>> read_sample_from_file(io.BytesIO(buffer.getvalue()), index[0])["__key__"]
'000000'
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import BinaryIO, NamedTuple

from dlstore.errors import CorruptSample, CorruptShard
from dlstore.format.checksums import DEFAULT_ALGORITHM, new_hasher
from dlstore.format.sample_index import SampleIndex, SampleSpan, digest_field, sample_digest
from dlstore.storage.base import IterReader

try:  # the walk of plain headers in C; without it, the Python reader reads every sample
    import dlstore.format.tar_headers as tar_headers
except ImportError:  # pragma: no cover - built at install where a C compiler is there
    tar_headers = None

__all__ = [
    "IMAGE_FIELDS",
    "MAX_MEMBER_SIZE",
    "TarMember",
    "image_field",
    "iter_members",
    "iter_samples",
    "iter_samples_with_spans",
    "parse_label",
    "parse_samples",
    "read_sample",
    "release_views",
    "read_sample_from_file",
    "read_shard_index",
    "scan_shard",
    "shard_name",
    "split_member_name",
]

BLOCK = 512
MAX_MEMBER_SIZE = 1 << 30  # a single member above 1 GiB is not an image sample: refuse it
_MAX_EXTENDED_HEADER = 1 << 20
_ZERO_BLOCK = bytes(BLOCK)
_REGULAR = (b"0", b"\0", b"7")
_EXTENDED = (b"x", b"g", b"L", b"K")
_REJECTED = {
    b"1": "a hard link",
    b"2": "a symbolic link",
    b"3": "a character device",
    b"4": "a block device",
    b"6": "a FIFO",
    b"S": "a sparse file",
    b"V": "a volume label",
    b"M": "a multi-volume continuation",
}
_NAME_RE = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext, exactly
_META_RE = re.compile(r"__[^/]*__($|/)")  # webdataset skips these members entirely

Source = bytes | bytearray | memoryview | BinaryIO | Iterable[bytes]

# The members that may hold a sample's image, in order of preference. `convert` writes these
# and the dataset reads them. With --keep-format each sample carries its own type.
IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp", "ppm", "pgm", "bmp", "gif", "tif", "tiff")


def image_field(sample: Mapping[str, object], fields: Iterable[str] = IMAGE_FIELDS) -> str | None:
    """The first of `fields` that `sample` has, or None.

    >>> image_field({"__key__": "0", "png": b"...", "cls": b"1"})
    'png'
    """
    return next((f for f in fields if f in sample), None)


def parse_label(sample: Mapping[str, object], num_classes: int, field: str = "cls") -> int:
    """The class index in `sample[field]`, as ASCII digits. It must name one of `num_classes`
    classes, or any non-negative index when that is 0. Raises `CorruptSample` otherwise.

    >>> parse_label({"__key__": "0", "cls": b" 7\\n"}, 10)
    7
    """
    key = sample.get("__key__")
    raw = sample.get(field)
    if raw is None:
        raise CorruptSample(f"sample {key!r} has no .{field} member")
    try:
        label = int(bytes(raw).decode("ascii").strip())  # type: ignore[arg-type]
    except (UnicodeDecodeError, ValueError, TypeError):
        raise CorruptSample(f"sample {key!r} has a non-integer label {shown(raw)}") from None
    if label < 0 or (num_classes and label >= num_classes):
        raise CorruptSample(f"sample {key!r} has label {shown(str(label))}, not one of {num_classes} classes")
    return label


def shown(value: object, limit: int = 40) -> str:
    """`repr(value)` for a message, cut to `limit` characters or bytes. A huge label member must not
    be quoted whole in an error line and in every epoch's skip warning.

    >>> shown(b"7" * 100, limit=4)
    "b'7777'... (100 bytes)"
    """
    if isinstance(value, (bytes, bytearray, memoryview, str)) and len(value) > limit:
        unit = "characters" if isinstance(value, str) else "bytes"
        return f"{value[:limit]!r}... ({len(value):,} {unit})"
    return repr(value)


def shard_name(prefix: str, index: int) -> str:
    """`shard-000012.tar` for `("shard", 12)`.

    >>> shard_name("train", 3)
    'train-000003.tar'
    """
    return f"{prefix}-{index:06d}.tar"


def split_member_name(name: str) -> tuple[str, str] | None:
    """The key and extension of a member name as WebDataset splits it; None without an extension.

    >>> split_member_name("a/b/00042.seg.png")
    ('a/b/00042', 'seg.png')
    """
    match = _NAME_RE.match(name)
    if match is None:
        return None
    return match.group(1), match.group(2).lower()


# -- reader --------------------------------------------------------------------------------
class TarMember(NamedTuple):
    """A regular file in a tar: its name, where its first header and its data start, and its size."""

    name: str
    offset: int
    data_offset: int
    size: int
    data: bytes | None


def _number(field: bytes, what: str, offset: int) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256
        if field[0] == 0xFF:
            raise CorruptShard(f"tar header at byte {offset}: negative {what}")
        return int.from_bytes(bytes([field[0] & 0x7F]) + field[1:], "big")
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    if text.translate(None, b"01234567"):
        raise CorruptShard(f"tar header at byte {offset}: {what} {text[:16]!r} is not an octal number")
    return int(text, 8)


def _byte_sum(block: bytes) -> int:
    """`sum(block)` of a 512-byte block, faster. Adler-32's low half is 1 + the sum of the bytes
    modulo 65521. That is exact for 256 bytes, at most 65,280, so it runs once per half."""
    return (zlib.adler32(block[:256]) & 0xFFFF) + (zlib.adler32(block[256:]) & 0xFFFF) - 2


def _check_header(block: bytes, offset: int) -> None:
    stored = _number(block[148:156], "checksum", offset)
    unsigned = _byte_sum(block) - sum(block[148:156]) + 8 * 32
    if stored != unsigned:
        signed = unsigned - 256 * sum(1 for i, b in enumerate(block) if b > 127 and not 148 <= i < 156)
        if stored != signed:
            raise CorruptShard(f"tar header at byte {offset}: bad checksum (not a tar, or a corrupt one)")


def _decode_name(raw: bytes, offset: int) -> str:
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptShard(f"tar member at byte {offset}: name {raw[:60]!r} is not UTF-8") from None
    while name.startswith("./"):
        name = name[2:]
    if not name or name.startswith("/") or "\0" in name or ".." in name.replace("\\", "/").split("/"):
        raise CorruptShard(f"tar member at byte {offset}: unsafe name {name[:100]!r}")
    return name


def _parse_pax(data: bytes, offset: int) -> dict[str, bytes]:
    records: dict[str, bytes] = {}
    pos = 0
    while pos < len(data) and data[pos] != 0:
        space = data.find(b" ", pos, pos + 24)
        if space < 0:
            raise CorruptShard(f"pax header at byte {offset}: malformed record")
        length_text = data[pos:space]
        if not length_text.isdigit() or int(length_text) < 5 or pos + int(length_text) > len(data):
            raise CorruptShard(f"pax header at byte {offset}: malformed record length {length_text[:16]!r}")
        end = pos + int(length_text)
        record = data[space + 1 : end]
        if not record.endswith(b"\n") or b"=" not in record:
            raise CorruptShard(f"pax header at byte {offset}: malformed record")
        key, _, value = record[:-1].partition(b"=")
        records[key.decode("utf-8", "replace")] = value
        pos = end
    return records


class _Reader:
    """`read(n)` and `skip(n)` over a buffer, a file or a chunk iterator; `read` is short only at
    the end. `length` is the byte count when it is known, for a buffer or a seekable file. So a
    member running past the end is found even when its data is skipped."""

    __slots__ = ("read", "skip", "position", "length", "in_memory", "_buffer")

    def __init__(self, source: Source) -> None:
        self.position = 0
        self.length: int | None = None
        self.in_memory = isinstance(source, (bytes, bytearray, memoryview))
        if self.in_memory:
            self._init_buffer(memoryview(source).cast("B"))
        else:
            if not hasattr(source, "read"):
                source = io.BufferedReader(IterReader(source), buffer_size=1 << 20)  # type: ignore[arg-type]
            self._init_file(source)  # type: ignore[arg-type]

    def _init_buffer(self, view: memoryview) -> None:
        self.length = len(view)
        self._buffer = view

        def read(n: int) -> bytes:
            start = self.position
            self.position = start + n
            return view[start : start + n].tobytes()

        def skip(n: int) -> None:
            self.position += n

        self.read, self.skip = read, skip

    def view(self, n: int) -> memoryview:
        """The next `n` bytes of a buffer, uncopied."""
        start = self.position
        self.position = start + n
        return self._buffer[start : start + n]

    def _init_file(self, file: BinaryIO) -> None:
        raw_read = file.read
        seekable = False
        try:
            seekable = file.seekable()
            if seekable:
                here = file.tell()
                self.length = file.seek(0, os.SEEK_END) - here
                file.seek(here)
        except (AttributeError, OSError, ValueError):
            seekable, self.length = False, None

        def read(n: int) -> bytes:
            data = raw_read(n)
            if data is None:
                data = b""
            while len(data) < n:  # unbuffered streams may return short reads before the end
                more = raw_read(n - len(data))
                if not more:
                    break
                data += more
            self.position += len(data)
            return data

        def skip(n: int) -> None:
            if seekable:
                file.seek(n, os.SEEK_CUR)
                self.position += n
            else:
                while n > 0:
                    chunk = read(min(n, 1 << 20))
                    if not chunk:
                        return
                    n -= len(chunk)

        self.read, self.skip = read, skip


def _name_and_size(
    block: bytes, size: int, long_name: bytes | None, pax: dict[str, bytes] | None, offset: int
) -> tuple[str, int]:
    """A member's name, from a ustar prefix, GNU long name or pax path, and size; pax's wins."""
    raw_name = block[:100].split(b"\0", 1)[0]
    if block[257:263] == b"ustar\x00" and block[345]:
        raw_name = block[345:500].split(b"\0", 1)[0] + b"/" + raw_name
    if long_name is not None:
        raw_name = long_name
    if pax is not None:
        raw_name = pax.get("path", raw_name)
        if "size" in pax:
            # At most 20 digits, for 2**64. Python refuses to parse a number of more than 4,300.
            if not pax["size"].isdigit() or len(pax["size"]) > 20:
                raise CorruptShard(f"pax header before byte {offset}: size {pax['size'][:16]!r}")
            size = int(pax["size"])
    return _decode_name(raw_name, offset), size


def _check_member(name: str, typeflag: bytes, size: int, start: int, max_member_size: int) -> None:
    if typeflag in _REJECTED:
        raise CorruptShard(
            f"tar member {name[:100]!r} at byte {start} is {_REJECTED[typeflag]}; shards hold regular files only"
        )
    if size > max_member_size:
        raise CorruptShard(f"tar member {name[:100]!r} at byte {start} claims {size} bytes (limit {max_member_size})")


def iter_members(
    source: Source,
    *,
    data: bool = True,
    max_member_size: int = MAX_MEMBER_SIZE,
    base_offset: int = 0,
    views: bool = False,
) -> Iterator[TarMember]:
    """The regular files of a tar, in order, checked as the module docstring says.

    `source` is a buffer, a binary file or an iterator of byte chunks. With `data=False` the data is
    skipped, seeked over when the file can seek, and `TarMember.data` is None. With `views`, a
    buffer's members are memoryviews of it, not copies. Directories and pax global headers are
    passed over. The walk ends at the first all-zero block, or cleanly at the end
    of the input on a block boundary.
    """
    reader = _Reader(source)
    read, skip = reader.read, reader.skip
    # The closures refer to the reader. Without its own references to them there is no cycle,
    # so a buffer, such as a mapped shard, goes when the walk does, not when the GC runs.
    reader.read = reader.skip = None
    first_header: int | None = None
    long_name: bytes | None = None
    pax: dict[str, bytes] | None = None
    while True:
        offset = base_offset + reader.position
        block = read(BLOCK)
        if len(block) < BLOCK:
            if block or first_header is not None:
                raise CorruptShard(f"tar truncated at byte {offset + len(block)}: a header is cut off")
            return
        if block == _ZERO_BLOCK:
            return
        _check_header(block, offset)
        typeflag = block[156:157]
        size = _number(block[124:136], "size", offset)
        if first_header is None:
            first_header = offset
        if typeflag in _EXTENDED:
            if size > _MAX_EXTENDED_HEADER:
                raise CorruptShard(f"tar header at byte {offset}: extended header of {size} bytes")
            payload = read(size + (-size % BLOCK))
            if len(payload) < size:
                raise CorruptShard(f"tar truncated at byte {base_offset + reader.position}: extended header cut off")
            if typeflag == b"L":
                long_name = payload[:size].split(b"\0", 1)[0]
            elif typeflag == b"x":
                pax = _parse_pax(payload[:size], offset)
            continue  # `g` (global) and `K` (long link name) change nothing we keep
        name, size = _name_and_size(block, size, long_name, pax, offset)
        member_start, first_header, long_name, pax = first_header, None, None, None
        _check_member(name, typeflag, size, member_start, max_member_size)
        pad = -size % BLOCK
        data_offset = base_offset + reader.position
        if reader.length is not None and reader.position + size + pad > reader.length:
            # Skipped data (a seek) would not notice the end; the known length does.
            raise CorruptShard(f"tar truncated at byte {base_offset + reader.length}: {name[:100]!r} is cut off")
        if typeflag == b"5":
            skip(size + pad)
            continue
        if typeflag not in _REGULAR:
            raise CorruptShard(f"tar member {name[:100]!r} at byte {member_start} has unknown type {typeflag!r}")
        if data:
            payload = reader.view(size) if views and reader.in_memory else read(size)
            if reader.in_memory:  # a buffer cannot shrink: the check above saw the padding there
                skip(pad)
            if len(payload) < size or (not reader.in_memory and len(read(pad)) < pad):
                raise CorruptShard(f"tar truncated after byte {data_offset + len(payload)}: {name[:100]!r} is cut off")
            yield TarMember(name, member_start, data_offset, size, payload)
        else:
            skip(size + pad)
            yield TarMember(name, member_start, data_offset, size, None)


def iter_samples_with_spans(
    source: Source, *, max_member_size: int = MAX_MEMBER_SIZE, views: bool = False
) -> Iterator[tuple[dict, SampleSpan]]:
    """Samples grouped by key, each with the byte span it occupies in the tar. With `views`, see
    `iter_members`."""
    sample: dict = {}
    key = None
    start = end = 0
    for member in iter_members(source, max_member_size=max_member_size, views=views):
        if _META_RE.match(member.name):
            continue
        parts = split_member_name(member.name)
        if parts is None:  # no extension: not part of any sample (webdataset skips it too)
            continue
        member_key, ext = parts
        if member_key != key:
            if sample:
                yield sample, SampleSpan(start, end - start)
            sample, key, start = {"__key__": member_key}, member_key, member.offset
        elif ext in sample:
            raise CorruptShard(f"sample {member_key!r} has two {ext!r} members (at byte {member.offset})")
        sample[ext] = member.data
        end = member.data_offset + member.size + (-member.size % BLOCK)
    if sample:
        yield sample, SampleSpan(start, end - start)


def iter_samples(source: Source, *, max_member_size: int = MAX_MEMBER_SIZE) -> Iterator[dict]:
    """Stream the samples of a shard: `{"__key__": "00000042", "jpg": b"...", "cls": b"7"}`.

    `source` is the shard's bytes, a binary file, or an iterator of chunks such as
    `store.get(key)`. Raises `CorruptShard` on anything unsafe or malformed.

    >>> for sample in iter_samples(open("shard-000000.tar", "rb")):   # doctest: +SKIP
    ...     image, label = sample["jpg"], int(sample["cls"])
    """
    for sample, _ in iter_samples_with_spans(source, max_member_size=max_member_size):
        yield sample


def parse_samples(buffer: bytes | bytearray | memoryview, *, max_member_size: int = MAX_MEMBER_SIZE) -> list[dict]:
    """The samples in a buffer of whole samples, as a ranged GET of `SampleIndex.run` returns."""
    return list(iter_samples(buffer, max_member_size=max_member_size))


def read_sample(buffer: bytes | bytearray | memoryview, span: SampleSpan | None = None, *, views: bool = False) -> dict:
    """One sample: from a buffer of exactly that sample when `span` is None, as `store.get_range`
    returns it. Else from a whole shard's bytes and the sample's `span`. With `views`, its members
    are memoryviews of `buffer`, for a buffer that outlives the sample, such as a mapped shard."""
    if span is not None:
        if span.offset < 0 or span.size <= 0 or span.end > len(buffer):
            raise CorruptShard(f"sample span {span} lies outside a {len(buffer)}-byte shard")
        plain = None if tar_headers is None else tar_headers.sample_members(buffer, span.offset, span.size)
        if plain is not None:  # the C walk's answer is this reader's, some 40 times sooner
            whole = memoryview(buffer)
            sample = {"__key__": plain[0]}
            for ext, start, stop in plain[1]:
                sample[ext] = whole[start:stop] if views else whole[start:stop].tobytes()
            return sample
        buffer = memoryview(buffer)[span.offset : span.end]
    samples = [sample for sample, _ in iter_samples_with_spans(buffer, views=views)]
    if len(samples) != 1:
        raise CorruptShard(f"expected one sample in the span, found {len(samples)}")
    return samples[0]


def release_views(samples: list[dict | None]) -> None:
    """Release the memoryviews among the samples' members, as `read_sample(views=True)` makes.
    A released view no longer keeps its buffer: an unlinked mapped file's disk space returns
    even while something, such as an error's traceback, still refers to the sample. A view a
    consumer still exports stays."""
    for sample in samples:
        for value in (sample or {}).values():
            if isinstance(value, memoryview):
                with contextlib.suppress(BufferError):
                    value.release()


def read_sample_from_file(file: BinaryIO, span: SampleSpan) -> dict:
    """One sample of a local shard file, read with one `pread`, so it is thread- and fork-safe."""
    try:
        data = os.pread(file.fileno(), span.size, span.offset)
    except (AttributeError, io.UnsupportedOperation):
        file.seek(span.offset)
        data = file.read(span.size)
    if len(data) != span.size:
        raise CorruptShard(f"shard ends before sample span {span}")
    return read_sample(data)


def scan_shard(
    source: Source,
    *,
    on_sample: Callable[[dict], None] | None = None,
    max_member_size: int = MAX_MEMBER_SIZE,
    sample_digests: bool = False,
    checksum_algorithm: str = DEFAULT_ALGORITHM,
) -> SampleIndex:
    """Walk a whole shard, a stream being fine, and build its `SampleIndex`. It hashes the shard on
    the way with `checksum_algorithm` (`dlstore.format.checksums`).

    `on_sample` sees each sample, to collect labels and fields or to decode it. With
    `sample_digests`, the index is version 2 and holds each sample's digest too. Those are hashed as
    the bytes stream past; only the samples not hashed yet are kept.
    """
    digest = new_hasher(checksum_algorithm)
    size = 0
    pending, pending_at, digests = bytearray(), 0, []  # bytes from pending_at on, not yet hashed

    def hashed(chunks: Iterable[bytes]) -> Iterator[bytes]:
        nonlocal size
        for chunk in chunks:
            digest.update(chunk)
            size += len(chunk)
            if sample_digests:
                pending.extend(chunk)
            yield chunk

    def digest_sample(start: int, end: int) -> None:
        nonlocal pending_at
        digests.append(sample_digest(pending[start - pending_at : end - pending_at]))
        del pending[: end - pending_at]
        pending_at = end

    if isinstance(source, (bytes, bytearray, memoryview)):
        stream: Iterator[bytes] = iter([bytes(source)])
    elif hasattr(source, "read"):
        stream = iter(lambda: source.read(1 << 20), b"")  # type: ignore[union-attr]
    else:
        stream = iter(source)  # type: ignore[arg-type]
    chunks = hashed(stream)
    offsets: list[int] = []
    end = 0
    for sample, span in iter_samples_with_spans(chunks, max_member_size=max_member_size):
        if sample_digests and offsets:
            digest_sample(offsets[-1], span.offset)
        offsets.append(span.offset)
        end = span.end
        if on_sample is not None:
            on_sample(sample)
    if sample_digests and offsets:
        digest_sample(offsets[-1], end)
    for _ in chunks:  # the end-of-archive blocks and record padding count towards the checksum
        pass
    index = SampleIndex(offsets + [end], size, digest_field(f"{checksum_algorithm}:{digest.hexdigest()}"))
    return index.with_sample_digests(digests) if sample_digests else index


def read_shard_index(path: str | os.PathLike[str]) -> SampleIndex:
    """The sample index of a local shard file. It is `<shard>.idx` beside it when that exists and
    matches the file's size. Else it comes from walking the tar's headers, seeking over data.
    Such an index has a zero checksum. The node cache keeps the indexes it walks
    (`dlstore.read.indexes`)."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    beside = path[:-4] + ".idx" if path.endswith(".tar") else path + ".idx"
    if os.path.exists(beside):
        with open(beside, "rb") as file:
            index = SampleIndex.from_bytes(file.read())
        if index.shard_size == size:
            return index
    offsets: list[int] = []
    key = None
    end = 0
    with open(path, "rb", buffering=0) as file:
        for member in iter_members(file, data=False):
            parts = None if _META_RE.match(member.name) else split_member_name(member.name)
            if parts is None:
                continue
            if parts[0] != key:
                offsets.append(member.offset)
                key = parts[0]
            end = member.data_offset + member.size + (-member.size % BLOCK)
    return SampleIndex(offsets + [end], size)
