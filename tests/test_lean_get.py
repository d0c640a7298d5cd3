"""`LeanSession` against a real HTTP server on loopback that answers as servers do, well
and badly: kept-alive and closed connections, chunked bodies, bodies cut short, stalls."""

from __future__ import annotations

import errno
import http.client
import http.server
import socket
import ssl
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from dlstore.storage.lean_get import LeanSession, failure_kind, proxied

BODY = bytes((i * 7) % 251 for i in range(3 * 2**20 + 12345))  # differs at every offset


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        server = self.server
        server.requests.append((self.client_address[1], self.path))  # (client port: one per connection)
        start, end = 0, len(BODY)
        if "Range" in self.headers:
            first, last = self.headers["Range"].removeprefix("bytes=").split("-")
            start, end = int(first), int(last) + 1
        data = BODY[start:end]
        if self.path == "/hangup":  # no answer at all: the connection just ends
            self.close_connection = True
            return
        if self.path == "/missing":
            self.send_response(404)
            self.send_header("Content-Length", "9")
            self.end_headers()
            self.wfile.write(b"not found")
            return
        self.send_response(206 if "Range" in self.headers else 200)
        if self.path == "/chunked":
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(data), 100_000):
                piece = data[i : i + 100_000]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
            return
        self.send_header("Content-Length", str(len(data)))
        if self.path == "/close":
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.path == "/cut":  # half the body, then the connection ends
            self.wfile.write(data[: len(data) // 2])
            self.close_connection = True
            return
        if self.path == "/stall":  # half the body, then nothing for longer than the client waits
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            time.sleep(2.0)
            self.close_connection = True
            return
        self.wfile.write(data)
        if self.path == "/drop-after":  # answered in full, then closed without saying so
            self.close_connection = True


@pytest.fixture
def server() -> Iterator[http.server.ThreadingHTTPServer]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.handle_error = lambda request, address: None  # the cut and stalled answers end in broken pipes
    httpd.daemon_threads = True
    httpd.requests = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _url(server: http.server.ThreadingHTTPServer, path: str) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}{path}"


def _session(chunk_size: int = 2**20, read_timeout_s: float = 5.0) -> LeanSession:
    return LeanSession((5.0, read_timeout_s), chunk_size)


def _connections(server) -> int:
    return len({port for port, _ in server.requests})


@pytest.mark.parametrize("chunk_size", [1000, 2**20, 8 * 2**20])
def test_bodies_are_exact_and_one_connection_serves_a_thread(server, chunk_size):
    session = _session(chunk_size)
    spans = [(0, len(BODY)), (5, 6), (1_000_001, 2_500_003), (len(BODY) - 7, len(BODY))]
    for start, end in spans:
        response = session.get(_url(server, "/obj"), {"Range": f"bytes={start}-{end - 1}"})
        assert response.status == 206
        chunks = list(response.body)
        assert all(len(c) <= chunk_size for c in chunks)
        assert b"".join(chunks) == BODY[start:end]
    assert _connections(server) == 1  # kept alive between the GETs


def test_threads_do_not_share_connections(server):
    session = _session()
    results = []

    def read() -> None:
        for _ in range(3):
            results.append(b"".join(session.get(_url(server, "/obj"), {}).body) == BODY)

    threads = [threading.Thread(target=read) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [True] * 12
    assert _connections(server) == 4


def test_a_chunked_body_is_read_through_http_client(server):
    response = _session().get(_url(server, "/chunked"), {"Range": "bytes=10-1000009"})
    assert b"".join(response.body) == BODY[10:1000010]


def test_a_connection_the_server_closes_is_not_kept(server):
    session = _session()
    assert b"".join(session.get(_url(server, "/close"), {}).body) == BODY
    assert b"".join(session.get(_url(server, "/obj"), {}).body) == BODY
    assert _connections(server) == 2


def test_a_kept_connection_closed_while_idle_is_replaced_once(server):
    session = _session()
    assert b"".join(session.get(_url(server, "/drop-after"), {}).body) == BODY
    time.sleep(0.2)  # the server has closed it by now
    assert b"".join(session.get(_url(server, "/obj"), {"Range": "bytes=3-9"}).body) == BODY[3:10]
    assert _connections(server) == 2


def test_a_body_cut_short_ends_short_and_its_connection_goes(server):
    session = _session(chunk_size=256 * 1024)
    body = b"".join(session.get(_url(server, "/cut"), {}).body)
    assert body == BODY[: len(BODY) // 2]  # the caller compares with Content-Length
    assert b"".join(session.get(_url(server, "/obj"), {"Range": "bytes=0-99"}).body) == BODY[:100]
    assert _connections(server) == 2


def test_an_abandoned_body_is_not_read_by_the_next_get(server):
    session = _session(chunk_size=100_000)
    body = session.get(_url(server, "/obj"), {})
    first = next(body.body) + next(body.body)  # what came with the headers, then a chunk
    assert first == BODY[: len(first)] and len(first) <= 100_000 + 8192
    body.body.close()
    never_read = session.get(_url(server, "/obj"), {})  # its body never started: its connection is not kept
    assert never_read.status == 200
    assert b"".join(session.get(_url(server, "/obj"), {"Range": "bytes=7-70"}).body) == BODY[7:71]
    assert _connections(server) == 3
    never_read.body.close()


def test_an_error_status_keeps_the_connection(server):
    session = _session()
    response = session.get(_url(server, "/missing"), {})
    assert (response.status, list(response.body)) == (404, [])
    assert b"".join(session.get(_url(server, "/obj"), {"Range": "bytes=0-9"}).body) == BODY[:10]
    assert _connections(server) == 1


def test_a_stalled_body_times_out_instead_of_hanging(server):
    session = _session(read_timeout_s=0.5)
    response = session.get(_url(server, "/stall"), {})
    started = time.monotonic()
    with pytest.raises((socket.timeout, TimeoutError)):
        b"".join(response.body)
    assert time.monotonic() - started < 1.9  # the server would answer at 2 s


def test_a_failing_kept_connection_is_tried_once_more_and_no_more(server):
    session = _session()
    assert b"".join(session.get(_url(server, "/obj"), {"Range": "bytes=0-9"}).body) == BODY[:10]
    with pytest.raises(http.client.RemoteDisconnected):
        session.get(_url(server, "/hangup"), {})
    assert [path for _, path in server.requests].count("/hangup") == 2  # the kept connection, then one new


def test_a_body_closed_unread_closes_its_connection(server):
    session = _session()
    port = server.server_address[1]
    response = session.get(_url(server, "/obj"), {})
    assert _open_to(port) == 1
    response.body.close()  # never started
    assert _open_to(port) == 0


def test_a_threads_connections_close_when_it_ends(server):
    session = _session()
    port = server.server_address[1]

    def read() -> None:
        assert b"".join(session.get(_url(server, "/obj"), {"Range": "bytes=0-99"}).body) == BODY[:100]
        assert _open_to(port) == 1  # kept for this thread's next GET

    thread = threading.Thread(target=read)
    thread.start()
    thread.join()
    assert _open_to(port) == 0


def _open_to(port: int) -> int:
    return sum(1 for c in psutil.Process().net_connections("tcp") if c.raddr and c.raddr.port == port)


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (http.client.IncompleteRead(b"", 10), "transient"),  # a chunked body cut short
        (http.client.BadStatusLine("x"), "transient"),
        (socket.gaierror(socket.EAI_NONAME, "no such host"), "transient"),
        (OSError(errno.ENETUNREACH, "unreachable"), "transient"),
        (TimeoutError(), "transient"),
        (ConnectionResetError(), "transient"),
        (ssl.SSLEOFError(), "transient"),
        (ssl.SSLCertVerificationError(), "tls"),
        (ssl.SSLError(), "tls"),
        (FileNotFoundError(), "other"),
        (ValueError(), "other"),
    ],
)
def test_failure_kinds(exc, kind):
    assert failure_kind(exc) == kind


def test_proxied_follows_the_environment(monkeypatch):
    for name in ("http", "https", "no", "all"):
        monkeypatch.delenv(f"{name}_proxy", raising=False)
        monkeypatch.delenv(f"{name.upper()}_PROXY", raising=False)
    assert not proxied("http://swift.example:8080/v1/AUTH_x")
    monkeypatch.setenv("http_proxy", "http://proxy.example:3128")
    assert proxied("http://swift.example:8080/v1/AUTH_x")
    assert not proxied("https://swift.example/v1/AUTH_x")  # no proxy for https
    monkeypatch.setenv("no_proxy", "swift.example")
    assert not proxied("http://swift.example:8080/v1/AUTH_x")
    monkeypatch.delenv("no_proxy")
    monkeypatch.delenv("http_proxy")
    monkeypatch.setenv("ALL_PROXY", "socks5://proxy.example:1080")
    assert proxied("https://swift.example/v1/AUTH_x")
