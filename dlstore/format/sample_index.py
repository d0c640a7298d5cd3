"""The per-shard sample index, `shard-000000.idx`: where each sample of a shard starts and ends.
From version 2 on it also holds each sample's digest. It sits beside its shard. The manifest
(`dlstore.format.manifest`) names it and holds its size and checksum.

File layout, little-endian: an 88-byte header, `n + 1` offsets, and from version 2 on `n` sample
digests::

    0   8   magic b"DLSIDX03" (version 3), b"DLSIDX02" (version 2) or b"DLSIDX01" (version 1:
            no sample digests)
    8   8   uint64  n, the number of samples
    16  8   uint64  the shard's size in bytes
    24  32  the shard's digest (`shard_digest`). Versions 1 and 2: SHA-256's 32 bytes.
            Version 3: XXH3-128's 16 bytes, b"xxh3_128" and 8 zero bytes.
    56  32  recipe: SHA-256 of what the shard was built from, zeros when unknown
    88  8(n+1)  uint64 offsets: sample i is the bytes [offsets[i], offsets[i+1]) of the shard,
            from its first tar header to the end of its last member's padding.
            offsets[n] is where the last sample ends; the end-of-archive blocks follow.
    .   16n     the first 16 bytes of the SHA-256 of each sample's bytes (`sample_digest`).
            Version 2 has them, and so does version 3 as `convert` and `index` write it.
            A node cache keeps version 3 indexes without them; the file's size tells.

Samples i..j-1 are one ranged GET of `[offsets[i], offsets[j])`.
`dlstore.format.shards.parse_samples` turns those bytes back into samples. The recipe lets an
interrupted conversion recognise a finished shard without reading it again.

Why per-sample digests: the shard's checksum verifies a whole shard only. A cache that fetches part
of a shard (`dlstore.cache.download`) checks each sample of its range on its own. The index itself
is trusted through the manifest's `index_checksum`. `dlstore convert` and `dlstore index` write
version 3, or version 2 with `--checksum sha256`. Readers accept all three. A version 1 index only
means that its shard is always fetched whole.

Why version 3: its layout is version 2's. But a reader that knows only SHA-256 would take an XXH3
digest for the first half of a SHA-256 one. The new magic makes it refuse the index instead, and a
conversion then rebuilds the shard. A version 2 index with an XXH3 digest is still read. The next
`convert` that keeps its shard rewrites it as version 3.

The shard's digest names its algorithm (`digest_field`), so an index never passes for another
algorithm's. The tag after an XXH3 digest stands where a SHA-256 digest has 16 more bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from dlstore.errors import ConfigError, FormatError
from dlstore.format.checksums import ALGORITHMS, parse_checksum

__all__ = [
    "SampleIndex",
    "SampleSpan",
    "digest_field",
    "index_name",
    "sample_digest",
]

INDEX_SUFFIX = ".idx"
SAMPLE_DIGEST_SIZE = 16
_DIGEST_FIELD = 32
_TAGS = {name: name.encode().ljust(_DIGEST_FIELD - size, b"\0") for name, size in ALGORITHMS.items() if size < 32}


def digest_field(checksum: str) -> bytes:
    """The 32 bytes a sample index holds for the shard checksum `checksum`. A `ConfigError` for one
    not of `checksums.ALGORITHMS`.

    >>> digest_field("xxh3_128:" + "ab" * 16).hex()[32:]
    '787868335f3132380000000000000000'
    """
    algorithm, hexdigest = parse_checksum(checksum)
    return bytes.fromhex(hexdigest) + _TAGS.get(algorithm, b"")


def _field_checksum(field: bytes) -> str:
    for algorithm, tag in _TAGS.items():
        if field.endswith(tag):
            return f"{algorithm}:{field[: ALGORITHMS[algorithm]].hex()}"
    return f"sha256:{field.hex()}"


def sample_digest(data: bytes | bytearray | memoryview) -> bytes:
    """A sample's digest in a version 2 sample index: the first 16 bytes of its SHA-256.

    >>> sample_digest(b"").hex()
    'e3b0c44298fc1c149afbf4c8996fb924'
    """
    return hashlib.sha256(data).digest()[:SAMPLE_DIGEST_SIZE]


def index_name(shard_name: str) -> str:
    """The sample index's key beside a shard: `shard-000000.tar` → `shard-000000.idx`.

    >>> index_name("train/shard-000012.tar")
    'train/shard-000012.idx'
    """
    stem = shard_name[:-4] if shard_name.endswith(".tar") else shard_name
    return stem + INDEX_SUFFIX


@dataclass(frozen=True)
class SampleSpan:
    """Bytes `[offset, offset + size)` of a shard: one sample, or a run of samples."""

    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size


class SampleIndex:
    """Where each sample of one shard starts and ends, and from version 2 on each sample's digest.
    The module docstring describes the file.

    >>> index = SampleIndex([0, 2048, 5120], shard_size=6144)
    >>> len(index), index[1], index.run(0, 2), index.version
    (2, SampleSpan(offset=2048, size=3072), SampleSpan(offset=0, size=5120), 1)
    """

    MAGIC = b"DLSIDX03"
    MAGIC_V2 = b"DLSIDX02"
    MAGIC_V1 = b"DLSIDX01"
    _HEADER = struct.Struct("<8sQQ32s32s")

    __slots__ = ("offsets", "shard_size", "shard_digest", "recipe", "sample_digests")

    def __init__(
        self,
        offsets: Sequence[int] | np.ndarray,
        shard_size: int,
        shard_digest: bytes = bytes(32),
        recipe: bytes = bytes(32),
        sample_digests: bytes | None = None,
    ) -> None:
        array = np.array(offsets, dtype=np.int64)
        if array.ndim != 1 or array.size < 1:
            raise FormatError("a sample index needs at least one offset (the end of the last sample)")
        if len(shard_digest) != 32 or len(recipe) != 32:
            raise FormatError("a sample index's digests are 32 bytes each")
        if not (int(array[0]) >= 0 and int(array[-1]) <= shard_size):
            raise FormatError(
                f"sample offsets run from {int(array[0])} to {int(array[-1])}, outside a {shard_size}-byte shard"
            )
        if np.any(array % 512) or np.any(np.diff(array) < 512):
            raise FormatError("sample offsets must be multiples of 512, each at least one tar block after the last")
        if sample_digests is not None and len(sample_digests) != SAMPLE_DIGEST_SIZE * (array.size - 1):
            raise FormatError(
                f"a sample index of {array.size - 1} samples needs {SAMPLE_DIGEST_SIZE * (array.size - 1)} bytes "
                f"of sample digests, not {len(sample_digests)}"
            )
        array.flags.writeable = False
        self.offsets = array
        self.shard_size = int(shard_size)
        self.shard_digest = bytes(shard_digest)
        self.recipe = bytes(recipe)
        self.sample_digests = None if sample_digests is None else bytes(sample_digests)
        if self.sample_digests is None and array.size == 1 and self.checksum_algorithm != "sha256":
            # No samples: its version 3 file cannot tell whether it has their digests. A read says
            # it has, and it does have the digests of all of none.
            self.sample_digests = b""

    def __len__(self) -> int:
        return self.offsets.size - 1

    def __getitem__(self, i: int) -> SampleSpan:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} of a shard with {n} samples")
        i %= n
        start = int(self.offsets[i])
        return SampleSpan(start, int(self.offsets[i + 1]) - start)

    def run(self, start: int, stop: int) -> SampleSpan:
        """The byte span of samples `start .. stop-1`: one ranged GET."""
        if not 0 <= start < stop <= len(self):
            raise IndexError(f"samples [{start}, {stop}) of a shard with {len(self)} samples")
        first = int(self.offsets[start])
        return SampleSpan(first, int(self.offsets[stop]) - first)

    @property
    def checksum(self) -> str:
        """The shard's checksum as the manifest writes it: `"sha256:<hex>"` or `"xxh3_128:<hex>"`."""
        return _field_checksum(self.shard_digest)

    @property
    def checksum_algorithm(self) -> str:
        """The algorithm of `checksum`, one of `dlstore.format.checksums`."""
        return self.checksum.partition(":")[0]

    def with_checksum(self, checksum: str) -> SampleIndex:
        """This index for the shard of checksum `checksum`."""
        try:
            field = digest_field(checksum)
        except ConfigError as exc:
            raise FormatError(str(exc)) from None
        return SampleIndex(self.offsets, self.shard_size, field, self.recipe, self.sample_digests)

    @classmethod
    def file_size(cls, samples: int, version: int) -> int:
        """The bytes of an index file of `samples` samples in `version` 1 or 2. So the manifest's
        `index_size` tells an index's version without fetching it (`describe_dataset`).

        >>> SampleIndex.file_size(3, 1), SampleIndex.file_size(3, 2)
        (120, 168)
        """
        return cls._HEADER.size + 8 * (samples + 1) + (SAMPLE_DIGEST_SIZE * samples if version >= 2 else 0)

    @property
    def version(self) -> int:
        """The file format this index is written in. A shard checked with SHA-256 gives 2 with
        sample digests and 1 without. Any other algorithm gives 3; `has_sample_digests` says
        whether it has them."""
        if self.checksum_algorithm != "sha256":
            return 3
        return 1 if self.sample_digests is None else 2

    @property
    def has_sample_digests(self) -> bool:
        """Whether each sample can be checked on its own, as a shard read in part needs."""
        return self.sample_digests is not None

    def digest(self, i: int) -> bytes:
        """Sample i's digest: the `sample_digest` of its bytes. `FormatError` without them."""
        if self.sample_digests is None:
            raise FormatError(f"this sample index (version {self.version}) has no sample digests")
        self[i]  # bounds check
        i %= len(self)
        return self.sample_digests[SAMPLE_DIGEST_SIZE * i : SAMPLE_DIGEST_SIZE * (i + 1)]

    def with_sample_digests(self, digests: Iterable[bytes]) -> SampleIndex:
        """This index with each sample's digest, in sample order: a version 2 index."""
        return SampleIndex(self.offsets, self.shard_size, self.shard_digest, self.recipe, b"".join(digests))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, SampleIndex)
            and self.shard_size == other.shard_size
            and self.shard_digest == other.shard_digest
            and self.recipe == other.recipe
            and self.sample_digests == other.sample_digests
            and np.array_equal(self.offsets, other.offsets)
        )

    def __repr__(self) -> str:
        return f"SampleIndex({len(self)} samples, shard_size={self.shard_size}, version={self.version})"

    def to_bytes(self) -> bytes:
        """The index file, in its `version`."""
        magic = {1: self.MAGIC_V1, 2: self.MAGIC_V2, 3: self.MAGIC}[self.version]
        header = self._HEADER.pack(magic, len(self), self.shard_size, self.shard_digest, self.recipe)
        return header + self.offsets.astype("<u8").tobytes() + (self.sample_digests or b"")

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> SampleIndex:
        """Parse and check an index file of version 1, 2 or 3; a `FormatError` if malformed."""
        data = bytes(data)
        size = cls._HEADER.size
        if len(data) < size + 8:
            raise FormatError(f"a sample index is at least {size + 8} bytes, this one has {len(data)}")
        magic, count, shard_size, shard_digest, recipe = cls._HEADER.unpack_from(data)
        if magic not in (cls.MAGIC, cls.MAGIC_V2, cls.MAGIC_V1):
            # A later version keeps the prefix: say so, or the index reads as foreign or damaged.
            newer = "; made by a newer dlstore: upgrade it" if magic[:6] == cls.MAGIC[:6] and magic > cls.MAGIC else ""
            raise FormatError(
                f"not a dlstore sample index (magic {magic!r}, expected {cls.MAGIC!r}, {cls.MAGIC_V2!r} "
                f"or {cls.MAGIC_V1!r}){newer}"
            )
        # Version 3 has sample digests unless its size says it has none, as a node cache's copy.
        with_digests = magic == cls.MAGIC_V2 or (
            magic == cls.MAGIC and (count == 0 or len(data) != size + 8 + 8 * count)
        )
        per_sample = 8 + (SAMPLE_DIGEST_SIZE if with_digests else 0)
        if len(data) != size + 8 + per_sample * count:
            raise FormatError(f"sample index says {count} samples but holds {(len(data) - size - 8) / per_sample:g}")
        if shard_size >= 2**62:
            raise FormatError(f"sample index gives an impossible shard size {shard_size}")
        end = size + 8 * (count + 1)
        offsets = np.frombuffer(data, dtype="<u8", offset=size, count=count + 1)
        if np.any(offsets >= 2**62):
            raise FormatError("sample index has an impossible offset")
        digests = data[end:] if with_digests else None
        index = cls(offsets.astype(np.int64), shard_size, shard_digest, recipe, digests)
        if magic == cls.MAGIC and index.checksum_algorithm == "sha256":
            raise FormatError("a version 3 sample index holds a SHA-256 shard digest, which version 2 holds")
        return index
