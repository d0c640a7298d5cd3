"""Partial cache entries: a run of samples `[start, stop)` of one shard, cached on its own.

Why: the epoch plan gives each node a contiguous range of samples, so a node's first and last
shard are usually split with its neighbours (`dlstore.plan`, "boundary shards"). Fetching such
a shard whole makes a node fetch up to two shards more than its share each epoch (1.15x its
share on 128 nodes of ImageNet); fetching only the node's samples keeps it at 1.00x.

What: a `SampleRange` names the samples and carries their byte offsets and digests from the
shard's version 2 sample index (`dlstore.format.sample_index`). Its cache entry is keyed by
`SampleRange.key` (the shard's name and the range), so it is locked, reserved, counted
against the limit, published atomically and evicted exactly like a shard (`ShardCache`
treats the key as a name); only the download differs (`write_verified_range`): one or more
ranged GETs of the bytes ``[offsets[start], offsets[stop])`` written at the entry's byte 0,
each sample checked against its digest as the written prefix reaches its end.

The trade-off: a partial entry and the whole shard are separate entries, so a node that
reads both (after a mid-epoch change of node count re-deals the unread samples) caches the
range twice; and a shard whose index is version 1 (no digests) cannot be verified in part,
so it is fetched whole. A range is not preallocated (it is a few hundred KB to a shard's
size, and its reservation already counts it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dlstore.cache.config import CacheConfig, ShardSpec
from dlstore.cache.download import DownloadReport, fetch_checked
from dlstore.cache.engine import DownloadEngine
from dlstore.format.sample_index import SAMPLE_DIGEST_SIZE, SampleIndex, SampleSpan, sample_digest
from dlstore.storage.base import Store

__all__ = ["SampleRange", "write_verified_range"]


@dataclass(frozen=True, eq=False)
class SampleRange:
    """Samples `start .. stop-1` of shard `shard`: `offsets` are their `stop - start + 1` byte
    offsets in the shard, `digests` their sample digests end to end.

    >>> index = SampleIndex([0, 1024, 2048, 4096], 10240, sample_digests=bytes(48))
    >>> r = SampleRange.of_index("s.tar", index, 1, 3)
    >>> r.key, r.byte_start, r.size, r[2]
    ('s.tar#samples=1-3', 1024, 3072, SampleSpan(offset=1024, size=2048))
    """

    shard: str
    start: int
    stop: int
    offsets: tuple[int, ...]
    digests: bytes

    @classmethod
    def of_index(cls, shard: str, index: SampleIndex, start: int, stop: int) -> SampleRange:
        """Samples [start, stop) of `shard` as its version 2 index describes them."""
        index.run(start, stop)  # bounds check
        digests = b"".join(index.digest(i) for i in range(start, stop))
        return cls(shard, start, stop, tuple(int(o) for o in index.offsets[start : stop + 1]), digests)

    @property
    def key(self) -> str:
        """The cache entry's name: apart from the shard's and from other ranges of it."""
        return f"{self.shard}#samples={self.start}-{self.stop}"

    @property
    def spec(self) -> ShardSpec:
        """What `ShardCache.hold` and `prefetch` take for this entry."""
        return ShardSpec(self.key, self.size, None, self)

    @property
    def byte_start(self) -> int:
        return self.offsets[0]

    @property
    def size(self) -> int:
        return self.offsets[-1] - self.offsets[0]

    def contains(self, samples: Sequence[int] | np.ndarray) -> bool:
        """Whether every sample index (within the shard) lies in this range."""
        array = np.asarray(samples)
        return bool(array.size == 0 or (array.min() >= self.start and array.max() < self.stop))

    def span(self, sample: int) -> SampleSpan:
        """Where sample `sample` (its index within the shard) lies in the entry's file."""
        if not self.start <= sample < self.stop:
            raise IndexError(f"sample {sample} is outside {self.key}")
        i = sample - self.start
        return SampleSpan(self.offsets[i] - self.byte_start, self.offsets[i + 1] - self.offsets[i])

    __getitem__ = span  # reads go through it as through a shard's `SampleIndex`

    def bad_samples(self, read: Callable[[int, int], bytes]) -> list[int]:
        """The samples whose bytes (`read(offset, size)`, in entry coordinates) fail their digest."""
        return [s for s in range(self.start, self.stop) if not self._matches(s, read(*self._at(s)))]

    def _at(self, sample: int) -> tuple[int, int]:
        span = self.span(sample)
        return span.offset, span.size

    def _matches(self, sample: int, data: bytes) -> bool:
        i = sample - self.start
        return sample_digest(data) == self.digests[SAMPLE_DIGEST_SIZE * i : SAMPLE_DIGEST_SIZE * (i + 1)]


class _SampleCheck:
    """Check each sample of a range as the written prefix of its file passes its end, reading
    the bytes back with `pread` (from the page cache: written moments ago)."""

    def __init__(self, fd: int, samples: SampleRange, what: str) -> None:
        self.fd, self.samples, self.what = fd, samples, what
        self.next = samples.start  # the first sample not checked yet
        self.bad: list[int] = []

    def update(self, _start: int, end: int) -> None:
        samples = self.samples
        while self.next < samples.stop and samples.offsets[self.next + 1 - samples.start] - samples.byte_start <= end:
            offset, size = samples._at(self.next)
            data = os.pread(self.fd, size, offset)
            if len(data) != size or not samples._matches(self.next, data):
                self.bad.append(self.next)
            self.next += 1

    def failure(self) -> str | None:
        if not self.bad and self.next == self.samples.stop:
            return None
        if not self.bad:  # the download ended before the range did: the engine says why, normally
            return f"{self.what}: samples {self.next}-{self.samples.stop - 1} of {self.samples.key} never arrived"
        return (
            f"{self.what}: samples {self.bad[:5]} of {self.samples.key} fail their digests in the shard's sample index"
        )


def write_verified_range(
    fd: int,
    engine: DownloadEngine,
    store: Store,
    samples: SampleRange,
    config: CacheConfig,
    priority: int,
    reader_waits: Callable[[], bool] | None = None,
) -> DownloadReport:
    """Fetch `samples` of their shard in `store` into `fd` (its bytes at 0, exactly
    `samples.size` of them) through `engine`, checking every sample against its digest as
    the bytes arrive. A range with a bad sample is fetched once more (the bytes may have been
    damaged on the way); a second failure raises `CorruptShard` naming the shard and samples.
    The digests are checked whatever `config.verify` says: they are the only check a range has.
    `reader_waits`: `fetch_checked`'s."""
    what = f"shard {samples.shard!r} in {store.url}"
    return fetch_checked(
        fd,
        engine,
        store,
        samples.shard,
        samples.size,
        config,
        priority,
        lambda: _SampleCheck(fd, samples, what),
        object_offset=samples.byte_start,
        reader_waits=reader_waits,
    )
