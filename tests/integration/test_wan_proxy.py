"""`tests/support/wan_proxy.py`, the WAN emulator, against a small HTTP/1.1 server on loopback:
bytes pass unchanged, each request on a keep-alive connection is counted and delayed,
each connection's download rate is capped, and the proxy ends after its lifetime.

Times are asserted only as lower bounds (what the emulator must cost at least), which a
slow or busy machine cannot break.
"""

from __future__ import annotations

import http.client
import http.server
import os
import socket
import threading
import time

import pytest

from tests.support.wan_proxy import WanProxy

BLOB = os.urandom(300_000)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive

    def do_GET(self) -> None:
        start, end = 0, len(BLOB)
        if self.headers.get("Range"):
            first, _, last = self.headers["Range"].removeprefix("bytes=").partition("-")
            start, end = int(first), min(len(BLOB), int(last) + 1 if last else len(BLOB))
        body = BLOB[start:end]
        self.send_response(206 if self.headers.get("Range") else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self) -> None:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            received = b""
            while size := int(self.rfile.readline().split(b";")[0], 16):
                received += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
        else:
            received = self.rfile.read(int(self.headers["Content-Length"]))
        answer = str(len(received)).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def http_port():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_requests_on_one_connection_are_each_delayed_and_logged(http_port):
    with WanProxy(http_port, delay_s=0.05) as wan:
        conn = http.client.HTTPConnection("127.0.0.1", wan.port, timeout=10)
        started = time.monotonic()
        for index in range(5):
            conn.request("GET", f"/blob?n={index}", headers={"Range": f"bytes={index * 1000}-{index * 1000 + 99}"})
            assert conn.getresponse().read() == BLOB[index * 1000 : index * 1000 + 100]
        took = time.monotonic() - started
        conn.request("PUT", "/upload", body=b"x" * 70_000)
        assert conn.getresponse().read() == b"70000"
        conn.request("PUT", "/chunked", body=iter([b"a" * 5000, b"b" * 3000]), encode_chunked=True)
        assert conn.getresponse().read() == b"8000"
        conn.close()
        assert wan.connections == 1  # one keep-alive connection carried them all
        assert [p for p, _ in wan.gets(r"^/blob$")] == ["/blob"] * 5
        assert wan.gets()[1] == ("/blob", "bytes=1000-1099")
        assert len(wan.log) == 7
    assert took >= 5 * 0.05  # each request waited its delay


def test_each_connection_is_capped_at_the_rate(http_port):
    rate = 1_000_000
    with WanProxy(http_port, rate=rate) as wan:
        results = {}

        def fetch(index: int) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", wan.port, timeout=30)
            started = time.monotonic()
            conn.request("GET", "/blob")
            results[index] = (conn.getresponse().read(), time.monotonic() - started)
            conn.close()

        threads = [threading.Thread(target=fetch, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert wan.most_open == 2 and wan.bytes_down >= 2 * len(BLOB)
    for body, took in results.values():
        assert body == BLOB
        assert took >= (len(BLOB) - wan.burst) / rate * 0.9  # no faster than the cap, per connection


def test_all_connections_together_are_capped_at_the_link_rate(http_port):
    """With a link cap, 4 connections share it: the 4 bodies together take at least their
    bytes over the link's rate, where each connection alone is uncapped."""
    link = 2_000_000
    with WanProxy(http_port, link_rate=link) as wan:
        bodies = {}

        def fetch(index: int) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", wan.port, timeout=30)
            conn.request("GET", "/blob")
            bodies[index] = conn.getresponse().read()
            conn.close()

        started = time.monotonic()
        threads = [threading.Thread(target=fetch, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        took = time.monotonic() - started
        assert wan.most_open == 4
    assert list(bodies.values()) == [BLOB] * 4
    burst = max(16 * 1024, link * 0.02)
    assert took >= (4 * len(BLOB) - burst) / link * 0.9  # no faster than the link, all together


def test_the_proxy_ends_after_its_lifetime(http_port):
    wan = WanProxy(http_port, lifetime_s=0.2).start()
    try:
        assert wan.expired.wait(10)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", wan.port), timeout=2).recv(1)
    finally:
        wan.close()
