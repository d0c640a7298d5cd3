"""The epoch plan: which samples each rank reads, in which order, as pure functions.

Everything here is a function of (shard sizes, `PlanConfig`, epoch, world, history):
numpy arrays in, arrays out, no I/O and no state. The loader calls `rank_plan` once per
epoch (and once per resume) and reads the rank's batches from the returned `RankPlan`.

How an epoch is planned
-----------------------
1. Shards are assigned to *nodes* (not ranks) by a greedy balanced assignment
   (`assign_shards`): shards in a seeded random order, biggest first, each to the node with
   the fewest samples so far (ties to the lowest node id). It depends on the seed and the
   number of nodes only, never on the epoch, so a node reads the same shards every epoch and
   a warm node cache stays warm (DESIGN invariant 5).
2. Each epoch, each node orders its shards by a permutation drawn from (seed, epoch, node),
   cuts that order into windows of `shuffle_window` shards and permutes the samples inside
   each window (invariant 6: orders change every epoch, and a batch mixes several shards).
3. The node's stream is dealt to its local ranks interleaved (position i to local rank
   i % local_world_size), so all ranks of a node work on the same window of shards at the
   same time and the node cache's working set stays at about one window.
4. Ranks are made equal (invariant 2): every rank gets L samples, L = the largest rank's
   count rounded up to a multiple of the batch size; a short rank repeats its own samples
   cyclically (else its node's, else, only when its node has no samples at all, the epoch's),
   and says so in `RankPlan.is_padding`. With `drop_last`, L = the smallest count rounded
   down instead, and each rank reports what it dropped in `RankPlan.dropped`.

Bound on padding (and on dropping): per rank, at most ``batch_size + ceil(s_max / local_world_size)``
samples, where ``s_max`` is the largest shard's sample count. Why: the greedy assignment keeps
node totals within ``s_max`` of each other, the interleaved deal keeps a node's ranks within one
sample of each other, and rounding to whole batches adds at most ``batch_size - 1``. A re-deal
after a change of node count (below) is balanced to one sample, so there the bound is
``batch_size``.

Progress and exact resume (invariant 4)
---------------------------------------
DDP ranks step in lockstep, so progress within an epoch is one number per world: global steps
done. A world (world size, local world size, batch size) that ran `steps` steps is a `Segment`;
an epoch's progress is the tuple of its segments (`EpochState.history`). `rank_plan` replays
that history: the first segment's plan is the fresh plan above; each later segment plans what
the previous one left unread:

* same world and batch size: the previous plan simply continues after the consumed steps, so
  the order delivered (padding included) is exactly the uninterrupted one;
* otherwise the unread remainder is re-dealt. Each old node's remainder is rebuilt in its
  stream order. If the number of nodes is unchanged, node n keeps its own remainder (perfect
  locality) and only the deal to its local ranks changes. If it changed, the old nodes'
  remainders are concatenated in node order and cut into equal contiguous pieces, one per new
  node. A re-deal only pads, never drops, so an interrupted and resumed epoch delivers exactly
  the real samples of the uninterrupted one (its first segment decides what `drop_last` drops).

The trade-off (DESIGN: "Invariants 4 and 5 pull against each other")
----------------------------------------------------------------------
Ownership of whole shards by nodes gives full locality in the steady state, with plain
whole-shard reads and no fixed partition count, but it costs:

* balance at shard granularity: node totals can differ by a whole shard, so padding (or
  dropping) is a fraction of about 1 / (shards per node) of the epoch. ImageNet in 1000 shards
  on 8 nodes x 8 GPUs, batch 256: 1.0% padding (0.25% dropped with drop_last); on 64 nodes x 1
  GPU: 3.6% (4.1%). Keep shards per node in the hundreds, or shards smaller, on large jobs;
* the epoch's order depends on the number of nodes: a run restarted at a new epoch on another
  node count sees a different (equally valid) order, not just a different partition;
* after a mid-epoch change of node count, each cut between pieces can split one window, so up
  to ``(num_nodes - 1) * shuffle_window`` shards are read by two nodes in that epoch, and nodes
  read shards their cache has not seen. The next epoch is planned afresh for the new world;
* resuming replays every segment's plan: the cost grows with the number of world changes in
  the epoch (each replay is one vectorised plan, well under a second for ImageNet).

The alternatives in DESIGN (canonical partitions as in mosaicml/streaming, or one global
sequence with ranged reads) keep the order independent of the node count but need either a
partition count fixed in advance or byte-range reads for locality.

Randomness is a splitmix64 hash of (purpose, seed, epoch, node, id) rather than a numpy
generator, whose streams numpy does not promise to keep across versions: a run can resume
exactly after the library under it was upgraded.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dlstore.errors import ConfigError
from dlstore.world import World

__all__ = [
    "EpochState",
    "PlanConfig",
    "RankPlan",
    "Segment",
    "assign_shards",
    "locate",
    "rank_plan",
    "shard_offsets",
    "world_plans",
]


# --------------------------------------------------------------------------- validation


def _check_int(name: str, value: object, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _set_ints(obj: object, **minimums: int | None) -> None:
    """Validate a frozen dataclass's integer fields and store them as plain ints (JSON-able)."""
    for name, minimum in minimums.items():
        object.__setattr__(obj, name, _check_int(name, getattr(obj, name), minimum))


def _check_world(world_size: int, local_world_size: int) -> None:
    _check_int("world_size", world_size, 1)
    _check_int("local_world_size", local_world_size, 1)
    if world_size % local_world_size:
        raise ConfigError(f"world_size {world_size} is not a multiple of local_world_size {local_world_size}")


def _as_sizes(shard_sizes: Sequence[int] | np.ndarray) -> np.ndarray:
    sizes = np.asarray(shard_sizes)
    if sizes.ndim != 1:
        raise ConfigError(f"shard_sizes must be one-dimensional, got shape {sizes.shape}")
    if sizes.size and not np.issubdtype(sizes.dtype, np.integer):
        raise ConfigError(f"shard_sizes must be integers, got dtype {sizes.dtype}")
    sizes = sizes.astype(np.int64)
    if sizes.size and sizes.min() < 0:
        raise ConfigError("shard_sizes must not be negative")
    return sizes


# --------------------------------------------------------------------------- public types


@dataclass(frozen=True)
class PlanConfig:
    """What decides an epoch's order, apart from the world.

    `shuffle_window` is how many shards (in the node's per-epoch shard order) have their
    samples mixed together: larger mixes more, and makes the node cache hold more at once.

    >>> PlanConfig(seed=0, batch_size=256)
    PlanConfig(seed=0, batch_size=256, drop_last=False, shuffle=True, shuffle_window=4)
    """

    seed: int
    batch_size: int
    drop_last: bool = False
    shuffle: bool = True
    shuffle_window: int = 4

    def __post_init__(self) -> None:
        _set_ints(self, seed=None, batch_size=1, shuffle_window=1)
        if not isinstance(self.drop_last, bool) or not isinstance(self.shuffle, bool):
            raise ConfigError("drop_last and shuffle must be bools")


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
        _set_ints(self, world_size=1, local_world_size=1, batch_size=1, steps=0)
        _check_world(self.world_size, self.local_world_size)

    def same_world(self, world_size: int, local_world_size: int, batch_size: int) -> bool:
        """Whether a run with these settings simply continues this segment (batch size included)."""
        return (self.world_size, self.local_world_size, self.batch_size) == (world_size, local_world_size, batch_size)


@dataclass(frozen=True)
class EpochState:
    """The loader's position: which epoch, and the segments of it already run.

    `advance` records `steps` more steps done by `world` with `batch_size`; it merges into the
    last segment when that segment had the same world and batch size. Use it either on the
    latest state with the steps since then, or on the state you resumed from with all the
    steps since the resume; not both.

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
        _set_ints(self, epoch=0)
        if not isinstance(self.history, tuple) or not all(isinstance(s, Segment) for s in self.history):
            raise ConfigError("history must be a tuple of Segment")

    @property
    def steps_done(self) -> int:
        return sum(s.steps for s in self.history)

    def advance(self, world: World, batch_size: int, steps: int) -> EpochState:
        _check_int("steps", steps, 0)
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


@dataclass(frozen=True, eq=False)
class RankPlan:
    """What one rank reads for the rest of an epoch, batch by batch.

    `ids` are global sample ids (see `locate`), `num_batches * batch_size` of them; batch j
    is ``ids[j * batch_size:(j + 1) * batch_size]``. Batch 0 is the epoch's global step
    `first_step` (non-zero after a resume). `shards[i]` is the shard of `ids[i]`. `dropped`
    holds the samples of this rank's share that `drop_last` left out of the epoch (empty after
    a re-deal, which never drops). The arrays are read-only.

    >>> p = rank_plan([3, 3], PlanConfig(seed=0, batch_size=2, shuffle=False), 0, World(0, 1, 1))
    >>> p.num_batches, p.batch(2)
    (3, (array([4, 5]), array([False, False])))
    """

    rank: int
    world_size: int
    local_world_size: int
    batch_size: int
    first_step: int
    ids: np.ndarray
    is_padding: np.ndarray
    shards: np.ndarray
    dropped: np.ndarray

    @property
    def num_batches(self) -> int:
        return len(self.ids) // self.batch_size

    @property
    def num_padding(self) -> int:
        return int(self.is_padding.sum())

    def batch(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch j's sample ids and padding mask."""
        sl = self._batch_slice(j)
        return self.ids[sl], self.is_padding[sl]

    def batch_shards(self, j: int) -> np.ndarray:
        """The shards batch j reads, in the order it first needs them."""
        return _unique_in_order(self.shards[self._batch_slice(j)])

    def shards_needed(self, start_batch: int = 0) -> np.ndarray:
        """The shards read from batch `start_batch` on, in the order they are first needed."""
        _check_int("start_batch", start_batch, 0)
        return _unique_in_order(self.shards[start_batch * self.batch_size :])

    def _batch_slice(self, j: int) -> slice:
        if not 0 <= j < self.num_batches:
            raise IndexError(f"batch {j} out of range 0..{self.num_batches - 1}")
        return slice(j * self.batch_size, (j + 1) * self.batch_size)


# --------------------------------------------------------------------------- sample ids


def shard_offsets(shard_sizes: Sequence[int] | np.ndarray) -> np.ndarray:
    """The global id of each shard's first sample (the exclusive cumulative sum of sizes).

    >>> shard_offsets([3, 0, 2]).tolist()
    [0, 3, 3]
    """
    sizes = _as_sizes(shard_sizes)
    return np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64) if sizes.size else sizes


def locate(ids: Sequence[int] | np.ndarray, shard_sizes: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split global sample ids into (shard index, index within the shard) arrays.

    >>> shard, index = locate([0, 3, 4], [3, 0, 2])
    >>> shard.tolist(), index.tolist()
    ([0, 2, 2], [0, 0, 1])
    """
    sizes = _as_sizes(shard_sizes)
    ids = np.asarray(ids, dtype=np.int64)
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if ends.size else 0
    if ids.size and (ids.min() < 0 or ids.max() >= total):
        raise ConfigError(f"sample ids must lie in [0, {total})")
    shard = np.searchsorted(ends, ids, side="right").astype(np.int64)
    return shard, ids - (ends[shard] - sizes[shard])


# --------------------------------------------------------------------------- randomness

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
# One tag per use, so the shard assignment, the shard order and the sample order are
# independent streams even when their other inputs coincide.
_TAG_ASSIGN, _TAG_SHARD_ORDER, _TAG_SAMPLE_ORDER = 1, 2, 3


def _mix64(x: int) -> int:
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def _stream_key(*parts: int) -> int:
    key = 0
    for part in parts:
        key = _mix64(key ^ _mix64(int(part) + _GOLDEN))
    return key


def _hash(key: int, values: np.ndarray) -> np.ndarray:
    """splitmix64 of each value under `key`: uint64 arrays wrap on overflow, as intended."""
    z = values.astype(np.uint64) * np.uint64(_GOLDEN) + np.uint64(key)
    z ^= z >> np.uint64(30)
    z *= np.uint64(_MIX1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_MIX2)
    z ^= z >> np.uint64(31)
    return z


# --------------------------------------------------------------------------- the fresh plan


def assign_shards(
    shard_sizes: Sequence[int] | np.ndarray, num_nodes: int, *, seed: int, shuffle: bool = True
) -> np.ndarray:
    """The node that owns each shard, for every epoch of a job with `num_nodes` nodes.

    Greedy and balanced: shards in a seeded random order (index order without `shuffle`),
    stably sorted biggest first, each to the node with the fewest samples so far, ties to the
    lowest node id. Node totals then differ by at most the largest shard.

    >>> assign_shards([10, 10, 10, 10, 1], 2, seed=0, shuffle=False).tolist()
    [0, 1, 0, 1, 0]
    """
    sizes = _as_sizes(shard_sizes)
    _check_int("num_nodes", num_nodes, 1)
    _check_int("seed", seed)
    if shuffle:
        order = np.lexsort((_hash(_stream_key(_TAG_ASSIGN, seed), np.arange(sizes.size)), -sizes))
    else:
        order = np.argsort(-sizes, kind="stable")
    node_of = np.empty(sizes.size, dtype=np.int64)
    loads = [(0, node) for node in range(num_nodes)]  # already a heap
    for shard, size in zip(order.tolist(), sizes[order].tolist(), strict=True):
        load, node = heapq.heappop(loads)
        node_of[shard] = node
        heapq.heappush(loads, (load + size, node))
    return node_of


def _expand(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated ranges starts[k] .. starts[k] + counts[k], without a Python loop."""
    total = int(counts.sum())
    run_start = np.cumsum(counts) - counts
    return np.repeat(starts - run_start, counts) + np.arange(total, dtype=np.int64)


def _node_stream(
    shards: np.ndarray, sizes: np.ndarray, offsets: np.ndarray, cfg: PlanConfig, epoch: int, node: int
) -> np.ndarray:
    """One node's samples for one epoch: its shards permuted, samples mixed within windows."""
    if cfg.shuffle:
        key = _stream_key(_TAG_SHARD_ORDER, cfg.seed, epoch, node)
        shards = shards[np.argsort(_hash(key, shards), kind="stable")]
    counts = sizes[shards]
    ids = _expand(offsets[shards], counts)
    if cfg.shuffle and ids.size:
        window = np.repeat(np.arange(shards.size, dtype=np.uint64) // np.uint64(cfg.shuffle_window), counts)
        key = _stream_key(_TAG_SAMPLE_ORDER, cfg.seed, epoch, node)
        # Window in the high bits keeps windows in order; the hash permutes within each.
        sort_key = (window << np.uint64(32)) | (_hash(key, ids) >> np.uint64(32))
        ids = ids[np.argsort(sort_key, kind="stable")]
    return ids


@dataclass(frozen=True, eq=False)
class _Plan:
    """Every rank of one world: (world_size, L) ids and padding mask, padding at row ends."""

    local_world_size: int
    batch_size: int
    ids: np.ndarray
    pad: np.ndarray
    dropped: tuple[np.ndarray, ...]

    @property
    def num_batches(self) -> int:
        return self.ids.shape[1] // self.batch_size


def _deal(streams: list[np.ndarray], local_world_size: int, batch_size: int, drop_last: bool) -> _Plan:
    """Deal each node's stream to its local ranks interleaved, then make the ranks equal."""
    rows = [stream[lr::local_world_size] for stream in streams for lr in range(local_world_size)]
    counts = np.array([row.size for row in rows], dtype=np.int64)
    if drop_last:
        length = int(counts.min()) // batch_size * batch_size
    else:
        length = -(-int(counts.max()) // batch_size) * batch_size
    ids = np.empty((len(rows), length), dtype=np.int64)
    pad = np.zeros((len(rows), length), dtype=bool)
    dropped = []
    everything = None
    for r, row in enumerate(rows):
        dropped.append(row[length:])
        real = min(row.size, length)
        ids[r, :real] = row[:real]
        if real == length:
            continue
        # Padding repeats samples already on this rank, else on its node, so padding never
        # makes a node fetch another node's shard; only a node with no samples at all (fewer
        # shards with samples than nodes) borrows from the whole epoch.
        source = row if row.size else streams[r // local_world_size]
        if source.size == 0:
            if everything is None:
                everything = np.concatenate(streams)
            source = everything
        ids[r, real:] = np.resize(source, length - real)
        pad[r, real:] = True
    return _Plan(local_world_size, batch_size, ids, pad, tuple(dropped))


def _fresh_plan(
    sizes: np.ndarray, cfg: PlanConfig, epoch: int, world_size: int, local_world_size: int, batch_size: int
) -> _Plan:
    num_nodes = world_size // local_world_size
    node_of = assign_shards(sizes, num_nodes, seed=cfg.seed, shuffle=cfg.shuffle)
    by_node = np.argsort(node_of, kind="stable")  # each node's shards in index order
    bounds = np.searchsorted(node_of[by_node], np.arange(num_nodes + 1))
    offsets = shard_offsets(sizes)
    streams = [
        _node_stream(by_node[bounds[n] : bounds[n + 1]], sizes, offsets, cfg, epoch, n) for n in range(num_nodes)
    ]
    return _deal(streams, local_world_size, batch_size, cfg.drop_last)


# --------------------------------------------------------------------------- resume


def _continue(plan: _Plan, steps: int) -> _Plan:
    start = steps * plan.batch_size
    return _Plan(plan.local_world_size, plan.batch_size, plan.ids[:, start:], plan.pad[:, start:], plan.dropped)


def _node_remainders(plan: _Plan, steps: int) -> list[np.ndarray]:
    """Each node's unread real samples, back in the node's stream order.

    The deal was interleaved and every rank consumed the same number of entries, so reading
    the node's rows column by column restores the stream order; padding sits at row ends.
    """
    rest = _continue(plan, steps)
    num_nodes = rest.ids.shape[0] // rest.local_world_size
    shape = (num_nodes, rest.local_world_size, rest.ids.shape[1])
    ids = rest.ids.reshape(shape).transpose(0, 2, 1).reshape(num_nodes, -1)
    real = ~rest.pad.reshape(shape).transpose(0, 2, 1).reshape(num_nodes, -1)
    return [ids[n][real[n]] for n in range(num_nodes)]


def _redeal(plan: _Plan, steps: int, world_size: int, local_world_size: int, batch_size: int) -> _Plan:
    """Plan the unread remainder of `plan` for a new world (never drops, only pads)."""
    pieces = _node_remainders(plan, steps)
    num_nodes = world_size // local_world_size
    if len(pieces) != num_nodes:
        # Contiguous equal pieces: balanced to one sample, and each cut splits at most one
        # window of shards between two nodes.
        pieces = np.array_split(np.concatenate(pieces), num_nodes)
    return _deal(pieces, local_world_size, batch_size, drop_last=False)


def _replay(
    sizes: np.ndarray,
    cfg: PlanConfig,
    epoch: int,
    world_size: int,
    local_world_size: int,
    history: Sequence[Segment],
) -> tuple[_Plan, int]:
    """The current world's plan after `history`, and the global step its batch 0 is."""
    _check_int("epoch", epoch, 0)
    _check_world(world_size, local_world_size)
    if not all(isinstance(s, Segment) for s in history):
        raise ConfigError("history must hold Segment objects")
    # A segment that ran no step read nothing: it must not change the plan.
    segments = [s for s in history if s.steps > 0]
    if not segments:
        return _fresh_plan(sizes, cfg, epoch, world_size, local_world_size, cfg.batch_size), 0
    first = segments[0]
    plan = _fresh_plan(sizes, cfg, epoch, first.world_size, first.local_world_size, first.batch_size)
    current = Segment(world_size, local_world_size, cfg.batch_size, 0)
    step = 0
    for seg, nxt in zip(segments, segments[1:] + [current], strict=True):
        if seg.steps > plan.num_batches:
            raise ConfigError(f"{seg} ran more steps than its plan has ({plan.num_batches}): wrong dataset or config?")
        if seg.same_world(nxt.world_size, nxt.local_world_size, nxt.batch_size):
            plan = _continue(plan, seg.steps)
        else:
            plan = _redeal(plan, seg.steps, nxt.world_size, nxt.local_world_size, nxt.batch_size)
        step += seg.steps
    return plan, step


def _rank_plan(plan: _Plan, sizes: np.ndarray, rank: int, first_step: int) -> RankPlan:
    ids = plan.ids[rank].copy()
    pad = plan.pad[rank].copy()
    shards = locate(ids, sizes)[0]
    dropped = plan.dropped[rank].copy()
    for array in (ids, pad, shards, dropped):
        array.flags.writeable = False
    return RankPlan(
        rank=rank,
        world_size=plan.ids.shape[0],
        local_world_size=plan.local_world_size,
        batch_size=plan.batch_size,
        first_step=first_step,
        ids=ids,
        is_padding=pad,
        shards=shards,
        dropped=dropped,
    )


def rank_plan(
    shard_sizes: Sequence[int] | np.ndarray,
    cfg: PlanConfig,
    epoch: int,
    world: World,
    history: Sequence[Segment] = (),
) -> RankPlan:
    """What `world.rank` reads for the rest of `epoch`, after the segments in `history`.

    With an empty history this is the whole epoch. Pass `EpochState.history` to resume: the
    result then holds exactly the samples the epoch has left for this rank.

    >>> cfg = PlanConfig(seed=7, batch_size=4)
    >>> p = rank_plan([100] * 10, cfg, epoch=0, world=World(rank=3, world_size=4, local_world_size=2))
    >>> p.num_batches, p.ids.size, p.num_padding
    (63, 252, 2)
    >>> later = rank_plan([100] * 10, cfg, 0, World(3, 4, 2), history=(Segment(4, 2, 4, steps=60),))
    >>> (later.first_step, later.num_batches, bool((later.ids == p.ids[240:]).all()))
    (60, 3, True)
    """
    sizes = _as_sizes(shard_sizes)
    plan, first_step = _replay(sizes, cfg, epoch, world.world_size, world.local_world_size, history)
    return _rank_plan(plan, sizes, world.rank, first_step)


def world_plans(
    shard_sizes: Sequence[int] | np.ndarray,
    cfg: PlanConfig,
    epoch: int,
    world_size: int,
    local_world_size: int,
    history: Sequence[Segment] = (),
) -> tuple[RankPlan, ...]:
    """`rank_plan` for every rank of a world at once (for tools and tests).

    >>> plans = world_plans([5, 5, 5], PlanConfig(seed=0, batch_size=2), 0, world_size=2, local_world_size=1)
    >>> [p.num_batches for p in plans]
    [5, 5]
    """
    sizes = _as_sizes(shard_sizes)
    plan, first_step = _replay(sizes, cfg, epoch, world_size, local_world_size, history)
    return tuple(_rank_plan(plan, sizes, rank, first_step) for rank in range(world_size))


def _unique_in_order(values: np.ndarray) -> np.ndarray:
    unique, first = np.unique(values, return_index=True)
    return unique[np.argsort(first, kind="stable")]
