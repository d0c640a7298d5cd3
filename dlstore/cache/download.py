"""One download: fetch an entry into its reserved temp file through the process's
`DownloadEngine`. Check it as its written prefix grows, before the cache publishes it.
A whole shard is checked by its size and checksum, a run of samples by each sample's digest."""

from __future__ import annotations

import errno
import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dlstore.cache.config import CacheConfig
from dlstore.cache.engine import DownloadEngine
from dlstore.cache.spec import SampleRange, ShardSpec
from dlstore.errors import ConfigError, CorruptShard
from dlstore.format.checksums import new_hasher
from dlstore.storage.base import Store

log = logging.getLogger(__name__)

#: What a full disk or quota fails with.
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_HASH_BLOCK = 4 * 2**20


def split_checksum(checksum: str) -> tuple[str, str]:
    """The algorithm and hex digest of "algo:hexdigest", for any algorithm hashlib knows."""
    algo, sep, digest = checksum.partition(":")
    if not sep or not digest:
        raise ConfigError(f"checksum {checksum!r} is not 'algo:hexdigest' (e.g. 'sha256:9f86d0...')")
    try:
        new_hasher(algo)
    except ConfigError:
        raise ConfigError(f"checksum {checksum!r}: unknown hash algorithm {algo!r}") from None
    return algo, digest.lower()


def file_digest(path: str, algo: str) -> str:
    """The hex digest of the file at `path`."""
    hasher = new_hasher(algo)
    with open(path, "rb") as file:
        while chunk := file.read(4 * 2**20):
            hasher.update(chunk)
    return hasher.hexdigest()


class _PrefixHash:
    """Hash a file's bytes as its written prefix grows, read back with `pread` from the page
    cache. It runs in the thread that waits, so the parts' threads only write. After the
    last byte, only the parts that ended last remain to hash."""

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
    """How one entry was fetched, for the log line and the benchmarks."""

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
    """Fetch `size` bytes of object `name` into `fd` through `engine`, from `object_offset`.
    Without an offset, fetch the whole object. `new_check()` makes each attempt's check; None
    checks nothing. Bytes that fail are fetched once more, since they may have been damaged on
    the way. A second failure raises `CorruptShard`. Whole shards and sample runs share this loop.

    A prefetch passes `reader_waits`: whether a reader of another process waits for these bytes.
    When it says so, `DownloadEngine.hurry` hurries the download, which that reader cannot do."""
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


def _no_check() -> None:
    return None


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
    """Fetch entry `spec` into `fd`, exactly `size` bytes, checked as the bytes arrive. A shard
    is checked by its size and, when `config.verify`, its checksum. A run of samples is checked
    by each sample's digest whatever `config.verify` says: it has no other check. A bad copy is
    fetched once more. A second failure, or a size unlike the manifest's, raises `CorruptShard`."""
    samples, offset = spec.samples, None
    what = f"shard {spec.name if samples is None else samples.shard!r} in {store.url}"
    new_check: Callable[[], EntryCheck | None] = _no_check
    if samples is not None:  # a run is not preallocated: its reservation already counts it
        name, size, offset = samples.shard, samples.size, samples.byte_start
        new_check = functools.partial(_SampleCheck, fd, samples, what)
    else:
        name = spec.name
        if config.preallocate and size:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in NO_SPACE_ERRNOS:
                    raise
                # EOPNOTSUPP, EINVAL: the file system cannot preallocate; writing still works.
        if config.verify and spec.checksum is not None:
            algo, expected = split_checksum(spec.checksum)
            new_check = functools.partial(_ChecksumCheck, fd, algo, expected, what)
    return fetch_checked(
        fd, engine, store, name, size, config, priority, new_check, object_offset=offset, reader_waits=reader_waits
    )


class _SampleCheck:
    """A run's check for `fetch_checked`. Each sample is checked against its digest once the
    written prefix passes its end, read back with `pread` from the page cache."""

    def __init__(self, fd: int, samples: SampleRange, what: str) -> None:
        self.fd, self.samples, self.what = fd, samples, what
        self.next = samples.start  # the first sample not checked yet
        self.bad: list[int] = []

    def update(self, _start: int, end: int) -> None:
        samples = self.samples
        while self.next < samples.stop and samples.offsets[self.next + 1 - samples.start] - samples.byte_start <= end:
            span = samples.span(self.next)
            data = os.pread(self.fd, span.size, span.offset)
            if len(data) != span.size or not samples.matches(self.next, data):
                self.bad.append(self.next)
            self.next += 1

    def failure(self) -> str | None:
        if not self.bad and self.next == self.samples.stop:
            return None
        if not self.bad:  # the download ended before the range did: the engine says why, normally
            return f"{self.what}: samples {self.next}-{self.samples.stop - 1} of {self.samples.key} never arrived"
        return (
            f"{self.what}: samples {self.bad[:5]} of {self.samples.key} fail their digests in the shard's sample index"
        )
