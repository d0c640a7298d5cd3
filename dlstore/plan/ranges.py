"""Sample ids, the plan's randomness, and which node reads which samples (`assign_ranges`)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dlstore.errors import ConfigError
from dlstore.plan.state import check_int

__all__ = [
    "TAG_ASSIGN",
    "TAG_SAMPLE_ORDER",
    "TAG_SHARD_ORDER",
    "NodeRanges",
    "as_sizes",
    "assign_ranges",
    "by_shard",
    "hash64",
    "locate",
    "shard_offsets",
    "shard_order",
    "stream_key",
]


def as_sizes(shard_sizes: Sequence[int] | np.ndarray) -> np.ndarray:
    """Shard sample counts as an int64 array; a `ConfigError` says what is wrong."""
    sizes = np.asarray(shard_sizes)
    if sizes.ndim != 1:
        raise ConfigError(f"shard_sizes must be one-dimensional, got shape {sizes.shape}")
    if sizes.size and not np.issubdtype(sizes.dtype, np.integer):
        raise ConfigError(f"shard_sizes must be integers, got dtype {sizes.dtype}")
    sizes = sizes.astype(np.int64)
    if sizes.size and sizes.min() < 0:
        raise ConfigError("shard_sizes must not be negative")
    return sizes


# --------------------------------------------------------------------------- sample ids


def shard_offsets(shard_sizes: Sequence[int] | np.ndarray) -> np.ndarray:
    """The global id of each shard's first sample: the exclusive cumulative sum of sizes.

    >>> shard_offsets([3, 0, 2]).tolist()
    [0, 3, 3]
    """
    sizes = as_sizes(shard_sizes)
    return np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64) if sizes.size else sizes


def locate(ids: Sequence[int] | np.ndarray, shard_sizes: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split global sample ids into arrays of shard index and index within the shard.

    >>> shard, index = locate([0, 3, 4], [3, 0, 2])
    >>> shard.tolist(), index.tolist()
    ([0, 2, 2], [0, 0, 1])
    """
    sizes = as_sizes(shard_sizes)
    ids = np.asarray(ids, dtype=np.int64)
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if ends.size else 0
    if ids.size and (ids.min() < 0 or ids.max() >= total):
        raise ConfigError(f"sample ids must lie in [0, {total})")
    shard = np.searchsorted(ends, ids, side="right").astype(np.int64)
    return shard, ids - (ends[shard] - sizes[shard])


def by_shard(ids: Sequence[int], shard_ends: Sequence[int]) -> dict[int, tuple[list[int], list[int]]]:
    """`ids` by shard, in shard order: each shard's positions in `ids` and its samples' indexes
    there. `shard_ends` is the cumulative sum of the shard sizes, as a list. `locate` in pure
    Python, for the decode threads: numpy's sort lets go of the GIL (see `dlstore.loader.threads`).

    >>> by_shard([0, 3, 4], [3, 3, 5])
    {0: ([0], [0]), 2: ([1, 2], [0, 1])}
    """
    total, grouped = (shard_ends[-1] if shard_ends else 0), {}
    for position, sample_id in enumerate(ids):
        if not 0 <= sample_id < total:
            raise ConfigError(f"sample ids must lie in [0, {total})")
        shard = bisect.bisect_right(shard_ends, sample_id)
        positions, offsets = grouped.setdefault(shard, ([], []))
        positions.append(position)
        offsets.append(sample_id - (shard_ends[shard - 1] if shard else 0))
    return dict(sorted(grouped.items()))


# --------------------------------------------------------------------------- randomness

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
# One tag per use, so the shard assignment, the shard order and the sample order are
# independent streams even when their other inputs coincide.
TAG_ASSIGN, TAG_SHARD_ORDER, TAG_SAMPLE_ORDER = 1, 2, 3


def _mix64(x: int) -> int:
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def stream_key(*parts: int) -> int:
    key = 0
    for part in parts:
        key = _mix64(key ^ _mix64(int(part) + _GOLDEN))
    return key


def hash64(key: int, values: np.ndarray) -> np.ndarray:
    """splitmix64 of each value under `key`. The uint64 arrays wrap on overflow, as intended."""
    z = values.astype(np.uint64) * np.uint64(_GOLDEN) + np.uint64(key)
    z ^= z >> np.uint64(30)
    z *= np.uint64(_MIX1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_MIX2)
    z ^= z >> np.uint64(31)
    return z


# --------------------------------------------------------------------------- node ranges


@dataclass(frozen=True, eq=False)
class NodeRanges:
    """Which node reads which samples, the same every epoch. Row k is samples `start[k]` to
    ``start[k] + count[k] - 1`` of shard `shard[k]`, read by node `node[k]`. Rows follow the
    global order of `shard_order`. So each node's rows are contiguous, and nodes come in order. A
    boundary shard has a row on each node that reads part of it.

    >>> r = assign_ranges([4, 4, 4], 2, seed=0, shuffle=False)
    >>> r.node.tolist(), r.shard.tolist(), r.start.tolist(), r.count.tolist()
    ([0, 0, 1, 1], [0, 1, 1, 2], [0, 0, 2, 0], [4, 2, 2, 4])
    >>> r.shards_of(1).tolist(), r.samples_per_node().tolist()
    ([1, 2], [6, 6])
    """

    num_nodes: int
    node: np.ndarray
    shard: np.ndarray
    start: np.ndarray
    count: np.ndarray

    def of_node(self, node: int) -> NodeRanges:
        """The rows of one node."""
        lo, hi = np.searchsorted(self.node, [node, node + 1])
        return NodeRanges(self.num_nodes, self.node[lo:hi], self.shard[lo:hi], self.start[lo:hi], self.count[lo:hi])

    def shards_of(self, node: int) -> np.ndarray:
        """The shards `node` reads, in whole or in part, in the global order."""
        return self.of_node(node).shard

    def samples_per_node(self) -> np.ndarray:
        """How many samples each node reads per epoch. The counts differ by at most one."""
        totals = np.zeros(self.num_nodes, dtype=np.int64)
        np.add.at(totals, self.node, self.count)
        return totals

    def partial_shards(self, shard_sizes: Sequence[int] | np.ndarray) -> dict[int, tuple[int, int]]:
        """The rows that cover only part of their shard, as {shard: (first sample, stop)}. On the
        rows of one node (`of_node`), these are the boundary shards it reads a range of. A node
        cache fetches only those samples' bytes, not the shard (`dlstore.cache.download`).

        >>> assign_ranges([4, 4, 4], 2, seed=0, shuffle=False).of_node(1).partial_shards([4, 4, 4])
        {1: (2, 4)}
        """
        if np.unique(self.node).size > 1:  # a boundary shard would have one run per node
            raise ConfigError("partial_shards takes the rows of one node: call it on of_node(node)")
        sizes = as_sizes(shard_sizes)
        part = self.count < sizes[self.shard]
        return {
            int(shard): (int(start), int(start + count))
            for shard, start, count in zip(self.shard[part], self.start[part], self.count[part], strict=True)
        }


def shard_order(shard_sizes: Sequence[int] | np.ndarray, *, seed: int, shuffle: bool = True) -> np.ndarray:
    """The fixed order of the shards whose samples nodes own in contiguous ranges. It is a seeded
    permutation, or index order without `shuffle`, the same every epoch and for any node count.
    It is random so that a node's range samples the whole, even where shard indexes follow the
    classes.

    >>> shard_order([5, 0, 5], seed=0, shuffle=False).tolist()
    [0, 1, 2]
    """
    sizes = as_sizes(shard_sizes)
    check_int("seed", seed)
    if not shuffle:
        return np.arange(sizes.size, dtype=np.int64)
    key = stream_key(TAG_ASSIGN, seed)
    return np.argsort(hash64(key, np.arange(sizes.size)), kind="stable").astype(np.int64)


def assign_ranges(
    shard_sizes: Sequence[int] | np.ndarray, num_nodes: int, *, seed: int, shuffle: bool = True
) -> NodeRanges:
    """Which samples each of `num_nodes` nodes reads, for every epoch of a job.

    The shards' samples are laid end to end in `shard_order`. They are cut into `num_nodes`
    contiguous ranges of equal size; the first ``total % num_nodes`` ranges are one sample longer.
    Each cut that falls inside a shard splits that shard between the two nodes.

    >>> r = assign_ranges([10, 10, 10], 4, seed=0, shuffle=False)
    >>> r.samples_per_node().tolist(), [r.shards_of(n).tolist() for n in range(4)]
    ([8, 8, 7, 7], [[0], [0, 1], [1, 2], [2]])
    """
    sizes = as_sizes(shard_sizes)
    check_int("num_nodes", num_nodes, 1)
    order = shard_order(sizes, seed=seed, shuffle=shuffle)
    ordered = sizes[order]
    ends = np.cumsum(ordered)
    total = int(ends[-1]) if ends.size else 0
    per_node, longer = divmod(total, num_nodes)
    n = np.arange(num_nodes + 1, dtype=np.int64)
    node_starts = n * per_node + np.minimum(n, longer)
    # Every shard boundary and every node boundary is a cut; the run between two cuts is a row.
    cuts = np.union1d(np.union1d(ends - ordered, ends), node_starts).astype(np.int64)
    lo, hi = cuts[:-1], cuts[1:]
    position = np.searchsorted(ends, lo, side="right")  # the first shard ending after lo: skips empty ones
    node = np.searchsorted(node_starts, lo, side="right") - 1  # nodes with no sample get no row
    start = lo - (ends[position] - ordered[position])
    return NodeRanges(num_nodes, node.astype(np.int64), order[position], start.astype(np.int64), hi - lo)
