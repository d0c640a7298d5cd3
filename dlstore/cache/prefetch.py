"""The background prefetch of one process. `CacheConfig.shards_in_flight` daemon threads keep
the next shards of the reader's list cached, sooner ones first, each fetching one at a time.
The reader moves the window on as it reaches each shard. `pace.PrefetchPace` sets from the
measured rates how many download at once, and how wide. A shard the reader reaches while in
flight becomes a reader's download, by `DownloadEngine.hurry`. The state lives in `Runtime`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from dlstore.cache.layout import unlock_and_close
from dlstore.cache.pace import Concurrency
from dlstore.cache.runtime import Runtime
from dlstore.cache.spec import ShardSpec
from dlstore.errors import ProgramExiting

log = logging.getLogger(__name__)

_PACE_RECHECK_S = 0.25
# How long a prefetch that found no room waits before it looks again.
_NO_ROOM_RETRY_S = 0.2

#: Fetch a shard for the prefetch, given the shards its eviction must spare and its priority.
#: Returns its lock descriptor held shared, None when there is no room now, or `PREFETCH_DROPPED`.
PrefetchFetch = Callable[[ShardSpec, frozenset[str], int], "int | None"]
#: What a `PrefetchFetch` returns when `Fetcher.acquire` let the shard go. The readers had
#: passed it, or an evictor took it once fetched. It is done, not tried again: a reader's call.
PREFETCH_DROPPED = -1


def start_prefetch(
    rt: Runtime, specs: list[ShardSpec], depth: int, fetch: PrefetchFetch, caps: Concurrency, lead: int = 0
) -> None:
    """Replace the list of upcoming shards and start the threads not running yet, `caps.shards`
    of them. The threads keep `depth` shards from the readers' place cached. The list's first
    `lead` shards, those in use, go before any later one. The same list again keeps the
    readers' place in it. Only its depth and lead may change."""
    with rt.lock:
        same = specs == rt.upcoming and not rt.closing
        if same and (depth, lead) == (rt.depth, rt.lead):
            return
        rt.depth, rt.lead = depth, lead
        if not same:
            _count_passed(rt, specs)
            rt.upcoming = specs
            rt.position = 0
            rt.in_lead = False
            rt.done = set()
            rt.generation += 1
            rt.closing = False
        rt.threads = [thread for thread in rt.threads if thread.is_alive()]
        while len(rt.threads) < min(caps.shards, depth):
            thread = threading.Thread(
                target=_prefetch_loop, args=(rt, fetch, caps), name="dlstore-cache-prefetch", daemon=True
            )
            thread.start()
            rt.threads.append(thread)
        rt.wake.notify_all()


def _count_passed(rt: Runtime, specs: list[ShardSpec]) -> None:
    """A new list that starts further along the old one: count the old list's shards before it
    as reached, for the pace. With worker processes, this process learns how far the readers
    are only from the lists its loader gives."""
    if not specs or not rt.upcoming:
        return
    names = [spec.name for spec in rt.upcoming]
    try:
        first = names.index(specs[0].name)
    except ValueError:
        return
    now = time.monotonic()
    for spec in rt.upcoming[rt.position : first]:
        rt.pace.reached(spec.name, spec.size, now)


def stop_prefetch(rt: Runtime, timeout_s: float) -> None:
    """Stop the threads after their current downloads, waiting up to `timeout_s`."""
    with rt.lock:
        rt.closing = True
        rt.upcoming = []
        rt.wake.notify_all()
        threads, rt.threads = rt.threads, []
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(timeout=max(deadline - time.monotonic(), 0.0))


def raise_prefetch_error(rt: Runtime, name: str, moot: Callable[[], bool]) -> None:
    """Raise the error the prefetch of `name` failed with, once. Not when `moot()`: the shard is
    in the cache after all, and the error would end a run that has recovered. A prefetch of it
    under way decides first: the reader would otherwise fetch a shard that just failed again."""
    with rt.lock:
        while name in rt.active and not rt.closing:
            rt.wake.wait(0.05)
        error = rt.errors.pop(name, None)
    if error is not None and not moot():
        raise error


def advance_window(rt: Runtime, name: str, depth: int) -> frozenset[str]:
    """The reader reached `name`: move the prefetch window past it, and hurry its download if
    the prefetch is still fetching it. Return the window, which the reader's evictions spare.

    The window never moves past a shard of the lead, the shards in use, that is not in yet.
    A batch reads them all at once and in any order, so reaching one passes none of the
    others. The reached shard is marked done instead, and its reader fetches it."""
    in_flight = None
    with rt.lock:
        for index in range(rt.position, len(rt.upcoming)):
            if rt.upcoming[index].name == name:
                now = time.monotonic()
                if index < rt.lead or _lead_pending(rt, index):
                    rt.pace.reached(name, rt.upcoming[index].size, now)
                    rt.done.add(name)
                    rt.in_lead = True
                else:
                    for spec in rt.upcoming[rt.position : index + 1]:
                        rt.pace.reached(spec.name, spec.size, now)
                    rt.position = index + 1
                rt.wake.notify_all()
                if name in rt.active:
                    in_flight = rt.upcoming[index]
                break
        window = rt.upcoming[rt.position : _window_end(rt, depth)]
    if in_flight is not None and rt.engine is not None:
        rt.engine.hurry(*_object_of(in_flight))
    return frozenset(spec.name for spec in window)


def still_ahead(rt: Runtime, name: str) -> bool:
    """Whether shard `name` is in the prefetch window, or is the one the reader has just
    reached. A prefetch of a shard the readers have passed lets it go."""
    with rt.lock:
        # The lead may reach past the window: `_next_prefetch` fetches it whole.
        end = max(_window_end(rt, rt.depth), rt.lead)
        return any(spec.name == name for spec in rt.upcoming[max(rt.position - 1, 0) : end])


def _lead_pending(rt: Runtime, before: int) -> bool:
    """Whether a shard of the lead before list index `before` is not in yet."""
    return any(spec.name not in rt.done for spec in rt.upcoming[rt.position : min(rt.lead, before)])


def _window_end(rt: Runtime, depth: int) -> int:
    """Where the window ends: `depth` shards past the readers' place. Once they reach the lead,
    it ends `depth` past the lead's end, so the lead takes none of the window's places."""
    return (max(rt.position, rt.lead) if rt.in_lead else rt.position) + depth


def _object_of(spec: ShardSpec) -> tuple[str, int | None]:
    """The store object a spec's download reads and its first byte, as `hurry` names it."""
    if spec.samples is None:
        return spec.name, None
    return spec.samples.shard, spec.samples.byte_start


def _next_prefetch(rt: Runtime, depth: int, caps: Concurrency) -> tuple[ShardSpec, frozenset[str]] | None:
    """The next shard to prefetch, and the shards its eviction must spare: those sooner in the
    list, and the one the reader has just reached. A shard another thread fetches is skipped.
    None while the pace allows no more. Sets the engine's width for prefetches to the pace's."""
    engine = rt.engine
    if engine is None:
        pace = caps
    else:
        pace = rt.pace.concurrency(caps, engine.connection_rate, engine.shard_rate)
        engine.set_background_parts(pace.parts)
    if len(rt.active) >= pace.shards:
        return None
    start = rt.position
    window = rt.upcoming[start : _window_end(rt, depth)]
    lead = rt.upcoming[start : rt.lead]  # the list's first shards, until the readers pass them
    if any(spec.name not in rt.done for spec in lead):
        window = lead  # the shards in use first: the later ones would take their bandwidth and CPU
    for index, spec in enumerate(window):
        if spec.name not in rt.done and spec.name not in rt.active:
            return spec, frozenset(s.name for s in rt.upcoming[max(start - 1, 0) : start + index])
    return None


def _priority(rt: Runtime, spec: ShardSpec, sooner: frozenset[str]) -> int:
    """0 for a lead shard: readers wait for it, so it goes first and as wide as a reader's.
    A later shard's is 1 + the shards before it in the window, so sooner ones go first."""
    if any(s.name == spec.name for s in rt.upcoming[rt.position : rt.lead]):
        return 0
    return 1 + len(sooner)


def _prefetch_loop(rt: Runtime, fetch: PrefetchFetch, caps: Concurrency) -> None:
    while True:
        with rt.lock:
            job = None
            while not rt.closing and (job := _next_prefetch(rt, rt.depth, caps)) is None:
                # The pace changes with the rates, not only when woken: look again now and then.
                rt.wake.wait(timeout=_PACE_RECHECK_S if rt.active else None)
            if rt.closing or job is None:
                return
            generation = rt.generation
            spec, sooner = job
            rt.active.add(spec.name)
            priority = _priority(rt, spec, sooner)
        error: Exception | None = None
        try:
            fd = fetch(spec, sooner, priority)
        except ProgramExiting:  # nobody will read it: no warning, and no next shard
            with rt.lock:
                rt.active.discard(spec.name)
            return
        except Exception as exc:  # kept for the reader: raised when it reaches this shard
            log.warning("prefetch of shard %r failed: %s: %s", spec.name, type(exc).__name__, exc)
            fd, error = None, exc
        if fd is not None and fd != PREFETCH_DROPPED:
            unlock_and_close(fd)
            rt.announce_release()
        if rt.engine is not None:  # a hurry of it held for this fetch and its retries only
            rt.engine.forget_hurry(*_object_of(spec))
        with rt.lock:
            rt.active.discard(spec.name)  # and marked done in the same breath: no thread fetches it twice
            if error is not None:
                rt.errors[spec.name] = error
                rt.done.add(spec.name)
            elif fd is None:  # no room without evicting a shard the plan keeps: look again later
                _wait_for_room(rt, generation)
            elif generation == rt.generation:
                rt.done.add(spec.name)


def _wait_for_room(rt: Runtime, generation: int) -> None:
    """Holding `rt.lock`, wait before a prefetch without room looks again. A new list or
    `stop_prefetch` ends the wait, a reader's release does not. In a cache full of hinted
    shards a release makes no room for a prefetch, and each wake would rescan the cache."""
    deadline = time.monotonic() + _NO_ROOM_RETRY_S
    while not rt.closing and rt.generation == generation and (left := deadline - time.monotonic()) > 0:
        rt.wake.wait(timeout=left)
