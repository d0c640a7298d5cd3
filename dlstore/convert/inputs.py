"""What every source lister produces: `SourceItem`s and a `Source`. Also the readers that fetch an
item's bytes in a worker process, from files or tar members. Also the folder-walking helpers the
ImageNet and ImageFolder listers share.

Readers are pickled into worker processes, so they open nothing until their first `read`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from dlstore.convert.options import SkippedInput
from dlstore.errors import FormatError

__all__ = [
    "FileReader",
    "Source",
    "SourceItem",
    "TarReader",
    "describe_found",
    "image_extensions",
    "subdirs",
    "walk_class_dirs",
]


@dataclass(frozen=True, slots=True)
class SourceItem:
    """One input: a stable id, its label, its size in bytes or 0 when unknown, and where the reader
    finds it. The id is a relative path, `<wnid>/<member>` or `<batch>/<i>`."""

    id: str
    label: int
    size: int = 0
    offset: int = -1


class FileReader:
    """Inputs are files under `root`; an item's id is its relative path."""

    def __init__(self, root: str) -> None:
        self.root = root

    def read(self, item: SourceItem) -> bytes:
        with open(os.path.join(self.root, item.id), "rb") as file:
            return file.read()


class TarReader:
    """Inputs are members of one local tar, maybe nested, read with `pread` at a known offset."""

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


@dataclass
class Source:
    """A listed input dataset: classes, inputs in canonical sorted-id order, and a reader.

    `reencode` is True when the shards' image bytes are not the input bytes. Their sizes are then
    only known after encoding."""

    format: str
    name: str
    split: str
    classes: list[str]
    items: list[SourceItem]
    reader: Any
    reencode: bool
    skipped: list[SkippedInput] = field(default_factory=list)


def describe_found(path: Path, limit: int = 8) -> str:
    """What is at `path`, for an error that says what was expected and what was found."""
    try:
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    except OSError:
        return "nothing readable"
    if not names:
        return "an empty directory"
    return ", ".join(names[:limit]) + (f", … ({len(names)} entries)" if len(names) > limit else "")


def image_extensions() -> set[str]:
    """File extensions Pillow can open, in lower case, with the dot."""
    Image.init()
    return {ext.lower() for ext in Image.registered_extensions()}


def walk_class_dirs(root: Path, class_dirs: Sequence[str], skipped: list[SkippedInput]) -> list[SourceItem]:
    """Every image file under each class folder, walked recursively like torchvision's ImageFolder.
    Some are skipped, each with its reason: a folder walked already, or reached by a link out of
    its class. Such a link, into another class or up the tree, would give its images this class's
    label. So are files that are not regular: a pipe would block the run, a link to /dev/zero
    fill memory. So are links to nothing, and names that are not UTF-8."""
    extensions = image_extensions()
    top = os.path.realpath(root)
    classes = {name: os.path.realpath(root / name) for name in class_dirs}
    items = []
    for label, name in enumerate(class_dirs):
        others = [real for other, real in classes.items() if other != name]
        seen: set[tuple[int, int]] = set()  # (device, inode) of the folders walked in this class
        for folder, dirs, files in os.walk(root / name, followlinks=True):
            # Links are followed, as a class folder may link to another disk. Each real folder is
            # walked once: a link back up the tree would walk it again and again.
            here = os.stat(folder)
            if (here.st_dev, here.st_ino) in seen:
                dirs[:] = []
                skipped.append(SkippedInput(os.path.relpath(folder, root), "a link to a folder already walked"))
                continue
            seen.add((here.st_dev, here.st_ino))
            real = os.path.realpath(folder)
            if folder != str(root / name) and (_within(top, real) or any(_within(real, o) for o in others)):
                dirs[:] = []
                skipped.append(SkippedInput(os.path.relpath(folder, root), "a link out of its class folder"))
                continue
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            rel_folder = os.path.relpath(folder, root)
            for file in sorted(files):
                if file.startswith("."):
                    continue
                rel = f"{rel_folder}/{file}".replace(os.sep, "/")
                if os.path.splitext(file)[1].lower() not in extensions:
                    skipped.append(SkippedInput(rel, "not an image file extension"))
                    continue
                why, size = _regular_file(os.path.join(folder, file), rel)
                if why is not None:
                    skipped.append(SkippedInput(rel.encode("utf-8", "backslashreplace").decode(), why))
                    continue
                items.append(SourceItem(rel, label, size))
    return items


def _within(path: str, folder: str) -> bool:
    """Whether real path `path` is `folder` or inside it."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _regular_file(path: str, rel: str) -> tuple[str | None, int]:
    """Why the file is skipped, or None, and its size."""
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        return "a name that is not UTF-8", 0
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return "a link to nothing", 0
    except OSError as exc:
        return f"cannot be read ({exc.strerror})", 0
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file (a pipe, a device)", 0
    return None, info.st_size


def subdirs(path: Path) -> list[str]:
    """The visible sub-folders of `path`, sorted."""
    return sorted(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
