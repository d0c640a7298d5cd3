"""Samples of a shard that is not cached yet, read straight from the store.

Why: from a cold cache, a pass's first batch waits for every shard it draws from. Yet it needs
only a few samples of each. Its samples are fetched by themselves, several ranged GETs at once,
and training starts. The shards' downloads begin once `Dataset.first_batch_delivered` says
that batch was handed on.

Trust: a sample is used only if its bytes match its digest in the shard's version 2 sample
index. `load_sample_index` checked that index against the manifest's checksum. Bytes that do
not match are not used: the caller reads those samples from the cached shard, whose checksum decides.

Cost: the batch's bytes come twice, once per pass that starts cold. Each shard's sample index
costs a small GET. The shards start that much later.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from contextlib import AbstractContextManager

from dlstore.cache import ShardCache
from dlstore.format.sample_index import SampleIndex, sample_digest
from dlstore.storage.base import Store

__all__ = ["DIRECT_RETRY", "DirectReads", "read_samples", "sample_runs"]

#: The most bytes one ranged GET reads: neighbouring samples are read together up to this.
RUN_BYTES = 4 * 2**20
#: The retry policy of direct reads, as `RetryConfig` fields. It is short: a failure only sends
#: the batch to the cache, which must not wait out the default deadline first.
DIRECT_RETRY = {
    "max_attempts": 3,
    "max_backoff_s": 1.0,
    "deadline_s": 10.0,
    "read_timeout_s": 10.0,
    "stall_timeout_s": 10.0,
}


def sample_runs(index: SampleIndex, samples: Sequence[int], most: int = RUN_BYTES) -> list[list[int]]:
    """`samples`, indexes within the shard, in runs that lie end to end in the shard. Each run
    holds at most `most` bytes, or one sample, and takes one ranged GET.

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
    `name`, each checked against its digest in `index`. All shards' runs go in about
    `connections` GETs at once. A shard with a sample that fails its digest is left out.
    Errors of the store propagate. `gate()` is entered around each GET, to bound them."""
    runs = [(name, index, sample_runs(index, samples)) for name, index, samples in wanted]
    # As many GETs as connections, each of as many ranges as that takes, as the store allows.
    # Fewer requests for the store to serve, and no link slower than its share of them.
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


_lock = threading.Lock()


def _new_lock() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_new_lock)


class DirectReads:
    """Direct reads beside one cache, with this process's store and bound on GETs at once.
    Picklable. A new process makes its own store and bound on first use."""

    def __init__(self, cache: ShardCache) -> None:
        self.cache = cache
        self._state: tuple[int, Store, threading.BoundedSemaphore] | None = None  # pid, store, gets

    def __getstate__(self) -> dict:
        return {"cache": self.cache}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["cache"])  # type: ignore[misc]

    @property
    def connections(self) -> int:
        return self.cache.config.parts_in_flight * 2

    def _process_state(self) -> tuple[int, Store, threading.BoundedSemaphore]:
        state = self._state
        if state is None or state[0] != os.getpid():
            with _lock:
                state = self._state
                if state is None or state[0] != os.getpid():
                    store = self.cache.store
                    short = store.with_retry(dataclasses.replace(store.config.retry, **DIRECT_RETRY))
                    state = self._state = (os.getpid(), short, threading.BoundedSemaphore(self.connections))
        return state

    @property
    def store(self) -> Store:
        """The store with direct reads' short retry. It is one per process, so what it learns in
        `Store.ranges_per_get` holds for later reads. Sample indexes are read through it too."""
        return self._process_state()[1]

    def read(self, wanted: Sequence[tuple[str, SampleIndex, Sequence[int]]]) -> dict[str, dict[int, bytes]]:
        """`read_samples` of the shards of `wanted` that are not cached, counted in
        `CacheStats.bytes_direct`. At most `connections` GETs run at once in this process. Each
        holds a node connection slot, as a download's part does. A slot not had within the short
        deadline raises `TransientError`, which sends the caller to the cache."""
        wanted = [w for w in wanted if not self.cache.cached(w[0])]
        if not wanted:
            return {}
        _, store, gets = self._process_state()

        @contextlib.contextmanager
        def gate() -> Iterator[None]:
            # The process's bound first: a node slot is never held while waiting for it.
            with gets, self.cache.node_slot(DIRECT_RETRY["deadline_s"]):
                yield

        got = read_samples(store, wanted, self.connections, gate)
        if got:  # recorded at once, as a download is: once per pass
            self.cache.count_direct(sum(len(data) for samples in got.values() for data in samples.values()))
        return got
