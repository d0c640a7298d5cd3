"""What the bench measures: `BenchConfig`, and the parsers the CLI hands its options through."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dlstore.config import DataConfig, parse_size
from dlstore.errors import ConfigError
from dlstore.loader.config import ENGINES
from dlstore.world import available_cores

__all__ = ["QUICK_DATA", "BenchConfig", "available_cores", "parse_int_list", "size_or_auto"]


# The data settings of `BenchConfig.quick`: small batches of small images.
QUICK_DATA: dict[str, Any] = {"image_size": 64, "batch_size": 32}

# DataConfig fields that `quick` accepts among its changes, unless the bench has one so named.
_DATA_FIELDS = frozenset(f.name for f in dataclasses.fields(DataConfig))


@dataclass(frozen=True)
class BenchConfig:
    """What to measure, on which data.

    `data` is the `DataConfig` the loader would get. Its `batch_size` and `workers` are the
    sweeps' defaults; with no `workers`, one worker per core. `engines` are the loader engines
    each worker count runs on. "auto" is what the trainer would get; "threads,processes" shows
    which is faster here. `demand_steps=None` means 20 timed steps on a GPU and 3 on a CPU.
    `cache_dir` holds the bench's own temporary cache, by default in the system temp dir.
    `cache_limit=""` sizes it to hold the dataset.

    >>> BenchConfig("file:///data/train", batch_sizes=(64, 128), workers=(2, 4)).batch_sizes
    (64, 128)
    """

    data: DataConfig | str
    batch_sizes: tuple[int, ...] = ()
    workers: tuple[int, ...] = ()
    procs: tuple[int, ...] = (1,)
    engines: tuple[str, ...] = ("auto",)
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

    def __post_init__(self) -> None:
        if isinstance(self.data, str):
            object.__setattr__(self, "data", DataConfig(self.data))
        if not self.batch_sizes:
            object.__setattr__(self, "batch_sizes", (self.data.batch_size,))
        if min(self.batch_sizes) < 1:
            raise ConfigError("batch_sizes must list at least one size, each at least 1")
        if self.workers and min(self.workers) < 0:
            raise ConfigError("workers must be 0 or more")
        if not self.engines or any(e not in ("auto", *ENGINES) for e in self.engines):
            raise ConfigError(f"engines must list some of auto, {', '.join(ENGINES)}; not {self.engines!r}")
        if not self.procs or min(self.procs) < 1:
            raise ConfigError("procs must list at least one process count, each at least 1")
        if self.batches < 2:
            raise ConfigError("batches must be at least 2 (the first round, which starts the workers, is not timed)")
        if self.stage_batches < 1:
            raise ConfigError("stage_batches must be at least 1")
        if self.data.transform.preset not in ("train", "eval"):
            raise ConfigError(f"transform must be 'train' or 'eval', not {self.data.transform.preset!r}")

    @classmethod
    def quick(cls, data: DataConfig | str, **changes: Any) -> BenchConfig:
        """A few seconds on a laptop: few small batches, ResNet-18 at 64 px.

        Given a URL, the data settings start from `QUICK_DATA`; a `DataConfig` is used as it is.
        `changes` may name bench fields and `DataConfig` fields alike.

        >>> BenchConfig.quick("file:///tmp/demo/train").model
        'resnet18'
        """
        own = {f.name for f in dataclasses.fields(cls)}  # workers, cache_*: the bench's own
        data_changes = {k: changes.pop(k) for k in list(changes) if k in _DATA_FIELDS and k not in own}
        if isinstance(data, str):
            data = DataConfig(data, **QUICK_DATA)
        data = data.replace(**data_changes) if data_changes else data
        preset: dict[str, Any] = dict(batches=6, stage_batches=1, model="resnet18", demand_steps=2, demand_warmup=1)
        return cls(data, **{**preset, **changes})

    @property
    def url(self) -> str:
        return self.data.url

    @property
    def image_size(self) -> int:
        return self.data.image_size

    @property
    def worker_counts(self) -> tuple[int, ...]:
        return self.workers or (self.data.workers if self.data.workers is not None else available_cores(),)

    def to_dict(self) -> dict[str, Any]:
        """For the report: the data settings beside the bench's, no credentials."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "data"}
        out = {**self.data.to_dict(), **out, "workers": self.worker_counts}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def parse_int_list(text: str) -> tuple[int, ...]:
    """Parse a comma-separated list of integers, as in `--batch-sizes 32,64,128`.

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
    """`--cache-limit`: a size such as `"2GB"`, or "auto" or "" to fit the dataset.

    >>> size_or_auto("auto"), size_or_auto("1KB")
    ('', 1000)
    """
    return "" if text in ("", "auto") else parse_size(text)
