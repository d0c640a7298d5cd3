"""The dataset manifest (`index.json`): what a dataset holds, read before anything else.

A dataset is a store prefix holding tar shards, one sample index beside each shard, and
`index.json` at the root. Readers start from the manifest: no bucket listing at start-up.

`index.json` (UTF-8 JSON, keys sorted)::

    {
      "format": "dlstore-dataset",
      "format_version": 2,                             # 1 where checksum_algorithm is "sha256"
      "checksum_algorithm": "xxh3_128",                # or "sha256": every checksum below uses it
      "total_samples": 1281167,
      "total_size": 147897477120,                      # bytes, all shards
      "classes": ["n01440764", "n01443537", ...],      # label i is classes[i]; [] if unlabelled
      "label_field": "cls",                            # null if unlabelled
      "fields": ["cls", "jpg", "json"],                # member extensions seen in the shards
      "shards": [
        {"name": "shard-000000.tar", "size": 256000512, "samples": 2298,
         "checksum": "xxh3_128:<32 hex>",
         "index": "shard-000000.idx", "index_size": 18480, "index_checksum": "xxh3_128:<32 hex>"},
        ...
      ],
      "created": {"tool": "dlstore convert", "tool_version": "0.1.0", "source_format": "imagenet",
                  "source": "ILSVRC2012_img_train.tar", "split": "train", "seed": 0,
                  "options": {...}},                   # "check_decode": true: every JPEG
                                                       # decoded once (`decode_checked`)
      "extra": {}                                      # free-form, kept as is
    }

Checksums are XXH3-128 or SHA-256, one algorithm per dataset. `dlstore.format.checksums` says
why XXH3 is the default, and when to ask for SHA-256. Format 2 is format 1 with XXH3 allowed. A
dataset checked with SHA-256 is still written as format 1, which every dlstore reads.

Each shard has a sample index beside it, `shard-000000.idx`. `dlstore.format.sample_index`
describes its format; `load_sample_index` here checks one against the manifest.

>>> m = Manifest.load(open_store("file:///data/imagenet/train"))      # doctest: +SKIP
>>> m.total_samples, len(m.shards), m.classes[:2]                     # doctest: +SKIP
(1281167, 578, ('n01440764', 'n01443537'))
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from dlstore.config import format_size
from dlstore.errors import ConfigError, FormatError, NotFound
from dlstore.format.checksums import ALGORITHMS, checksum_of, is_checksum, parse_checksum
from dlstore.format.sample_index import SampleIndex
from dlstore.logs import printable

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "CreationInfo",
    "Manifest",
    "ShardInfo",
    "describe_dataset",
    "load_sample_index",
    "read_index_bytes",
]

MANIFEST_NAME = "index.json"
FORMAT = "dlstore-dataset"
FORMAT_VERSION = 2  # the newest this dlstore reads and writes
_SHA256_ONLY_VERSION = 1

_FIELD_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")


def is_field_name(name: str) -> bool:
    """Whether a member extension can be one of a manifest's `fields`."""
    return bool(_FIELD_RE.match(name))


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

    >>> from dlstore.format.checksums import checksum_of
    >>> m = Manifest(shards=(ShardInfo("a.tar", 2048, 1, checksum_of(b"x", "xxh3_128")),), classes=("cat",),
    ...              fields=("cls", "jpg"), label_field="cls")
    >>> Manifest.from_json(m.to_json()) == m, m.checksum_algorithm, m.format_version
    (True, 'xxh3_128', 2)
    """

    shards: tuple[ShardInfo, ...]
    classes: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    label_field: str | None = None
    created: CreationInfo = field(default_factory=CreationInfo)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shards", tuple(self.shards))
        object.__setattr__(self, "classes", tuple(self.classes))
        object.__setattr__(self, "fields", tuple(sorted(self.fields)))
        checksums = {c.partition(":")[0] for s in self.shards for c in (s.checksum, s.index_checksum) if c}
        if len(checksums) > 1:
            raise ConfigError(f"a manifest's checksums use one algorithm, these use {sorted(checksums)}")

    @property
    def checksum_algorithm(self) -> str:
        """The algorithm of every checksum of the dataset; SHA-256 for a manifest without shards."""
        return self.shards[0].checksum.partition(":")[0] if self.shards else "sha256"

    @property
    def format_version(self) -> int:
        """1 where the checksums are SHA-256 (every dlstore reads it), else 2."""
        return _SHA256_ONLY_VERSION if self.checksum_algorithm == "sha256" else FORMAT_VERSION

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

    @property
    def shard_table_digest(self) -> str:
        """A SHA-256 checksum of the shard table: names, sizes, samples, checksums. It pins what a
        sample id means and which bytes it has. A new conversion gets another one."""
        table = [[s.name, s.size, s.samples, s.checksum] for s in self.shards]
        return checksum_of(json.dumps(table).encode(), "sha256")

    @property
    def decode_checked(self) -> bool:
        """Whether `dlstore convert` decoded every JPEG once, as the loader's first decode of a
        sample does. Those that failed were left out (`ConvertOptions.check_decode`). The loader
        may then decode only each crop's rows from the first epoch on."""
        return self.created.tool == "dlstore convert" and self.created.options.get("check_decode") is True

    # -- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": self.format_version,
            "checksum_algorithm": self.checksum_algorithm,
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
        """Read the manifest at the root of `store`; `NotFound` if there is none."""
        try:
            data = store.get_bytes(key)
        except NotFound as exc:
            # The store's 404 alone would not say what is missing, or why.
            raise NotFound(
                f"no dlstore dataset at {store.url}: {exc}. Check the URL, or write the dataset there first "
                "(`dlstore convert`, or `dlstore index` for WebDataset shards)"
            ) from None
        return cls.from_json(data)

    def save(self, store, key: str = MANIFEST_NAME) -> None:
        """Write the manifest; converters call it last, once every shard is in place. A manifest its
        reader would refuse, with duplicate class names say, is a `FormatError`, not written."""
        text = self.to_json()
        type(self).from_json(text)  # the reader's checks
        store.put(key, text)


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


def _checksum(value: Any, where: str, algorithm: str) -> str:
    text = _str(value, where)
    if not is_checksum(text, algorithm):
        digits = 2 * ALGORITHMS[algorithm]
        raise FormatError(f"{where}: expected '{algorithm}:' and {digits} lowercase hex digits, found {text[:80]!r}")
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


def _parse_shard(value: Any, where: str, algorithm: str) -> ShardInfo:
    raw = _require_object(value, where, _SHARD_REQUIRED, _SHARD_OPTIONAL)
    index = raw.get("index")
    samples, size = _int(raw["samples"], f"{where}.samples"), _int(raw["size"], f"{where}.size")
    if samples > size // 512:  # a sample is a tar member at least: a 512-byte header
        # A huge count would go on to a huge plan, or to numpy's "array is too big".
        raise FormatError(f"{where}.samples: {samples} samples do not fit in a shard of {size} bytes")
    return ShardInfo(
        name=_key(raw["name"], f"{where}.name"),
        size=_int(raw["size"], f"{where}.size"),
        samples=_int(raw["samples"], f"{where}.samples"),
        checksum=_checksum(raw["checksum"], f"{where}.checksum", algorithm),
        index=None if index is None else _key(index, f"{where}.index"),
        index_size=None if raw.get("index_size") is None else _int(raw["index_size"], f"{where}.index_size"),
        index_checksum=None
        if raw.get("index_checksum") is None
        else _checksum(raw["index_checksum"], f"{where}.index_checksum", algorithm),
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
    if not 1 <= version <= FORMAT_VERSION:
        newer = " (made by a newer dlstore; upgrade)" if version > FORMAT_VERSION else ""
        raise FormatError(
            f"{MANIFEST_NAME}: format_version {version} is not supported{newer}; "
            f"this dlstore reads 1 to {FORMAT_VERSION}"
        )
    algorithm = raw["checksum_algorithm"]
    known = ["sha256"] if version == _SHA256_ONLY_VERSION else sorted(ALGORITHMS)
    if algorithm not in known:
        raise FormatError(
            f"checksum_algorithm: {str(algorithm)[:40]!r} is not supported in format {version}, expected one of {known}"
        )
    if not isinstance(raw["shards"], list):
        raise FormatError(f"shards: expected a list, found {_kind(raw['shards'])}")
    shards = tuple(_parse_shard(s, f"shards[{i}]", algorithm) for i, s in enumerate(raw["shards"]))
    names = [s.name for s in shards] + [s.index for s in shards if s.index is not None]
    if len(set(names)) != len(names):
        raise FormatError("shards: two shards (or indexes) share a name")
    fields = _str_list(raw["fields"], "fields")
    for name in fields:
        if not is_field_name(name):
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
    )
    for name, actual in (("total_samples", manifest.total_samples), ("total_size", manifest.total_size)):
        if name in raw and _int(raw[name], name) != actual:
            raise FormatError(f"{name}: says {raw[name]}, but the shards add up to {actual}")
    return manifest


# -- summary for `dlstore ls` ----------------------------------------------------------------


#: Options that shape only some sources' shards, by the sources they shape. `convert` records
#: every option, since a conversion run again compares them whole. `ls` shows those that mattered.
_OPTION_SOURCES = {"image_format": ("cifar10", "mnist"), "keep_format": ("imagefolder",)}


def _describe_options(options: Mapping[str, Any], source_format: str | None) -> str:
    shown = {
        k: v
        for k, v in options.items()
        if v not in (None, False, "") and (k not in _OPTION_SOURCES or source_format in _OPTION_SOURCES[k])
    }
    return ", ".join(f"{k}={v}" for k, v in sorted(shown.items()))


def describe_dataset(store) -> str:
    """A few lines about the dataset at the root of `store`, from its manifest.

    >>> print(describe_dataset(open_store("file:///data/cifar10/train")))   # doctest: +SKIP
    file:///data/cifar10/train: dlstore dataset, format 2, xxh3_128 checksums
      samples  50,000 in 4 shards, 119.4 MB (2.4 KB per sample)
      ...
    """
    m = Manifest.load(store)
    n, size = m.total_samples, m.total_size
    lines = [f"{store.url}: dlstore dataset, format {m.format_version}, {m.checksum_algorithm} checksums"]
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
            # Why it matters: a node then fetches such a shard whole, though it needs only part.
            lines.append(
                f"  indexes  {old} of {len(m.shards)} are version 1 (no sample digests: boundary shards are "
                "fetched whole); `dlstore index`, or `dlstore convert --no-check-decode` again, upgrades them"
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
        lines.append(f"  options  {_describe_options(c.options, c.source_format)}")
    # Every line as a terminal shows it: the manifest's names and source are anyone's.
    return "\n".join(printable(line) for line in lines)


# -- sample indexes, checked against the manifest --------------------------------------------
def read_index_bytes(store, shard: ShardInfo) -> bytes:
    """The stored sample index of `shard`, read no further than an index of its samples can be long.
    The manifest's `index_size` raises that bound. A longer object is a `FormatError`, found
    before it is read whole into memory."""
    assert shard.index is not None
    most = max(shard.index_size or 0, SampleIndex.file_size(shard.samples, 3))
    data = b"".join(store.get(shard.index, 0, most + 1))
    if len(data) > most:
        raise FormatError(
            f"sample index {shard.index!r} is longer than an index of {shard.samples} samples ({most} bytes)"
        )
    return data


def load_sample_index(store, shard: ShardInfo) -> SampleIndex:
    """Fetch one shard's sample index and check it against the manifest. That checks the index's
    checksum when the manifest has one, and the shard's size, samples and checksum."""
    if shard.index is None:
        raise FormatError(f"shard {shard.name!r} has no sample index in the manifest")
    data = read_index_bytes(store, shard)
    if shard.index_checksum is not None:
        # The sample digests are only as trustworthy as the index: check it against the manifest.
        actual = checksum_of(data, parse_checksum(shard.index_checksum)[0])
        if actual != shard.index_checksum:
            raise FormatError(
                f"sample index {shard.index!r} fails its checksum: {actual[:21]}…, manifest {shard.index_checksum[:21]}…"
            )
    index = SampleIndex.from_bytes(data)
    if len(index) != shard.samples or index.shard_size != shard.size or index.checksum != shard.checksum:
        raise FormatError(
            f"sample index {shard.index!r} describes a shard of {index.shard_size} bytes and {len(index)} samples "
            f"(checksum {index.checksum[:21]}…), the manifest one of {shard.size} bytes and {shard.samples} samples"
        )
    return index
