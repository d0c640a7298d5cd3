"""The epoch plan: which samples each rank reads, in which order, as pure functions.

Everything here is a function of (shard sizes, `PlanConfig`, epoch, world, history):
numpy arrays in, arrays out, no I/O and no state. The loader calls `rank_plan` once per
epoch (and once per resume) and reads the rank's batches from the returned `RankPlan`.

How an epoch is planned
-----------------------
1. *Nodes* (not ranks) own contiguous sample ranges of one fixed global order
   (`assign_ranges`): the shards in a seeded random order (`shard_order`; index order without
   `shuffle`), their samples end to end, cut into `num_nodes` ranges whose sizes differ by at
   most one sample. A cut usually falls inside a shard: that *boundary shard* is split between
   two nodes, each reading its own part. The ranges depend on the seed and the number of nodes
   only, never on the epoch, so a node reads the same samples every epoch and a warm node
   cache stays warm (DESIGN invariant 5).
2. Each epoch, each node orders its pieces (a whole shard, or its part of a boundary shard)
   by a permutation drawn from (seed, epoch, node), cuts that order into windows of
   `shuffle_window` pieces and permutes the samples inside each window (invariant 6: orders
   change every epoch, and a batch mixes several shards). With `window_ramp` (the default)
   the first `shuffle_window` pieces are split into windows that double, from the fewest
   pieces (two at least) that hold the node's first step (the first segment's ranks per node
   x batch size, so a replay plans the same windows): a cold cache starts after those
   downloads, not a whole window's (ImageNet, 8 ranks x 256: two shards instead of four).
   What it costs: the first window's samples mix over fewer shards, which `convert`'s global
   shuffle makes as good a source; shards cut in class order (`convert` without shuffling,
   some foreign shards) give the epoch's first batches fewer classes. A store as fast as the
   readers gains nothing (the next, larger window must then arrive during a smaller one).
   With the ramp, windows count whole pieces (a node's sliver of a boundary shard rides with
   the piece before it) and a last window of one piece joins the one before it, so no window
   is one shard; without it, the windows of dlstore before the ramp, which a state saved by
   it resumes in.
3. The node's stream is dealt to its local ranks interleaved (position i to local rank
   i % local_world_size), so all ranks of a node work on the same window of shards at the
   same time and the node cache's working set stays at about one window.
4. Ranks are made equal (invariant 2). Steps 1 and 3 leave the ranks' counts within one sample
   of each other; every rank gets L samples, L = the largest count, and a rank one short
   repeats its first sample, saying so in `RankPlan.is_padding` (a rank without any sample,
   when there are fewer samples than ranks, repeats its node's, else the epoch's). L need
   not be a multiple of the batch size: the last batch is short, and as short on every rank,
   so every rank runs the same number of DDP steps. With `drop_last`, L = the smallest count
   rounded down to whole batches instead, and each rank reports what it dropped in
   `RankPlan.dropped`.

Bound on padding: at most one sample per rank, ``world_size - 1`` per epoch (none when the
world size divides the sample count; a single rank delivers each sample once). On dropping:
at most ``batch_size`` samples per rank. ImageNet (1,281,167 samples, 1000 shards) on 128
nodes x 8 GPUs: 881 samples of padding, 0.07% of the epoch, at any batch size
(tools/bench_plan.py; with whole shards per node and whole batches per rank it was 22.8%).

Progress and exact resume (invariant 4)
---------------------------------------
DDP ranks step in lockstep, so progress within an epoch is one number per world: global steps
done. A world (world size, local world size, batch size) that ran `steps` steps is a `Segment`;
an epoch's progress is the tuple of its segments (`EpochState.history`). A segment consumed
``min(steps * batch_size, L)`` entries of every rank's list: a stop after the short last batch
is the end of the epoch, and no segment can run more steps than its plan's `num_batches`.
`rank_plan` replays that history: the first segment's plan is the fresh plan above; each
later segment plans what the previous one left unread:

* same world size and ranks per node (any batch size): the previous plan simply continues
  after the consumed entries, cut into the new batch size, so the order delivered (padding
  included) is exactly the uninterrupted one;
* otherwise the unread remainder is re-dealt. Each old node's remainder is rebuilt in its
  stream order. If the number of nodes is unchanged, node n keeps its own remainder (perfect
  locality: a node with nothing left pads with samples it has read, never another node's)
  and only the deal to its local ranks changes; nodes' remainders then differ by up
  to D = (old ranks per node) x (the old plan's spread of rank counts, 1 for a fresh plan),
  so the padding is at most ``1 + ceil(D / local_world_size)`` per rank. If the number of
  nodes changed, the old nodes' remainders are concatenated in node order and cut into
  contiguous pieces equal to one sample, one per new node: at most one sample of padding
  per rank.
  A re-deal only pads, never drops, so an interrupted and resumed epoch delivers exactly the
  real samples of the uninterrupted one (its first segment decides what `drop_last` drops).

The trade-off (DESIGN: "Invariants 4 and 5 pull against each other")
----------------------------------------------------------------------
Ownership of contiguous sample ranges gives balance to one sample at any scale and full
locality in the steady state, with no partition count fixed in advance, but it costs:

* boundary shards: each cut between two nodes' ranges splits at most one shard, so up to
  ``num_nodes - 1`` shards are read in part by two nodes (a shard bigger than a node's share,
  on a tiny dataset, by more). `node_ranges(...).partial_shards(...)` names a node's
  boundary shards and its samples of each, and the dataset has the node cache fetch only
  those samples' bytes (a partial entry, `dlstore.cache.partial`, verified sample by sample
  against the version 2 sample index's digests): every byte is then fetched by one node,
  1.00x of dataset / nodes per node at any scale (tools/bench_plan.py). What that costs: a
  boundary shard is two cache entries on two nodes, each a ranged GET more per epoch when
  not cached; and a dataset whose indexes are version 1 (no per-sample digests) has its
  boundary shards fetched whole, both nodes fetching the shard: at most ``num_nodes - 1``
  extra shard fetches per epoch, at most ``1 + 2 / (shards per node)`` times dataset / nodes
  on one node (ImageNet in 1000 shards, largest node (mean): 1.01x (1.01x) on 8 nodes, 1.06x
  (1.03x) on 32, 1.09x (1.06x) on 64, 1.15x (1.13x) on 128). Running `dlstore convert`
  again adds the digests (one read of each tar, which stays as it is; `dlstore index` for
  foreign shards);
* the epoch's order depends on the number of nodes: a run restarted at a new epoch on another
  node count sees a different (equally valid) order, and nodes own new ranges;
* after a mid-epoch change of node count, each cut between new pieces can split one window,
  so up to ``(num_nodes - 1) * shuffle_window`` shards (plus the old boundary shards) are read
  by two nodes in that epoch, and nodes read shards their cache has not seen. The next epoch
  is planned afresh for the new world;
* resuming replays every segment's plan: the cost grows with the number of world changes in
  the epoch (each replay is one vectorised plan, well under a second for ImageNet).

The alternatives in DESIGN (canonical partitions as in mosaicml/streaming, or one global
sequence with ranged reads) keep the order independent of the node count but need either a
partition count fixed in advance or ranged reads for every shard, not only the boundary ones.

Randomness is a splitmix64 hash of (purpose, seed, epoch, node, id) rather than a numpy
generator, whose streams numpy does not promise to keep across versions: a run can resume
exactly after the library under it was upgraded.
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
