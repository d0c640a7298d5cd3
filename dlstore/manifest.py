"""The dataset manifest (`index.json`) and the per-shard sample index (`*.idx`).

A dataset is a store prefix holding tar shards, one sample index beside each shard, and
`index.json` at the root. Readers start from the manifest: no bucket listing at start-up.

`index.json` (UTF-8 JSON, keys sorted)::

    {
      "format": "dlstore-dataset",
      "format_version": 1,
      "checksum_algorithm": "sha256",
      "total_samples": 1281167,
      "total_size": 147897477120,                      # bytes, all shards
      "classes": ["n01440764", "n01443537", ...],      # label i is classes[i]; [] if unlabelled
      "label_field": "cls",                            # null if unlabelled
      "fields": ["cls", "jpg", "json"],                # member extensions seen in the shards
      "shards": [
        {"name": "shard-000000.tar", "size": 256000512, "samples": 2298,
         "checksum": "sha256:<64 hex>",
         "index": "shard-000000.idx", "index_size": 18480, "index_checksum": "sha256:<64 hex>"},
        ...
      ],
      "created": {"tool": "dlstore convert", "tool_version": "0.1.0", "source_format": "imagenet",
                  "source": "ILSVRC2012_img_train.tar", "split": "train", "seed": 0,
                  "options": {...}},
      "extra": {}                                      # free-form, kept as is
    }

Checksums are SHA-256 (hashlib's is the fastest strong hash on CPUs with SHA extensions:
~1.8 GB/s on one core here, against ~1.2 GB/s for BLAKE2b), written as `"sha256:<hex>"`.

Sample index (`shard-000000.idx`, little-endian, 88-byte header, `n + 1` offsets, and in
version 2 `n` sample digests)::

    0   8   magic b"DLSIDX02" (version 2) or b"DLSIDX01" (version 1: no sample digests)
    8   8   uint64  n, the number of samples
    16  8   uint64  the shard's size in bytes
    24  32  SHA-256 digest of the shard
    56  32  recipe: SHA-256 of what the shard was built from (zeros when unknown)
    88  8(n+1)  uint64 offsets: sample i is the bytes [offsets[i], offsets[i+1]) of the shard,
            from its first tar header to the end of its last member's padding;
            offsets[n] is where the last sample ends (the end-of-archive blocks follow)
    .   16n     version 2 only: the first 16 bytes of the SHA-256 of each sample's bytes
            [offsets[i], offsets[i+1]) (`sample_digest`)

Samples i..j-1 are therefore one ranged GET of `[offsets[i], offsets[j])`, which
`dlstore.shards.parse_samples` turns back into samples. The recipe lets an interrupted
conversion recognise a finished shard without reading it again.

Why per-sample digests: the shard's checksum verifies a whole shard only, so a cache that
fetches part of a shard (a node's share of a shard it splits with its neighbour,
`dlstore.cache.partial`) could not verify what it fetched. With version 2 each sample of a
range is checked on its own; the index itself is trusted through the manifest's
`index_checksum`. 16 bytes of SHA-256 per sample (2^-128 odds of missing a damaged one) add
~20 MB to ImageNet's indexes (1.28 M samples), next to its 147 GB of shards. `dlstore
convert` and `dlstore index` write version 2; readers accept both, and a version 1 index
only means that its shard is always fetched whole.

>>> m = Manifest.load(open_store("file:///data/imagenet/train"))      # doctest: +SKIP
>>> m.total_samples, len(m.shards), m.classes[:2]                     # doctest: +SKIP
(1281167, 578, ('n01440764', 'n01443537'))
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dlstore.config import format_size
from dlstore.errors import FormatError

__all__ = [
    "CHECKSUM_ALGORITHM",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "CreationInfo",
    "Manifest",
    "SampleIndex",
    "SampleSpan",
    "ShardInfo",
    "checksum_of",
    "describe_dataset",
    "index_name",
    "load_sample_index",
    "sample_digest",
]

MANIFEST_NAME = "index.json"
FORMAT = "dlstore-dataset"
FORMAT_VERSION = 1
CHECKSUM_ALGORITHM = "sha256"
INDEX_SUFFIX = ".idx"
SAMPLE_DIGEST_SIZE = 16

_CHECKSUM_RE = re.compile(r"sha256:[0-9a-f]{64}\Z")
_FIELD_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")


def checksum_of(data: bytes | bytearray | memoryview) -> str:
    """`"sha256:<hex>"` of `data`: the form the manifest stores.

    >>> checksum_of(b"")[:15]
    'sha256:e3b0c442'
    """
    return f"{CHECKSUM_ALGORITHM}:{hashlib.sha256(data).hexdigest()}"


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


# -- the per-shard sample index ------------------------------------------------------------
@dataclass(frozen=True)
class SampleSpan:
    """Bytes `[offset, offset + size)` of a shard: one sample, or a run of samples."""

    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size


class SampleIndex:
    """Where each sample of one shard starts and ends, and (version 2) each sample's digest;
    see the module docstring for the file.

    >>> index = SampleIndex([0, 2048, 5120], shard_size=6144)
    >>> len(index), index[1], index.run(0, 2), index.version
    (2, SampleSpan(offset=2048, size=3072), SampleSpan(offset=0, size=5120), 1)
    """

    MAGIC = b"DLSIDX02"
    MAGIC_V1 = b"DLSIDX01"
    _HEADER = struct.Struct("<8sQQ32s32s")

    __slots__ = ("offsets", "shard_size", "sha256", "recipe", "sample_digests")

    def __init__(
        self,
        offsets: Sequence[int] | np.ndarray,
        shard_size: int,
        sha256: bytes = bytes(32),
        recipe: bytes = bytes(32),
        sample_digests: bytes | None = None,
    ) -> None:
        array = np.array(offsets, dtype=np.int64)
        if array.ndim != 1 or array.size < 1:
            raise FormatError("a sample index needs at least one offset (the end of the last sample)")
        if len(sha256) != 32 or len(recipe) != 32:
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
        self.sha256 = bytes(sha256)
        self.recipe = bytes(recipe)
        self.sample_digests = None if sample_digests is None else bytes(sample_digests)

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
        return f"{CHECKSUM_ALGORITHM}:{self.sha256.hex()}"

    @classmethod
    def file_size(cls, samples: int, version: int) -> int:
        """The bytes of an index file of `samples` samples in `version` (1 or 2): the manifest's
        `index_size` tells an index's version without fetching it (`describe_dataset`).

        >>> SampleIndex.file_size(3, 1), SampleIndex.file_size(3, 2)
        (120, 168)
        """
        return cls._HEADER.size + 8 * (samples + 1) + (SAMPLE_DIGEST_SIZE * samples if version >= 2 else 0)

    @property
    def version(self) -> int:
        """The file format this index is written in: 2 with sample digests, 1 without."""
        return 1 if self.sample_digests is None else 2

    def digest(self, i: int) -> bytes:
        """Sample i's digest (`sample_digest` of its bytes); `FormatError` for a version 1 index."""
        if self.sample_digests is None:
            raise FormatError("a version 1 sample index has no sample digests")
        self[i]  # bounds check
        i %= len(self)
        return self.sample_digests[SAMPLE_DIGEST_SIZE * i : SAMPLE_DIGEST_SIZE * (i + 1)]

    def with_sample_digests(self, digests: Iterable[bytes]) -> SampleIndex:
        """This index with each sample's digest (in sample order): a version 2 index."""
        return SampleIndex(self.offsets, self.shard_size, self.sha256, self.recipe, b"".join(digests))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, SampleIndex)
            and self.shard_size == other.shard_size
            and self.sha256 == other.sha256
            and self.recipe == other.recipe
            and self.sample_digests == other.sample_digests
            and np.array_equal(self.offsets, other.offsets)
        )

    def __repr__(self) -> str:
        return f"SampleIndex({len(self)} samples, shard_size={self.shard_size}, version={self.version})"

    def to_bytes(self) -> bytes:
        """The index file: version 2 with sample digests, else version 1."""
        magic = self.MAGIC_V1 if self.sample_digests is None else self.MAGIC
        header = self._HEADER.pack(magic, len(self), self.shard_size, self.sha256, self.recipe)
        return header + self.offsets.astype("<u8").tobytes() + (self.sample_digests or b"")

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> SampleIndex:
        """Parse and validate an index file (version 1 or 2); anything malformed is a `FormatError`."""
        data = bytes(data)
        size = cls._HEADER.size
        if len(data) < size + 8:
            raise FormatError(f"a sample index is at least {size + 8} bytes, this one has {len(data)}")
        magic, count, shard_size, sha256, recipe = cls._HEADER.unpack_from(data)
        if magic not in (cls.MAGIC, cls.MAGIC_V1):
            # A later version keeps the prefix: say so, or the index reads as foreign or damaged.
            newer = "; made by a newer dlstore: upgrade it" if magic[:6] == cls.MAGIC[:6] and magic > cls.MAGIC else ""
            raise FormatError(
                f"not a dlstore sample index (magic {magic!r}, expected {cls.MAGIC!r} or {cls.MAGIC_V1!r}){newer}"
            )
        per_sample = 8 + (SAMPLE_DIGEST_SIZE if magic == cls.MAGIC else 0)
        if len(data) != size + 8 + per_sample * count:
            raise FormatError(f"sample index says {count} samples but holds {(len(data) - size - 8) / per_sample:g}")
        if shard_size >= 2**62:
            raise FormatError(f"sample index gives an impossible shard size {shard_size}")
        end = size + 8 * (count + 1)
        offsets = np.frombuffer(data, dtype="<u8", offset=size, count=count + 1)
        if np.any(offsets >= 2**62):
            raise FormatError("sample index has an impossible offset")
        digests = data[end:] if magic == cls.MAGIC else None
        return cls(offsets.astype(np.int64), shard_size, sha256, recipe, digests)


def load_sample_index(store, shard: ShardInfo) -> SampleIndex:
    """Fetch the sample index of one shard of a manifest, and check it against the manifest
    (its checksum when the manifest has one, and the shard's size, samples and checksum)."""
    if shard.index is None:
        raise FormatError(f"shard {shard.name!r} has no sample index in the manifest")
    data = store.get_bytes(shard.index)
    if shard.index_checksum is not None and checksum_of(data) != shard.index_checksum:
        # The sample digests are only as trustworthy as the index: check it against the manifest.
        raise FormatError(
            f"sample index {shard.index!r} fails its checksum: {checksum_of(data)[:19]}…, "
            f"manifest {shard.index_checksum[:19]}…"
        )
    index = SampleIndex.from_bytes(data)
    if len(index) != shard.samples or index.shard_size != shard.size or index.checksum != shard.checksum:
        raise FormatError(
            f"sample index {shard.index!r} describes a shard of {index.shard_size} bytes and {len(index)} samples "
            f"(checksum {index.checksum[:19]}…), the manifest one of {shard.size} bytes and {shard.samples} samples"
        )
    return index


# -- the manifest ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardInfo:
    """One shard: its key relative to the dataset root, size in bytes, samples, checksum."""

    name: str
    size: int
    samples: int
    checksum: str
    index: str | None = None
    index_size: int | None = None
    index_checksum: str | None = None


@dataclass(frozen=True)
class CreationInfo:
    """How the dataset was made: the tool, its version and the options that shaped the bytes."""

    tool: str = "dlstore"
    tool_version: str = ""
    source_format: str = ""
    source: str = ""
    split: str = ""
    seed: int | None = None
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Manifest:
    """The dataset manifest; see the module docstring for the JSON.

    >>> m = Manifest(shards=(ShardInfo("a.tar", 2048, 1, checksum_of(b"x")),), classes=("cat",),
    ...              fields=("cls", "jpg"), label_field="cls")
    >>> Manifest.from_json(m.to_json()) == m
    True
    """

    shards: tuple[ShardInfo, ...]
    classes: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    label_field: str | None = None
    created: CreationInfo = field(default_factory=CreationInfo)
    extra: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "shards", tuple(self.shards))
        object.__setattr__(self, "classes", tuple(self.classes))
        object.__setattr__(self, "fields", tuple(sorted(self.fields)))

    @property
    def total_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def total_size(self) -> int:
        return sum(s.size for s in self.shards)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def shard(self, name: str) -> ShardInfo:
        for info in self.shards:
            if info.name == name:
                return info
        raise KeyError(name)

    def with_shards(self, shards: Iterable[ShardInfo]) -> Manifest:
        return replace(self, shards=tuple(shards))

    # -- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": self.format_version,
            "checksum_algorithm": CHECKSUM_ALGORITHM,
            "total_samples": self.total_samples,
            "total_size": self.total_size,
            "classes": list(self.classes),
            "label_field": self.label_field,
            "fields": list(self.fields),
            "shards": [
                {k: v for k, v in vars(s).items() if v is not None or k in ("name", "size", "samples", "checksum")}
                for s in self.shards
            ],
            "created": {
                "tool": self.created.tool,
                "tool_version": self.created.tool_version,
                "source_format": self.created.source_format,
                "source": self.created.source,
                "split": self.created.split,
                "seed": self.created.seed,
                "options": self.created.options,
            },
            "extra": self.extra,
        }

    def to_json(self) -> bytes:
        return (json.dumps(self.to_dict(), indent=1, sort_keys=True, allow_nan=False) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> Manifest:
        """Parse and validate; anything unexpected is a `FormatError` that says what and where."""
        try:
            raw = json.loads(data, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise FormatError(f"{MANIFEST_NAME} is not valid JSON: {exc}") from None
        return _parse_manifest(raw)

    @classmethod
    def load(cls, store, key: str = MANIFEST_NAME) -> Manifest:
        """Read the manifest at the root of `store` (`NotFound` if there is none)."""
        return cls.from_json(store.get_bytes(key))

    def save(self, store, key: str = MANIFEST_NAME) -> None:
        """Write the manifest; converters call this last, once every shard is in place."""
        store.put(key, self.to_json())


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


# -- validation -----------------------------------------------------------------------------
def _require_object(value: Any, where: str, required: set[str], optional: set[str]) -> dict:
    if not isinstance(value, dict):
        raise FormatError(f"{where}: expected a JSON object, found {_kind(value)}")
    missing = required - value.keys()
    if missing:
        raise FormatError(f"{where}: missing {', '.join(sorted(missing))}")
    unknown = value.keys() - required - optional
    if unknown:
        raise FormatError(f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
    return value


def _kind(value: Any) -> str:
    names = {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
    }
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _int(value: Any, where: str, minimum: int = 0) -> int:
    if type(value) is not int:  # bool is an int subclass: exclude it
        raise FormatError(f"{where}: expected an integer, found {_kind(value)}")
    if value < minimum or value >= 2**62:
        raise FormatError(f"{where}: {value} is out of range")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise FormatError(f"{where}: expected a string, found {_kind(value)}")
    return value


def _key(value: Any, where: str) -> str:
    text = _str(value, where)
    parts = text.split("/")
    if not text or text.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in text or "\0" in text:
        raise FormatError(f"{where}: {text!r} is not a relative object key")
    return text


def _checksum(value: Any, where: str) -> str:
    text = _str(value, where)
    if not _CHECKSUM_RE.match(text):
        raise FormatError(f"{where}: expected 'sha256:' and 64 lowercase hex digits, found {text[:80]!r}")
    return text


def _str_list(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise FormatError(f"{where}: expected a list, found {_kind(value)}")
    items = tuple(_str(v, f"{where}[{i}]") for i, v in enumerate(value))
    if len(set(items)) != len(items):
        raise FormatError(f"{where}: holds duplicates")
    return items


_SHARD_REQUIRED = {"name", "size", "samples", "checksum"}
_SHARD_OPTIONAL = {"index", "index_size", "index_checksum"}
_TOP_REQUIRED = {"format", "format_version", "checksum_algorithm", "shards", "fields", "classes"}
_TOP_OPTIONAL = {"total_samples", "total_size", "label_field", "created", "extra"}
_CREATED = {"tool", "tool_version", "source_format", "source", "split", "seed", "options"}


def _parse_shard(value: Any, where: str) -> ShardInfo:
    raw = _require_object(value, where, _SHARD_REQUIRED, _SHARD_OPTIONAL)
    index = raw.get("index")
    return ShardInfo(
        name=_key(raw["name"], f"{where}.name"),
        size=_int(raw["size"], f"{where}.size"),
        samples=_int(raw["samples"], f"{where}.samples"),
        checksum=_checksum(raw["checksum"], f"{where}.checksum"),
        index=None if index is None else _key(index, f"{where}.index"),
        index_size=None if raw.get("index_size") is None else _int(raw["index_size"], f"{where}.index_size"),
        index_checksum=None
        if raw.get("index_checksum") is None
        else _checksum(raw["index_checksum"], f"{where}.index_checksum"),
    )


def _parse_created(value: Any) -> CreationInfo:
    if value is None:
        return CreationInfo()
    raw = _require_object(value, "created", set(), _CREATED)
    options = raw.get("options", {})
    if not isinstance(options, dict):
        raise FormatError(f"created.options: expected an object, found {_kind(options)}")
    seed = raw.get("seed")
    return CreationInfo(
        tool=_str(raw.get("tool", ""), "created.tool"),
        tool_version=_str(raw.get("tool_version", ""), "created.tool_version"),
        source_format=_str(raw.get("source_format", ""), "created.source_format"),
        source=_str(raw.get("source", ""), "created.source"),
        split=_str(raw.get("split", ""), "created.split"),
        seed=None if seed is None else _int(seed, "created.seed"),
        options=options,
    )


def _parse_manifest(raw: Any) -> Manifest:
    raw = _require_object(raw, MANIFEST_NAME, _TOP_REQUIRED, _TOP_OPTIONAL)
    if raw["format"] != FORMAT:
        raise FormatError(f"{MANIFEST_NAME}: format is {str(raw['format'])[:60]!r}, expected {FORMAT!r}")
    version = _int(raw["format_version"], "format_version")
    if version != FORMAT_VERSION:
        newer = " (made by a newer dlstore; upgrade)" if version > FORMAT_VERSION else ""
        raise FormatError(
            f"{MANIFEST_NAME}: format_version {version} is not supported{newer}; this dlstore reads {FORMAT_VERSION}"
        )
    if raw["checksum_algorithm"] != CHECKSUM_ALGORITHM:
        raise FormatError(
            f"checksum_algorithm: {str(raw['checksum_algorithm'])[:40]!r} is not supported, expected 'sha256'"
        )
    if not isinstance(raw["shards"], list):
        raise FormatError(f"shards: expected a list, found {_kind(raw['shards'])}")
    shards = tuple(_parse_shard(s, f"shards[{i}]") for i, s in enumerate(raw["shards"]))
    names = [s.name for s in shards] + [s.index for s in shards if s.index is not None]
    if len(set(names)) != len(names):
        raise FormatError("shards: two shards (or indexes) share a name")
    fields = _str_list(raw["fields"], "fields")
    for name in fields:
        if not _FIELD_RE.match(name):
            raise FormatError(f"fields: {name[:40]!r} is not a member extension")
    classes = _str_list(raw["classes"], "classes")
    label_field = raw.get("label_field")
    if label_field is not None:
        label_field = _str(label_field, "label_field")
    if label_field is not None and label_field not in fields:
        raise FormatError(f"label_field: {label_field[:40]!r} is not one of the fields {list(fields)}")
    extra = raw.get("extra", {})
    if not isinstance(extra, dict):
        raise FormatError(f"extra: expected an object, found {_kind(extra)}")
    manifest = Manifest(
        shards=shards,
        classes=classes,
        fields=fields,
        label_field=label_field,
        created=_parse_created(raw.get("created")),
        extra=extra,
        format_version=version,
    )
    for name, actual in (("total_samples", manifest.total_samples), ("total_size", manifest.total_size)):
        if name in raw and _int(raw[name], name) != actual:
            raise FormatError(f"{name}: says {raw[name]}, but the shards add up to {actual}")
    return manifest


# -- summary for `dlstore ls` ----------------------------------------------------------------


def _describe_options(options: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(options.items()) if v not in (None, False, ""))


def describe_dataset(store) -> str:
    """A few lines about the dataset at the root of `store`, from its manifest.

    >>> print(describe_dataset(open_store("file:///data/cifar10/train")))   # doctest: +SKIP
    file:///data/cifar10/train: dlstore dataset, format 1
      samples  50,000 in 4 shards, 119.4 MB (2.4 KB per sample)
      ...
    """
    m = Manifest.load(store)
    n, size = m.total_samples, m.total_size
    lines = [f"{store.url}: dlstore dataset, format {m.format_version}"]
    per_sample = f" ({format_size(size / n)} per sample)" if n else ""
    lines.append(f"  samples  {n:,} in {len(m.shards)} shards, {format_size(size)}{per_sample}")
    if m.classes:
        shown = ", ".join(m.classes[:5]) + (", …" if len(m.classes) > 5 else "")
        lines.append(f"  classes  {len(m.classes)}: {shown}")
    else:
        lines.append("  classes  none (unlabelled)")
    lines.append(f"  fields   {', '.join(m.fields) or '-'}" + (f" (label: {m.label_field})" if m.label_field else ""))
    if m.shards:
        sizes = [s.size for s in m.shards]
        first, last = m.shards[0].name, m.shards[-1].name
        span = first if len(m.shards) == 1 else f"{first} … {last}"
        lines.append(f"  shards   {span}; {format_size(min(sizes))} to {format_size(max(sizes))}")
        indexed = sum(1 for s in m.shards if s.index)
        if indexed < len(m.shards):
            lines.append(f"  indexes  {indexed} of {len(m.shards)} shards have a sample index")
        old = sum(1 for s in m.shards if s.index and s.samples and s.index_size == SampleIndex.file_size(s.samples, 1))
        if old:
            # Why it matters: a node then fetches such a shard whole where it needs only part of it.
            lines.append(
                f"  indexes  {old} of {len(m.shards)} are version 1 (no sample digests: boundary shards are "
                "fetched whole); `dlstore convert` again, or `dlstore index`, upgrades them"
            )
    c = m.created
    made = " ".join(x for x in (c.tool, c.tool_version) if x) or "unknown"
    source = " ".join(x for x in (c.source_format, c.source, f"split={c.split}" if c.split else "") if x)
    lines.append(
        f"  made by  {made}"
        + (f" from {source}" if source else "")
        + (f", seed {c.seed}" if c.seed is not None else "")
    )
    if c.options:
        lines.append(f"  options  {_describe_options(c.options)}")
    return "\n".join(lines)
