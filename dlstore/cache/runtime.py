"""The state a `ShardCache` keeps in one process: counters, the prefetch, the download engine.
`ProcessLocal` rebuilds it after a fork or unpickling. It is never pickled."""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import multiprocessing.util
import os
import threading
import time
import weakref
from collections.abc import Callable

from dlstore.cache.engine import DownloadEngine
from dlstore.cache.layout import CacheDir, CacheStats, EpochStats, unlock_and_close
from dlstore.cache.mapped import MappedEntries
from dlstore.cache.pace import PrefetchPace
from dlstore.cache.spec import ShardSpec
from dlstore.errors import raise_if_exiting

log = logging.getLogger(__name__)


class Runtime:
    """State of one process: rebuilt after fork or unpickling, never pickled."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        # Counts the shard locks this process released. Its threads waiting for one wake on
        # `wake` when this moves, not at the end of their poll.
        self.releases = 0
        self.started = False
        self.stats = CacheStats()
        self.pending = CacheStats()  # not yet added to stats.json
        self.last_flush = time.monotonic()
        # Per epoch, from `ShardCache.set_epoch`: the epoch read now, the one each shard was
        # last named in, the prefetch list's, and the counters not yet added to stats.json.
        self.epoch: int | None = None
        self.read_epochs: dict[str, int] = {}
        self.prefetch_epoch: int | None = None
        self.pending_epochs: dict[int, EpochStats] = {}
        # The prefetch, run by `dlstore.cache.prefetch`.
        self.upcoming: list[ShardSpec] = []
        self.position = 0  # index in `upcoming` the readers have passed; not past the lead until it is in
        self.depth = 0  # shards from `position` on that the prefetch keeps cached
        self.lead = 0  # the list's first shards, fetched before any after them
        self.in_lead = False  # a reader has reached the lead: the window counts from its end
        self.generation = 0
        self.done: set[str] = set()
        self.errors: dict[str, BaseException] = {}
        self.active: set[str] = set()  # shards a prefetch thread is fetching now
        self.pace = PrefetchPace()  # how many of them at once
        self.threads: list[threading.Thread] = []
        self.closing = False
        self.engine: DownloadEngine | None = None  # made when the cache is first used here
        self.mapped = MappedEntries(self.release_lock)  # entries this process reads, held between reads

    def release_lock(self, fd: int) -> None:
        """Let go of a shard lock of this process, and say so."""
        unlock_and_close(fd)
        self.announce_release()

    def announce_release(self) -> None:
        """A shard lock of this process was released: wake its threads waiting for one."""
        with self.lock:
            self.releases += 1
            self.wake.notify_all()

    def sleep_unless_released(self, seen: int, seconds: float) -> float:
        """Sleep up to `seconds`, less if a lock was released since `releases` was `seen`.
        Return the seconds slept. Locks of other processes still take the whole poll. Once the
        program exits, raise `ProgramExiting` instead: the wait would hold the exit."""
        raise_if_exiting("a wait in the cache")
        started = time.monotonic()
        with self.lock:
            if self.releases == seen:
                self.wake.wait(seconds)
        return time.monotonic() - started

    # -- counters ------------------------------------------------------------------------------
    def count(self, epoch: int | None = None, **deltas: float) -> None:
        """Add `CacheStats` fields to this process's counters. Hits, misses and bytes are also
        counted under `epoch`, when it is known."""
        delta = CacheStats(**deltas)
        with self.lock:
            self.stats.add(delta)
            self.pending.add(delta)
            if epoch is not None and (delta.hits or delta.misses):
                self.pending_epochs.setdefault(epoch, EpochStats()).add(
                    EpochStats(delta.hits, delta.misses, delta.bytes_fetched)
                )

    def epoch_of(self, name: str) -> int | None:
        """The epoch, from `set_epoch`, a reader's hit or download of shard `name` counts under."""
        with self.lock:
            return self.read_epochs.get(name, self.epoch)

    def flush(self, directory: CacheDir, force: bool = False) -> None:
        """Add pending counters to stats.json. Downloads and evictions `force` it at once.
        Otherwise it runs at most once a second, so a hit costs no cache-wide lock. Never call
        it while holding the cache-wide lock."""
        with self.lock:
            if not force and time.monotonic() - self.last_flush < 1.0:
                return
            pending, self.pending = self.pending, CacheStats()
            epochs, self.pending_epochs = self.pending_epochs, {}
            self.last_flush = time.monotonic()
        if pending.is_zero() and not epochs:
            return
        if not os.path.isdir(directory.root):  # a temporary cache was removed: nothing to record
            return
        try:
            with directory.locked():
                directory.add_stats(pending, epochs)
        except OSError as exc:
            log.warning("could not record cache counters in %s: %s", directory.stats_path, exc)


class ProcessLocal:
    """A cache's `Runtime` in the process that uses it, made and started once in each process.
    `start` sets the process up. The counters are flushed when the process exits."""

    def __init__(self, directory: CacheDir, start: Callable[[Runtime], None]) -> None:
        self.directory = directory
        self._start = start
        self._rt: Runtime | None = None

    def current(self) -> Runtime | None:
        """This process's runtime, None before its first use here."""
        rt = self._rt
        return rt if rt is not None and rt.pid == os.getpid() else None

    def get(self) -> Runtime:
        """This process's runtime, started."""
        rt = self._rt
        if rt is not None and rt.pid == os.getpid() and rt.started:
            return rt
        with _start_lock:
            rt = self._rt
            if rt is None or rt.pid != os.getpid():
                if rt is not None and rt.engine is not None and rt.engine.slots is not None:
                    rt.engine.slots.forget_after_fork()  # the parent's descriptors, not its locks
                if rt is not None:
                    rt.mapped.forget_after_fork()
                rt = self._rt = Runtime()  # new process: fresh counters, no thread
            if not rt.started:
                self._start(rt)
                rt.started = True
                _live.add(self)
                _flush_at_worker_exit()
        return rt

    def flush_stats(self) -> None:
        """Add this process's counters not yet recorded to the directory's totals."""
        rt = self.current()
        if rt is not None:
            rt.flush(self.directory, force=True)


_start_lock = threading.Lock()
_live: weakref.WeakSet[ProcessLocal] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    global _start_lock
    _start_lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _flush_live() -> None:
    for local in list(_live):
        with contextlib.suppress(Exception):
            local.flush_stats()


_finalizer_pid: int | None = None


def _flush_at_worker_exit() -> None:
    """In a `multiprocessing` child, flush the counters as it exits. A forked one ends with
    `os._exit`, which runs no `atexit` hook, only multiprocessing's finalizers. Registered
    once per process: multiprocessing clears the registry a child starts with."""
    global _finalizer_pid
    if _finalizer_pid != os.getpid() and multiprocessing.parent_process() is not None:
        _finalizer_pid = os.getpid()
        multiprocessing.util.Finalize(None, _flush_live, exitpriority=10)
