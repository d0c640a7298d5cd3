"""The read side of the sample path: what its readers keep beside the node cache.

* `indexes`: each cached shard's sample index. It is kept in the cache, walked once a node.
* `marks`: which samples decode cleanly, one byte a sample, shared by the node.
* `direct`: a cold pass's first samples, read straight from the store.
"""

from __future__ import annotations

from dlstore.read.direct import DIRECT_RETRY, DirectReads, read_samples, sample_runs
from dlstore.read.indexes import cached_sample_index, forget_sample_index
from dlstore.read.marks import NodeMarks

__all__ = [
    "DIRECT_RETRY",
    "DirectReads",
    "NodeMarks",
    "cached_sample_index",
    "forget_sample_index",
    "read_samples",
    "sample_runs",
]
