"""A small fault-injecting TCP proxy for tests (stdlib asyncio in a background thread).

It listens on a free port of 127.0.0.1 and forwards every connection to a target
``host:port``. Tests arm faults on it and then point a client at ``proxy.port``:

* ``drop_after_bytes(n, times=1, reset=False)``: the next response that grows past
  ``n`` bytes is cut after exactly ``n`` bytes (FIN, or RST with ``reset=True``).
* ``stall_after_bytes(n, seconds, times=1)`` / ``stall_next(seconds, times=1)``:
  the next response that grows past ``n`` bytes (0: its first byte) pauses for
  ``seconds`` there, to trip client read timeouts.
* ``reset_next(n=1)``: the next ``n`` requests are answered with a TCP reset
  instead of being forwarded.
* ``close_all()``: cut every open connection (a server restart, as the client sees it).

Counters: ``connections`` (accepted), ``requests`` (HTTP requests seen from clients),
``bytes_to_server`` and ``bytes_to_client``.

The proxy follows the clients' HTTP/1.x request framing, so counts stay right on
keep-alive connections. A response's bytes count from the start of its request; a stream
that is not HTTP is one request.

Example::

    with TcpProxy(swift_port) as proxy:
        proxy.drop_after_bytes(1000)
        conn = swiftclient.Connection(preauthurl=f"http://127.0.0.1:{proxy.port}/v1/AUTH_test", ...)
        conn.get_object("c", "o")   # the first GET is cut, swiftclient retries
        assert proxy.requests == 2
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from tests.support.loop_server import LoopThreadServer, close_writer

__all__ = ["TcpProxy"]

_READ = 65536
_MAX_HEAD = 1 << 20


@dataclass
class _Fault:
    kind: str  # "drop" | "reset" | "stall"
    at: int  # response byte offset where it fires
    times: int
    seconds: float = 0.0


class _RequestFraming:
    """Follows HTTP/1.x request framing on the client→server stream; ``feed`` counts request starts."""

    def __init__(self) -> None:
        self.state = "head"  # head | body | chunk-size | chunk-data | trailer | opaque
        self.buf = b""
        self.remaining = 0
        self.in_request = False

    def feed(self, data: bytes) -> int:
        started = 0
        pos = 0
        while pos < len(data) and self.state != "opaque":
            if self.state == "head":
                if not self.in_request:
                    # Bytes between requests that are only CRLF are allowed (RFC 9112 2.2).
                    while pos < len(data) and data[pos : pos + 1] in (b"\r", b"\n"):
                        pos += 1
                    if pos == len(data):
                        break
                    self.in_request = True
                    started += 1
                self.buf += data[pos:]
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.buf) > _MAX_HEAD:
                        self.state = "opaque"
                    return started
                pos = len(data) - (len(self.buf) - end - 4)
                self._start_body(self.buf[:end])
                self.buf = b""
            elif self.state in ("body", "chunk-data"):
                take = min(self.remaining, len(data) - pos)
                pos += take
                self.remaining -= take
                if self.remaining == 0:
                    self._next(self.state == "body")
            else:  # chunk-size or trailer: line oriented
                self.buf += data[pos:]
                end = self.buf.find(b"\r\n")
                if end < 0:
                    if len(self.buf) > _MAX_HEAD:
                        self.state = "opaque"
                    return started
                pos = len(data) - (len(self.buf) - end - 2)
                line, self.buf = self.buf[:end], b""
                if self.state == "trailer":
                    if not line:
                        self._next(True)
                else:
                    try:
                        size = int(line.split(b";", 1)[0].strip(), 16)
                    except ValueError:
                        self.state = "opaque"
                        continue
                    self.state, self.remaining = ("trailer", 0) if size == 0 else ("chunk-data", size + 2)
        return started

    def _start_body(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        if len(lines[0].split(b" ")) != 3 or not lines[0].split(b" ")[2].startswith(b"HTTP/"):
            self.state = "opaque"  # not HTTP: the rest of the connection is one "request"
            return
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        if b"chunked" in headers.get(b"transfer-encoding", b""):
            self.state = "chunk-size"
            return
        try:
            length = int(headers.get(b"content-length", b"0") or 0)
        except ValueError:
            self.state = "opaque"
            return
        if length > 0:
            self.state, self.remaining = "body", length
        else:
            self._next(True)

    def _next(self, request_done: bool) -> None:
        if request_done:
            self.state, self.in_request = "head", False
        else:  # the CRLF after a chunk's data was consumed with it
            self.state = "chunk-size"


class _Conn:
    def __init__(self, proxy: TcpProxy, client_w: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.client_w = client_w
        self.server_w: asyncio.StreamWriter | None = None
        self.framing = _RequestFraming()
        self.response_bytes = 0
        self.tasks: list[asyncio.Task] = []

    def abort(self, rst: bool) -> None:
        for writer in (self.client_w, self.server_w):
            close_writer(writer, rst)


class TcpProxy(LoopThreadServer):
    """Forward 127.0.0.1:``port`` to ``target_host:target_port`` with faults on demand (see module doc)."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1", listen_host: str = "127.0.0.1") -> None:
        super().__init__()
        self.target = (target_host, target_port)
        self.listen_host = listen_host
        self.connections = 0
        self.requests = 0
        self.bytes_to_server = 0
        self.bytes_to_client = 0
        self._lock = threading.Lock()
        self._faults: list[_Fault] = []
        self._resets = 0
        self._conns: set[_Conn] = set()

    # -- faults (callable from any thread) ------------------------------
    def drop_after_bytes(self, n: int, times: int = 1, reset: bool = False) -> None:
        with self._lock:
            self._faults.append(_Fault("reset" if reset else "drop", n, times))

    def stall_after_bytes(self, n: int, seconds: float, times: int = 1) -> None:
        with self._lock:
            self._faults.append(_Fault("stall", n, times, seconds))

    def stall_next(self, seconds: float, times: int = 1) -> None:
        self.stall_after_bytes(0, seconds, times)

    def reset_next(self, n: int = 1) -> None:
        with self._lock:
            self._resets += n

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()
            self._resets = 0

    def close_all(self) -> None:
        """Cut every open connection (RST), as a crashing server would."""
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._close_all(), self._loop).result(timeout=5)

    @property
    def url(self) -> str:
        return f"http://{self.listen_host}:{self.port}"

    # -- the event loop side (start/close/with come from LoopThreadServer) ---------------------------------------------
    async def _shutdown(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._close_all()
        await self._server.wait_closed()

    async def _close_all(self) -> None:
        conns = list(self._conns)
        for conn in conns:
            conn.abort(rst=True)
            for task in conn.tasks:
                task.cancel()
        await asyncio.gather(*(t for c in conns for t in c.tasks), return_exceptions=True)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        conn = _Conn(self, client_w)
        with self._lock:
            self.connections += 1
        self._conns.add(conn)
        try:
            try:
                server_r, conn.server_w = await asyncio.open_connection(*self.target)
            except OSError:
                conn.abort(rst=True)
                return
            conn.tasks = [
                asyncio.ensure_future(self._upstream(conn, client_r)),
                asyncio.ensure_future(self._downstream(conn, server_r)),
            ]
            await asyncio.gather(*conn.tasks, return_exceptions=True)
        finally:
            conn.abort(rst=False)
            self._conns.discard(conn)

    async def _upstream(self, conn: _Conn, client_r: asyncio.StreamReader) -> None:
        """client → server: count requests, apply reset_next."""
        assert conn.server_w is not None
        try:
            while data := await client_r.read(_READ):
                started = conn.framing.feed(data)
                if started:
                    conn.response_bytes = 0
                    with self._lock:
                        self.requests += started
                        reset = self._resets > 0
                        self._resets -= reset
                    if reset:
                        conn.abort(rst=True)
                        conn.tasks[1].cancel()
                        return
                with self._lock:
                    self.bytes_to_server += len(data)
                conn.server_w.write(data)
                await conn.server_w.drain()
            if conn.server_w.can_write_eof():
                conn.server_w.write_eof()  # half-close: the response may still be coming
        except (ConnectionError, OSError):
            conn.abort(rst=True)

    async def _downstream(self, conn: _Conn, server_r: asyncio.StreamReader) -> None:
        """server → client: apply drop/stall faults at response byte offsets."""
        try:
            while data := await server_r.read(_READ):
                while data:
                    fault = self._take_fault(conn.response_bytes, len(data))
                    cut = len(data) if fault is None else fault.at - conn.response_bytes
                    if cut:
                        await self._send(conn, data[:cut])
                    data = data[cut:]
                    if fault is None:
                        break
                    if fault.kind == "stall":
                        await asyncio.sleep(fault.seconds)
                        # Send one byte past the offset, so that this fault's next use is for a later response.
                        await self._send(conn, data[:1])
                        data = data[1:]
                    else:
                        while conn.client_w.transport.get_write_buffer_size():
                            await asyncio.sleep(0.001)  # all n bytes handed to the kernel before the cut
                        conn.abort(rst=fault.kind == "reset")
                        conn.tasks[0].cancel()
                        return
            conn.client_w.close()
        except (ConnectionError, OSError):
            conn.abort(rst=True)
        conn.tasks[0].cancel()

    async def _send(self, conn: _Conn, data: bytes) -> None:
        conn.response_bytes += len(data)
        with self._lock:
            self.bytes_to_client += len(data)
        conn.client_w.write(data)
        await conn.client_w.drain()

    def _take_fault(self, offset: int, length: int) -> _Fault | None:
        """The first armed fault whose byte offset falls in [offset, offset + length); consumes one use."""
        with self._lock:
            for fault in self._faults:
                if offset <= fault.at < offset + length:
                    fault.times -= 1
                    if fault.times <= 0:
                        self._faults.remove(fault)
                    return fault
        return None
