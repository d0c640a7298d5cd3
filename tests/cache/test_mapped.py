"""`ShardCache.mapped`: an entry stays held between reads, and goes when idle or when a reader needs room."""

from __future__ import annotations

from dlstore.cache import CacheConfig, ShardCache, mapped
from dlstore.storage import open_store


def _caches(tmp_path, limit: int, count: int = 1, shards: int = 3, size: int = 100_000):
    """`count` caches on one directory: each holds its locks as another process would."""
    store = open_store(f"file://{tmp_path}/store")
    for i in range(shards):
        store.put(f"s{i}.tar", bytes([i]) * size)
    config = CacheConfig(str(tmp_path / "cache"), limit, prefetch=0, fsync=False, wait_timeout_s=30)
    return [ShardCache(config, store) for _ in range(count)], size


def test_a_mapped_entry_is_read_again_without_a_new_hold(tmp_path):
    (cache,), size = _caches(tmp_path, 1_000_000)
    with cache.mapped("s0.tar", size) as (memory, path):
        assert memory[:3] == b"\0\0\0" and len(memory) == size and path.endswith("s0.tar")
    hits = cache.stats.hits
    with cache.mapped("s0.tar", size) as (again, _):
        assert again is memory  # the same mapping, held since
    assert cache.stats.hits == hits + 1  # still a read served from the cache
    cache.close()


def test_an_idle_mapped_entry_goes_so_another_process_may_evict_it(tmp_path, monkeypatch):
    monkeypatch.setattr(mapped, "LINGER_S", 0.2)
    (first, second), size = _caches(tmp_path, 250_000, count=2)  # two entries fit
    for name in ("s0.tar", "s1.tar"):
        with first.mapped(name, size):
            pass
    # Both are held by the first while it might read them again; once idle, they go, and
    # the second evicts one for s2 instead of failing with CacheFull.
    with second.mapped("s2.tar", size) as (memory, _):
        assert memory[:1] == b"\2"
    assert not (first.cached("s0.tar") and first.cached("s1.tar"))
    first.close()
    second.close()


def test_a_reader_that_needs_room_evicts_its_own_idle_entry_but_not_one_in_use(tmp_path):
    (cache,), size = _caches(tmp_path, 250_000)
    with cache.mapped("s0.tar", size):
        with cache.mapped("s1.tar", size):
            pass
        # s1 is mapped and idle, s0 in use: the reader of s2 evicts s1.
        with cache.mapped("s2.tar", size) as (memory, _):
            assert memory[:1] == b"\2"
        assert cache.cached("s0.tar") and not cache.cached("s1.tar")
    cache.close()
