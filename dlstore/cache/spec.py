"""What the cache is asked for: a shard as the manifest lists it, or a run of its samples.

A `ShardSpec` names a shard. A `SampleRange` is a run of its samples cached as an entry of
its own. Why runs: the plan gives each node a contiguous range of samples, so a node's first
and last shards are usually shared with its neighbours. Fetching only the node's samples keeps each
node at its share of the bytes. A run is locked, reserved, counted, published and evicted
like a shard, under its own key. Only its download differs: see `download.write_verified`.

The trade-off: a node that reads both a run and its whole shard caches the run twice. A shard
whose index has no sample digests, version 1, cannot be checked in part, so it is fetched whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from dlstore.format.sample_index import SAMPLE_DIGEST_SIZE, SampleIndex, SampleSpan, sample_digest

__all__ = ["SampleRange", "ShardSpec"]


@dataclass(frozen=True, eq=False)
class SampleRange:
    """Samples `start .. stop-1` of shard `shard`. `offsets` are their `stop - start + 1` byte
    offsets in the shard. `digests` holds their sample digests end to end.

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
        """The entry's name in the cache, apart from the shard's and from other runs of it."""
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
        """Whether every sample index, counted within the shard, lies in this range."""
        array = np.asarray(samples)
        return bool(array.size == 0 or (array.min() >= self.start and array.max() < self.stop))

    def span(self, sample: int) -> SampleSpan:
        """Where sample `sample`, by its index within the shard, lies in the entry's file."""
        if not self.start <= sample < self.stop:
            raise IndexError(f"sample {sample} is outside {self.key}")
        i = sample - self.start
        return SampleSpan(self.offsets[i] - self.byte_start, self.offsets[i + 1] - self.offsets[i])

    __getitem__ = span  # reads go through it as through a shard's `SampleIndex`

    def matches(self, sample: int, data: bytes) -> bool:
        """Whether `data` are the bytes of `sample`, by its digest."""
        i = sample - self.start
        return sample_digest(data) == self.digests[SAMPLE_DIGEST_SIZE * i : SAMPLE_DIGEST_SIZE * (i + 1)]

    def bad_samples(self, read: Callable[[int, int], bytes]) -> list[int]:
        """The samples whose bytes fail their digest. `read(offset, size)` reads the entry's file."""
        bad = []
        for sample in range(self.start, self.stop):
            span = self.span(sample)
            if not self.matches(sample, read(span.offset, span.size)):
                bad.append(sample)
        return bad


class ShardSpec(NamedTuple):
    """A shard as the manifest describes it: its key in the store, byte size and checksum.
    With `samples`, it is a run of samples: `name` is `samples.key`, `size` its bytes, no checksum."""

    name: str
    size: int | None = None
    checksum: str | None = None
    samples: SampleRange | None = None
