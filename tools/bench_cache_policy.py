#!/usr/bin/env python3
"""Bytes fetched per epoch when the dataset does not fit the node cache: LRU against the
plan-aware eviction (`dlstore.cache.policy`), through the real `Dataset` and `Loader`.

One rank reads a small `file://` dataset (48 shards of 16 tiny JPEGs by default) for a few
epochs, with the cache limit at a fraction f of the dataset, once with the readers' hints
(plan-aware) and once without (LRU, the cache as it was before hints). It prints the
fraction of the dataset fetched in each epoch; the first epoch fetches everything either
way. A cache below two shuffle windows and the prefetch gets no hints (so at f = 0.25 on 24
shards both rows are LRU). Takes seconds.

With `--ranks-per-node`, node 0 of a 2-node world instead: its ranks are processes sharing
one cache at the first of `--fractions` of the node's share, stepping together, over a grid
of ranks per node x shuffle windows x batch sizes (plan-aware; a minute or two).

Example::

    python tools/bench_cache_policy.py --fractions 0.25 0.5 0.75 --epochs 4
    python tools/bench_cache_policy.py --shards 24 --samples 32
    python tools/bench_cache_policy.py --shards 96 --samples 8 --fractions 0.5 --prefetch-shards 2 \\
        --ranks-per-node 1 2 4 --shuffle-windows 2 4 --batch-sizes 4 16
"""

from __future__ import annotations

import argparse
import bisect
import multiprocessing
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from loader_support import write_dataset  # noqa: E402

import dlstore  # noqa: E402
from dlstore.cache import STATS_FILE_BYTES, cache_report  # noqa: E402
from dlstore.cache.policy import HINTS_DIR  # noqa: E402
from dlstore.format.manifest import Manifest  # noqa: E402
from dlstore.loader import ENGINES  # noqa: E402
from dlstore.plan import PlanConfig, RankPlan, node_ranges  # noqa: E402
from dlstore.storage import open_store  # noqa: E402
from dlstore.world import World  # noqa: E402

_OPTIONS = dict(transform="eval", image_size=8, batch_size=8, seed=0, prefetch_shards=4)


class LruDataset(dlstore.Dataset):
    """A dataset that gives the cache no hints: the cache evicts least recently used shards."""

    def hint_cache(self, plan: RankPlan, index: int) -> None:
        return None


def write_bench_dataset(root: str, shards: int = 48, samples: int = 16) -> str:
    """A `file://` dataset of `shards` shards of `samples` tiny JPEGs each; returns its URL."""
    url = f"file://{root}"
    write_dataset(open_store(url), [samples] * shards)
    return url


@dataclass(frozen=True)
class PolicyRun:
    """Bytes the node cache fetched in each epoch, the dataset's bytes, and whether the
    dataset gave the cache hints (it gives none to a cache too small for them)."""

    fetched: list[int]
    dataset_bytes: int
    hinted: bool

    @property
    def shares(self) -> list[float]:
        return [b / self.dataset_bytes for b in self.fetched]


def fetched_per_epoch(
    url: str, cache_dir: str, fraction: float, epochs: int, plan_aware: bool = True, **settings
) -> PolicyRun:
    """Read `epochs` epochs on one rank with the cache limit at `fraction` of the dataset
    (plus the stats file, which the limit counts too). `settings` go to the `Dataset`
    (e.g. shuffle_window)."""
    options = {**_OPTIONS, **settings}
    dataset_bytes = sum(s.size for s in Manifest.load(open_store(url)).shards)
    limit = int(fraction * dataset_bytes) + STATS_FILE_BYTES
    kind = dlstore.Dataset if plan_aware else LruDataset
    ds = kind(url, cache_dir=cache_dir, cache_limit=limit, world=World(0, 1, 1), **options)
    loader = dlstore.Loader(ds, num_workers=2, device="cpu")
    hinted = False
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for _ in loader:
            pass
        ds.cache.flush_stats()
        hinted = hinted or _has_hints(cache_dir)
    loader.close()
    ds.cache.close()
    # Each epoch's bytes as the cache counts them (`dlstore cache stats`: under the epoch they
    # were fetched for), not the bytes between two epochs' starts: the loader builds the next
    # epoch's first batches, and the prefetch fetches for them, before this one ends, and after
    # the last epoch for one that is never read.
    epochs_seen = cache_report(cache_dir).epochs
    fetched = [epochs_seen[epoch].bytes_fetched if epoch in epochs_seen else 0 for epoch in range(epochs)]
    return PolicyRun(fetched, dataset_bytes, hinted)


def node_share_bytes(url: str, world: World, **settings) -> int:
    """The bytes of the samples `world.node` reads per epoch (a shard it reads part of counts
    in part): what its cache fetches per epoch when it holds nothing from one to the next."""
    shards = Manifest.load(open_store(url)).shards
    config = PlanConfig(seed=settings.get("seed", 0), batch_size=settings.get("batch_size", 8))
    ranges = node_ranges([s.samples for s in shards], config, world)
    return sum(shards[k].size * n // shards[k].samples for k, n in zip(ranges.shard, ranges.count, strict=True))


def _read_as_rank(
    url: str, cache_dir: str, limit: int, world: World, epochs: int, step, hinted, kind, options, loader_options
) -> None:
    """One rank of node `world.node`: `epochs` epochs through the real `Dataset` and `Loader`,
    waiting at `step` after each batch (the ranks of a job step together, as DDP makes them);
    sets `hinted` if the cache had hints at the end of an epoch."""
    try:
        ds = kind(url, cache_dir=cache_dir, cache_limit=limit, world=world, **options)
        loader = dlstore.Loader(ds, device="cpu", **loader_options)
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for _ in loader:
                step.wait(timeout=300)
            ds.cache.flush_stats()
            if _has_hints(cache_dir):
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
    """Node 0 of a world of `nodes` x `ranks_per_node`: its ranks as processes sharing one
    cache whose limit is `fraction` of the node's share, reading `epochs` epochs in step.
    The other nodes' ranks are not run: a plan is a pure function, so node 0 reads the same
    either way. Bytes fetched per epoch are the cache's per-epoch counters."""
    options = {**_OPTIONS, **settings}
    share = node_share_bytes(url, World(0, nodes * ranks_per_node, ranks_per_node), **options)
    limit = int(fraction * share) + STATS_FILE_BYTES
    kind = dlstore.Dataset if plan_aware else LruDataset
    fork = multiprocessing.get_context("fork")
    step, hinted = fork.Barrier(ranks_per_node), fork.Value("b", 0)
    ranks = []
    for rank in range(ranks_per_node):
        world = World(rank, nodes * ranks_per_node, ranks_per_node)
        args = (url, cache_dir, limit, world, epochs, step, hinted, kind, options, loader_options or {"num_workers": 1})
        ranks.append(fork.Process(target=_read_as_rank, args=args))  # not a daemon: a loader may fork workers
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    if any(process.exitcode for process in ranks):
        raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in ranks]}")
    counted = cache_report(cache_dir).epochs
    fetched = [counted[e].bytes_fetched if e in counted else 0 for e in range(epochs)]
    return PolicyRun(fetched, share, bool(hinted.value))


def offline_optimum(ds: dlstore.Dataset, epochs: int, capacity: int, ahead: int, in_flight: int = 2) -> list[int]:
    """Misses per epoch of Belady's rule with the true future, on the plan `ds` reads: the
    floor for a cache of `capacity` shards, one rank. Modelled as the loader reads: each batch's
    shards and those of the `in_flight` batches built after it are held (never evicted), the
    `ahead` shards needed next after them are fetched ahead, and fetching ahead never evicts a
    shard needed no later. A miss counts under the epoch that needs the shard."""
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
                if shard not in held and next_use(victim, i) <= next_use(shard, i):
                    continue
                cache.remove(victim)
            cache.add(shard)
            misses[batches[min(next_use(shard, i), len(batches) - 1)][0]] += 1
    return misses


def _has_hints(cache_dir: str) -> bool:
    hints = os.path.join(cache_dir, HINTS_DIR)
    return os.path.isdir(hints) and bool(os.listdir(hints))


def _one_rank_table(url: str, root: str, args: argparse.Namespace) -> None:
    """LRU against plan-aware, one rank, per cache fraction."""
    settings = dict(shuffle_window=args.shuffle_window, prefetch_shards=args.prefetch_shards, seed=args.seed)
    print(f"{args.shards} shards x {args.samples} samples, one rank, {settings}; fraction of the dataset fetched")
    for fraction in args.fractions:
        for plan_aware in (False, True):
            cache_dir = f"{root}/cache-{fraction}-{plan_aware}"
            run = fetched_per_epoch(url, cache_dir, fraction, args.epochs, plan_aware, **settings)
            later = run.shares[1:] or run.shares
            name = "plan-aware" if plan_aware else "lru"
            unhinted = "; no hints: the cache is below two windows and the prefetch" * (plan_aware and not run.hinted)
            print(
                f"f={fraction:.2f} {name:10s} per epoch: {' '.join(f'{s:.2f}' for s in run.shares)}"
                f"  (epochs 1+: mean {sum(later) / len(later):.2f}; ideal {1 - fraction:.2f}{unhinted})"
            )
        sizes = [s.size for s in Manifest.load(open_store(url)).shards]
        limit, capacity = int(fraction * sum(sizes)), int(fraction * sum(sizes)) // max(sizes)
        options = {**_OPTIONS, **settings}
        ds = dlstore.Dataset(url, cache_dir=f"{root}/plans", cache_limit=limit, world=World(0, 1, 1), **options)
        misses = offline_optimum(ds, args.epochs, capacity, ds.prefetch_ahead if args.prefetch_shards else 0)
        shares = [m / len(sizes) for m in misses]
        later = shares[1:] or shares
        print(
            f"f={fraction:.2f} {'offline':10s} per epoch: {' '.join(f'{s:.2f}' for s in shares)}"
            f"  (epochs 1+: mean {sum(later) / len(later):.2f}; Belady with the true future, {capacity} shards)"
        )


def _node_table(url: str, root: str, args: argparse.Namespace) -> None:
    """Node 0 of 2, its ranks as processes sharing its cache: fraction of the node's share
    fetched, cold epoch and the later ones (median and range over the rounds), per setting."""
    print(
        f"{args.shards} shards x {args.samples} samples, node 0 of 2, cache {args.fractions[0]:.2f} of its share, "
        f"prefetch {args.prefetch_shards}, {args.rounds} rounds; fraction of the node's share fetched"
    )
    settings = [
        (ranks, window, batch)
        for ranks in args.ranks_per_node
        for window in args.shuffle_windows
        for batch in args.batch_sizes
    ]
    variants = {engine: {"num_workers": args.workers, "engine": engine} for engine in args.engines}
    runs: dict[tuple, list[list[float]]] = {(*s, v): [] for s in settings for v in variants}
    for round_ in range(args.rounds):  # rounds outermost: a noisy spell hits every setting alike
        for ranks, window, batch in settings:
            cache_dir = f"{root}/node-{round_}-{ranks}-{window}-{batch}"
            options = dict(shuffle_window=window, batch_size=batch, prefetch_shards=args.prefetch_shards)
            for variant, loader_options in variants.items():
                run = node_fetched_per_epoch(
                    url, f"{cache_dir}-{variant}", args.fractions[0], args.epochs, ranks,
                    loader_options=loader_options, seed=args.seed, **options,
                )  # fmt: skip
                runs[(ranks, window, batch, variant)].append(run.shares)
    for (ranks, window, batch, variant), shares in runs.items():
        cold, later = [s[0] for s in shares], [x for s in shares for x in s[1:]]
        span = ranks * batch / args.samples
        print(
            f"ranks/node {ranks} window {window} batch {batch:3d} (a step spans {span:g} shards), {variant}: "
            f"cold {_spread(cold)}  epochs 1+ {_spread(later)}"
        )


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


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
        if args.ranks_per_node:
            _node_table(url, root, args)
        else:
            _one_rank_table(url, root, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
