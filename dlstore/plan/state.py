"""The plan's inputs, validated and JSON-able: `PlanConfig` decides an epoch's order apart from the
world. `EpochState`, a history of `Segment`s, says how far an epoch has run."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from dlstore.errors import ConfigError
from dlstore.world import World

__all__ = ["EpochState", "PlanConfig", "Segment", "check_int", "check_world"]


def check_int(name: str, value: object, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def set_ints(obj: object, **minimums: int | None) -> None:
    """Validate a frozen dataclass's integer fields and store them as plain, JSON-able ints."""
    for name, minimum in minimums.items():
        object.__setattr__(obj, name, check_int(name, getattr(obj, name), minimum))


def check_world(world_size: int, local_world_size: int) -> None:
    check_int("world_size", world_size, 1)
    check_int("local_world_size", local_world_size, 1)
    if world_size % local_world_size:
        raise ConfigError(f"world_size {world_size} is not a multiple of local_world_size {local_world_size}")


@dataclass(frozen=True)
class PlanConfig:
    """What decides an epoch's order, apart from the world.

    `shuffle_window` is how many shards have their samples mixed together, in the node's per-epoch
    shard order. A larger window mixes more, and makes the node cache hold more at once. With
    `window_ramp`, each epoch's first `shuffle_window` pieces are split into windows that double.
    The first is the fewest pieces, two at least, that hold the node's first step. A cold cache then
    starts after those downloads, not a whole window's. False gives plain windows, the order in
    which older saved states resume.

    >>> PlanConfig(seed=0, batch_size=256)
    PlanConfig(seed=0, batch_size=256, drop_last=False, shuffle=True, shuffle_window=4, window_ramp=True)
    """

    seed: int
    batch_size: int
    drop_last: bool = False
    shuffle: bool = True
    shuffle_window: int = 4
    window_ramp: bool = True

    def __post_init__(self) -> None:
        set_ints(self, seed=None, batch_size=1, shuffle_window=1)
        if not all(isinstance(v, bool) for v in (self.drop_last, self.shuffle, self.window_ramp)):
            raise ConfigError("drop_last, shuffle and window_ramp must be bools")


@dataclass(frozen=True)
class Segment:
    """A stretch of an epoch run by one world: `steps` global steps of `batch_size` per rank.

    >>> Segment(world_size=16, local_world_size=8, batch_size=64, steps=100)
    Segment(world_size=16, local_world_size=8, batch_size=64, steps=100)
    """

    world_size: int
    local_world_size: int
    batch_size: int
    steps: int

    def __post_init__(self) -> None:
        set_ints(self, world_size=1, local_world_size=1, batch_size=1, steps=0)
        check_world(self.world_size, self.local_world_size)

    def same_world(self, world_size: int, local_world_size: int, batch_size: int) -> bool:
        """Whether a run with these settings, batch size included, simply continues this segment."""
        return (self.world_size, self.local_world_size, self.batch_size) == (world_size, local_world_size, batch_size)


@dataclass(frozen=True)
class EpochState:
    """The loader's position: which epoch, and the segments of it already run.

    `advance` records `steps` more steps done by `world` with `batch_size`. It merges them into the
    last segment when that had the same world and batch size. Call it on the latest state with the
    steps since then. Or call it on the state you resumed from, with all the steps since the resume.
    Never both.

    >>> s = EpochState(epoch=3).advance(World(0, 8, 4), batch_size=32, steps=10)
    >>> s = s.advance(World(0, 8, 4), batch_size=32, steps=5)
    >>> s.history, s.steps_done
    ((Segment(world_size=8, local_world_size=4, batch_size=32, steps=15),), 15)
    >>> EpochState.from_dict(s.to_dict()) == s
    True
    """

    epoch: int
    history: tuple[Segment, ...] = ()

    def __post_init__(self) -> None:
        set_ints(self, epoch=0)
        if not isinstance(self.history, tuple) or not all(isinstance(s, Segment) for s in self.history):
            raise ConfigError("history must be a tuple of Segment")

    @property
    def steps_done(self) -> int:
        return sum(s.steps for s in self.history)

    def advance(self, world: World, batch_size: int, steps: int) -> EpochState:
        check_int("steps", steps, 0)
        if steps == 0:
            return self
        last = self.history[-1] if self.history else None
        if last is not None and last.same_world(world.world_size, world.local_world_size, batch_size):
            merged = Segment(last.world_size, last.local_world_size, last.batch_size, last.steps + steps)
            return EpochState(self.epoch, self.history[:-1] + (merged,))
        added = Segment(world.world_size, world.local_world_size, batch_size, steps)
        return EpochState(self.epoch, self.history + (added,))

    def to_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "history": [
                {
                    "world_size": s.world_size,
                    "local_world_size": s.local_world_size,
                    "batch_size": s.batch_size,
                    "steps": s.steps,
                }
                for s in self.history
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> EpochState:
        try:
            history = tuple(
                Segment(
                    world_size=s["world_size"],
                    local_world_size=s["local_world_size"],
                    batch_size=s["batch_size"],
                    steps=s["steps"],
                )
                for s in data["history"]
            )
            return cls(epoch=data["epoch"], history=history)
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"malformed epoch state {data!r}: {exc}") from exc
