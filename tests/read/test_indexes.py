"""The sample indexes the node cache keeps beside its shards (`dlstore.read.indexes`): walked
from a shard once per node, reused by every later reader, never another shard's, removed
with the shard; and walked by one thread of a process at a time."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import dlstore
import dlstore.read.indexes as indexes
from dlstore.format.sample_index import SampleIndex
from dlstore.storage import open_store
from dlstore.world import World
from tests.support.loader_support import write_dataset


@pytest.fixture
def data_url(tmp_path):
    url = f"file://{tmp_path}/data"
    write_dataset(open_store(url), [5, 9, 2, 7])
    return url


def _dataset(url: str, cache_dir: Path) -> dlstore.Dataset:
    return dlstore.Dataset(
        url, cache_dir=str(cache_dir), cache_limit="50MB", transform="eval", image_size=8, batch_size=4,
        world=World(0, 1, 1),
    )  # fmt: skip


def _all_keys(ds: dlstore.Dataset) -> list[str]:
    return [sample["__key__"] for sample in ds.samples.read(np.arange(int(ds.shard_sizes.sum())))]


def _walks(monkeypatch) -> list[str]:
    """The shard files walked for their index from now on (the walk itself still runs)."""
    walked: list[str] = []
    walk = indexes.read_shard_index

    def counted(path):
        walked.append(os.path.basename(path))
        return walk(path)

    monkeypatch.setattr(indexes, "read_shard_index", counted)
    return walked


def test_each_shard_is_walked_once_per_cache_and_its_index_kept(data_url, tmp_path, monkeypatch):
    walked = _walks(monkeypatch)
    first = _all_keys(_dataset(data_url, tmp_path / "cache"))
    assert len(walked) == 4 and len(set(walked)) == 4
    kept = sorted(os.listdir(tmp_path / "cache" / "indexes"))
    assert kept == sorted(name + ".idx" for name in walked)
    # A new process's dataset over the same cache (a DataLoader worker, another rank, the next
    # run) reads every sample through the kept indexes: no walk, the same samples.
    assert _all_keys(_dataset(data_url, tmp_path / "cache")) == first
    assert len(walked) == 4
    # Another cache walks its own.
    assert _all_keys(_dataset(data_url, tmp_path / "other-cache")) == first
    assert len(walked) == 8


def test_a_kept_index_of_other_content_or_damaged_is_walked_again(data_url, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = _all_keys(_dataset(data_url, cache))
    kept = sorted((cache / "indexes").iterdir())
    # One names another shard checksum (a shard cached before under this name), one is garbage.
    stale = SampleIndex.from_bytes(kept[0].read_bytes())
    kept[0].write_bytes(SampleIndex(stale.offsets, stale.shard_size, bytes(range(32))).to_bytes())
    kept[1].write_bytes(b"not an index")
    walked = _walks(monkeypatch)
    assert _all_keys(_dataset(data_url, cache)) == first
    assert sorted(walked) == sorted(path.name.removesuffix(".idx") for path in kept[:2])
    # ... and replaced by good ones.
    for path in kept[:2]:
        assert SampleIndex.from_bytes(path.read_bytes()).shard_digest != bytes(range(32))


def test_a_kept_index_that_misleads_a_read_is_dropped_and_walked_again(data_url, tmp_path):
    """A kept index with the right size and checksum but wrong offsets (a stray write, a bad
    disk): the read it misleads fails, the node's copy is dropped with the recheck, and the
    read is retried from a fresh walk, for this process and the next."""
    cache = tmp_path / "cache"
    first = _all_keys(_dataset(data_url, cache))
    kept = sorted((cache / "indexes").iterdir(), key=lambda path: path.stat().st_size)[-1]  # 9 samples
    good = SampleIndex.from_bytes(kept.read_bytes())
    merged = np.delete(good.offsets, 1)  # samples 0 and 1 as one span: still a well-formed index
    kept.write_bytes(SampleIndex(merged, good.shard_size, good.shard_digest).to_bytes())
    assert _all_keys(_dataset(data_url, cache)) == first
    assert SampleIndex.from_bytes(kept.read_bytes()) == good
    assert _all_keys(_dataset(data_url, cache)) == first


def test_eviction_removes_the_shards_index(data_url, tmp_path):
    """A cache that holds two of the four shards at most: reading them all evicts, and every
    index kept is that of a shard still there."""
    sizes = sorted(shard.size for shard in _dataset(data_url, tmp_path / "probe").manifest.shards)
    cache = tmp_path / "cache"
    ds = dlstore.Dataset(
        data_url, cache_dir=str(cache), cache_limit=sizes[-1] + sizes[-2] + 4096, transform="eval", image_size=8,
        batch_size=4, world=World(0, 1, 1),
    )  # fmt: skip
    for shard in range(4):
        ds.samples.read(np.arange(int(ds.shard_sizes[:shard].sum()), int(ds.shard_sizes[: shard + 1].sum())))
    shards = sorted(os.listdir(cache / "shards"))
    assert len(shards) < 4  # some were evicted
    assert sorted(os.listdir(cache / "indexes")) == [name + ".idx" for name in shards]


def test_threads_of_a_process_walk_a_shard_once(data_url, tmp_path, monkeypatch):
    """Threads reading the same shard at once: one walks it, the others wait for its index."""
    ds = _dataset(data_url, tmp_path / "cache")
    ds.cache.fetch(*ds.samples.shard_ref(1))
    walked: list[str] = []
    walk = indexes.read_shard_index

    def slow_walk(path):
        walked.append(path)
        time.sleep(0.3)  # all the threads arrive while the first one walks
        return walk(path)

    monkeypatch.setattr(indexes, "read_shard_index", slow_walk)
    ids = np.arange(5, 14)  # shard 1's samples
    results: list = [None] * 4

    def read(i: int) -> None:
        results[i] = [sample["__key__"] for sample in ds.samples.read(ids)]

    threads = [threading.Thread(target=read, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(walked) == 1
    assert all(result == results[0] and len(result) == 9 for result in results)


def test_a_fork_while_a_thread_walks_a_shard_does_not_hang_the_child(data_url, tmp_path, monkeypatch):
    """A worker forked (torch's default start) while a thread of the parent walks a shard: the
    child reads that shard itself instead of waiting for a walk that goes on only in the parent."""
    ds = _dataset(data_url, tmp_path / "cache")
    ds.cache.fetch(*ds.samples.shard_ref(1))
    walking, walk = threading.Event(), indexes.read_shard_index

    def slow_walk(path):
        if os.getpid() == parent:
            walking.set()
            time.sleep(1.0)
        return walk(path)

    parent = os.getpid()
    monkeypatch.setattr(indexes, "read_shard_index", slow_walk)
    reader = threading.Thread(target=ds.samples.read, args=(np.arange(5, 14),))
    reader.start()
    assert walking.wait(timeout=30)
    child = os.fork()
    if child == 0:  # the child: read the shard being walked, within a bound
        signal.alarm(20)
        try:
            os._exit(0 if len(ds.samples.read(np.arange(5, 14))) == 9 else 1)
        except BaseException:
            os._exit(2)
    reader.join(timeout=30)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_dead_writers_index_temp_file_is_removed_when_a_cache_opens(data_url, tmp_path):
    """A process that died between writing a kept index's temp file and renaming it left the
    file behind: a process that opens the cache later removes it (a writer takes
    milliseconds: 10 minutes old is stale); a temp file being written now stays."""
    cache = tmp_path / "cache"
    first = _all_keys(_dataset(data_url, cache))
    folder = cache / "indexes"
    dead = folder / "x.idx.12345.00000000.tmp"
    live = folder / f"y.idx.{os.getpid()}.00000000.tmp"
    for path in (dead, live):
        path.write_bytes(b"half an index")
    long_ago = time.time() - 660
    os.utime(dead, (long_ago, long_ago))
    assert _all_keys(_dataset(data_url, cache)) == first
    assert not dead.exists()
    assert live.exists()
    assert len(list(folder.glob("*.idx"))) == 4
