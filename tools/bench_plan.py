"""Padding and per-node reads of the epoch plan at scale (issue 12), from the plan alone (no I/O).

For ImageNet as `dlstore convert` cuts it (1,281,167 samples in 1000 shards of ~1,281), on
8, 32, 64 and 128 nodes of 8 GPUs, with batch 32 and 256 per GPU, it prints:

* padding: samples repeated to keep the ranks equal, as a share of the epoch, for the plan
  before issue 12 (nodes owned whole shards; ranks were padded to whole batches) and for
  today's `world_plans` (nodes own contiguous sample ranges; a short last batch);
* reads per node over dataset / nodes: before (whole shards, each read by one node; the
  largest node), and now what a node's cache fetches ("fetched", largest / mean node): whole
  shards, and for a boundary shard (`node_ranges(...).partial_shards`) only the node's run
  of samples, as `Dataset` asks the cache for it when the sample index is version 2; and
  what it fetched with version 1 indexes, where a boundary shard is fetched whole on both
  its nodes ("whole shards"). Bytes are counted as samples: convert cuts shards by bytes, so
  a sample's share of a shard's bytes is about the same everywhere.

    python tools/bench_plan.py
    python tools/bench_plan.py --nodes 8,128 --batch 256 --json
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time

import numpy as np

from dlstore.plan import PlanConfig, locate, node_ranges, shard_order, world_plans
from dlstore.world import World

IMAGENET_SAMPLES = 1_281_167
IMAGENET_SHARDS = 1000


def imagenet_sizes(samples: int = IMAGENET_SAMPLES, shards: int = IMAGENET_SHARDS) -> np.ndarray:
    """Sample counts of `shards` shards as even as convert cuts them (1,281 or 1,282 each)."""
    return np.array([len(part) for part in np.array_split(np.arange(samples), shards)], dtype=np.int64)


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def before_issue_12(sizes: np.ndarray, nodes: int, gpus: int, batch: int, seed: int) -> tuple[int, float]:
    """(padding, largest node's samples / (dataset / nodes)) of the plan before issue 12.

    Then, shards in a seeded order, stably sorted biggest first, went each to the node with
    the fewest samples (ties to the lowest id); a node's samples were dealt to its ranks
    interleaved, and every rank was padded to the longest rounded up to whole batches.
    """
    order = shard_order(sizes, seed=seed)
    order = order[np.argsort(-sizes[order], kind="stable")]
    loads = [(0, node) for node in range(nodes)]  # already a heap
    for size in sizes[order].tolist():
        load, node = heapq.heappop(loads)
        heapq.heappush(loads, (load + size, node))
    totals = np.array([load for load, _ in sorted(loads, key=lambda item: item[1])], dtype=np.int64)
    local = np.arange(gpus)
    counts = totals[:, None] // gpus + (local[None, :] < totals[:, None] % gpus)
    length = -(-int(counts.max()) // batch) * batch
    return int((length - counts).sum()), float(totals.max() / (sizes.sum() / nodes))


def node_fetch(sizes: np.ndarray, cfg: PlanConfig, world: World, ids: np.ndarray) -> int:
    """Samples' worth of bytes the cache of `world.node` fetches to read `ids` (the node's ranks'
    samples): whole shards, and the node's run of samples of each boundary shard whose samples
    it reads all lie in that run (as `SamplePath.cache_spec` asks the cache)."""
    shards, within = locate(np.unique(ids), sizes)
    partial = node_ranges(sizes, cfg, world).partial_shards(sizes)
    fetched = 0
    for shard in np.unique(shards).tolist():
        run = partial.get(shard)
        read = within[shards == shard]
        inside = run is not None and run[0] <= read.min() and read.max() < run[1]
        fetched += run[1] - run[0] if inside else int(sizes[shard])
    return fetched


def with_ranges(sizes: np.ndarray, nodes: int, gpus: int, batch: int, seed: int) -> dict:
    """Padding and per-node reads of today's plan, from `world_plans` for every rank."""
    cfg = PlanConfig(seed=seed, batch_size=batch)
    plans = world_plans(sizes, cfg, 0, nodes * gpus, gpus)
    share = sizes.sum() / nodes
    fetched, whole, fetches = [], [], 0
    for node in range(nodes):
        ranks = plans[node * gpus : (node + 1) * gpus]
        ids = np.concatenate([p.ids for p in ranks])
        fetched.append(node_fetch(sizes, cfg, World(node * gpus, nodes * gpus, gpus), ids))
        shards = np.unique(np.concatenate([p.shards for p in ranks]))
        whole.append(int(sizes[shards].sum()))
        fetches += shards.size
    return {
        "padding": sum(p.num_padding for p in plans),
        "padding_rank_max": max(p.num_padding for p in plans),
        "batches": plans[0].num_batches,
        "last_batch": len(plans[0].ids) - (plans[0].num_batches - 1) * batch,
        "fetched_max": max(fetched) / share,
        "fetched_mean": sum(fetched) / nodes / share,
        "whole_max": max(whole) / share,
        "whole_mean": sum(whole) / nodes / share,
        "boundary_fetches": fetches - int(np.count_nonzero(sizes)),
    }


def measure(sizes: np.ndarray, nodes: int, gpus: int, batch: int, seed: int) -> dict:
    old_padding, old_max = before_issue_12(sizes, nodes, gpus, batch, seed)
    start = time.perf_counter()
    now = with_ranges(sizes, nodes, gpus, batch, seed)
    total = int(sizes.sum())
    return {
        "nodes": nodes,
        "gpus_per_node": gpus,
        "batch_per_gpu": batch,
        "shards_per_node": len(sizes) / nodes,
        "padding_before": old_padding,
        "padding_before_pct": 100 * old_padding / total,
        "padding_now": now["padding"],
        "padding_now_pct": 100 * now["padding"] / total,
        "padding_per_rank_max": now["padding_rank_max"],
        "batches_per_rank": now["batches"],
        "last_batch": now["last_batch"],
        "reads_before_max": old_max,
        "fetched_max": now["fetched_max"],
        "fetched_mean": now["fetched_mean"],
        "reads_whole_shards_max": now["whole_max"],
        "reads_whole_shards_mean": now["whole_mean"],
        "boundary_fetches": now["boundary_fetches"],
        "plan_seconds": time.perf_counter() - start,
    }


def markdown(rows: list[dict]) -> str:
    head = (
        "| nodes x GPUs | batch/GPU | shards/node | padding before | padding now | batches (last) "
        "| reads/node before | fetched/node now (max / mean) | v1 index: whole shards (max / mean) "
        "| boundary shards |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['nodes']} x {r['gpus_per_node']} | {r['batch_per_gpu']} | {r['shards_per_node']:.1f} "
            f"| {r['padding_before_pct']:.2f}% ({r['padding_before']:,}) "
            f"| {r['padding_now_pct']:.3f}% ({r['padding_now']:,}; <= {r['padding_per_rank_max']}/rank) "
            f"| {r['batches_per_rank']} ({r['last_batch']}) "
            f"| {r['reads_before_max']:.3f} | {r['fetched_max']:.4f} / {r['fetched_mean']:.4f} "
            f"| {r['reads_whole_shards_max']:.3f} / {r['reads_whole_shards_mean']:.3f} | {r['boundary_fetches']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=_ints, default=[8, 32, 64, 128], help="node counts (comma-separated)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--batch", type=_ints, default=[32, 256], help="batch sizes per GPU (comma-separated)")
    parser.add_argument("--samples", type=int, default=IMAGENET_SAMPLES)
    parser.add_argument("--shards", type=int, default=IMAGENET_SHARDS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args(argv)
    sizes = imagenet_sizes(args.samples, args.shards)
    rows = [measure(sizes, nodes, args.gpus_per_node, batch, args.seed) for nodes in args.nodes for batch in args.batch]
    print(json.dumps(rows, indent=2) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
