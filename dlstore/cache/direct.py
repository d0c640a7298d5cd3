"""Samples of a shard that is not cached yet, read straight from the store.

Why: from a cold cache the first batch of a pass waits for every shard it draws from (two
with the plan's window ramp, 512 MB at the default shard size: ~2 s at 40 MB/s per
connection), although it needs a few MB of them. Its samples are fetched by themselves
(ranged GETs, several at once), and training starts; the shards' downloads begin once that
batch is handed on (`Dataset.first_batch_delivered`).

Trust: a sample is used only if its bytes match its digest in the shard's version 2 sample
index, which itself matched the manifest's checksum of it (`load_sample_index`). Bytes that do
not match are not used: the caller reads the samples from the shard once it is cached, where
the shard's checksum decides (a damaged shard raises `CorruptShard` there, as without this).

Cost: the batch's bytes twice (here and in its shards), once per pass that starts cold; a
small GET of each such shard's sample index; and the shards start that much later.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from concurrent import futures
from contextlib import AbstractContextManager

from dlstore.format.sample_index import SampleIndex, sample_digest
from dlstore.storage.base import Store

__all__ = ["DIRECT_RETRY", "read_samples", "sample_runs"]

#: The most bytes one ranged GET reads: neighbouring samples are read together up to this.
RUN_BYTES = 4 * 2**20
#: The retry policy of direct reads (`RetryConfig` fields): short, since a failure only sends
#: the batch to the cache, which must not wait out the default deadline first.
DIRECT_RETRY = {
    "max_attempts": 3,
    "max_backoff_s": 1.0,
    "deadline_s": 10.0,
    "read_timeout_s": 10.0,
    "stall_timeout_s": 10.0,
}


def sample_runs(index: SampleIndex, samples: Sequence[int], most: int = RUN_BYTES) -> list[list[int]]:
    """`samples` (indexes within the shard) in runs that lie end to end in the shard, each of
    at most `most` bytes (or one sample): one ranged GET per run.

    >>> index = SampleIndex([0, 1024, 2048, 3072, 4096], 4096)
    >>> sample_runs(index, [3, 0, 1], most=1500), sample_runs(index, [0, 1, 3])
    ([[0], [1], [3]], [[0, 1], [3]])
    """
    runs: list[list[int]] = []
    for sample in sorted(set(samples)):
        span = index[sample]
        if runs:
            first, last = index[runs[-1][0]], index[runs[-1][-1]]
            if last.offset + last.size == span.offset and span.offset + span.size - first.offset <= most:
                runs[-1].append(sample)
                continue
        runs.append([sample])
    return runs


def read_samples(
    store: Store,
    wanted: Sequence[tuple[str, SampleIndex, Sequence[int]]],
    connections: int,
    gate: Callable[[], AbstractContextManager] | None = None,
) -> dict[str, dict[int, bytes]]:
    """For each `(name, index, samples)` of `wanted`, the bytes of those samples of shard
    `name` in `store`, each checked against its digest in `index` (version 2); all shards' runs
    in about `connections` GETs, all at once. A shard with a sample that fails its digest
    is left out. Errors of the store propagate. `gate()`: entered around each GET (bounds on
    GETs at once shared by the calls of several threads, and by the node's processes)."""
    runs = [(name, index, sample_runs(index, samples)) for name, index, samples in wanted]
    # As many GETs as connections, each of as many ranges as that takes (the store allowing):
    # fewer requests for the store to serve, and no link slower than its share of them.
    total = sum(len(shard_runs) for _, _, shard_runs in runs)
    per_get = max(1, min(store.ranges_per_get, math.ceil(total / max(1, connections))))
    jobs = [
        (name, index, shard_runs[i : i + per_get])
        for name, index, shard_runs in runs
        for i in range(0, len(shard_runs), per_get)
    ]

    def fetch(job: tuple[str, SampleIndex, list[list[int]]]) -> dict[int, bytes] | None:
        name, index, runs = job
        spans = [
            (index[run[0]].offset, index[run[-1]].offset + index[run[-1]].size - index[run[0]].offset) for run in runs
        ]
        with gate() if gate is not None else contextlib.nullcontext():
            got = store.get_ranges(name, spans)
        if len(got) != len(spans):
            return None
        out = {}
        for run, (first, _), data in zip(runs, spans, got):
            for sample in run:
                span = index[sample]
                raw = data[span.offset - first : span.offset - first + span.size]
                if sample_digest(raw) != index.digest(sample):
                    return None
                out[sample] = raw
        return out

    if len(jobs) <= 1:
        got = [fetch(job) for job in jobs]
    else:
        with futures.ThreadPoolExecutor(min(len(jobs), max(1, connections)), "dlstore-direct-read") as pool:
            got = list(pool.map(fetch, jobs))
    shards: dict[str, dict[int, bytes]] = {}
    failed = set()
    for (name, _, _), part in zip(jobs, got):
        if part is None:
            failed.add(name)
        else:
            shards.setdefault(name, {}).update(part)
    return {name: samples for name, samples in shards.items() if name not in failed}
