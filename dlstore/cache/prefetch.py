"""The background prefetch of one process: daemon threads (`CacheConfig.shards_in_flight`
of them, each fetching one shard at a time) that keep the next `CacheConfig.prefetch`
shards of the reader's list cached, sooner shards first, and the window that the reader
moves on as it reaches each shard. How many of the threads download at once is paced by
the rates measured (`pace.PrefetchPace`). All of its state lives in the process's `_Runtime`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from dlstore.cache.config import ShardSpec
from dlstore.cache.layout import _release
from dlstore.cache.runtime import _Runtime

log = logging.getLogger(__name__)

_PACE_RECHECK_S = 0.25

#: Fetch a shard for the prefetch: (shard, the shards its eviction must spare) -> the shard's
#: lock descriptor held shared, or None when there is no room for it now.
PrefetchFetch = Callable[[ShardSpec, frozenset[str]], "int | None"]


def start_prefetch(rt: _Runtime, specs: list[ShardSpec], depth: int, fetch: PrefetchFetch, threads: int) -> None:
    """Replace the list of upcoming shards, and start the threads that do not run already.
    The same list again changes nothing: the readers' place in it stands."""
    with rt.lock:
        if specs == rt.upcoming and not rt.closing:
            return
        rt.upcoming = specs
        rt.position = 0
        rt.done = set()
        rt.generation += 1
        rt.closing = False
        rt.threads = [thread for thread in rt.threads if thread.is_alive()]
        while len(rt.threads) < min(threads, depth):
            thread = threading.Thread(
                target=_prefetch_loop, args=(rt, depth, fetch, threads), name="dlstore-cache-prefetch", daemon=True
            )
            thread.start()
            rt.threads.append(thread)
        rt.wake.notify_all()


def stop_prefetch(rt: _Runtime, timeout_s: float) -> None:
    """Stop the threads after their current downloads (waiting up to `timeout_s`)."""
    with rt.lock:
        rt.closing = True
        rt.upcoming = []
        rt.wake.notify_all()
        threads, rt.threads = rt.threads, []
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(timeout=max(deadline - time.monotonic(), 0.0))


def raise_prefetch_error(rt: _Runtime, name: str) -> None:
    with rt.lock:
        error = rt.errors.pop(name, None)
    if error is not None:
        raise error


def advance_window(rt: _Runtime, name: str, depth: int) -> frozenset[str]:
    """The reader reached `name`: move the prefetch window past it. Returns the window,
    which the reader's own evictions spare when they can."""
    with rt.lock:
        for index in range(rt.position, len(rt.upcoming)):
            if rt.upcoming[index].name == name:
                now = time.monotonic()
                for spec in rt.upcoming[rt.position : index + 1]:
                    rt.pace.reached(spec.name, spec.size, now)
                rt.position = index + 1
                rt.wake.notify_all()
                break
        window = rt.upcoming[rt.position : rt.position + depth]
    return frozenset(spec.name for spec in window)


def _next_prefetch(rt: _Runtime, depth: int, cap: int) -> tuple[ShardSpec, frozenset[str]] | None:
    """The next shard to prefetch, and the shards its eviction must spare: those sooner in
    the list, and the one the reader has just reached (it may not hold its lock yet). A shard
    another prefetch thread is fetching is skipped; none while the pace allows no more."""
    shard_rate = rt.engine.shard_rate if rt.engine is not None else None
    if len(rt.active) >= rt.pace.shards_at_once(cap, shard_rate):
        return None
    start = rt.position
    window = rt.upcoming[start : start + depth]
    for index, spec in enumerate(window):
        if spec.name not in rt.done and spec.name not in rt.active:
            return spec, frozenset(s.name for s in rt.upcoming[max(start - 1, 0) : start + index])
    return None


def _prefetch_loop(rt: _Runtime, depth: int, fetch: PrefetchFetch, cap: int) -> None:
    while True:
        with rt.lock:
            job = None
            while not rt.closing and (job := _next_prefetch(rt, depth, cap)) is None:
                # The pace changes with the rates, not only when woken: look again now and then.
                rt.wake.wait(timeout=_PACE_RECHECK_S if rt.active else None)
            if rt.closing or job is None:
                return
            generation = rt.generation
            spec, sooner = job
            rt.active.add(spec.name)
        error: Exception | None = None
        try:
            fd = fetch(spec, sooner)
        except Exception as exc:  # kept for the reader: raised when it reaches this shard
            log.warning("prefetch of shard %r failed: %s: %s", spec.name, type(exc).__name__, exc)
            fd, error = None, exc
        if fd is not None:
            _release(fd)
        with rt.lock:
            rt.active.discard(spec.name)  # and marked done in the same breath: no thread fetches it twice
            if error is not None:
                rt.errors[spec.name] = error
                rt.done.add(spec.name)
            elif fd is None:  # no room without evicting what is needed sooner: try again later
                rt.wake.wait(timeout=0.2)
            elif generation == rt.generation:
                rt.done.add(spec.name)
