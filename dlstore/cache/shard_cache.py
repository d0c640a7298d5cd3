"""`ShardCache`, the facade: fetch a shard into the node-local cache once, hold it while it is
read, evict to stay within the limit. `layout` owns the directory and its locks, `room` the
reservations and eviction, and `fetcher` the locks and downloads. `prefetch` and `runtime` own
the process's threads and counters. The package docstring states the invariants."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import mmap
import os
from collections.abc import Iterable, Iterator

from dlstore.cache.config import STATS_FILE_BYTES, CacheConfig
from dlstore.cache.engine import DownloadEngine
from dlstore.cache.fetcher import Fetcher
from dlstore.cache.layout import CacheDir, CacheStats, entry_stem, unlock_and_close
from dlstore.cache.mapped import NEAR, map_file
from dlstore.cache.pace import Concurrency
from dlstore.cache.policy import HintWriter
from dlstore.cache.prefetch import (
    PREFETCH_DROPPED,
    advance_window,
    raise_prefetch_error,
    start_prefetch,
    stop_prefetch,
)
from dlstore.cache.room import Room, check_fits, disk_room
from dlstore.cache.runtime import ProcessLocal, Runtime
from dlstore.cache.slots import node_slots
from dlstore.cache.spec import SampleRange, ShardSpec
from dlstore.config import format_size
from dlstore.errors import ConfigError
from dlstore.storage.base import Store

log = logging.getLogger(__name__)


class ShardCache:
    """The node-local shard cache over one store. See the package docstring, `dlstore.cache`.

    >>> cache = ShardCache(CacheConfig("/mnt/ssd/dlstore", "150GB"), open_store("swift://imagenet/train"))  # doctest: +SKIP
    >>> with cache.hold("shard-000000.tar", 301_234_176, "sha256:9f86d0...") as path:  # doctest: +SKIP
    ...     samples = read_tar(path)
    """

    def __init__(self, config: CacheConfig, store: Store) -> None:
        self.config = config
        self.store = store
        self._dir = CacheDir(config.cache_dir)
        # Names are keys relative to the store root. The store's URL keeps two datasets with
        # the same shard names apart in one cache directory.
        self._namespace = hashlib.sha256(store.url.encode()).hexdigest()[:12]
        self._stem = functools.partial(entry_stem, self._namespace)
        self._room = Room(config, self._dir, self._stem)
        self._fetcher = Fetcher(config, store, self._dir, self._room, self._stem)
        self._process = ProcessLocal(self._dir, functools.partial(_start_process, self._room, config))
        self._hints: HintWriter | None = None  # this process's hint file, made on the first `hint`

    def __repr__(self) -> str:
        return f"ShardCache({self.config.cache_dir!r}, limit={self.config.limit_bytes}, store={self.store!r})"

    def __getstate__(self) -> dict:
        return {"config": self.config, "store": self.store}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["config"], state["store"])  # type: ignore[misc]

    @property
    def stats(self) -> CacheStats:
        """A copy of this process's counters."""
        rt = self._process.get()
        with rt.lock:
            return dataclasses.replace(rt.stats)

    def set_epoch(self, epoch: int, names: Iterable[str] = ()) -> None:
        """Say which epoch this process reads now, and which shards `names` a batch of it reads.
        Hits and downloads are then also counted per epoch, in `cache_report(...).epochs`. A
        named shard counts under the epoch that named it last, others under the epoch read now.
        A prefetch's counts under the epoch of its list. `Dataset` calls it for each batch.

        >>> cache.set_epoch(3, ["train/shard-000007.tar", "train/shard-000012.tar"])  # doctest: +SKIP
        """
        rt = self._process.get()
        with rt.lock:
            rt.epoch = epoch
            rt.read_epochs.update(dict.fromkeys(names, epoch))

    def check_fits(self, max_shard_size: int, readers: int = 1) -> None:
        """Raise `ConfigError` unless the largest shard fits under the limit. Warn when
        `readers` processes, each holding one shard of that size, would not fit at once.

        >>> cache.check_fits(max(s.size for s in manifest.shards), readers=world.local_size * workers)  # doctest: +SKIP
        """
        check_fits(self.config, max_shard_size, readers)

    def check_disk_room(self, dataset_size: int) -> None:
        """Warn when the disk cannot hold what the cache will: the limit, or the whole dataset
        if smaller. Asked once per dataset, by one rank of the node."""
        wanted = min(self.config.limit_bytes, dataset_size + STATS_FILE_BYTES)
        disk = disk_room(self._dir)
        if disk is not None and wanted > disk:
            log.warning(
                "cache %s: its disk has room for %s (free space and the shards it holds), and it would hold %s "
                "(cache_limit %s): lower cache_limit (--cache-limit), or downloads will fail when the disk fills",
                self.config.cache_dir,
                format_size(disk),
                format_size(wanted),
                format_size(self.config.limit_bytes),
            )

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
        """Fetch shard `name` if needed and yield its local path, not evicted until the `with`
        block ends.

        `size` and `checksum`, as "algo:hexdigest", come from the manifest. A cached copy of the
        wrong size is replaced, and with `recheck=True` one whose checksum fails too. An error
        of the background prefetch of this shard is raised here. With `samples`, the entry is
        that run of samples, checked by digests. Take `name` and `size` from `samples.spec`.

        >>> with cache.hold("shard-000003.tar", 300_000_000, "sha256:ab12...") as path:  # doctest: +SKIP
        ...     index = read_index(path)
        """
        rt = self._process.get()
        if recheck:  # a copy that may be replaced: this process's own lock must not stand in the way
            rt.mapped.forget(name)
        protect = advance_window(rt, name, self.config.prefetch)  # first: it widens a prefetch under way
        raise_prefetch_error(rt, name, moot=lambda: self.cached(name))
        fd = self._fetcher.acquire(rt, ShardSpec(name, size, checksum, samples), recheck=recheck, protect=protect)
        try:
            yield self._dir.shard_path(self._stem(name))
        finally:
            # No touch here: LRU goes by when a read started, so a shard just read is evicted
            # before the prefetched ones the reader has not reached yet.
            unlock_and_close(fd)
            rt.announce_release()  # room for a reservation waiting in this process, maybe

    @contextlib.contextmanager
    def mapped(
        self, name: str, size: int | None = None, checksum: str | None = None, samples: SampleRange | None = None
    ) -> Iterator[tuple[mmap.mmap | bytes, str]]:
        """Entry `name`'s bytes, mapped read-only, and its path, for the `with` block: `hold` for
        readers that slice samples out of it. The first use in a process fetches and holds the
        entry, as `hold` does. Later ones take no system call: the hold lasts until the entry
        goes idle (see `dlstore.cache.mapped`), after `close()` only until the block ends."""
        rt = self._process.get()
        used = rt.mapped.use(name)
        found = None if used is None else used[:2]
        if used is not None:
            rt.count(rt.epoch_of(name), hits=1)  # a read served from the cache, as a hold's
            if used[2]:  # mapped ahead by the prefetch: its first read moves the window on
                advance_window(rt, name, self.config.prefetch)
        else:
            protect = advance_window(rt, name, self.config.prefetch)
            raise_prefetch_error(rt, name, moot=lambda: self.cached(name))
            fd = self._fetcher.acquire(rt, ShardSpec(name, size, checksum, samples), protect=protect)
            path = self._dir.shard_path(self._stem(name))
            try:
                found = map_file(path), path
            except BaseException:
                rt.release_lock(fd)
                raise
            rt.mapped.add(name, *found, fd)
        try:
            yield found
        finally:
            rt.mapped.done(name, keep=not rt.closing)

    def fetch(
        self,
        name: str,
        size: int | None = None,
        checksum: str | None = None,
        samples: SampleRange | None = None,
        *,
        recheck: bool = False,
    ) -> str:
        """Make sure entry `name` is cached, as `hold` does, and return its path. The entry may
        be evicted once this returns, so use `hold` around reads.

        >>> path = cache.fetch("shard-000003.tar", 300_000_000, "sha256:ab12...")  # doctest: +SKIP
        """
        with self.hold(name, size, checksum, samples, recheck=recheck) as path:
            return path

    def cached(self, name: str) -> bool:
        """Whether entry `name` is in the cache now. A hint only: another process may evict it
        the next moment. Reads go through `hold`."""
        self._process.get()
        return os.path.exists(self._dir.shard_path(self._stem(name)))

    def prefetch(self, shards: Iterable[ShardSpec | tuple], depth: int | None = None, lead: int = 0) -> None:
        """Set the shards the reader will ask for next, in order, replacing any earlier list.
        Daemon threads keep the first `depth` not yet reached cached, within the limit. They
        never evict a held shard, one sooner in the list, or one the hints name: they wait for
        room instead. `depth` defaults to `config.prefetch`.
        The first `lead` shards, those in use, come before any later one. `hold` moves the window on.

        >>> cache.prefetch([(s.name, s.size, s.checksum) for s in my_shards])  # doctest: +SKIP
        """
        specs = [ShardSpec(*s) for s in shards]
        if (depth is not None and depth < 0) or lead < 0:
            raise ConfigError(f"prefetch depth {depth} and lead {lead} must not be negative")
        if self.config.prefetch <= 0:
            return
        rt = self._process.get()
        rt.prefetch_epoch = rt.epoch  # the list is of the epoch being read now
        start_prefetch(
            rt,
            specs,
            depth if depth is not None else self.config.prefetch,
            functools.partial(self._prefetch_shard, rt),
            Concurrency(self.config.shards_in_flight, self.config.parts_in_flight),
            lead,
        )

    def _prefetch_shard(self, rt: Runtime, spec: ShardSpec, sooner: frozenset[str], priority: int) -> int | None:
        """The prefetch's fetch of `spec`, as `start_prefetch` asks. A shard in use (`priority`
        0) is also mapped here, in a process whose readers map: their first read then takes no
        system call, which lets go of the GIL (why that costs: `dlstore.loader.threads`). A shard
        mapped here already is done. The epoch
        is read when the shard is fetched."""
        if rt.mapped.holds(spec.name):
            return PREFETCH_DROPPED
        fd = self._fetcher.acquire(
            rt, spec, protect=sooner, prefetching=True, priority=priority, epoch=rt.prefetch_epoch
        )
        if fd is None or fd == PREFETCH_DROPPED or priority != 0 or not rt.mapped.read_here:
            return fd
        path = self._dir.shard_path(self._stem(spec.name))
        try:
            memory = map_file(path)
        except OSError as exc:
            log.debug("shard %r is left to its reader to map: %s", spec.name, exc)
            return fd
        rt.mapped.add(spec.name, memory, path, fd, ahead=True)
        return PREFETCH_DROPPED

    def hint(self, names: Iterable[str]) -> None:
        """Tell the cache the order in which this process will need shards, soonest first: the
        rest of this epoch, then the next. Every process of the node sees it, and evictions keep
        the shards needed soonest: see `dlstore.cache.policy`. Without hints they go by LRU. It
        replaces this process's earlier order, and an empty one withdraws it. A hint that
        cannot be written is logged.

        >>> cache.hint(name for name in shard_names_in_read_order)  # doctest: +SKIP
        """
        self._process.get()
        writer = self._hints
        if writer is None or writer.pid != os.getpid():  # none yet, or the parent's after a fork
            writer = self._hints = HintWriter(self._dir, self._namespace, self._stem)
        names = list(names)
        try:
            writer.write(names)
        except OSError as exc:
            log.warning("could not record the shard order in cache %s: %s", self.config.cache_dir, exc)
        # Entries this process keeps mapped that it needs no time soon: other processes may evict them.
        self._process.get().mapped.keep_only(names[:NEAR])

    def usage(self) -> int:
        """Bytes the cache directory holds now, counted as the limit counts them."""
        self._process.get()
        with self._dir.locked():
            return self._dir.scan().total

    # -- seams for the read side, `dlstore.read` ------------------------------------------------
    def index_path(self, name: str) -> str:
        """Where the sample index of cached shard `name` is kept. Eviction removes it."""
        return self._dir.index_path(self._stem(name))

    def marks_path(self, dataset: str) -> str:
        """Where the node's decode marks of `dataset`, a digest of its bytes, are kept."""
        return self._dir.marks_path(f"{self._namespace}-{dataset}")

    @contextlib.contextmanager
    def node_slot(self, timeout_s: float) -> Iterator[None]:
        """Hold one of the node's connection slots around a GET made outside the cache, as a
        download's part does. Raise `TransientError` after `timeout_s`."""
        engine = self._process.get().engine
        assert engine is not None
        with engine.node_slot(timeout_s):
            yield

    def count_direct(self, nbytes: int) -> None:
        """Count `nbytes` read straight from the store as `CacheStats.bytes_direct`, recorded at once."""
        rt = self._process.get()
        rt.count(bytes_direct=nbytes)
        rt.flush(self._dir, force=True)

    # -- the process ---------------------------------------------------------------------------
    def flush_stats(self) -> None:
        """Add this process's counters not yet recorded to the directory's totals."""
        self._process.flush_stats()

    def close(self) -> None:
        """Stop the prefetch threads after their current downloads and let the download workers
        end. Record the counters, and withdraw this process's hints: other processes would
        evict by a closed reader's order."""
        rt = self._process.current()
        if rt is None:
            return
        stop_prefetch(rt, self.config.wait_timeout_s)
        rt.mapped.let_go_idle()
        if rt.engine is not None:
            rt.engine.close()
        rt.flush(self._dir, force=True)
        if self._hints is not None and self._hints.pid == os.getpid():
            self._hints.close()
            self._hints = None


def _start_process(room: Room, config: CacheConfig, rt: Runtime) -> None:
    """A cache's first use in a process: set the directory up, then make the download engine."""
    room.set_up(rt)
    rt.engine = DownloadEngine(config.connections, slots=node_slots(config))
