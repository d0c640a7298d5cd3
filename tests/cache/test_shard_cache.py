"""The node-local shard cache against the four cache invariants of DESIGN.md:
byte limit, atomic publish, one download per node, readers never lose a held shard.

Everything runs on a local `file://` store in a temp directory; several tests fork real
processes (the cache is shared through files and `flock` only, so that is the real thing).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import hashlib
import io
import json
import logging
import multiprocessing
import os
import pickle
import random
import resource
import signal
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import unquote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlstore.cache import (
    STATS_FILE_BYTES,
    CacheConfig,
    CacheFull,
    SampleRange,
    ShardCache,
    ShardSpec,
    cache_report,
)
from dlstore.cache.fetcher import Fetcher
from dlstore.cache.layout import CacheDir
from dlstore.cache.pace import Concurrency
from dlstore.cache.prefetch import _next_prefetch, advance_window
from dlstore.cache.room import Room
from dlstore.cache.runtime import Runtime
from dlstore.cli import main
from dlstore.config import RetryConfig, StoreConfig
from dlstore.errors import ConfigError, CorruptShard, NoSpace, NotFound, TransientError
from dlstore.format.checksums import checksum_of
from dlstore.format.sample_index import SampleIndex, sample_digest
from dlstore.format.shard_writer import TarShardWriter
from dlstore.format.shards import read_sample_from_file
from dlstore.storage.local import LocalStore

FORK = multiprocessing.get_context("fork")


class RecordingStore(LocalStore):
    """A local store that appends the key of every download to `log_path` (one line each,
    O_APPEND, so many processes can share it) and sleeps `delay_s` before each chunk."""

    def __init__(self, url: str, log_path: str | None = None, delay_s: float = 0.0, chunk_size: int = 1024):
        super().__init__(url, StoreConfig(chunk_size=chunk_size))
        self.log_path = log_path
        self.delay_s = delay_s

    def _read(self, key, start, end):
        if self.log_path:
            with open(self.log_path, "a") as log:
                log.write(key + "\n")
        for chunk in super()._read(key, start, end):
            if self.delay_s:
                time.sleep(self.delay_s)
            yield chunk

    def downloads(self) -> collections.Counter:
        if not self.log_path or not os.path.exists(self.log_path):
            return collections.Counter()
        with open(self.log_path) as log:
            return collections.Counter(log.read().split())


def make_remote(root, sizes, seed=0):
    """Shards of the given sizes under `root`; returns [(name, size, checksum)] and their bytes."""
    rng = random.Random(seed)
    specs, contents = [], {}
    for index, size in enumerate(sizes):
        name = f"train/shard-{index:06d}.tar"
        data = rng.randbytes(size)
        path = os.path.join(root, "train", f"shard-{index:06d}.tar")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as file:
            file.write(data)
        specs.append((name, size, "sha256:" + hashlib.sha256(data).hexdigest()))
        contents[name] = data
    return specs, contents


def disk_bytes(cache_dir) -> int:
    """Bytes of every regular file in the cache directory (shards/ before tmp/, so a download
    published during the walk is missed rather than counted twice)."""
    total = 0
    for sub in ("shards", "tmp", "locks", ""):
        directory = os.path.join(cache_dir, sub)
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(directory):
                with contextlib.suppress(FileNotFoundError):
                    if entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
    return total


class DiskSampler:
    """Samples `disk_bytes` from a thread while the test runs, under the cache-wide lock so
    that an eviction and the next reservation never land on either side of one walk."""

    def __init__(self, cache_dir) -> None:
        self.cache_dir = str(cache_dir)
        self.max = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        lock_path = os.path.join(self.cache_dir, "cache.lock")
        while not self._stop.is_set():
            if os.path.exists(lock_path):
                fd = os.open(lock_path, os.O_RDWR)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    self.max = max(self.max, disk_bytes(self.cache_dir))
                    self.samples += 1
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)
            time.sleep(0.002)

    def __enter__(self) -> DiskSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def cached_names(cache_dir) -> set[str]:
    with contextlib.suppress(FileNotFoundError):
        return {name.split("-", 1)[1].replace("%2F", "/") for name in os.listdir(os.path.join(cache_dir, "shards"))}
    return set()


@pytest.fixture
def remote(tmp_path):
    def build(sizes, **store_kwargs):
        root = tmp_path / "remote"
        specs, contents = make_remote(root, sizes)
        store = RecordingStore(str(root), log_path=str(tmp_path / "gets.log"), **store_kwargs)
        return store, specs, contents

    return build


def config(tmp_path, limit, **kwargs) -> CacheConfig:
    kwargs.setdefault("prefetch", 0)
    kwargs.setdefault("fsync", False)
    return CacheConfig(str(tmp_path / "cache"), limit, **kwargs)


def read(path) -> bytes:
    with open(path, "rb") as file:
        return file.read()


# -- configuration ---------------------------------------------------------------------------------
def test_config_reads_sizes_and_rejects_nonsense(tmp_path):
    assert CacheConfig(tmp_path, "150GB").limit_bytes == 150 * 10**9
    assert CacheConfig(tmp_path, "64MiB").cache_dir == str(tmp_path)
    with pytest.raises(ConfigError):
        CacheConfig(tmp_path, "lots")
    with pytest.raises(ConfigError):
        CacheConfig(tmp_path, 100)  # not even the stats file fits
    with pytest.raises(ConfigError):
        CacheConfig(tmp_path, "1GB", prefetch=-1)


def test_limit_smaller_than_a_shard_is_a_config_error_at_once(tmp_path, remote):
    store, specs, _ = remote([8000])
    cache = ShardCache(config(tmp_path, 5000), store)
    with pytest.raises(ConfigError, match="smaller than the largest shard"):
        cache.check_fits(8000)
    started = time.monotonic()
    with pytest.raises(ConfigError, match="smaller than the largest shard"):
        cache.fetch(*specs[0])
    assert time.monotonic() - started < 1.0
    cache.check_fits(5000 - STATS_FILE_BYTES)  # exactly fits


def test_a_limit_beyond_what_the_disk_can_hold_is_said_at_once(tmp_path, remote, caplog):
    """A cache limit of 1 GB on a 3 MB disk ran until the disk filled, then failed with NoSpace
    and no word of the limit. What the cache would hold (the limit, or the dataset if smaller)
    is compared with the disk's room (its free space and what the cache holds) when a dataset
    is opened; a limit or a dataset within it says nothing."""
    import shutil

    store, _, _ = remote([8000])
    free = shutil.disk_usage(tmp_path).free
    with caplog.at_level(logging.WARNING, logger="dlstore.cache"):
        ShardCache(config(tmp_path, free * 4), store).check_disk_room(free * 2)
    assert "its disk has room for" in caplog.text and "--cache-limit" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dlstore.cache"):
        ShardCache(config(tmp_path, min(free // 2, 10**9)), store).check_disk_room(free * 2)  # a limit within it
        ShardCache(config(tmp_path, free * 4), store).check_disk_room(8000)  # a dataset within it (50 GB default)
    assert "its disk has room for" not in caplog.text


# -- basics ----------------------------------------------------------------------------------------
def test_fetch_downloads_once_then_hits(tmp_path, remote):
    store, specs, contents = remote([3000, 0])
    cache = ShardCache(config(tmp_path, 100_000, fsync=True), store)
    for _ in range(3):
        for name, size, checksum in specs:
            with cache.hold(name, size, checksum) as path:
                assert read(path) == contents[name]
                assert path.endswith(".tar")
    assert cache.stats.misses == 2 and cache.stats.hits == 4
    assert cache.stats.bytes_fetched == 3000
    assert store.downloads() == {specs[0][0]: 1, specs[1][0]: 1}
    assert os.listdir(tmp_path / "cache" / "tmp") == []


def test_size_unknown_is_asked_of_the_store(tmp_path, remote):
    store, specs, contents = remote([2500])
    cache = ShardCache(config(tmp_path, 100_000), store)
    assert read(cache.fetch(specs[0][0])) == contents[specs[0][0]]


def test_cache_pickles_without_runtime_state(tmp_path, remote):
    store, specs, contents = remote([2000, 2000, 2000])
    cache = ShardCache(config(tmp_path, 100_000, prefetch=2), store)
    cache.prefetch(specs)  # a live thread and locks must not travel
    clone = pickle.loads(pickle.dumps(cache))
    assert read(clone.fetch(*specs[2])) == contents[specs[2][0]]
    cache.close()
    clone.close()


# -- invariant 1 (limit) and 4 (held shards), as a property -------------------------------------------
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_limit_never_exceeded_and_held_shards_survive(data):
    sizes = data.draw(st.lists(st.integers(0, 4000), min_size=1, max_size=6), label="sizes")
    limit = STATS_FILE_BYTES + max(1, *sizes) + data.draw(st.integers(0, sum(sizes)), label="extra")
    ops = data.draw(
        st.lists(st.tuples(st.sampled_from(["fetch", "hold", "release"]), st.integers(0, 5)), max_size=20),
        label="ops",
    )
    with tempfile.TemporaryDirectory() as tmp:
        specs, contents = make_remote(os.path.join(tmp, "remote"), sizes)
        store = RecordingStore(os.path.join(tmp, "remote"), chunk_size=512)
        cache_dir = os.path.join(tmp, "cache")
        cache = ShardCache(CacheConfig(cache_dir, limit, prefetch=0, fsync=False, wait_timeout_s=0.05), store)
        held: list[tuple[int, str, contextlib.ExitStack]] = []
        try:
            with DiskSampler(cache_dir) as sampler:
                for op, index in ops:
                    index %= len(specs)
                    name, size, _ = specs[index]
                    if op == "release":
                        if held:
                            held.pop(index % len(held))[2].close()
                        continue
                    held_now = {i for i, _, _ in held}
                    stack = contextlib.ExitStack()
                    try:
                        path = stack.enter_context(cache.hold(*specs[index]))
                    except CacheFull:
                        # Only when the shards held here leave no room for this one.
                        assert index not in held_now
                        assert sum(sizes[i] for i in held_now) + size > limit - STATS_FILE_BYTES
                    else:
                        assert read(path) == contents[name]
                        if op == "hold":
                            held.append((index, path, stack))
                        else:
                            stack.close()
                    assert disk_bytes(cache_dir) <= limit
                    for i, path, _ in held:
                        assert read(path) == contents[specs[i][0]]
            assert sampler.max <= limit
        finally:
            for _, _, stack in held:
                stack.close()
            cache.close()


def _hold_until(cache, spec, ready, release):
    with cache.hold(*spec):
        ready.set()
        release.wait(20)


def test_shard_held_by_another_process_is_not_evicted(tmp_path, remote):
    store, specs, contents = remote([5000] * 4)
    limit = STATS_FILE_BYTES + 2 * 5000
    cache = ShardCache(config(tmp_path, limit, wait_timeout_s=0.3), store)
    ready, release = FORK.Event(), FORK.Event()
    child = FORK.Process(target=_hold_until, args=(cache, specs[0], ready, release))
    child.start()
    try:
        assert ready.wait(10)
        for spec in specs[1:]:
            cache.fetch(*spec)  # each evicts the one before, never the held shard 0
        assert cached_names(tmp_path / "cache") == {specs[0][0], specs[3][0]}
        assert read(cache.fetch(*specs[0])) == contents[specs[0][0]]
        with cache.hold(*specs[3]), pytest.raises(CacheFull, match="is full"):
            cache.fetch(*specs[1])  # both slots held: wait, then a clear error
        assert disk_bytes(tmp_path / "cache") <= limit
    finally:
        release.set()
        child.join(10)
    assert child.exitcode == 0
    cache.fetch(*specs[1])  # released: room again
    assert cache.stats.wait_time_s > 0


def test_a_smaller_limit_at_start_evicts_down_to_it(tmp_path, remote):
    store, specs, _ = remote([3000] * 5)
    big = ShardCache(config(tmp_path, 100_000), store)
    for spec in specs:
        big.fetch(*spec)
    small = ShardCache(config(tmp_path, STATS_FILE_BYTES + 2 * 3000), store)
    assert small.usage() <= STATS_FILE_BYTES + 2 * 3000
    assert len(cached_names(tmp_path / "cache")) == 2


# -- invariant 2: one download per node, many processes --------------------------------------------
def _read_all(cache, specs, digests, seed, barrier):
    order = list(specs)
    random.Random(seed).shuffle(order)
    barrier.wait(10)
    for spec in order:
        with cache.hold(*spec) as path:
            assert hashlib.sha256(read(path)).hexdigest() == digests[spec[0]]
    cache.close()


def test_processes_share_one_download_per_shard(tmp_path, remote):
    store, specs, contents = remote([8192] * 5, delay_s=0.01)  # 80 ms per shard: downloads overlap
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in contents.items()}
    cache = ShardCache(config(tmp_path, 1_000_000), store)
    cache.fetch(*specs[0])  # used before the fork: children must rebuild their own state
    barrier = FORK.Barrier(6)
    children = [FORK.Process(target=_read_all, args=(cache, specs, digests, i, barrier)) for i in range(6)]
    with DiskSampler(tmp_path / "cache") as sampler:
        for child in children:
            child.start()
        for child in children:
            child.join(30)
    assert [c.exitcode for c in children] == [0] * 6
    assert store.downloads() == {name: 1 for name, _, _ in specs}
    cache.close()
    totals = cache_report(tmp_path / "cache").totals
    assert totals.misses == 5 and totals.bytes_fetched == 5 * 8192
    assert totals.hits == 6 * 5 - 4
    assert totals.wait_time_s > 0  # someone waited for someone else's download
    assert sampler.max <= 1_000_000


def _read_randomly(cache, specs, digests, seed, rounds):
    rng = random.Random(seed)
    for _ in range(rounds):
        spec = rng.choice(specs)
        with cache.hold(*spec) as path:
            time.sleep(rng.random() * 0.005)  # evictors run meanwhile; the file must stay whole
            assert hashlib.sha256(read(path)).hexdigest() == digests[spec[0]]
    cache.close()


def test_processes_under_a_tight_limit(tmp_path, remote):
    sizes = [random.Random(i).randint(2000, 6000) for i in range(8)]
    store, specs, contents = remote(sizes, delay_s=0.001)
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in contents.items()}
    limit = STATS_FILE_BYTES + 4 * max(sizes)  # four readers, each holding one shard
    cache = ShardCache(config(tmp_path, limit, wait_timeout_s=20), store)
    cache.check_fits(max(sizes), readers=4)
    children = [FORK.Process(target=_read_randomly, args=(cache, specs, digests, i, 15)) for i in range(4)]
    with DiskSampler(tmp_path / "cache") as sampler:
        for child in children:
            child.start()
        for child in children:
            child.join(30)
    assert [c.exitcode for c in children] == [0] * 4
    assert sampler.samples > 0 and sampler.max <= limit
    totals = cache_report(tmp_path / "cache").totals
    assert totals.hits + totals.misses == 4 * 15
    assert totals.evictions > 0


class GatedStore(RecordingStore):
    """Downloads wait for `gate` before their first chunk (a thread, not a process, opens it)."""

    def __init__(self, url: str, **kwargs):
        super().__init__(url, **kwargs)
        self.gate = threading.Event()

    def _read(self, key, start, end):
        assert self.gate.wait(10)
        yield from super()._read(key, start, end)


def test_a_download_published_during_a_scan_is_counted_once(tmp_path, monkeypatch):
    """`cache_report` (and every reservation) scans tmp/ then shards/ under the cache-wide
    lock; a download must not move from one to the other in between, or the scan counts it
    twice and reports the cache over its limit."""
    specs, contents = make_remote(tmp_path / "remote", [8000])
    store = GatedStore(str(tmp_path / "remote"))
    limit = STATS_FILE_BYTES + 12_000  # room for the shard once, not twice
    cache_dir = tmp_path / "cache"
    cache = ShardCache(config(tmp_path, limit), store)
    cache.usage()  # create the directory
    fetched = {}
    downloader = threading.Thread(target=lambda: fetched.setdefault("path", cache.fetch(*specs[0])))
    downloader.start()
    wait_for(lambda: os.listdir(cache_dir / "tmp"))  # reserved; waiting at the gate

    original = CacheDir._temp_owner_dead

    def slow_check(path):  # mid-scan: past tmp/, before shards/; the download finishes now
        dead = original(path)
        store.gate.set()
        downloader.join(0.5)
        return dead

    monkeypatch.setattr(CacheDir, "_temp_owner_dead", staticmethod(slow_check))
    report = cache_report(cache_dir)
    monkeypatch.undo()
    downloader.join(10)
    assert read(fetched["path"]) == contents[specs[0][0]]
    assert report.bytes == STATS_FILE_BYTES + 8000 <= limit
    assert report.in_flight + report.files == 1
    assert cache_report(cache_dir).bytes == STATS_FILE_BYTES + 8000
    cache.close()


def _sleeps_noted(monkeypatch) -> threading.Event:
    """An event set when a thread of the cache starts a poll's sleep (`sleep_unless_released`)."""
    sleeping = threading.Event()
    original = Runtime.sleep_unless_released

    def noted(self, seen, seconds):
        sleeping.set()
        return original(self, seen, seconds)

    monkeypatch.setattr(Runtime, "sleep_unless_released", noted)
    return sleeping


def test_a_reader_waiting_for_another_threads_download_wakes_when_it_is_in(tmp_path, monkeypatch):
    """A reader whose shard another thread of its process downloads polls the shard's lock;
    the download's end wakes it at once, not at the end of its poll's sleep (here an hour:
    without the wake-up it sleeps through the test)."""
    monkeypatch.setattr("dlstore.cache.fetcher._LOCK_POLL_S", (3600.0, 3600.0))
    sleeping = _sleeps_noted(monkeypatch)
    specs, contents = make_remote(tmp_path / "remote", [8000])
    store = GatedStore(str(tmp_path / "remote"))
    cache = ShardCache(config(tmp_path, 10**6), store)
    cache.usage()  # create the directory
    downloader = threading.Thread(target=cache.fetch, args=specs[0])
    downloader.start()
    wait_for(lambda: os.listdir(tmp_path / "cache" / "tmp"))  # it holds the lock, at the gate
    got = {}

    def read_it():
        with cache.hold(*specs[0]) as path:
            got["bytes"] = read(path)

    reader = threading.Thread(target=read_it)
    reader.start()
    assert sleeping.wait(10)
    store.gate.set()
    downloader.join(30)
    reader.join(30)
    assert not reader.is_alive(), "the reader slept on after the download was in"
    assert got["bytes"] == contents[specs[0][0]]
    cache.close()


def test_a_download_waiting_for_room_wakes_when_a_reader_lets_go(tmp_path, monkeypatch):
    """A download that waits for room (the only shard that could go is held) starts as soon as
    a reader of its process lets go, not at the end of its poll's sleep (here an hour)."""
    monkeypatch.setattr("dlstore.cache.room._ROOM_POLL_S", (3600.0, 3600.0))
    sleeping = _sleeps_noted(monkeypatch)
    specs, contents = make_remote(tmp_path / "remote", [8000, 8000])
    cache = ShardCache(config(tmp_path, STATS_FILE_BYTES + 12_000), LocalStore(str(tmp_path / "remote")))
    fetched = {}
    with cache.hold(*specs[0]):
        second = threading.Thread(target=lambda: fetched.setdefault("path", cache.fetch(*specs[1])))
        second.start()
        assert sleeping.wait(10)  # no room while the first is held
    second.join(30)
    assert not second.is_alive(), "the download slept on after the reader let go"
    assert read(fetched["path"]) == contents[specs[1][0]]
    cache.close()


def test_prefetch_threads_without_room_do_not_wake_each_other(tmp_path, monkeypatch):
    """Two prefetch threads with no room (the reader holds the one shard that fits) try again
    when their wait ends or the list changes, not each time the other gives up: a refusal
    announced as a release would have them wake each other in a busy loop."""
    specs, _ = make_remote(tmp_path / "remote", [8000] * 4)
    cache = ShardCache(
        config(tmp_path, STATS_FILE_BYTES + 12_000, prefetch=3, shards_in_flight=2),
        LocalStore(str(tmp_path / "remote")),
    )
    tries = collections.Counter()
    original = Room.reserve

    def counted(self, rt, name, *args, **kwargs):
        tries[name] += 1
        return original(self, rt, name, *args, **kwargs)

    monkeypatch.setattr(Room, "reserve", counted)
    with cache.hold(*specs[0]):
        cache.prefetch(specs[1:])
        time.sleep(1.0)
    cache.close()
    # Each thread tries again every 0.2 s at most: some ten tries in the second, not thousands.
    assert 2 <= sum(tries.values()) <= 40, tries


def test_a_prefetch_leaves_room_for_a_shard_sooner_in_its_list_that_no_one_fetches_yet(tmp_path, remote):
    """Room for two shards; the reader holds shard 0, and shard 1's download cannot start yet
    (its lock is held, as by another process). Shard 2 would fit, but its prefetch waits: had
    it taken the room, shard 1 would have evicted it (a later shard) and it would be fetched
    twice. Each shard is downloaded once."""
    store, specs, contents = remote([6000] * 4)
    cfg = config(tmp_path, STATS_FILE_BYTES + 12_000, prefetch=2, shards_in_flight=2, wait_timeout_s=10)
    cache = ShardCache(cfg, store)
    cache._dir.create()
    blocker = cache._dir.open_lock(cache._stem(specs[1][0]))
    fcntl.flock(blocker, fcntl.LOCK_EX)  # no one fetches shard 1 while this is held
    cache.prefetch(specs)
    with cache.hold(*specs[0]):
        time.sleep(0.6)  # the prefetch tries shard 2 every 0.2 s
        assert specs[2][0] not in cached_names(tmp_path / "cache")
        os.close(blocker)
        wait_for(lambda: specs[1][0] in cached_names(tmp_path / "cache"))
    for spec in specs[1:]:
        with cache.hold(*spec) as path:
            assert read(path) == contents[spec[0]]
    cache.close()
    assert store.downloads() == {name: 1 for name, _, _ in specs}


def test_a_prefetched_shard_evicted_before_its_shared_lock_is_not_fetched_again(tmp_path, remote, monkeypatch):
    """Between a download and the shared lock that follows it an evictor may slip in (a reader
    that has passed the shard, or one making room for a sooner shard). The prefetch then lets
    it be: fetching it again is for a reader that still wants it."""
    store, specs, _ = remote([6000] * 3)
    cache = ShardCache(config(tmp_path, 10**6, prefetch=3), store)
    original = Fetcher.fetch_exclusively
    evicted = []

    def evicted_at_once(self, rt, spec, stem, path, *args):
        fetched = original(self, rt, spec, stem, path, *args)
        if fetched and spec.name == specs[1][0] and not evicted:
            os.unlink(path)  # as an evictor would, once the exclusive lock is let go
            evicted.append(spec.name)
        return fetched

    monkeypatch.setattr(Fetcher, "fetch_exclusively", evicted_at_once)
    cache.prefetch(specs)
    wait_for(lambda: {specs[0][0], specs[2][0]} <= cached_names(tmp_path / "cache"))
    time.sleep(0.5)  # a prefetch without room tries again every 0.2 s: this one is done
    cache.close()
    assert evicted and store.downloads()[specs[1][0]] == 1 and specs[1][0] not in cached_names(tmp_path / "cache")


def test_a_prefetch_lets_go_a_shard_the_readers_passed_while_it_waited_for_its_lock(tmp_path, remote):
    """Shard 1's lock is held (as by another process's download) while the reader reads shard 0
    and then shard 2: it has passed shard 1, so the prefetch waiting for that lock does not
    download it once the lock is free."""
    store, specs, _ = remote([6000] * 4)
    cache = ShardCache(config(tmp_path, 10**6, prefetch=2, wait_timeout_s=10), store)
    cache._dir.create()
    blocker = cache._dir.open_lock(cache._stem(specs[1][0]))
    fcntl.flock(blocker, fcntl.LOCK_EX)
    cache.prefetch(specs)
    for spec in (specs[0], specs[2]):
        with cache.hold(*spec):
            pass
    os.close(blocker)
    wait_for(lambda: specs[3][0] in cached_names(tmp_path / "cache"))
    time.sleep(0.3)
    cache.close()
    assert specs[1][0] not in store.downloads() and specs[1][0] not in cached_names(tmp_path / "cache")


def test_a_prefetch_fetches_a_lead_deeper_than_its_window(tmp_path, remote):
    """The lead (the shards in use) is fetched whole, however deep the window: a lead shard
    past the window is still one the readers wait for, not one they have passed."""
    store, specs, _ = remote([6000] * 5)
    cache = ShardCache(config(tmp_path, 10**6, prefetch=1, shards_in_flight=2), store)
    cache.prefetch(specs, lead=3)
    wait_for(lambda: {name for name, _, _ in specs[:3]} <= cached_names(tmp_path / "cache"))
    cache.close()
    assert all(store.downloads()[name] == 1 for name, _, _ in specs[:3])


def _read_with_prefetch(cache, specs, seed, rounds):
    rng = random.Random(seed)
    order = [rng.choice(specs) for _ in range(rounds)]
    cache.prefetch(order)  # the background thread downloads ahead, as in every rank's main process
    for spec in order:
        with cache.hold(*spec) as path:
            assert os.path.getsize(path) == spec[1]
            time.sleep(rng.random() * 0.002)
    cache.close()


def test_processes_with_prefetch_threads_never_report_more_than_the_limit(tmp_path, remote):
    """Ranks and their prefetch threads downloading into one tight cache while a monitor polls
    `cache_report` (the loader test's sampler): no report may exceed the limit."""
    sizes = [random.Random(i).randint(1000, 6000) for i in range(24)]
    store, specs, _ = remote(sizes, delay_s=0.0005)
    limit = STATS_FILE_BYTES + 4 * max(sizes) + 2000
    cache = ShardCache(config(tmp_path, limit, prefetch=2, wait_timeout_s=20), store)
    cache.usage()  # create the directory before the monitor starts
    children = [FORK.Process(target=_read_with_prefetch, args=(cache, specs, i, 25)) for i in range(4)]
    reports, stop = [], threading.Event()

    def monitor():
        while not stop.is_set():
            reports.append(cache_report(tmp_path / "cache").bytes)

    thread = threading.Thread(target=monitor, daemon=True)
    thread.start()
    try:
        for child in children:
            child.start()
        for child in children:
            child.join(60)
    finally:
        stop.set()
        thread.join()
    assert [c.exitcode for c in children] == [0] * 4
    assert reports and max(reports) <= limit, f"{max(reports) - limit} bytes over the limit"
    totals = cache_report(tmp_path / "cache").totals
    assert totals.evictions > 0 and totals.misses > len(specs)


# -- invariant 3: crashes ---------------------------------------------------------------------------
def _fetch_forever(cache, spec):
    cache.fetch(*spec)


def test_killed_download_leaves_no_final_file_and_is_cleaned(tmp_path, remote):
    store, specs, contents = remote([64 * 1024], delay_s=0.02)  # 64 chunks: ~1.3 s
    cache = ShardCache(config(tmp_path, 1_000_000), store)
    child = FORK.Process(target=_fetch_forever, args=(cache, specs[0]))
    child.start()
    tmp_dir = tmp_path / "cache" / "tmp"
    wait_for(lambda: tmp_dir.exists() and os.listdir(tmp_dir))
    time.sleep(0.2)  # some chunks written
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    assert cached_names(tmp_path / "cache") == set()
    assert len(os.listdir(tmp_dir)) == 1  # the orphan, until someone looks

    fresh = ShardCache(config(tmp_path, 1_000_000), RecordingStore(store.root))
    assert fresh.usage() == STATS_FILE_BYTES  # start removed the dead process's temp file
    assert os.listdir(tmp_dir) == []
    assert read(fresh.fetch(*specs[0])) == contents[specs[0][0]]


def test_killed_reader_releases_its_hold(tmp_path, remote):
    store, specs, _ = remote([1000])
    cache = ShardCache(config(tmp_path, 100_000), store)
    ready, release = FORK.Event(), FORK.Event()
    child = FORK.Process(target=_hold_until, args=(cache, specs[0], ready, release))
    child.start()
    assert ready.wait(10)
    assert main(["cache", "clear", str(tmp_path / "cache")]) == 0
    assert cached_names(tmp_path / "cache") == {specs[0][0]}  # held: kept
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    assert main(["cache", "clear", str(tmp_path / "cache")]) == 0
    assert cached_names(tmp_path / "cache") == set()


def _fetch_under_file_size_limit(cache, spec, max_file_bytes, result_path):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))
    try:
        cache.fetch(*spec)
        outcome = "fetched"
    except NoSpace as exc:
        outcome = f"NoSpace: {exc}"
    except BaseException as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    with open(result_path, "w") as file:
        file.write(outcome[:200])


@pytest.mark.parametrize("preallocate", [False, True])
def test_full_disk_removes_the_temp_file_and_raises_no_space(tmp_path, remote, preallocate):
    """A file-size rlimit makes the write (or the preallocation) fail the way a full disk does."""
    store, specs, _ = remote([20_000])
    cache = ShardCache(config(tmp_path, 1_000_000, preallocate=preallocate), store)
    cache.usage()  # create the layout and stats file before the rlimit
    child = FORK.Process(target=_fetch_under_file_size_limit, args=(cache, specs[0], 4096, tmp_path / "result"))
    child.start()
    child.join(20)
    outcome = (tmp_path / "result").read_text()
    assert outcome.startswith("NoSpace:") and "shard-000000.tar" in outcome, outcome
    assert os.listdir(tmp_path / "cache" / "tmp") == []
    assert cached_names(tmp_path / "cache") == set()


# -- verification --------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["checksum", "longer", "shorter"])
def test_corrupt_remote_copy_raises_naming_the_shard(tmp_path, remote, damage):
    store, specs, _ = remote([4000])
    name, size, checksum = specs[0]
    if damage == "checksum":
        checksum = "sha256:" + "0" * 64
    elif damage == "longer":
        size -= 10  # the store has more bytes than the manifest says
    else:
        size += 10
    cache = ShardCache(config(tmp_path, 100_000), store)
    with pytest.raises(CorruptShard, match="shard-000000.tar"):
        cache.fetch(name, size, checksum)
    assert cached_names(tmp_path / "cache") == set()
    assert os.listdir(tmp_path / "cache" / "tmp") == []


def test_a_cache_directory_that_cannot_be_used_is_a_clear_error(tmp_path, remote):
    """Under a file, or in /proc: a ConfigError naming the directory and the flag to change,
    at the first fetch (it was a bare NotADirectoryError or FileNotFoundError traceback)."""
    store, specs, _ = remote([1000])
    (tmp_path / "a-file").write_bytes(b"")
    for cache_dir in (tmp_path / "a-file" / "cache", Path("/proc/dlstore-cache")):
        cache = ShardCache(CacheConfig(str(cache_dir), "1MB", prefetch=0), store)
        with pytest.raises(ConfigError, match=f"cannot use {cache_dir} as the cache directory.*--cache-dir"):
            cache.fetch(*specs[0])
        cache.close()


def test_corrupt_cached_copy_is_replaced(tmp_path, remote):
    store, specs, contents = remote([4000])
    name = specs[0][0]
    cache = ShardCache(config(tmp_path, 100_000), store)
    path = cache.fetch(*specs[0])
    with open(path, "ab") as file:
        file.write(b"junk")  # wrong size: found on every access
    assert read(cache.fetch(*specs[0])) == contents[name]
    with open(path, "r+b") as file:
        file.write(b"\0" * 16)  # same size: found when asked to recheck
    assert read(cache.fetch(*specs[0], recheck=True)) == contents[name]
    assert cache.stats.corrupt_replaced == 2
    assert store.downloads()[name] == 3


def _recheck_counting_hashes(cache_config, store, spec, start, results) -> None:
    """In a forked process: wait for the others, recheck `spec`, report (ok, whole-shard hashes)."""
    import dlstore.cache.fetcher as fetcher

    hashes, digest = [0], fetcher.file_digest

    def counting(path, algo):
        hashes[0] += 1
        return digest(path, algo)

    fetcher.file_digest = counting
    try:
        start.wait()
        path = ShardCache(cache_config, store).fetch(*spec, recheck=True)
        results.put((read(path) == read(os.path.join(store.root, spec[0])), hashes[0]))
    except Exception as exc:
        results.put((f"{type(exc).__name__}: {exc}", hashes[0]))


def test_readers_rechecking_one_damaged_copy_at_once_replace_it_once_without_hashing_in_rounds(tmp_path, remote):
    """Every reader of a damaged shard rechecks it at the same time. Each found it bad under
    a shared lock; had it gone on to hash it again under a shared lock while waiting for the
    exclusive one, each one's hash would refuse the others' exclusive lock, round after round
    (4 processes on a 32 MB shard hashed it 10-20 times each, and 8 on 200 MB ran out of time
    with an error blaming a download). Now each waits for the exclusive lock: one download,
    and a few hashes each."""
    store, specs, contents = remote([32 * 2**20], chunk_size=2**20)
    cache_config = config(tmp_path, 10**9, wait_timeout_s=120)
    path = ShardCache(cache_config, store).fetch(*specs[0])
    gets = store.downloads()[specs[0][0]]  # one download: its ranged GETs
    with open(path, "r+b") as file:
        file.seek(12345)
        file.write(b"\0" * 16)  # damaged in place: the same size, found by a recheck
    start, results = FORK.Barrier(4), FORK.Queue()
    workers = [
        FORK.Process(target=_recheck_counting_hashes, args=(cache_config, store, specs[0], start, results))
        for _ in range(4)
    ]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=300) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
    assert [ok for ok, _ in outcomes] == [True] * 4, outcomes
    assert max(hashes for _, hashes in outcomes) <= 2, outcomes  # SH; and EX for the one that replaces it
    assert store.downloads()[specs[0][0]] == 2 * gets  # the first download, and one replacement for all four
    assert read(path) == contents[specs[0][0]]


def test_xxh3_checksums_are_verified_as_sha256_ones_are(tmp_path, remote):
    """The default of `dlstore convert`: a right XXH3-128 fetches, a wrong one is `CorruptShard`
    with nothing published, and a recheck of a cached copy damaged in place replaces it."""
    store, specs, contents = remote([300_000, 4000])
    (name, size, _), (other, other_size, _) = specs
    checksum = checksum_of(contents[name], "xxh3_128")
    cache = ShardCache(config(tmp_path, 1_000_000), store)
    path = cache.fetch(name, size, checksum)
    assert read(path) == contents[name]
    with open(path, "r+b") as file:
        file.write(b"\0" * 16)
    assert read(cache.fetch(name, size, checksum, recheck=True)) == contents[name]
    assert cache.stats.corrupt_replaced == 1
    wrong = checksum_of(contents[name], "xxh3_128")  # another shard's
    with pytest.raises(CorruptShard, match="shard-000001.tar"):
        cache.fetch(other, other_size, wrong)
    assert cached_names(tmp_path / "cache") == {name}
    assert os.listdir(tmp_path / "cache" / "tmp") == []


def test_unverified_checksum_format_is_a_config_error(tmp_path, remote):
    store, specs, _ = remote([100])
    cache = ShardCache(config(tmp_path, 100_000), store)
    with pytest.raises(ConfigError, match="algo:hexdigest"):
        cache.fetch(specs[0][0], 100, "deadbeef")
    with pytest.raises(ConfigError, match="unknown hash"):
        cache.fetch(specs[0][0], 100, "nosuchhash:00")


# -- partial entries: a run of samples of a boundary shard ----------------------------------------------
class RangeRecordingStore(LocalStore):
    """A local store that records the byte range of every GET."""

    def __init__(self, url: str):
        super().__init__(url, StoreConfig(chunk_size=1024))
        self.ranges: list[tuple[str, int, int | None]] = []

    def _read(self, key, start, end):
        self.ranges.append((key, start, end))
        yield from super()._read(key, start, end)


def cached_entries(cache_dir) -> set[str]:
    """The names of the cached entries, partial entries' keys (`#samples=a-b`) unquoted."""
    return {unquote(name) for name in cached_names(cache_dir)}


def make_indexed_shard(root, samples=8, seed=0) -> tuple[str, bytes, SampleIndex]:
    """A real tar shard under `root` and its version 2 sample index (digests of each sample's bytes)."""
    rng = random.Random(seed)
    buffer = io.BytesIO()
    writer = TarShardWriter(buffer)
    for i in range(samples):
        writer.write(f"{i:06d}", {"bin": rng.randbytes(700 + 97 * i), "cls": b"%d" % i})
    index = writer.close()
    data = buffer.getvalue()
    index = index.with_sample_digests(
        sample_digest(data[index.offsets[i] : index.offsets[i + 1]]) for i in range(samples)
    )
    os.makedirs(os.path.join(root, "train"), exist_ok=True)
    with open(os.path.join(root, "train", "shard-000000.tar"), "wb") as file:
        file.write(data)
    return "train/shard-000000.tar", data, index


def test_partial_entry_fetches_only_its_samples_bytes_and_reads_them(tmp_path):
    name, data, index = make_indexed_shard(tmp_path / "remote")
    store = RangeRecordingStore(str(tmp_path / "remote"))
    cache = ShardCache(config(tmp_path, 100_000), store)
    part = SampleRange.of_index(name, index, 2, 6)
    start, end = int(index.offsets[2]), int(index.offsets[6])
    with cache.hold(*part.spec) as path:
        assert read(path) == data[start:end]
        with open(path, "rb") as file:
            assert read_sample_from_file(file, part.span(3))["cls"] == b"3"
    # Exactly the range's bytes were asked for (no probe byte past it), and counted as fetched.
    assert store.ranges and all(key == name and start <= a and b <= end for key, a, b in store.ranges)
    assert sum(b - a for _, a, b in store.ranges) == end - start == cache.stats.bytes_fetched
    assert cached_entries(tmp_path / "cache") == {part.key}
    store.ranges.clear()
    assert read(cache.fetch(*part.spec)) == data[start:end] and store.ranges == []  # a hit
    assert cache.usage() == end - start + STATS_FILE_BYTES


def test_partial_entry_with_a_corrupt_byte_raises_naming_the_shard_and_publishes_nothing(tmp_path):
    name, data, index = make_indexed_shard(tmp_path / "remote")
    store = RangeRecordingStore(str(tmp_path / "remote"))
    part = SampleRange.of_index(name, index, 2, 6)
    damaged = bytearray(data)
    damaged[int(index.offsets[4]) + 600] ^= 1  # inside sample 4's member data
    (tmp_path / "remote" / name).write_bytes(bytes(damaged))
    cache = ShardCache(config(tmp_path, 100_000), store)
    with pytest.raises(CorruptShard, match=r"shard-000000\.tar.*samples \[4\]"):
        cache.fetch(*part.spec)
    assert cached_names(tmp_path / "cache") == set()
    assert os.listdir(tmp_path / "cache" / "tmp") == []
    # Damage outside the range is not this entry's concern.
    outside = SampleRange.of_index(name, index, 5, 8)
    assert read(cache.fetch(*outside.spec)) == data[int(index.offsets[5]) : int(index.offsets[8])]


def test_partial_entry_is_rechecked_counted_and_evicted_like_a_shard(tmp_path):
    name, data, index = make_indexed_shard(tmp_path / "remote")
    store = RangeRecordingStore(str(tmp_path / "remote"))
    first, second = SampleRange.of_index(name, index, 0, 4), SampleRange.of_index(name, index, 4, 8)
    limit = max(first.size, second.size) + STATS_FILE_BYTES + 100  # room for one at a time
    cache = ShardCache(config(tmp_path, limit), store)
    path = cache.fetch(*first.spec)
    with open(path, "r+b") as file:
        file.seek(700)
        file.write(b"\0" * 16)  # same size: found when asked to recheck, through the digests
    assert read(cache.fetch(*first.spec, recheck=True)) == data[: first.size]
    assert cache.stats.corrupt_replaced == 1
    cache.fetch(*second.spec)
    assert cached_entries(tmp_path / "cache") == {second.key} and cache.stats.evictions == 1
    assert disk_bytes(tmp_path / "cache") <= limit


def _hold_range(cache, part, result_path):
    with cache.hold(*part.spec) as path, open(result_path, "wb") as out:
        out.write(hashlib.sha256(read(path)).digest())


def test_processes_share_one_download_of_a_partial_entry(tmp_path):
    name, data, index = make_indexed_shard(tmp_path / "remote", samples=64)
    store = RecordingStore(str(tmp_path / "remote"), log_path=str(tmp_path / "gets.log"), delay_s=0.002)
    part = SampleRange.of_index(name, index, 10, 50)
    cache = ShardCache(config(tmp_path, 10**7), store)
    procs = [FORK.Process(target=_hold_range, args=(cache, part, tmp_path / f"r{i}")) for i in range(3)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    want = hashlib.sha256(data[part.byte_start : part.byte_start + part.size]).digest()
    assert [(tmp_path / f"r{i}").read_bytes() for i in range(3)] == [want] * 3
    assert store.downloads()[name] == 1


# -- prefetch ------------------------------------------------------------------------------------------
def test_prefetch_runs_ahead_within_the_limit(tmp_path, remote):
    store, specs, contents = remote([6000] * 8, delay_s=0.003)  # ~20 ms per shard
    limit = STATS_FILE_BYTES + 3 * 6000  # the shard being read + a window of 2
    cache = ShardCache(config(tmp_path, limit, prefetch=2, wait_timeout_s=10), store)
    with DiskSampler(tmp_path / "cache") as sampler:
        cache.prefetch(specs)
        wait_for(lambda: cached_names(tmp_path / "cache") == {specs[0][0], specs[1][0]})
        time.sleep(0.1)
        assert specs[2][0] not in cached_names(tmp_path / "cache")  # the window is 2 shards
        for spec in specs:
            with cache.hold(*spec) as path:
                assert read(path) == contents[spec[0]]
                time.sleep(0.08)  # "reading": the thread fetches the next ones meanwhile
    cache.close()
    assert sampler.max <= limit
    assert store.downloads() == {name: 1 for name, _, _ in specs}
    assert cache.stats.hits >= 5  # the reader found most shards already there


def test_a_prefetch_list_with_its_own_depth_is_kept_cached_to_that_depth(tmp_path, remote):
    """`prefetch(specs, depth=n)`: the first n shards of the list, whatever the config's
    window; for readers in other processes (worker processes), whose reads never move this
    process's window on. The same list with another depth takes the new one."""
    store, specs, _ = remote([6000] * 6)
    cache = ShardCache(config(tmp_path, 1_000_000, prefetch=2, wait_timeout_s=10), store)
    try:
        cache.prefetch(specs)
        wait_for(lambda: cached_names(tmp_path / "cache") == {specs[0][0], specs[1][0]})
        time.sleep(0.1)
        assert len(cached_names(tmp_path / "cache")) == 2  # the config's window: no read, no more
        cache.prefetch(specs, depth=5)
        wait_for(lambda: cached_names(tmp_path / "cache") == {name for name, _, _ in specs[:5]})
        time.sleep(0.1)
        assert specs[5][0] not in cached_names(tmp_path / "cache")
    finally:
        cache.close()


def test_a_prefetch_lead_is_fetched_before_the_shards_after_it(tmp_path):
    """`prefetch(specs, depth, lead=2)`: the list's first two shards (in use: readers wait for
    them) are in before any later one starts, though 4 could download at once."""
    specs, _ = make_remote(tmp_path / "remote", [6000] * 5)
    cached_at_start: dict[str, set[str]] = {}

    class Watching(RecordingStore):
        def _read(self, key, start, end):
            cached_at_start.setdefault(key, cached_names(tmp_path / "cache"))
            yield from super()._read(key, start, end)

    store = Watching(str(tmp_path / "remote"), delay_s=0.003)  # ~20 ms per shard
    settings = dict(prefetch=2, shards_in_flight=4, parts_in_flight=1, wait_timeout_s=10)
    cache = ShardCache(config(tmp_path, 1_000_000, **settings), store)
    try:
        cache.prefetch(specs, depth=5, lead=2)
        wait_for(lambda: len(cached_names(tmp_path / "cache")) == 5)
        lead = {specs[0][0], specs[1][0]}
        for name, _, _ in specs[2:]:
            assert lead <= cached_at_start[name], name
        assert not cached_at_start[specs[0][0]] & lead and not cached_at_start[specs[1][0]] & lead
    finally:
        cache.close()


def test_a_prefetch_lead_is_the_lists_first_shards_not_the_next_after_the_readers():
    """The lead holds back the shards after it only while the readers have not passed it:
    once they read the list's second shard (lead 1), the prefetch takes the shards after it
    side by side, instead of one at a time behind the next shard the readers would reach."""
    specs = [ShardSpec(f"s{i}.tar", 1000, None) for i in range(5)]
    rt = Runtime()
    rt.upcoming, rt.depth, rt.lead = specs, 5, 1
    caps = Concurrency(shards=4, parts=1)
    assert _next_prefetch(rt, rt.depth, caps)[0] is specs[0]  # the lead first,
    rt.active.add("s0.tar")
    assert _next_prefetch(rt, rt.depth, caps) is None  # alone
    rt.active.clear()
    rt.done.add("s0.tar")
    rt.position = 1  # a reader reached s1 (`advance_window`)
    taken = []
    while (job := _next_prefetch(rt, rt.depth, caps)) is not None:
        taken.append(job[0].name)
        rt.active.add(job[0].name)
    assert taken == ["s1.tar", "s2.tar", "s3.tar", "s4.tar"]


def _prefetch_takes(rt: Runtime, caps: Concurrency) -> list[str]:
    """The shards the prefetch threads would start now, in order (none of them finishes)."""
    names = []
    while (job := _next_prefetch(rt, rt.depth, caps)) is not None:
        names.append(job[0].name)
        rt.active.add(job[0].name)
    rt.active.clear()
    return names


def test_a_reader_reaching_one_shard_in_use_passes_none_of_the_others():
    """A batch reads the shards in use (the lead) all at once and in any order (a reader takes
    its shards by index, the list is by first need): a reader that reaches the lead's second
    shard first leaves the first to the prefetch, before any shard after the lead. (Moving on
    past it gave its bandwidth to later shards: a cold first batch waited for its second shard
    until its first had come in: 0.81 s instead of 0.45 s at 40 MB/s, 24 shards, 1 thread.)"""
    specs = [ShardSpec(f"s{i}.tar", 1000, None) for i in range(5)]
    rt = Runtime()
    rt.upcoming, rt.depth, rt.lead = specs, 5, 2
    caps = Concurrency(shards=4, parts=1)
    window = advance_window(rt, "s1.tar", 5)  # the reader fetches s1 itself
    assert {"s0.tar", "s1.tar"} <= window  # both spared by the reader's evictions
    assert _prefetch_takes(rt, caps) == ["s0.tar"]  # the lead's other shard, alone
    rt.done.add("s0.tar")
    assert _prefetch_takes(rt, caps) == ["s2.tar", "s3.tar", "s4.tar"]  # the lead is in: the rest
    advance_window(rt, "s3.tar", 5)  # past the lead, a reader moves the window on as before
    assert rt.position == 4


def test_the_window_counts_from_the_leads_end_once_the_readers_are_in_it():
    """A window no deeper than the lead (a cache without room for two shuffle windows: depth =
    `prefetch_shards`, lead = the batch's shards) still prefetches `depth` shards after the
    lead while the readers are in it; and a reader of a later batch that reaches a shard after
    the lead before the lead is in passes none of the lead's shards either."""
    specs = [ShardSpec(f"s{i}.tar", 1000, None) for i in range(7)]
    rt = Runtime()
    rt.upcoming, rt.depth, rt.lead = specs, 2, 2
    caps = Concurrency(shards=4, parts=1)
    assert _prefetch_takes(rt, caps) == ["s0.tar", "s1.tar"]
    advance_window(rt, "s3.tar", 2)  # a reader of a batch queued behind, before the lead is in
    assert rt.position == 0 and _prefetch_takes(rt, caps) == ["s0.tar", "s1.tar"]
    for name in ("s0.tar", "s1.tar"):  # the readers reach the lead
        advance_window(rt, name, 2)
    assert _prefetch_takes(rt, caps) == ["s2.tar"]  # s3 is its reader's: then 2 past the lead
    advance_window(rt, "s4.tar", 2)  # the lead is in: the window moves on past s4
    assert rt.position == 5 and _prefetch_takes(rt, caps) == ["s5.tar", "s6.tar"]


def test_prefetch_error_is_raised_when_the_reader_reaches_the_shard(tmp_path, remote):
    store, specs, contents = remote([1000])
    cache = ShardCache(config(tmp_path, 100_000, prefetch=2), store)
    cache.prefetch([("train/missing.tar", 1000, None), specs[0]])
    # The prefetch went past the failure: two may run at once, so the shard after it can be
    # cached before the missing one was even asked for.
    wait_for(
        lambda: specs[0][0] in cached_names(tmp_path / "cache") and store.downloads().get("train/missing.tar") == 1
    )
    with pytest.raises(NotFound):
        cache.fetch("train/missing.tar", 1000)
    assert store.downloads()["train/missing.tar"] == 1  # the prefetch's error, not a new attempt
    assert read(cache.fetch(*specs[0])) == contents[specs[0][0]]
    cache.close()


def test_a_prefetch_error_is_not_raised_for_a_shard_the_cache_holds_after_all(tmp_path, remote):
    """The prefetch of a shard failed (a blip), and meanwhile a reader (here another process's
    cache) fetched it: the kept error would end a run that has already recovered, so a hold of
    the cached shard takes it without raising."""
    _, specs, contents = remote([1000, 1000])

    class FailsOnce(LocalStore):
        failed = False

        def _read(self, key, start, end):
            if key == specs[0][0] and not FailsOnce.failed:
                FailsOnce.failed = True
                raise TransientError("connection reset by peer")
            yield from super()._read(key, start, end)

    no_retries = StoreConfig(retry=RetryConfig(max_attempts=1, deadline_s=1))
    cache = ShardCache(config(tmp_path, 100_000, prefetch=2), FailsOnce(str(tmp_path / "remote"), no_retries))
    cache.prefetch([specs[0], specs[1]])
    wait_for(lambda: specs[1][0] in cached_names(tmp_path / "cache"))  # the thread went past the failure
    assert specs[0][0] not in cached_names(tmp_path / "cache")
    other = ShardCache(config(tmp_path, 100_000), LocalStore(str(tmp_path / "remote")))
    other.fetch(*specs[0])  # another reader of the node fetched it
    with cache.hold(*specs[0]) as path:
        assert read(path) == contents[specs[0][0]]
    cache.close()
    other.close()


def test_prefetch_of_a_corrupt_shard_is_raised_to_the_reader(tmp_path, remote):
    store, specs, _ = remote([1000, 1000])
    cache = ShardCache(config(tmp_path, 100_000, prefetch=2), store)
    bad = (specs[0][0], specs[0][1], "sha256:" + "1" * 64)
    cache.prefetch([bad, specs[1]])
    wait_for(lambda: specs[1][0] in cached_names(tmp_path / "cache"))
    with pytest.raises(CorruptShard, match="shard-000000.tar"), cache.hold(*bad):
        pass
    cache.close()


# -- CLI -------------------------------------------------------------------------------------------
def test_cli_stats_and_clear(tmp_path, remote, capsys):
    store, specs, _ = remote([3000, 3000, 3000])
    cache_dir = str(tmp_path / "cache")
    cache = ShardCache(config(tmp_path, "1MB"), store)
    for spec in specs + specs:
        cache.fetch(*spec)
    cache.flush_stats()

    assert main(["cache", "stats", cache_dir, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["files"] == 3 and report["limit_bytes"] == 10**6
    assert report["bytes"] == 3 * 3000 + STATS_FILE_BYTES
    assert report["totals"]["hits"] == 3 and report["totals"]["misses"] == 3
    assert report["totals"]["bytes_fetched"] == 9000

    assert main(["cache", "stats", cache_dir]) == 0
    out = capsys.readouterr().out
    assert "limit" in out and "1.0 MB" in out and "50.0%" in out

    with cache.hold(*specs[1]):
        assert main(["cache", "clear", cache_dir]) == 0
        captured = capsys.readouterr()
        assert "removed 2 shards" in captured.out and "kept 1 shards" in captured.err
    assert cached_names(cache_dir) == {specs[1][0]}

    assert main(["cache", "clear", cache_dir, "--reset-stats"]) == 0
    capsys.readouterr()
    assert cached_names(cache_dir) == set()
    assert cache_report(cache_dir).totals.hits == 0

    assert main(["cache", "stats", str(tmp_path / "nothing-here")]) == 2
    assert "not a dlstore cache" in capsys.readouterr().err


# -- per-epoch counters ----------------------------------------------------------------------------
def _read_in_epoch(cache, specs, epoch):
    cache.set_epoch(epoch)
    for spec in specs:
        cache.fetch(*spec)
    cache.close()


def test_counters_per_epoch_are_summed_over_processes(tmp_path, remote):
    store, specs, _ = remote([3000, 4000, 5000])
    cache = ShardCache(config(tmp_path, "1MB"), store)
    cache.fetch(*specs[0])  # before any epoch is said: in the totals only
    cache.set_epoch(0)
    for spec in specs:
        cache.fetch(*spec)
    cache.set_epoch(1)
    cache.fetch(*specs[1])
    cache.flush_stats()
    # Another process in epoch 1 finds one shard cached and fetches one the first did not have.
    extra = remote([3000, 4000, 5000, 6000])[1]
    child = FORK.Process(target=_read_in_epoch, args=(cache, [extra[0], extra[3]], 1))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    cache.close()

    report = cache_report(tmp_path / "cache")
    assert report.totals.misses == 4 and report.totals.bytes_fetched == 18000 and report.totals.hits == 3
    assert list(report.epochs) == [0, 1]
    assert dataclasses.astuple(report.epochs[0]) == (1, 2, 9000)  # (hits, misses, bytes fetched)
    assert dataclasses.astuple(report.epochs[1]) == (2, 1, 6000)


def test_prefetched_shards_count_under_the_epoch_of_the_prefetch_list(tmp_path, remote):
    """Near an epoch's end the loader starts the next epoch's batches while the prefetch is
    still fetching this epoch's last shards: those count under the epoch that listed them,
    and the shards of a later list under its epoch (the prefetch threads outlive a list)."""
    store, specs, _ = remote([3000, 4000, 5000, 6000])
    cache = ShardCache(config(tmp_path, "1MB", prefetch=2), store)
    cache.set_epoch(4)
    cache.prefetch(specs[1:3])
    cache.set_epoch(5)  # the next epoch's first request, before the prefetch is done
    wait_for(lambda: cached_names(tmp_path / "cache") >= {specs[1][0], specs[2][0]})
    cache.fetch(*specs[0])  # not on the list: the epoch read now
    cache.prefetch(specs[3:])  # epoch 5's list
    wait_for(lambda: specs[3][0] in cached_names(tmp_path / "cache"))
    cache.close()
    epochs = cache_report(tmp_path / "cache").epochs
    assert dataclasses.astuple(epochs[4]) == (0, 2, 9000)
    assert dataclasses.astuple(epochs[5]) == (0, 2, 9000)


def test_a_reader_counts_a_shard_under_the_epoch_whose_batch_named_it(tmp_path, remote):
    """A loader building the next epoch's first batches while this epoch's last ones are
    still read: each batch's shards count under its own epoch."""
    store, specs, _ = remote([3000, 4000, 5000])
    cache = ShardCache(config(tmp_path, "1MB"), store)
    cache.set_epoch(6, [specs[0][0]])  # the epoch's last batch
    cache.set_epoch(7, [specs[1][0]])  # the next epoch's first batch, asked for before the last is read
    for spec in specs:
        cache.fetch(*spec)  # shard 2, named by no batch: the epoch read now
    cache.close()
    epochs = cache_report(tmp_path / "cache").epochs
    assert dataclasses.astuple(epochs[6]) == (0, 1, 3000)
    assert dataclasses.astuple(epochs[7]) == (0, 2, 9000)


def test_stats_file_keeps_the_latest_epochs_within_its_fixed_size(tmp_path, remote):
    store, specs, _ = remote([3000])
    cache = ShardCache(config(tmp_path, "1TB"), store)
    for epoch in range(40):
        cache.set_epoch(10**6 + epoch)
        cache.fetch(*specs[0])
        cache.flush_stats()
    cache.close()
    assert os.path.getsize(tmp_path / "cache" / "stats.json") == STATS_FILE_BYTES
    epochs = cache_report(tmp_path / "cache").epochs
    assert list(epochs) == [10**6 + e for e in range(24, 40)]
    assert all(dataclasses.astuple(stats) == (1, 0, 0) for stats in epochs.values())


def test_max_connections_is_the_most_parts_in_flight_at_once(tmp_path, remote):
    store, specs, _ = remote([64 * 1024, 64 * 1024], delay_s=0.002)
    cache = ShardCache(config(tmp_path, "1MB", part_size=16 * 1024, parts_in_flight=4), store)
    cache.fetch(*specs[0])
    assert 1 <= cache.stats.max_connections <= 4
    cache.close()
    assert cache_report(tmp_path / "cache").totals.max_connections == cache.stats.max_connections


def test_cli_stats_per_epoch(tmp_path, remote, capsys):
    store, specs, _ = remote([3000, 3000, 3000])
    cache_dir = str(tmp_path / "cache")
    cache = ShardCache(config(tmp_path, "1MB"), store)
    for epoch, read_specs in enumerate((specs[:2], specs)):
        cache.set_epoch(epoch)
        for spec in read_specs:
            cache.fetch(*spec)
    cache.close()

    assert main(["cache", "stats", cache_dir, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["epochs"] == {
        "0": {"hits": 0, "misses": 2, "bytes_fetched": 6000},
        "1": {"hits": 2, "misses": 1, "bytes_fetched": 3000},
    }
    assert main(["cache", "stats", cache_dir]) == 0
    out = capsys.readouterr().out
    lines = out[out.index("per epoch") :].splitlines()
    assert lines[2].split() == ["0", "6.0", "KB", "2", "0"]
    assert lines[3].split() == ["1", "3.0", "KB", "1", "2"]

    assert main(["cache", "clear", cache_dir, "--reset-stats"]) == 0
    assert cache_report(cache_dir).epochs == {}
