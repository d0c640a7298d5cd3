"""The cache directory on disk: paths and names, the cache-wide and per-shard locks, the temp
files that record reservations, the scan that counts bytes, and the stats file. It keeps no
per-process state. The package docstring shows the layout."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import operator
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import quote

from dlstore.cache.config import STATS_FILE_BYTES
from dlstore.errors import ConfigError, DlstoreError

log = logging.getLogger(__name__)

#: stats.json keeps the counters of the latest this many epochs: the file has a fixed size.
EPOCHS_KEPT = 16


@dataclass
class CacheStats:
    """Counters of one process, in `ShardCache.stats`, or summed over all, in `cache_report`.
    A miss is one shard fetched, by a reader or the prefetch. `max_connections` is the most
    connections one process had open at once. It merges as a maximum, the others as sums."""

    hits: int = 0
    misses: int = 0
    bytes_fetched: int = 0
    # Samples read straight from the store, not into the cache: a cold pass's first batch.
    bytes_direct: int = 0
    evictions: int = 0
    wait_time_s: float = 0.0
    corrupt_replaced: int = 0
    max_connections: int = dataclasses.field(default=0, metadata={"merge": max})

    def add(self, other: CacheStats) -> None:
        for f in dataclasses.fields(self):
            merge = f.metadata.get("merge", operator.add)
            setattr(self, f.name, merge(getattr(self, f.name), getattr(other, f.name)))

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


@dataclass
class EpochStats:
    """The counters of one epoch named by `ShardCache.set_epoch`, summed over the node's
    processes. Stored in stats.json as ``[hits, misses, bytes_fetched]``."""

    hits: int = 0
    misses: int = 0
    bytes_fetched: int = 0

    def add(self, other: EpochStats) -> None:
        self.hits += other.hits
        self.misses += other.misses
        self.bytes_fetched += other.bytes_fetched

    def to_list(self) -> list[int]:
        return [self.hits, self.misses, self.bytes_fetched]

    @classmethod
    def from_list(cls, value: object) -> EpochStats | None:
        """None for anything but a list of three integers: a damaged entry is dropped."""
        if not isinstance(value, list) or len(value) != 3 or not all(isinstance(v, int) for v in value):
            return None
        return cls(*value)


def read_epochs(data: dict) -> dict[int, EpochStats]:
    """The per-epoch counters of a stats.json's contents, by epoch."""
    raw = data.get("epochs")
    out: dict[int, EpochStats] = {}
    if isinstance(raw, dict):
        for key, value in raw.items():
            stats = EpochStats.from_list(value)
            if stats is not None and key.lstrip("-").isdigit():
                out[int(key)] = stats
    return dict(sorted(out.items()))


# -- flock helpers ------------------------------------------------------------------------------
def try_flock(fd: int, mode: int) -> bool:
    """Take `mode` on `fd` without blocking. Return whether it was had."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def unlock_and_close(fd: int) -> None:
    """Unlock, then close. Unlock first: a forked child may share this open file description.
    Closing our descriptor alone would leave the lock held through the child's."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def entry_stem(namespace: str, name: str) -> str:
    """The file name of entry `name` of the store `namespace` names, under every folder."""
    if not name or name.startswith("/"):
        raise ConfigError(f"invalid shard name {name!r}: names are keys relative to the store root")
    stem = f"{namespace}-{quote(name, safe='')}"
    if len(stem) > 180:  # file names stop at 255 bytes; temp names add ~45
        digest = hashlib.sha256(name.encode()).hexdigest()[:24]
        stem = f"{namespace}-{digest}-{stem[-100:]}"
    return stem


@dataclass
class Usage:
    """What a scan found: the shards, the downloads in flight and their bytes."""

    shards: list[tuple[int, str, int]]  # (mtime_ns, stem, size), unsorted
    in_flight: int
    in_flight_bytes: int
    stale_removed: int
    in_flight_stems: frozenset[str] = frozenset()  # of the downloads in tmp/

    @property
    def total(self) -> int:
        return sum(size for _, _, size in self.shards) + self.in_flight_bytes + STATS_FILE_BYTES

    def unreserved(self, wanted: list[tuple[str, int]]) -> int:
        """Bytes of the `wanted` shards, as stem and size, that are neither cached nor
        downloading. That is what they will still take from the limit."""
        there = self.in_flight_stems | {stem for _, stem, _ in self.shards}
        return sum(size for stem, size in wanted if stem not in there)


class CacheDir:
    """The files of one cache directory and the operations on them. No per-process state."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.shards = os.path.join(root, "shards")
        self.tmp = os.path.join(root, "tmp")
        self.locks = os.path.join(root, "locks")
        self.indexes = os.path.join(root, "indexes")  # kept sample indexes: `dlstore.read.indexes`
        self.marks = os.path.join(root, "marks")  # samples known to decode cleanly: `dlstore.read.marks`
        self.lock_path = os.path.join(root, "cache.lock")
        self.stats_path = os.path.join(root, "stats.json")

    def create(self) -> None:
        for directory in (self.shards, self.tmp, self.locks, self.indexes):
            os.makedirs(directory, exist_ok=True)

    def require(self) -> None:
        if not os.path.isfile(self.lock_path) or not os.path.isdir(self.shards):
            raise ConfigError(f"{self.root} is not a dlstore cache directory (no cache.lock or shards/)")

    def shard_path(self, stem: str) -> str:
        return os.path.join(self.shards, stem)

    def marks_path(self, name: str) -> str:
        """Where the node's decode marks `name` are kept, for `dlstore.read.NodeMarks`."""
        return os.path.join(self.marks, name + ".bin")

    def index_path(self, stem: str) -> str:
        """Where the sample index of cached shard `stem` is kept, for `dlstore.read.indexes`."""
        return os.path.join(self.indexes, stem + ".idx")

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
            unlock_and_close(fd)

    def open_lock(self, stem: str) -> int:
        return os.open(os.path.join(self.locks, stem + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)

    # A reader waiting for another process's download holds the shard's `.wanted` file shared.
    # The process prefetching it probes the file in `reader_waits` and hurries the download.
    def mark_wanted(self, stem: str) -> int | None:
        """Hold `stem`'s wanted lock shared, or None if it cannot be now. `unlock_and_close` it."""
        try:
            fd = os.open(os.path.join(self.locks, stem + ".wanted"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError:
            return None  # e.g. no descriptors left: the download is not hurried, nothing else changes
        try:
            if try_flock(fd, fcntl.LOCK_SH):
                return fd
        except OSError:  # a hint only: a file system without flock costs the hurry, not the read
            pass
        os.close(fd)  # a probe holds it for a moment: try again at the next look
        return None

    def reader_waits(self, stem: str) -> bool:
        """Whether a reader of any process waits for shard `stem` now, by `mark_wanted`."""
        try:
            fd = os.open(os.path.join(self.locks, stem + ".wanted"), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False  # never wanted, or unreadable
        try:
            if try_flock(fd, fcntl.LOCK_EX):
                fcntl.flock(fd, fcntl.LOCK_UN)
                return False
            return True
        except OSError:  # a hint only: never a reason to fail the download
            return False
        finally:
            os.close(fd)

    # -- under the cache-wide lock -----------------------------------------------------------------
    def scan(self) -> Usage:
        """Bytes on disk, removing temp files of dead processes. Exact because downloads move
        from `tmp/` to `shards/` only under the cache-wide lock, which the caller holds."""
        in_flight = in_flight_bytes = stale = 0
        stems = set()
        for entry in os.scandir(self.tmp):
            if self._temp_owner_dead(entry.path):
                unlink_quietly(entry.path)
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
            stems.add(entry.name.removesuffix(".part").rsplit(".", 3)[0])  # create_temp's name
        shards = []
        for entry in os.scandir(self.shards):
            try:
                stat = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            shards.append((stat.st_mtime_ns, entry.name, stat.st_size))
        return Usage(shards, in_flight, in_flight_bytes, stale, frozenset(stems))

    def remove_stale_index_temps(self, max_age_s: float = 600.0) -> int:
        """Remove kept sample indexes' temp files whose writer died, and return how many. A
        writer is quick, so a file older than `max_age_s` is stale. It goes by age, not by
        pid: the processes sharing a cache may not share a pid namespace."""
        removed = 0
        try:
            entries = list(os.scandir(self.indexes))
        except FileNotFoundError:
            return 0
        now = time.time()
        for entry in entries:
            if not entry.name.endswith(".tmp"):
                continue
            try:
                age = now - entry.stat(follow_symlinks=False).st_mtime
            except FileNotFoundError:
                continue  # renamed or removed meanwhile
            if age < max_age_s:
                continue
            unlink_quietly(entry.path)
            removed += 1
            log.info("removed stale sample index temp file %s (its writer died)", entry.path)
        return removed

    @staticmethod
    def _reserved_size(temp_name: str) -> int:
        try:
            return int(temp_name.removesuffix(".part").rsplit(".", 1)[1])
        except (IndexError, ValueError):
            return 0

    @staticmethod
    def _temp_owner_dead(path: str) -> bool:
        """Whether no live process holds the temp file's lock, so it is an orphan."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False  # just published or removed: nothing to clean
        try:
            return try_flock(fd, fcntl.LOCK_EX)
        finally:
            unlock_and_close(fd)

    def create_temp(self, stem: str, size: int) -> tuple[int, str]:
        """A new temp file recording the reservation of `size` bytes, locked by us."""
        path = os.path.join(self.tmp, f"{stem}.{os.getpid()}.{secrets.token_hex(4)}.{size}.part")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: cannot be held by anyone
        return fd, path

    def try_evict(self, stem: str) -> int | None:
        """Remove one shard unless a reader or downloader holds it. Return bytes freed, or None if held."""
        fd = self.open_lock(stem)
        if not try_flock(fd, fcntl.LOCK_EX):
            os.close(fd)
            return None
        try:
            return self.remove_shard(stem)
        finally:
            unlock_and_close(fd)

    def remove_shard(self, stem: str) -> int:
        """Unlink a shard whose lock the caller holds exclusively, and its sample index. Return bytes freed."""
        path = self.shard_path(stem)
        unlink_quietly(self.index_path(stem))
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
        """Rewrite stats.json with the latest `EPOCHS_KEPT` epochs, fewer if they do not fit."""
        epochs = data.get("epochs")
        if isinstance(epochs, dict) and len(epochs) > EPOCHS_KEPT:
            data["epochs"] = {k: epochs[k] for k in sorted(epochs, key=_epoch_number)[-EPOCHS_KEPT:]}
        text = json.dumps(data, sort_keys=True, separators=(",", ":"))
        while len(text) >= STATS_FILE_BYTES and data.get("epochs"):
            oldest = min(data["epochs"], key=_epoch_number)
            data["epochs"] = {k: v for k, v in data["epochs"].items() if k != oldest}
            text = json.dumps(data, sort_keys=True, separators=(",", ":"))
        if len(text) >= STATS_FILE_BYTES:
            raise DlstoreError(f"cache stats do not fit in {STATS_FILE_BYTES} bytes: {text[:80]}...")
        # In place at a fixed size: no second file, no growth beyond what the limit counts.
        payload = (text.ljust(STATS_FILE_BYTES - 1) + "\n").encode()
        fd = os.open(self.stats_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            os.pwrite(fd, payload, 0)
            os.ftruncate(fd, STATS_FILE_BYTES)
        finally:
            os.close(fd)

    def add_stats(self, delta: CacheStats, epochs: dict[int, EpochStats] | None = None) -> None:
        """Add one process's counters, and its per-epoch ones, to stats.json."""
        data = self.read_stats()
        totals = CacheStats.from_dict(data)
        totals.add(delta)
        data.update(dataclasses.asdict(totals))
        if epochs:
            merged = read_epochs(data)
            for epoch, stats in epochs.items():
                merged.setdefault(epoch, EpochStats()).add(stats)
            data["epochs"] = {str(epoch): stats.to_list() for epoch, stats in merged.items()}
        self.write_stats(data)


def _epoch_number(key: str) -> int:
    try:
        return int(key)
    except ValueError:
        return -(2**63)  # not an epoch: dropped first
