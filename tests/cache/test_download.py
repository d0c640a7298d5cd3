"""The cache's download engine (issue 12): a shard fetched as parallel ranged GETs written
at their offsets, several shards in flight, retries per part that resume from the next
byte, and the verdicts (size, checksum, full disk) a download ends with.

Everything runs on a local `file://` store whose reads can be gated, cut or damaged;
the same behaviour against the real Swift server, through the fault proxy and the WAN
emulator, is in `tests/integration/test_faults.py`. Times are never asserted.
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading
import time

import pytest

import dlstore
from benchmarks.data import write_bench_dataset
from dlstore.cache import CacheConfig, ShardCache
from dlstore.cache.engine import DownloadEngine
from dlstore.cache.pace import PrefetchPace
from dlstore.cache.slots import NodeSlots
from dlstore.config import RetryConfig, StoreConfig
from dlstore.errors import CorruptShard, NotFound, TransientError
from dlstore.storage.local import LocalStore
from dlstore.storage.retry import ProgressRetry
from dlstore.world import World
from tests.cache.test_shard_cache import FORK, _fetch_under_file_size_limit, cached_names, config, make_remote, read

QUICK = RetryConfig(max_attempts=3, initial_backoff_s=0.0, max_backoff_s=0.0, deadline_s=30)


class PartStore(LocalStore):
    """A local store that records every read as (key, start, end), counts reads running at
    once, and can be told to cut, damage or hold back reads."""

    def __init__(self, url: str, chunk_size: int = 1024, retry: RetryConfig = QUICK) -> None:
        super().__init__(url, StoreConfig(chunk_size=chunk_size, retry=retry))
        self.reads: list[tuple[str, int, int | None]] = []
        self.running = 0
        self.most_running = 0
        self.gate = threading.Event()
        self.gate.set()
        self.cut_after: dict[int, list[int]] = {}  # read start -> bytes after which to cut (one per read)
        self.damage_starts: dict[int, int] = {}  # read start -> how many more reads to damage
        self.fail_always: set[int] = set()  # read starts that always fail before a byte
        self._lock = threading.Lock()

    def _read(self, key, start, end):
        with self._lock:
            self.reads.append((key, start, end))
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            cut = self.cut_after.get(start, [None]).pop(0) if self.cut_after.get(start) else None
            damage = self.damage_starts.get(start, 0) > 0
            if damage:
                self.damage_starts[start] -= 1
        try:
            assert self.gate.wait(10)
            if start in self.fail_always:
                raise TransientError(f"{self.url}/{key}: injected failure")
            sent = 0
            for chunk in super()._read(key, start, end):
                if cut is not None and sent + len(chunk) > cut:
                    yield chunk[: cut - sent]
                    raise TransientError(f"short read of {self.url}/{key}")
                sent += len(chunk)
                yield bytes(b ^ 0xFF for b in chunk) if damage else chunk
        finally:
            with self._lock:
                self.running -= 1

    def reads_of(self, key: str) -> list[tuple[int, int | None]]:
        return [(s, e) for k, s, e in self.reads if k == key]


@pytest.fixture
def parts_remote(tmp_path):
    def build(sizes, **kwargs):
        specs, contents = make_remote(tmp_path / "remote", sizes)
        return PartStore(str(tmp_path / "remote"), **kwargs), specs, contents

    return build


def parts_config(tmp_path, limit=10_000_000, **kwargs) -> CacheConfig:
    kwargs.setdefault("part_size", 4096)
    kwargs.setdefault("parts_in_flight", 4)
    return config(tmp_path, limit, **kwargs)


# -- the retry budget --------------------------------------------------------------------------------
def test_progress_restarts_the_retry_budget():
    now = [0.0]
    retry = ProgressRetry(
        RetryConfig(max_attempts=3, initial_backoff_s=0, max_backoff_s=0, deadline_s=10), clock=lambda: now[0]
    )
    error = TransientError("cut")
    for _ in range(50):  # far more failures than attempts, and far longer than the deadline
        now[0] += 9.0
        retry.failed(error, moved=1)
    retry.failed(error, moved=0)
    retry.failed(error, moved=0)
    with pytest.raises(TransientError):
        retry.failed(error, moved=0)  # three attempts in a row without a byte
    retry = ProgressRetry(
        RetryConfig(max_attempts=100, initial_backoff_s=0, max_backoff_s=0, deadline_s=10), clock=lambda: now[0]
    )
    now[0] += 11.0
    with pytest.raises(TransientError):
        retry.failed(error, moved=0)  # no byte within the deadline


def test_progress_is_a_chunk_moved_by_one_attempt_or_by_several():
    """A server that sends a thousand bytes and closes, every time, is no progress: the budget
    runs out (it once held a download for days). Attempts that each move half a chunk are."""
    now = [0.0]
    policy = RetryConfig(max_attempts=5, initial_backoff_s=0, max_backoff_s=0, deadline_s=10)
    retry = ProgressRetry(policy, least=2**20, clock=lambda: now[0])
    with pytest.raises(TransientError):
        for _ in range(5):
            retry.failed(TransientError("cut early"), moved=1000)
    retry = ProgressRetry(policy, least=2**20, clock=lambda: now[0])
    for _ in range(50):
        now[0] += 4.0
        retry.failed(TransientError("cut"), moved=2**19)  # half a chunk each: a chunk every two


def test_a_stream_cut_again_and_again_completes_while_it_moves(tmp_path):
    data = os.urandom(40_000)
    (tmp_path / "obj").write_bytes(data)
    store = PartStore(str(tmp_path), chunk_size=1000)
    store.cut_after[0] = [500]
    position = 500
    for _ in range(12):  # 13 cuts, each after some progress: more than max_attempts=3
        store.cut_after[position] = [700]
        position += 700
    assert store.get_bytes("obj") == data
    assert len(store.reads) == 14
    assert [s for _, s, _ in store.reads[:3]] == [0, 500, 1200]  # each resumed from the next byte
    store.cut_after[0] = [position]
    store.fail_always.add(position)
    store.reads.clear()
    with pytest.raises(TransientError):
        store.get_bytes("obj")
    assert sum(1 for _, s, _ in store.reads if s == position) == 3  # no progress: the budget runs out


# -- parts ------------------------------------------------------------------------------------------------
def test_a_shard_is_fetched_as_parallel_ranged_parts(tmp_path, parts_remote):
    store, specs, contents = parts_remote([50_000, 3000, 0])
    store.gate.clear()  # hold every read until several are running
    cache = ShardCache(parts_config(tmp_path), store)
    fetched = {}
    thread = threading.Thread(target=lambda: fetched.setdefault("path", cache.fetch(*specs[0])))
    thread.start()
    deadline = time.monotonic() + 10
    while store.running < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # no more start
    store.gate.set()
    thread.join(10)
    name = specs[0][0]
    assert read(fetched["path"]) == contents[name]
    reads = store.reads_of(name)
    assert len(reads) == 13  # ceil(50,000 / 4096) parts, each read once
    assert store.most_running == 8  # twice parts_in_flight: a reader waits for this shard
    starts = sorted(s for s, _ in reads)
    assert starts == list(range(0, 50_000, 4096))
    assert sorted(e for _, e in reads)[-1] == 50_001  # the last part asks one byte more
    for small in specs[1:]:  # a shard no larger than a part: one GET, as before
        assert read(cache.fetch(*small)) == contents[small[0]]
        assert store.reads_of(small[0]) == [(0, small[1] + 1)]
    assert os.listdir(tmp_path / "cache" / "tmp") == []


def test_one_part_in_flight_is_one_get_per_shard(tmp_path, parts_remote):
    store, specs, contents = parts_remote([50_000])
    cache = ShardCache(parts_config(tmp_path, parts_in_flight=1), store)
    assert read(cache.fetch(*specs[0])) == contents[specs[0][0]]
    assert store.reads_of(specs[0][0]) == [(0, 50_001)]


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_part_cut_mid_body_resumes_from_its_next_byte(tmp_path, parts_remote, where):
    store, specs, contents = parts_remote([40_000], chunk_size=1000)
    start = {"first": 0, "middle": 4 * 4096, "last": 9 * 4096}[where]
    store.cut_after[start] = [1500]  # cut twice: after 1,500 bytes, then after 300 more
    store.cut_after[start + 1500] = [300]
    cache = ShardCache(parts_config(tmp_path), store)
    assert read(cache.fetch(*specs[0])) == contents[specs[0][0]]
    starts = collections.Counter(s for s, _ in store.reads_of(specs[0][0]))
    assert starts[start] == 1 and starts[start + 1500] == 1 and starts[start + 1800] == 1
    assert len(store.reads) == 10 + 2


def test_a_part_that_fails_for_good_fails_the_shard_naming_it(tmp_path, parts_remote):
    store, specs, _ = parts_remote([40_000])
    store.fail_always.add(2 * 4096)
    cache = ShardCache(parts_config(tmp_path), store)
    with pytest.raises(TransientError, match=r"shard-000000\.tar.*part 2 \(bytes 8192-12287\)"):
        cache.fetch(*specs[0])
    assert cached_names(tmp_path / "cache") == set()
    assert os.listdir(tmp_path / "cache" / "tmp") == []
    assert store.running == 0  # no part still writing into a file given up


def test_a_missing_object_is_not_found_naming_the_shard(tmp_path, parts_remote):
    store, _, _ = parts_remote([10])
    cache = ShardCache(parts_config(tmp_path), store)
    with pytest.raises(NotFound, match="absent.tar"):
        cache.fetch("train/absent.tar", 50_000)
    assert os.listdir(tmp_path / "cache" / "tmp") == []


def test_a_corrupt_part_is_fetched_once_more_then_corrupt_shard(tmp_path, parts_remote):
    store, specs, contents = parts_remote([40_000])
    name = specs[0][0]
    store.damage_starts[3 * 4096] = 1  # damaged on the way, once
    cache = ShardCache(parts_config(tmp_path), store)
    assert read(cache.fetch(*specs[0])) == contents[name]
    assert len(store.reads_of(name)) == 2 * 10  # the whole shard once more

    store.damage_starts[3 * 4096] = 2  # damaged both times
    store.reads.clear()
    fresh = ShardCache(parts_config(tmp_path / "b"), store)
    with pytest.raises(CorruptShard, match=r"shard-000000\.tar.*fails its checksum"):
        fresh.fetch(*specs[0])
    assert len(store.reads_of(name)) == 2 * 10  # fetched twice, then given up
    assert cached_names(tmp_path / "b" / "cache") == set()
    assert os.listdir(tmp_path / "b" / "cache" / "tmp") == []


@pytest.mark.parametrize("damage", ["longer", "shorter", "much shorter"])
def test_a_size_other_than_the_manifest_is_corrupt_with_parts(tmp_path, parts_remote, damage):
    store, specs, _ = parts_remote([40_000])
    name, size, checksum = specs[0]
    size += {"longer": -10, "shorter": 10, "much shorter": 3 * 4096}[damage]
    cache = ShardCache(parts_config(tmp_path), store)
    with pytest.raises(CorruptShard, match=r"shard-000000\.tar.*(larger than|has .*bytes)"):
        cache.fetch(name, size, checksum)
    assert len(store.reads_of(name)) <= -(-size // 4096)  # no second fetch: the sizes disagree
    assert os.listdir(tmp_path / "cache" / "tmp") == []


def test_a_full_disk_mid_download_leaves_no_partial_file(tmp_path, parts_remote):
    store, specs, _ = parts_remote([60_000])
    cache = ShardCache(parts_config(tmp_path, preallocate=False), store)
    cache.usage()  # the layout and stats file exist before the limit
    child = FORK.Process(target=_fetch_under_file_size_limit, args=(cache, specs[0], 30_000, tmp_path / "result"))
    child.start()
    child.join(30)
    outcome = (tmp_path / "result").read_text()
    assert outcome.startswith("NoSpace:") and "shard-000000.tar" in outcome, outcome
    assert os.listdir(tmp_path / "cache" / "tmp") == []
    assert cached_names(tmp_path / "cache") == set()


# -- several shards, several processes ----------------------------------------------------------------
def _read_all(cache, specs, digests, barrier):
    barrier.wait(10)
    for spec in specs:
        with cache.hold(*spec) as path:
            assert hashlib.sha256(read(path)).hexdigest() == digests[spec[0]]
    cache.close()


class LoggingPartStore(PartStore):
    """Appends "key start" for every read to a file many processes share."""

    def __init__(self, url: str, log_path: str) -> None:
        super().__init__(url)
        self.log_path = log_path

    def _read(self, key, start, end):
        with open(self.log_path, "a") as log:
            log.write(f"{key} {start}\n")
        time.sleep(0.005)
        yield from super()._read(key, start, end)


def test_processes_fetch_each_part_once_per_node(tmp_path):
    specs, contents = make_remote(tmp_path / "remote", [30_000] * 4)
    store = LoggingPartStore(str(tmp_path / "remote"), str(tmp_path / "reads.log"))
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in contents.items()}
    cache = ShardCache(parts_config(tmp_path, prefetch=0), store)
    barrier = FORK.Barrier(4)
    children = [FORK.Process(target=_read_all, args=(cache, specs, digests, barrier)) for _ in range(4)]
    for child in children:
        child.start()
    for child in children:
        child.join(30)
    assert [c.exitcode for c in children] == [0] * 4
    reads = collections.Counter((tmp_path / "reads.log").read_text().split("\n")[:-1])
    assert set(reads.values()) == {1} and len(reads) == 4 * 8  # 8 parts a shard, each once on the node


def test_the_shards_in_use_at_a_cold_start_download_as_a_readers(tmp_path, parts_remote):
    """The prefetch list's lead (the shards the first batches read) is what the readers wait
    for at a cold start: each runs twice `parts_in_flight` parts at once, as a reader's own
    shard does, and the later shards wait for them."""
    store, specs, contents = parts_remote([20_000] * 4)
    store.gate.clear()
    # 8 connections: room for both, 4 parts each, with the later shards held back
    cache = ShardCache(parts_config(tmp_path, prefetch=3, shards_in_flight=3, parts_in_flight=2), store)
    cache.prefetch(specs, lead=2)
    deadline = time.monotonic() + 10
    while store.running < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # no more start
    in_flight = collections.Counter(k for k, _, _ in store.reads)
    store.gate.set()
    assert in_flight == {specs[0][0]: 4, specs[1][0]: 4}
    for spec in specs:
        with cache.hold(*spec) as path:
            assert read(path) == contents[spec[0]]
    cache.close()


def test_prefetch_keeps_several_shards_in_flight(tmp_path, parts_remote):
    store, specs, contents = parts_remote([20_000] * 5)
    store.gate.clear()
    cache = ShardCache(parts_config(tmp_path, prefetch=3, shards_in_flight=2, parts_in_flight=2), store)
    cache.prefetch(specs)
    deadline = time.monotonic() + 10
    while store.running < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    in_flight = {k for k, _, _ in store.reads}
    store.gate.set()
    assert in_flight == {specs[0][0], specs[1][0]}  # two shards, two parts each, the sooner ones
    assert store.most_running == 4
    for spec in specs:
        with cache.hold(*spec) as path:
            assert read(path) == contents[spec[0]]
    cache.close()


def test_the_reader_s_shard_goes_before_the_prefetch_s(tmp_path):
    """With every connection busy, the next free one takes a part of the shard a reader waits
    for (priority 0), not the next part of a prefetch (priority 1 or more)."""
    specs, contents = make_remote(tmp_path / "remote", [40_000, 40_000])
    store = PartStore(str(tmp_path / "remote"))
    store.gate.clear()
    engine = DownloadEngine(connections=2)
    files = [os.open(tmp_path / f"out-{i}", os.O_RDWR | os.O_CREAT) for i in range(2)]
    try:
        background = engine.start(store, specs[0][0], files[0], 40_000, priority=2, parts_in_flight=2, part_size=4096)
        deadline = time.monotonic() + 10
        while store.running < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        urgent = engine.start(store, specs[1][0], files[1], 40_000, priority=0, parts_in_flight=2, part_size=4096)
        store.gate.set()
        urgent.wait()
        order = [k for k, _, _ in store.reads]
        last_urgent = len(order) - 1 - order[::-1].index(specs[1][0])
        # Before the urgent shard's last part: the two background parts that were running,
        # and at most one more, taken while that last part ran.
        assert order[:last_urgent].count(specs[0][0]) <= 3
        background.wait()
        for fd, spec in zip(files, specs):
            assert os.pread(fd, 40_000, 0) == contents[spec[0]]
    finally:
        for fd in files:
            os.close(fd)
        engine.close()


def test_a_shard_under_parts_in_flight_parts_is_spread_over_all_its_connections(tmp_path, parts_remote):
    """A cold reader waits for a whole shard: one that parts of `part_size` would spread over
    fewer than `parts_in_flight` connections comes in `parts_in_flight` parts at once (a 32 MB
    shard with 16 MiB parts used 2 of its 8 connections); none is cut under 1 MiB."""
    mib = 2**20
    store, specs, contents = parts_remote([6 * mib, 2 * mib], chunk_size=64 * 1024)
    cache = ShardCache(parts_config(tmp_path, part_size=16 * mib, parts_in_flight=4), store)
    for spec in specs:
        assert read(cache.fetch(*spec)) == contents[spec[0]]
    spread = sorted(store.reads_of(specs[0][0]))
    assert [start for start, _ in spread] == [0, 1.5 * mib, 3 * mib, 4.5 * mib]
    assert spread[-1][1] == 6 * mib + 1  # the last part asks one byte more
    assert sorted(store.reads_of(specs[1][0])) == [(0, mib), (mib, 2 * mib + 1)]  # 1 MiB parts at least


def test_the_prefetch_list_reaches_past_the_shuffle_window_in_use(tmp_path, monkeypatch):
    """From batch 0 of a cold epoch the prefetch is given the shards batch 0 reads (the whole
    first window: the readers wait for all of them) and then `prefetch_shards` more in plan
    order, so the next window's shards come in while this one is read. (The list used to stop
    at `prefetch_shards` shards from the next batch on, which with a window that wide held only
    shards in use, and each shard of the next window was fetched by a reader that waited.)"""
    url = write_bench_dataset(str(tmp_path / "data"), shards=24, samples=8)
    ds = dlstore.Dataset(
        url,
        cache_dir=str(tmp_path / "cache"),
        cache_limit="1GB",
        world=World(0, 1, 1),
        transform="eval",
        image_size=8,
        batch_size=16,
        shuffle_window=4,
        prefetch_shards=3,
    )
    lists: list[list[str]] = []
    depths: list[tuple[int | None, int]] = []  # (depth, lead) of each list
    monkeypatch.setattr(
        ds.cache,
        "prefetch",
        lambda specs, depth=None, lead=0: (lists.append([s[0] for s in specs]), depths.append((depth, lead))),
    )
    plan = ds.plan(0)
    names = [s.name for s in ds.manifest.shards]
    for index in (0, 4):
        ds.prefetch_after(plan, index)
        reading = plan.batch_shards(index).tolist()
        following = [s for s in plan.shards_needed(index).tolist() if s not in reading][:3]
        assert lists[-1] == [names[s] for s in reading + following]
        assert len(following) == 3
        # The window is the whole list (not the cache's `prefetch_shards` from the readers'
        # place), the shards in use first: fetched before the shards after them.
        assert depths[-1] == (len(lists[-1]), len(reading))
    # A cache without room for two shuffle windows and the prefetch keeps the cache's window:
    # a deeper one would evict shards of the window in use that queued batches still need.
    # (Smaller than the data, it fetches one shard ahead: `prefetch_ahead`.)
    largest = max(s.size for s in ds.manifest.shards)
    small = dlstore.Dataset(
        url, cache_dir=str(tmp_path / "small-cache"), cache_limit=(2 * 4 + 1) * largest - 1, world=World(0, 1, 1),
        transform="eval", image_size=8, batch_size=16, shuffle_window=4, prefetch_shards=3,
    )  # fmt: skip
    assert small.prefetch_ahead == 1
    monkeypatch.setattr(small.cache, "prefetch", ds.cache.prefetch)  # the recording one above
    small.prefetch_after(small.plan(0), 0)
    assert depths[-1] == (None, len(small.plan(0).batch_shards(0)))


def test_the_prefetch_paces_its_shards_in_flight_by_the_rates_measured():
    """As many shards at once as bring the window in at twice the rate the readers reach it;
    the cap until both rates are known (a cold start) and whenever that is not enough."""
    pace = PrefetchPace()
    assert pace.shards_at_once(cap=4, shard_rate=None) == 4
    for second, name in enumerate(["a", "b", "c"]):
        pace.reached(name, 50_000_000, second / 2)  # 100 MB/s
    assert pace.shards_at_once(cap=4, shard_rate=None) == 4  # no download measured yet
    assert pace.shards_at_once(cap=4, shard_rate=320e6) == 1  # 8 parts at 40 MB/s
    assert pace.shards_at_once(cap=4, shard_rate=80e6) == 3  # 8 parts at 10 MB/s
    assert pace.shards_at_once(cap=2, shard_rate=10e6) == 2
    pace.reached("a", 50_000_000, 10.0)  # a shard reached again (a new list): not consumed again
    assert pace.consumed_rate() == 100e6


# -- the node's cap on connections (CacheConfig.node_connections) ----------------------------------
class NodeCountingStore(PartStore):
    """Counts the reads running at once over every process of a node, in shared memory made
    before the fork; each read dawdles a little so that reads overlap."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.node_running = FORK.Value("i", 0)
        self.node_most = FORK.Value("i", 0)
        self.node_reads = FORK.Value("i", 0)

    def _read(self, key, start, end):
        with self.node_running.get_lock():
            self.node_running.value += 1
            self.node_reads.value += 1
            self.node_most.value = max(self.node_most.value, self.node_running.value)
        try:
            time.sleep(0.005)
            yield from super()._read(key, start, end)
        finally:
            with self.node_running.get_lock():
                self.node_running.value -= 1


def _read_own_shards(cache, specs, digests):
    for spec in specs:
        with cache.hold(*spec) as path:
            assert hashlib.sha256(read(path)).hexdigest() == digests[spec[0]]
    cache.close()


def test_the_node_s_processes_together_stay_within_the_connection_cap(tmp_path):
    """4 processes, each reading its own 3 shards of 5 parts with 4 parts in flight and a
    prefetch of 2 (up to 12 GETs each, 48 on the node): never more than 3 at once."""
    specs, contents = make_remote(tmp_path / "remote", [20_000] * 12)
    store = NodeCountingStore(str(tmp_path / "remote"))
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in contents.items()}
    cache = ShardCache(parts_config(tmp_path, prefetch=2, shards_in_flight=2, node_connections=3), store)
    children = [
        FORK.Process(target=_read_own_shards, args=(cache, specs[i * 3 : i * 3 + 3], digests)) for i in range(4)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
    assert [c.exitcode for c in children] == [0] * 4
    assert store.node_reads.value >= 12 * 5  # every part of every shard was read
    assert 1 <= store.node_most.value <= 3


def test_a_reader_waiting_for_a_node_slot_gets_the_next_before_any_prefetch(tmp_path):
    """Two engines with slot handles of their own (as two processes of a node), 2 slots: the
    prefetch's 2 parts hold both; the reader's shard (3 parts) waits. As slots free, all 3
    reader parts start before the prefetch's third part."""
    specs, contents = make_remote(tmp_path / "remote", [40_000, 12_000])
    store = PartStore(str(tmp_path / "remote"))
    store.gate.clear()
    prefetch_engine = DownloadEngine(connections=4, slots=NodeSlots(str(tmp_path / "cache"), 2))
    reader_engine = DownloadEngine(connections=4, slots=NodeSlots(str(tmp_path / "cache"), 2))
    files = [os.open(tmp_path / f"out-{i}", os.O_RDWR | os.O_CREAT) for i in range(2)]
    sizes = [40_000, 12_000]
    try:
        background = prefetch_engine.start(
            store, specs[0][0], files[0], sizes[0], priority=2, parts_in_flight=4, part_size=4096
        )
        deadline = time.monotonic() + 10
        while store.running < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        urgent = reader_engine.start(
            store, specs[1][0], files[1], sizes[1], priority=0, parts_in_flight=4, part_size=4096
        )
        while not reader_engine.slots.waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.running == 2 and reader_engine.slots.waiting  # the cap holds; the reader waits
        store.gate.set()
        urgent.wait()
        background.wait()
        order = [k for k, _, _ in store.reads]
        assert order[:5] == [specs[0][0]] * 2 + [specs[1][0]] * 3
        for fd, spec in zip(files, specs):
            assert os.pread(fd, spec[1], 0) == contents[spec[0]]
    finally:
        for fd in files:
            os.close(fd)
        prefetch_engine.close()
        reader_engine.close()


def test_a_prefetch_takes_no_slot_while_a_reader_waits(tmp_path):
    """The slots' rule on its own: handles of their own stand for processes of a node."""
    holder, reader, prefetch = (NodeSlots(str(tmp_path), 2) for _ in range(3))
    taken = [holder.try_take(urgent=False), holder.try_take(urgent=False)]
    assert sorted(taken) == [0, 1] and holder.try_take(urgent=True) is None  # the cap: 2
    assert reader.try_take(urgent=True) is None
    reader.set_waiting(True)
    holder.give_back(taken[0])
    assert prefetch.try_take(urgent=False) is None  # free, but a reader waits for it
    reader.look_again()  # the engine's poller, at its next tick
    assert reader.try_take(urgent=True) == taken[0]
    reader.set_waiting(False)
    holder.give_back(taken[1])
    assert prefetch.try_take(urgent=False) == taken[1]
    for slots in (holder, reader, prefetch):
        slots.close()


def _hold_a_slot_in_a_get(cache, spec):
    cache.fetch(*spec)  # its store's read hangs: killed while it holds the slot


class HangingStore(LocalStore):
    """A store whose reads touch `marker` and then hang."""

    def __init__(self, url: str, marker: str) -> None:
        super().__init__(url, StoreConfig(retry=QUICK))
        self.marker = marker

    def _read(self, key, start, end):
        open(self.marker, "w").close()
        time.sleep(600)
        yield b""


def test_a_process_killed_while_holding_a_slot_blocks_nobody(tmp_path):
    specs, contents = make_remote(tmp_path / "remote", [20_000, 20_000])
    marker = tmp_path / "reading"
    hanging = ShardCache(parts_config(tmp_path, node_connections=1), HangingStore(str(tmp_path / "remote"), marker))
    child = FORK.Process(target=_hold_a_slot_in_a_get, args=(hanging, specs[0]))
    child.start()
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    probe = NodeSlots(str(tmp_path / "cache"), 1)
    assert probe.try_take(urgent=True) is None  # the child's GET holds the only slot
    child.kill()
    child.join(10)
    probe.look_again()
    slot = probe.try_take(urgent=True)  # the lock died with its holder
    assert slot == 0
    probe.give_back(slot)
    probe.close()
    store = PartStore(str(tmp_path / "remote"))
    cache = ShardCache(parts_config(tmp_path, node_connections=1), store)
    for spec in specs:  # the killed child's shard too: its lock and temp file died with it
        assert read(cache.fetch(*spec)) == contents[spec[0]]
    assert store.most_running == 1  # 5 parts a shard, one at a time under the cap
    cache.close()


def test_a_reader_still_gets_a_slot_when_the_waiting_file_cannot_be_opened(tmp_path, caplog):
    """A reader marks itself waiting for a node slot in a file it opens when first needed; if
    that fails (no descriptors left, a full disk), the reader loses its precedence over
    prefetches but its download still completes once a slot frees (it used to kill the
    worker thread and leave `wait` blocked forever)."""
    specs, contents = make_remote(tmp_path / "remote", [3 * 2**20])
    name, size = specs[0][0], specs[0][1]
    cache_dir = tmp_path / "cache"
    (cache_dir / "slots" / "readers-waiting.lock").mkdir(parents=True)  # opening it fails
    other_process = NodeSlots(str(cache_dir), 2)
    held = [other_process.try_take(urgent=True) for _ in range(2)]
    assert None not in held
    engine = DownloadEngine(4, slots=NodeSlots(str(cache_dir), 2))
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
    download = engine.start(
        LocalStore(str(tmp_path / "remote")), name, fd, size, priority=0, parts_in_flight=2, part_size=2**20
    )
    errors = []
    waiter = threading.Thread(target=lambda: errors.append(download.wait()), daemon=True)
    waiter.start()
    time.sleep(0.3)  # the reader's parts wait for a slot
    for index in held:
        other_process.give_back(index)
    waiter.join(10)
    try:
        assert not waiter.is_alive(), "the download never completed"
        assert errors == [None] and download.error is None
        assert os.pread(fd, size, 0) == contents[name]
        assert "cannot mark a reader waiting" in caplog.text
    finally:
        engine.close()
        other_process.close()
        os.close(fd)


def _open_slot_files(cache_dir) -> int:
    """This process's descriptors of the node slot files of the cache in `cache_dir`."""
    slots, count = os.path.join(os.path.realpath(cache_dir), "slots") + os.sep, 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(slots)
        except OSError:  # the listing's own descriptor, gone
            pass
    return count


def _slot_files_after_first_use(cache: ShardCache, spec, out) -> None:
    cache.fetch(*spec)  # a hit: this process's own engine opens no slot file for it
    out.put(_open_slot_files(cache.config.cache_dir))


def test_slot_files_close_with_the_cache_and_a_forked_child_drops_the_parent_s(tmp_path):
    specs, _ = make_remote(tmp_path / "remote", [20_000])
    cache = ShardCache(parts_config(tmp_path, node_connections=4), PartStore(str(tmp_path / "remote")))
    cache.fetch(*specs[0])
    assert _open_slot_files(tmp_path / "cache") > 0
    out = FORK.Queue()
    child = FORK.Process(target=_slot_files_after_first_use, args=(cache, specs[0], out))
    child.start()
    in_child = out.get(timeout=30)
    child.join(10)
    assert in_child == 0  # the inherited descriptors are closed (the parent's locks stay)
    cache.close()
    assert _open_slot_files(tmp_path / "cache") == 0
