"""An HTTP-aware fault-injecting proxy for reliability tests (stdlib asyncio, background thread).

`FaultProxy` listens on a free port of 127.0.0.1 (plain TCP, or TLS with `ssl_context`) and
forwards HTTP/1.1 to a target port, following each request and response, so a fault hits
one whole request of one object, on the Swift API and the S3 API alike (both are served by
the Swift proxy server, and so is tempauth's `/auth/v1.0`).

Faults (the `kind` of a rule or of a rate):

* ``"500"``, ``"503"``, ``"429"``, ``"408"`` (or any status given to `add_rule`): answered
  by the proxy, with ``Connection: close``; the request never reaches the server.
* ``"reset"``: a TCP reset instead of any response (the request is not forwarded).
* ``"reset_body"``: the response head and half its body, then a TCP reset.
* ``"short_body"``: the response head (with its full ``Content-Length``) and half the body,
  then a clean close (FIN): the client sees a body shorter than announced.
* ``"stall"``: the response is held back `stall_s` seconds before its first byte.
* ``"stall_body"``: the head and half the body, then `stall_s` seconds of silence, then the rest.
* ``"trickle_head"`` (by rule only): the response head one byte every `trickle_s` seconds
  (then the body as it comes), until the client goes away.
* ``"trickle_body"`` (by rule only): the head and half the body, then one byte every
  `trickle_s` seconds until the client goes away: each byte within any read timeout.
* ``close_connections=True``: every answer says ``Connection: close`` (as a server at its
  keep-alive limit does), so each request goes on a new connection.
* ``"ignore_range"`` (by rule only): the request goes on without its Range header, as to a
  server that ignores it: the whole object comes back (200). Swift's API only: S3 clients
  sign the Range header, so the server then refuses the request.

A rule's `then` (a function of no arguments) runs, in a thread, when its fault happens: for
a body fault once the half body is sent and before the cut, so a test can e.g. replace the
object between a cut and its resume.

How a request is chosen:

* by rule: `add_rule(kind, method="GET", path=r"shard-000003\\.tar$", times=2)` faults the
  next 2 matching requests (``times=None``: every one); rules are tried in order;
* at a rate: `set_rate(0.1, method="GET")` faults 10% of matching requests, each with a
  kind drawn from `kinds` (or, with ``cycle=True``, the kinds in turn). Whether the n-th
  request of one object is faulted depends only on (seed, method, object name, n): every
  run faults the same requests, in any order of requests and any container.

Counters: `count(method, path_regex)` and `requests` (a Counter of (method, object path));
`log` lists every request as (method, object path, Range header); `injected` every fault as
(method, object path, kind).

Example::

    with FaultProxy(swift_port, seed=1) as proxy:
        proxy.set_rate(0.1, method="GET")
        env = {"ST_AUTH": f"{proxy.url}/auth/v1.0", ...}   # tempauth hands out proxy URLs
        ... run the loader ...
        assert proxy.count("GET", r"/shard-000000\\.tar$") >= 1
"""

from __future__ import annotations

import asyncio
import collections
import random
import re
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from tests.support.loop_server import LoopThreadServer, close_writer

__all__ = ["ALL_FAULTS", "STATUS_FAULTS", "FaultProxy", "Injection", "Rule"]

STATUS_FAULTS = ("500", "503", "429", "408")
BODY_FAULTS = ("reset_body", "short_body", "stall_body")
ALL_FAULTS = (*STATUS_FAULTS, "reset", "reset_body", "short_body", "stall", "stall_body")
RULE_ONLY = ("ignore_range", "trickle_head", "trickle_body")  # not a failure: never drawn by `set_rate`
_RANGE_LINE = re.compile(rb"\r\nrange:[^\r]*", re.IGNORECASE)
_REASONS = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    408: "Request Timeout",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
_LIMIT = 1 << 20  # longest request/response head or chunk-size line


@dataclass
class Rule:
    """Fault `kind` for requests whose method equals `method` (None: any) and whose target
    (path and query) matches the regex `path` (None: any), `times` times (None: always)."""

    kind: str
    method: str | None = None
    path: str | None = None
    times: int | None = 1
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    then: Callable[[], object] | None = None

    def matches(self, method: str, target: str) -> bool:
        if self.times is not None and self.times <= 0:
            return False
        if self.method is not None and self.method != method:
            return False
        return self.path is None or re.search(self.path, target) is not None


@dataclass(frozen=True)
class Injection:
    method: str
    path: str
    kind: str


@dataclass
class _Request:
    method: str
    target: str
    path: str  # unquoted, without the query: the object
    head: bytes
    length: int | None  # request body length; None: chunked
    expect_continue: bool
    range: str | None  # the Range header, e.g. "bytes=150000-"


class _Closed(Exception):
    """The connection is finished (by a fault, a close or EOF)."""


def _parse_headers(lines: list[bytes]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(b":")
        if sep:
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return headers


def _parse_request(head: bytes) -> _Request:
    lines = head.rstrip(b"\r\n").split(b"\r\n")
    parts = lines[0].decode("latin-1").split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise _Closed(f"not an HTTP request line: {lines[0][:80]!r}")
    method, target = parts[0], parts[1]
    headers = _parse_headers(lines[1:])
    chunked = "chunked" in headers.get("transfer-encoding", "").lower()
    length = None if chunked else int(headers.get("content-length") or 0)
    return _Request(
        method=method,
        target=target,
        path=unquote(urlsplit(target).path),
        head=head,
        length=length,
        expect_continue=headers.get("expect", "").lower() == "100-continue",
        range=headers.get("range"),
    )


async def _copy_exact(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None, n: int) -> None:
    while n > 0:
        data = await reader.read(min(n, 65536))
        if not data:
            raise _Closed("peer closed mid-body")
        n -= len(data)
        if writer is not None:
            writer.write(data)
            await writer.drain()


async def _copy_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None) -> None:
    while True:
        line = await reader.readuntil(b"\r\n")
        if writer is not None:
            writer.write(line)
        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while True:  # trailer lines, then an empty line
                trailer = await reader.readuntil(b"\r\n")
                if writer is not None:
                    writer.write(trailer)
                if trailer == b"\r\n":
                    break
            if writer is not None:
                await writer.drain()
            return
        await _copy_exact(reader, writer, size + 2)


class FaultProxy(LoopThreadServer):
    """Forward 127.0.0.1:`port` to `target_host:target_port`, faulting requests as the module
    docstring says. A context manager; the event loop runs in a daemon thread."""

    stream_limit = _LIMIT

    def __init__(
        self,
        target_port: int,
        *,
        target_host: str = "127.0.0.1",
        seed: int = 0,
        stall_s: float = 3.0,
        trickle_s: float = 0.2,
        close_connections: bool = False,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__()
        self.target = (target_host, target_port)
        self.seed = seed
        self.stall_s = stall_s
        self.trickle_s = trickle_s
        self.close_connections = close_connections
        self.ssl_context = ssl_context
        self.requests: collections.Counter[tuple[str, str]] = collections.Counter()
        self.log: list[tuple[str, str, str | None]] = []  # (method, object path, Range header), in order
        self.injected: list[Injection] = []
        self.connections = 0
        self._rules: list[Rule] = []
        self._rate = 0.0
        self._rate_kinds: tuple[str, ...] = ALL_FAULTS
        self._rate_method: str | None = "GET"
        self._rate_path: str | None = None
        self._rate_cycle = False
        self._rate_faults = 0
        self._lock = threading.Lock()
        self._tasks: set[asyncio.Task] = set()

    # -- configuration (from any thread) ---------------------------------------------------
    def add_rule(
        self,
        kind: str | int,
        method: str | None = None,
        path: str | None = None,
        times: int | None = 1,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        then: Callable[[], object] | None = None,
    ) -> Rule:
        """Fault the next `times` requests that match; `kind` is a fault name or any HTTP
        status (answered with `body` and `headers`); `then` runs when the fault happens."""
        kind = str(kind)
        if kind not in ALL_FAULTS + RULE_ONLY and not kind.isdigit():
            raise ValueError(f"unknown fault {kind!r}; choose from {ALL_FAULTS + RULE_ONLY} or an HTTP status")
        rule = Rule(kind, method, path, times, body, tuple((headers or {}).items()), then)
        with self._lock:
            self._rules.append(rule)
        return rule

    def set_rate(
        self,
        rate: float,
        kinds: tuple[str, ...] = ALL_FAULTS,
        method: str | None = "GET",
        path: str | None = None,
        seed: int | None = None,
        cycle: bool = False,
    ) -> None:
        """Fault a fraction `rate` of the requests that match `method` and `path`, each with a
        kind drawn from `kinds` (see the module docstring for the draw). With `cycle`, the
        faults take the kinds in turn instead, so any `len(kinds)` of them show every kind."""
        for kind in kinds:
            if kind not in ALL_FAULTS:
                raise ValueError(f"unknown fault {kind!r}")
        with self._lock:
            self._rate, self._rate_kinds, self._rate_method, self._rate_path = rate, tuple(kinds), method, path
            self._rate_cycle, self._rate_faults = cycle, 0
            if seed is not None:
                self.seed = seed

    def clear(self) -> None:
        """No more faults (counters stay)."""
        with self._lock:
            self._rules.clear()
            self._rate = 0.0

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()
            self.log.clear()
            self.injected.clear()

    def count(self, method: str | None = None, path: str | None = None) -> int:
        """Requests seen with this method (None: any) whose object path matches regex `path`."""
        with self._lock:
            return sum(
                n
                for (m, p), n in self.requests.items()
                if (method is None or m == method) and (path is None or re.search(path, p))
            )

    def per_object(self, method: str = "GET", path: str | None = None) -> dict[str, int]:
        """{object path: requests} for `method`, restricted to paths matching `path`."""
        with self._lock:
            return {p: n for (m, p), n in self.requests.items() if m == method and (path is None or re.search(path, p))}

    def injected_kinds(self) -> collections.Counter[str]:
        with self._lock:
            return collections.Counter(i.kind for i in self.injected)

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl_context is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    # -- lifecycle: start/close/with come from LoopThreadServer --------------------------------
    async def _shutdown(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- choosing faults ----------------------------------------------------------------------
    def _decide(self, req: _Request) -> Rule | None:
        with self._lock:
            attempt = self.requests[(req.method, req.path)]
            self.requests[(req.method, req.path)] += 1
            self.log.append((req.method, req.path, req.range))
            fault = None
            for rule in self._rules:
                if rule.matches(req.method, req.target):
                    if rule.times is not None:
                        rule.times -= 1
                    fault = rule
                    break
            if (
                fault is None
                and self._rate > 0
                and (self._rate_method is None or self._rate_method == req.method)
                and (self._rate_path is None or re.search(self._rate_path, req.target))
            ):
                # By the object's name, not its full path: the container differs between runs.
                name = req.path.rstrip("/").rsplit("/", 1)[-1]
                draw = random.Random(f"{self.seed}|{req.method}|{name}|{attempt}")
                if draw.random() < self._rate:
                    if self._rate_cycle:
                        kind = self._rate_kinds[self._rate_faults % len(self._rate_kinds)]
                    else:
                        kind = draw.choice(self._rate_kinds)
                    self._rate_faults += 1
                    fault = Rule(kind)
            if fault is not None:
                self.injected.append(Injection(req.method, req.path, fault.kind))
            return fault

    # -- the event loop side ------------------------------------------------------------------
    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        with self._lock:
            self.connections += 1
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                try:
                    head = await client_r.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                req = _parse_request(head)
                fault = self._decide(req)
                if fault is not None and fault.kind == "reset":
                    close_writer(client_w, rst=True)
                    return
                if fault is not None and fault.kind.isdigit():
                    if fault.then is not None:
                        await asyncio.to_thread(fault.then)
                    await self._answer(req, fault, client_r, client_w)
                    return
                if fault is not None and fault.kind == "ignore_range":
                    req.head = _RANGE_LINE.sub(b"", req.head)
                    if fault.then is not None:
                        await asyncio.to_thread(fault.then)
                if upstream is None:
                    try:
                        upstream = await asyncio.open_connection(*self.target, limit=_LIMIT)
                    except OSError:
                        close_writer(client_w, rst=True)  # what a client of a stopped server sees
                        return
                if not await self._exchange(req, fault, client_r, client_w, *upstream):
                    return
        except (_Closed, ConnectionError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            close_writer(client_w, rst=True)
        except asyncio.CancelledError:
            # `_shutdown` cancelled it: end as a handler that returned (closed below), since Python
            # 3.11's stream callback asks a cancelled handler for its exception and logs a traceback.
            pass
        finally:
            close_writer(client_w, rst=False)
            if upstream is not None:
                close_writer(upstream[1], rst=False)
            self._tasks.discard(task)

    async def _answer(
        self, req: _Request, rule: Rule, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
    ) -> None:
        """Answer with the rule's status and close: the server never sees the request."""
        if not req.expect_continue:  # the client sends its body first: read it, so it sees our answer
            if req.length is None:
                await _copy_chunked(client_r, None)
            else:
                await _copy_exact(client_r, None, req.length)
        status = int(rule.kind)
        body = rule.body or f"injected {status}\n".encode()
        headers = {"Content-Type": "text/plain", **dict(rule.headers)}
        if status in (429, 503):
            headers.setdefault("Retry-After", "0")
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
        client_w.write("\r\n".join(lines).encode("latin-1") + body)
        await client_w.drain()
        client_w.close()

    async def _exchange(
        self,
        req: _Request,
        fault: Rule | None,
        client_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
        server_r: asyncio.StreamReader,
        server_w: asyncio.StreamWriter,
    ) -> bool:
        """Forward one request and its response; True if the connection can carry another."""
        server_w.write(req.head)
        await server_w.drain()
        # The body goes up while the answer may already come down (100-continue, early errors).
        body = asyncio.ensure_future(
            _copy_chunked(client_r, server_w) if req.length is None else _copy_exact(client_r, server_w, req.length)
        )
        try:
            keep = await self._relay_response(req, fault, server_r, client_w)
            if not body.done():
                keep = False  # answered before the body was sent: the framing is in doubt
            else:
                body.result()
            return keep
        finally:
            if not body.done():
                body.cancel()
                await asyncio.gather(body, return_exceptions=True)

    async def _trickle(self, data: bytes, client_w: asyncio.StreamWriter) -> None:
        """`data` a byte every `trickle_s` seconds, until the client gives up on it."""
        for i in range(len(data)):
            await asyncio.sleep(self.trickle_s)
            if client_w.is_closing():
                raise _Closed
            client_w.write(data[i : i + 1])
            await client_w.drain()

    async def _relay_response(
        self, req: _Request, fault: Rule | None, server_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
    ) -> bool:
        kind = fault.kind if fault is not None else None
        while True:
            head = await server_r.readuntil(b"\r\n\r\n")
            lines = head.rstrip(b"\r\n").split(b"\r\n")
            status = int(lines[0].split(b" ")[1])
            if 100 <= status < 200:  # interim (100 Continue): pass on, the final answer follows
                client_w.write(head)
                await client_w.drain()
                continue
            break
        headers = _parse_headers(lines[1:])
        if self.close_connections and "connection" not in headers:  # as a server at its keep-alive limit
            head = head[:-2] + b"Connection: close\r\n\r\n"
            headers["connection"] = "close"
        if kind == "stall":
            await asyncio.sleep(self.stall_s)
        if kind == "trickle_head":
            await self._trickle(head[:-1], client_w)
            head = head[-1:]
        client_w.write(head)
        await client_w.drain()
        close = headers.get("connection", "").lower() == "close"
        if req.method == "HEAD" or status in (204, 304):
            return not close
        if "chunked" in headers.get("transfer-encoding", "").lower():
            if kind in BODY_FAULTS:
                if fault is not None and fault.then is not None:
                    await asyncio.to_thread(fault.then)
                close_writer(client_w, rst=kind == "reset_body")
                return False
            await _copy_chunked(server_r, client_w)
            return not close
        if "content-length" not in headers:  # the body runs to the end of the connection
            while data := await server_r.read(65536):
                client_w.write(data)
                await client_w.drain()
            return False
        length = int(headers["content-length"])
        if kind == "trickle_body":
            half = length // 2
            await _copy_exact(server_r, client_w, half)
            await self._trickle(await server_r.readexactly(length - half), client_w)
            return not close
        if kind in BODY_FAULTS:
            half = length // 2
            await _copy_exact(server_r, client_w, half)
            if fault is not None and fault.then is not None:
                await asyncio.to_thread(fault.then)
            if kind == "stall_body":
                await asyncio.sleep(self.stall_s)
                await _copy_exact(server_r, client_w, length - half)
                return not close
            close_writer(client_w, rst=kind == "reset_body")
            return False
        await _copy_exact(server_r, client_w, length)
        return not close
