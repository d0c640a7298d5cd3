"""What the bench measures: `BenchConfig`, and the parsers the CLI hands its options through."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from dlstore.config import StoreConfig, parse_size
from dlstore.errors import ConfigError

__all__ = ["BenchConfig", "available_cores", "parse_int_list", "size_or_auto"]


def available_cores() -> int:
    """CPU cores this process may run on (affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class BenchConfig:
    """What to measure. `workers=()` means one worker per core; `demand_steps=None` means 20
    timed steps on a GPU and 3 on a CPU. `cache_dir` is where the bench's own temporary cache
    goes (default: the system temp dir); `cache_limit=""` sizes it to hold the dataset.

    >>> BenchConfig("file:///data/train", batch_sizes=(64, 128), workers=(2, 4)).batch_sizes
    (64, 128)
    """

    url: str
    batch_sizes: tuple[int, ...] = (256,)
    workers: tuple[int, ...] = ()
    procs: tuple[int, ...] = (1,)
    image_size: int = 224
    transform: str = "train"
    decode_on: str = "worker"  # or "device": JPEG decode on the GPU (nvJPEG), see DatasetConfig
    batches: int = 20
    stage_batches: int = 2
    model: str = "resnet50"
    device: str = "auto"
    amp: str = "auto"
    channels_last: bool = True
    compile: bool = False
    demand: bool = True
    demand_steps: int | None = None
    demand_warmup: int | None = None
    cache_dir: str = ""
    cache_limit: str | int = ""
    seed: int = 0
    store_config: StoreConfig | None = None

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ConfigError("batch_sizes must list at least one size, each at least 1")
        if self.workers and min(self.workers) < 0:
            raise ConfigError("workers must be 0 or more")
        if not self.procs or min(self.procs) < 1:
            raise ConfigError("procs must list at least one process count, each at least 1")
        if self.batches < 2:
            raise ConfigError("batches must be at least 2 (the first round, which starts the workers, is not timed)")
        if self.stage_batches < 1:
            raise ConfigError("stage_batches must be at least 1")
        if self.transform not in ("train", "eval"):
            raise ConfigError(f"transform must be 'train' or 'eval', not {self.transform!r}")
        if self.decode_on not in ("worker", "device"):
            raise ConfigError(f"decode_on must be 'worker' or 'device', not {self.decode_on!r}")

    @classmethod
    def quick(cls, url: str, **changes: Any) -> BenchConfig:
        """A few seconds on a laptop: small batches, few of them, ResNet-18 at 64 px.

        >>> BenchConfig.quick("file:///tmp/demo/train").model
        'resnet18'
        """
        preset: dict[str, Any] = dict(
            batch_sizes=(32,),
            image_size=64,
            batches=6,
            stage_batches=1,
            model="resnet18",
            demand_steps=2,
            demand_warmup=1,
        )
        return cls(url, **{**preset, **changes})

    @property
    def worker_counts(self) -> tuple[int, ...]:
        return self.workers or (available_cores(),)


def parse_int_list(text: str) -> tuple[int, ...]:
    """Parse a comma-separated list of integers (`--batch-sizes 32,64,128`).

    >>> parse_int_list("1, 2,4")
    (1, 2, 4)
    """
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"expected comma-separated integers, not {text!r}") from None
    if not values:
        raise ConfigError("expected at least one integer")
    return values


def size_or_auto(text: str) -> int | str:
    """`--cache-limit`: a size (`"2GB"`), or "auto"/"" for `BenchConfig`'s sized-to-the-dataset default.

    >>> size_or_auto("auto"), size_or_auto("1KB")
    ('', 1000)
    """
    return "" if text in ("", "auto") else parse_size(text)
