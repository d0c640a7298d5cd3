"""Fetching: take an entry's lock shared, with a good copy under it. Download or replace the
copy first when needed. `Fetcher.acquire` is a state machine over the shard's lock: see `Step`."""

from __future__ import annotations

import contextlib
import enum
import fcntl
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from dlstore.cache.config import STATS_FILE_BYTES, CacheConfig
from dlstore.cache.download import NO_SPACE_ERRNOS, file_digest, split_checksum, write_verified
from dlstore.cache.layout import CacheDir, try_flock, unlink_quietly, unlock_and_close
from dlstore.cache.prefetch import PREFETCH_DROPPED, still_ahead
from dlstore.cache.room import Room, check_fits
from dlstore.cache.runtime import Runtime
from dlstore.cache.spec import ShardSpec
from dlstore.errors import NoSpace, TransientError
from dlstore.storage.base import Store

log = logging.getLogger(__name__)

# Sleeps, first and longest, while another process holds a shard's lock. A release in this
# process ends them early: see `Runtime.sleep_unless_released`.
_LOCK_POLL_S = (0.001, 0.05)


class Step(enum.Enum):
    """Where `Fetcher.acquire` stands with an entry's lock. LOOK goes to HELD, TAKE, WAIT or
    DROPPED. BAD_COPY goes to LOOK or TAKE. TAKE goes to LOOK, WAIT or NO_ROOM. WAIT goes to
    LOOK or BAD_COPY, or raises `TransientError` at the deadline."""

    LOOK = "take the lock shared and look at the copy"
    BAD_COPY = "a recheck found the copy bad: wait to replace it, unless another process does"
    TAKE = "take the lock exclusively, to fetch or replace the copy"
    WAIT = "another process holds the lock exclusively: sleep, then look again"
    HELD = "done: a good copy, the lock held shared"
    NO_ROOM = "done: a prefetch found no room for it now"
    DROPPED = "done: a prefetch let it go, the readers no longer need it from it"


_DONE = (Step.HELD, Step.NO_ROOM, Step.DROPPED)


def _file_identity(path: str) -> tuple[int, int] | None:
    """The inode and mtime in ns of the file at `path`, or None when there is none. A copy
    replaced by a publish, a rename, has another."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns


@dataclass(frozen=True)
class Request:
    """Who asks for an entry. It holds the shards its evictions spare and whether it is a
    prefetch. It also holds its download's priority in the engine, and the epoch it counts under."""

    protect: frozenset[str] = frozenset()
    prefetching: bool = False
    priority: int = 0
    epoch: int | None = None


class _Acquire:
    """One `Fetcher.acquire`: what it was asked, and the state its steps share."""

    def __init__(self, fetcher: Fetcher, rt: Runtime, spec: ShardSpec, recheck: bool, request: Request) -> None:
        self.fetcher, self.rt, self.spec, self.recheck, self.request = fetcher, rt, spec, recheck, request
        self.stem = fetcher.stem(spec.name)
        self.path = fetcher.directory.shard_path(self.stem)
        self.deadline = time.monotonic() + fetcher.config.wait_timeout_s
        self.delay, self.waited = _LOCK_POLL_S[0], 0.0
        self.seen = 0  # `rt.releases` when the lock was last looked at
        self.downloaded = False  # by this call: no recheck of its own download
        self.wanted: int | None = None  # held while a reader waits for another process's download
        # A recheck found this copy bad: wait for the exclusive lock to replace it, and do not
        # hash it again under a shared one. Every reader of a damaged shard rechecks it at once,
        # and each one's shared lock would refuse the others' exclusive one, round after round.
        self.bad_copy: tuple[int, int] | None = None  # inode and mtime of the copy found bad
        self.fd = -1

    def run(self) -> int | None:
        self.fd = self.fetcher.directory.open_lock(self.stem)
        steps = {Step.LOOK: self.look, Step.BAD_COPY: self.bad, Step.TAKE: self.take, Step.WAIT: self.wait}
        step = Step.LOOK
        try:
            while step not in _DONE:
                step = steps[step]()
        except BaseException:
            with contextlib.suppress(OSError):
                unlock_and_close(self.fd)
            self.rt.announce_release()  # a failed download's lock: its waiters look again now
            raise
        finally:
            if self.wanted is not None:
                unlock_and_close(self.wanted)
        return {Step.HELD: self.fd, Step.NO_ROOM: None, Step.DROPPED: PREFETCH_DROPPED}[step]

    @property
    def rechecking(self) -> bool:
        return self.recheck and not self.downloaded

    def look(self) -> Step:
        self.seen = self.rt.releases
        if not try_flock(self.fd, fcntl.LOCK_SH):
            return Step.WAIT
        state = self.fetcher.cached_state(self.path, self.spec, self.rechecking)
        if state == "ok":
            return self.held()
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        if state == "bad" and self.rechecking:
            self.bad_copy = _file_identity(self.path)
        prefetching = self.request.prefetching
        if prefetching and state == "missing" and (self.downloaded or not still_ahead(self.rt, self.spec.name)):
            # Evicted between this download and its shared lock, or passed by the readers while
            # this waited for its lock: fetching it is the readers' call now.
            unlock_and_close(self.fd)
            self.rt.announce_release()
            return Step.DROPPED
        return Step.TAKE

    def bad(self) -> Step:
        self.seen = self.rt.releases
        if _file_identity(self.path) != self.bad_copy:
            # Replaced by another process meanwhile: that copy was checked as it was fetched.
            self.bad_copy, self.downloaded = None, True
            return Step.LOOK
        return Step.TAKE

    def take(self) -> Step:
        if not try_flock(self.fd, fcntl.LOCK_EX):
            return Step.WAIT
        self.bad_copy = None
        fetched = self.fetcher.fetch_exclusively(
            self.rt, self.spec, self.stem, self.path, self.rechecking, self.request
        )
        if fetched is None:
            # No announcement: it would wake the other prefetch threads without room, which
            # would wake this one, and so on. A reader polls this lock.
            unlock_and_close(self.fd)
            return Step.NO_ROOM
        self.downloaded = self.downloaded or fetched
        # EX -> SH is not atomic: an evictor may slip in, so look again.
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.rt.announce_release()
        return Step.LOOK

    def wait(self) -> Step:
        # Another process downloads or evicts it. A reader says it waits, so that a prefetch
        # of it there is widened: see `reader_waits`.
        if self.wanted is None and not self.request.prefetching:
            self.wanted = self.fetcher.directory.mark_wanted(self.stem)
        if time.monotonic() > self.deadline:
            holders = (
                "its copy failed a recheck, and other processes still hold it (reading or checking it)"
                if self.bad_copy is not None
                else "another process is still downloading or evicting it"
            )
            config = self.fetcher.config
            raise TransientError(
                f"waited {config.wait_timeout_s:.0f}s for shard {self.spec.name!r} in cache "
                f"{config.cache_dir}: {holders}"
            )
        self.waited += self.rt.sleep_unless_released(self.seen, self.delay)
        self.delay = min(self.delay * 2, _LOCK_POLL_S[1])
        return Step.LOOK if self.bad_copy is None else Step.BAD_COPY

    def held(self) -> Step:
        with contextlib.suppress(OSError):
            os.utime(self.path)  # LRU: the last access
        if not self.downloaded and not self.request.prefetching:
            self.rt.count(self.request.epoch, hits=1)
        if self.waited:
            self.rt.count(wait_time_s=self.waited)
        self.rt.flush(self.fetcher.directory, force=self.downloaded)
        return Step.HELD


class Fetcher:
    """Gets entries of one store into one cache directory: locks, downloads, verifies, publishes."""

    def __init__(
        self, config: CacheConfig, store: Store, directory: CacheDir, room: Room, stem: Callable[[str], str]
    ) -> None:
        self.config, self.store, self.directory, self.room, self.stem = config, store, directory, room, stem

    def acquire(
        self,
        rt: Runtime,
        spec: ShardSpec,
        *,
        recheck: bool = False,
        protect: frozenset[str] = frozenset(),
        prefetching: bool = False,
        priority: int = 0,
        epoch: int | None = None,
    ) -> int | None:
        """The entry's lock file descriptor, held shared over a published, valid copy. When
        `prefetching`, return None if there is no room for it now, and `PREFETCH_DROPPED` if
        the readers no longer need it from the prefetch. A download goes by `priority` in the
        engine, lower first. It and a hit count under `epoch`, by default the shard's."""
        if spec.checksum is not None:
            split_checksum(spec.checksum)
        self.check_size(spec)
        if epoch is None:
            epoch = rt.epoch_of(spec.name)
        return _Acquire(self, rt, spec, recheck, Request(protect, prefetching, priority, epoch)).run()

    def fetch_exclusively(
        self, rt: Runtime, spec: ShardSpec, stem: str, path: str, recheck: bool, request: Request
    ) -> bool | None:
        """Holding the entry's lock exclusively, look again: another process may have published
        it. Then fetch it unless it is there. Return whether it was downloaded, or None when
        `prefetching` and there is no room for it now."""
        state = self.cached_state(path, spec, recheck)
        if state == "ok":
            return False
        if state == "bad":
            os.unlink(path)
            rt.count(corrupt_replaced=1)
            log.warning("cached shard %r is corrupt; fetching it again", spec.name)
        return True if self._download(rt, spec, stem, path, request) else None

    def check_size(self, spec: ShardSpec) -> None:
        if spec.size is not None and spec.size > self.config.limit_bytes - STATS_FILE_BYTES:
            check_fits(self.config, spec.size)

    def cached_state(self, path: str, spec: ShardSpec, recheck: bool) -> str:
        """'ok', 'missing', or 'bad'. Bad is the wrong size, or the wrong checksum when rechecking."""
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            return "missing"
        if spec.size is not None and size != spec.size:
            return "bad"
        if recheck and spec.samples is not None:
            with open(path, "rb") as file:
                return "bad" if spec.samples.bad_samples(lambda at, n: os.pread(file.fileno(), n, at)) else "ok"
        if recheck and spec.checksum is not None:
            algo, digest = split_checksum(spec.checksum)
            if file_digest(path, algo) != digest:
                return "bad"
        return "ok"

    def _download(self, rt: Runtime, spec: ShardSpec, stem: str, path: str, request: Request) -> bool:
        """Fetch the entry into a reserved temp file, verify, publish, and count it. Called
        holding its lock exclusively. False if a prefetch finds no room now."""
        protect, prefetching, priority = request.protect, request.prefetching, request.priority
        size = spec.size if spec.size is not None else self.store.stat(spec.name).size
        self.check_size(ShardSpec(spec.name, size))
        # A prefetch leaves room for the shards sooner in the list that no one fetches yet:
        # taking it, it would be evicted by a sooner one's reader, and downloaded twice.
        ahead = self._sooner_unfetched(rt, protect) if prefetching else []
        reserved = self.room.reserve(rt, spec.name, stem, size, protect, wait=not prefetching, ahead=ahead)
        if reserved is None:
            return False
        fd, temp = reserved
        engine = rt.engine
        assert engine is not None
        try:
            # A prefetch looks whether readers of other processes wait for it.
            waits = (lambda: self.directory.reader_waits(stem)) if prefetching else None
            report = write_verified(fd, engine, self.store, spec, size, self.config, priority, waits)
            # Under the cache-wide lock: a scan must not count the bytes in tmp/ and again in shards/.
            with self.directory.locked():
                # A damaged copy replaced: its kept sample index may come from the damage.
                unlink_quietly(self.directory.index_path(os.path.basename(path)))
                os.replace(temp, path)
            temp = None
        except OSError as exc:
            if exc.errno in NO_SPACE_ERRNOS:
                raise NoSpace(
                    f"no space in cache {self.config.cache_dir} while fetching shard {spec.name!r} "
                    f"({size} bytes): {exc.strerror}"
                ) from exc
            raise
        finally:
            # Unlock before unlinking: no scan counts bytes still allocated to an open, unlinked
            # file. A scan that finds this file unlocked removes it itself.
            unlock_and_close(fd)
            if temp is not None:
                unlink_quietly(temp)
        log.info(
            "fetched shard %r (%d bytes, %.2fs, %d parts on up to %d connections, hash tail %.3fs)%s",
            spec.name,
            size,
            report.seconds,
            report.parts,
            report.connections,
            report.hash_tail_s,
            " [prefetch]" * prefetching,
        )
        rt.count(request.epoch, misses=1, bytes_fetched=size, max_connections=engine.most_running)
        return True

    def _sooner_unfetched(self, rt: Runtime, sooner: frozenset[str]) -> list[tuple[str, int]]:
        """Stem and size of the prefetch list's shards named in `sooner`, those before a
        prefetch's own. `Room.reserve` counts the ones not in the cache yet."""
        found: list[tuple[str, int]] = []
        with rt.lock:
            for spec in rt.upcoming[max(rt.position - 1, 0) :]:
                if len(found) == len(sooner):
                    break
                if spec.name in sooner and spec.size is not None:
                    found.append((self.stem(spec.name), spec.size))
        return found
