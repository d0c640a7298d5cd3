"""What a conversion is asked to do (`ConvertOptions`), and what it reports back. `ConvertProgress`
comes while it runs, `ConvertSummary` at the end."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from dlstore.errors import ConfigError
from dlstore.format.checksums import ALGORITHMS
from dlstore.format.manifest import Manifest

__all__ = ["ConvertOptions", "ConvertProgress", "ConvertSummary", "SkippedInput"]


@dataclass(frozen=True)
class ConvertOptions:
    """How to convert. Only the fields listed in `shaping()` change the shards' bytes.

    `split` is `train` or `val` for imagenet, and `train` or `test` for cifar10 and mnist. For
    imagefolder it is a sub-folder; None is the folder itself. `image_format` is `png` or `jpeg`,
    for cifar10 and mnist. `keep_format`, for imagefolder, stores non-JPEG images as they are, not
    as JPEG. `val_labels` points at an ImageNet ground-truth file when it is not beside the data.

    `checksum_algorithm` is the checksum of shards and indexes (`dlstore.format.checksums`). None,
    the default, keeps the one of the dataset at the destination, else XXH3-128. With
    `check_decode`, every JPEG input is decoded at 1/8 scale, as the loader's first decode of it
    would be. One that fails is skipped like any unreadable input. The manifest then says so
    (`Manifest.decode_checked`), and the loader decodes only each crop's rows from the first epoch
    on, not every row once per node.
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
    checksum_algorithm: str | None = None
    check_decode: bool = True

    def __post_init__(self) -> None:
        if self.checksum_algorithm is not None and self.checksum_algorithm not in ALGORITHMS:
            raise ConfigError(
                f"checksum_algorithm must be one of {sorted(ALGORITHMS)}, not {self.checksum_algorithm!r}"
            )
        if self.shard_size < 4096:
            raise ConfigError(
                f"shard_size {self.shard_size} is too small: at least 4096 bytes (a few hundred MB is usual)"
            )
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
            # Only when set, so a conversion without the check keeps the recipes, and so the
            # shards, of datasets converted without it.
            **({"check_decode": True} if self.check_decode else {}),
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
    """What a conversion made. `skipped` lists the inputs dropped by the shards built in this run.
    `skipped_earlier` counts those dropped by shards kept from an earlier run."""

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
