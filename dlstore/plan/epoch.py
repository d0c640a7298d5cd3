"""Each rank's plan of an epoch, and its replay after a resume. The package docstring says why."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dlstore.errors import ConfigError
from dlstore.plan.ranges import (
    TAG_SAMPLE_ORDER,
    TAG_SHARD_ORDER,
    NodeRanges,
    as_sizes,
    assign_ranges,
    hash64,
    locate,
    shard_offsets,
    stream_key,
)
from dlstore.plan.state import PlanConfig, Segment, check_int, check_world
from dlstore.world import World

__all__ = ["RankPlan", "node_ranges", "rank_plan", "world_plans"]


@dataclass(frozen=True, eq=False)
class RankPlan:
    """What one rank reads for the rest of an epoch, batch by batch.

    `ids` are global sample ids, as `locate` reads them. Batch j is ``ids[j * batch_size:(j + 1) *
    batch_size]``, so the last batch can be short. It is as short on every rank of the world. Batch
    0 is the epoch's global step `first_step`, non-zero after a resume. `shards[i]` is the shard of
    `ids[i]`. `dropped` holds the samples of this rank's share that `drop_last` left out. It is
    empty after a re-deal, which never drops. The arrays are read-only.

    >>> p = rank_plan([3, 2], PlanConfig(seed=0, batch_size=2, shuffle=False), 0, World(0, 1, 1))
    >>> p.num_batches, p.batch(1), p.batch(2)
    (3, (array([2, 3]), array([False, False])), (array([4]), array([False])))
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
        return -(-len(self.ids) // self.batch_size)

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
        check_int("start_batch", start_batch, 0)
        return _unique_in_order(self.shards[start_batch * self.batch_size :])

    def _batch_slice(self, j: int) -> slice:
        if not 0 <= j < self.num_batches:
            raise IndexError(f"batch {j} out of range 0..{self.num_batches - 1}")
        return slice(j * self.batch_size, min((j + 1) * self.batch_size, len(self.ids)))


# --------------------------------------------------------------------------- the fresh plan


def _expand(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated ranges starts[k] .. starts[k] + counts[k], without a Python loop."""
    total = int(counts.sum())
    run_start = np.cumsum(counts) - counts
    return np.repeat(starts - run_start, counts) + np.arange(total, dtype=np.int64)


def _windows(counts: np.ndarray, size: int, first_samples: int | None) -> np.ndarray:
    """The window of each piece; `counts` holds each piece's samples, in stream order.

    Without the ramp, `first_samples` is None and windows are runs of `size` pieces. With it,
    `first_samples` is the node's first step, and windows count whole pieces. A node's sliver of a
    boundary shard, under half the median piece, rides with the piece before it. So a window of two
    is never one shard and a sliver. The first `size` whole pieces are split into windows that
    double. The first window is the fewest pieces that hold `first_samples`, two at least, so a
    batch still draws from several shards (DESIGN invariant 6). The last ramp window takes the rest.
    There is no ramp when the first window would hold `size` pieces or more. A last window of one
    piece joins the one before it; its batches would each come from one shard.

    >>> _windows(np.full(12, 10), 8, 20).tolist()  # windows of 2, 6 (the ramp), then 4
    [0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2]
    >>> _windows(np.full(12, 10), 4, 20).tolist(), _windows(np.full(5, 10), 4, 35).tolist()
    ([0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3], [0, 0, 0, 0, 0])
    >>> _windows(np.array([10, 1, 10, 10, 10, 10, 2]), 4, 5).tolist()  # slivers ride along
    [0, 0, 0, 1, 1, 1, 1]
    >>> _windows(np.full(5, 10), 4, None).tolist()  # without the ramp
    [0, 0, 0, 0, 1]
    """
    if first_samples is None or size <= 1 or counts.size == 0:
        return (np.arange(counts.size, dtype=np.int64) // size).astype(np.uint64)
    whole = 2 * counts >= np.median(counts)
    unit = np.maximum(np.cumsum(whole) - 1, 0)  # each piece's whole piece (slivers: the one before)
    unit_counts = np.bincount(unit, weights=counts)
    return _ramped_windows(unit_counts, size, first_samples)[unit].astype(np.uint64)


def _ramped_windows(counts: np.ndarray, size: int, first_samples: int) -> np.ndarray:
    """`_windows` with the ramp, over whole pieces; `counts` includes their slivers."""
    piece = np.arange(counts.size, dtype=np.int64)
    first = max(2, int(np.searchsorted(np.cumsum(counts), first_samples)) + 1)
    parts = [first] if first < size else []
    while parts and sum(parts) < size:
        more = min(2 * parts[-1], size - sum(parts))
        if more < parts[-1]:
            parts[-1] += more  # a last part smaller than the one before it: joined to it
        else:
            parts.append(more)
    ramped = sum(parts)
    ramp = np.searchsorted(np.cumsum(parts, dtype=np.int64), piece, side="right")
    window = np.where(piece < ramped, ramp, len(parts) + (piece - ramped) // size)
    if piece.size > 1 and window[-1] != window[-2]:
        window[-1] = window[-2]  # a last window of one piece joins the one before it (mixing)
    return window


def _node_stream(
    ranges: NodeRanges, offsets: np.ndarray, cfg: PlanConfig, epoch: int, node: int, step_samples: int
) -> np.ndarray:
    """One node's samples for one epoch: its pieces permuted, samples mixed within windows. With the
    ramp, the first windows hold at least `step_samples`, the node's first step."""
    first, counts = offsets[ranges.shard] + ranges.start, ranges.count
    if cfg.shuffle:
        key = stream_key(TAG_SHARD_ORDER, cfg.seed, epoch, node)
        # A node holds at most one piece of a shard, so the shard id names the piece.
        by_hash = np.argsort(hash64(key, ranges.shard), kind="stable")
        first, counts = first[by_hash], counts[by_hash]
    ids = _expand(first, counts)
    if cfg.shuffle and ids.size:
        ramp_from = step_samples if cfg.window_ramp else None
        window = np.repeat(_windows(counts, cfg.shuffle_window, ramp_from), counts)
        key = stream_key(TAG_SAMPLE_ORDER, cfg.seed, epoch, node)
        # Window in the high bits keeps windows in order; the hash permutes within each.
        sort_key = (window << np.uint64(32)) | (hash64(key, ids) >> np.uint64(32))
        ids = ids[np.argsort(sort_key, kind="stable")]
    return ids


@dataclass(frozen=True, eq=False)
class _Plan:
    """Every rank of one world: ids and padding mask, one row of length L per rank, padded at the
    end."""

    local_world_size: int
    batch_size: int
    ids: np.ndarray
    pad: np.ndarray
    dropped: tuple[np.ndarray, ...]

    @property
    def num_batches(self) -> int:
        return -(-self.ids.shape[1] // self.batch_size)


def _deal(
    streams: list[np.ndarray],
    local_world_size: int,
    batch_size: int,
    drop_last: bool,
    spares: list[np.ndarray] | None = None,
) -> _Plan:
    """Deal each node's stream to its local ranks interleaved, then make the ranks equal. Ranks are
    as long as the longest, and the last batch may be short. With `drop_last` they are as long as
    the shortest, in whole batches. `spares[n]` are the samples node n pads with when its stream
    is empty: after a resume, those it read already."""
    rows = [stream[lr::local_world_size] for stream in streams for lr in range(local_world_size)]
    counts = np.array([row.size for row in rows], dtype=np.int64)
    length = int(counts.min()) // batch_size * batch_size if drop_last else int(counts.max())
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
        # Padding repeats samples of this rank, else of its node, else those the node read before
        # a resume. So padding never makes a node fetch another node's shard. Only a node with no
        # samples at all borrows from the epoch; that takes fewer samples than nodes.
        source = row if row.size else streams[r // local_world_size]
        if source.size == 0 and spares is not None:
            source = spares[r // local_world_size]
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
    ranges = assign_ranges(sizes, world_size // local_world_size, seed=cfg.seed, shuffle=cfg.shuffle)
    offsets = shard_offsets(sizes)
    step = local_world_size * batch_size  # the node's samples in one step
    streams = [
        _node_stream(ranges.of_node(n), offsets, cfg, epoch, n, step) for n in range(world_size // local_world_size)
    ]
    return _deal(streams, local_world_size, batch_size, cfg.drop_last)


# --------------------------------------------------------------------------- resume


def _continue(plan: _Plan, steps: int, batch_size: int) -> _Plan:
    """What `plan` has left after `steps` of its steps, in batches of `batch_size` from there."""
    start = steps * plan.batch_size  # past the end after a short last batch: nothing left
    return _Plan(plan.local_world_size, batch_size, plan.ids[:, start:], plan.pad[:, start:], plan.dropped)


def _node_remainders(plan: _Plan, steps: int) -> list[np.ndarray]:
    """Each node's unread real samples, back in the node's stream order.

    The deal was interleaved, and every rank consumed the same number of entries. So reading
    the node's rows column by column restores the stream order. Padding sits at row ends.
    """
    rest = _continue(plan, steps, plan.batch_size)
    num_nodes = rest.ids.shape[0] // rest.local_world_size
    shape = (num_nodes, rest.local_world_size, rest.ids.shape[1])
    ids = rest.ids.reshape(shape).transpose(0, 2, 1).reshape(num_nodes, -1)
    real = ~rest.pad.reshape(shape).transpose(0, 2, 1).reshape(num_nodes, -1)
    return [ids[n][real[n]] for n in range(num_nodes)]


def _redeal(plan: _Plan, steps: int, world_size: int, local_world_size: int, batch_size: int) -> _Plan:
    """Plan the unread remainder of `plan` for a new world. A re-deal only pads, never drops."""
    remainders = _node_remainders(plan, steps)
    num_nodes = world_size // local_world_size
    if len(remainders) != num_nodes:
        # Contiguous equal pieces balance to one sample. Each cut splits at most one window of
        # shards between two nodes.
        remainders = np.array_split(np.concatenate(remainders), num_nodes)
        return _deal(remainders, local_world_size, batch_size, drop_last=False)
    # Same nodes: a node whose unread entries were all padding has an empty remainder. It pads
    # with what its ranks read in this plan: its own samples, cached on the node.
    spares = list(plan.ids.reshape(num_nodes, -1))
    return _deal(remainders, local_world_size, batch_size, drop_last=False, spares=spares)


def _replay(
    sizes: np.ndarray,
    cfg: PlanConfig,
    epoch: int,
    world_size: int,
    local_world_size: int,
    history: Sequence[Segment],
) -> tuple[_Plan, int]:
    """The current world's plan after `history`, and the global step its batch 0 is."""
    check_int("epoch", epoch, 0)
    check_world(world_size, local_world_size)
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
        if (seg.world_size, seg.local_world_size) == (nxt.world_size, nxt.local_world_size):
            plan = _continue(plan, seg.steps, nxt.batch_size)
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
    >>> p.num_batches, p.ids.size, p.num_padding, p.batch(62)[0].size
    (63, 250, 0, 2)
    >>> later = rank_plan([100] * 10, cfg, 0, World(3, 4, 2), history=(Segment(4, 2, 4, steps=60),))
    >>> (later.first_step, later.num_batches, bool((later.ids == p.ids[240:]).all()))
    (60, 3, True)
    """
    sizes = as_sizes(shard_sizes)
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
    """`rank_plan` for every rank of a world at once, for tools and tests.

    >>> plans = world_plans([5, 5, 5], PlanConfig(seed=0, batch_size=2), 0, world_size=2, local_world_size=1)
    >>> [(p.num_batches, p.num_padding) for p in plans]
    [(4, 0), (4, 1)]
    """
    sizes = as_sizes(shard_sizes)
    plan, first_step = _replay(sizes, cfg, epoch, world_size, local_world_size, history)
    return tuple(_rank_plan(plan, sizes, rank, first_step) for rank in range(world_size))


def node_ranges(shard_sizes: Sequence[int] | np.ndarray, cfg: PlanConfig, world: World) -> NodeRanges:
    """The samples `world.node` owns in every epoch planned afresh for this world. Its node cache
    should hold them; `NodeRanges.partial_shards` names the shards it reads only in part. A
    resumed epoch whose history has another node count reads outside them until it ends.

    >>> r = node_ranges([10, 10, 10], PlanConfig(seed=0, batch_size=2, shuffle=False), World(2, 4, 2))
    >>> r.shard.tolist(), r.partial_shards([10, 10, 10])
    ([1, 2], {1: (5, 10)})
    """
    sizes = as_sizes(shard_sizes)
    return assign_ranges(sizes, world.num_nodes, seed=cfg.seed, shuffle=cfg.shuffle).of_node(world.node)


def _unique_in_order(values: np.ndarray) -> np.ndarray:
    """The distinct values in order of first appearance. By a dict, not `np.unique`: the loader
    asks it per batch, and numpy's sort lets go of the GIL (see `dlstore.loader.threads`)."""
    return np.array(list(dict.fromkeys(values.tolist())), dtype=values.dtype)
