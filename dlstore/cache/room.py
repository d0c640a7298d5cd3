"""Room under the limit: a download's reservation and the evictions that make room for it.
It also checks that the limit and the disk can hold the shards at all. Evictions go in `policy`'s order."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Callable

from dlstore.cache.config import STATS_FILE_BYTES, CacheConfig
from dlstore.cache.download import NO_SPACE_ERRNOS
from dlstore.cache.layout import CacheDir, Usage, try_flock, unlock_and_close
from dlstore.cache.policy import read_next_use, victim_order
from dlstore.cache.runtime import Runtime
from dlstore.config import format_size
from dlstore.errors import ConfigError, NoSpace

log = logging.getLogger(__name__)

# Sleeps (first, longest) while the cache has no room; a release in this process ends them early.
_ROOM_POLL_S = (0.005, 0.1)
# What a cache directory that cannot be used at all fails with: read-only, not ours, a file.
_UNUSABLE_DIR_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.ENOENT, errno.EEXIST)


class CacheFull(NoSpace):
    """The cache cannot make room within its limit. The other shards are held by readers or
    being downloaded, and none was released within `wait_timeout_s`."""


def check_fits(config: CacheConfig, max_shard_size: int, readers: int = 1) -> None:
    """Raise `ConfigError` unless the largest shard fits under the limit. Warn when `readers`
    processes, each holding one such shard, would not fit at once."""
    room = config.limit_bytes - STATS_FILE_BYTES
    if max_shard_size > room:
        raise ConfigError(
            f"cache limit {format_size(config.limit_bytes)} ({config.cache_dir}) is smaller than the "
            f"largest shard ({format_size(max_shard_size)}) plus the {STATS_FILE_BYTES}-byte stats file; "
            "raise the cache limit or write smaller shards"
        )
    if readers > 1 and readers * max_shard_size > room:
        log.warning(
            "cache limit %s holds fewer than %d shards of %s: readers will wait for each other",
            format_size(config.limit_bytes),
            readers,
            format_size(max_shard_size),
        )


def disk_room(directory: CacheDir) -> int | None:
    """The bytes the cache could hold on its disk: the free space there and its shards'."""
    folder = os.path.abspath(directory.root)
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)  # the folder the cache will be made in
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    held = 0
    with contextlib.suppress(OSError), os.scandir(directory.shards) as entries:
        held = sum(entry.stat().st_size for entry in entries if entry.is_file())
    return free + held


class Room:
    """Reservations and evictions in one cache directory, under its cache-wide lock."""

    def __init__(self, config: CacheConfig, directory: CacheDir, stem: Callable[[str], str]) -> None:
        self.config = config
        self.directory = directory
        self.stem = stem

    def set_up(self, rt: Runtime) -> None:
        """First use in a process: create the layout and remove dead downloads' temp files.
        Then bring the directory within this process's limit. A full disk raises `NoSpace`
        naming the cache directory, as it does when a download fills it."""
        try:
            evicted, stale = self._set_up()
        except OSError as exc:
            if exc.errno in NO_SPACE_ERRNOS:
                raise NoSpace(f"no space in cache {self.config.cache_dir} to set it up: {exc.strerror}") from exc
            if exc.errno in _UNUSABLE_DIR_ERRNOS:
                raise ConfigError(
                    f"cannot use {self.config.cache_dir} as the cache directory: {exc.strerror} ({exc.filename}); "
                    "give --cache-dir (or DLSTORE_CACHE_DIR) a writable folder on the node's local disk"
                ) from None
            raise
        if stale or evicted:
            log.info(
                "cache %s: removed %d stale temp files, evicted %d shards over the limit",
                self.config.cache_dir,
                stale,
                evicted,
            )
        if evicted:
            rt.count(evictions=evicted)

    def _set_up(self) -> tuple[int, int]:
        """Return the shards evicted and the stale temp files removed."""
        directory, limit = self.directory, self.config.limit_bytes
        directory.create()
        with directory.locked():
            usage = directory.scan()
            stale = usage.stale_removed + directory.remove_stale_index_temps()
            data = directory.read_stats()
            previous = data.get("limit_bytes")
            if previous not in (None, limit):
                log.warning(
                    "cache %s was used with limit %s; now %s (processes sharing it should agree)",
                    self.config.cache_dir,
                    format_size(previous) if isinstance(previous, (int, float)) else previous,
                    format_size(limit),
                )
            data["limit_bytes"] = limit
            directory.write_stats(data)
            excess = usage.total - limit
            evicted = self.evict(usage, excess, frozenset(), strict=True, partial=True)[1] if excess > 0 else 0
        return evicted, stale

    def reserve(
        self,
        rt: Runtime,
        name: str,
        stem: str,
        size: int,
        protect: frozenset[str],
        wait: bool,
        ahead: list[tuple[str, int]] | None = None,
    ) -> tuple[int, str] | None:
        """Reserve `size` bytes under the limit, evicting shards no reader holds. Return the
        new temp file's descriptor and path. Wait for room up to `wait_timeout_s`, or return
        None at once when not `wait`, a prefetch's call. Room is also kept for the `ahead`
        shards, as stem and size, that are neither cached nor downloading."""
        deadline = time.monotonic() + self.config.wait_timeout_s
        delay, waited, evicted = _ROOM_POLL_S[0], 0.0, 0
        try:
            while True:
                seen = rt.releases
                with self.directory.locked():
                    usage = self.directory.scan()
                    excess = usage.total + size + usage.unreserved(ahead or []) - self.config.limit_bytes
                    if excess > 0:
                        if wait:  # this process's mapped entries no read uses may be the best victims
                            rt.mapped.let_go_idle()
                        freed, count = self.evict(usage, excess, protect, strict=not wait, prefetching=not wait)
                        excess -= freed
                        evicted += count
                    if excess <= 0:
                        return self.directory.create_temp(stem, size)
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
                rt.count(evictions=evicted, wait_time_s=waited)

    def evict(
        self,
        usage: Usage,
        need: int,
        protect: frozenset[str],
        strict: bool,
        partial: bool = False,
        prefetching: bool = False,
    ) -> tuple[int, int]:
        """Under the cache-wide lock, evict shards no one holds until `need` bytes are free.
        If that is impossible, evict none, unless `partial`. The order is `policy.victim_order`'s:
        furthest next use by the readers' hints, else least recently used. When `prefetching`,
        every hinted shard is spared. Shards in `protect` go last, and never when `strict`.
        Return the bytes and shards freed."""
        protected = {self.stem(name) for name in protect}
        ordered = victim_order(usage.shards, read_next_use(self.directory), prefetching)
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
                fd = self.directory.open_lock(stem)
                if not try_flock(fd, fcntl.LOCK_EX):
                    os.close(fd)  # a reader holds it
                    continue
                victims.append((fd, stem))
                total += size
            if total < need and not partial:
                return 0, 0
            freed = 0
            for _, stem in victims:
                size = self.directory.remove_shard(stem)
                freed += size
                log.debug("evicted %s (%d bytes)", stem, size)
            return freed, len(victims)
        finally:
            for fd, _ in victims:
                unlock_and_close(fd)
