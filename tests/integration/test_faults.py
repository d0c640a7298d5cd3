"""Reliability under injected faults, against the real Swift server (issue 6, cases 1 and 2).

* Every fault of `fault_proxy.FaultProxy`, once, on each API: the read returns exactly the
  object's bytes, with one extra request (a ranged one from the next byte after a cut body).
* Case 1: 10% of GETs faulted in every way during 2 epochs on 2 gloo ranks: the keys each
  rank delivers are exactly those of a fault-free run.
* The cache's parallel parts (issue 12): every fault once on one part of a shard fetched
  as ranged GETs: that part alone is asked again (from its next byte after a cut body) and
  the shard's bytes are exact; a part damaged on the way fails the checksum, the shard is
  fetched once more, and damaged again it is a `CorruptShard`; and a shard fetched through
  the WAN emulator (`tests/support/wan_proxy.py`) as parts, from a Swift SLO and an S3 multipart
  object.
* Case 2: the Swift server (a dedicated instance, not the session's: all its processes,
  memcached and so its tokens included) stopped for 20 s mid-epoch and started again on the
  same port: the loader waits within its retry deadline and loses nothing; kept down past
  the deadline, it stops with a `TransientError`, not a hang.

Times are never asserted except as generous upper bounds that prove "no hang"; the
measured detection times are printed (run with `-s` to see them).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import json
import os
import random
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

import pytest
import swiftclient
import torch.multiprocessing as tmp

import dlstore
from dlstore.cache import CacheConfig, ShardCache
from dlstore.config import RetryConfig, StoreConfig
from dlstore.errors import ConfigError, CorruptShard, NotFound, ObjectChanged, StalledRead, TransientError
from dlstore.storage import open_store
from dlstore.world import World
from tests.loader.test_loader import _CacheSampler
from tests.support.fault_proxy import ALL_FAULTS, FaultProxy
from tests.support.loader_support import fault_free_run, run_rank, write_dataset
from tests.support.swift_fixtures import SWIFT_SERVER_SCRIPT as SWIFT_SERVER
from tests.support.swift_server import read_env_file
from tests.support.wan_proxy import WanProxy

pytestmark = pytest.mark.swift

# Short timeouts and backoff: a stall is noticed after the read timeout, a retry waits ~0.05 s.
READ_TIMEOUT_S = 1.0
STALL_S = 2.5
FAST_RETRY = RetryConfig(initial_backoff_s=0.05, max_backoff_s=0.5, deadline_s=60, read_timeout_s=READ_TIMEOUT_S)
# Where one request more or less is asserted: a read timeout that a busy machine cannot trip.
PATIENT_READS = RetryConfig(initial_backoff_s=0.05, max_backoff_s=0.5, deadline_s=60, read_timeout_s=2.0)


def loader_error(loader, kind: type[BaseException]) -> BaseException:
    """The error a pass over `loader` ends with, which must be a `kind`.

    A DataLoader iterator freed by the garbage collector (not by its reference count) waits
    5 s per worker to shut down, so the error comes back without its traceback, which would
    tie the loader into reference cycles (as `pytest.raises` would, through the test's frame)."""
    try:
        for _ in loader:
            pass
    except Exception as exc:
        assert isinstance(exc, kind), f"expected {kind.__name__}, got {exc!r}"
        return exc.with_traceback(None)
    raise AssertionError(f"the loader finished without raising {kind.__name__}")


def report(case: str, **fields: object) -> None:
    """One line for the closing table (visible with `pytest -s`)."""
    print(f"\nRELIABILITY {case}: " + ", ".join(f"{k}={v}" for k, v in fields.items()))


def server_port(server) -> int:
    return urlsplit(server.storage_url).port


def proxied_env(server, proxy: FaultProxy, api: str) -> dict[str, str]:
    """Credentials that reach the server only through `proxy` (tempauth then hands out the
    proxy's own storage URL, since it follows the Host header)."""
    if api == "swift":
        return {"ST_AUTH": f"{proxy.url}/auth/v1.0", "ST_USER": server.user, "ST_KEY": server.key}
    return {**server.s3_env(), "AWS_ENDPOINT_URL": proxy.url}


def retry_env(policy: RetryConfig) -> dict[str, str]:
    return {
        "DLSTORE_RETRY_ATTEMPTS": str(policy.max_attempts),
        "DLSTORE_RETRY_DEADLINE": str(policy.deadline_s),
        "DLSTORE_RETRY_BACKOFF": str(policy.initial_backoff_s),
        "DLSTORE_READ_TIMEOUT": str(policy.read_timeout_s),
    }


def config_for(env: dict[str, str], retry: RetryConfig = FAST_RETRY) -> StoreConfig:
    return dataclasses.replace(StoreConfig.from_env(env), retry=retry)


# -- every fault, once, on both APIs --------------------------------------------------------------
OBJECT = bytes(range(256)) * 1200  # 300 KiB: several chunks, so a cut lands mid-body


@pytest.mark.parametrize("kind", ALL_FAULTS)
@pytest.mark.parametrize("api", ["swift", "s3"])
def test_each_fault_is_retried_and_the_bytes_are_exact(swift_server, swift_container, api, kind):
    with FaultProxy(server_port(swift_server), stall_s=4.0) as proxy:
        env = proxied_env(swift_server, proxy, api)
        store = open_store(f"{api}://{swift_container}/matrix", config_for(env, PATIENT_READS))
        store.put("obj", OBJECT)
        assert store.get_bytes("obj") == OBJECT  # authenticated, connection warm
        before = proxy.count("GET", r"/obj$")
        proxy.add_rule(kind, method="GET", path=r"/matrix/obj(\?|$)")
        started = time.monotonic()
        assert store.get_bytes("obj") == OBJECT
        took = time.monotonic() - started
        assert proxy.injected_kinds() == {kind: 1}
        # One faulted GET and one more: the whole object again, or the rest from the next byte.
        assert proxy.count("GET", r"/obj$") - before == 2
        retry_range = [r for m, p, r in proxy.log if m == "GET" and p.endswith("/obj")][-1]
        if kind == "short_body":  # half the body, then a clean end: the rest is asked for
            assert retry_range == f"bytes={len(OBJECT) // 2}-"
        elif kind in ("reset_body", "stall_body"):  # the bytes of a read that failed come again
            assert retry_range is None or 0 < int(retry_range[6:-1]) <= len(OBJECT) // 2
        else:
            assert retry_range is None
        assert store.get_range("obj", 1000, 5000) == OBJECT[1000:6000]
        assert took < 30  # no hang (a stall is given up after the read timeout)
    report(f"fault {kind} ({api})", detected_and_recovered_s=f"{took:.2f}")


@pytest.mark.parametrize("api", ["swift", "s3"])
def test_a_trickling_server_is_cut_and_the_read_resumed(swift_server, swift_container, api):
    """A byte every 0.2 s is within any read timeout: only the stall timeout ends the wait for
    a chunk. Once, the read resumes and its bytes are exact; for good, it ends in `StalledRead`
    (it held `ls`, `cp` and `verify` forever)."""
    policy = dataclasses.replace(PATIENT_READS, stall_timeout_s=2.0)
    with FaultProxy(server_port(swift_server), trickle_s=0.2) as proxy:
        env = proxied_env(swift_server, proxy, api)
        store = open_store(f"{api}://{swift_container}/trickle", config_for(env, policy))
        store.put("obj", OBJECT)
        assert store.get_bytes("obj") == OBJECT
        before = proxy.count("GET", r"/obj$")
        proxy.add_rule("trickle_body", method="GET", path=r"/trickle/obj(\?|$)")
        started = time.monotonic()
        assert store.get_bytes("obj") == OBJECT
        took = time.monotonic() - started
        assert proxy.injected_kinds() == {"trickle_body": 1}
        assert proxy.count("GET", r"/obj$") - before == 2
        assert took < 30
        # Several ranges in one GET (Swift's multipart answer, read whole): cut and asked again.
        proxy.add_rule("trickle_body", method="GET", path=r"/trickle/obj(\?|$)")
        spans = [(0, 10), (100_000, 50_000), (300_000, 7)]
        assert store.get_ranges("obj", spans) == [OBJECT[s : s + n] for s, n in spans]
        assert proxy.injected_kinds() == {"trickle_body": 2}

        proxy.add_rule("trickle_body", method="GET", path=r"/trickle/obj(\?|$)", times=None)
        started = time.monotonic()
        with pytest.raises(StalledRead, match="trickling connection"):
            store.with_retry(dataclasses.replace(policy, deadline_s=5.0)).get_bytes("obj")
        gave_up = time.monotonic() - started
        assert gave_up < 30
    report(f"trickle ({api})", resumed_s=f"{took:.2f}", gave_up_s=f"{gave_up:.2f}")


@pytest.mark.parametrize("api", ["swift", "s3"])
def test_an_answer_whose_head_trickles_is_cut_and_asked_again(swift_server, swift_container, api):
    """A response head sent a byte every 0.2 s (a HEAD, a listing page, a GET's head) is within
    any read timeout, and it is read inside the client library: the connection it came on is
    cut after the stall timeout. Once, each call is asked again and answers; for good, it ends
    in `StalledRead`."""
    policy = dataclasses.replace(PATIENT_READS, stall_timeout_s=2.0)
    with FaultProxy(server_port(swift_server), trickle_s=0.2) as proxy:
        env = proxied_env(swift_server, proxy, api)
        store = open_store(f"{api}://{swift_container}/headtrickle", config_for(env, policy))
        store.put("obj", OBJECT)
        listing = rf"/{swift_container}(\?|$)"
        calls = {
            "HEAD": (r"/headtrickle/obj$", lambda: store.stat("obj").size == len(OBJECT)),
            "GET": (r"/headtrickle/obj(\?|$)", lambda: store.get_bytes("obj") == OBJECT),
            "list": (listing, lambda: [i.key for i in store.list()] == ["obj"]),
        }
        assert all(call() for _, call in calls.values())  # authenticated, connections warm
        took = {}
        for name, (path, call) in calls.items():
            proxy.add_rule("trickle_head", method="HEAD" if name == "HEAD" else "GET", path=path)
            started = time.monotonic()
            assert call(), name
            took[name] = time.monotonic() - started
            assert took[name] < 30, name
        assert proxy.injected_kinds() == {"trickle_head": 3}

        impatient = store.with_retry(dataclasses.replace(policy, deadline_s=3.0, max_attempts=2))
        for name, method, path, call in (
            ("HEAD", "HEAD", r"/headtrickle/obj$", lambda: impatient.stat("obj")),
            ("list", "GET", listing, lambda: list(impatient.list())),
        ):
            proxy.add_rule("trickle_head", method=method, path=path, times=None)
            started = time.monotonic()
            with pytest.raises(StalledRead, match="no answer within 2 s"):
                call()
            assert time.monotonic() - started < 30, name
            proxy.clear()
    report(f"trickled head ({api})", **{f"{k}_s": f"{v:.2f}" for k, v in took.items()})


class _SlowSource(io.BytesIO):
    """An upload's source that gives its bytes at `rate` bytes/s (a slow disk, a pipe)."""

    def __init__(self, data: bytes, rate: float) -> None:
        super().__init__(data)
        self.rate = rate

    def read(self, size: int | None = -1) -> bytes:
        block = super().read(size)
        time.sleep(len(block) / self.rate)
        return block


@pytest.mark.parametrize("api", ["swift", "s3"])
def test_an_upload_or_delete_whose_answer_trickles_is_cut_and_sent_again(swift_server, swift_container, api):
    """The answer to an object PUT, a segment's or part's PUT, or a DELETE, sent a byte every
    0.2 s, held the upload (a checkpoint, a shard) for good: uploads were not watched, since
    their time grows with their size. Their wait now restarts at each block of the body sent,
    so an upload that takes its time is never cut (a source slower than the stall timeout
    here), and a stalled answer is cut and sent again; for good, it ends in `StalledRead`."""
    policy = dataclasses.replace(PATIENT_READS, stall_timeout_s=2.0)
    big = bytes(range(256)) * (11 * 2**12)  # 11 MiB: 3 segments or parts of 5 MiB
    with FaultProxy(server_port(swift_server), trickle_s=0.2) as proxy:
        env = {**proxied_env(swift_server, proxy, api), "DLSTORE_SEGMENT_SIZE": str(5 * 2**20)}
        store = open_store(f"{api}://{swift_container}/uptrickle", config_for(env, policy))
        store.put("obj", OBJECT)  # authenticated, connections warm
        started = time.monotonic()
        store.put("slow", _SlowSource(OBJECT, rate=len(OBJECT) / 3.0))  # 3 s to read, one block at a time
        assert time.monotonic() - started > 2.0 and store.get_bytes("slow") == OBJECT
        assert proxy.count("PUT", r"/uptrickle/slow$") == 1  # not cut, not sent again
        part = r"/uptrickle/big/slo/.*/00000001$" if api == "swift" else r"/uptrickle/big\?.*partNumber=2"
        calls = {
            "PUT": ("PUT", r"/uptrickle/obj$", lambda: store.put("obj", OBJECT)),
            "part": ("PUT", part, lambda: store.put("big", big)),
            "DELETE": ("DELETE", r"/uptrickle/obj$", lambda: store.delete("obj")),
        }
        took = {}
        for name, (method, path, call) in calls.items():
            proxy.add_rule("trickle_head", method=method, path=path)
            started = time.monotonic()
            call()
            took[name] = time.monotonic() - started
            assert took[name] < 30, name
        assert proxy.injected_kinds() == {"trickle_head": 3}
        assert store.get_bytes("big") == big and [i.key for i in store.list()] == ["big", "slow"]

        impatient = store.with_retry(dataclasses.replace(policy, deadline_s=3.0, max_attempts=2))
        proxy.add_rule("trickle_head", method="PUT", path=r"/uptrickle/obj$", times=None)
        started = time.monotonic()
        with pytest.raises(StalledRead, match="no answer within 2 s"):
            impatient.put("obj", OBJECT)
        assert time.monotonic() - started < 30
    report(f"trickled upload answer ({api})", **{f"{k}_s": f"{v:.2f}" for k, v in took.items()})


@pytest.mark.parametrize("api", ["swift", "s3"])
def test_deleting_a_missing_object_is_not_found_even_after_a_failed_look(swift_server, swift_container, api):
    """A DELETE asked again after an attempt whose answer was lost takes NotFound for done; the
    look that comes before it (a HEAD) failing once made a missing object's delete "succeed"."""
    with FaultProxy(server_port(swift_server)) as proxy:
        store = open_store(f"{api}://{swift_container}/gone", config_for(proxied_env(swift_server, proxy, api)))
        store.put("there", b"x")
        proxy.add_rule(503, method="HEAD", path=r"/gone/missing$")
        with pytest.raises(NotFound):
            store.delete("missing")
        assert proxy.injected_kinds() == {"503": 1}
        proxy.add_rule("reset", method="DELETE", path=r"/gone/there$")  # the DELETE's answer lost
        store.delete("there")
        assert [info.key for info in store.list()] == []


def test_a_swift_clusters_own_large_object_limits_are_kept(swift_server, swift_container):
    """Segments were sized for Swift's default limits (1,000 segments a manifest, 5 GiB a
    segment): on a cluster set lower, a large upload went up whole and was then refused with
    a 413. The limits come from the cluster's /info now, asked once per store."""
    size = 5 * 2**20 + 5
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    with FaultProxy(server_port(swift_server)) as proxy:
        env = {**proxied_env(swift_server, proxy, "swift"), "DLSTORE_SEGMENT_SIZE": str(2**20)}

        def upload(info: dict | None, source) -> tuple[int, int]:
            """(segments PUT, /info GETs) of one upload of `source` by a new store, with `info`
            answered as the cluster's /info (None: the cluster's own)."""
            proxy.clear()
            if info is not None:
                proxy.add_rule(200, method="GET", path=r"^/info$", body=json.dumps(info).encode(), times=None)
            puts, infos = proxy.count("PUT", r"/limits/obj/slo/"), proxy.count("GET", r"^/info$")
            store = open_store(f"swift://{swift_container}/limits", config_for(env))
            try:
                store.put("obj", source)
                assert store.get_bytes("obj") == data
            finally:
                upload.counts = (proxy.count("PUT", r"/limits/obj/slo/") - puts, proxy.count("GET", r"^/info$") - infos)
            return upload.counts

        assert upload(None, data) == (6, 1)  # the cluster's own /info: Swift's defaults
        assert upload({"slo": {"max_manifest_segments": 2}}, data) == (2, 1)  # each segment made large enough
        chunks = (data[i : i + 2**19] for i in range(0, size, 2**19))  # no size known: the segments grow
        segments, _ = upload({"slo": {"max_manifest_segments": 3}}, chunks)
        assert segments <= 3
        with pytest.raises(ConfigError, match="more than one static large object holds here"):
            upload({"slo": {"max_manifest_segments": 2}, "swift": {"max_file_size": 2**20}}, data)
        assert upload.counts == (0, 1)  # refused before anything went up


@pytest.mark.parametrize("api", ["swift", "s3"])
def test_a_copy_under_another_retry_policy_reads_with_its_own_timeout(swift_server, swift_container, api):
    """A `with_retry` copy (the direct reads' short policy) reads with its own timeouts, not
    with the store's connections and their longer read timeout (a hang hunt suspected it did:
    a copy makes its own clients, as an unpickled store does)."""
    patient = dataclasses.replace(PATIENT_READS, read_timeout_s=30.0, max_attempts=1)
    with FaultProxy(server_port(swift_server), stall_s=8.0) as proxy:
        store = open_store(
            f"{api}://{swift_container}/timeouts", config_for(proxied_env(swift_server, proxy, api), patient)
        )
        store.put("obj", OBJECT)
        assert store.stat("obj").size == len(OBJECT)  # its clients and connections made
        quick = store.with_retry(dataclasses.replace(patient, read_timeout_s=1.0))
        proxy.add_rule("stall", method="HEAD", path=r"/timeouts/obj$")
        with pytest.raises(TransientError):
            quick.stat("obj")  # the answer comes after 8 s: past this copy's timeout
        proxy.add_rule("stall", method="HEAD", path=r"/timeouts/obj$")
        assert store.stat("obj").size == len(OBJECT)  # the store's own 30 s still wait for it


@pytest.mark.parametrize("api", ["swift", "s3"])
def test_a_trickled_answer_on_a_connection_the_server_closes_is_cut(swift_server, swift_container, api):
    """An answer that says `Connection: close` (a server at its keep-alive limit) leaves its
    connection without a socket while its body is read: the cut must still find the socket.
    A listing page whose body trickles was never cut, and `ls` hung."""
    policy = dataclasses.replace(PATIENT_READS, stall_timeout_s=2.0)
    with FaultProxy(server_port(swift_server), trickle_s=0.2, close_connections=True) as proxy:
        env = proxied_env(swift_server, proxy, api)
        store = open_store(f"{api}://{swift_container}/closing", config_for(env, policy))
        store.put("obj", OBJECT)
        listing = rf"/{swift_container}(\?|$)"
        proxy.add_rule("trickle_body", method="GET", path=listing)
        started = time.monotonic()
        assert [info.key for info in store.list()] == ["obj"]
        took = time.monotonic() - started
        assert proxy.injected_kinds() == {"trickle_body": 1} and took < 30

        proxy.add_rule("trickle_body", method="GET", path=listing, times=None)
        started = time.monotonic()
        with pytest.raises(StalledRead, match="no answer within 2 s"):
            list(store.with_retry(dataclasses.replace(policy, deadline_s=3.0, max_attempts=2)).list())
        gave_up = time.monotonic() - started
        assert gave_up < 30
    report(f"trickled listing, Connection: close ({api})", resumed_s=f"{took:.2f}", gave_up_s=f"{gave_up:.2f}")


@pytest.mark.compat
def test_a_server_that_ignores_range_still_gives_the_bytes_asked_for(swift_server, swift_container):
    """A server (or a proxy before it) that answers a ranged GET with the whole object (200):
    the bytes before the range are skipped, never taken for it; after a cut, too. It used to
    return the object from byte 0, and a resumed read repeated its first part. (Swift's API
    only: S3 signs the Range header, so the proxy cannot drop it; tests/storage/test_s3_client.py
    has a server that ignores it.)"""
    with FaultProxy(server_port(swift_server)) as proxy:
        env = proxied_env(swift_server, proxy, "swift")
        store = open_store(f"swift://{swift_container}/whole", config_for(env, PATIENT_READS))
        store.put("obj", OBJECT)
        proxy.add_rule("ignore_range", method="GET", path=r"/whole/obj(\?|$)")
        assert store.get_range("obj", 1000, 5000) == OBJECT[1000:6000]
        assert proxy.injected_kinds() == {"ignore_range": 1}
        proxy.add_rule("short_body", method="GET", path=r"/whole/obj(\?|$)")
        proxy.add_rule("ignore_range", method="GET", path=r"/whole/obj(\?|$)")
        assert store.get_bytes("obj") == OBJECT  # the resume got the whole object again
        assert proxy.injected_kinds() == {"ignore_range": 2, "short_body": 1}


@pytest.mark.compat
@pytest.mark.parametrize("replacement", ["as long", "shorter"])
@pytest.mark.parametrize("api", ["swift", "s3"])
def test_an_object_replaced_between_a_cut_and_its_resume_is_an_error(swift_server, swift_container, api, replacement):
    """The object is overwritten while its read is cut: the resume asks for the version read
    so far (If-Match), and its loss is an `ObjectChanged`. It used to return the old bytes
    up to the cut and the new ones after it (or, shorter, the old ones cut off), silently."""
    other = b"B" * (len(OBJECT) if replacement == "as long" else 1000)
    with FaultProxy(server_port(swift_server)) as proxy:
        env = proxied_env(swift_server, proxy, api)
        store = open_store(f"{api}://{swift_container}/swap", config_for(env, PATIENT_READS))
        store.put("obj", OBJECT)
        proxy.add_rule("short_body", method="GET", path=r"/swap/obj(\?|$)", then=lambda: store.put("obj", other))
        with pytest.raises(ObjectChanged, match="replaced while it was read"):
            store.get_bytes("obj")
        assert store.get_bytes("obj") == other  # a fresh read takes the new version whole


@pytest.mark.compat
def test_a_large_object_read_resumes_on_the_same_version(swift_server, swift_container):
    """A Swift SLO (segments and a manifest) cut mid-body resumes with If-Match on the
    manifest's ETag, which Swift answers for the large object: the bytes are exact."""
    with FaultProxy(server_port(swift_server)) as proxy:
        env = proxied_env(swift_server, proxy, "swift")
        config = config_for(env, PATIENT_READS)
        config = dataclasses.replace(config, swift=dataclasses.replace(config.swift, segment_size=1 << 20))
        store = open_store(f"swift://{swift_container}/slo", config)
        data = random.Random(5).randbytes(3 * (1 << 20) + 123)
        store.put("big", data)
        proxy.add_rule("reset_body", method="GET", path=r"/slo/big(\?|$)")
        assert store.get_bytes("big") == data
        assert proxy.injected_kinds() == {"reset_body": 1}
        proxy.add_rule("short_body", method="GET", path=r"/slo/big(\?|$)", then=lambda: store.put("big", data[::-1]))
        with pytest.raises(ObjectChanged):
            store.get_bytes("big")


# -- the cache's parallel parts under each fault (issue 12) --------------------------------------
PART = 64 * 1024  # below the 1 MiB the engine needs to adapt part sizes: the parts are as cut here
SHARD = random.Random(12).randbytes(5 * PART + 1000)  # 6 parts
SHARD_SUM = "sha256:" + hashlib.sha256(SHARD).hexdigest()


def parts_cache(tmp_path, store, **kwargs) -> ShardCache:
    kwargs.setdefault("part_size", PART)
    kwargs.setdefault("parts_in_flight", 4)
    return ShardCache(CacheConfig(str(tmp_path / "cache"), "10MB", prefetch=0, fsync=False, **kwargs), store)


def _range_of(header: str) -> tuple[int, int]:
    first, _, last = header.removeprefix("bytes=").partition("-")
    return int(first), int(last)


@pytest.mark.parametrize("kind", ALL_FAULTS)
@pytest.mark.parametrize("api", ["swift", "s3"])
def test_each_fault_on_a_part_resumes_that_part(swift_server, swift_container, tmp_path, api, kind):
    with FaultProxy(server_port(swift_server), stall_s=4.0) as proxy:
        env = proxied_env(swift_server, proxy, api)
        store = open_store(f"{api}://{swift_container}/parts", config_for(env, PATIENT_READS))
        store.put("shard.tar", SHARD)
        assert store.get_range("shard.tar", 0, 1) == SHARD[:1]  # authenticated
        proxy.reset_counts()
        proxy.add_rule(kind, method="GET", path=r"/parts/shard\.tar(\?|$)")
        with open(parts_cache(tmp_path, store).fetch("shard.tar", len(SHARD), SHARD_SUM), "rb") as file:
            assert file.read() == SHARD
        assert proxy.injected_kinds() == {kind: 1}
        ranges = [_range_of(r) for m, p, r in proxy.log if m == "GET" and p.endswith("/parts/shard.tar")]
    assert len(ranges) == 6 + 1  # six parts, the faulted one asked twice
    (start, last), later = ranges[0], ranges[1:]  # the proxy faulted the first GET it saw
    again = [first for first, end in later if end == last]  # the same part: its range ends where it did
    length = min(last + 1, len(SHARD)) - start
    if kind == "short_body":  # half the part, then a clean end: the rest is asked for
        assert again == [start + length // 2]
    elif kind in ("reset_body", "stall_body"):  # from the next byte the client kept
        assert len(again) == 1 and start <= again[0] <= start + length // 2
    else:
        assert again == [start]
    # Six parts in all; the last asks for one byte past the end.
    assert sorted({end for _, end in ranges}) == [(i + 1) * PART - 1 for i in range(5)] + [len(SHARD)]


@pytest.mark.parametrize("api", ["swift", "s3"])
def test_a_part_damaged_on_the_way_is_fetched_once_more_then_corrupt(swift_server, swift_container, tmp_path, api):
    """The proxy answers one ranged GET with 206 and the right length of wrong bytes."""
    data = SHARD[: 2 * PART]  # two parts of one length: the damaged answer fits either
    checksum = "sha256:" + hashlib.sha256(data).hexdigest()
    with FaultProxy(server_port(swift_server)) as proxy:
        env = proxied_env(swift_server, proxy, api)
        store = open_store(f"{api}://{swift_container}/damaged", config_for(env, PATIENT_READS))
        store.put("shard.tar", data)
        assert store.get_range("shard.tar", 0, 1) == data[:1]
        proxy.reset_counts()
        proxy.add_rule(206, method="GET", path=r"/damaged/shard\.tar(\?|$)", body=b"\0" * PART)
        with open(parts_cache(tmp_path / "a", store).fetch("shard.tar", len(data), checksum), "rb") as file:
            assert file.read() == data
        assert proxy.count("GET", r"/damaged/shard\.tar$") == 2 * 2  # the whole shard once more

        proxy.reset_counts()
        proxy.add_rule(206, method="GET", path=r"/damaged/shard\.tar(\?|$)", body=b"\0" * PART, times=None)
        with pytest.raises(CorruptShard, match=r"shard\.tar.*fails its checksum"):
            parts_cache(tmp_path / "b", store).fetch("shard.tar", len(data), checksum)
        assert proxy.count("GET", r"/damaged/shard\.tar$") == 2 * 2  # fetched twice, then given up
        proxy.clear()
    assert os.listdir(tmp_path / "b" / "cache" / "tmp") == []


@pytest.mark.parametrize("api", ["swift", "s3"])
def test_parts_through_the_wan_emulator(swift_server, swift_container, tmp_path, api):
    """8 MB at 4 MB/s per connection and 5 ms per request, in 4 parts of 2 MiB: on one
    connection it would take about 2 s, in parts about 0.5 s (shown, not asserted). The
    object is a Swift SLO (3 MB segments) or an S3 multipart upload, so parts cross segments."""
    data = random.Random(7).randbytes(8_000_000)
    checksum = "sha256:" + hashlib.sha256(data).hexdigest()
    direct = swift_server.swift_env() if api == "swift" else swift_server.s3_env()
    segmented = {**direct, "DLSTORE_SEGMENT_SIZE": "3MB"}
    open_store(f"{api}://{swift_container}/wan", config_for(segmented)).put("shard.tar", data)
    with WanProxy(server_port(swift_server), rate=4e6, delay_s=0.005, lifetime_s=120) as wan:
        env = proxied_env(swift_server, wan, api)
        proxied = open_store(f"{api}://{swift_container}/wan", config_for(env, PATIENT_READS))  # one GET a part
        cache = parts_cache(tmp_path, proxied, part_size="2MiB")
        started = time.monotonic()
        with open(cache.fetch("shard.tar", len(data), checksum), "rb") as file:
            assert file.read() == data
        took = time.monotonic() - started
        gets = wan.gets(r"/wan/shard\.tar$")
    assert sorted(_range_of(r)[0] for _, r in gets) == [i * 2 * 2**20 for i in range(4)]
    report(f"wan parts ({api})", parts=len(gets), most_open=wan.most_open, fetch_s=f"{took:.2f}")


@pytest.mark.parametrize("api", ["swift", "s3"])
def test_a_download_longer_than_the_retry_deadline_completes_while_it_moves(
    swift_server, swift_container, tmp_path, api
):
    """Issue 12's "a 1 GB shard at under ~8.5 MB/s kills the run", scaled down: 2 MB at
    300 KB/s per connection (about 7 s) as one GET stream, with a retry deadline of 1 s, and
    the stream cut twice mid-body (the fault proxy in front of the WAN emulator), each cut
    seconds after the deadline had passed since the start. Each attempt that moved bytes
    restarts the budget, so the download resumes from its next byte and completes with its
    checksum. The object is a Swift SLO (512 KB segments) or an S3 multipart upload."""
    data = random.Random(8).randbytes(2_000_000)
    checksum = "sha256:" + hashlib.sha256(data).hexdigest()
    direct = swift_server.swift_env() if api == "swift" else swift_server.s3_env()
    segmented = {**direct, "DLSTORE_SEGMENT_SIZE": "512KB"}
    open_store(f"{api}://{swift_container}/slow", config_for(segmented)).put("shard.tar", data)
    short = RetryConfig(max_attempts=3, initial_backoff_s=0.05, max_backoff_s=0.2, deadline_s=1.0, read_timeout_s=5)
    wan = WanProxy(server_port(swift_server), rate=300e3, delay_s=0.005, lifetime_s=120)
    with wan, FaultProxy(wan.port) as cuts:
        # Chunks of 64 KiB, scaled down with the rest: progress is counted in chunks yielded, and
        # the default 1 MiB would take 3.5 s at this rate (the bytes of a chunk cut short come again).
        scaled = dataclasses.replace(config_for(proxied_env(swift_server, cuts, api), short), chunk_size=64 * 1024)
        store = open_store(f"{api}://{swift_container}/slow", scaled)
        assert store.get_range("shard.tar", 0, 1) == data[:1]  # authenticated
        cuts.reset_counts()
        cuts.add_rule("reset_body", method="GET", path=r"/slow/shard\.tar(\?|$)", times=2)
        started = time.monotonic()
        cache = parts_cache(tmp_path, store, parts_in_flight=1)
        with open(cache.fetch("shard.tar", len(data), checksum), "rb") as file:
            assert file.read() == data
        took = time.monotonic() - started
        assert cuts.injected_kinds() == {"reset_body": 2}
        starts = [_range_of(r)[0] for m, p, r in cuts.log if m == "GET" and p.endswith("/slow/shard.tar")]
    assert len(starts) == 3 and starts[0] == 0 and 0 < starts[1] < starts[2] < len(data)  # resumed, twice
    report(f"slow stream past the deadline ({api})", deadline_s=short.deadline_s, fetch_s=f"{took:.1f}")


# -- case 1: 10% of GETs faulted during 2 epochs on 2 gloo ranks ----------------------------------
# 72 samples in 30 small shards, and a cache of 3 of them: about 150 GETs in the run.
SHARDS = [2, 3, 1, 4, 2, 3, 2, 1, 3, 2, 4, 2, 3, 1, 2, 3, 2, 4, 1, 3, 2, 2, 3, 1, 4, 2, 3, 2, 1, 3]


def _spawn(spec: dict, nprocs: int) -> list[dict]:
    tmp.start_processes(run_rank, args=(spec,), nprocs=nprocs, start_method="spawn")
    records = []
    for rank in range(nprocs):
        with open(f"{spec['out']}/rank-{rank}.json") as file:
            records.append(json.load(file))
    return records


@pytest.mark.slow
@pytest.mark.parametrize("api", ["swift", "s3"])
def test_ten_percent_of_gets_faulted_two_ranks_two_epochs(swift_server, swift_container, tmp_path, api):
    direct = swift_server.swift_env() if api == "swift" else swift_server.s3_env()
    url = f"{api}://{swift_container}/faulty"
    store = open_store(url, config_for(direct))
    keys = write_dataset(store, SHARDS)
    shard_bytes = max(info.size for info in store.list() if info.key.endswith(".tar"))
    spec = dict(
        url=url,
        cache_limit=3 * shard_bytes + 4096,  # a tenth of the data: shards are fetched again and again
        batch_size=4,
        seed=11,
        world_size=2,
        local_world_size=2,
        workers=1,
        epochs=2,
        out=str(tmp_path),
    )
    expected = fault_free_run(url, spec, str(tmp_path / "cache-reference"), config_for(direct))

    with FaultProxy(server_port(swift_server), seed=46, stall_s=STALL_S) as proxy:
        proxy.set_rate(0.1, kinds=ALL_FAULTS, method="GET", cycle=True)
        env = {**proxied_env(swift_server, proxy, api), **retry_env(FAST_RETRY)}
        spec.update(env=env, cache_dir=str(tmp_path / "cache"), init=f"file://{tmp_path}/rdv")
        started = time.monotonic()
        with _CacheSampler(spec["cache_dir"]) as sampler:
            records = _spawn(spec, 2)
        took = time.monotonic() - started
        injected = proxy.injected_kinds()
        gets = proxy.count("GET")

    for rank, record in enumerate(records):
        assert record["epochs"] == expected[rank], f"rank {rank} delivered other samples than the fault-free run"
    for epoch in ("0", "1"):
        delivered = collections.Counter(
            k for r in records for batch in r["epochs"][epoch] for k, padding in batch if not padding
        )
        assert sorted(delivered) == sorted(keys) and set(delivered.values()) == {1}
    # Seeded draws: the same requests are faulted on every run, and they show every kind.
    assert set(injected) == set(ALL_FAULTS), injected
    # Downloads cut off, retried or given up kept the cache within its limit: a download
    # reserves its whole size before it starts, so not even a shard in flight goes over.
    over = sampler.max - spec["cache_limit"]
    assert sampler.samples > 0 and over <= 0, f"{over} bytes over the limit (max {sampler.max})"
    report(f"case 1 ({api})", gets=gets, faults=dict(injected), run_s=f"{took:.1f}", lost=0, repeated=0)


# -- case 2: the Swift server stopped mid-epoch, then started again -------------------------------
def _swift_tool(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SWIFT_SERVER), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture
def own_swift_server(tmp_path_factory):
    """A second Swift server in its own data dir, so stopping it leaves the session's alone.
    Yields (start, stop, env); `start()` brings it back on the same proxy port."""
    data_dir = tmp_path_factory.mktemp("outage-swift")
    started = _swift_tool("start", "--data-dir", str(data_dir), "--stop-with-pid", str(os.getpid()))
    if started.returncode != 0:
        pytest.fail(f"could not start a second Swift server:\n{started.stderr[-3000:]}")
    env = read_env_file(data_dir / "env.sh")
    port = str(urlsplit(env["ST_AUTH"]).port)

    def start() -> float:
        t0 = time.monotonic()
        again = _swift_tool("start", "--data-dir", str(data_dir), "--port", port, "--stop-with-pid", str(os.getpid()))
        assert again.returncode == 0, again.stderr[-3000:]
        return time.monotonic() - t0

    def stop() -> None:
        stopped = _swift_tool("stop", "--data-dir", str(data_dir))
        assert stopped.returncode == 0, stopped.stderr[-3000:]

    try:
        yield start, stop, env
    finally:
        _swift_tool("stop", "--data-dir", str(data_dir))


OUTAGE_S = 20.0  # the 20 s


@pytest.mark.slow
def test_swift_stopped_mid_epoch_then_restarted(own_swift_server, tmp_path):
    start, stop, env = own_swift_server
    swift_env = {k: env[k] for k in ("ST_AUTH", "ST_USER", "ST_KEY")}
    # The default attempt count: the deadline, not a number of tries, decides how long to wait
    # (with the old default of 8 attempts this run gave up after a few seconds of the outage).
    patient = RetryConfig(initial_backoff_s=0.05, max_backoff_s=2.0, deadline_s=60, read_timeout_s=5)
    config = config_for(swift_env, patient)
    swiftclient.Connection(authurl=env["ST_AUTH"], user=env["ST_USER"], key=env["ST_KEY"]).put_container("outage")
    url = "swift://outage/data"
    keys = write_dataset(open_store(url, config), [5] * 10)

    def dataset(cache: str, retry: RetryConfig) -> dlstore.Dataset:
        return dlstore.Dataset(
            url,
            cache_dir=str(tmp_path / cache),
            cache_limit="60KB",  # about 3 shards: the rest are fetched as the epoch goes
            transform="eval",
            image_size=8,
            batch_size=5,
            seed=2,
            world=World(0, 1, 1),
            store_config=config_for(swift_env, retry),
            return_keys=True,
            prefetch_shards=1,
            shuffle_window=1,
        )

    # Within the deadline: stopped after the third batch for OUTAGE_S, then started again.
    loader = dlstore.Loader(dataset("cache-a", patient), num_workers=1, device="cpu")
    delivered: list[str] = []
    outage: dict[str, float] = {}
    longest, last = 0.0, time.monotonic()
    for step, (_, _, meta) in enumerate(loader):
        longest, last = max(longest, time.monotonic() - last), time.monotonic()
        delivered += [k for k, p in zip(meta["keys"], meta["padding"].tolist()) if not p]
        if step == 2:
            stop()
            outage["stopped"] = time.monotonic()
            timer = threading.Timer(OUTAGE_S, lambda: outage.setdefault("restart_s", start()))
            timer.start()
    timer.join()
    waited = time.monotonic() - outage["stopped"]
    assert sorted(delivered) == sorted(keys) and len(delivered) == len(keys)
    assert waited >= OUTAGE_S  # the loader did wait for the server
    report(
        "case 2 (within deadline)",
        outage_s=OUTAGE_S,
        restart_s=f"{outage['restart_s']:.1f}",
        longest_wait_for_a_batch_s=f"{longest:.1f}",
        lost=0,
        repeated=0,
    )

    # Past the deadline: a clear TransientError, not a hang.
    short = RetryConfig(initial_backoff_s=0.05, max_backoff_s=0.5, deadline_s=4, read_timeout_s=2)
    loader = dlstore.Loader(dataset("cache-b", short), num_workers=1, device="cpu")  # manifest read while up
    stop()
    started = time.monotonic()
    error = loader_error(loader, TransientError)
    detected = time.monotonic() - started
    assert detected < 60  # the deadline is 4 s; the worker and the prefetch thread may each spend it
    assert "swift://outage/data" in str(error)  # names what it could not reach (a shard, or the login)
    report("case 2 (past deadline)", deadline_s=short.deadline_s, detected_s=f"{detected:.1f}")
