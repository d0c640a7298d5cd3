"""The state a `ShardCache` keeps in one process (counters, the prefetch list and threads,
the download engine): rebuilt after fork or unpickling, never pickled."""

from __future__ import annotations

import os
import threading
import time

from dlstore.cache.config import ShardSpec
from dlstore.cache.engine import DownloadEngine
from dlstore.cache.layout import CacheStats, EpochStats
from dlstore.cache.pace import PrefetchPace
from dlstore.errors import raise_if_exiting
from dlstore.storage.base import Store


class _Runtime:
    """State of one process: rebuilt after fork or unpickling, never pickled."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        # Shard locks this process released (`announce_release`): its threads that wait for
        # one (a reader polling another thread's download, a reservation waiting for room) wake
        # on `wake` when this moves, not at the end of their poll interval.
        self.releases = 0
        self.started = False
        self.stats = CacheStats()
        self.pending = CacheStats()  # not yet added to stats.json
        self.last_flush = time.monotonic()
        # per epoch (`ShardCache.set_epoch`): the epoch read now, that of each shard a batch
        # named last, that of the prefetch list, and the counters not yet added to stats.json
        self.epoch: int | None = None
        self.read_epochs: dict[str, int] = {}
        self.prefetch_epoch: int | None = None
        self.pending_epochs: dict[int, EpochStats] = {}
        # prefetch
        self.upcoming: list[ShardSpec] = []
        self.position = 0  # index in `upcoming` the readers have passed (not past the lead until it is in)
        self.depth = 0  # shards from `position` on that the prefetch keeps cached (the last list's)
        self.lead = 0  # the list's first shards, fetched before any after them (`start_prefetch`)
        self.in_lead = False  # a reader has reached the lead: the window counts from its end
        self.generation = 0
        self.done: set[str] = set()
        self.errors: dict[str, BaseException] = {}
        self.active: set[str] = set()  # shards a prefetch thread is fetching now
        self.pace = PrefetchPace()  # how many of them at once
        # `ShardCache.read_direct`'s: its GETs at once, and its store (a short retry), made once
        self.direct_gets: threading.Semaphore | None = None
        self.direct_store: Store | None = None
        self.threads: list[threading.Thread] = []
        self.closing = False
        # downloads: made when the cache is first used in this process
        self.engine: DownloadEngine | None = None

    def announce_release(self) -> None:
        """A shard lock of this process was released: wake its threads waiting for one."""
        with self.lock:
            self.releases += 1
            self.wake.notify_all()

    def sleep_unless_released(self, seen: int, seconds: float) -> float:
        """Sleep up to `seconds`, less if a lock is released (or was since `releases` was
        `seen`); the seconds slept. Locks of other processes still take the whole poll. Once
        the program exits this wait is given up (`ProgramExiting`): it would hold the exit."""
        raise_if_exiting("a wait in the cache")
        started = time.monotonic()
        with self.lock:
            if self.releases == seen:
                self.wake.wait(seconds)
        return time.monotonic() - started
