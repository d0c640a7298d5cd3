"""The epoch plan: which samples each rank reads, in which order, as pure functions.

Everything here is a function of shard sizes, `PlanConfig`, epoch, world and history. Numpy arrays
go in and come out; there is no I/O and no state. The loader calls `rank_plan` once per epoch and
once per resume. It reads the rank's batches from the returned `RankPlan`.

How an epoch is planned
-----------------------
1. *Nodes*, not ranks, own contiguous sample ranges of one fixed global order (`assign_ranges`). The
   order lays the shards end to end in a seeded random order (`shard_order`), or in index order
   without `shuffle`. It is cut into `num_nodes` ranges whose sizes differ by at most one sample. A
   cut usually falls inside a shard. That *boundary shard* is split between two nodes. The ranges
   depend on the seed and the node count only, never on the epoch. So a node reads the same samples
   every epoch, and a warm cache stays warm (DESIGN invariant 5).
2. Each epoch, each node orders its pieces by a permutation drawn from seed, epoch and node. A piece
   is a whole shard, or the node's part of a boundary shard. The node cuts that order into windows
   of `shuffle_window` pieces and permutes the samples inside each window. Orders change every
   epoch, and a batch mixes several shards (invariant 6). With `window_ramp`, the default, the first
   `shuffle_window` pieces form windows that double. The first window holds the fewest pieces, two
   at least, that cover the node's first step. That step is the first segment's ranks per node times
   its batch size, so a replay plans the same windows. A cold cache then starts after those
   downloads, not a whole window's. The cost: the first window mixes fewer shards. Where shards were
   cut in class order, the first batches see fewer classes. With the ramp, windows count whole
   pieces. A node's sliver of a boundary shard rides with the piece before it. A last window of one
   piece joins the one before it. Without the ramp, windows are plain runs of `shuffle_window`
   pieces; older saved states resume in those.
3. The node's stream is dealt to its local ranks interleaved: position i goes to local rank i %
   local_world_size. All ranks of a node then work on the same window of shards. The node cache's
   working set stays at about one window.
4. Ranks are made equal (invariant 2). Steps 1 and 3 leave the ranks' counts within one sample of
   each other. Every rank gets L samples, L the largest count. A rank one short repeats its first
   sample and flags it in `RankPlan.is_padding`. A rank without any sample repeats its node's, else
   the epoch's. The last batch may be short, as short on every rank, so every rank runs the same
   number of DDP steps. With `drop_last`, L is the smallest count rounded down to whole batches.
   Each rank reports what it dropped in `RankPlan.dropped`.

Padding is at most one sample per rank, ``world_size - 1`` per epoch. There is none when the world
size divides the sample count. Dropping loses at most ``batch_size`` samples per rank.

Progress and exact resume (invariant 4)
---------------------------------------
DDP ranks step in lockstep, so progress within an epoch is one number per world: global steps done.
A world that ran `steps` steps is a `Segment`: world size, local world size, batch size. An epoch's
progress is the tuple of its segments (`EpochState.history`). A segment consumed ``min(steps *
batch_size, L)`` entries of every rank's list. A stop after the short last batch is the end of the
epoch. No segment runs more steps than its plan's `num_batches`. `rank_plan` replays that history.
The first segment's plan is the fresh plan above. Each later segment plans what the previous one
left unread:

* Same world size and ranks per node, any batch size: the previous plan continues after the consumed
  entries, cut into the new batch size. The order delivered, padding included, is exactly the
  uninterrupted one.
* Otherwise the unread remainder is re-dealt, each old node's rebuilt in its stream order. If the
  node count is unchanged, node n keeps its own remainder, for perfect locality. A node with nothing
  left pads with samples it has read, never another node's. Only the deal to its local ranks
  changes. Remainders then differ by up to D, the old ranks per node times the old plan's spread of
  rank counts. That spread is 1 for a fresh plan. Padding is then at most ``1 + ceil(D /
  local_world_size)`` per rank. If the node count changed, the old remainders are concatenated in
  node order. They are cut into contiguous pieces equal to one sample, one per new node: at most one
  sample of padding per rank. A re-deal only pads, never drops. An interrupted and resumed epoch so
  delivers exactly the real samples of the uninterrupted one. Its first segment decides what
  `drop_last` drops.

The trade-off (DESIGN: "Invariants 4 and 5 pull against each other")
----------------------------------------------------------------------
Contiguous sample ranges give balance to one sample at any scale. They give full locality in the
steady state, with no partition count fixed in advance. What it costs:

* Boundary shards: each cut between two nodes' ranges splits at most one shard. Up to ``num_nodes -
  1`` shards are read in part by two nodes, more on a tiny dataset.
  `node_ranges(...).partial_shards(...)` names a node's boundary shards and its samples of each. The
  node cache fetches only those samples' bytes as a partial entry (`dlstore.cache.download`). It
  verifies them against the version 2 sample index's digests. Every byte is then fetched by one
  node. A boundary shard is two cache entries on two nodes, each one more ranged GET per epoch when
  not cached. Version 1 indexes have no per-sample digests, so both nodes fetch a boundary shard
  whole. That is at most ``num_nodes - 1`` extra shard fetches per epoch. One node fetches at most
  ``1 + 2 / (shards per node)`` times dataset / nodes. Running `dlstore convert` again adds the
  digests; `dlstore index` does it for foreign shards.
* The epoch's order depends on the node count. A run restarted at a new epoch on another node count
  sees a different, equally valid order, and nodes own new ranges.
* After a mid-epoch change of node count, each cut between new pieces can split one window. Up to
  ``(num_nodes - 1) * shuffle_window`` shards, plus the old boundary shards, are then read by two
  nodes in that epoch. The next epoch is planned afresh for the new world.
* Resuming replays every segment's plan. The cost grows with the world changes in the epoch, each
  replay one vectorised plan.

DESIGN lists the alternatives: canonical partitions as in mosaicml/streaming, or one global sequence
with ranged reads. They keep the order independent of the node count. But they need a partition
count fixed in advance, or ranged reads for every shard, not only boundary ones.

Randomness is a splitmix64 hash of purpose, seed, epoch, node and id, not a numpy generator. Numpy
does not promise to keep its streams across versions. A run must resume exactly after the library
under it was upgraded.
"""

from __future__ import annotations

from dlstore.plan.epoch import RankPlan, node_ranges, rank_plan, world_plans
from dlstore.plan.ranges import NodeRanges, assign_ranges, by_shard, locate, shard_offsets, shard_order
from dlstore.plan.state import EpochState, PlanConfig, Segment

__all__ = [
    "EpochState",
    "NodeRanges",
    "PlanConfig",
    "RankPlan",
    "Segment",
    "assign_ranges",
    "by_shard",
    "locate",
    "node_ranges",
    "rank_plan",
    "shard_offsets",
    "shard_order",
    "world_plans",
]
