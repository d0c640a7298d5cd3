"""Storage edges that once went wrong: HTTP error answers through fsspec's `http://` (typed and
retried, not all `NotFound`), Swift puts of unknown size past the SLO segment limit, and host
names that do not exist (not retried)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dlstore.config import RetryConfig, StoreConfig
from dlstore.errors import AuthError, ConfigError, NotFound, ObjectChanged, TransientError
from dlstore.storage import open_store
from dlstore.storage import s3 as s3_module
from dlstore.storage.stall import ConnectionRegistry, StallWatch
from dlstore.storage.swift import SwiftStore
from dlstore.storage.swift.upload import MAX_SEGMENT_SIZE
from dlstore.storage.transfer import copy_object
from tests.storage.test_store_contract import payload, swift_store_config

FAST_RETRY = RetryConfig(initial_backoff_s=0.01, max_backoff_s=0.05, deadline_s=5)
BODY = (bytes(range(256)) * 20)[:5000]


# -- fsspec http:// -----------------------------------------------------------------------------------
@contextmanager
def http_server(
    head_status: int = 200, get_failures: int = 0, get_status: int = 503, stalled_gets: int = 0
) -> Iterator[dict]:
    """A server of one 5000-byte object at any path: HEAD answers `head_status` (the object's
    size when 200), GET answers `get_status` for its first `get_failures` requests (and for all
    of them when HEAD does not answer 200), then the bytes; its first `stalled_gets` GETs send
    their head and 100 bytes, then nothing until the server is shut down. Yields its URL and
    request counts."""
    state = {"gets": 0, "heads": 0}
    shut = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _fail(self, status: int) -> None:
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_HEAD(self) -> None:
            state["heads"] += 1
            if head_status != 200:
                return self._fail(head_status)
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY)))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()

        def do_GET(self) -> None:
            state["gets"] += 1
            if head_status != 200:
                return self._fail(head_status)
            if state["gets"] <= get_failures:
                return self._fail(get_status)
            start, end = 0, len(BODY)
            wanted = self.headers.get("Range")
            if wanted:
                first, _, last = wanted.removeprefix("bytes=").partition("-")
                start, end = int(first), min(int(last) + 1 if last else len(BODY), len(BODY))
            self.send_response(206 if wanted else 200)
            if wanted:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(BODY)}")
            self.send_header("Content-Length", str(end - start))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            if state["gets"] <= stalled_gets:
                self.wfile.write(BODY[start : start + 100])
                self.wfile.flush()
                shut.wait(600)
                return
            self.wfile.write(BODY[start:end])

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield {"url": f"http://127.0.0.1:{server.server_address[1]}/data", "state": state}
    finally:
        shut.set()
        server.shutdown()
        server.server_close()


def test_http_get_answering_503_is_retried():
    """Two 503s to GET then the bytes: a transient failure, retried, not an untyped error."""
    with http_server(get_failures=2) as server:
        store = open_store(server["url"], StoreConfig(retry=FAST_RETRY))
        assert store.get_bytes("obj.bin") == BODY
        assert server["state"]["gets"] >= 3


def test_http_get_answering_503_for_good_is_a_transient_error():
    with http_server(get_failures=10**6) as server:
        store = open_store(server["url"], StoreConfig(retry=RetryConfig(max_attempts=2, initial_backoff_s=0.01)))
        with pytest.raises(TransientError, match="HTTP 503"):
            store.get_bytes("obj.bin")


def test_an_http_get_that_stalls_is_cut_after_the_read_timeout_and_retried():
    """fsspec's http:// waited on a stalled answer for aiohttp's default of 5 minutes, whatever
    `read_timeout_s` said, and that same default cut any answer longer than 5 minutes (a
    whole shard from a server without range requests, on a slow link). Now a GET is cut
    after `read_timeout_s` without a byte and retried; a long answer is not cut."""
    retry = RetryConfig(initial_backoff_s=0.01, max_backoff_s=0.05, deadline_s=30, read_timeout_s=1)
    with http_server(stalled_gets=1) as server:
        store = open_store(server["url"], StoreConfig(retry=retry))
        timeouts = store.fs.client_kwargs["timeout"]
        assert timeouts.total is None and timeouts.sock_read == 1 and timeouts.sock_connect == retry.connect_timeout_s
        got: list = []
        reader = threading.Thread(target=lambda: got.append(store.get_bytes("obj.bin")), daemon=True)
        reader.start()
        reader.join(60)  # the 5-minute default would still wait here
        assert not reader.is_alive(), "the stalled GET was not cut"
        assert got == [BODY] and server["state"]["gets"] >= 2


@pytest.mark.parametrize(
    ("status", "error"), [(503, TransientError), (401, AuthError), (403, AuthError), (404, NotFound)]
)
def test_http_error_answers_keep_their_kind(status, error):
    """fsspec reports any failed HEAD as FileNotFoundError: only a 404 may become NotFound."""
    retry = RetryConfig(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=0.05, deadline_s=5)
    with http_server(head_status=status) as server:
        store = open_store(server["url"], StoreConfig(retry=retry))
        with pytest.raises(error) as stat_error:
            store.stat("obj.bin")
        with pytest.raises(error) as get_error:
            store.get_bytes("obj.bin")
        assert type(stat_error.value) is error and type(get_error.value) is error
        if status == 404:
            assert not store.exists("obj.bin")
        else:
            assert f"HTTP {status}" in str(get_error.value)
            with pytest.raises(error):  # a server that fails is not a missing object
                store.exists("obj.bin")


# -- Swift: puts of unknown size ----------------------------------------------------------------------
def _pieces(data: bytes, size: int) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def _manifest(conn, container: str, name: str) -> list[dict]:
    headers, body = conn.get_object(container, name, query_string="multipart-manifest=get")
    assert headers.get("x-static-large-object") == "True"
    return json.loads(body)


SEGMENT = 2**20  # Swift's smallest SLO segment in older releases (min_segment_size)


def cluster_limits(monkeypatch, segments: int, segment_size: int = MAX_SEGMENT_SIZE) -> None:
    """A Swift cluster whose /info says a manifest lists at most `segments` segments of at most
    `segment_size` bytes (the local server says Swift's defaults; `tests/integration/test_faults.py`
    tests the asking of /info itself)."""
    monkeypatch.setattr(SwiftStore, "_slo_limits", lambda self: (segments, segment_size))


def test_swift_streamed_put_past_the_segment_limit(swift_server, swift_container, monkeypatch):
    """An iterator (size unknown) of more than max-segments x segment_size bytes: the segments
    grow as it goes, so the manifest stays within the limit; overwrite and delete clean up."""
    cluster_limits(monkeypatch, segments=4)
    config = swift_store_config(swift_server, segment_size=SEGMENT)
    store = open_store(f"swift://{swift_container}/edge", config)
    data = payload(6 * SEGMENT + 12345, seed=21)  # six full segments of the configured size, and more
    store.put("obj", _pieces(data, 256 * 1024))
    assert store.get_bytes("obj") == data

    conn = swift_server.swift_connection()
    manifest = _manifest(conn, swift_container, "edge/obj")
    assert len(manifest) <= 4
    sizes = [entry["bytes"] for entry in manifest]
    assert sum(sizes) == len(data) and all(size >= SEGMENT for size in sizes[:-1])

    def segments() -> list[str]:
        return [item["name"] for item in conn.get_container(f"{swift_container}_segments", prefix="edge/obj/")[1]]

    assert len(segments()) == len(manifest)
    smaller = payload(3 * SEGMENT + 5, seed=22)
    store.put("obj", _pieces(smaller, 256 * 1024))  # an overwrite drops the old segments
    assert store.get_bytes("obj") == smaller
    assert len(segments()) == len(_manifest(conn, swift_container, "edge/obj"))
    store.delete("obj")
    assert not store.exists("obj")
    assert segments() == []


def test_swift_put_too_large_for_any_manifest_fails_clearly(swift_server, swift_container, monkeypatch):
    """A stream larger than max-segments of the largest segment: a ConfigError saying so, and no
    object or segment left behind."""
    cluster_limits(monkeypatch, segments=2, segment_size=SEGMENT)
    config = swift_store_config(swift_server, segment_size=SEGMENT)
    store = open_store(f"swift://{swift_container}/edge", config)
    data = payload(2 * SEGMENT + 1, seed=23)
    with pytest.raises(ConfigError, match="segments"):
        store.put("streamed", _pieces(data, 256 * 1024))
    with pytest.raises(ConfigError, match="segments"):
        store.put("sized", data)  # size known: refused before any upload
    assert not store.exists("streamed") and not store.exists("sized")
    conn = swift_server.swift_connection()
    assert conn.get_container(f"{swift_container}_segments")[1] == []


# -- S3: multipart uploads within the server's part limit ----------------------------------------------
def test_s3_part_limit_is_within_the_servers(swift_server):
    """Swift's S3 API takes at most `max_upload_part_num` parts (1,000 by default; AWS 10,000):
    with 10,000 assumed, an upload past 1,000 parts (64 GB at the default part size) failed at
    part 1,001, after all that was sent."""
    import urllib.request

    with urllib.request.urlopen(swift_server.s3_endpoint.rstrip("/") + "/info", timeout=10) as answer:
        limits = json.load(answer)["s3api"]
    assert limits["max_upload_part_num"] >= s3_module._MAX_PARTS, limits


@pytest.mark.parametrize("bucket", ["Bad_Bucket", "ab", "bad..name"])
def test_a_bucket_name_that_s3_refuses_says_why(swift_server, bucket):
    """S3 answers a HEAD in a bucket whose name breaks its rules with a bare "400 Bad Request"
    (a HEAD's answer has no body): `ls`, `convert` and a loader said no more. They now say
    that the name breaks S3's naming rules, and how, as a ConfigError (not retried)."""
    store = open_store(f"s3://{bucket}/x", swift_store_config(swift_server))
    for read in (lambda: store.exists("index.json"), lambda: store.get_bytes("index.json"), store.ensure_container):
        with pytest.raises(ConfigError, match="naming rules") as caught:
            read()
        assert f"s3://{bucket}" in str(caught.value)


def test_a_bucket_name_within_s3s_rules_is_not_blamed():
    for name in ("abc", "my-bucket.v2", "a" * 63, "0-data"):
        assert s3_module._bucket_name_fault(f"s3://{name}/k") is None, name
    for name in ("a" * 64, "-data", "data-", "1.2.3.4", "Data", "a.-b", "a-.b", "a..b"):
        assert s3_module._bucket_name_fault(f"s3://{name}/k") is not None, name


def _parts_of(swift_server, bucket: str, key: str) -> int:
    etag = swift_server.s3_client().head_object(Bucket=bucket, Key=key)["ETag"].strip('"')
    return int(etag.rsplit("-", 1)[1]) if "-" in etag else 1


def test_s3_streamed_put_past_the_part_limit(swift_server, s3_bucket, monkeypatch):
    """An iterator (size unknown) of more than max-parts x part size: the parts grow as it goes,
    so the upload stays within the limit; a sized put makes its parts large enough up front."""
    monkeypatch.setattr(s3_module, "_MAX_PARTS", 3)
    part = 5 * 2**20  # S3's smallest part
    store = open_store(f"s3://{s3_bucket}/edge", swift_store_config(swift_server, part_size=part))
    data = payload(4 * part + 4321, seed=25)  # four full parts of the configured size, and more
    store.put("streamed", _pieces(data, 256 * 1024))
    assert store.get_bytes("streamed") == data
    assert _parts_of(swift_server, s3_bucket, "edge/streamed") <= 3
    store.put("sized", data)
    assert store.get_bytes("sized") == data and _parts_of(swift_server, s3_bucket, "edge/sized") == 3


def test_s3_put_too_large_for_any_upload_fails_clearly(swift_server, s3_bucket, monkeypatch):
    """More than max-parts of the largest part: a ConfigError saying so, and no object or
    unfinished upload left behind."""
    monkeypatch.setattr(s3_module, "_MAX_PARTS", 2)
    monkeypatch.setattr(s3_module, "_MAX_PART", 5 * 2**20)
    part = 5 * 2**20
    store = open_store(f"s3://{s3_bucket}/edge", swift_store_config(swift_server, part_size=part))
    data = payload(2 * part + 1, seed=26)
    with pytest.raises(ConfigError, match="parts"):
        store.put("streamed", _pieces(data, 256 * 1024))
    with pytest.raises(ConfigError, match="parts"):
        store.put("sized", data)  # size known: refused before any upload
    assert not store.exists("streamed") and not store.exists("sized")
    assert swift_server.s3_client().list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


def test_copy_object_to_swift_uses_the_source_size(swift_server, swift_container, monkeypatch, tmp_path):
    """`dlstore cp` knows the source's size: the segments are sized for it up front (even,
    within the limit) instead of growing as for a stream of unknown length."""
    cluster_limits(monkeypatch, segments=4)
    data = payload(6 * SEGMENT + 7, seed=24)
    source = open_store(f"file://{tmp_path}/src", StoreConfig(retry=FAST_RETRY))
    source.put("big.bin", data)
    config = swift_store_config(swift_server, segment_size=SEGMENT)
    progress: list[int] = []
    with monkeypatch.context() as env:
        for name, value in swift_server.swift_env().items():
            env.setenv(name, value)
        env.setenv("DLSTORE_SEGMENT_SIZE", str(SEGMENT))
        dst_store, dst_key = copy_object(source, "big.bin", f"swift://{swift_container}/copy/", progress.append)
    assert dst_key == "big.bin" and sum(progress) == len(data)
    store = open_store(f"swift://{swift_container}/copy", config)
    assert store.get_bytes("big.bin") == data
    sizes = [entry["bytes"] for entry in _manifest(swift_server.swift_connection(), swift_container, "copy/big.bin")]
    assert len(sizes) == 4 and len(set(sizes[:-1])) == 1 and sizes[0] == -(-len(data) // 4)


def test_a_copied_source_reads_as_a_file_that_can_start_again(tmp_path):
    """The copy's source, given to a put as a sized file: a put that starts again (a seek back)
    reads the same bytes anew, progress counts each byte once, a changed source is refused."""
    from dlstore.storage.transfer import _SourceReader  # here: the module's other tests run without it

    data = payload(300_000, seed=25)
    store = open_store(f"file://{tmp_path}/src", StoreConfig(retry=FAST_RETRY))
    store.put("a.bin", data)
    progress: list[int] = []
    reader = _SourceReader(store, "a.bin", len(data), progress.append)
    assert reader.read(1000) == data[:1000]
    assert reader.seek(0, 2) == len(data) and reader.seek(1000) == 1000  # a size probe reads nothing
    assert reader.read(2000) == data[1000:3000]
    reader.seek(0)
    assert reader.readall() == data and reader.read(10) == b""
    assert sum(progress) == len(data)
    store.put("a.bin", data + b"more")
    with pytest.raises(ObjectChanged):
        _SourceReader(store, "a.bin", len(data), None).readall()
    store.put("a.bin", data[:-1])
    with pytest.raises(ObjectChanged):
        _SourceReader(store, "a.bin", len(data), None).readall()


# -- a host name that does not exist --------------------------------------------------------------------
NO_SUCH_HOST = "no-such-host.invalid"
UNKNOWN_HOST_STORES = {
    "swift tempauth": ("swift://c/p", dict(auth_url=f"http://{NO_SUCH_HOST}:8080/auth/v1.0", user="a:b")),
    "swift keystone": ("swift://c/p", dict(auth_url=f"http://{NO_SUCH_HOST}:5000/v3", auth_version="3", user="u")),
    "swift storage url": ("swift://c/p", dict(storage_url=f"http://{NO_SUCH_HOST}:8080/v1/AUTH_x")),
    "s3": ("s3://b/p", None),
    "http": (f"http://{NO_SUCH_HOST}:8080/x", None),
}


def unknown_host_store(kind: str, retry: RetryConfig):
    from dlstore.config import S3Config, Secret, SwiftConfig

    url, swift = UNKNOWN_HOST_STORES[kind]
    if swift is not None:
        secrets = dict(key=Secret("k"), project_name="p", user_domain_name="Default", project_domain_name="Default")
        if "storage_url" in swift:
            secrets = dict(auth_token=Secret("t"))
        return open_store(url, StoreConfig(retry=retry, swift=SwiftConfig(**swift, **secrets)))
    s3 = S3Config(endpoint_url=f"http://{NO_SUCH_HOST}:8080", access_key_id="a", secret_access_key=Secret("b"))
    return open_store(url, StoreConfig(retry=retry, s3=s3))


@pytest.fixture
def resolver(monkeypatch):
    """The system resolver, except for `NO_SUCH_HOST`, which gets the answer set in the returned
    dict (NXDOMAIN by default): the test must not hang on whatever DNS the machine has."""
    import socket

    answer = {"errno": socket.EAI_NONAME, "asked": 0}
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if host == NO_SUCH_HOST:
            answer["asked"] += 1
            raise socket.gaierror(answer["errno"], "Name or service not known")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return answer


def read_something(store, url: str) -> None:
    if url.startswith("http"):
        store.get_bytes("x")
    else:
        list(store.list(""))


@pytest.mark.parametrize("kind", sorted(UNKNOWN_HOST_STORES))
def test_a_host_name_that_does_not_exist_is_a_config_error_at_once(resolver, kind):
    """A typo in an endpoint's host name is not retried: it was, until the deadline (two minutes
    of warnings by default), as if the store were down."""
    store = unknown_host_store(kind, RetryConfig(initial_backoff_s=0.5, max_backoff_s=1, deadline_s=30))
    with pytest.raises(ConfigError, match="no such host") as caught:
        read_something(store, UNKNOWN_HOST_STORES[kind][0])
    assert resolver["asked"] <= 3, resolver  # urllib3/aiohttp may ask for each address family; no retry
    assert NO_SUCH_HOST in str(caught.value)  # the error names the host to check


@pytest.mark.parametrize("kind", ["swift tempauth", "s3", "http"])
def test_a_resolver_that_cannot_answer_now_is_retried(resolver, kind):
    """EAI_AGAIN (no DNS server reachable, for now) may pass: it is retried, then a TransientError."""
    import socket

    resolver["errno"] = socket.EAI_AGAIN
    store = unknown_host_store(kind, FAST_RETRY.__class__(initial_backoff_s=0.01, max_backoff_s=0.05, deadline_s=1))
    with pytest.raises(TransientError):
        read_something(store, UNKNOWN_HOST_STORES[kind][0])
    assert resolver["asked"] >= 2


def test_an_http_server_that_is_down_is_retried_not_not_found():
    """fsspec's http turns a failed HEAD into FileNotFoundError whatever the cause: a server
    down (connection refused) was `NotFound`, which is never retried."""
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens once the socket is closed
    store = open_store(f"http://127.0.0.1:{port}/x", StoreConfig(retry=FAST_RETRY.__class__(deadline_s=0.5)))
    with pytest.raises(TransientError, match="ClientConnectorError|ConnectionError"):
        store.get_bytes("y")
    with http_server(head_status=404) as server, pytest.raises(NotFound):
        open_store(server["url"], StoreConfig(retry=FAST_RETRY)).get_bytes("y")


def test_credentials_in_an_fsspec_url_are_in_no_message_log_or_repr(caplog):
    """A password in an http URL, or a presigned URL's signature and token, were printed whole
    in errors, retry warnings and the store's repr."""
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    secrets = ("URLPASS_h7", "SIG_9f2", "TOKEN_77")
    url = f"http://alice:{secrets[0]}@127.0.0.1:{port}/data?X-Amz-Signature={secrets[1]}&X-Amz-Security-Token={secrets[2]}"
    store = open_store(url, StoreConfig(retry=RetryConfig(initial_backoff_s=0.01, max_backoff_s=0.02, deadline_s=0.3)))
    with caplog.at_level("DEBUG"), pytest.raises(TransientError) as caught:
        store.get_bytes("y")
    said = " ".join([str(caught.value), repr(store), store.url, caplog.text])
    assert not [secret for secret in secrets if secret in said], said
    assert "alice:***@127.0.0.1" in str(caught.value)


# -- the stall watch --------------------------------------------------------------------------------
def test_the_stall_watch_cuts_a_long_wait_for_the_server_and_never_a_slow_consumer():
    watch = StallWatch(timeout_s=0.3)
    cuts: list[str] = []
    slow_server = watch.watch(lambda: cuts.append("server"))
    slow_consumer = watch.watch(lambda: cuts.append("consumer"))
    for _ in range(4):  # 1.2 s in all, each wait for the server 0.05 s: the rest is the consumer's
        with slow_consumer.waiting():
            time.sleep(0.05)
        time.sleep(0.25)
    assert cuts == [] and not slow_server.cut  # it has not waited on the server yet
    with slow_server.waiting():
        deadline = time.monotonic() + 5
        while not slow_server.cut and time.monotonic() < deadline:
            time.sleep(0.02)
    assert cuts == ["server"] and slow_server.cut and not slow_consumer.cut
    slow_server.done()
    slow_consumer.done()
    deadline = time.monotonic() + 5
    while watch._thread is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert watch._thread is None  # no thread stays behind once nothing is watched


def test_a_store_made_again_in_a_child_process_has_its_own_stall_watch(tmp_path, monkeypatch):
    store = open_store(f"file://{tmp_path}")
    watch = store._stall_watch()
    assert store._stall_watch() is watch
    monkeypatch.setattr("os.getpid", lambda: watch.pid + 1)  # as in a forked child
    assert store._stall_watch() is not watch
    assert "_client_stall_watch" not in store.__getstate__()  # never pickled into a worker


def test_a_cut_shuts_only_the_connection_its_thread_sent_on_since_the_call_began():
    """A connection noted before the call began may be another thread's by now (a shared pool):
    a cut must not touch it."""
    import socket

    class Connection:  # a socket and the server's end of it
        def __init__(self) -> None:
            self.sock, self.peer = socket.socketpair()

    registry = ConnectionRegistry()
    older, current = Connection(), Connection()
    registry.note(older.sock)
    time.sleep(0.01)
    cut = registry.cutter()
    assert cut() is False  # nothing sent since: nothing to cut (the watch tries again later)
    older.peer.sendall(b"x")
    assert older.sock.recv(1) == b"x"
    registry.note(current.sock)
    assert cut() is True
    assert current.sock.recv(1) == b""  # shut: a blocked read would end now
    other_thread_cut = []
    thread = threading.Thread(target=lambda: other_thread_cut.append(registry.cutter()))
    thread.start()
    thread.join()
    older.peer.sendall(b"y")
    assert other_thread_cut[0]() is False  # another thread's cut: it sent nothing
    assert older.sock.recv(1) == b"y"
    for conn in (older, current):
        conn.sock.close()
        conn.peer.close()


def test_a_cut_that_finds_nothing_to_shut_is_tried_again_and_never_lands_after_the_wait():
    """A slow name lookup leaves no socket to shut at the first look: the read must stay
    watched (it was cut once and never again, and hung), and a cut never lands once the wait
    it was meant for is over."""
    watch = StallWatch(timeout_s=0.2)
    answers = iter([False, False, True])
    tries: list[bool] = []

    def cut() -> bool:
        tries.append(next(answers))
        return tries[-1]

    read = watch.watch(cut)
    with read.waiting():
        deadline = time.monotonic() + 5
        while not read.cut and time.monotonic() < deadline:
            time.sleep(0.02)
    assert tries == [False, False, True] and read.cut
    read.done()

    late = watch.watch(lambda: tries.append(True))
    with late.waiting():
        pass
    late.shut()  # the watch saw it waiting, but the wait ended before the cut
    assert not late.cut and len(tries) == 3
    late.done()
