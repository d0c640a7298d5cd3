"""The storage contract (`dlstore/storage/base.py`), one suite run unchanged on every backend.

Each backend only supplies a `Backend` (the `backend` fixture): a store rooted at a
prefix inside a fresh container/bucket/directory, a store at a container that does
not exist, and a few facts about it. `file://` and `memory://` run everywhere;
`swift://` and `s3://` run against the local Swift server (Swift API and s3api).
"""

from __future__ import annotations

import dataclasses
import io
import multiprocessing
import os
import pickle
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dlstore.config import RetryConfig, S3Config, Secret, StoreConfig, SwiftConfig
from dlstore.errors import ConfigError, DlstoreError, NotFound
from dlstore.storage import Store, open_store
from dlstore.storage.base import connection_failure
from dlstore.storage.registry import split_object_url

pytestmark = pytest.mark.compat  # run again against Debian's Swift 2.30 (tools/run_tests.sh)
REPO_ROOT = Path(__file__).resolve().parents[2]
# Fast retries: the suite never waits on a backoff meant for a real cluster.
TEST_RETRY = RetryConfig(max_attempts=4, initial_backoff_s=0.05, max_backoff_s=0.5, deadline_s=30)


@dataclass
class Backend:
    name: str
    store: Store  # rooted at "<container>/root"
    sibling: Store  # rooted at "<container>/rootx": shares a name prefix with store, not a directory
    missing: Store  # in a container/bucket that does not exist
    segment_size: int  # objects this large or larger go in segments
    containers: bool  # listing or writing into a missing container raises NotFound
    shared_between_processes: bool  # another process sees the same objects


def swift_store_config(server, segment_size: int = 1_000_000, part_size: int = 5 * 2**20) -> StoreConfig:
    """A StoreConfig for the local Swift server's Swift and S3 APIs, built from its environment."""
    config = StoreConfig.from_env(server.env())
    return dataclasses.replace(
        config,
        retry=TEST_RETRY,
        swift=dataclasses.replace(config.swift, segment_size=segment_size),
        s3=dataclasses.replace(
            config.s3,
            multipart_chunk_size=part_size,
            multipart_threshold=part_size,
            # s3api asks Swift for one name more than a page; the test server lists 100 per page.
            list_page_size=min(1000, server.listing_limit - 1),
        ),
    )


def _file_backend(request, tmp_path) -> Backend:
    config = StoreConfig(retry=TEST_RETRY)
    return Backend(
        name="file",
        store=open_store(f"file://{tmp_path}/root", config),
        sibling=open_store(f"file://{tmp_path}/rootx", config),
        missing=open_store(f"file://{tmp_path}/no-such-dir/root", config),
        segment_size=1_000_000,
        containers=False,
        shared_between_processes=True,
    )


def _memory_backend(request, tmp_path) -> Backend:
    config = StoreConfig(retry=TEST_RETRY)
    base = f"memory://dlstore-test-{uuid.uuid4().hex[:12]}"
    request.addfinalizer(lambda: _memory_cleanup(base))
    return Backend(
        name="memory",
        store=open_store(f"{base}/root", config),
        sibling=open_store(f"{base}/rootx", config),
        missing=open_store(f"{base}-missing/root", config),
        segment_size=1_000_000,
        containers=False,
        shared_between_processes=False,  # memory:// lives in one process
    )


def _memory_cleanup(base: str) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    if fs.exists(base):
        fs.rm(base, recursive=True)


def _swift_backend(request, tmp_path) -> Backend:
    server = request.getfixturevalue("swift_server")
    container = request.getfixturevalue("swift_container")
    config = swift_store_config(server, segment_size=1_000_000)
    return Backend(
        name="swift",
        store=open_store(f"swift://{container}/root", config),
        sibling=open_store(f"swift://{container}/rootx", config),
        missing=open_store(f"swift://{container}-missing/root", config),
        segment_size=1_000_000,
        containers=True,
        shared_between_processes=True,
    )


def _s3_backend(request, tmp_path) -> Backend:
    server = request.getfixturevalue("swift_server")
    bucket = request.getfixturevalue("s3_bucket")
    part = 5 * 2**20  # S3's smallest part size
    config = swift_store_config(server, part_size=part)
    return Backend(
        name="s3",
        store=open_store(f"s3://{bucket}/root", config),
        sibling=open_store(f"s3://{bucket}/rootx", config),
        missing=open_store(f"s3://{bucket}-missing/root", config),
        segment_size=part,
        containers=True,
        shared_between_processes=True,
    )


_BACKENDS = {"file": _file_backend, "memory": _memory_backend, "swift": _swift_backend, "s3": _s3_backend}


@pytest.fixture(
    params=[
        "file",
        "memory",
        pytest.param("swift", marks=pytest.mark.swift),
        pytest.param("s3", marks=pytest.mark.swift),
    ]
)
def backend(request, tmp_path) -> Backend:
    return _BACKENDS[request.param](request, tmp_path)


def payload(size: int, seed: int = 0) -> bytes:
    """Deterministic bytes that differ at every offset (so an off-by-one range shows)."""
    block = bytes((i * 7 + seed) % 251 for i in range(251))
    return (block * (size // len(block) + 1))[:size]


def keys(store: Store, prefix: str = "") -> list[str]:
    return [info.key for info in store.list(prefix)]


class OneWayStream(io.RawIOBase):
    """A non-seekable binary stream that hands out odd-sized reads, like a pipe."""

    def __init__(self, data: bytes, step: int = 65_521) -> None:
        self._data = memoryview(data)
        self._step = step

    def readable(self) -> bool:
        return True

    def readinto(self, out) -> int:
        n = min(len(out), self._step, len(self._data))
        out[:n] = self._data[:n]
        self._data = self._data[n:]
        return n


# -- put and get ------------------------------------------------------------------------------
def test_put_get_bytes(backend):
    store = backend.store
    store.put("a/b.bin", b"hello world")
    assert store.get_bytes("a/b.bin") == b"hello world"
    store.put("bytearray.bin", bytearray(b"\x00\x01\x02"))
    store.put("memoryview.bin", memoryview(b"abcdef")[1:4])
    assert store.get_bytes("bytearray.bin") == b"\x00\x01\x02"
    assert store.get_bytes("memoryview.bin") == b"bcd"


def test_put_from_path_file_stream_and_iterator(backend, tmp_path):
    store = backend.store
    data = payload(300_000)
    source = tmp_path / "source.bin"
    source.write_bytes(data)
    store.put("from-str-path", str(source))
    store.put("from-pathlike", source)
    with open(source, "rb") as file:
        file.seek(1000)  # a seekable file is read from where it stands
        store.put("from-file", file)
    store.put("from-stream", OneWayStream(data))
    store.put("from-iterator", iter([data[:1], data[1:70_000], b"", data[70_000:]]))
    store.put("from-generator", (data[i : i + 4096] for i in range(0, len(data), 4096)))
    assert store.get_bytes("from-str-path") == data
    assert store.get_bytes("from-pathlike") == data
    assert store.get_bytes("from-file") == data[1000:]
    assert store.get_bytes("from-stream") == data
    assert store.get_bytes("from-iterator") == data
    assert store.get_bytes("from-generator") == data


def test_get_streams_in_chunks(backend):
    data = payload(3 * backend.store.config.chunk_size + 5)
    backend.store.put("chunked", data)
    chunks = list(backend.store.get("chunked"))
    assert b"".join(chunks) == data
    assert len(chunks) > 1
    assert max(len(chunk) for chunk in chunks) <= backend.store.config.chunk_size


def test_overwrite_replaces_the_object(backend):
    backend.store.put("k", b"first version")
    backend.store.put("k", b"second")
    assert backend.store.get_bytes("k") == b"second"
    assert backend.store.stat("k").size == 6


def test_empty_object(backend):
    store = backend.store
    store.put("empty", b"")
    store.put("empty-iter", iter([]))
    for key in ("empty", "empty-iter"):
        assert store.get_bytes(key) == b""
        assert store.get_range(key, 0, 10) == b""
        assert store.stat(key).size == 0
    assert [(i.key, i.size) for i in store.list("empty")] == [("empty", 0), ("empty-iter", 0)]


def test_unusual_key_names(backend):
    names = ["with space/file name.bin", "unicodé/ключ.txt", "percent%20literal", "plus+and&amp;?.bin"]
    for i, name in enumerate(names):
        backend.store.put(name, bytes([i]) * (i + 1))
    assert keys(backend.store) == sorted(names, key=lambda k: k.encode())
    for i, name in enumerate(names):
        assert backend.store.get_bytes(name) == bytes([i]) * (i + 1)
        assert backend.store.stat(name).size == i + 1


# -- ranges -------------------------------------------------------------------------------------
def test_get_range(backend):
    data = payload(10_000)
    backend.store.put("r", data)
    get_range = backend.store.get_range
    assert get_range("r", 0, 100) == data[:100]  # start
    assert get_range("r", 4321, 1234) == data[4321:5555]  # middle
    assert get_range("r", 9_900, 100) == data[9_900:]  # end, exactly
    assert get_range("r", 9_990, 100) == data[9_990:]  # past the end: the tail only
    assert get_range("r", 10_000, 10) == b""  # at the end: nothing
    assert get_range("r", 20_000, 10) == b""  # beyond it: nothing
    assert get_range("r", 5, 0) == b""
    assert get_range("r", 0, 10_000) == data
    assert b"".join(backend.store.get("r", 9_000)) == data[9_000:]  # open-ended
    assert b"".join(backend.store.get("r", 10, 20)) == data[10:20]


def test_get_ranges(backend):
    """Several spans in one call (one GET for up to `ranges_per_get` of them, multipart/byteranges
    on Swift): each span's bytes exactly as `get_range` gives them, in a plain object and in a
    segmented one (a span across a segment boundary included)."""
    data = payload(10_000)
    backend.store.put("r", data)
    spans = [(0, 10), (100, 1), (4321, 1234), (5555, 5), (9_990, 100), (20_000, 10)]
    assert backend.store.get_ranges("r", spans) == [
        data[0:10],
        data[100:101],
        data[4321:5555],
        data[5555:5560],
        data[9_990:],
        b"",
    ]
    assert backend.store.get_ranges("r", [(7, 3)]) == [data[7:10]]
    assert backend.store.get_ranges("r", [(0, 10), (20_000, 10)]) == [data[:10], b""]  # one inside: a plain 206
    most = [(i * 150, 100) for i in range(max(2, backend.store.ranges_per_get))]
    assert backend.store.get_ranges("r", most) == [data[start : start + n] for start, n in most]
    big = payload(2 * backend.segment_size + 17, seed=3)
    backend.store.put("big", big)
    edge = backend.segment_size
    spans = [(0, 5), (edge - 2, 4), (2 * edge - 1, 2), (len(big) - 3, 10)]
    assert backend.store.get_ranges("big", spans) == [big[start : start + n] for start, n in spans]


def test_invalid_ranges_and_keys_are_config_errors(backend):
    backend.store.put("x", b"x")
    with pytest.raises(ConfigError):
        list(backend.store.get("x", 5, 2))
    with pytest.raises(ConfigError):
        list(backend.store.get("x", -1))
    for bad in ("", "/abs", "a//b", "dir/", "a/../b", "./a"):
        with pytest.raises(ConfigError):
            backend.store.put(bad, b"x")


# -- listing ------------------------------------------------------------------------------------
LISTED = [
    "a-b",
    "a.b",
    "a/1",
    "a/10",
    "a/2",
    "a/z/deep.bin",
    "ab",
    "b",
    "shard-000001.tar",
    "shard-000010.tar",
    "shard-00x/inner",
    "shard-1.tar",
]


def test_list_order_and_prefixes(backend):
    store = backend.store
    for i, key in enumerate(reversed(LISTED)):
        store.put(key, b"x" * i)
    backend.sibling.put("a/outside-the-root", b"not mine")

    infos = list(store.list())
    assert [i.key for i in infos] == LISTED  # byte order, and nothing from the sibling root
    sizes = {i.key: i.size for i in infos}
    assert sizes == {key: len(LISTED) - 1 - LISTED.index(key) for key in LISTED}
    assert keys(store, "a/") == ["a/1", "a/10", "a/2", "a/z/deep.bin"]
    assert keys(store, "a") == ["a-b", "a.b", "a/1", "a/10", "a/2", "a/z/deep.bin", "ab"]
    assert keys(store, "a/1") == ["a/1", "a/10"]
    assert keys(store, "a/z/") == ["a/z/deep.bin"]
    # A prefix that is not a directory boundary.
    assert keys(store, "shard-00") == ["shard-000001.tar", "shard-000010.tar", "shard-00x/inner"]
    assert keys(store, "shard-000001.tar") == ["shard-000001.tar"]
    assert keys(store, "nothing-here") == []
    assert keys(store, "a/nothing/") == []
    assert keys(backend.sibling) == ["a/outside-the-root"]


def test_list_is_lazy(backend):
    for i in range(3):
        backend.store.put(f"lazy/{i}", b"x")
    listing = backend.store.list("lazy/")
    assert iter(listing) is listing  # an iterator, fetched page by page, not a list
    assert next(listing).key == "lazy/0"
    listing.close()  # and it can be abandoned half-way


# -- stat, delete, missing things ------------------------------------------------------------------
def test_stat(backend):
    backend.store.put("s/obj", payload(1234))
    info = backend.store.stat("s/obj")
    assert (info.key, info.size) == ("s/obj", 1234)
    assert backend.store.exists("s/obj")
    assert not backend.store.exists("s/other")


def test_delete(backend):
    store = backend.store
    store.put("d/1", b"1")
    store.put("d/2", b"2")
    store.delete("d/1")
    assert keys(store, "d/") == ["d/2"]
    with pytest.raises(NotFound):
        store.get_bytes("d/1")
    with pytest.raises(NotFound):
        store.delete("d/1")


def test_missing_key_is_not_found(backend):
    store = backend.store
    store.put("present", b"x")
    with pytest.raises(NotFound):
        store.get_bytes("absent")
    with pytest.raises(NotFound):
        store.get_range("absent", 0, 10)
    with pytest.raises(NotFound):
        store.stat("absent")
    with pytest.raises(NotFound):
        store.delete("absent")
    with pytest.raises(NotFound):
        store.stat("present/below")


def test_missing_container_is_not_found(backend):
    missing = backend.missing
    with pytest.raises(NotFound):
        missing.get_bytes("x")
    with pytest.raises(NotFound):
        missing.stat("x")
    with pytest.raises(NotFound):
        missing.delete("x")
    if backend.containers:
        with pytest.raises(NotFound, match="does not exist"):  # not a bare "HTTP 404"
            list(missing.list())
        with pytest.raises(NotFound):
            missing.put("x", b"x")  # containers and buckets are not made behind your back
    else:
        assert list(missing.list()) == []


# -- large objects ---------------------------------------------------------------------------------
def test_large_object_in_segments(backend, tmp_path):
    store = backend.store
    seg = backend.segment_size
    data = payload(2 * seg + seg // 2 + 17, seed=3)  # three segments, the last one short
    store.put("big/from-bytes", data)
    assert store.get_bytes("big/from-bytes") == data
    source = tmp_path / "big.bin"
    source.write_bytes(data)
    store.put("big/from-file", source)
    store.put("big/from-stream", OneWayStream(data, step=300_007))
    for key in ("big/from-bytes", "big/from-file", "big/from-stream"):
        assert store.stat(key).size == len(data)
        # Across the first segment boundary, and the tail of the last segment.
        assert store.get_range(key, seg - 1000, 2000) == data[seg - 1000 : seg + 1000]
        assert store.get_range(key, 2 * seg - 1, len(data)) == data[2 * seg - 1 :]
    assert store.get_bytes("big/from-stream") == data
    assert [(i.key, i.size) for i in store.list("big/")] == [
        ("big/from-bytes", len(data)),
        ("big/from-file", len(data)),
        ("big/from-stream", len(data)),
    ]
    # Exactly one segment's worth, and a small object over a large one.
    store.put("big/exact", data[:seg])
    assert store.get_bytes("big/exact") == data[:seg]
    store.put("big/from-bytes", b"small now")
    assert store.get_bytes("big/from-bytes") == b"small now"
    store.delete("big/from-file")
    assert not store.exists("big/from-file")


# -- pickling and processes ------------------------------------------------------------------------
_CHILD = """
import pickle, sys
store = pickle.load(sys.stdin.buffer)
if store.exists("from-parent"):
    sys.stdout.buffer.write(store.get_bytes("from-parent"))
store.put("from-child", b"written by the child")
sys.stdout.buffer.write(b"|" + store.get_bytes("from-child"))
"""


def test_store_pickles_into_a_fresh_process(backend):
    store = backend.store
    store.put("from-parent", b"written by the parent")  # the client exists now; it must not pickle
    blob = pickle.dumps(store)
    clone = pickle.loads(blob)
    assert repr(clone) == repr(store)
    assert clone.get_bytes("from-parent") == b"written by the parent"

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", _CHILD], input=blob, capture_output=True, env=env, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    if backend.shared_between_processes:
        assert result.stdout == b"written by the parent|written by the child"
        assert store.get_bytes("from-child") == b"written by the child"
    else:
        assert result.stdout == b"|written by the child"


def _read_in_child(store: Store, key: str, queue) -> None:
    try:
        queue.put(store.get_bytes(key))
    except BaseException as exc:  # report, never hang the parent
        queue.put(repr(exc))


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_store_works_after_fork(backend):
    store = backend.store
    store.put("forked", payload(50_000))
    assert store.get_bytes("forked") == payload(50_000)  # connection open in the parent
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_read_in_child, args=(store, "forked", queue))
    child.start()
    try:
        assert queue.get(timeout=60) == payload(50_000)
    finally:
        child.join(timeout=30)
    assert child.exitcode == 0
    assert store.get_bytes("forked") == payload(50_000)  # and the parent's client still works


def test_parallel_threads_share_a_store(backend):
    from concurrent.futures import ThreadPoolExecutor

    store = backend.store

    def roundtrip(i: int) -> bytes:
        store.put(f"t/{i:02d}", payload(10_000 + i, seed=i))
        return store.get_bytes(f"t/{i:02d}")

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(roundtrip, range(16)))
    assert results == [payload(10_000 + i, seed=i) for i in range(16)]
    assert keys(store, "t/") == [f"t/{i:02d}" for i in range(16)]


def test_config_secrets_survive_pickling():
    config = StoreConfig(swift=SwiftConfig(key=Secret("k")), s3=S3Config(secret_access_key=Secret("s")))
    clone = pickle.loads(pickle.dumps(config))
    assert clone.swift.key.reveal() == "k"
    assert clone.s3.secret_access_key.reveal() == "s"


# -- fsspec over plain HTTP (read-only, no range requests) -------------------------------------------
@pytest.fixture
def http_root(tmp_path) -> Iterator[str]:
    import functools
    import http.server
    import threading

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_fsspec_http_is_readable(tmp_path, http_root):
    pytest.importorskip("aiohttp")
    data = payload(3 * 2**20 + 11)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "obj.bin").write_bytes(data)
    store = open_store(f"{http_root}/d", StoreConfig(retry=TEST_RETRY))
    assert store.get_bytes("obj.bin") == data
    # Python's http.server ignores Range: the store streams from byte 0 and skips ahead.
    assert store.get_range("obj.bin", 2**20 - 5, 10) == data[2**20 - 5 : 2**20 + 5]
    assert store.stat("obj.bin").size == len(data)
    with pytest.raises(NotFound):
        store.get_bytes("absent.bin")
    with pytest.raises(DlstoreError):
        store.put("new.bin", b"read-only")


def test_a_url_a_slash_short_or_with_a_mistyped_scheme_is_refused_not_taken_for_a_folder(tmp_path, monkeypatch):
    """`swift:/data/train` is a slash short of a store: taken as a path it wrote the dataset
    into a folder named "swift:" in the working directory, and said nothing."""
    monkeypatch.chdir(tmp_path)
    for url, meant in [("swift:/data/train", "swift://data/train"), ("s3:bucket/x", "s3://bucket/x")]:
        with pytest.raises(ConfigError, match=f"did you mean {meant}"):
            open_store(url)
    with pytest.raises(ConfigError, match="did you mean swift://"):
        split_object_url("swift:/data/train/shard-000000.tar")
    with pytest.raises(ConfigError, match=r"unknown storage scheme swfit:// .*did you mean swift://"):
        open_store("swfit://data/train")
    with pytest.raises(ConfigError, match=r"unknown storage scheme nosuch://.*s3://, swift://"):
        open_store("nosuch://data")
    assert list(tmp_path.iterdir()) == []  # nothing written anywhere
    assert open_store("memory://x").url.startswith("memory://")  # fsspec's own schemes still work
    assert open_store("data:2024").url == f"file://{tmp_path}/data:2024"  # a colon in a folder's name
    assert open_store("file:/data/train").url == "file:///data/train"  # a file URI's short form


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_local_objects_get_the_permissions_the_umask_gives(tmp_path, umask):
    """A dataset converted into a shared (NFS) folder is for the team to read: the objects
    get what the umask allows, as files that any tool writes there, not a temp file's 0600."""
    store = open_store(str(tmp_path / "store"))
    old = os.umask(umask)
    try:
        store.put("train/shard-000000.tar", b"x" * 1000)
        store.put("index.json", io.BytesIO(b"{}"))
    finally:
        os.umask(old)
    for key in ("train/shard-000000.tar", "index.json"):
        assert (tmp_path / "store" / key).stat().st_mode & 0o777 == 0o666 & ~umask
    assert not [p for p in (tmp_path / "store").rglob(".dlstore-tmp-*")]


def test_a_failed_connection_is_named_by_host_port_and_reason_only():
    """`ls` against a store that is down said only 'ConnectionError'; now where and why, and
    nothing else of the request (no path, no query: a signed URL's signature)."""
    import botocore.exceptions
    import requests

    with pytest.raises(requests.exceptions.ConnectionError) as refused:
        requests.get("http://127.0.0.1:1/v1/AUTH_x/c/o?temp_url_sig=SECRET", timeout=5)
    assert connection_failure(refused.value) == " (127.0.0.1:1: Connection refused)"
    s3 = botocore.exceptions.EndpointConnectionError(endpoint_url="http://10.0.0.9:8080/b/k?X-Amz-Signature=SECRET")
    assert connection_failure(s3) == " (10.0.0.9:8080)"
    assert connection_failure(ValueError("nothing to go by")) == ""


# -- S3 error mapping, without a server (botocore's Stubber answers) ---------------------------------
@pytest.fixture
def stubbed_s3():
    from botocore.stub import Stubber

    config = StoreConfig(
        retry=RetryConfig(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02, deadline_s=5),
        s3=S3Config(endpoint_url="http://127.0.0.1:9", access_key_id="id", secret_access_key=Secret("secret")),
    )
    store = open_store("s3://bucket/p", config)
    with Stubber(store.client) as stubber:
        yield store, stubber


def test_s3_errors_map_to_the_contract(stubbed_s3):
    from dlstore.errors import AuthError, TransientError

    store, stubber = stubbed_s3
    stubber.add_client_error("head_object", "403", "Forbidden", 403)
    with pytest.raises(AuthError):
        store.stat("k")
    for _ in range(3):  # every attempt of the policy, then the error
        stubber.add_client_error("head_object", "SlowDown", "Reduce your request rate", 503)
    with pytest.raises(TransientError, match="SlowDown"):
        store.stat("k")
    stubber.add_client_error("head_object", "InternalError", "oops", 500)
    stubber.add_response("head_object", {"ContentLength": 7, "ETag": '"abc"'})
    assert store.stat("k").size == 7  # a 5xx is retried
    stubber.add_client_error("list_objects_v2", "NoSuchBucket", "no bucket", 404)
    with pytest.raises(NotFound):
        list(store.list())
    stubber.assert_no_pending_responses()


def test_s3_listing_limit_hint(stubbed_s3):
    # Swift's s3api asks the cluster for MaxKeys + 1 names; a cluster whose
    # container_listing_limit is lower answers 412, which s3api reports as InternalError.
    store, stubber = stubbed_s3
    stubber.add_client_error("list_objects_v2", "InternalError", "unexpected status code 412", 500)
    with pytest.raises(ConfigError, match="DLSTORE_S3_LIST_PAGE_SIZE"):
        list(store.list())
