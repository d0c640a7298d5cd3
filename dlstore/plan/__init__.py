"""The epoch plan: which samples each rank reads, in which order, as pure functions.

Everything here is a function of (shard sizes, `PlanConfig`, epoch, world, history): numpy
arrays in, arrays out, no I/O and no state. The loader calls `rank_plan` once per epoch, and
once per resume, and reads the rank's batches from the returned `RankPlan`.

How an epoch is planned
-----------------------
1. *Nodes*, not ranks, own contiguous sample ranges of one fixed global order (`assign_ranges`).
   The order is the shards in a seeded random order (`shard_order`; index order without
   `shuffle`), their samples end to end, cut into `num_nodes` ranges whose sizes differ by at
   most one sample. A cut usually falls inside a shard: that *boundary shard* is split between
   two nodes. The ranges depend on the seed and the node count only, never on the epoch, so a
   node reads the same samples every epoch and a warm cache stays warm (DESIGN invariant 5).
2. Each epoch, each node orders its pieces (a whole shard, or its part of a boundary shard) by
   a permutation drawn from (seed, epoch, node). It cuts that order into windows of
   `shuffle_window` pieces and permutes the samples inside each window. Orders change every
   epoch and a batch mixes several shards (invariant 6).
   With `window_ramp`, the default, the first `shuffle_window` pieces form windows that double.
   The first holds the fewest pieces, two at least, that cover the node's first step (the first
   segment's ranks per node x batch size, so a replay plans the same windows). A cold cache then
   starts after those downloads, not a whole window's. The cost: the first window mixes fewer
   shards, and shards cut in class order give the first batches fewer classes. With the ramp,
   windows count whole pieces (a node's sliver of a boundary shard rides with the piece before
   it) and a last window of one piece joins the one before it. Without it, windows are plain
   runs of `shuffle_window` pieces; states saved before the ramp existed resume in those.
3. The node's stream is dealt to its local ranks interleaved (position i to local rank
   i % local_world_size). All ranks of a node then work on the same window of shards, and the
   node cache's working set stays at about one window.
4. Ranks are made equal (invariant 2). Steps 1 and 3 leave the ranks' counts within one sample
   of each other. Every rank gets L samples, L the largest count; a rank one short repeats its
   first sample and says so in `RankPlan.is_padding`. A rank without any sample repeats its
   node's, else the epoch's. The last batch may be short, as short on every rank, so every rank
   runs the same number of DDP steps. With `drop_last`, L is the smallest count rounded down to
   whole batches, and each rank reports what it dropped in `RankPlan.dropped`.

Bound on padding: at most one sample per rank, ``world_size - 1`` per epoch; none when the
world size divides the sample count. On dropping: at most ``batch_size`` samples per rank.

Progress and exact resume (invariant 4)
---------------------------------------
DDP ranks step in lockstep, so progress within an epoch is one number per world: global steps
done. A world (world size, local world size, batch size) that ran `steps` steps is a `Segment`;
an epoch's progress is the tuple of its segments (`EpochState.history`). A segment consumed
``min(steps * batch_size, L)`` entries of every rank's list: a stop after the short last batch
is the end of the epoch, and no segment runs more steps than its plan's `num_batches`.
`rank_plan` replays that history. The first segment's plan is the fresh plan above; each later
segment plans what the previous one left unread:

* same world size and ranks per node, any batch size: the previous plan continues after the
  consumed entries, cut into the new batch size. The order delivered, padding included, is
  exactly the uninterrupted one.
* otherwise the unread remainder is re-dealt, each old node's rebuilt in its stream order.
  If the node count is unchanged, node n keeps its own remainder (perfect locality: a node with
  nothing left pads with samples it has read, never another node's); only the deal to its local
  ranks changes. Remainders then differ by up to D = (old ranks per node) x (the old plan's
  spread of rank counts, 1 for a fresh plan), so padding is at most
  ``1 + ceil(D / local_world_size)`` per rank. If the node count changed, the old remainders are
  concatenated in node order and cut into contiguous pieces equal to one sample, one per new
  node: at most one sample of padding per rank.
  A re-deal only pads, never drops, so an interrupted and resumed epoch delivers exactly the
  real samples of the uninterrupted one; its first segment decides what `drop_last` drops.

The trade-off (DESIGN: "Invariants 4 and 5 pull against each other")
----------------------------------------------------------------------
Owning contiguous sample ranges gives balance to one sample at any scale and full locality in
the steady state, with no partition count fixed in advance. What it costs:

* boundary shards: each cut between two nodes' ranges splits at most one shard, so up to
  ``num_nodes - 1`` shards are read in part by two nodes (more, on a tiny dataset).
  `node_ranges(...).partial_shards(...)` names a node's boundary shards and its samples of
  each; the node cache fetches only those samples' bytes, as a partial entry
  (`dlstore.cache.download`) verified against the version 2 sample index's digests. Every byte
  is then fetched by one node. A boundary shard is two cache entries on two nodes, each a
  ranged GET more per epoch when not cached. With version 1 indexes, which have no per-sample
  digests, both nodes fetch a boundary shard whole: at most ``num_nodes - 1`` extra shard
  fetches per epoch, at most ``1 + 2 / (shards per node)`` times dataset / nodes on one node.
  Running `dlstore convert` again adds the digests (`dlstore index` for foreign shards);
* the epoch's order depends on the node count: a run restarted at a new epoch on another node
  count sees a different, equally valid order, and nodes own new ranges;
* after a mid-epoch change of node count, each cut between new pieces can split one window, so
  up to ``(num_nodes - 1) * shuffle_window`` shards, plus the old boundary shards, are read by
  two nodes in that epoch. The next epoch is planned afresh for the new world;
* resuming replays every segment's plan: the cost grows with the world changes in the epoch,
  each replay one vectorised plan.

The alternatives in DESIGN (canonical partitions as in mosaicml/streaming, or one global
sequence with ranged reads) keep the order independent of the node count. They need a
partition count fixed in advance, or ranged reads for every shard, not only boundary ones.

Randomness is a splitmix64 hash of (purpose, seed, epoch, node, id), not a numpy generator:
numpy does not promise to keep its streams across versions, and a run must resume exactly
after the library under it was upgraded.
"""

from __future__ import annotations

from dlstore.plan.epoch import RankPlan, node_ranges, rank_plan, world_plans
from dlstore.plan.ranges import NodeRanges, assign_ranges, locate, shard_offsets, shard_order
from dlstore.plan.state import EpochState, PlanConfig, Segment

__all__ = [
    "EpochState",
    "NodeRanges",
    "PlanConfig",
    "RankPlan",
    "Segment",
    "assign_ranges",
    "locate",
    "node_ranges",
    "rank_plan",
    "shard_offsets",
    "shard_order",
    "world_plans",
]
