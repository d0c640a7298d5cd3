"""The benchmarks' data, made one way: generated JPEGs, their shards, and copies in Swift.

Every generator is seeded, so a conversion of the same images gives the same shards.
Data made under a work directory is reused by the next run with the same sizes.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from dlstore.config import StoreConfig
from dlstore.convert import ConvertOptions, convert
from dlstore.demo.datagen import make_imagenet
from dlstore.format.checksums import DEFAULT_ALGORITHM
from dlstore.storage import open_store
from tests.support.loader_support import write_dataset
from tests.support.swift_server import read_env_file

#: ImageNet-like images: about 100 KB as JPEGs.
IMAGE_SIZE = (400, 350)


class Data(NamedTuple):
    url: str  # the shards, as dlstore reads them
    store_dir: Path  # the same shard files, as webdataset reads them
    folder: Path  # the JPEGs they were made from, an ImageFolder
    cache_dir: str  # dlstore's shard cache, shared by every dlstore run


def make_part(part: tuple[str, int, int, tuple[int, int], int]) -> None:
    root, classes, per_class, size, seed = part
    make_imagenet(root, num_classes=classes, train_per_class=per_class, val_per_class=1, image_size=size, seed=seed)


def make_images(train: Path, images: int, classes: int, size: tuple[int, int], procs: int) -> None:
    """An ImageFolder of `images` generated JPEGs of `size` under `train`.

    The count is rounded down to a multiple of `classes`. `procs` processes make it,
    one seed each.
    """
    per_class = max(1, images // classes)
    procs = max(1, min(procs, per_class))
    counts = [per_class // procs + (i < per_class % procs) for i in range(procs)]
    parts = [(str(train.parent.parent / f"part{i}"), classes, n, size, i) for i, n in enumerate(counts)]
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        pool.map(make_part, parts)
    for number, (root, *_rest) in enumerate(parts):
        for class_dir in sorted((Path(root) / "train").iterdir()):
            target = train / class_dir.name
            target.mkdir(parents=True, exist_ok=True)
            for image in class_dir.iterdir():
                image.rename(target / f"p{number}_{image.name}")
        shutil.rmtree(root)


def prepare_data(workdir: Path, images: int, shards: int) -> Data:
    """About `images` JPEGs in 10 classes, and the same JPEGs in `shards` shards.

    They are made once per size under `workdir`.
    """
    classes = min(10, images)
    per_class = max(1, images // classes)
    root = workdir / f"imagenet-{classes}x{per_class}-{shards}-shards"
    store_dir = root / "store" / "train"
    if not (store_dir / "index.json").exists():
        shutil.rmtree(root, ignore_errors=True)  # what an interrupted run left
        procs = len(os.sched_getaffinity(0))
        make_images(root / "source" / "train", classes * per_class, classes, IMAGE_SIZE, procs)
        options = ConvertOptions(samples_per_shard=-(-classes * per_class // shards), workers=procs)
        convert("imagefolder", root / "source" / "train", f"file://{store_dir}", options)
    return Data(f"file://{store_dir}", store_dir, root / "source" / "train", str(root / "cache"))


def upload_to_swift(
    root: Path,
    env: Mapping[str, str],
    samples_per_shard: int,
    checksum_algorithm: str = DEFAULT_ALGORITHM,
    check_decode: bool = True,
) -> tuple[str, StoreConfig]:
    """The images under `root/source` converted straight into Swift.

    Each size, algorithm and decode check has its own prefix, so runs leave each
    other's data in place.
    """
    import swiftclient

    config = StoreConfig.from_env(env)
    swift = config.swift
    key = swift.key.reveal() if swift.key else None
    swiftclient.Connection(swift.auth_url, swift.user, key).put_container("bench")
    url = f"swift://bench/train-{samples_per_shard}"
    url += "" if checksum_algorithm == DEFAULT_ALGORITHM else f"-{checksum_algorithm}"
    url += "" if check_decode else "-unchecked"
    options = ConvertOptions(
        split="train",
        samples_per_shard=samples_per_shard,
        workers=1,
        checksum_algorithm=checksum_algorithm,
        check_decode=check_decode,
        overwrite=True,  # data an older dlstore made is rebuilt, not refused
    )
    convert("imagenet", root / "source", url, options, config=config)
    return url, config


def write_bench_dataset(root: str, shards: int = 48, samples: int = 16) -> str:
    """A `file://` dataset of `shards` shards of `samples` tiny JPEGs each; returns its URL."""
    url = f"file://{root}"
    write_dataset(open_store(url), [samples] * shards)
    return url


def make_payload(size: int) -> bytes:
    """`size` bytes that do not compress: a random MiB repeated."""
    block = os.urandom(2**20)
    return (block * (size // len(block) + 1))[:size]


def store_env(env_file: str | None) -> Mapping[str, str]:
    """The store's credentials: from `env_file` (a swift_server env.sh), else the environment."""
    return read_env_file(env_file) if env_file else os.environ
