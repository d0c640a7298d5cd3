"""Dataset converters (ImageNet, ImageFolder, CIFAR-10, MNIST → tar shards in any store),
and the two operations on finished datasets: `verify_dataset` and `index_dataset`.

How a conversion runs:

1. **List** the source (`list_source`): every input with its label, in a canonical order
   (sorted source ids), without reading image bytes. Tars are indexed in place — the outer
   ImageNet tar and each per-class tar inside it are walked header by header with `pread`,
   never extracted.
2. **Plan**: a seeded global shuffle (`numpy.random.RandomState`, whose stream numpy keeps
   stable across versions), then consecutive runs of that order become shards, cut at
   `shard_size` bytes (exact sizes for inputs stored as they are, a probe-based estimate
   when images are re-encoded) and/or `samples_per_shard`. The plan is a pure function of
   the listing and the options, so every run of the same conversion makes the same shards.
3. **Build** each shard in a worker process: read, check, maybe resize/re-encode each input,
   write the tar to a temporary file, then `store.put` the shard and then its sample index.
   Local temp space is at most one shard per worker.
4. **Resume**: a shard whose sample index is in the store, whose recipe digest (a hash of
   its planned inputs and the byte-shaping options) matches, and whose tar has the recorded
   size is kept as it is. The index is put after the tar, so its presence means the tar is
   complete.
5. **Manifest last**: `index.json` is deleted at the start and written once every shard is in
   place, so a half-finished dataset is never taken for a finished one.

Inputs that cannot be read as images are skipped and listed in the summary (`strict`
turns the first one into a `CorruptSample` error). A cheap check catches truncated files:
Pillow parses the header, and a JPEG without its end-of-image marker near the end is
decoded fully before it is accepted.

>>> summary = convert("imagenet", "/data/ILSVRC2012", "swift://imagenet/train",
...                   ConvertOptions(split="train", workers=8, seed=0))   # doctest: +SKIP
>>> summary.samples, summary.shards                                       # doctest: +SKIP
(1281167, 578)
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import logging
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dlstore.config import StoreConfig
from dlstore.errors import ConfigError, CorruptSample, CorruptShard, DlstoreError, FormatError, NotFound
from dlstore.manifest import (
    MANIFEST_NAME,
    CreationInfo,
    Manifest,
    SampleIndex,
    ShardInfo,
    checksum_of,
    index_name,
)
from dlstore.shards import TarShardWriter, iter_members, scan_shard, shard_name
from dlstore.storage import Store, open_store

__all__ = [
    "FORMATS",
    "ConvertOptions",
    "ConvertProgress",
    "ConvertSummary",
    "SkippedInput",
    "Source",
    "SourceItem",
    "VerifyReport",
    "convert",
    "index_dataset",
    "list_source",
    "plan_shards",
    "verify_dataset",
]

log = logging.getLogger(__name__)

FORMATS = ("imagenet", "imagefolder", "cifar10", "mnist")
IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp", "ppm", "pgm", "bmp", "gif", "tif", "tiff")
_WNID_RE = re.compile(r"n\d{8}\Z")
_EXT_OF_FORMAT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "BMP": "bmp", "GIF": "gif", "TIFF": "tiff", "PPM": "ppm"}


# -- options and results -------------------------------------------------------------------
@dataclass(frozen=True)
class ConvertOptions:
    """How to convert. Only the fields listed in `shaping()` change the shards' bytes.

    `split`: imagenet `train`/`val`; cifar10 and mnist `train`/`test`; imagefolder a sub-folder
    (None: the folder itself). `image_format` is for cifar10/mnist (`png` or `jpeg`);
    `keep_format` (imagefolder) stores non-JPEG images as they are instead of re-encoding
    them as JPEG; `val_labels` points at an ImageNet ground-truth file when it is not found
    beside the data.
    """

    split: str | None = None
    shard_size: int = 256 * 10**6
    samples_per_shard: int | None = None
    resize_max_side: int | None = None
    quality: int = 90
    image_format: str = "png"
    keep_format: bool = False
    val_labels: str | None = None
    metadata: bool = True
    seed: int = 0
    shuffle: bool = True
    strict: bool = False
    workers: int = 1
    prefix: str = "shard"
    tmp_dir: str | None = None
    overwrite: bool = False
    rehash_existing: bool = False

    def __post_init__(self) -> None:
        if self.shard_size < 4096:
            raise ConfigError(f"shard_size {self.shard_size} is too small; use at least a few MB")
        if self.samples_per_shard is not None and self.samples_per_shard < 1:
            raise ConfigError("samples_per_shard must be at least 1")
        if self.resize_max_side is not None and self.resize_max_side < 8:
            raise ConfigError("resize_max_side must be at least 8 pixels")
        if not 1 <= self.quality <= 100:
            raise ConfigError("quality is a JPEG quality from 1 to 100")
        if self.image_format not in ("png", "jpeg"):
            raise ConfigError(f"image_format must be 'png' or 'jpeg', not {self.image_format!r}")
        if not 0 <= self.seed < 2**32:
            raise ConfigError("seed must be in [0, 2**32)")
        if self.workers < 1:
            raise ConfigError("workers must be at least 1")
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_./-]*", self.prefix) or ".." in self.prefix.split("/"):
            raise ConfigError(f"shard prefix {self.prefix!r} must be a plain relative name")

    def shaping(self) -> dict[str, Any]:
        """The options that decide which bytes end up in which shard."""
        return {
            "split": self.split,
            "shard_size": self.shard_size,
            "samples_per_shard": self.samples_per_shard,
            "resize_max_side": self.resize_max_side,
            "quality": self.quality,
            "image_format": self.image_format,
            "keep_format": self.keep_format,
            "metadata": self.metadata,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "prefix": self.prefix,
        }


@dataclass(frozen=True)
class SkippedInput:
    """An input left out of the dataset, and why."""

    id: str
    reason: str


@dataclass(frozen=True)
class ConvertProgress:
    """Passed to the `progress` callback after each shard and a few times a second."""

    samples_done: int
    samples_total: int
    bytes_done: int
    shards_done: int
    shards_total: int
    shards_reused: int


@dataclass(frozen=True)
class ConvertSummary:
    """What a conversion made; `skipped` lists the inputs dropped by the shards built in this run
    (`skipped_earlier` counts those dropped by shards kept from an earlier run)."""

    url: str
    samples: int
    shards: int
    bytes: int
    shards_written: int
    shards_reused: int
    skipped: tuple[SkippedInput, ...]
    skipped_earlier: int
    seconds: float
    manifest: Manifest

    def describe(self) -> str:
        rate = self.samples / self.seconds if self.seconds > 0 else 0.0
        mbps = self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0
        lines = [
            f"{self.url}: {self.samples:,} samples in {self.shards} shards, {self.bytes / 1e6:,.1f} MB "
            f"({self.shards_written} written, {self.shards_reused} kept from an earlier run) "
            f"in {self.seconds:.1f} s ({rate:,.0f} samples/s, {mbps:,.1f} MB/s)"
        ]
        skipped = len(self.skipped) + self.skipped_earlier
        if skipped:
            lines.append(f"skipped {skipped} input(s):")
            lines += [f"  {s.id}: {s.reason}" for s in self.skipped[:50]]
            if len(self.skipped) > 50:
                lines.append(f"  … and {len(self.skipped) - 50} more")
            if self.skipped_earlier:
                lines.append(f"  {self.skipped_earlier} in shards kept from an earlier run")
        return "\n".join(lines)


# -- sources -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SourceItem:
    """One input: a stable id (a relative path, `<wnid>/<member>`, `<batch>/<i>`), its label,
    its size in bytes when known (0 otherwise), and where the reader finds it."""

    id: str
    label: int
    size: int = 0
    offset: int = -1


class _FileReader:
    """Inputs are files under `root`; an item's id is its relative path."""

    def __init__(self, root: str) -> None:
        self.root = root

    def read(self, item: SourceItem) -> bytes:
        with open(os.path.join(self.root, item.id), "rb") as file:
            return file.read()


class _TarReader:
    """Inputs are members of one local tar (maybe nested): `pread` at a known offset."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    def __getstate__(self) -> dict:
        return {"path": self.path, "_fd": None}

    def read(self, item: SourceItem) -> bytes:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        data = os.pread(self._fd, item.size, item.offset)
        if len(data) != item.size:
            raise FormatError(f"{self.path} ends inside {item.id}")
        return data


class _ArrayReader:
    """Inputs are rows of arrays (CIFAR-10 batches, MNIST idx files), loaded lazily in each process.

    `parts` maps a part name (an id's first component: `data_batch_1`, `train`) to a loader spec.
    """

    def __init__(self, kind: str, parts: dict[str, tuple]) -> None:
        self.kind, self.parts = kind, parts
        self._arrays: dict[str, np.ndarray] = {}

    def __getstate__(self) -> dict:
        return {"kind": self.kind, "parts": self.parts, "_arrays": {}}

    def read(self, item: SourceItem) -> np.ndarray:
        part = item.id.split("/", 1)[0]
        if part not in self._arrays:
            self._arrays[part] = _load_array(self.kind, self.parts[part])[0]
        return self._arrays[part][item.offset]


@dataclass
class Source:
    """A listed input dataset: classes, inputs in canonical (sorted-id) order, and a reader.

    `reencode` is True when the shards' image bytes are not the input bytes (so their
    sizes are only known after encoding)."""

    format: str
    name: str
    split: str
    classes: list[str]
    items: list[SourceItem]
    reader: Any
    reencode: bool
    skipped: list[SkippedInput] = field(default_factory=list)


def list_source(fmt: str, src: str | os.PathLike[str], options: ConvertOptions = ConvertOptions()) -> Source:
    """List `src` as a dataset of format `fmt` (one of `FORMATS`); `FormatError` if it is not one.

    >>> source = list_source("cifar10", "/data/cifar10", ConvertOptions(split="test"))  # doctest: +SKIP
    >>> len(source.items), source.classes[:2]                                            # doctest: +SKIP
    (10000, ['airplane', 'automobile'])
    """
    path = Path(src)
    if not path.exists():
        raise FormatError(f"{src}: no such file or directory")
    listers: dict[str, Callable[[Path, ConvertOptions], Source]] = {
        "imagenet": _imagenet_source,
        "imagefolder": _imagefolder_source,
        "cifar10": _cifar10_source,
        "mnist": _mnist_source,
    }
    if fmt not in listers:
        raise ConfigError(f"unknown source format {fmt!r}; expected one of {', '.join(FORMATS)}")
    source = listers[fmt](path, options)
    source.items.sort(key=lambda item: item.id)
    if not source.items:
        raise FormatError(f"{src}: found no {fmt} inputs for split {source.split!r}")
    return source


def _found(path: Path, limit: int = 8) -> str:
    try:
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    except OSError:
        return "nothing readable"
    if not names:
        return "an empty directory"
    return ", ".join(names[:limit]) + (f", … ({len(names)} entries)" if len(names) > limit else "")


def _image_extensions() -> set[str]:
    from PIL import Image

    Image.init()
    return {ext.lower() for ext in Image.registered_extensions()}


def _walk_class_dirs(root: Path, class_dirs: Sequence[str], skipped: list[SkippedInput]) -> list[SourceItem]:
    """Every image file under each class folder (recursively, like torchvision's ImageFolder)."""
    extensions = _image_extensions()
    items = []
    for label, name in enumerate(class_dirs):
        for folder, dirs, files in os.walk(root / name, followlinks=True):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            rel_folder = os.path.relpath(folder, root)
            for file in sorted(files):
                if file.startswith("."):
                    continue
                rel = f"{rel_folder}/{file}".replace(os.sep, "/")
                if os.path.splitext(file)[1].lower() not in extensions:
                    skipped.append(SkippedInput(rel, "not an image file extension"))
                    continue
                items.append(SourceItem(rel, label, os.path.getsize(os.path.join(folder, file))))
    return items


def _subdirs(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))


# ImageNet ----------------------------------------------------------------------------------
_IMAGENET_EXPECTED = (
    "an ImageNet (ILSVRC2012) source: a folder with train/<wnid>/*.JPEG and val/ (as <wnid> folders, "
    "or flat with LOC_val_solution.csv or a '<filename> <wnid>' list), or with ILSVRC2012_img_train.tar / "
    "ILSVRC2012_img_val.tar, or one of those tars itself"
)
_VAL_LABEL_FILES = ("LOC_val_solution.csv", "val_labels.csv", "val_labels.txt", "val.txt")
_DEVKIT_GROUND_TRUTH = "ILSVRC2012_validation_ground_truth.txt"


def _imagenet_source(src: Path, options: ConvertOptions) -> Source:
    split = options.split or "train"
    if split not in ("train", "val"):
        raise ConfigError(f"imagenet splits are 'train' and 'val', not {split!r}")
    if src.is_file():
        return _imagenet_tar(src, split, options)
    for base in (src, src / "ILSVRC" / "Data" / "CLS-LOC", src / "Data" / "CLS-LOC"):
        if (base / split).is_dir():
            return _imagenet_folder(base / split, split, options, search=[src, base, base / split])
        if (base / f"ILSVRC2012_img_{split}.tar").is_file():
            return _imagenet_tar(base / f"ILSVRC2012_img_{split}.tar", split, options)
    extensions = _image_extensions()
    has_images = split == "val" and any(p.suffix.lower() in extensions for p in src.iterdir() if p.is_file())
    if any(_WNID_RE.match(d) for d in _subdirs(src)) or has_images:
        return _imagenet_folder(src, split, options, search=[src, src.parent])
    hint = "; for class folders not named by WordNet id use the imagefolder format" if _subdirs(src) else ""
    raise FormatError(f"{src}: expected {_IMAGENET_EXPECTED}; found {_found(src)}{hint}")


def _imagenet_folder(folder: Path, split: str, options: ConvertOptions, search: list[Path]) -> Source:
    dirs = _subdirs(folder)
    bad = [d for d in dirs if not _WNID_RE.match(d)]
    if bad:
        raise FormatError(
            f"{folder}: expected class folders named by WordNet id (like n01440764), found {bad[:5]}; "
            "use the imagefolder format for other class names"
        )
    skipped: list[SkippedInput] = []
    if dirs:
        items = _walk_class_dirs(folder, dirs, skipped)
        return Source("imagenet", folder.name, split, dirs, items, _FileReader(str(folder)), False, skipped)
    # A flat folder (validation images): labels come from the ground-truth file.
    extensions = _image_extensions()
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in extensions)
    if not files:
        raise FormatError(f"{folder}: expected {_IMAGENET_EXPECTED}; found {_found(folder)}")
    labels, classes, origin = _val_labels(options, search)
    items = _label_flat([(p.name, p.stat().st_size, -1) for p in files], labels, classes, origin)
    return Source("imagenet", folder.name, split, classes, items, _FileReader(str(folder)), False, skipped)


def _imagenet_tar(path: Path, split: str, options: ConvertOptions) -> Source:
    """`ILSVRC2012_img_train.tar` (per-class tars inside) or `ILSVRC2012_img_val.tar` (flat)."""
    extensions = _image_extensions()
    with open(path, "rb", buffering=0) as file:
        try:
            members = list(iter_members(file, data=False))
        except CorruptShard as exc:
            raise FormatError(f"{path}: expected {_IMAGENET_EXPECTED}; it is not a readable tar ({exc})") from None
        nested = [m for m in members if m.name.endswith(".tar")]
        images = [m for m in members if os.path.splitext(m.name)[1].lower() in extensions]
        if nested and len(nested) == len(members):
            items: list[SourceItem] = []
            classes = []
            for member in sorted(nested, key=lambda m: m.name):
                wnid = member.name.rsplit("/", 1)[-1][:-4]
                if not _WNID_RE.match(wnid):
                    raise FormatError(f"{path}: expected per-class tars named <wnid>.tar, found {member.name!r}")
                window = _FileWindow(file.fileno(), member.data_offset, member.size)
                try:
                    inner = list(iter_members(window, data=False, base_offset=member.data_offset))
                except CorruptShard as exc:
                    raise FormatError(f"{path}: member {member.name!r} is not a readable tar ({exc})") from None
                label = len(classes)
                classes.append(wnid)
                items += [SourceItem(f"{wnid}/{m.name}", label, m.size, m.data_offset) for m in inner]
            return Source("imagenet", path.name, split, classes, items, _TarReader(str(path)), False)
        if images and len(images) == len(members):
            labels, classes, origin = _val_labels(options, [path.parent, path.parent.parent])
            flat = [(m.name.rsplit("/", 1)[-1], m.size, m.data_offset) for m in images]
            items = _label_flat(flat, labels, classes, origin)
            return Source("imagenet", path.name, split, classes, items, _TarReader(str(path)), False)
    sample = ", ".join(m.name for m in members[:5]) or "no files"
    raise FormatError(f"{path}: expected a tar of per-class <wnid>.tar files or a flat tar of images; found {sample}")


class _FileWindow:
    """A read-only, seekable view of `[start, start + size)` of an open file (a nested tar)."""

    def __init__(self, fd: int, start: int, size: int) -> None:
        self.fd, self.start, self.size, self.pos = fd, start, size, 0

    def seekable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n < 0 else min(n, self.size - self.pos)
        data = os.pread(self.fd, n, self.start + self.pos) if n > 0 else b""
        self.pos += len(data)
        return data

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.pos = min(self.size, offset + (self.pos if whence == os.SEEK_CUR else 0))
        return self.pos


def _val_labels(options: ConvertOptions, search: list[Path]) -> tuple[dict[str, str], list[str], str]:
    """Ground truth for flat validation images: {image stem: wnid}, sorted wnids, the file's name.

    Looked for in `search` (and their `ILSVRC2012_devkit_t12/data/`): LOC_val_solution.csv,
    a `<filename> <wnid>` list, or the devkit's ILSVRC2012_validation_ground_truth.txt with
    its meta.mat."""
    if options.val_labels:
        candidates = [Path(options.val_labels)]
    else:
        folders = [f for d in dict.fromkeys(search) for f in (d, d / "ILSVRC2012_devkit_t12" / "data")]
        candidates = [d / name for d in folders for name in (*_VAL_LABEL_FILES, _DEVKIT_GROUND_TRUTH)]
    for path in candidates:
        if path.is_file():
            labels = _parse_devkit(path) if path.name == _DEVKIT_GROUND_TRUTH else _parse_val_labels(path)
            return labels, sorted(set(labels.values())), path.name
    if options.val_labels:
        raise FormatError(f"{options.val_labels}: no such ground-truth file")
    raise FormatError(
        "flat ImageNet validation images need their ground truth: expected one of "
        f"{', '.join(_VAL_LABEL_FILES + (_DEVKIT_GROUND_TRUTH,))} in "
        f"{', '.join(str(d) for d in dict.fromkeys(search))} (or pass val_labels / --val-labels)"
    )


def _parse_val_labels(path: Path) -> dict[str, str]:
    """`LOC_val_solution.csv` (`ImageId,PredictionString` whose first token is the wnid) or
    lines of `<filename> <wnid>`."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise FormatError(f"{path}: cannot read the ground truth ({exc})") from None
    if text.startswith("ImageId,"):
        rows = [row + ["", ""] for row in csv.reader(io.StringIO(text)) if row][1:]
        pairs = [(row[0], (row[1].split() or [""])[0]) for row in rows]
    else:
        pairs = [
            ((line.split() + ["", ""])[0], (line.split() + ["", ""])[1]) for line in text.splitlines() if line.strip()
        ]
    labels: dict[str, str] = {}
    for number, (name, wnid) in enumerate(pairs, 1):
        if not _WNID_RE.match(wnid):
            raise FormatError(
                f"{path}, entry {number}: expected '<filename> <wnid>' (or the LOC_val_solution.csv columns), "
                f"found {name!r} {wnid!r}"
            )
        labels[os.path.splitext(name)[0]] = wnid
    if not labels:
        raise FormatError(f"{path}: the ground-truth file is empty")
    return labels


def _parse_devkit(path: Path) -> dict[str, str]:
    """The ILSVRC2012 devkit: line i of the ground truth is the ILSVRC2012_ID of
    ILSVRC2012_val_<i>, and meta.mat maps IDs of leaf synsets to wnids."""
    meta = path.with_name("meta.mat")
    try:
        from scipy.io import loadmat
    except ImportError:
        raise FormatError(
            f"reading the devkit's {meta.name} needs scipy (pip install scipy); or pass --val-labels "
            "with LOC_val_solution.csv or a '<filename> <wnid>' list"
        ) from None
    try:
        synsets = loadmat(str(meta), squeeze_me=True)["synsets"]
        wnid_of = {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in synsets if int(s["num_children"]) == 0}
        ids = [int(line) for line in path.read_text(encoding="ascii").split()]
    except Exception as exc:  # scipy and the parsing raise many types for a bad file
        raise FormatError(f"{meta} / {path.name}: not the ILSVRC2012 devkit ({type(exc).__name__}: {exc})") from None
    unknown = sorted(set(ids) - set(wnid_of))
    if unknown or not ids:
        raise FormatError(f"{path}: ILSVRC2012_IDs {unknown[:5]} are not leaf synsets in {meta.name}")
    return {f"ILSVRC2012_val_{i:08d}": wnid_of[n] for i, n in enumerate(ids, 1)}


def _label_flat(
    files: list[tuple[str, int, int]], labels: dict[str, str], classes: list[str], origin: str
) -> list[SourceItem]:
    index = {wnid: i for i, wnid in enumerate(classes)}
    missing = [name for name, _, _ in files if os.path.splitext(name)[0] not in labels]
    if missing:
        raise FormatError(f"{len(missing)} validation image(s) have no label in {origin}, e.g. {missing[0]!r}")
    return [SourceItem(name, index[labels[os.path.splitext(name)[0]]], size, offset) for name, size, offset in files]


# ImageFolder -------------------------------------------------------------------------------
def _imagefolder_source(src: Path, options: ConvertOptions) -> Source:
    root = src / options.split if options.split else src
    if not root.is_dir():
        raise FormatError(f"{root}: expected a folder of class sub-folders; found {_found(src)}")
    classes = _subdirs(root)
    if not classes:
        raise FormatError(f"{root}: expected class sub-folders (<class>/<image>), found {_found(root)}")
    skipped: list[SkippedInput] = []
    items = _walk_class_dirs(root, classes, skipped)
    reencode = not options.keep_format and any(not item.id.lower().endswith((".jpg", ".jpeg")) for item in items)
    return Source(
        "imagefolder", root.name, options.split or "", classes, items, _FileReader(str(root)), reencode, skipped
    )


# CIFAR-10 ----------------------------------------------------------------------------------
_CIFAR_EXPECTED = "cifar-10-batches-py/ (data_batch_1..5, test_batch, batches.meta) or cifar-10-python.tar.gz"


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """The CIFAR batches are pickles; unpickling untrusted data can run code, so only the names
    a pickled numpy array needs are allowed."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise FormatError(f"the pickle refers to {module}.{name}; a CIFAR batch holds only arrays and lists")
        return super().find_class(module, name)


def _unpickle(data: bytes, what: str) -> dict:
    try:
        value = _NumpyOnlyUnpickler(io.BytesIO(data), encoding="bytes").load()
    except FormatError:
        raise
    except Exception as exc:  # a malformed pickle can fail in many ways; all mean "not a CIFAR batch"
        raise FormatError(f"{what}: not a CIFAR-10 python batch ({type(exc).__name__}: {exc})") from None
    if not isinstance(value, dict):
        raise FormatError(f"{what}: expected a pickled dict, found {type(value).__name__}")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in value.items()}


def _cifar_files(src: Path) -> dict[str, tuple]:
    """Where each CIFAR file is: ("file", path) or ("tar.gz", archive, member)."""
    for folder in (src / "cifar-10-batches-py", src):
        if (folder / "batches.meta").is_file():
            return {p.name: ("file", str(p)) for p in folder.iterdir() if p.is_file()}
    archive = src if src.is_file() else src / "cifar-10-python.tar.gz"
    if archive.is_file():
        try:
            with gzip.open(archive, "rb") as stream:
                names = [m.name for m in iter_members(stream, data=False)]
        except (OSError, EOFError, CorruptShard) as exc:
            raise FormatError(f"{archive}: expected {_CIFAR_EXPECTED}; not a readable .tar.gz ({exc})") from None
        return {name.rsplit("/", 1)[-1]: ("tar.gz", str(archive), name) for name in names}
    raise FormatError(f"{src}: expected {_CIFAR_EXPECTED}; found {_found(src if src.is_dir() else src.parent)}")


def _read_spec(spec: tuple) -> bytes:
    if spec[0] == "file":
        return Path(spec[1]).read_bytes()
    with gzip.open(spec[1], "rb") as stream:
        for member in iter_members(stream):
            if member.name == spec[2]:
                return member.data  # type: ignore[return-value]
    raise FormatError(f"{spec[1]}: {spec[2]} vanished")


def _load_array(kind: str, spec: tuple) -> tuple[np.ndarray, list[int]]:
    """(images N×H×W[×3] uint8, labels) of one CIFAR batch or one MNIST split."""
    if kind == "cifar10":
        batch = _unpickle(_read_spec(spec), spec[-1])
        data, labels = batch.get("data"), batch.get("labels")
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
            raise FormatError(f"{spec[-1]}: expected 'data' as a uint8 N×3072 array")
        if (
            not isinstance(labels, list)
            or len(labels) != len(data)
            or not all(type(x) is int and 0 <= x < 10 for x in labels)
        ):
            raise FormatError(f"{spec[-1]}: expected 'labels' as {len(data)} integers in 0..9")
        return np.ascontiguousarray(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)), labels
    images, labels = _read_idx(spec[0], 2051, 3), _read_idx(spec[1], 2049, 1)
    if len(images) != len(labels):
        raise FormatError(f"{spec[0]} holds {len(images)} images but {spec[1]} {len(labels)} labels")
    return images, [int(x) for x in labels]


def _cifar10_source(src: Path, options: ConvertOptions) -> Source:
    split = {"val": "test"}.get(options.split or "train", options.split or "train")
    if split not in ("train", "test"):
        raise ConfigError(f"cifar10 splits are 'train' and 'test', not {options.split!r}")
    files = _cifar_files(src)
    wanted = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    missing = [name for name in wanted + ["batches.meta"] if name not in files]
    if missing:
        raise FormatError(f"{src}: expected {_CIFAR_EXPECTED}; missing {', '.join(missing)}")
    meta = _unpickle(_read_spec(files["batches.meta"]), "batches.meta")
    names = meta.get("label_names")
    if not isinstance(names, list) or len(names) != 10:
        raise FormatError("batches.meta: expected 'label_names' with 10 class names")
    classes = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
    items = []
    for batch in wanted:
        _, labels = _load_array("cifar10", files[batch])
        items += [SourceItem(f"{batch}/{i}", label, 0, i) for i, label in enumerate(labels)]
    reader = _ArrayReader("cifar10", {batch: files[batch] for batch in wanted})
    return Source("cifar10", src.name, split, classes, items, reader, True)


# MNIST -------------------------------------------------------------------------------------
def _read_idx(path: str, magic: int, ndim: int) -> np.ndarray:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as file:  # type: ignore[operator]
            data = file.read()
    except (OSError, EOFError) as exc:
        raise FormatError(f"{path}: cannot read ({exc})") from None
    header = 4 + 4 * ndim
    if len(data) < header or struct.unpack(">I", data[:4])[0] != magic:
        raise FormatError(f"{path}: not an idx file with magic {magic} (MNIST {'images' if ndim == 3 else 'labels'})")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    if len(data) != header + int(np.prod(shape)):
        raise FormatError(f"{path}: header says {shape}, but the file holds {len(data) - header} bytes of data")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def _mnist_source(src: Path, options: ConvertOptions) -> Source:
    split = {"val": "test"}.get(options.split or "train", options.split or "train")
    if split not in ("train", "test"):
        raise ConfigError(f"mnist splits are 'train' and 'test', not {options.split!r}")
    prefix = "train" if split == "train" else "t10k"
    found: dict[str, str] = {}
    for folder in (src, src / "raw", src / "MNIST" / "raw"):
        for kind in ("images-idx3", "labels-idx1"):
            for name in (f"{prefix}-{kind}-ubyte", f"{prefix}-{kind.replace('-', '.')}-ubyte"):
                for candidate in (folder / name, folder / (name + ".gz")):
                    if kind not in found and candidate.is_file():
                        found[kind] = str(candidate)
        if len(found) == 2:
            break
    if len(found) != 2:
        raise FormatError(
            f"{src}: expected MNIST idx files {prefix}-images-idx3-ubyte[.gz] and {prefix}-labels-idx1-ubyte[.gz]; "
            f"found {_found(src)}"
        )
    spec = (found["images-idx3"], found["labels-idx1"])
    images, labels = _load_array("mnist", spec)
    if images.shape[1:] != (28, 28):
        log.info("MNIST-format images of %s pixels", images.shape[1:])
    if any(not 0 <= x < 10 for x in labels):
        raise FormatError(f"{spec[1]}: labels outside 0..9")
    items = [SourceItem(f"{split}/{i}", label, 0, i) for i, label in enumerate(labels)]
    return Source(
        "mnist", src.name, split, [str(d) for d in range(10)], items, _ArrayReader("mnist", {split: spec}), True
    )


# -- encoding one input --------------------------------------------------------------------
def _jpeg_bytes(image, quality: int) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", quality=quality)
    return out.getvalue()


def _shrink(image, max_side: int):
    """Scale so the longer side is `max_side`: a DCT-domain downscale first when the JPEG
    allows (decoding at 1/2, 1/4 or 1/8 is several times cheaper), then an antialiased resize."""
    from PIL import Image

    w, h = image.size
    scale = max_side / max(w, h)
    target = (max(1, round(w * scale)), max(1, round(h * scale)))
    if image.format == "JPEG":
        image.draft("RGB", target)
    image = image.convert("RGB")
    if image.size != target:
        image = image.resize(target, Image.Resampling.LANCZOS, reducing_gap=3.0)
    return image


_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def jpeg_header(data: bytes) -> tuple[int, int, int] | None:
    """(width, height, components) from a JPEG's frame header, walking its marker segments
    (~100x cheaper than `PIL.Image.open`), or None when this is not a well-formed JPEG start.

    >>> jpeg_header(b"\\xff\\xd8\\xff\\xc0\\x00\\x11\\x08\\x01\\x5e\\x01\\x90\\x03" + bytes(9))
    (400, 350, 3)
    """
    if data[:2] != b"\xff\xd8":
        return None
    pos, end = 2, len(data)
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            pos += 2
            continue
        length = (data[pos + 2] << 8) | data[pos + 3]
        if marker in _SOF_MARKERS:
            if length < 8 or pos + 10 > end:
                return None
            height = (data[pos + 5] << 8) | data[pos + 6]
            width = (data[pos + 7] << 8) | data[pos + 8]
            return (width, height, data[pos + 9]) if width and height else None
        if marker == 0xDA or length < 2:  # scan data before any frame header: malformed
            return None
        pos += 2 + length
    return None


def encode_input(raw: bytes | np.ndarray, options: ConvertOptions) -> tuple[str, bytes]:
    """(field, bytes) to store for one input; `CorruptSample` if it is not a usable image."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(raw, np.ndarray):
        image = Image.fromarray(raw)
        if options.resize_max_side and max(image.size) > options.resize_max_side:
            image = _shrink(image, options.resize_max_side)
        if options.image_format == "jpeg":
            return "jpg", _jpeg_bytes(image, options.quality)
        out = io.BytesIO()
        image.save(out, "PNG")
        return "png", out.getvalue()
    # The common case: a complete grey or colour JPEG that need not shrink is stored as it is.
    header = jpeg_header(raw)
    if (
        header is not None
        and header[2] in (1, 3)
        and (not options.resize_max_side or max(header[:2]) <= options.resize_max_side)
        and raw.rfind(b"\xff\xd9", max(0, len(raw) - 4096)) >= 0
    ):
        return "jpg", raw
    try:
        image = Image.open(io.BytesIO(raw))
        fmt = image.format
        if options.resize_max_side and max(image.size) > options.resize_max_side:
            return "jpg", _jpeg_bytes(_shrink(image, options.resize_max_side), options.quality)
        if fmt == "JPEG" and image.mode in ("RGB", "L"):
            if raw.rfind(b"\xff\xd9", max(0, len(raw) - 4096)) < 0:
                image.load()  # no end-of-image marker near the end: decode to tell truncation from trailing junk
            return "jpg", raw
        if options.keep_format and fmt in _EXT_OF_FORMAT:
            image.verify()
            return _EXT_OF_FORMAT[fmt], raw
        # Other formats and JPEG modes decoders handle badly (CMYK): re-encode as RGB JPEG.
        return "jpg", _jpeg_bytes(image.convert("RGB"), options.quality)
    except UnidentifiedImageError:
        raise CorruptSample("not an image format Pillow reads") from None
    except Exception as exc:  # Pillow raises many types for bad input (OSError, SyntaxError, ValueError, …)
        raise CorruptSample(f"{type(exc).__name__}: {exc}") from None


# -- planning ------------------------------------------------------------------------------
def sample_key(position: int) -> str:
    """The sample key of the input at `position` in the sorted listing: `00000042`."""
    return f"{position:08d}"


def _metadata(item: SourceItem, classes: Sequence[str]) -> bytes:
    record = {"source": item.id, "label": item.label, "class": classes[item.label]}
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def plan_shards(
    items: Sequence[SourceItem], options: ConvertOptions, sample_bytes: Callable[[int], int]
) -> list[list[int]]:
    """Positions (in `items`) of each shard's inputs, in write order: a seeded shuffle cut at
    `shard_size` bytes (by `sample_bytes(position)`) and/or `samples_per_shard`.

    >>> plan_shards([SourceItem(str(i), 0) for i in range(5)], ConvertOptions(samples_per_shard=2, shuffle=False),
    ...             lambda p: 100)
    [[0, 1], [2, 3], [4]]
    """
    order = np.arange(len(items))
    if options.shuffle:
        order = np.random.RandomState(options.seed).permutation(len(items))
    shards: list[list[int]] = []
    current: list[int] = []
    size = 0
    limit = options.samples_per_shard or len(items) + 1
    for position in order.tolist():
        nbytes = sample_bytes(position)
        if current and (len(current) >= limit or size + nbytes > options.shard_size - 1024):
            shards.append(current)
            current, size = [], 0
        current.append(position)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def _sample_bytes_estimator(source: Source, options: ConvertOptions) -> Callable[[int], int]:
    """Bytes a sample will take in a shard: exact for inputs stored as they are, otherwise the
    mean over a deterministic probe of up to 32 inputs encoded here."""

    def member(n: int) -> int:
        return 512 + n + (-n % 512)

    def meta(position: int) -> int:
        return member(len(_metadata(source.items[position], source.classes))) if options.metadata else 0

    def cls(position: int) -> int:
        return member(len(str(source.items[position].label)))

    if not source.reencode and not options.resize_max_side:
        return lambda p: member(source.items[p].size) + cls(p) + meta(p)
    step = max(1, len(source.items) // 32)
    probe = []
    for position in range(0, len(source.items), step)[:32]:
        try:
            probe.append(len(encode_input(source.reader.read(source.items[position]), options)[1]))
        except (CorruptSample, FormatError, OSError):
            continue
    mean = int(np.mean(probe)) if probe else 100_000
    return lambda p: member(mean) + cls(p) + meta(p)


def _recipe(source: Source, options: ConvertOptions, name: str, positions: Sequence[int]) -> bytes:
    """What a shard is made from: a changed input, option or class list gives another digest."""
    h = hashlib.sha256()
    h.update(json.dumps([1, source.format, name, options.shaping(), source.classes], sort_keys=True).encode())
    for p in positions:
        item = source.items[p]
        h.update(f"\n{p}\t{item.id}\t{item.label}\t{item.size}".encode())
    return h.digest()


# -- building shards (in worker processes) -------------------------------------------------
@dataclass(frozen=True)
class _ShardTask:
    number: int
    name: str
    positions: tuple[int, ...]
    recipe: bytes


@dataclass(frozen=True)
class _BuildContext:
    store: Store
    source: Source
    options: ConvertOptions
    tmp_dir: str


@dataclass(frozen=True)
class _Built:
    number: int
    info: ShardInfo
    skipped: tuple[SkippedInput, ...]
    reused: bool = False


class _Counters:
    """Samples and bytes done, shared across worker processes (or local ones in-process)."""

    def __init__(self, shared: tuple | None = None) -> None:
        self.shared = shared
        self.samples = self.bytes = 0
        self.on_add: Callable[[], None] | None = None  # in-process: report progress, twice a second
        self._last = 0.0

    def add(self, samples: int, nbytes: int) -> None:
        if self.shared is None:
            self.samples += samples
            self.bytes += nbytes
            if self.on_add is not None and time.monotonic() - self._last > 0.5:
                self._last = time.monotonic()
                self.on_add()
            return
        for value, n in zip(self.shared, (samples, nbytes), strict=True):
            with value.get_lock():
                value.value += n

    def read(self) -> tuple[int, int]:
        if self.shared is None:
            return self.samples, self.bytes
        return self.shared[0].value, self.shared[1].value


_worker_context: _BuildContext | None = None
_worker_counters: _Counters | None = None


def _init_worker(context: _BuildContext, shared: tuple | None) -> _Counters:
    global _worker_context, _worker_counters
    _worker_context, _worker_counters = context, _Counters(shared)
    return _worker_counters


def _init_pool_worker(context: _BuildContext, shared: tuple | None) -> None:
    # Pool.terminate() sends SIGTERM; exiting through SystemExit runs the `finally` blocks that
    # remove a half-written object (the default action would leave it behind).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    _init_worker(context, shared)


def _shard_chunks(task: _ShardTask, context: _BuildContext, counters: _Counters, out: dict) -> Iterator[bytes]:
    """The shard's bytes, one sample at a time; `out` receives the index and the skipped inputs."""
    source, options = context.source, context.options
    parts: list[bytes] = []  # what the writer emitted since the last yield, without copying it

    class Sink:
        write = parts.append

    writer = TarShardWriter(Sink)  # type: ignore[arg-type]
    skipped: list[SkippedInput] = []
    for position in task.positions:
        item = source.items[position]
        try:
            ext, data = encode_input(source.reader.read(item), options)
        except (CorruptSample, OSError) as exc:
            if options.strict:
                raise CorruptSample(f"{item.id}: {exc}") from None
            skipped.append(SkippedInput(item.id, str(exc)))
            counters.add(1, 0)
            continue
        sample = {ext: data, "cls": str(item.label).encode()}
        if options.metadata:
            sample["json"] = _metadata(item, source.classes)
        span = writer.write(sample_key(position), sample)
        counters.add(1, span.size)
        yield from parts
        parts.clear()
    out["index"] = writer.close(recipe=task.recipe)
    out["skipped"] = tuple(skipped)
    yield from parts


def _build_shard(task: _ShardTask) -> _Built:
    context, counters = _worker_context, _worker_counters
    if context is None or counters is None:
        raise DlstoreError("shard builder used before _init_worker")
    out: dict[str, Any] = {}
    chunks = _shard_chunks(task, context, counters, out)
    if context.store.scheme == "file":
        # A local store writes beside the target and renames: streaming into it is one write
        # of the data and no temp space.
        context.store.put(task.name, chunks)
    else:
        # Remote stores get a seekable file, so that a failed upload is retried from its start.
        with tempfile.NamedTemporaryFile(dir=context.tmp_dir, prefix="shard-", suffix=".tar") as tmp:
            for chunk in chunks:
                tmp.write(chunk)
            tmp.flush()
            context.store.put(task.name, tmp.name)
    index: SampleIndex = out["index"]
    index_bytes = index.to_bytes()
    # The tar first, then its index: an index in the store means its tar is complete.
    context.store.put(index_name(task.name), index_bytes)
    info = ShardInfo(
        task.name,
        index.shard_size,
        len(index),
        index.checksum,
        index_name(task.name),
        len(index_bytes),
        checksum_of(index_bytes),
    )
    return _Built(task.number, info, out["skipped"])


def _existing_shard(store: Store, task: _ShardTask, sizes: dict[str, int], rehash: bool) -> _Built | None:
    """The shard as an earlier run left it, if it is complete and was built from the same recipe."""
    if task.name not in sizes or index_name(task.name) not in sizes:
        return None
    try:
        index_bytes = store.get_bytes(index_name(task.name))
        index = SampleIndex.from_bytes(index_bytes)
    except (NotFound, FormatError):
        return None
    if index.recipe != task.recipe or index.shard_size != sizes[task.name]:
        return None
    if rehash:
        digest = hashlib.sha256()
        for chunk in store.get(task.name):
            digest.update(chunk)
        if digest.digest() != index.sha256:
            log.warning("%s: checksum differs from its index; rebuilding it", task.name)
            return None
    info = ShardInfo(
        task.name,
        index.shard_size,
        len(index),
        index.checksum,
        index_name(task.name),
        len(index_bytes),
        checksum_of(index_bytes),
    )
    return _Built(task.number, info, (), reused=True)


# -- the conversion ------------------------------------------------------------------------
def _tool_version() -> str:
    from dlstore import __version__

    return __version__


def _check_destination(store: Store, creation: CreationInfo, options: ConvertOptions) -> None:
    """Refuse to overwrite another dataset; remove the manifest before touching any shard."""
    if not store.exists(MANIFEST_NAME):
        return
    try:
        previous = Manifest.load(store).created
        same = (previous.source_format, previous.options) == (creation.source_format, creation.options)
    except FormatError:
        same = False
    if not same and not options.overwrite:
        raise ConfigError(
            f"{store.url} already holds a dataset made from another source or with other options; "
            "choose another URL or pass overwrite (--overwrite)"
        )
    store.delete(MANIFEST_NAME)


def convert(
    fmt: str,
    src: str | os.PathLike[str],
    dest: str | Store,
    options: ConvertOptions = ConvertOptions(),
    *,
    config: StoreConfig | None = None,
    progress: Callable[[ConvertProgress], None] | None = None,
) -> ConvertSummary:
    """Convert the dataset at `src` (format `fmt`, one of `FORMATS`) into shards at `dest`.

    `dest` is a store URL (`swift://container/imagenet/train`, `s3://bucket/x`, `file:///d`)
    or a `Store`; it becomes the dataset root: `shard-000000.tar`, `shard-000000.idx`, …,
    `index.json`. `progress` is called with a `ConvertProgress` after every shard and a few
    times a second; an exception it raises stops the conversion (which can then be resumed).

    >>> convert("mnist", "./mnist", "file:///data/mnist-train",
    ...         ConvertOptions(split="train", samples_per_shard=10000))     # doctest: +SKIP
    """
    started = time.monotonic()
    store = dest if isinstance(dest, Store) else open_store(dest, config)
    source = list_source(fmt, src, options)
    estimate = _sample_bytes_estimator(source, options)
    plan = plan_shards(source.items, options, estimate)
    names = [shard_name(options.prefix, i) for i in range(len(plan))]
    tasks = [_ShardTask(i, names[i], tuple(p), _recipe(source, options, names[i], p)) for i, p in enumerate(plan)]
    creation = CreationInfo(
        tool="dlstore convert",
        tool_version=_tool_version(),
        source_format=source.format,
        source=source.name,
        split=source.split,
        seed=options.seed if options.shuffle else None,
        options=options.shaping(),
    )
    _check_destination(store, creation, options)

    listed = {info.key: info.size for info in store.list(options.prefix)}
    built: dict[int, _Built] = {}
    for task in tasks:
        existing = _existing_shard(store, task, listed, options.rehash_existing)
        if existing is not None:
            built[task.number] = existing
    todo = [task for task in tasks if task.number not in built]
    if built:
        log.info("%d of %d shards are already in %s; building %d", len(built), len(tasks), store.url, len(todo))

    total = len(source.items)
    reused_samples = sum(len(tasks[n].positions) for n in built)
    reused_bytes = sum(b.info.size for b in built.values())

    def report(counters: _Counters) -> None:
        if progress is not None:
            samples, nbytes = counters.read()
            progress(
                ConvertProgress(
                    reused_samples + samples,
                    total,
                    reused_bytes + nbytes,
                    len(built),
                    len(tasks),
                    sum(b.reused for b in built.values()),
                )
            )

    tmp_dir = tempfile.mkdtemp(prefix="dlstore-convert-", dir=options.tmp_dir)
    try:
        context = _BuildContext(store, source, options, tmp_dir)
        if options.workers == 1 or len(todo) <= 1:
            _build_in_process(context, todo, built, report)
        else:
            _build_in_pool(context, todo, built, report)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)

    results = [built[task.number] for task in tasks]
    # Predicted rather than collected, so that a resumed run (whose kept shards are not
    # read again) writes the same manifest as an uninterrupted one.
    fields = _expected_fields(source, options)
    manifest = Manifest(
        shards=tuple(b.info for b in results),
        classes=tuple(source.classes),
        fields=tuple(sorted(fields)),
        label_field="cls",
        created=creation,
    )
    manifest.save(store)
    stale = sorted(set(listed) - set(names) - {index_name(n) for n in names} - {MANIFEST_NAME})
    if stale:
        log.warning(
            "%s holds %d object(s) under the shard prefix that this dataset does not use, e.g. %s",
            store.url,
            len(stale),
            stale[0],
        )
    skipped = [s for b in results for s in b.skipped] + source.skipped
    skipped_earlier = sum(len(tasks[b.number].positions) - b.info.samples for b in results if b.reused)
    return ConvertSummary(
        url=store.url,
        samples=manifest.total_samples,
        shards=len(results),
        bytes=manifest.total_size,
        shards_written=sum(not b.reused for b in results),
        shards_reused=sum(b.reused for b in results),
        skipped=tuple(skipped),
        skipped_earlier=skipped_earlier,
        seconds=time.monotonic() - started,
        manifest=manifest,
    )


def _expected_fields(source: Source, options: ConvertOptions) -> set[str]:
    """The members a conversion writes: the image (`jpg`, or `png` for arrays stored as PNG, or
    with `keep_format` whatever formats the inputs are in), `cls`, and `json` with metadata."""
    fields = {"cls", "json"} if options.metadata else {"cls"}
    if isinstance(source.reader, _ArrayReader):
        return fields | {"png" if options.image_format == "png" else "jpg"}
    if options.keep_format and not options.resize_max_side:
        by_extension = {".jpeg": "jpg", ".jpg": "jpg", ".jpe": "jpg", ".tif": "tiff"}
        for item in source.items:
            ext = os.path.splitext(item.id)[1].lower()
            fields.add(by_extension.get(ext, ext[1:]))
        fields &= set(IMAGE_FIELDS) | {"cls", "json"}
    return fields | {"jpg"}


def _build_in_process(context: _BuildContext, todo: list[_ShardTask], built: dict[int, _Built], report) -> None:
    counters = _init_worker(context, None)
    counters.on_add = lambda: report(counters)
    for task in todo:
        built[task.number] = _build_shard(task)
        report(counters)


def _build_in_pool(context: _BuildContext, todo: list[_ShardTask], built: dict[int, _Built], report) -> None:
    # spawn, not fork: the parent may hold threads (progress bar, store clients) that a fork would copy mid-state.
    ctx = multiprocessing.get_context("spawn")
    shared = (ctx.Value("q", 0), ctx.Value("q", 0))
    counters = _Counters(shared)
    workers = min(context.options.workers, len(todo))
    with ctx.Pool(workers, initializer=_init_pool_worker, initargs=(context, shared)) as pool:
        pending = [pool.apply_async(_build_shard, (task,)) for task in todo]
        while pending:
            pending[0].wait(0.25)
            still = []
            for result in pending:
                if result.ready():
                    done = result.get()  # re-raises a worker's error here
                    built[done.number] = done
                    report(counters)
                else:
                    still.append(result)
            pending = still
            report(counters)
        pool.close()
        pool.join()


# -- verify ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class VerifyReport:
    """The outcome of `verify_dataset`: `problems` is empty when everything matched."""

    url: str
    shards: int
    samples: int
    bytes: int
    deep: bool
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_sample(sample: dict, manifest: Manifest) -> str | None:
    from PIL import Image

    key = sample["__key__"]
    image_field = next((f for f in IMAGE_FIELDS if f in sample), None)
    if image_field is None:
        return f"sample {key!r} has no image ({', '.join(k for k in sample if k != '__key__')})"
    try:
        with Image.open(io.BytesIO(sample[image_field])) as image:
            image.load()
    except Exception as exc:  # any decoder failure means the sample is unusable
        return f"sample {key!r}: {image_field} does not decode ({type(exc).__name__}: {exc})"
    if manifest.label_field:
        raw = sample.get(manifest.label_field)
        try:
            label = int(raw.decode("ascii")) if raw is not None else None
        except (UnicodeDecodeError, ValueError):
            label = None
        if label is None or not 0 <= label < max(1, manifest.num_classes):
            return f"sample {key!r}: label {raw!r} is not an integer in [0, {manifest.num_classes})"
    if "json" in sample:
        try:
            json.loads(sample["json"])
        except ValueError:
            return f"sample {key!r}: json member is not JSON"
    return None


def _verify_shard(store: Store, manifest: Manifest, shard: ShardInfo, deep: bool) -> tuple[list[str], int, int]:
    problems: list[str] = []
    try:
        actual = store.stat(shard.name).size
    except NotFound:
        return [f"{shard.name}: missing"], 0, 0
    if actual != shard.size:
        problems.append(f"{shard.name}: {actual} bytes, the manifest says {shard.size}")
    stored_index = None
    if shard.index:
        try:
            index_bytes = store.get_bytes(shard.index)
            if shard.index_checksum and checksum_of(index_bytes) != shard.index_checksum:
                problems.append(f"{shard.index}: checksum differs from the manifest")
            stored_index = SampleIndex.from_bytes(index_bytes)
            if (len(stored_index), stored_index.shard_size) != (shard.samples, shard.size):
                problems.append(
                    f"{shard.index}: describes {len(stored_index)} samples / {stored_index.shard_size} bytes, the manifest {shard.samples} / {shard.size}"
                )
        except NotFound:
            problems.append(f"{shard.index}: missing")
        except FormatError as exc:
            problems.append(f"{shard.index}: {exc}")
    if not deep:
        digest = hashlib.sha256()
        for chunk in store.get(shard.name):
            digest.update(chunk)
        if f"sha256:{digest.hexdigest()}" != shard.checksum:
            problems.append(f"{shard.name}: checksum differs from the manifest")
        return problems, shard.samples, actual
    bad: list[str] = []

    def check(sample: dict) -> None:
        problem = _check_sample(sample, manifest)
        if problem:
            bad.append(problem)

    try:
        index = scan_shard(store.get(shard.name), on_sample=check)
    except CorruptShard as exc:
        return problems + [f"{shard.name}: {exc}"], 0, actual
    if index.checksum != shard.checksum:
        problems.append(f"{shard.name}: checksum differs from the manifest")
    if len(index) != shard.samples:
        problems.append(f"{shard.name}: holds {len(index)} samples, the manifest says {shard.samples}")
    if stored_index is not None and not np.array_equal(stored_index.offsets, index.offsets):
        problems.append(f"{shard.index}: sample offsets do not match the shard")
    problems += [f"{shard.name}: {b}" for b in bad[:20]] + (
        [f"{shard.name}: … {len(bad) - 20} more bad samples"] if len(bad) > 20 else []
    )
    return problems, len(index), actual


def verify_dataset(
    dataset: str | Store,
    *,
    deep: bool = False,
    workers: int = 4,
    config: StoreConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Check every shard's size and checksum (and its sample index) against the manifest.

    `deep` also walks every shard: each sample must decode, carry a label in range and
    appear where its index says, and counts must match. `progress(done, total)` after each shard.

    >>> report = verify_dataset("swift://imagenet/train", deep=True)   # doctest: +SKIP
    >>> report.ok, report.problems[:1]                                  # doctest: +SKIP
    (True, ())
    """
    store = dataset if isinstance(dataset, Store) else open_store(dataset, config)
    try:
        manifest = Manifest.load(store)
    except (NotFound, FormatError) as exc:
        return VerifyReport(store.url, 0, 0, 0, deep, (f"{MANIFEST_NAME}: {exc}",))
    problems: list[str] = []
    samples = nbytes = 0
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="dlstore-verify") as pool:
        futures = [pool.submit(_verify_shard, store, manifest, shard, deep) for shard in manifest.shards]
        for done, future in enumerate(futures, 1):
            shard_problems, shard_samples, shard_bytes = future.result()
            problems += shard_problems
            samples += shard_samples
            nbytes += shard_bytes
            if progress is not None:
                progress(done, len(futures))
    if deep and samples != manifest.total_samples and not problems:
        problems.append(f"the shards hold {samples} samples, the manifest says {manifest.total_samples}")
    return VerifyReport(store.url, len(manifest.shards), samples, nbytes, deep, tuple(problems))


# -- index foreign shards --------------------------------------------------------------------
def index_dataset(
    dataset: str | Store,
    *,
    label_field: str = "cls",
    workers: int = 4,
    config: StoreConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Manifest:
    """Build sample indexes and `index.json` for the `.tar` shards under `dataset` (written
    by `webdataset.ShardWriter` or any other tool), in place.

    Labels are the integer `label_field` members; the class count is the largest label + 1
    (class names are then `"0"`, `"1"`, …). Shards without labels give an unlabelled manifest.

    >>> index_dataset("s3://bucket/laion-subset").total_samples       # doctest: +SKIP
    """
    store = dataset if isinstance(dataset, Store) else open_store(dataset, config)
    names = [info.key for info in store.list("") if info.key.endswith(".tar")]
    if not names:
        raise FormatError(f"{store.url}: expected WebDataset .tar shards, found none")

    def index_one(name: str) -> tuple[ShardInfo, set[str], int, bool]:
        fields: set[str] = set()
        top = -1
        unlabelled = False

        def collect(sample: dict) -> None:
            nonlocal top, unlabelled
            fields.update(k for k in sample if not k.startswith("__"))
            raw = sample.get(label_field)
            if raw is None:
                unlabelled = True
                return
            try:
                label = int(raw.decode("ascii").strip())
            except (UnicodeDecodeError, ValueError):
                raise FormatError(
                    f"{name}: sample {sample['__key__']!r} has a non-integer {label_field!r}: {raw[:20]!r}"
                ) from None
            if label < 0:
                raise FormatError(f"{name}: sample {sample['__key__']!r} has a negative label {label}")
            top = max(top, label)

        index = scan_shard(store.get(name), on_sample=collect)
        index_bytes = index.to_bytes()
        store.put(index_name(name), index_bytes)
        info = ShardInfo(
            name,
            index.shard_size,
            len(index),
            index.checksum,
            index_name(name),
            len(index_bytes),
            checksum_of(index_bytes),
        )
        return info, fields, top, unlabelled

    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="dlstore-index") as pool:
        futures = [pool.submit(index_one, name) for name in names]
        results = []
        for done, future in enumerate(futures, 1):
            results.append(future.result())
            if progress is not None:
                progress(done, len(futures))
    fields = set().union(*(r[1] for r in results))
    top = max(r[2] for r in results)
    labelled = top >= 0 and not any(r[3] for r in results)
    if top >= 0 and not labelled:
        log.warning("%s: some samples have no %r member; the manifest is unlabelled", store.url, label_field)
    manifest = Manifest(
        shards=tuple(r[0] for r in results),
        classes=tuple(str(i) for i in range(top + 1)) if labelled else (),
        fields=tuple(sorted(fields)),
        label_field=label_field if labelled else None,
        created=CreationInfo(tool="dlstore index", tool_version=_tool_version(), source_format="webdataset"),
    )
    manifest.save(store)
    return manifest
