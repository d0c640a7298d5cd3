#!/usr/bin/env python3
"""Bytes fetched per epoch when the dataset does not fit the node cache: LRU against the
plan-aware eviction (`dlstore.cache.policy`), through the real `Dataset` and `Loader`.

One rank reads a small `file://` dataset (48 shards of 16 tiny JPEGs by default) for a few
epochs, with the cache limit at a fraction f of the dataset, once with the readers' hints
(plan-aware) and once without (LRU, the cache as it was before hints). It prints the
fraction of the dataset fetched in each epoch; the first epoch fetches everything either
way. A cache below two shuffle windows and the prefetch gets no hints (so at f = 0.25 on 24
shards both rows are LRU). Takes seconds.

Example::

    python tools/bench_cache_policy.py --fractions 0.25 0.5 0.75 --epochs 4
    python tools/bench_cache_policy.py --shards 24 --samples 32
"""

from __future__ import annotations

import argparse
import os
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
from dlstore.manifest import Manifest  # noqa: E402
from dlstore.plan import RankPlan  # noqa: E402
from dlstore.storage import open_store  # noqa: E402
from dlstore.world import World  # noqa: E402


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
    options = dict(transform="eval", image_size=8, batch_size=8, seed=0, prefetch_shards=4)
    options.update(settings)
    dataset_bytes = sum(s.size for s in Manifest.load(open_store(url)).shards)
    limit = int(fraction * dataset_bytes) + STATS_FILE_BYTES
    kind = dlstore.Dataset if plan_aware else LruDataset
    ds = kind(url, cache_dir=cache_dir, cache_limit=limit, world=World(0, 1, 1), **options)
    loader = dlstore.Loader(ds, num_workers=2, device="cpu")
    fetched, hinted = [], False
    for epoch in range(epochs):
        before = cache_report(cache_dir).totals.bytes_fetched if epoch else 0
        loader.set_epoch(epoch)
        for _ in loader:
            pass
        ds.cache.flush_stats()
        fetched.append(cache_report(cache_dir).totals.bytes_fetched - before)
        hinted = hinted or _has_hints(cache_dir)
    loader.close()
    ds.cache.close()
    return PolicyRun(fetched, dataset_bytes, hinted)


def _has_hints(cache_dir: str) -> bool:
    hints = os.path.join(cache_dir, HINTS_DIR)
    return os.path.isdir(hints) and bool(os.listdir(hints))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=48)
    parser.add_argument("--samples", type=int, default=16, help="samples per shard")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    parser.add_argument("--shuffle-window", type=int, default=4)
    parser.add_argument("--prefetch-shards", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    settings = dict(shuffle_window=args.shuffle_window, prefetch_shards=args.prefetch_shards, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="dlstore-bench-policy-") as root:
        url = write_bench_dataset(f"{root}/data", args.shards, args.samples)
        print(f"{args.shards} shards x {args.samples} samples, one rank, {settings}; fraction of the dataset fetched")
        for fraction in args.fractions:
            for plan_aware in (False, True):
                cache_dir = f"{root}/cache-{fraction}-{plan_aware}"
                run = fetched_per_epoch(url, cache_dir, fraction, args.epochs, plan_aware, **settings)
                later = run.shares[1:] or run.shares
                name = "plan-aware" if plan_aware else "lru"
                unhinted = "; no hints: the cache is below two windows and the prefetch" * (
                    plan_aware and not run.hinted
                )
                print(
                    f"f={fraction:.2f} {name:10s} per epoch: {' '.join(f'{s:.2f}' for s in run.shares)}"
                    f"  (epochs 1+: mean {sum(later) / len(later):.2f}; ideal {1 - fraction:.2f}{unhinted})"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
