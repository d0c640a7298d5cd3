"""The ImageNet (ILSVRC2012) lister. It reads class folders named by WordNet id, or flat validation
images labelled from a ground-truth file: LOC_val_solution.csv, a `<filename> <wnid>` list or the
devkit. It also indexes the original tars in place. The outer tar and each per-class tar inside
it are walked header by header with `pread`, never extracted.
"""

from __future__ import annotations

import csv
import io
import os
import re
from pathlib import Path

from dlstore.convert.inputs import (
    FileReader,
    Source,
    SourceItem,
    TarReader,
    describe_found,
    image_extensions,
    subdirs,
    walk_class_dirs,
)
from dlstore.convert.options import ConvertOptions, SkippedInput
from dlstore.errors import ConfigError, CorruptShard, FormatError
from dlstore.format.shards import TarMember, iter_members

__all__ = ["imagenet_source"]

_WNID_RE = re.compile(r"n\d{8}\Z")
_IMAGENET_EXPECTED = (
    "an ImageNet (ILSVRC2012) source: a folder with train/<wnid>/*.JPEG and val/ (as <wnid> folders, "
    "or flat with LOC_val_solution.csv or a '<filename> <wnid>' list), or with ILSVRC2012_img_train.tar / "
    "ILSVRC2012_img_val.tar, or one of those tars itself"
)
_VAL_LABEL_FILES = ("LOC_val_solution.csv", "val_labels.csv", "val_labels.txt", "val.txt")
_DEVKIT_GROUND_TRUTH = "ILSVRC2012_validation_ground_truth.txt"


def imagenet_source(src: Path, options: ConvertOptions) -> Source:
    """Find the split in any of the usual layouts, listed in `_IMAGENET_EXPECTED`, and list it."""
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
    extensions = image_extensions()
    has_images = split == "val" and any(p.suffix.lower() in extensions for p in src.iterdir() if p.is_file())
    if any(_WNID_RE.match(d) for d in subdirs(src)) or has_images:
        return _imagenet_folder(src, split, options, search=[src, src.parent])
    hint = "; for class folders not named by WordNet id use the imagefolder format" if subdirs(src) else ""
    raise FormatError(f"{src}: expected {_IMAGENET_EXPECTED}; found {describe_found(src)}{hint}")


def _imagenet_folder(folder: Path, split: str, options: ConvertOptions, search: list[Path]) -> Source:
    """`<wnid>/` class folders, or flat images labelled from a ground-truth file found in `search`."""
    dirs = subdirs(folder)
    bad = [d for d in dirs if not _WNID_RE.match(d)]
    if bad:
        raise FormatError(
            f"{folder}: expected class folders named by WordNet id (like n01440764), found {bad[:5]}; "
            "use the imagefolder format for other class names"
        )
    skipped: list[SkippedInput] = []
    if dirs:
        items = walk_class_dirs(folder, dirs, skipped)
        return Source("imagenet", folder.name, split, dirs, items, FileReader(str(folder)), False, skipped)
    # A flat folder of validation images: labels come from the ground-truth file.
    extensions = image_extensions()
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in extensions)
    if not files:
        raise FormatError(f"{folder}: expected {_IMAGENET_EXPECTED}; found {describe_found(folder)}")
    labels, classes, origin = _val_labels(options, search)
    items = _label_flat([(p.name, p.stat().st_size, -1) for p in files], labels, classes, origin)
    return Source("imagenet", folder.name, split, classes, items, FileReader(str(folder)), False, skipped)


def _imagenet_tar(path: Path, split: str, options: ConvertOptions) -> Source:
    """`ILSVRC2012_img_train.tar`, with per-class tars inside, or the flat `ILSVRC2012_img_val.tar`."""
    extensions = image_extensions()
    with open(path, "rb", buffering=0) as file:
        try:
            members = list(iter_members(file, data=False))
        except CorruptShard as exc:
            raise FormatError(f"{path}: expected {_IMAGENET_EXPECTED}; it is not a readable tar ({exc})") from None
        nested = [m for m in members if m.name.endswith(".tar")]
        images = [m for m in members if os.path.splitext(m.name)[1].lower() in extensions]
        if nested and len(nested) == len(members):
            classes, items = _list_class_tars(path, file.fileno(), nested)
            return Source("imagenet", path.name, split, classes, items, TarReader(str(path)), False)
        if images and len(images) == len(members):
            labels, classes, origin = _val_labels(options, [path.parent, path.parent.parent])
            flat = [(m.name.rsplit("/", 1)[-1], m.size, m.data_offset) for m in images]
            items = _label_flat(flat, labels, classes, origin)
            return Source("imagenet", path.name, split, classes, items, TarReader(str(path)), False)
    sample = ", ".join(m.name for m in members[:5]) or "no files"
    raise FormatError(f"{path}: expected a tar of per-class <wnid>.tar files or a flat tar of images; found {sample}")


def _list_class_tars(path: Path, fd: int, nested: list[TarMember]) -> tuple[list[str], list[SourceItem]]:
    """The wnids and items of the per-class `<wnid>.tar` members of the train tar, read in place."""
    items: list[SourceItem] = []
    classes: list[str] = []
    for member in sorted(nested, key=lambda m: m.name):
        wnid = member.name.rsplit("/", 1)[-1][:-4]
        if not _WNID_RE.match(wnid):
            raise FormatError(f"{path}: expected per-class tars named <wnid>.tar, found {member.name!r}")
        window = _FileWindow(fd, member.data_offset, member.size)
        try:
            inner = list(iter_members(window, data=False, base_offset=member.data_offset))
        except CorruptShard as exc:
            raise FormatError(f"{path}: member {member.name!r} is not a readable tar ({exc})") from None
        label = len(classes)
        classes.append(wnid)
        items += [SourceItem(f"{wnid}/{m.name}", label, m.size, m.data_offset) for m in inner]
    return classes, items


class _FileWindow:
    """A read-only, seekable view of `[start, start + size)` of an open file, such as a nested tar."""

    def __init__(self, fd: int, start: int, size: int) -> None:
        self.fd, self.start, self.size, self.pos = fd, start, size, 0

    def seekable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n < 0 else min(n, self.size - self.pos)
        data = os.pread(self.fd, n, self.start + self.pos) if n > 0 else b""
        self.pos += len(data)
        return data

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        """Seek as a file does. Without `tell` and `SEEK_END` the tar reader would take this for a
        stream, read every member's bytes to list them, and find no truncated member."""
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence]
        self.pos = max(0, min(self.size, base + offset))
        return self.pos


def _val_labels(options: ConvertOptions, search: list[Path]) -> tuple[dict[str, str], list[str], str]:
    """Ground truth for flat validation images: {image stem: wnid}, sorted wnids, the file's name.

    It is looked for in `search` and their `ILSVRC2012_devkit_t12/data/`. It is
    LOC_val_solution.csv, a `<filename> <wnid>` list, or the devkit's
    ILSVRC2012_validation_ground_truth.txt with its meta.mat."""
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
    """`LOC_val_solution.csv`, whose `PredictionString` starts with the wnid, or lines of
    `<filename> <wnid>`."""
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
        from scipy.io import loadmat  # optional and heavy: only the devkit's meta.mat needs it
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
    """Items for flat files given as name, size, offset; each needs a label in the ground truth."""
    index = {wnid: i for i, wnid in enumerate(classes)}
    missing = [name for name, _, _ in files if os.path.splitext(name)[0] not in labels]
    if missing:
        raise FormatError(f"{len(missing)} validation image(s) have no label in {origin}, e.g. {missing[0]!r}")
    return [SourceItem(name, index[labels[os.path.splitext(name)[0]]], size, offset) for name, size, offset in files]
