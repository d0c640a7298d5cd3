"""The node-local shard cache: one directory on local SSD shared by every rank and
DataLoader worker of a node (many processes, no shared memory, only files and `flock`).

    cache = ShardCache(CacheConfig("/mnt/ssd/dlstore", "150GB"), store)
    cache.check_fits(max_shard_size)              # a limit below one shard fails here, not later
    cache.prefetch(upcoming)                      # (name, size, checksum) in read order
    with cache.hold("train/shard-000007.tar", size, "sha256:...") as path:
        read(path)                                # not evicted while held

Layout of the directory::

    cache.lock          cache-wide lock: reservations, eviction, stats (held for milliseconds)
    stats.json          counters summed over every process, padded to exactly 1 KiB
    shards/<stem>       published shards, complete and verified; mtime = last access (LRU)
    locks/<stem>.lock   per-shard lock: readers hold LOCK_SH, a downloader or evictor LOCK_EX
    tmp/<stem>.<pid>.<token>.<size>.part
                        downloads in flight; the name records the bytes reserved, the
                        downloader holds LOCK_EX on the file itself while it lives

Invariants (DESIGN.md, "Cache invariants") and how they hold:

* **Byte limit.** Bytes on disk = published shards + reservations of downloads in flight
  + the 1 KiB stats file. A download reserves its full size under the cache-wide lock
  (creating its temp file, whose name carries the size) after evicting least recently used
  shards that no reader holds; if they cannot make room it waits, and raises `CacheFull`
  after `wait_timeout_s`. So the directory never exceeds the limit, not even by the shard
  being fetched. Every scan holds the cache-wide lock, and a download moves from `tmp/` to
  `shards/` only under that lock too, so a scan counts it exactly once: were the rename
  free to land between a scan's pass over `tmp/` and its pass over `shards/`, the scan
  would count the shard twice and a reservation or `cache_report` would see the directory
  over the limit when it is not. A failed download gives up its temp file's lock before
  unlinking it, so no scan misses bytes still allocated to an open, unlinked file.
* **Atomic publish.** A shard is streamed into its temp file, hashed while written, its size
  and checksum verified, fsynced, then `os.replace`d to its final name (under the cache-wide
  lock, see above): a name under `shards/` always holds a complete, verified file.
* **One download per node.** The downloader holds the shard's lock exclusively; other
  processes poll it (shared, non-blocking) and find the published file when it is released.
* **Crash safety.** `flock`s die with their process. A temp file whose lock can be taken
  belongs to a dead process and is removed (at start and at every scan); lock files are
  empty and kept (deleting a lock file others may have open would split the lock).
* **Readers are safe.** Eviction takes the shard's lock with `LOCK_EX | LOCK_NB`; a reader's
  `LOCK_SH` makes that fail, so a held shard is skipped. `flock` conflicts between separate
  open files even within one process, so a thread's eviction respects its own process's
  readers. Locks are released explicitly (`LOCK_UN`) because a forked child shares open file
  descriptions: closing alone would leave the lock held by the child's copy.

Locking order: a thread holding the cache-wide lock only ever *tries* shard and temp-file
locks (never blocks on them), so their holders may take the cache-wide lock without
deadlock (a downloader does, to publish).

The directory must be on a local file system: over NFS `flock` becomes a POSIX lock with
per-process semantics and the in-process guarantees above no longer hold.

A `ShardCache` pickles into DataLoader workers and survives `fork`: it holds no open file,
lock or thread in its pickled state, and rebuilds its per-process state (counters, prefetch
thread) the first time it is used in a new process.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple
from urllib.parse import quote

from dlstore.config import parse_size
from dlstore.errors import ConfigError, CorruptShard, DlstoreError, NoSpace, TransientError
from dlstore.storage.base import Store

__all__ = [
    "STATS_FILE_BYTES",
    "CacheConfig",
    "CacheFull",
    "CacheReport",
    "CacheStats",
    "ClearResult",
    "ShardCache",
    "ShardSpec",
    "cache_report",
    "clear_cache",
]

log = logging.getLogger(__name__)

#: The stats file is rewritten in place at this fixed size, and counted against the limit,
#: so the whole directory (not only the shards) stays within `limit_bytes`.
STATS_FILE_BYTES = 1024

_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_MAX_POLL_S = 0.05


class CacheFull(NoSpace):
    """The cache cannot make room within its limit: the other shards are held by readers or
    being downloaded, and none was released within `wait_timeout_s`."""


@dataclass(frozen=True)
class CacheConfig:
    """Where the node-local cache lives and how it behaves.

    >>> CacheConfig("/mnt/ssd/dlstore", "150GB").limit_bytes
    150000000000

    `limit_bytes` bounds everything in the directory (shards, downloads in flight, the
    1 KiB stats file). `prefetch` is how many shards the background thread fetches ahead of
    the reader (0 turns it off). `verify` checks each download against the manifest's
    checksum ("algo:hexdigest"); sizes are always checked. `fsync` makes a published shard
    survive a power loss, not only a process crash. `preallocate` reserves the blocks of a
    download up front (so a full disk shows at once). `wait_timeout_s` bounds every wait: for
    another process's download of the same shard, and for room under the limit.
    """

    cache_dir: str
    limit_bytes: int
    prefetch: int = 2
    verify: bool = True
    fsync: bool = True
    preallocate: bool = True
    wait_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_dir", os.path.abspath(os.fspath(self.cache_dir)))
        object.__setattr__(self, "limit_bytes", parse_size(self.limit_bytes))
        if self.limit_bytes <= STATS_FILE_BYTES:
            raise ConfigError(f"cache limit {self.limit_bytes} bytes is too small to hold any shard")
        if self.prefetch < 0:
            raise ConfigError(f"CacheConfig.prefetch must be 0 or more, not {self.prefetch}")
        if self.wait_timeout_s <= 0:
            raise ConfigError(f"CacheConfig.wait_timeout_s must be positive, not {self.wait_timeout_s}")


class ShardSpec(NamedTuple):
    """A shard as the manifest describes it: its key in the store, byte size and checksum."""

    name: str
    size: int | None = None
    checksum: str | None = None


@dataclass
class CacheStats:
    """Counters of one process (`ShardCache.stats`), or summed over all (`cache_report`)."""

    hits: int = 0
    misses: int = 0
    bytes_fetched: int = 0
    evictions: int = 0
    wait_time_s: float = 0.0
    corrupt_replaced: int = 0

    def add(self, other: CacheStats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def is_zero(self) -> bool:
        return not any(getattr(self, f.name) for f in dataclasses.fields(self))

    @classmethod
    def from_dict(cls, data: dict) -> CacheStats:
        out = cls()
        for name in (f.name for f in dataclasses.fields(cls)):
            value = data.get(name)
            if isinstance(value, (int, float)):
                setattr(out, name, type(getattr(out, name))(value))
        return out


@dataclass(frozen=True)
class CacheReport:
    """What `dlstore cache stats DIR` shows."""

    cache_dir: str
    files: int
    bytes: int
    in_flight: int
    in_flight_bytes: int
    limit_bytes: int | None
    totals: CacheStats


@dataclass(frozen=True)
class ClearResult:
    """What `clear_cache` removed, and what it left because readers hold it."""

    removed: int
    removed_bytes: int
    skipped_held: int
    skipped_bytes: int
    stale_temps: int


# -- flock helpers ------------------------------------------------------------------------------
def _try_flock(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _release(fd: int) -> None:
    """Unlock, then close. Unlock first: a forked child may share this open file description,
    and closing our descriptor alone would leave the lock held through the child's."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _parse_checksum(checksum: str) -> tuple[str, str]:
    algo, sep, digest = checksum.partition(":")
    if not sep or not digest:
        raise ConfigError(f"checksum {checksum!r} is not 'algo:hexdigest' (e.g. 'sha256:9f86d0...')")
    try:
        hashlib.new(algo)
    except ValueError:
        raise ConfigError(f"checksum {checksum!r}: unknown hash algorithm {algo!r}") from None
    return algo, digest.lower()


def _file_digest(path: str, algo: str) -> str:
    hasher = hashlib.new(algo)
    with open(path, "rb") as file:
        while chunk := file.read(4 * 2**20):
            hasher.update(chunk)
    return hasher.hexdigest()


@dataclass
class _Usage:
    shards: list[tuple[int, str, int]]  # (mtime_ns, stem, size), unsorted
    in_flight: int
    in_flight_bytes: int
    stale_removed: int

    @property
    def total(self) -> int:
        return sum(size for _, _, size in self.shards) + self.in_flight_bytes + STATS_FILE_BYTES


class _CacheDir:
    """The files of one cache directory and the operations on them; no per-process state."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.shards = os.path.join(root, "shards")
        self.tmp = os.path.join(root, "tmp")
        self.locks = os.path.join(root, "locks")
        self.lock_path = os.path.join(root, "cache.lock")
        self.stats_path = os.path.join(root, "stats.json")

    def create(self) -> None:
        for directory in (self.shards, self.tmp, self.locks):
            os.makedirs(directory, exist_ok=True)

    def require(self) -> None:
        if not os.path.isfile(self.lock_path) or not os.path.isdir(self.shards):
            raise ConfigError(f"{self.root} is not a dlstore cache directory (no cache.lock or shards/)")

    def shard_path(self, stem: str) -> str:
        return os.path.join(self.shards, stem)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The cache-wide lock. A fresh open file per call, so threads exclude each other too.
        Never re-entered: a nested call would wait on itself."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        try:
            yield
        finally:
            _release(fd)

    def open_lock(self, stem: str) -> int:
        return os.open(os.path.join(self.locks, stem + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)

    # -- under the cache-wide lock -----------------------------------------------------------------
    def scan(self) -> _Usage:
        """Bytes on disk, removing temp files of dead processes. Exact because downloads
        publish (move from `tmp/` to `shards/`) only under the cache-wide lock, which the
        caller holds: a scan never sees a download in both places, nor in neither."""
        in_flight = in_flight_bytes = stale = 0
        for entry in os.scandir(self.tmp):
            if self._temp_owner_dead(entry.path):
                _unlink_quietly(entry.path)
                stale += 1
                log.info("removed stale temp file %s (its download died)", entry.path)
                continue
            reserved = self._reserved_size(entry.name)
            try:
                actual = entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                actual = 0
            in_flight += 1
            in_flight_bytes += max(reserved, actual)
        shards = []
        for entry in os.scandir(self.shards):
            try:
                stat = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            shards.append((stat.st_mtime_ns, entry.name, stat.st_size))
        return _Usage(shards, in_flight, in_flight_bytes, stale)

    @staticmethod
    def _reserved_size(temp_name: str) -> int:
        try:
            return int(temp_name.removesuffix(".part").rsplit(".", 1)[1])
        except (IndexError, ValueError):
            return 0

    @staticmethod
    def _temp_owner_dead(path: str) -> bool:
        """Whether no live process holds the temp file's lock (so it is an orphan)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False  # just published or removed: nothing to clean
        try:
            return _try_flock(fd, fcntl.LOCK_EX)
        finally:
            _release(fd)

    def create_temp(self, stem: str, size: int) -> tuple[int, str]:
        """A new temp file recording the reservation of `size` bytes, locked by us."""
        path = os.path.join(self.tmp, f"{stem}.{os.getpid()}.{secrets.token_hex(4)}.{size}.part")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: cannot be held by anyone
        return fd, path

    def try_evict(self, stem: str) -> int | None:
        """Remove one shard unless a reader or downloader holds it: bytes freed, or None if held."""
        fd = self.open_lock(stem)
        if not _try_flock(fd, fcntl.LOCK_EX):
            os.close(fd)
            return None
        try:
            return self.remove_shard(stem)
        finally:
            _release(fd)

    def remove_shard(self, stem: str) -> int:
        """Unlink a shard whose lock the caller holds exclusively; bytes freed."""
        path = self.shard_path(stem)
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            return 0
        return size

    def read_stats(self) -> dict:
        try:
            with open(self.stats_path, encoding="utf-8") as file:
                text = file.read().strip()
            return json.loads(text) if text else {}
        except FileNotFoundError:
            return {}
        except (ValueError, OSError) as exc:
            log.warning("cache stats file %s is unreadable (%s); counting from zero", self.stats_path, exc)
            return {}

    def write_stats(self, data: dict) -> None:
        text = json.dumps(data, sort_keys=True)
        if len(text) >= STATS_FILE_BYTES:
            raise DlstoreError(f"cache stats do not fit in {STATS_FILE_BYTES} bytes: {text[:80]}...")
        # Rewritten in place at a fixed size: no second file, no growth beyond what the limit counts.
        payload = (text.ljust(STATS_FILE_BYTES - 1) + "\n").encode()
        fd = os.open(self.stats_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            os.pwrite(fd, payload, 0)
            os.ftruncate(fd, STATS_FILE_BYTES)
        finally:
            os.close(fd)

    def add_stats(self, delta: CacheStats) -> None:
        data = self.read_stats()
        totals = CacheStats.from_dict(data)
        totals.add(delta)
        data.update(dataclasses.asdict(totals))
        self.write_stats(data)


# -- per-process state ---------------------------------------------------------------------------
class _Runtime:
    """State of one process: rebuilt after fork or unpickling, never pickled."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.started = False
        self.stats = CacheStats()
        self.pending = CacheStats()  # not yet added to stats.json
        self.last_flush = time.monotonic()
        # prefetch
        self.upcoming: list[ShardSpec] = []
        self.position = 0  # index in `upcoming` of the first shard the reader has not reached
        self.generation = 0
        self.done: set[str] = set()
        self.errors: dict[str, BaseException] = {}
        self.thread: threading.Thread | None = None
        self.closing = False


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


class ShardCache:
    """The node-local shard cache over one store; see the module docstring for the design.

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

    def check_fits(self, max_shard_size: int, readers: int = 1) -> None:
        """Raise `ConfigError` unless the largest shard fits under the limit; warn when
        `readers` processes each holding one shard of that size would not fit at once.

        >>> cache.check_fits(max(s.size for s in manifest.shards), readers=world.local_size * workers)  # doctest: +SKIP
        """
        room = self.config.limit_bytes - STATS_FILE_BYTES
        if max_shard_size > room:
            raise ConfigError(
                f"cache limit {self.config.limit_bytes} bytes ({self.config.cache_dir}) is smaller than the "
                f"largest shard ({max_shard_size} bytes) plus the {STATS_FILE_BYTES}-byte stats file; "
                "raise the cache limit or write smaller shards"
            )
        if readers > 1 and readers * max_shard_size > room:
            log.warning(
                "cache limit %d bytes holds fewer than %d shards of %d bytes: readers will wait for each other",
                self.config.limit_bytes,
                readers,
                max_shard_size,
            )

    @contextlib.contextmanager
    def hold(self, name: str, size: int | None = None, checksum: str | None = None, *, recheck: bool = False):
        """Fetch shard `name` if needed and yield its local path, which is not evicted until
        the `with` block ends.

        `size` and `checksum` ("algo:hexdigest") come from the manifest; a cached copy of the
        wrong size is replaced, and with `recheck=True` so is one whose checksum fails. An
        error of the background prefetch of this shard is raised here.

        >>> with cache.hold("shard-000003.tar", 300_000_000, "sha256:ab12...") as path:  # doctest: +SKIP
        ...     index = read_index(path)
        """
        rt = self._runtime()
        self._raise_prefetch_error(rt, name)
        protect = self._advance(rt, name)
        fd = self._acquire(rt, ShardSpec(name, size, checksum), recheck=recheck, protect=protect)
        path = self._dir.shard_path(self._stem(name))
        try:
            yield path
        finally:
            # No touch here: LRU goes by when a read started, so a shard just read is evicted
            # before the prefetched ones the reader has not reached yet.
            _release(fd)

    def fetch(self, name: str, size: int | None = None, checksum: str | None = None, *, recheck: bool = False) -> str:
        """Make sure shard `name` is cached and return its path. The shard may be evicted
        once this returns; use `hold` around reads.

        >>> path = cache.fetch("shard-000003.tar", 300_000_000, "sha256:ab12...")  # doctest: +SKIP
        """
        with self.hold(name, size, checksum, recheck=recheck) as path:
            return path

    def prefetch(self, shards: Iterable[ShardSpec | tuple]) -> None:
        """Set the shards the reader will ask for next, in order; a daemon thread keeps the
        first `config.prefetch` of them not yet reached cached, within the limit, never
        evicting a held shard or one sooner in this list. Reaching a shard with `hold` or
        `fetch` moves the window on. Replaces any earlier list.

        >>> cache.prefetch([(s.name, s.size, s.checksum) for s in my_shards])  # doctest: +SKIP
        """
        specs = [ShardSpec(*s) for s in shards]
        if self.config.prefetch <= 0:
            return
        rt = self._runtime()
        with rt.lock:
            rt.upcoming = specs
            rt.position = 0
            rt.done = set()
            rt.generation += 1
            rt.closing = False
            if rt.thread is None or not rt.thread.is_alive():
                rt.thread = threading.Thread(
                    target=self._prefetch_loop, args=(rt,), name="dlstore-cache-prefetch", daemon=True
                )
                rt.thread.start()
            rt.wake.notify_all()

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
        """Stop the prefetch thread (after its current download) and record the counters."""
        rt = self._rt
        if rt is None or rt.pid != os.getpid():
            return
        with rt.lock:
            rt.closing = True
            rt.upcoming = []
            rt.wake.notify_all()
            thread = rt.thread
        if thread is not None:
            thread.join(timeout=self.config.wait_timeout_s)
            rt.thread = None
        self._flush(rt, force=True)

    # -- per-process state -------------------------------------------------------------------------
    def _runtime(self) -> _Runtime:
        rt = self._rt
        if rt is not None and rt.pid == os.getpid() and rt.started:
            return rt
        with _runtime_lock:
            rt = self._rt
            if rt is None or rt.pid != os.getpid():
                rt = self._rt = _Runtime()  # new process: fresh counters, no thread
            if not rt.started:
                self._start()
                rt.started = True
                _live_caches.add(self)
        return rt

    def _start(self) -> None:
        """First use in this process: create the layout, remove dead downloads' temp files,
        and bring the directory within this process's limit."""
        self._dir.create()
        with self._dir.locked():
            usage = self._dir.scan()
            data = self._dir.read_stats()
            previous = data.get("limit_bytes")
            if previous not in (None, self.config.limit_bytes):
                log.warning(
                    "cache %s was used with limit %s bytes; now %d bytes (processes sharing it should agree)",
                    self.config.cache_dir,
                    previous,
                    self.config.limit_bytes,
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

    def _count(self, rt: _Runtime, **deltas: float) -> None:
        with rt.lock:
            for name, value in deltas.items():
                setattr(rt.stats, name, getattr(rt.stats, name) + value)
                setattr(rt.pending, name, getattr(rt.pending, name) + value)

    def _flush(self, rt: _Runtime, force: bool = False) -> None:
        """Add pending counters to stats.json: at once for downloads and evictions, at most
        once a second for hits (so a hit costs no cache-wide lock). Never call it while
        holding the cache-wide lock."""
        with rt.lock:
            if not force and time.monotonic() - rt.last_flush < 1.0:
                return
            pending, rt.pending = rt.pending, CacheStats()
            rt.last_flush = time.monotonic()
        if pending.is_zero():
            return
        if not os.path.isdir(self._dir.root):  # the cache was removed (a temporary one): nothing to record
            return
        try:
            with self._dir.locked():
                self._dir.add_stats(pending)
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
    ) -> int | None:
        """Return the shard's lock file descriptor holding LOCK_SH, with the shard published
        and valid; None only when `prefetching` and there is no room for it now."""
        if spec.checksum is not None:
            _parse_checksum(spec.checksum)
        if spec.size is not None:
            self._check_size(spec)
        stem = self._stem(spec.name)
        path = self._dir.shard_path(stem)
        fd = self._dir.open_lock(stem)
        deadline = time.monotonic() + self.config.wait_timeout_s
        delay, waited, downloaded = 0.001, 0.0, False
        try:
            while True:
                if _try_flock(fd, fcntl.LOCK_SH):
                    if self._cached_state(path, spec, recheck and not downloaded) == "ok":
                        self._touch(path)
                        if not downloaded and not prefetching:
                            self._count(rt, hits=1)
                        if waited:
                            self._count(rt, wait_time_s=waited)
                        self._flush(rt, force=downloaded)
                        return fd
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    if _try_flock(fd, fcntl.LOCK_EX):
                        # Ours alone: nobody reads or downloads it. Check again (another
                        # process may have published it since), then fetch it.
                        state = self._cached_state(path, spec, recheck and not downloaded)
                        if state != "ok":
                            if state == "bad":
                                os.unlink(path)
                                self._count(rt, corrupt_replaced=1)
                                log.warning("cached shard %r is corrupt; fetching it again", spec.name)
                            if not self._download(rt, spec, stem, path, protect, prefetching):
                                _release(fd)
                                return None
                            downloaded = True
                        # EX -> SH is not atomic: an evictor may slip in, so loop and check.
                        fcntl.flock(fd, fcntl.LOCK_UN)
                        continue
                # Another process holds it exclusively: downloading it, or evicting it.
                if time.monotonic() > deadline:
                    raise TransientError(
                        f"waited {self.config.wait_timeout_s:.0f}s for shard {spec.name!r} in cache "
                        f"{self.config.cache_dir}: another process is still downloading or evicting it"
                    )
                time.sleep(delay)
                waited += delay
                delay = min(delay * 2, _MAX_POLL_S)
        except BaseException:
            with contextlib.suppress(OSError):
                _release(fd)
            raise

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
        if recheck and spec.checksum is not None:
            algo, digest = _parse_checksum(spec.checksum)
            if _file_digest(path, algo) != digest:
                return "bad"
        return "ok"

    def _download(
        self, rt: _Runtime, spec: ShardSpec, stem: str, path: str, protect: frozenset[str], prefetching: bool
    ) -> bool:
        """Stream the shard into a reserved temp file, verify, publish. Called holding the
        shard's lock exclusively. False if `prefetching` and there is no room now."""
        size = spec.size if spec.size is not None else self.store.stat(spec.name).size
        self._check_size(ShardSpec(spec.name, size))
        reserved = self._reserve(rt, spec.name, stem, size, protect, wait=not prefetching)
        if reserved is None:
            return False
        fd, temp = reserved
        started = time.monotonic()
        try:
            self._write_verified(fd, spec, size)
            # Under the cache-wide lock: a scan (which holds it) must not see the bytes leave
            # tmp/ after it counted them there and then find them again under shards/.
            with self._dir.locked():
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
            "fetched shard %r (%d bytes, %.2fs)%s",
            spec.name,
            size,
            time.monotonic() - started,
            " [prefetch]" * prefetching,
        )
        self._count(rt, misses=1, bytes_fetched=size)
        return True

    def _write_verified(self, fd: int, spec: ShardSpec, size: int) -> None:
        if self.config.preallocate and size:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in _NO_SPACE_ERRNOS:
                    raise
                # EOPNOTSUPP, EINVAL: the file system cannot preallocate; writing still works.
        hasher = expected = None
        if self.config.verify and spec.checksum is not None:
            algo, expected = _parse_checksum(spec.checksum)
            hasher = hashlib.new(algo)
        written = 0
        for chunk in self.store.get(spec.name):
            if written + len(chunk) > size:
                raise CorruptShard(
                    f"shard {spec.name!r} in {self.store.url} is larger than the {size} bytes its manifest says"
                )
            view = memoryview(chunk)
            while view:
                view = view[os.pwrite(fd, view, written + len(chunk) - len(view)) :]
            if hasher is not None:
                hasher.update(chunk)
            written += len(chunk)
        if written != size:
            raise CorruptShard(f"shard {spec.name!r} in {self.store.url} has {written} bytes; its manifest says {size}")
        if hasher is not None and hasher.hexdigest() != expected:
            raise CorruptShard(
                f"shard {spec.name!r} in {self.store.url} fails its checksum: "
                f"{hasher.name} {hasher.hexdigest()}, manifest {expected}"
            )
        if self.config.fsync:
            os.fsync(fd)

    def _reserve(
        self, rt: _Runtime, name: str, stem: str, size: int, protect: frozenset[str], wait: bool
    ) -> tuple[int, str] | None:
        """Reserve `size` bytes under the limit, evicting LRU shards no reader holds; returns
        the new temp file (descriptor, path). Waits for room up to `wait_timeout_s`, or
        returns None at once when not `wait`."""
        deadline = time.monotonic() + self.config.wait_timeout_s
        delay, waited, evicted = 0.005, 0.0, 0
        try:
            while True:
                with self._dir.locked():
                    usage = self._dir.scan()
                    excess = usage.total + size - self.config.limit_bytes
                    if excess > 0:
                        freed, count = self._evict(usage, excess, protect, strict=not wait)
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
                time.sleep(delay)
                waited += delay
                delay = min(delay * 2, 0.1)
        finally:
            if evicted or waited:
                self._count(rt, evictions=evicted, wait_time_s=waited)

    def _evict(
        self, usage: _Usage, need: int, protect: frozenset[str], strict: bool, partial: bool = False
    ) -> tuple[int, int]:
        """Under the cache-wide lock: evict least recently used shards no one holds until
        `need` bytes are free, or none at all if that is impossible (unless `partial`).
        Shards in `protect` go last, and never when `strict`. Returns (bytes, shards)."""
        protected = {self._stem(name) for name in protect}
        ordered = sorted(usage.shards)
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

    # -- prefetch ------------------------------------------------------------------------------------
    def _raise_prefetch_error(self, rt: _Runtime, name: str) -> None:
        with rt.lock:
            error = rt.errors.pop(name, None)
        if error is not None:
            raise error

    def _advance(self, rt: _Runtime, name: str) -> frozenset[str]:
        """The reader reached `name`: move the prefetch window past it. Returns the window,
        which the reader's own evictions spare when they can."""
        with rt.lock:
            for index in range(rt.position, len(rt.upcoming)):
                if rt.upcoming[index].name == name:
                    rt.position = index + 1
                    rt.wake.notify_all()
                    break
            window = rt.upcoming[rt.position : rt.position + self.config.prefetch]
        return frozenset(spec.name for spec in window)

    def _next_prefetch(self, rt: _Runtime) -> tuple[ShardSpec, frozenset[str]] | None:
        """The next shard to prefetch, and the shards its eviction must spare: those sooner in
        the list, and the one the reader has just reached (it may not hold its lock yet)."""
        start = rt.position
        window = rt.upcoming[start : start + self.config.prefetch]
        for index, spec in enumerate(window):
            if spec.name not in rt.done:
                return spec, frozenset(s.name for s in rt.upcoming[max(start - 1, 0) : start + index])
        return None

    def _prefetch_loop(self, rt: _Runtime) -> None:
        while True:
            with rt.lock:
                job = None
                while not rt.closing and (job := self._next_prefetch(rt)) is None:
                    rt.wake.wait()
                if rt.closing or job is None:
                    return
                generation = rt.generation
            spec, sooner = job
            try:
                fd = self._acquire(rt, spec, protect=sooner, prefetching=True)
            except Exception as exc:  # kept for the reader: raised when it reaches this shard
                log.warning("prefetch of shard %r failed: %s: %s", spec.name, type(exc).__name__, exc)
                with rt.lock:
                    rt.errors[spec.name] = exc
                    rt.done.add(spec.name)
                continue
            if fd is None:  # no room without evicting what is needed sooner: try again later
                with rt.lock:
                    rt.wake.wait(timeout=0.2)
                continue
            _release(fd)
            with rt.lock:
                if generation == rt.generation:
                    rt.done.add(spec.name)


# -- whole-directory operations (the CLI) ---------------------------------------------------------
def cache_report(cache_dir: str | os.PathLike[str]) -> CacheReport:
    """Files, bytes, limit and counters summed over every process that used `cache_dir`.

    >>> cache_report("/mnt/ssd/dlstore").totals.hits  # doctest: +SKIP
    1234
    """
    directory = _CacheDir(os.path.abspath(os.fspath(cache_dir)))
    directory.require()
    with directory.locked():
        usage = directory.scan()
        data = directory.read_stats()
    limit = data.get("limit_bytes")
    return CacheReport(
        cache_dir=directory.root,
        files=len(usage.shards),
        bytes=usage.total,
        in_flight=usage.in_flight,
        in_flight_bytes=usage.in_flight_bytes,
        limit_bytes=limit if isinstance(limit, int) else None,
        totals=CacheStats.from_dict(data),
    )


def clear_cache(cache_dir: str | os.PathLike[str], reset_stats: bool = False) -> ClearResult:
    """Remove every shard no reader holds (and stale temp files); safe while the cache is in
    use. Held shards are left and counted in the result.

    >>> clear_cache("/mnt/ssd/dlstore").removed  # doctest: +SKIP
    40
    """
    directory = _CacheDir(os.path.abspath(os.fspath(cache_dir)))
    directory.require()
    removed = removed_bytes = skipped = skipped_bytes = 0
    with directory.locked():
        usage = directory.scan()
        for _, stem, size in sorted(usage.shards):
            freed = directory.try_evict(stem)
            if freed is None:
                skipped += 1
                skipped_bytes += size
            else:
                removed += 1
                removed_bytes += freed
        if reset_stats:
            data = directory.read_stats()
            data.update(dataclasses.asdict(CacheStats()))
            directory.write_stats(data)
        elif removed:
            directory.add_stats(CacheStats(evictions=removed))
    if skipped:
        log.warning("kept %d shards (%d bytes) that readers hold in %s", skipped, skipped_bytes, directory.root)
    return ClearResult(removed, removed_bytes, skipped, skipped_bytes, usage.stale_removed)
