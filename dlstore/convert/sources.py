"""Step 1 of a conversion, **list**: `list_source` turns a source folder or archive into a `Source`.
That holds the classes, every input with its label in sorted-id order, and a reader. No image
bytes are read. Each format has its lister: ImageNet in `imagenet.py`, CIFAR-10 and MNIST in
`arrays.py`, ImageFolder here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from dlstore.convert.arrays import cifar10_source, mnist_source
from dlstore.convert.imagenet import imagenet_source
from dlstore.convert.inputs import FileReader, Source, describe_found, subdirs, walk_class_dirs
from dlstore.convert.options import ConvertOptions, SkippedInput
from dlstore.errors import ConfigError, FormatError

__all__ = ["FORMATS", "list_source"]

FORMATS = ("imagenet", "imagefolder", "cifar10", "mnist")
#: Folder names that an ImageFolder tree's splits go by.
_SPLIT_NAMES = frozenset({"train", "training", "val", "valid", "validation", "test", "testing"})


def list_source(fmt: str, src: str | os.PathLike[str], options: ConvertOptions = ConvertOptions()) -> Source:
    """List `src` as a dataset of format `fmt`, one of `FORMATS`; `FormatError` if it is not one.

    >>> source = list_source("cifar10", "/data/cifar10", ConvertOptions(split="test"))  # doctest: +SKIP
    >>> len(source.items), source.classes[:2]                                            # doctest: +SKIP
    (10000, ['airplane', 'automobile'])
    """
    path = Path(src)
    if not path.exists():
        raise FormatError(f"{src}: no such file or directory")
    listers: dict[str, Callable[[Path, ConvertOptions], Source]] = {
        "imagenet": imagenet_source,
        "imagefolder": imagefolder_source,
        "cifar10": cifar10_source,
        "mnist": mnist_source,
    }
    if fmt not in listers:
        raise ConfigError(f"unknown source format {fmt!r}; expected one of {', '.join(FORMATS)}")
    source = listers[fmt](path, options)
    source.items.sort(key=lambda item: item.id)
    if not source.items:
        raise FormatError(f"{src}: found no {fmt} inputs for split {source.split!r}")
    return source


def imagefolder_source(src: Path, options: ConvertOptions) -> Source:
    """`<class>/<image>` folders, under `options.split` when given, like torchvision's ImageFolder."""
    root = src / options.split if options.split else src
    if not root.is_dir():
        raise FormatError(f"{root}: expected a folder of class sub-folders; found {describe_found(src)}")
    classes = subdirs(root)
    if not classes:
        raise FormatError(f"{root}: expected class sub-folders (<class>/<image>), found {describe_found(root)}")
    for name in classes:
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise FormatError(f"{root}: class folder {name!r} is not named in UTF-8; rename it") from None
    splits = [name for name in classes if name.lower() in _SPLIT_NAMES and subdirs(root / name)]
    if splits and not options.split:
        # Converted as they are, the splits would become the classes: every image labelled "train" or "val".
        raise ConfigError(
            f"{root} holds split folders ({', '.join(splits)}) of class folders, not class folders: "
            f"give --split {splits[0]} (and convert each split on its own)"
        )
    skipped: list[SkippedInput] = []
    items = walk_class_dirs(root, classes, skipped)
    reencode = not options.keep_format and any(not item.id.lower().endswith((".jpg", ".jpeg")) for item in items)
    return Source(
        "imagefolder", root.name, options.split or "", classes, items, FileReader(str(root)), reencode, skipped
    )
