#!/usr/bin/env python3
"""A WAN emulator on loopback: a TCP proxy in front of the local Swift proxy server.

Each connection gets a capped download rate and every HTTP request a delay, as a store
across a network gives.

* **Rate**: the server-to-client bytes of each connection pass a token bucket of `rate`
  bytes per second (a burst of `burst` bytes, by default 20 ms' worth): one connection
  never goes faster, several connections each get the full rate, as with a per-flow cap.
* **Link**: optionally (`link_rate`), all connections' server-to-client bytes together pass one
  more token bucket, as where the link (not each flow) is the limit: many connections then
  share its rate instead of each getting `rate`.
* **Delay**: each HTTP request, keep-alive ones too, is held `delay_s` before it is
  forwarded, so every request costs a round trip. Bytes that are not HTTP are relayed as
  they are, delayed once per connection.
* **Lifetime**: after `lifetime_s` the proxy stops listening and drops its connections,
  so a forgotten one does not outlive its benchmark.

Counters: `connections` (accepted), `most_open` (open at once, at most), `bytes_down`,
and `log`, every request as (method, path, Range header); `gets()` lists the GETs of
paths matching a regex.

Importable as `tests.support.wan_proxy`, like `fault_proxy.FaultProxy`
(`WanProxyProcess` runs one in a child process, for benchmarks)::

    with WanProxy(swift_port, rate=40e6, delay_s=0.005) as wan:
        env = {"ST_AUTH": f"{wan.url}/auth/v1.0", ...}   # tempauth hands out the proxy's URL
        ...
        print(wan.most_open, len(wan.gets(r"/shard-000000\\.tar$")))

or a command::

    python -m tests.support.wan_proxy --target 127.0.0.1:8080 --rate 40MB --delay-ms 5 --lifetime 600
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import re
import sys
import threading
import time
from multiprocessing.connection import Connection
from urllib.parse import unquote, urlsplit

from dlstore.config import parse_size
from tests.support.loop_server import LoopThreadServer, close_writer

__all__ = ["WanProxy", "WanProxyProcess"]

_HEAD_LIMIT = 1 << 20
_MAX_BLOCK = 256 * 1024


class _TokenBucket:
    """`rate` bytes per second with a burst of `burst` bytes; a take beyond the tokens left
    sleeps until the debt is paid."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = time.monotonic()

    async def take(self, n: int) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate) - n
        self.stamp = now
        if self.tokens < 0:
            await asyncio.sleep(-self.tokens / self.rate)


def _request_framing(head: bytes) -> tuple[str, str, str | None, int | None] | None:
    """(method, path, Range header, body length; None when chunked) of a request head, or
    None when it is not HTTP/1.x."""
    lines = head.rstrip(b"\r\n").split(b"\r\n")
    words = lines[0].decode("latin-1").split(" ")
    if len(words) != 3 or not words[2].startswith("HTTP/1."):
        return None
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    chunked = "chunked" in headers.get("transfer-encoding", "").lower()
    length = None if chunked else int(headers.get("content-length") or 0)
    return words[0], unquote(urlsplit(words[1]).path), headers.get("range"), length


async def _relay_exact(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
    while n > 0:
        data = await reader.read(min(n, _MAX_BLOCK))
        if not data:
            raise ConnectionResetError("client closed mid-body")
        n -= len(data)
        writer.write(data)
        await writer.drain()


async def _relay_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        line = await reader.readuntil(b"\r\n")
        writer.write(line)
        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                writer.write(trailer)
            writer.write(trailer)
            await writer.drain()
            return
        await _relay_exact(reader, writer, size + 2)


class WanProxy(LoopThreadServer):
    """Forward 127.0.0.1:`port` to `target_host:target_port` with a per-connection download
    `rate` (bytes/s; None: no cap), all connections together at most `link_rate`, and
    `delay_s` per request; see the module docstring."""

    stream_limit = _HEAD_LIMIT

    def __init__(
        self,
        target_port: int,
        *,
        target_host: str = "127.0.0.1",
        rate: float | None = None,
        delay_s: float = 0.0,
        burst: float | None = None,
        link_rate: float | None = None,
        lifetime_s: float = 600.0,
    ) -> None:
        super().__init__()
        for name, value in (("rate", rate), ("link_rate", link_rate)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive bytes per second, not {value}")
        self.target = (target_host, target_port)
        self.rate = rate
        self.delay_s = delay_s
        self.burst = burst if burst is not None else max(16 * 1024, (rate or 0) * 0.02)
        self.link_rate = link_rate
        # One bucket for every connection: used only in the proxy's event loop (one thread).
        self._link = _TokenBucket(link_rate, max(16 * 1024, link_rate * 0.02)) if link_rate else None
        self.lifetime_s = lifetime_s
        self.expired = threading.Event()
        self.connections = 0
        self.open = 0
        self.most_open = 0
        self.bytes_down = 0
        self.log: list[tuple[str, str, str | None]] = []
        self._lock = threading.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._expiry: asyncio.TimerHandle | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def gets(self, path: str | None = None) -> list[tuple[str, str | None]]:
        """(path, Range header) of every GET whose path matches regex `path` (None: all)."""
        with self._lock:
            return [(p, r) for m, p, r in self.log if m == "GET" and (path is None or re.search(path, p))]

    def reset_counts(self) -> None:
        with self._lock:
            self.connections = self.bytes_down = 0
            self.most_open = self.open
            self.log.clear()

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> WanProxy:
        super().start()
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._arm_lifetime)
        return self

    def _arm_lifetime(self) -> None:
        assert self._loop is not None
        self._expiry = self._loop.call_later(self.lifetime_s, lambda: asyncio.ensure_future(self._expire()))

    async def _expire(self) -> None:
        await self._shutdown()
        self.expired.set()

    async def _shutdown(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- the event loop side --------------------------------------------------------------------------
    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        with self._lock:
            self.connections += 1
            self.open += 1
            self.most_open = max(self.most_open, self.open)
        server_w = None
        try:
            server_r, server_w = await asyncio.open_connection(*self.target, limit=_HEAD_LIMIT)
            up = asyncio.ensure_future(self._pump_requests(client_r, server_w))
            down = asyncio.ensure_future(self._pump_responses(server_r, client_w))
            try:
                await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
                if up.done() and up.exception() is None and not down.done():
                    server_w.write_eof()  # the client is done asking; its answers may still come
                    await down
            finally:
                for pump in (up, down):
                    pump.cancel()
                await asyncio.gather(up, down, return_exceptions=True)
        except (ConnectionError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            close_writer(client_w, rst=True)
        except asyncio.CancelledError:
            pass  # the proxy is closing: end quietly (a cancelled handler makes asyncio log an error)
        finally:
            close_writer(client_w, rst=False)
            close_writer(server_w, rst=False)
            with self._lock:
                self.open -= 1
            self._tasks.discard(task)

    async def _pump_requests(self, client_r: asyncio.StreamReader, server_w: asyncio.StreamWriter) -> None:
        """Client to server: each request delayed `delay_s`, then forwarded with its body."""
        while True:
            try:
                head = await client_r.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    server_w.write(exc.partial)
                return
            framing = _request_framing(head)
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            server_w.write(head)
            await server_w.drain()
            if framing is None:  # not HTTP: relay the rest as it comes, delayed once
                while data := await client_r.read(_MAX_BLOCK):
                    server_w.write(data)
                    await server_w.drain()
                return
            method, path, byte_range, length = framing
            with self._lock:
                self.log.append((method, path, byte_range))
            if length is None:
                await _relay_chunked(client_r, server_w)
            else:
                await _relay_exact(client_r, server_w, length)

    async def _pump_responses(self, server_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        """Server to client, through this connection's token bucket and the link's."""
        bucket = _TokenBucket(self.rate, self.burst) if self.rate else None
        block = int(min(_MAX_BLOCK, max(self.burst, 4096)))
        if self._link is not None:
            block = int(min(block, max(self._link.burst, 4096)))
        while data := await server_r.read(block):
            if bucket is not None:
                await bucket.take(len(data))
            if self._link is not None:
                await self._link.take(len(data))
            with self._lock:  # counted before the client can see the bytes
                self.bytes_down += len(data)
            client_w.write(data)
            await client_w.drain()


def _serve(commands: Connection, target_port: int, options: dict) -> None:
    """The child of `WanProxyProcess`: run a proxy, answer the parent's commands."""
    with WanProxy(target_port, **options) as proxy:
        commands.send(proxy.port)
        while True:
            command = commands.recv()
            if command == "reset":
                proxy.reset_counts()
                commands.send(None)
            elif command == "stats":
                with proxy._lock:
                    commands.send(
                        {
                            "connections": proxy.connections,
                            "most_open": proxy.most_open,
                            "bytes_down": proxy.bytes_down,
                            "log": list(proxy.log),
                        }
                    )
            else:
                return


class WanProxyProcess:
    """A `WanProxy` in a process of its own, for benchmarks: its event loop then competes
    with no client thread for the interpreter lock. Same arguments; counters by `stats()`.

    >>> with WanProxyProcess(swift_port, rate=40e6, delay_s=0.005) as wan:   # doctest: +SKIP
    ...     wan.reset_counts(); fetch(); print(wan.stats()["connections"])
    """

    def __init__(self, target_port: int, **options: object) -> None:
        self.target_port = target_port
        self.options = options
        self.port = 0
        self._commands: Connection | None = None
        self._process: multiprocessing.process.BaseProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The emulator's process (its CPU is the store side's in a benchmark)."""
        return self._process.pid if self._process is not None else None

    def start(self) -> WanProxyProcess:
        context = multiprocessing.get_context("spawn")
        self._commands, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, self.target_port, self.options), daemon=True)
        self._process.start()
        deadline = time.monotonic() + 60
        while not self._commands.poll(0.1):
            if not self._process.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the WAN emulator's process did not start (spawned: is the caller's main guarded?)")
        self.port = self._commands.recv()
        return self

    def reset_counts(self) -> None:
        self._ask("reset")

    def stats(self) -> dict:
        """connections, most_open, bytes_down, and log: [(method, path, Range header)]."""
        return self._ask("stats")

    def _ask(self, command: str):
        assert self._commands is not None, "start() first"
        self._commands.send(command)
        return self._commands.recv()

    def close(self) -> None:
        if self._commands is not None:
            with contextlib.suppress(OSError):
                self._commands.send("stop")
        if self._process is not None:
            self._process.join(10)
            if self._process.is_alive():
                self._process.terminate()
                self._process.join(10)
        self._commands = self._process = None

    def __enter__(self) -> WanProxyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="HOST:PORT of the server, e.g. 127.0.0.1:8080")
    parser.add_argument("--rate", default=None, help="download cap per connection, bytes/s: 40MB, 5MiB (default: none)")
    parser.add_argument("--link-rate", default=None, help="download cap of all connections together (default: none)")
    parser.add_argument("--delay-ms", type=float, default=5.0, help="delay per HTTP request (default 5)")
    parser.add_argument("--lifetime", type=float, default=600.0, help="seconds before the proxy stops (default 600)")
    args = parser.parse_args(argv)
    host, _, port = args.target.rpartition(":")
    rate = parse_size(args.rate) if args.rate else None
    link_rate = parse_size(args.link_rate) if args.link_rate else None
    proxy = WanProxy(
        int(port),
        target_host=host or "127.0.0.1",
        rate=rate,
        link_rate=link_rate,
        delay_s=args.delay_ms / 1000,
        lifetime_s=args.lifetime,
    )
    with proxy:
        print(
            f"{proxy.url} -> {args.target}: {args.rate or 'unlimited'}/s per connection, "
            f"{args.link_rate or 'unlimited'}/s for all, "
            f"{args.delay_ms:g} ms per request, for {args.lifetime:g} s",
            flush=True,
        )
        try:
            proxy.expired.wait()
        except KeyboardInterrupt:
            pass
    print(
        f"connections {proxy.connections} (at most {proxy.most_open} open), requests {len(proxy.log)}, "
        f"{proxy.bytes_down} bytes down",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
