"""`ShardCache`: fetch a shard into the node-local cache once, hold it while it is read, and
evict least recently used shards to stay within the byte limit. The package docstring
(`dlstore.cache`) states the invariants and how they hold."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import logging
import multiprocessing
import multiprocessing.util
import os
import shutil
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from urllib.parse import quote

from dlstore.cache.config import STATS_FILE_BYTES, CacheConfig, ShardSpec
from dlstore.cache.direct import DIRECT_RETRY, read_samples
from dlstore.cache.download import _NO_SPACE_ERRNOS, _file_digest, _parse_checksum, write_verified
from dlstore.cache.engine import DownloadEngine
from dlstore.cache.indexes import cached_sample_index
from dlstore.cache.layout import CacheStats, EpochStats, _CacheDir, _release, _try_flock, _unlink_quietly, _Usage
from dlstore.cache.marks import NodeMarks
from dlstore.cache.pace import Concurrency
from dlstore.cache.partial import SampleRange, write_verified_range
from dlstore.cache.policy import HintWriter, read_next_use, victim_order
from dlstore.cache.prefetch import (
    PREFETCH_DROPPED,
    advance_window,
    raise_prefetch_error,
    start_prefetch,
    still_ahead,
    stop_prefetch,
)
from dlstore.cache.runtime import _Runtime
from dlstore.cache.slots import node_slots
from dlstore.config import format_size
from dlstore.errors import ConfigError, NoSpace, TransientError
from dlstore.format.sample_index import SampleIndex
from dlstore.storage.base import Store

log = logging.getLogger(__name__)

# Sleeps (first, longest) while another process holds a shard's lock, and while the cache has
# no room: a release in this process ends them early (`_Runtime.sleep_unless_released`).
_LOCK_POLL_S = (0.001, 0.05)
_ROOM_POLL_S = (0.005, 0.1)


# What a cache directory that cannot be used at all fails with: read-only, not ours, a file.
_UNUSABLE_DIR_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.ENOENT, errno.EEXIST)


def _file_identity(path: str) -> tuple[int, int] | None:
    """(inode, mtime in ns) of the file at `path`, None when there is none: a copy replaced by
    a publish (a rename) has another."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns


class CacheFull(NoSpace):
    """The cache cannot make room within its limit: the other shards are held by readers or
    being downloaded, and none was released within `wait_timeout_s`."""


_runtime_lock = threading.Lock()
_live_caches: weakref.WeakSet[ShardCache] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    global _runtime_lock
    _runtime_lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _flush_live_caches() -> None:
    for cache in list(_live_caches):
        with contextlib.suppress(Exception):
            cache.flush_stats()


_finalizer_pid: int | None = None


def _flush_at_worker_exit() -> None:
    """In a `multiprocessing` child (a DataLoader worker), flush the counters as it exits:
    a forked one ends with `os._exit`, which runs no `atexit` hook, only multiprocessing's
    finalizers (a spawned one runs both: the second flush finds nothing left to add).
    Registered once per process, at its first use of a cache (multiprocessing clears the
    registry a child starts with after the fork)."""
    global _finalizer_pid
    if _finalizer_pid != os.getpid() and multiprocessing.parent_process() is not None:
        _finalizer_pid = os.getpid()
        multiprocessing.util.Finalize(None, _flush_live_caches, exitpriority=10)


class ShardCache:
    """The node-local shard cache over one store; see the package docstring (`dlstore.cache`) for the design.

    >>> cache = ShardCache(CacheConfig("/mnt/ssd/dlstore", "150GB"), open_store("swift://imagenet/train"))  # doctest: +SKIP
    >>> with cache.hold("shard-000000.tar", 301_234_176, "sha256:9f86d0...") as path:  # doctest: +SKIP
    ...     samples = read_tar(path)
    """

    def __init__(self, config: CacheConfig, store: Store) -> None:
        self.config = config
        self.store = store
        self._dir = _CacheDir(config.cache_dir)
        # Shard names are keys relative to the store root; the store's URL keeps two datasets
        # with the same shard names apart when they share one cache directory.
        self._namespace = hashlib.sha256(store.url.encode()).hexdigest()[:12]
        self._rt: _Runtime | None = None
        self._hints: HintWriter | None = None  # this process's hint file, made on the first `hint`

    def __repr__(self) -> str:
        return f"ShardCache({self.config.cache_dir!r}, limit={self.config.limit_bytes}, store={self.store!r})"

    def __getstate__(self) -> dict:
        return {"config": self.config, "store": self.store}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["config"], state["store"])  # type: ignore[misc]

    # -- public API ----------------------------------------------------------------------------------
    @property
    def stats(self) -> CacheStats:
        """This process's counters (a copy)."""
        rt = self._runtime()
        with rt.lock:
            return dataclasses.replace(rt.stats)

    def set_epoch(self, epoch: int, names: Iterable[str] = ()) -> None:
        """Say which epoch this process reads now, and optionally shards `names` that a batch
        of it reads: hits and downloads are also counted per epoch (`cache_report(...).epochs`,
        `dlstore cache stats`). A reader's hit or download of a named shard counts under the
        epoch that named it last, others under the epoch read now; a prefetch's, under the
        epoch its list was given in. So a loader that builds the next epoch's first batches
        while this one's last are still being read counts each under its own epoch.
        `Dataset` calls it for each batch it asks for or builds.

        >>> cache.set_epoch(3, ["train/shard-000007.tar", "train/shard-000012.tar"])  # doctest: +SKIP
        """
        rt = self._runtime()
        with rt.lock:
            rt.epoch = epoch
            rt.read_epochs.update(dict.fromkeys(names, epoch))

    def check_fits(self, max_shard_size: int, readers: int = 1) -> None:
        """Raise `ConfigError` unless the largest shard fits under the limit; warn when
        `readers` processes each holding one shard of that size would not fit at once.

        >>> cache.check_fits(max(s.size for s in manifest.shards), readers=world.local_size * workers)  # doctest: +SKIP
        """
        room = self.config.limit_bytes - STATS_FILE_BYTES
        if max_shard_size > room:
            raise ConfigError(
                f"cache limit {format_size(self.config.limit_bytes)} ({self.config.cache_dir}) is smaller than the "
                f"largest shard ({format_size(max_shard_size)}) plus the {STATS_FILE_BYTES}-byte stats file; "
                "raise the cache limit or write smaller shards"
            )
        if readers > 1 and readers * max_shard_size > room:
            log.warning(
                "cache limit %s holds fewer than %d shards of %s: readers will wait for each other",
                format_size(self.config.limit_bytes),
                readers,
                format_size(max_shard_size),
            )

    def check_disk_room(self, dataset_size: int) -> None:
        """Warn when the disk cannot hold what the cache will (the limit, or the whole dataset if
        smaller): a run on a small disk failed with NoSpace once it filled, with no word of the
        limit. Asked once per dataset, by one rank of the node."""
        wanted = min(self.config.limit_bytes, dataset_size + STATS_FILE_BYTES)
        disk = self._disk_room()
        if disk is not None and wanted > disk:
            log.warning(
                "cache %s: its disk has room for %s (free space and the shards it holds), and it would hold %s "
                "(cache_limit %s): lower cache_limit (--cache-limit), or downloads will fail when the disk fills",
                self.config.cache_dir,
                format_size(disk),
                format_size(wanted),
                format_size(self.config.limit_bytes),
            )

    def _disk_room(self) -> int | None:
        """The bytes the cache could hold on its disk: the free space there and its shards'."""
        folder = os.path.abspath(self.config.cache_dir)
        while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
            folder = os.path.dirname(folder)  # the folder the cache will be made in
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            return None
        held = 0
        with contextlib.suppress(OSError), os.scandir(self._dir.shards) as entries:
            held = sum(entry.stat().st_size for entry in entries if entry.is_file())
        return free + held

    @contextlib.contextmanager
    def hold(
        self,
        name: str,
        size: int | None = None,
        checksum: str | None = None,
        samples: SampleRange | None = None,
        *,
        recheck: bool = False,
    ):
        """Fetch shard `name` if needed and yield its local path, which is not evicted until
        the `with` block ends.

        `size` and `checksum` ("algo:hexdigest") come from the manifest; a cached copy of the
        wrong size is replaced, and with `recheck=True` so is one whose checksum fails. An
        error of the background prefetch of this shard is raised here. With `samples` (and
        `name`, `size` from it: `samples.spec`), the entry is that run of samples of a shard
        (`dlstore.cache.partial`), checked against their digests instead of a checksum.

        >>> with cache.hold("shard-000003.tar", 300_000_000, "sha256:ab12...") as path:  # doctest: +SKIP
        ...     index = read_index(path)
        """
        rt = self._runtime()
        raise_prefetch_error(rt, name, moot=lambda: self.cached(name))
        protect = advance_window(rt, name, self.config.prefetch)
        fd = self._acquire(rt, ShardSpec(name, size, checksum, samples), recheck=recheck, protect=protect)
        path = self._dir.shard_path(self._stem(name))
        try:
            yield path
        finally:
            # No touch here: LRU goes by when a read started, so a shard just read is evicted
            # before the prefetched ones the reader has not reached yet.
            _release(fd)
            rt.announce_release()  # room for a reservation waiting in this process, maybe

    def forget_sample_index(self, name: str) -> None:
        """Drop the kept sample index of shard `name` (a read through it failed: walked again)."""
        _unlink_quietly(self._dir.index_path(self._stem(name)))

    def sample_index(self, path: str, checksum: str | None) -> SampleIndex:
        """The sample index of the shard held at `path` (a `hold`'s), kept in the cache
        (`indexes.cached_sample_index`); `checksum` is the manifest's."""
        return cached_sample_index(self._dir.index_path(os.path.basename(path)), path, checksum)

    def node_marks(self, dataset: str) -> NodeMarks:
        """The node's marks of which samples of `dataset` (a digest naming the dataset's bytes)
        decode cleanly (`marks.NodeMarks`), shared by every process of this cache directory."""
        return NodeMarks(self._dir.marks_path(f"{self._namespace}-{dataset}"))

    def cached(self, name: str) -> bool:
        """Whether shard `name` is in the cache now: a hint (another process may evict it the
        next moment); reads go through `hold`."""
        self._runtime()
        return os.path.exists(self._dir.shard_path(self._stem(name)))

    @property
    def direct_store(self) -> Store:
        """The store as direct reads use it (theirs and their sample indexes' GETs): with a
        short retry (`DIRECT_RETRY`), since a failure only sends the reader to the cache, which
        must not wait out the default deadline first. One per process, so that what it learns
        (`Store.ranges_per_get`) holds for later reads."""
        rt = self._runtime()
        with rt.lock:
            if rt.direct_store is None:
                rt.direct_store = self.store.with_retry(dataclasses.replace(self.store.config.retry, **DIRECT_RETRY))
            return rt.direct_store

    def read_direct(self, wanted: Sequence[tuple[str, SampleIndex, Sequence[int]]]) -> dict[str, dict[int, bytes]]:
        """For each `(name, index, samples)` of `wanted` whose shard is not cached, the bytes of
        those samples straight from the store, each checked against its digest in `index`
        (`dlstore.cache.direct`), counted in `CacheStats.bytes_direct`. A shard that is cached
        (read it there) or has a sample that fails its digest is left out. The GETs, at most
        `2 * parts_in_flight` at once in this process, each hold a node connection slot as a
        download's part does (`CacheConfig.node_connections`); a slot not had within the short
        deadline of `DIRECT_RETRY` raises `TransientError`, which sends the caller to the cache."""
        rt = self._runtime()
        wanted = [w for w in wanted if not self.cached(w[0])]
        if not wanted:
            return {}
        connections = self.config.parts_in_flight * 2
        store = self.direct_store
        with rt.lock:
            if rt.direct_gets is None:  # one bound for all the process's decode threads
                rt.direct_gets = threading.BoundedSemaphore(connections)
        gets, engine = rt.direct_gets, rt.engine

        @contextlib.contextmanager
        def gate() -> Iterator[None]:
            # The process's bound first: a node slot is never held while waiting for it.
            with gets, engine.node_slot(DIRECT_RETRY["deadline_s"]):
                yield

        got = read_samples(store, wanted, connections, gate)
        if got:  # recorded at once, as a download is: once per pass
            self._count(rt, bytes_direct=sum(len(data) for samples in got.values() for data in samples.values()))
            self._flush(rt, force=True)
        return got

    def fetch(
        self,
        name: str,
        size: int | None = None,
        checksum: str | None = None,
        samples: SampleRange | None = None,
        *,
        recheck: bool = False,
    ) -> str:
        """Make sure shard `name` (or the run of `samples`, as in `hold`) is cached and return
        its path. The entry may be evicted once this returns; use `hold` around reads.

        >>> path = cache.fetch("shard-000003.tar", 300_000_000, "sha256:ab12...")  # doctest: +SKIP
        """
        with self.hold(name, size, checksum, samples, recheck=recheck) as path:
            return path

    def prefetch(self, shards: Iterable[ShardSpec | tuple], depth: int | None = None, lead: int = 0) -> None:
        """Set the shards the reader will ask for next, in order; a daemon thread keeps the
        first `depth` (default `config.prefetch`) of them not yet reached cached, within the
        limit, never evicting a held shard or one sooner in this list; the first `lead` of the
        list (shards in use) are fetched before any later one. Reaching a shard with `hold` or
        `fetch` moves the window on. Replaces any earlier list.

        >>> cache.prefetch([(s.name, s.size, s.checksum) for s in my_shards])  # doctest: +SKIP
        """
        specs = [ShardSpec(*s) for s in shards]
        if (depth is not None and depth < 0) or lead < 0:
            raise ConfigError(f"prefetch depth {depth} and lead {lead} must not be negative")
        if self.config.prefetch <= 0:
            return
        rt = self._runtime()
        rt.prefetch_epoch = rt.epoch  # the list is of the epoch being read now
        start_prefetch(
            rt,
            specs,
            depth if depth is not None else self.config.prefetch,
            # The threads keep this function: the epoch is read when a shard is fetched.
            lambda spec, sooner, priority: self._acquire(
                rt, spec, protect=sooner, prefetching=True, priority=priority, epoch=rt.prefetch_epoch
            ),
            Concurrency(self.config.shards_in_flight, self.config.parts_in_flight),
            lead,
        )

    def hint(self, names: Iterable[str]) -> None:
        """Tell the cache the order in which this process will need shards, soonest first:
        the rest of this epoch, then the next one. Every process of the node sees it, and
        evictions then keep the shards needed soonest (`dlstore.cache.policy`); without hints
        the cache evicts least recently used shards. Replaces this process's earlier order;
        an empty one withdraws it. Hints are advice: one that cannot be written is logged.

        >>> cache.hint(name for name in shard_names_in_read_order)  # doctest: +SKIP
        """
        self._runtime()
        writer = self._hints
        if writer is None or writer.pid != os.getpid():  # none yet, or the parent's (after a fork)
            writer = self._hints = HintWriter(self._dir, self._namespace, self._stem)
        try:
            writer.write(names)
        except OSError as exc:
            log.warning("could not record the shard order in cache %s: %s", self.config.cache_dir, exc)

    def usage(self) -> int:
        """Bytes the cache directory holds now, counted as the limit counts them."""
        self._runtime()
        with self._dir.locked():
            return self._dir.scan().total

    def flush_stats(self) -> None:
        """Add this process's counters not yet recorded to the directory's totals."""
        rt = self._rt
        if rt is not None and rt.pid == os.getpid():
            self._flush(rt, force=True)

    def close(self) -> None:
        """Stop the prefetch threads (after their current downloads), let the download
        workers end, record the counters, and withdraw this process's hints (their file and
        descriptor: other processes would evict by a closed reader's order)."""
        rt = self._rt
        if rt is None or rt.pid != os.getpid():
            return
        stop_prefetch(rt, self.config.wait_timeout_s)
        if rt.engine is not None:
            rt.engine.close()
        self._flush(rt, force=True)
        if self._hints is not None and self._hints.pid == os.getpid():
            self._hints.close()
            self._hints = None

    # -- per-process state -------------------------------------------------------------------------
    def _runtime(self) -> _Runtime:
        rt = self._rt
        if rt is not None and rt.pid == os.getpid() and rt.started:
            return rt
        with _runtime_lock:
            rt = self._rt
            if rt is None or rt.pid != os.getpid():
                if rt is not None and rt.engine is not None and rt.engine.slots is not None:
                    rt.engine.slots.forget_after_fork()  # the parent's descriptors, not its locks
                rt = self._rt = _Runtime()  # new process: fresh counters, no thread
            if not rt.started:
                self._start()
                rt.engine = DownloadEngine(self.config.connections, slots=node_slots(self.config))
                rt.started = True
                _live_caches.add(self)
                _flush_at_worker_exit()
        return rt

    def _start(self) -> None:
        """First use in this process: create the layout, remove dead downloads' temp files,
        and bring the directory within this process's limit. A full disk says so, naming the
        cache directory, as it does when a download fills it."""
        try:
            self._set_up()
        except OSError as exc:
            if exc.errno in _NO_SPACE_ERRNOS:
                raise NoSpace(f"no space in cache {self.config.cache_dir} to set it up: {exc.strerror}") from exc
            if exc.errno in _UNUSABLE_DIR_ERRNOS:
                raise ConfigError(
                    f"cannot use {self.config.cache_dir} as the cache directory: {exc.strerror} ({exc.filename}); "
                    "give --cache-dir (or DLSTORE_CACHE_DIR) a writable folder on the node's local disk"
                ) from None
            raise

    def _set_up(self) -> None:
        self._dir.create()
        with self._dir.locked():
            usage = self._dir.scan()
            usage.stale_removed += self._dir.remove_stale_index_temps()
            data = self._dir.read_stats()
            previous = data.get("limit_bytes")
            if previous not in (None, self.config.limit_bytes):
                log.warning(
                    "cache %s was used with limit %s; now %s (processes sharing it should agree)",
                    self.config.cache_dir,
                    format_size(previous) if isinstance(previous, (int, float)) else previous,
                    format_size(self.config.limit_bytes),
                )
            data["limit_bytes"] = self.config.limit_bytes
            self._dir.write_stats(data)
            excess = usage.total - self.config.limit_bytes
            evicted = self._evict(usage, excess, frozenset(), strict=True, partial=True)[1] if excess > 0 else 0
        if usage.stale_removed or evicted:
            log.info(
                "cache %s: removed %d stale temp files, evicted %d shards over the limit",
                self.config.cache_dir,
                usage.stale_removed,
                evicted,
            )
        if evicted:
            rt = self._rt
            assert rt is not None
            self._count(rt, evictions=evicted)

    def _count(self, rt: _Runtime, epoch: int | None = None, **deltas: float) -> None:
        """Add to this process's counters (`CacheStats` fields); hits, misses and bytes also
        under `epoch`, when it is known."""
        delta = CacheStats(**deltas)
        with rt.lock:
            rt.stats.add(delta)
            rt.pending.add(delta)
            if epoch is not None and (delta.hits or delta.misses):
                rt.pending_epochs.setdefault(epoch, EpochStats()).add(
                    EpochStats(delta.hits, delta.misses, delta.bytes_fetched)
                )

    @staticmethod
    def _epoch_of(rt: _Runtime, name: str) -> int | None:
        """The epoch a reader's hit or download of shard `name` counts under (`set_epoch`)."""
        with rt.lock:
            return rt.read_epochs.get(name, rt.epoch)

    def _flush(self, rt: _Runtime, force: bool = False) -> None:
        """Add pending counters to stats.json: at once for downloads and evictions, at most
        once a second for hits (so a hit costs no cache-wide lock). Never call it while
        holding the cache-wide lock."""
        with rt.lock:
            if not force and time.monotonic() - rt.last_flush < 1.0:
                return
            pending, rt.pending = rt.pending, CacheStats()
            epochs, rt.pending_epochs = rt.pending_epochs, {}
            rt.last_flush = time.monotonic()
        if pending.is_zero() and not epochs:
            return
        if not os.path.isdir(self._dir.root):  # the cache was removed (a temporary one): nothing to record
            return
        try:
            with self._dir.locked():
                self._dir.add_stats(pending, epochs)
        except OSError as exc:
            log.warning("could not record cache counters in %s: %s", self._dir.stats_path, exc)

    def _stem(self, name: str) -> str:
        if not name or name.startswith("/"):
            raise ConfigError(f"invalid shard name {name!r}: names are keys relative to the store root")
        stem = f"{self._namespace}-{quote(name, safe='')}"
        if len(stem) > 180:  # file names stop at 255 bytes; temp names add ~45
            digest = hashlib.sha256(name.encode()).hexdigest()[:24]
            stem = f"{self._namespace}-{digest}-{stem[-100:]}"
        return stem

    @staticmethod
    def _touch(path: str) -> None:
        with contextlib.suppress(OSError):
            os.utime(path)

    # -- fetching ------------------------------------------------------------------------------------
    def _acquire(
        self,
        rt: _Runtime,
        spec: ShardSpec,
        *,
        recheck: bool = False,
        protect: frozenset[str] = frozenset(),
        prefetching: bool = False,
        priority: int = 0,
        epoch: int | None = None,
    ) -> int | None:
        """Return the shard's lock file descriptor holding LOCK_SH, with the shard published
        and valid; None only when `prefetching` and there is no room for it now, and
        `PREFETCH_DROPPED` when `prefetching` and the readers no longer need it from it. A download
        goes by `priority` in the engine (lower first); it and a hit count under `epoch`
        (default: `_epoch_of` the shard)."""
        if spec.checksum is not None:
            _parse_checksum(spec.checksum)
        if spec.size is not None:
            self._check_size(spec)
        stem = self._stem(spec.name)
        path = self._dir.shard_path(stem)
        fd = self._dir.open_lock(stem)
        deadline = time.monotonic() + self.config.wait_timeout_s
        delay, waited, downloaded = _LOCK_POLL_S[0], 0.0, False
        wanted: int | None = None  # held while a reader waits for another process's download
        # A recheck found this copy bad: wait for the exclusive lock to replace it, and do not
        # hash it again under a shared one meanwhile. Every reader of a damaged shard rechecks
        # it at once, and each one's shared lock (held for a whole hash) would refuse the
        # others' exclusive one, round after round.
        found_bad: tuple[int, int] | None = None  # (inode, mtime) of the copy found bad
        if epoch is None:
            epoch = self._epoch_of(rt, spec.name)
        try:
            while True:
                seen = rt.releases
                if found_bad is not None and _file_identity(path) != found_bad:
                    # Replaced by another process meanwhile: that copy was checked as it was fetched.
                    found_bad, downloaded = None, True
                if found_bad is not None or _try_flock(fd, fcntl.LOCK_SH):
                    state = (
                        "bad" if found_bad is not None else self._cached_state(path, spec, recheck and not downloaded)
                    )
                    if state == "ok":
                        self._touch(path)
                        if not downloaded and not prefetching:
                            self._count(rt, epoch, hits=1)
                        if waited:
                            self._count(rt, wait_time_s=waited)
                        self._flush(rt, force=downloaded)
                        return fd
                    if found_bad is None:
                        fcntl.flock(fd, fcntl.LOCK_UN)
                        if state == "bad" and recheck and not downloaded:
                            found_bad = _file_identity(path)
                    if prefetching and state == "missing" and (downloaded or not still_ahead(rt, spec.name)):
                        # Evicted between this download and its shared lock (by a reader that has
                        # passed it, or for a sooner shard), or passed while this waited for its
                        # lock: fetching it is the readers' call now.
                        _release(fd)
                        rt.announce_release()
                        return PREFETCH_DROPPED
                    if _try_flock(fd, fcntl.LOCK_EX):
                        found_bad = None
                        fetched = self._fetch_exclusively(
                            rt, spec, stem, path, recheck and not downloaded, protect, prefetching, priority, epoch
                        )
                        if fetched is None:
                            # No announcement: it would wake the other prefetch threads without
                            # room, which would wake this one, and so on (a reader polls this lock).
                            _release(fd)
                            return None
                        downloaded = downloaded or fetched
                        # EX -> SH is not atomic: an evictor may slip in, so loop and check.
                        fcntl.flock(fd, fcntl.LOCK_UN)
                        rt.announce_release()
                        continue
                # Another process holds it exclusively: downloading it, or evicting it. A reader
                # says it waits, so that a prefetch of it there is widened (`reader_waits`).
                if wanted is None and not prefetching:
                    wanted = self._dir.mark_wanted(stem)
                if time.monotonic() > deadline:
                    holders = (
                        "its copy failed a recheck, and other processes still hold it (reading or checking it)"
                        if found_bad is not None
                        else "another process is still downloading or evicting it"
                    )
                    raise TransientError(
                        f"waited {self.config.wait_timeout_s:.0f}s for shard {spec.name!r} in cache "
                        f"{self.config.cache_dir}: {holders}"
                    )
                waited += rt.sleep_unless_released(seen, delay)
                delay = min(delay * 2, _LOCK_POLL_S[1])
        except BaseException:
            with contextlib.suppress(OSError):
                _release(fd)
            rt.announce_release()  # a failed download's lock: its waiters look again (and fetch it) now
            raise
        finally:
            if wanted is not None:
                _release(wanted)

    def _fetch_exclusively(
        self,
        rt: _Runtime,
        spec: ShardSpec,
        stem: str,
        path: str,
        recheck: bool,
        protect: frozenset[str],
        prefetching: bool,
        priority: int,
        epoch: int | None,
    ) -> bool | None:
        """Holding the shard's lock exclusively, so nobody reads or downloads it: check again
        (another process may have published it since), then fetch it unless it is there.
        Whether it was downloaded (counted under `epoch`); None when `prefetching` and there
        is no room for it now."""
        state = self._cached_state(path, spec, recheck)
        if state == "ok":
            return False
        if state == "bad":
            os.unlink(path)
            self._count(rt, corrupt_replaced=1)
            log.warning("cached shard %r is corrupt; fetching it again", spec.name)
        if not self._download(rt, spec, stem, path, protect, prefetching, priority, epoch):
            return None
        return True

    def _check_size(self, spec: ShardSpec) -> None:
        if spec.size is not None and spec.size > self.config.limit_bytes - STATS_FILE_BYTES:
            self.check_fits(spec.size)

    def _cached_state(self, path: str, spec: ShardSpec, recheck: bool) -> str:
        """'ok', 'missing', or 'bad' (wrong size, or wrong checksum when rechecking)."""
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
            algo, digest = _parse_checksum(spec.checksum)
            if _file_digest(path, algo) != digest:
                return "bad"
        return "ok"

    def _download(
        self,
        rt: _Runtime,
        spec: ShardSpec,
        stem: str,
        path: str,
        protect: frozenset[str],
        prefetching: bool,
        priority: int,
        epoch: int | None,
    ) -> bool:
        """Fetch the shard into a reserved temp file (parallel ranged GETs), verify, publish,
        and count it (under `epoch`). Called holding the shard's lock exclusively. False if
        `prefetching` and there is no room now."""
        size = spec.size if spec.size is not None else self.store.stat(spec.name).size
        self._check_size(ShardSpec(spec.name, size))
        # A prefetch leaves room for the shards sooner in the list that no one fetches yet: it
        # took room a sooner one then needed, whose reader evicted it: downloaded twice.
        ahead = self._sooner_unfetched(rt, protect) if prefetching else []
        reserved = self._reserve(rt, spec.name, stem, size, protect, wait=not prefetching, ahead=ahead)
        if reserved is None:
            return False
        fd, temp = reserved
        assert rt.engine is not None
        try:
            # A prefetch looks whether readers of other processes wait for it (`_acquire`).
            waits = (lambda: self._dir.reader_waits(stem)) if prefetching else None
            if spec.samples is not None:
                report = write_verified_range(fd, rt.engine, self.store, spec.samples, self.config, priority, waits)
            else:
                report = write_verified(fd, rt.engine, self.store, spec, size, self.config, priority, waits)
            # Under the cache-wide lock: a scan (which holds it) must not see the bytes leave
            # tmp/ after it counted them there and then find them again under shards/.
            with self._dir.locked():
                # A copy replaced (a damaged one): its kept sample index may come from the damage.
                _unlink_quietly(self._dir.index_path(os.path.basename(path)))
                os.replace(temp, path)
            temp = None
        except OSError as exc:
            if exc.errno in _NO_SPACE_ERRNOS:
                raise NoSpace(
                    f"no space in cache {self.config.cache_dir} while fetching shard {spec.name!r} "
                    f"({size} bytes): {exc.strerror}"
                ) from exc
            raise
        finally:
            # Unlock before unlinking: bytes still allocated to an open, unlinked file would
            # be on disk yet counted by no scan; a scan that finds this file unlocked first
            # removes it itself.
            _release(fd)
            if temp is not None:
                _unlink_quietly(temp)
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
        self._count(rt, epoch, misses=1, bytes_fetched=size, max_connections=rt.engine.most_running)
        return True

    def _sooner_unfetched(self, rt: _Runtime, sooner: frozenset[str]) -> list[tuple[str, int]]:
        """(stem, size) of the prefetch list's shards named in `sooner` (those before a prefetch's
        own), for `_reserve` to count the ones not in the cache yet."""
        found: list[tuple[str, int]] = []
        with rt.lock:
            for spec in rt.upcoming[max(rt.position - 1, 0) :]:
                if len(found) == len(sooner):
                    break
                if spec.name in sooner and spec.size is not None:
                    found.append((self._stem(spec.name), spec.size))
        return found

    def _reserve(
        self,
        rt: _Runtime,
        name: str,
        stem: str,
        size: int,
        protect: frozenset[str],
        wait: bool,
        ahead: list[tuple[str, int]] | None = None,
    ) -> tuple[int, str] | None:
        """Reserve `size` bytes under the limit, evicting LRU shards no reader holds; returns
        the new temp file (descriptor, path). Waits for room up to `wait_timeout_s`, or
        returns None at once when not `wait`. Room is also kept for the `ahead` (stem, size)
        shards that are neither cached nor downloading."""
        deadline = time.monotonic() + self.config.wait_timeout_s
        delay, waited, evicted = _ROOM_POLL_S[0], 0.0, 0
        try:
            while True:
                seen = rt.releases
                with self._dir.locked():
                    usage = self._dir.scan()
                    excess = usage.total + size + usage.unreserved(ahead or []) - self.config.limit_bytes
                    if excess > 0:
                        freed, count = self._evict(
                            usage, excess, protect, strict=not wait, incoming=None if wait else stem
                        )
                        excess -= freed
                        evicted += count
                    if excess <= 0:
                        return self._dir.create_temp(stem, size)
                if not wait:
                    return None
                if time.monotonic() > deadline:
                    raise CacheFull(
                        f"cache {self.config.cache_dir} is full: {usage.total} of {self.config.limit_bytes} bytes "
                        f"are shards held by readers or downloads in flight, and shard {name!r} needs {size}; "
                        f"waited {waited:.1f}s. Raise the limit, or hold fewer shards at once."
                    )
                waited += rt.sleep_unless_released(seen, delay)
                delay = min(delay * 2, _ROOM_POLL_S[1])
        finally:
            if evicted or waited:
                self._count(rt, evictions=evicted, wait_time_s=waited)

    def _evict(
        self,
        usage: _Usage,
        need: int,
        protect: frozenset[str],
        strict: bool,
        partial: bool = False,
        incoming: str | None = None,
    ) -> tuple[int, int]:
        """Under the cache-wide lock: evict shards no one holds until `need` bytes are free,
        or none at all if that is impossible (unless `partial`): those needed furthest ahead
        by the readers' hints first, else least recently used (`policy.victim_order`; a
        prefetch of stem `incoming` spares shards needed no later than it). Shards in
        `protect` go last, and never when `strict`. Returns (bytes, shards)."""
        protected = {self._stem(name) for name in protect}
        ordered = victim_order(usage.shards, read_next_use(self._dir), incoming)
        candidates = [s for s in ordered if s[1] not in protected]
        if not strict:
            candidates += [s for s in ordered if s[1] in protected]
        # Lock the victims first and delete only if they free enough: evicting shards and
        # still not fitting would throw away data for nothing.
        victims: list[tuple[int, str]] = []
        total = 0
        try:
            for _, stem, size in candidates:
                if total >= need:
                    break
                fd = self._dir.open_lock(stem)
                if not _try_flock(fd, fcntl.LOCK_EX):
                    os.close(fd)  # a reader holds it
                    continue
                victims.append((fd, stem))
                total += size
            if total < need and not partial:
                return 0, 0
            freed = 0
            for _, stem in victims:
                size = self._dir.remove_shard(stem)
                freed += size
                log.debug("evicted %s (%d bytes)", stem, size)
            return freed, len(victims)
        finally:
            for fd, _ in victims:
                _release(fd)
