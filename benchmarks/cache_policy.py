"""Bytes fetched per epoch when the dataset does not fit the node cache.

LRU against the plan-aware eviction (`dlstore.cache.policy`), through the real `Dataset`
and `Loader`. One rank reads a small `file://` dataset for a few epochs, with the cache
limit at a fraction f of the dataset: once with the readers' hints, once without. It
prints the fraction of the dataset fetched in each epoch, and Belady's offline optimum.
A cache below two shuffle windows and the prefetch gets no hints. Takes seconds.

The "survivor" row is plan-aware too, with `prefetch_shards` ahead: a prefetch sized for a
share that fit, as on a node that survived a lost one (issue 39). Its goal: no later epoch
fetches more than 0.05 of the dataset above the ideal. `--shards 24 --fractions 0.5` is the
issue's setting.

With `--ranks-per-node` it runs node 0 of a 2-node world instead. Its ranks are
processes that share one cache and step together, over a grid of ranks per node,
shuffle windows and batch sizes. That takes a minute or two.

Example::

    python -m benchmarks.cache_policy --fractions 0.25 0.5 0.75 --epochs 4
    python -m benchmarks.cache_policy --shards 24 --fractions 0.5
    python -m benchmarks.cache_policy --shards 24 --samples 32
    python -m benchmarks.cache_policy --shards 96 --samples 8 --fractions 0.5 --prefetch-shards 2 \\
        --ranks-per-node 1 2 4 --shuffle-windows 2 4 --batch-sizes 4 16
"""

from __future__ import annotations

import argparse
import bisect
import functools
import multiprocessing
import os
import sys
import tempfile
from dataclasses import dataclass

import dlstore
from dlstore.cache import STATS_FILE_BYTES, cache_report
from dlstore.cache.policy import HINTS_DIR
from dlstore.format.manifest import Manifest
from dlstore.loader import ENGINES
from dlstore.plan import PlanConfig, RankPlan, node_ranges
from dlstore.storage import open_store
from dlstore.world import World

from .data import write_bench_dataset
from .runner import Spread, interleave

DATASET_OPTIONS = dict(transform="eval", image_size=8, batch_size=8, seed=0, prefetch_shards=4)
#: How far above the ideal, 1 - f, the survivor row's later epochs may fetch.
SURVIVOR_GOAL_ABOVE_IDEAL = 0.05


class LruDataset(dlstore.Dataset):
    """A dataset that gives the cache no hints, so the cache evicts least recently used."""

    def hint_cache(self, plan: RankPlan, index: int) -> None:
        return None


class SurvivorDataset(dlstore.Dataset):
    """A plan-aware dataset that fetches `prefetch_shards` ahead even when its share outgrows
    the cache. That is a prefetch sized for a share that fit, as on a node whose share grew
    after a lost node. Only the cache's own rule then keeps the fetches ahead from displacing
    the shards it keeps."""

    @functools.cached_property
    def prefetch_ahead(self) -> int:
        return self.cfg.prefetch_shards


@dataclass(frozen=True)
class PolicyRun:
    """Bytes fetched per epoch, the dataset's bytes, and whether the cache had hints."""

    fetched: list[int]
    dataset_bytes: int
    hinted: bool

    @property
    def shares(self) -> list[float]:
        return [b / self.dataset_bytes for b in self.fetched]


def has_hints(cache_dir: str) -> bool:
    hints = os.path.join(cache_dir, HINTS_DIR)
    return os.path.isdir(hints) and bool(os.listdir(hints))


def epochs_fetched(cache_dir: str, epochs: int) -> list[int]:
    """Each epoch's bytes as the cache counts them: under the epoch they were fetched for.

    The prefetch fetches for the next epoch before this one ends, so the bytes between
    two epochs' starts would be off.
    """
    counted = cache_report(cache_dir).epochs
    return [counted[e].bytes_fetched if e in counted else 0 for e in range(epochs)]


def fetched_per_epoch(
    url: str,
    cache_dir: str,
    fraction: float,
    epochs: int,
    plan_aware: bool = True,
    dataset_class: type[dlstore.Dataset] | None = None,
    **settings,
) -> PolicyRun:
    """`epochs` epochs on one rank, the cache limit at `fraction` of the dataset.

    The limit counts the stats file too. `settings` go to the `Dataset`, made as
    `dataset_class` when given, else as the plan-aware one or `LruDataset`.
    """
    dataset_bytes = sum(s.size for s in Manifest.load(open_store(url)).shards)
    limit = int(fraction * dataset_bytes) + STATS_FILE_BYTES
    kind = dataset_class or (dlstore.Dataset if plan_aware else LruDataset)
    ds = kind(url, cache_dir=cache_dir, cache_limit=limit, world=World(0, 1, 1), **{**DATASET_OPTIONS, **settings})
    loader = dlstore.Loader(ds, num_workers=2, device="cpu")
    hinted = False
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for _ in loader:
            pass
        ds.cache.flush_stats()
        hinted = hinted or has_hints(cache_dir)
    loader.close()
    ds.cache.close()
    return PolicyRun(epochs_fetched(cache_dir, epochs), dataset_bytes, hinted)


def node_share_bytes(url: str, world: World, **settings) -> int:
    """The bytes of the samples `world.node` reads per epoch; a shard read in part counts in part."""
    shards = Manifest.load(open_store(url)).shards
    config = PlanConfig(seed=settings.get("seed", 0), batch_size=settings.get("batch_size", 8))
    ranges = node_ranges([s.samples for s in shards], config, world)
    return sum(shards[k].size * n // shards[k].samples for k, n in zip(ranges.shard, ranges.count, strict=True))


def read_as_rank(url, cache_dir, limit, world, epochs, step, hinted, kind, options, loader_options) -> None:
    """One rank: `epochs` epochs, waiting at `step` after each batch, as DDP makes ranks step."""
    try:
        ds = kind(url, cache_dir=cache_dir, cache_limit=limit, world=world, **options)
        loader = dlstore.Loader(ds, device="cpu", **loader_options)
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for _ in loader:
                step.wait(timeout=300)
            ds.cache.flush_stats()
            if has_hints(cache_dir):
                hinted.value = 1
        loader.close()
        ds.cache.close()
    except BaseException:
        step.abort()  # the other ranks stop waiting for this one
        raise


def node_fetched_per_epoch(
    url: str,
    cache_dir: str,
    fraction: float,
    epochs: int,
    ranks_per_node: int,
    nodes: int = 2,
    plan_aware: bool = True,
    loader_options: dict | None = None,
    **settings,
) -> PolicyRun:
    """Node 0 of `nodes` x `ranks_per_node`: its ranks as processes sharing one cache.

    The limit is `fraction` of the node's share. The other nodes are not run: a plan is
    a pure function, so node 0 reads the same either way.
    """
    options = {**DATASET_OPTIONS, **settings}
    share = node_share_bytes(url, World(0, nodes * ranks_per_node, ranks_per_node), **options)
    limit = int(fraction * share) + STATS_FILE_BYTES
    kind = dlstore.Dataset if plan_aware else LruDataset
    fork = multiprocessing.get_context("fork")
    step, hinted = fork.Barrier(ranks_per_node), fork.Value("b", 0)
    ranks = []
    for rank in range(ranks_per_node):
        world = World(rank, nodes * ranks_per_node, ranks_per_node)
        args = (url, cache_dir, limit, world, epochs, step, hinted, kind, options, loader_options or {"num_workers": 1})
        ranks.append(fork.Process(target=read_as_rank, args=args))  # not a daemon: a loader may fork workers
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    if any(process.exitcode for process in ranks):
        raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in ranks]}")
    return PolicyRun(epochs_fetched(cache_dir, epochs), share, bool(hinted.value))


def offline_optimum(ds: dlstore.Dataset, epochs: int, capacity: int, ahead: int, in_flight: int = 2) -> list[int]:
    """Misses per epoch of Belady's rule with the true future: the floor for `capacity` shards.

    It is modelled as the loader reads. Each batch's shards, and those of the `in_flight`
    batches built after it, are held. The `ahead` shards needed next are fetched ahead, as
    the cache does: into free room, or in place of a shard never needed again. A miss
    counts under the epoch that needs the shard.
    """
    batches: list[tuple[int, set[int]]] = []
    for epoch in range(epochs):
        plan = ds.plan(epoch)
        for j in range(plan.num_batches):
            batches.append((epoch, set(plan.shards[j * plan.batch_size : (j + 1) * plan.batch_size].tolist())))
    uses: dict[int, list[int]] = {}
    for i, (_, shards) in enumerate(batches):
        for shard in shards:
            uses.setdefault(shard, []).append(i)

    def next_use(shard: int, i: int) -> int:
        later = uses[shard][bisect.bisect_left(uses[shard], i) :]
        return later[0] if later else len(batches)

    cache: set[int] = set()
    misses = [0] * epochs
    for i in range(len(batches)):
        held = set().union(*(shards for _, shards in batches[i : i + 1 + in_flight]))
        coming: list[int] = []
        for _, shards in batches[i + 1 + in_flight :]:
            coming += sorted(s for s in shards if s not in held and s not in coming)
            if len(coming) >= ahead:
                break
        wanted = sorted(held, key=lambda s: next_use(s, i)) + coming[:ahead]
        for k, shard in enumerate(wanted):
            if shard in cache:
                continue
            if len(cache) >= capacity:
                pinned = held | set(wanted[: k + 1])
                victims = [s for s in cache if s not in pinned]
                if not victims:
                    continue
                victim = max(victims, key=lambda s: next_use(s, i))
                if shard not in held and next_use(victim, i) < len(batches):
                    continue
                cache.remove(victim)
            cache.add(shard)
            misses[batches[min(next_use(shard, i), len(batches) - 1)][0]] += 1
    return misses


def per_epoch_line(fraction: float, name: str, shares: list[float], note: str) -> str:
    later = shares[1:] or shares
    return (f"f={fraction:.2f} {name:10s} per epoch: {' '.join(f'{s:.2f}' for s in shares)}"
            f"  (epochs 1+: mean {sum(later) / len(later):.2f}; {note})")  # fmt: skip


def one_rank_table(url: str, root: str, args: argparse.Namespace) -> None:
    """LRU against plan-aware and the offline optimum, one rank, per cache fraction."""
    settings = dict(shuffle_window=args.shuffle_window, prefetch_shards=args.prefetch_shards, seed=args.seed)
    print(f"{args.shards} shards x {args.samples} samples, one rank, {settings}; fraction of the dataset fetched")
    sizes = [s.size for s in Manifest.load(open_store(url)).shards]
    kinds = {"lru": LruDataset, "plan-aware": dlstore.Dataset, "survivor": SurvivorDataset}
    for fraction in args.fractions:
        for name, kind in kinds.items():
            run = fetched_per_epoch(url, f"{root}/cache-{fraction}-{name}", fraction, args.epochs,
                                    dataset_class=kind, **settings)  # fmt: skip
            note = f"ideal {1 - fraction:.2f}"
            if kind is not LruDataset and not run.hinted:
                note += "; no hints: the cache is below two windows and the prefetch"
            if kind is SurvivorDataset:
                goal = 1 - fraction + SURVIVOR_GOAL_ABOVE_IDEAL
                met = max(run.shares[1:] or run.shares) <= goal + 1e-9
                note += f"; goal: each <= {goal:.2f}, {'met' if met else 'MISSED'}"
            print(per_epoch_line(fraction, name, run.shares, note))
        limit = int(fraction * sum(sizes))
        ds = dlstore.Dataset(url, cache_dir=f"{root}/plans", cache_limit=limit, world=World(0, 1, 1),
                             **{**DATASET_OPTIONS, **settings})  # fmt: skip
        capacity = limit // max(sizes)
        misses = offline_optimum(ds, args.epochs, capacity, ds.prefetch_ahead if args.prefetch_shards else 0)
        note = f"Belady with the true future, {capacity} shards"
        print(per_epoch_line(fraction, "offline", [m / len(sizes) for m in misses], note))


def node_table(url: str, root: str, args: argparse.Namespace) -> None:
    """Node 0 of 2: the share fetched, cold and later epochs, over the rounds, per setting."""
    print(f"{args.shards} shards x {args.samples} samples, node 0 of 2, cache {args.fractions[0]:.2f} of its share, "
          f"prefetch {args.prefetch_shards}, {args.rounds} rounds; fraction of the node's share fetched")  # fmt: skip
    grid = [(r, w, b, e) for r in args.ranks_per_node for w in args.shuffle_windows for b in args.batch_sizes
            for e in args.engines]  # fmt: skip
    made = iter(range(10**9))

    def run(ranks: int, window: int, batch: int, engine: str) -> list[float]:
        cache_dir = f"{root}/node-{next(made)}-{ranks}-{window}-{batch}-{engine}"
        options = dict(shuffle_window=window, batch_size=batch, prefetch_shards=args.prefetch_shards, seed=args.seed)
        loader_options = {"num_workers": args.workers, "engine": engine}
        return node_fetched_per_epoch(url, cache_dir, args.fractions[0], args.epochs, ranks,
                                      loader_options=loader_options, **options).shares  # fmt: skip

    # Rounds outermost: a noisy spell hits every setting alike.
    rounds = interleave(args.rounds, {key: (lambda key=key: run(*key)) for key in grid}, rotate=False)
    for ranks, window, batch, engine in grid:
        shares = [r[ranks, window, batch, engine] for r in rounds]
        cold, later = Spread.of(s[0] for s in shares), Spread.of(x for s in shares for x in s[1:])
        print(f"ranks/node {ranks} window {window} batch {batch:3d} (a step spans {ranks * batch / args.samples:g} "
              f"shards), {engine}: cold {cold.text('{:.2f}')}  epochs 1+ {later.text('{:.2f}')}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=48)
    parser.add_argument("--samples", type=int, default=16, help="samples per shard")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    parser.add_argument("--shuffle-window", type=int, default=4)
    parser.add_argument("--prefetch-shards", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    nodes = parser.add_argument_group("several ranks per node (plan-aware; the first of --fractions)")
    nodes.add_argument("--ranks-per-node", type=int, nargs="+", help="run node 0 of 2 with these ranks per node")
    nodes.add_argument("--shuffle-windows", type=int, nargs="+", default=[2, 4])
    nodes.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 16])
    nodes.add_argument("--rounds", type=int, default=3)
    nodes.add_argument("--engines", nargs="+", default=["threads"], choices=ENGINES, help="the ranks' loader engines")
    nodes.add_argument("--workers", type=int, default=1, help="decode threads or worker processes per rank")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dlstore-bench-policy-") as root:
        url = write_bench_dataset(f"{root}/data", args.shards, args.samples)
        (node_table if args.ranks_per_node else one_rank_table)(url, root, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
