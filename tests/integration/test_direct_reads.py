"""A pass's first batch from a cold cache, read straight from the store (`dlstore.read.direct`),
over the local Swift: it comes while its shards cannot be downloaded yet, it is the batch
the cached shards give, its bytes are counted (apart from the cache's fetches), and bytes that fail their digests
are never used (the shard's own checksum then fails as without direct reads)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import numpy as np
import pytest

import dlstore
from dlstore.cache import cache_report
from dlstore.config import StoreConfig
from dlstore.convert import ConvertOptions, convert
from dlstore.demo.datagen import make_imagefolder
from dlstore.errors import CorruptShard
from dlstore.format.manifest import load_sample_index
from dlstore.format.shards import read_sample
from dlstore.plan import locate
from dlstore.storage import open_store
from dlstore.world import World
from tests.support.fault_proxy import FaultProxy

BATCH = 4


@pytest.fixture
def converted(swift_server, swift_container, tmp_path):
    """3 shards of 40 JPEGs (version 2 sample indexes) in the local Swift: (url, store config).
    A first batch of 4 reads at most a tenth of a shard: little enough to be read directly."""
    config = StoreConfig.from_env(swift_server.swift_env())
    url = f"swift://{swift_container}/data"
    made = make_imagefolder(tmp_path / "src", num_classes=3, per_class=40, image_size=(24, 20), formats=("jpg",))
    convert("imagefolder", made.root, url, ConvertOptions(samples_per_shard=40, workers=1), config=config)
    return url, config


def _loader(url: str, config: StoreConfig, cache_dir, engine="threads", workers=1, **options) -> dlstore.Loader:
    ds = dlstore.Dataset(
        url, cache_dir=str(cache_dir), batch_size=BATCH, image_size=16, seed=0, world=World(), store_config=config,
        return_keys=True, **options,
    )  # fmt: skip
    return dlstore.Loader(ds, num_workers=workers, device="cpu", dtype="uint8", engine=engine)


@contextlib.contextmanager
def _locked_elsewhere(paths: list[str]) -> Iterator[None]:
    """Exclusive `flock`s on `paths`, held by another process until the block ends (it is
    killed then): a lock of this process would be inherited by forked worker processes."""
    code = (
        "import fcntl, os, sys, time\n"
        "fds = [os.open(p, os.O_RDWR | os.O_CREAT, 0o666) for p in sys.argv[1:]]\n"
        "[fcntl.flock(fd, fcntl.LOCK_EX) for fd in fds]\n"
        "print('locked', flush=True)\n"
        "time.sleep(600)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, *paths], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        yield
    finally:
        holder.kill()
        holder.wait(timeout=30)


def _first_shards(loader: dlstore.Loader) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The shards batch 0 reads, and each of its samples' shard and index within it."""
    ds = loader.dataset
    ids, _ = ds.plan(0).batch(0)
    shards, offsets = locate(ids, ds.shard_sizes)
    return sorted(set(shards.tolist())), shards, offsets


def _batches_in_thread(loader: dlstore.Loader) -> queue.Queue:
    """The loader's batches (or the error that ended them) as they come, from a thread."""
    out: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            for batch in loader:
                out.put(batch)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.put(exc)
        out.put(None)

    threading.Thread(target=run, daemon=True).start()
    return out


@pytest.mark.parametrize("engine", ["threads", "processes"])
def test_a_cold_first_batch_comes_while_its_shards_cannot_be_downloaded(converted, tmp_path, engine):
    url, config = converted
    # One part per shard: two connections for the direct reads, so one Swift GET carries
    # several byte ranges (multipart/byteranges) and that path is what this test runs.
    # Two worker processes: each reads its half of the first batch directly.
    workers = 2 if engine == "processes" else 1
    loader = _loader(url, config, tmp_path / "cold", engine=engine, workers=workers, fetch_parts=1)
    cache = loader.dataset.cache
    first, shards, offsets = _first_shards(loader)
    cache._dir.create()
    locks = [
        os.path.join(cache._dir.locks, cache._stem(loader.dataset.manifest.shards[s].name) + ".lock") for s in first
    ]
    with _locked_elsewhere(locks):  # as another process's downloads: no one fetches them now
        batches = _batches_in_thread(loader)
        batch = batches.get(timeout=60)  # without direct reads: no batch until the locks go
        assert not isinstance(batch, BaseException), batch
        batch = (batch[0].clone(), batch[1].clone(), batch[2])  # its buffer may be reused later
    rest = []
    while (item := batches.get(timeout=60)) is not None:
        assert not isinstance(item, BaseException), item
        rest.append(item)
    loader.close()
    loader.dataset.cache.close()

    warm = _loader(url, config, tmp_path / "cold", first_batch_direct=False)  # the cache is full now
    expected = next(iter(warm))
    warm.close()
    warm.dataset.cache.close()
    images, labels, meta = batch
    assert meta["keys"] == expected[2]["keys"] and labels.tolist() == expected[1].tolist()
    assert np.array_equal(images.numpy(), expected[0].numpy())
    # Counted apart from the cache's fetches: every shard once, and the first batch's samples.
    store = open_store(url, config)
    spans = sum(load_sample_index(store, warm.dataset.manifest.shards[s])[int(o)].size for s, o in zip(shards, offsets))
    report = cache_report(str(tmp_path / "cold"))
    assert report.epochs[0].bytes_fetched == sum(info.size for info in warm.dataset.manifest.shards)
    assert report.totals.bytes_direct == spans


def test_bytes_that_fail_their_digest_are_never_used(converted, tmp_path):
    """A sample of batch 0 is damaged in the store (after its index was made): the direct read
    finds it does not match its digest and leaves the shard to the cache, whose checksum then
    fails twice: `CorruptShard`, and no batch before it."""
    url, config = converted
    loader = _loader(url, config, tmp_path / "cold")
    _, shards, offsets = _first_shards(loader)
    info = loader.dataset.manifest.shards[int(shards[0])]
    store = open_store(url, config)
    span = load_sample_index(store, info)[int(offsets[0])]
    data = bytearray(store.get_bytes(info.name))
    raw = bytes(data[span.offset : span.offset + span.size])
    jpeg = read_sample(raw)["jpg"]
    # One byte in the middle of the JPEG's entropy-coded data: the image still decodes (only
    # the digest can tell), so a batch built from these bytes would come before any error.
    data[span.offset + raw.index(jpeg) + len(jpeg) // 2] ^= 0x10
    store.put(info.name, bytes(data))
    batches = _batches_in_thread(loader)
    first = batches.get(timeout=120)
    loader.close()
    assert isinstance(first, CorruptShard), first
    assert info.name in str(first)


def test_direct_gets_hold_the_nodes_connection_slots(converted, tmp_path):
    """With one connection slot on the node, held by another process, and the first batch's
    shards locked as if another process downloaded them: no direct GET goes out until the
    slot frees; then the batch comes, its shards still locked."""
    url, config = converted
    loader = _loader(url, config, tmp_path / "cold", fetch_node_connections=1)
    cache = loader.dataset.cache
    first, _, _ = _first_shards(loader)
    names = [loader.dataset.manifest.shards[s].name for s in first]
    cache._dir.create()
    blockers = [cache._dir.open_lock(cache._stem(name)) for name in names]
    os.makedirs(tmp_path / "cold" / "slots", exist_ok=True)
    slot = os.open(tmp_path / "cold" / "slots" / "slot-0000.lock", os.O_RDWR | os.O_CREAT, 0o666)
    for fd in (*blockers, slot):
        fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        batches = _batches_in_thread(loader)
        with pytest.raises(queue.Empty):
            batches.get(timeout=3)  # no slot: no direct GET, and no download of the locked shards
        assert cache_report(str(tmp_path / "cold")).totals.bytes_direct == 0
        os.close(slot)  # the slot frees; the shards stay locked
        batch = batches.get(timeout=60)
    finally:
        for fd in blockers:
            os.close(fd)
    assert not isinstance(batch, BaseException), batch
    while (item := batches.get(timeout=60)) is not None:
        assert not isinstance(item, BaseException), item
    loader.close()
    cache.close()
    assert cache_report(str(tmp_path / "cold")).totals.bytes_direct > 0


def _proxied(swift_server, proxy: FaultProxy) -> StoreConfig:
    """A store config that reaches the local Swift only through `proxy`."""
    env = {"ST_AUTH": f"{proxy.url}/auth/v1.0", "ST_USER": swift_server.user, "ST_KEY": swift_server.key}
    return StoreConfig.from_env(env)


def test_a_warm_pass_asks_the_store_for_nothing(converted, swift_server, tmp_path):
    """Direct reads are for shards not cached yet: a pass over a full cache sends no request
    (no sample index, no ranged GET), while the cold pass before it read its first batch directly."""
    url, _ = converted
    with FaultProxy(urlsplit(swift_server.storage_url).port) as proxy:
        config = _proxied(swift_server, proxy)
        cold = _loader(url, config, tmp_path / "cache")
        list(cold)
        cold.close()
        cold.dataset.cache.close()
        assert cache_report(str(tmp_path / "cache")).totals.bytes_direct > 0
        warm = _loader(url, config, tmp_path / "cache")  # the manifest is read here
        proxy.reset_counts()
        list(warm)
        warm.close()
        warm.dataset.cache.close()
        assert proxy.log == []


def test_a_sample_index_that_could_not_be_had_is_asked_for_again(converted, swift_server, tmp_path):
    """The store's sample index of a shard fails for a while (503s past direct reads' short
    retry): that pass reads the shard from the cache; a later pass asks for the index again."""
    url, _ = converted
    with FaultProxy(urlsplit(swift_server.storage_url).port) as proxy:
        loader = _loader(url, _proxied(swift_server, proxy), tmp_path / "cache")
        path = loader.dataset.samples
        info = loader.dataset.manifest.shards[0]
        proxy.add_rule("503", method="GET", path=re.escape(info.index) + "$", times=None)
        assert path._store_index(0) is None
        proxy.clear()
        index = path._store_index(0)
        loader.dataset.cache.close()
    assert index is not None and len(index) == info.samples


@pytest.mark.parametrize("resumed", [False, True], ids=["fresh", "resumed"])
@pytest.mark.parametrize("engine", ["threads", "processes"])
def test_the_shards_downloads_wait_for_the_first_batch_read_directly(
    converted, swift_server, tmp_path, engine, resumed
):
    """A cold pass's prefetch starts once its first batch, read directly, is handed on: every
    direct GET of the pass is sent before the first download of a whole shard, which then
    did not compete with it for the link, the store and the loader's CPU. A pass resumed
    mid-epoch into a cold cache (a new lease) is such a pass too: its first batch is the
    first of what its epoch has left."""
    url, config = converted
    state = None
    if resumed:
        before = _loader(url, config, tmp_path / "old-cache", engine, 1)
        batches = iter(before)
        next(batches), next(batches)
        state = before.state_dict()
        del batches
        before.close()
        before.dataset.cache.close()
    with FaultProxy(urlsplit(swift_server.storage_url).port) as proxy:
        # One worker process: with two, one of them may start batch 1's download (a reader's,
        # never held back) while the other still reads its half of batch 0.
        loader = _loader(url, _proxied(swift_server, proxy), tmp_path / "cache", engine, 1, fetch_parts=1)
        if state is not None:
            loader.load_state_dict(state)
        sizes = {info.name: info.size for info in loader.dataset.manifest.shards}
        proxy.reset_counts()
        got = list(loader)
        assert len(got) == loader.dataset.plan(0).num_batches - (2 if resumed else 0)
        loader.close()
        loader.dataset.cache.close()
        log = list(proxy.log)
    gets = [(path.rsplit("/", 1)[-1], byte_range) for method, path, byte_range in log if method == "GET"]
    shard_gets = [(name, byte_range) for name, byte_range in gets if name in sizes]
    whole = [i for i, (name, byte_range) in enumerate(shard_gets) if byte_range == f"bytes=0-{sizes[name]}"]
    direct = [i for i in range(len(shard_gets)) if i not in whole]
    assert direct and len(whole) == len(sizes), shard_gets  # batch 0 read directly; each shard downloaded once
    assert max(direct) < min(whole), shard_gets


def test_a_pass_requested_ahead_leaves_the_held_prefetch_alone(converted, tmp_path):
    """The engines request the next epoch's first batches before this one's is handed on
    (near an epoch's end, or in a short epoch). Only the fresh pass holds its prefetch back,
    and handing on its first batch starts that pass's list, whatever was requested since."""
    url, config = converted
    ds = _loader(url, config, tmp_path / "cache").dataset
    plan = ds.plan(0)
    ds.request(plan, 0, 0, fresh_pass=True)
    ds.prefetch_after(plan, 0)  # held: nothing is fetched yet
    ds.request(ds.plan(1), 1, 0)  # the next epoch's first batch, requested ahead
    names = [info.name for info in ds.manifest.shards]
    time.sleep(1)
    assert not any(ds.cache.cached(name) for name in names)
    ds.first_batch_delivered()
    deadline = time.monotonic() + 60
    while not all(ds.cache.cached(name) for name in plan_names(ds, plan)) and time.monotonic() < deadline:
        time.sleep(0.05)
    ds.cache.close()
    assert all(ds.cache.cached(name) for name in plan_names(ds, plan))


def plan_names(ds, plan) -> list[str]:
    """The shards batch 0 of `plan` reads: the lead of the prefetch list it asks for."""
    return [ds.manifest.shards[s].name for s in sorted(set(plan.batch_shards(0).tolist()))]
