"""How much the cache's prefetch downloads at once (issue 12): shards in flight and connections
per prefetched shard, paced by the rate the readers consume and the rate one connection gets,
within the caps of the config; a reader's shard always at full width.

The pacing arithmetic is checked on its own; the engine's narrowing and widening, and the
prefetch over a real local `file://` store, with reads counted as they run. Times are never
asserted: the behavioural test only makes the link far faster than its readers.
"""

from __future__ import annotations

import collections
import contextlib
import os
import subprocess
import sys
import threading
import time

import pytest

from dlstore.cache import ShardCache
from dlstore.cache.engine import DownloadEngine
from dlstore.cache.pace import Concurrency, PrefetchPace
from dlstore.cache.prefetch import start_prefetch, stop_prefetch
from dlstore.cache.runtime import Runtime
from dlstore.cache.spec import ShardSpec
from tests.cache.test_download import PartStore
from tests.cache.test_shard_cache import config, make_remote, read

MIB = 2**20
CAPS = Concurrency(shards=4, parts=8)


def readers_at(rate: float) -> PrefetchPace:
    """A pace whose readers have reached 100 MB shards at `rate` bytes per second."""
    pace = PrefetchPace()
    for step, name in enumerate("abcd"):
        pace.reached(name, 100_000_000, step * 100_000_000 / rate)
    return pace


# -- the arithmetic --------------------------------------------------------------------------------
def test_a_fast_link_and_slow_readers_need_few_connections():
    pace = readers_at(10e6)
    assert pace.concurrency(CAPS, connection_rate=100e6) == (1, 1)  # 2 x 10 MB/s on one connection
    assert pace.concurrency(CAPS, connection_rate=4e6) == (1, 5)  # 20 MB/s: 5 connections, one shard


def test_a_slow_link_gets_full_width_and_more_shards_before_narrow_ones():
    pace = readers_at(100e6)
    assert pace.concurrency(CAPS, connection_rate=10e6) == (3, 7)  # 20 connections: 3 shards, not 4 of 5
    assert pace.concurrency(CAPS, connection_rate=1e6) == CAPS  # 200 wanted: the caps
    assert readers_at(10e6).concurrency(CAPS, connection_rate=2.2e6) == (2, 5)  # 10 on 2 shards


def test_until_the_rates_are_known_the_prefetch_uses_its_caps():
    assert PrefetchPace().concurrency(CAPS, connection_rate=50e6, shard_rate=400e6) == CAPS  # no reader measured
    pace = readers_at(100e6)
    assert pace.concurrency(CAPS, connection_rate=None) == CAPS  # no connection measured
    # No connection measured, a whole shard's download has: shards paced by it, each at full width.
    assert pace.concurrency(CAPS, connection_rate=None, shard_rate=320e6) == (1, 8)
    assert pace.concurrency(CAPS, connection_rate=0.0, shard_rate=80e6) == (3, 8)


def test_the_pace_widens_while_readers_wait_and_settles_on_a_shared_link():
    """Readers that wait reach shards as fast as the prefetch's connections bring them in:
    the aim (twice that) widens the prefetch step by step up to the caps. On a link its
    connections share, fewer of them each get more: the width shrinks to what the readers
    need, monotonically, and stays there."""
    connections = 1
    widths = []
    for _ in range(8):  # every connection 10 MB/s, readers limited by the downloads
        width = readers_at(connections * 10e6).concurrency(CAPS, connection_rate=10e6)
        connections = width.shards * width.parts
        widths.append(connections)
    assert widths[:4] == [2, 4, 8, 16] and widths[-1] == 32  # shards x parts: the caps
    assert widths == sorted(widths)

    link, connection_limit = 400e6, 50e6  # 400 MB/s shared; one connection gets 50 MB/s at most
    connections, widths = 32, []
    for _ in range(12):  # readers take 60 MB/s: 3 connections of 50 MB/s bring in twice that
        width = readers_at(60e6).concurrency(CAPS, connection_rate=min(connection_limit, link / connections))
        connections = width.shards * width.parts
        widths.append(connections)
    assert widths == sorted(widths, reverse=True) and widths[-4:] == [3] * 4


def test_lists_that_move_on_tell_the_pace_how_far_the_readers_are():
    """With worker processes the readers hold shards in other processes: the lists the loader
    gives (each led by the shards of the batch just requested) tell this process's pace."""
    rt = Runtime()
    specs = [ShardSpec(f"shard-{i:02d}.tar", 10_000_000) for i in range(16)]
    caps = Concurrency(shards=1, parts=1)
    try:
        start_prefetch(rt, specs[:6], depth=4, fetch=lambda spec, sooner, priority: None, caps=caps)
        start_prefetch(rt, specs[:6], depth=4, fetch=lambda spec, sooner, priority: None, caps=caps)  # the same list
        assert rt.pace.consumed_rate() is None
        for step in range(1, 5):
            time.sleep(0.05)
            start_prefetch(
                rt, specs[2 * step : 2 * step + 6], depth=4, fetch=lambda spec, sooner, priority: None, caps=caps
            )
        rate = rt.pace.consumed_rate()
        # 2 shards of 10 MB every 50+ ms: ~400 MB/s (the estimate counts the first step's shards too)
        assert rate is not None and 20e6 / 0.2 < rate < 2 * 20e6 / 0.05
    finally:
        stop_prefetch(rt, 5.0)


# -- the engine ------------------------------------------------------------------------------------
def test_a_prefetch_runs_at_most_background_parts_until_a_reader_hurries_it(tmp_path):
    """A prefetch (priority above 0) runs `background_parts` parts at once; a shard a reader
    waits for twice its `parts_in_flight`; `hurry` makes the prefetch a reader's, as wide."""
    specs, contents = make_remote(tmp_path / "remote", [40_000, 40_000])
    store = PartStore(str(tmp_path / "remote"))
    store.gate.clear()  # every read started stays running: reads started = reads running
    engine = DownloadEngine(connections=16)
    engine.background_parts = 1
    files = [os.open(tmp_path / f"out-{i}", os.O_RDWR | os.O_CREAT) for i in range(2)]
    (prefetched, _, _), (wanted, _, _) = specs
    try:
        background = engine.start(store, prefetched, files[0], 40_000, priority=1, parts_in_flight=4, part_size=4096)
        urgent = engine.start(store, wanted, files[1], 40_000, priority=0, parts_in_flight=4, part_size=4096)
        _wait_for(lambda: store.running >= 9)
        assert (len(store.reads_of(prefetched)), len(store.reads_of(wanted))) == (1, 8)
        engine.hurry(prefetched)
        _wait_for(lambda: len(store.reads_of(prefetched)) >= 8)
        assert (len(store.reads_of(prefetched)), len(store.reads_of(wanted))) == (8, 8)
        store.gate.set()
        urgent.wait()
        background.wait()
        for fd, (name, size, _) in zip(files, specs):
            assert os.pread(fd, size, 0) == contents[name]
    finally:
        store.gate.set()
        for fd in files:
            os.close(fd)
        engine.close()


@contextlib.contextmanager
def _gated_prefetch(tmp_path, background_parts: int, size: int = 40_000, priority: int = 1):
    """An engine narrowed to `background_parts` and a one-object store whose reads stay
    running until its gate opens (reads started = reads running); yields (engine, the object's
    name, its reads so far, start), `start()` beginning its download at `priority` (a
    prefetch by default), 4 parts wide. On leaving,
    the gate opens and the download must bring the object whole."""
    specs, contents = make_remote(tmp_path / "remote", [size])
    ((name, size, _),) = specs
    store = PartStore(str(tmp_path / "remote"))
    store.gate.clear()
    engine = DownloadEngine(connections=8)
    engine.set_background_parts(background_parts)
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
    downloads = []

    def start():
        downloads.append(engine.start(store, name, fd, size, priority=priority, parts_in_flight=4, part_size=4096))

    try:
        yield engine, name, lambda: len(store.reads_of(name)), start
        store.gate.set()
        for download in downloads:
            download.wait()
        assert os.pread(fd, size, 0) == contents[name]
    finally:
        store.gate.set()
        os.close(fd)
        engine.close()


def test_a_prefetch_hurried_before_its_download_begins_begins_at_full_width(tmp_path):
    """A reader can reach a prefetched shard while its prefetch still reserves room, before
    the download exists: the download then begins as a reader's (first, twice as wide as
    its `parts_in_flight`)."""
    with _gated_prefetch(tmp_path, background_parts=1) as (engine, name, reads, start):
        engine.hurry(name)  # nothing to hurry yet
        start()
        _wait_for(lambda: reads() >= 8)
        time.sleep(0.1)
        assert reads() == 8


def test_a_readers_shard_is_twice_as_wide_only_until_the_link_is_measured(tmp_path):
    """The doubled width of a shard readers wait for is a cold start's: once a part has
    measured the link, such a shard runs its `parts_in_flight`."""
    with _gated_prefetch(tmp_path, background_parts=1, size=1_000_000, priority=0) as (engine, _, reads, start):
        # As a finished part would: a round trip so short that the parts stay small (64 KiB: 16 of them)
        engine.link.add(first_byte_s=1e-5, nbytes=4 * 2**20, transfer_s=0.1)
        start()
        _wait_for(lambda: reads() >= 4)
        time.sleep(0.1)
        assert reads() == 4


def test_a_hurry_holds_for_one_prefetch_of_the_object_only(tmp_path):
    """Once the prefetch a reader hurried is over (`forget_hurry`), a later prefetch of the
    same object (say next epoch, after an eviction) runs as narrow as the pace says."""
    with _gated_prefetch(tmp_path, background_parts=1) as (engine, name, reads, start):
        engine.hurry(name)
        engine.forget_hurry(name)
        start()
        _wait_for(lambda: reads() >= 1)
        time.sleep(0.1)
        assert reads() == 1


def test_a_running_prefetch_widens_as_soon_as_the_pace_allows(tmp_path):
    """`set_background_parts` raised while a narrowed prefetch runs (no part has ended yet):
    its other parts start at once."""
    with _gated_prefetch(tmp_path, background_parts=1) as (engine, _, reads, start):
        start()
        _wait_for(lambda: reads() >= 1)
        time.sleep(0.1)
        assert reads() == 1
        engine.set_background_parts(4)
        _wait_for(lambda: reads() >= 4)
        assert reads() == 4


# -- the prefetch over a real store ------------------------------------------------------------------
class PacedStore(PartStore):
    """A local store whose reads move at most 64 MiB/s each (a 64 KiB chunk a millisecond),
    counting the reads of each object running at once."""

    def __init__(self, url: str) -> None:
        super().__init__(url, chunk_size=64 * 1024)
        self.running_of: collections.Counter[str] = collections.Counter()
        self.most_of: collections.Counter[str] = collections.Counter()

    def _read(self, key, start, end):
        with self._lock:
            self.running_of[key] += 1
            self.most_of[key] = max(self.most_of[key], self.running_of[key])
        try:
            for chunk in super()._read(key, start, end):
                time.sleep(0.001)
                yield chunk
        finally:
            with self._lock:
                self.running_of[key] -= 1


@contextlib.contextmanager
def _narrowed_prefetch(tmp_path):
    """Readers taking a 4 MiB shard every 0.6 s (some 7 MB/s) from a link whose connections
    each move up to 64 MiB/s: once both rates are measured, the prefetch fetches each shard
    on one connection, not 4. Yields (cache, the shard the prefetch now fetches on one
    connection, its spec, its bytes, the store), its reads held running until the store's
    gate opens; on leaving, the gate opens and the shard must arrive whole."""
    specs, contents = make_remote(tmp_path / "remote", [4 * MIB] * 10)
    store = PacedStore(str(tmp_path / "remote"))
    settings = dict(prefetch=2, shards_in_flight=2, parts_in_flight=4, part_size=MIB)
    cache = ShardCache(config(tmp_path, 100 * MIB, **settings), store)
    try:
        cache.prefetch(specs[:8])
        for spec in specs[:8]:
            with cache.hold(*spec) as path:
                assert read(path) == contents[spec[0]]
            time.sleep(0.6)
        # Shard 4 on were prefetched once the readers had reached three shards.
        assert [store.most_of[name] for name, _, _ in specs[4:8]] == [1] * 4
        store.gate.clear()  # reads started from here on stay running
        cache.prefetch(specs[8:])
        narrow = specs[8][0]
        _wait_for(lambda: store.running >= 1)
        time.sleep(0.2)  # room for more reads to start, were the prefetch wider
        assert store.running_of[narrow] == 1 and store.running == 1  # one connection, one shard
        yield cache, narrow, specs[8], contents[narrow], store
        store.gate.set()
        with cache.hold(*specs[8]) as path:
            assert read(path) == contents[narrow]
    finally:
        store.gate.set()
        cache.close()


@pytest.mark.slow
def test_a_prefetched_shard_gets_the_connections_its_readers_need_and_full_width_once_waited_for(tmp_path):
    """A prefetched shard that a reader reaches while it is in flight (narrowed to one
    connection by the pace) is widened to all 4."""
    with _narrowed_prefetch(tmp_path) as (cache, narrow, spec, _, store):
        reader = threading.Thread(target=lambda: cache.fetch(*spec))
        reader.start()  # it reaches the shard in flight: widened, as a reader's own fetch is
        _wait_for(lambda: store.running_of[narrow] >= 4)
        assert store.running_of[narrow] == 4
        store.gate.set()
        reader.join(30)


_OTHER_PROCESS_READER = """
import hashlib, sys
from dlstore.cache import CacheConfig, ShardCache
from dlstore.storage import open_store
cache_dir, limit, url, name, size, checksum = sys.argv[1:]
cache = ShardCache(CacheConfig(cache_dir, int(limit), prefetch=0, fsync=False), open_store(url))
with cache.hold(name, int(size), checksum) as path, open(path, "rb") as file:
    digest = hashlib.sha256(file.read()).hexdigest()
sys.exit(0 if "sha256:" + digest == checksum else 3)
"""


@pytest.mark.slow
def test_a_prefetch_is_widened_when_a_reader_of_another_process_waits_for_it(tmp_path):
    """A reader in another process (a DataLoader worker, another rank) waits on the shard's
    lock, not in this process's prefetch: it says so on the shard's `.wanted` lock, and the
    prefetch here widens the download to all 4 connections."""
    with _narrowed_prefetch(tmp_path) as (cache, narrow, spec, _, store):
        reader = subprocess.Popen(
            [sys.executable, "-c", _OTHER_PROCESS_READER, cache.config.cache_dir, str(cache.config.limit_bytes),
             f"file://{tmp_path / 'remote'}", *map(str, spec)],
        )  # fmt: skip
        try:
            _wait_for(lambda: store.running_of[narrow] >= 4, timeout_s=60)
            assert store.running_of[narrow] == 4
            store.gate.set()
            assert reader.wait(60) == 0  # it read the shard the prefetch published
        finally:
            reader.kill()
            reader.wait()


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
