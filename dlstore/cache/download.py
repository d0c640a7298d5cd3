"""One download: fetch a shard from the store into its reserved temp file through the
process's `DownloadEngine` (parallel ranged GETs), hash it as its prefix grows, and check
its size and checksum before the cache publishes it."""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dlstore.cache.config import CacheConfig, ShardSpec
from dlstore.cache.engine import DownloadEngine
from dlstore.errors import ConfigError, CorruptShard
from dlstore.format.checksums import new_hasher
from dlstore.storage.base import Store

log = logging.getLogger(__name__)

_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_HASH_BLOCK = 4 * 2**20


def _parse_checksum(checksum: str) -> tuple[str, str]:
    algo, sep, digest = checksum.partition(":")
    if not sep or not digest:
        raise ConfigError(f"checksum {checksum!r} is not 'algo:hexdigest' (e.g. 'sha256:9f86d0...')")
    try:
        new_hasher(algo)
    except ConfigError:
        raise ConfigError(f"checksum {checksum!r}: unknown hash algorithm {algo!r}") from None
    return algo, digest.lower()


def _file_digest(path: str, algo: str) -> str:
    hasher = new_hasher(algo)
    with open(path, "rb") as file:
        while chunk := file.read(4 * 2**20):
            hasher.update(chunk)
    return hasher.hexdigest()


class _PrefixHash:
    """Hash a file's bytes as its written prefix grows, reading them back with `pread` (from
    the page cache: they were written moments ago). Runs in the thread that waits for the
    download, so the parts' threads only write; after the last byte, only the parts that
    ended last remain to hash."""

    def __init__(self, fd: int, algo: str) -> None:
        self.fd = fd
        self.hasher = new_hasher(algo)
        self.hashed = 0
        self._buffer = bytearray(_HASH_BLOCK)

    def update(self, start: int, end: int) -> None:
        view = memoryview(self._buffer)
        while start < end:
            n = os.preadv(self.fd, [view[: min(_HASH_BLOCK, end - start)]], start)
            if n <= 0:
                raise CorruptShard(f"the cache's temp file ended at byte {start} while hashing it")
            self.hasher.update(view[:n])
            start += n
        self.hashed = end


@dataclass(frozen=True)
class DownloadReport:
    """How one shard was fetched: for the log line and the benchmarks."""

    parts: int
    connections: int  # parts in flight at once, at most
    seconds: float
    hash_tail_s: float  # from the last byte written to the checksum's verdict
    attempts: int  # 2 when the first copy failed its checksum


class _ChecksumCheck(_PrefixHash):
    """A whole shard's check for `fetch_checked`: its checksum against the manifest's."""

    def __init__(self, fd: int, algo: str, expected: str, what: str) -> None:
        super().__init__(fd, algo)
        self.expected, self.what = expected, what

    def failure(self) -> str | None:
        actual = self.hasher.hexdigest()
        if actual == self.expected:
            return None
        return f"{self.what} fails its checksum: {self.hasher.name} {actual}, manifest {self.expected}"


class EntryCheck(Protocol):
    """What `fetch_checked` checks the bytes of one attempt with."""

    def update(self, start: int, end: int) -> None: ...  # a new stretch of the written prefix

    def failure(self) -> str | None: ...  # once all bytes are in: what is wrong, or None


def fetch_checked(
    fd: int,
    engine: DownloadEngine,
    store: Store,
    name: str,
    size: int,
    config: CacheConfig,
    priority: int,
    new_check: Callable[[], EntryCheck | None],
    object_offset: int | None = None,
    reader_waits: Callable[[], bool] | None = None,
) -> DownloadReport:
    """Fetch `size` bytes of object `name` (from `object_offset`, default the whole object)
    into `fd` through `engine`, checked as they arrive by `new_check()` (one per attempt; None:
    no check). Bytes that fail are fetched once more, since they may have been damaged on the
    way; a second failure raises `CorruptShard`. The one fetch loop of the cache's entries:
    whole shards (`write_verified`) and runs of samples (`dlstore.cache.partial`).

    `reader_waits` (a prefetch's, `priority` above 0): whether a reader of another process
    waits for these bytes now. Looked at while the download runs; when it says so, the
    download is hurried (`DownloadEngine.hurry`): that reader's own `hurry` cannot reach it."""
    started = time.monotonic()
    hurried = False

    def look_for_readers() -> None:
        nonlocal hurried
        if not hurried and reader_waits():  # passed to `wait` only with a `reader_waits`
            engine.hurry(name, object_offset)
            hurried = True

    for attempt in (1, 2):
        download = engine.start(
            store,
            name,
            fd,
            size,
            priority=priority,
            parts_in_flight=config.parts_in_flight,
            part_size=config.part_size,
            object_offset=object_offset,
        )
        check = new_check()
        download.wait(
            check.update if check is not None else None,
            look_for_readers if reader_waits is not None and priority > 0 and not hurried else None,
        )
        verdict = time.monotonic()
        failure = check.failure() if check is not None else None
        if failure is None:
            break
        if attempt == 2:
            raise CorruptShard(failure + " (fetched twice)")
        log.warning("%s; fetching it once more", failure)
    if config.fsync:
        os.fsync(fd)
    return DownloadReport(
        parts=len(download.parts),
        connections=download.most_running,
        seconds=time.monotonic() - started,
        hash_tail_s=max(verdict - download.last_write, 0.0) if check is not None else 0.0,
        attempts=attempt,
    )


def write_verified(
    fd: int,
    engine: DownloadEngine,
    store: Store,
    spec: ShardSpec,
    size: int,
    config: CacheConfig,
    priority: int,
    reader_waits: Callable[[], bool] | None = None,
) -> DownloadReport:
    """Fetch shard `spec` of `store` into `fd` (exactly `size` bytes, never more) through
    `engine`, then check its size and, when `config.verify`, its checksum, which the bytes
    are hashed for as they arrive. A copy that fails its checksum is fetched once more (the
    bytes may have been damaged on the way); a second failure, or a size that differs from
    the manifest's, raises `CorruptShard` naming the shard. `reader_waits`: `fetch_checked`'s."""
    if config.preallocate and size:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in _NO_SPACE_ERRNOS:
                raise
            # EOPNOTSUPP, EINVAL: the file system cannot preallocate; writing still works.
    if not config.verify or spec.checksum is None:
        return fetch_checked(
            fd, engine, store, spec.name, size, config, priority, lambda: None, reader_waits=reader_waits
        )
    algo, expected = _parse_checksum(spec.checksum)
    what = f"shard {spec.name!r} in {store.url}"
    return fetch_checked(
        fd,
        engine,
        store,
        spec.name,
        size,
        config,
        priority,
        lambda: _ChecksumCheck(fd, algo, expected, what),
        reader_waits=reader_waits,
    )
