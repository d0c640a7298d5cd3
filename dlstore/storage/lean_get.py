"""Bulk GETs that read the body straight from the socket into the chunks handed on.

A cold epoch receives every byte of its shards through 16-32 download threads beside the
decode. Through swiftclient (or botocore), requests and urllib3, each chunk passes several
layers of Python, with the GIL held, on its way to the cache file. Here a ranged GET is one
`http.client` request on a kept-alive connection of the calling thread, and its body goes from
the socket into a new chunk with `recv_into`: one Python frame per receive. Since a thread's
connections are its own, they close when a short-lived thread (a direct read's) ends, rather
than when the garbage collector gets to them.

Only what a store's bulk read needs: GET, a `Content-Length` body (anything else is read
through `http.client`), TLS trusting what the client libraries trust (the store's CA bundle,
else certifi's), no proxy (a store reached through a proxy keeps its client library:
`proxied`). Statuses are the caller's to map, and failures too, with `failure_kind`; a
connection is kept only after a body read to its end.
"""

from __future__ import annotations

import errno
import http.client
import inspect
import os
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field

import requests.utils

__all__ = ["LeanResponse", "LeanSession", "failure_kind", "proxied"]

_ERROR_BODY = 64 * 1024
_NETWORK_ERRNOS = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN, errno.EHOSTDOWN, errno.ETIMEDOUT}
#: What a connection kept by a thread may have been closed by the server with, noticed only
#: when a request is sent on it: that request goes once more on a new connection.
_STALE = (
    http.client.RemoteDisconnected,
    ConnectionResetError,
    BrokenPipeError,
    ConnectionAbortedError,
    ssl.SSLEOFError,
)


def proxied(url: str) -> bool:
    """Whether the environment sends requests for `url` through a proxy (`https_proxy`,
    `all_proxy`, `no_proxy`, ...), as requests decides it."""
    return bool(requests.utils.select_proxy(url, requests.utils.get_environ_proxies(url)))


def failure_kind(exc: BaseException) -> str:
    """What a `LeanSession` failure is, for the store to map: "tls" (a certificate or a
    handshake refused: retrying will not help), "transient" (the connection: a name that did
    not resolve, refused, reset, timed out, cut, a malformed answer) or "other"."""
    if isinstance(exc, ssl.SSLError) and not isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
        return "tls"
    if isinstance(exc, (ConnectionError, TimeoutError, socket.gaierror, http.client.HTTPException, ssl.SSLError)):
        return "transient"
    if isinstance(exc, OSError) and exc.errno in _NETWORK_ERRNOS:
        return "transient"
    return "other"


@dataclass
class LeanResponse:
    """One GET's answer: `status`, `headers` (lower-case names) and, for a status under 300,
    `body`: the body in chunks of up to the session's `chunk_size` (bytearrays, each new); for
    any other, `error_body`: its first `_ERROR_BODY` bytes (an S3 error's XML names its code)."""

    status: int
    reason: str
    headers: dict[str, str]
    body: LeanBody = field(default_factory=lambda: LeanBody(iter(())))
    error_body: bytes = b""


class LeanBody:
    """A body's chunks. `close()` ends it, and closes its connection unless it was read to its
    end (kept for the thread's next GET), started or not."""

    def __init__(self, chunks: Iterator[bytearray], close_unstarted: tuple = ()) -> None:
        self._chunks = chunks
        self._close_unstarted = close_unstarted  # what a started body's own end would close

    def __iter__(self) -> Iterator[bytearray]:
        return self._chunks

    def __next__(self) -> bytearray:
        return next(self._chunks)

    def close(self) -> None:
        if inspect.isgenerator(self._chunks) and inspect.getgeneratorstate(self._chunks) == inspect.GEN_CREATED:
            for closable in self._close_unstarted:
                closable.close()
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()


class _IdleConnections(dict):
    """A thread's idle connections, by host: closed when the thread ends (its thread-local
    data goes then), not left for the garbage collector."""

    def __del__(self) -> None:
        for conn in self.values():
            conn.close()


class LeanSession:
    """Keep-alive HTTP(S) connections, one per thread and host, for GETs whose bodies go
    straight from the socket into new chunks. `timeout`: (connect, read) seconds.

    Made per process (a forked child starts with none: a socket shared with the parent would
    mix two conversations); `close()` drops the calling thread's connections."""

    def __init__(
        self, timeout: tuple[float, float], chunk_size: int, cafile: str | None = None, insecure: bool = False
    ) -> None:
        self.connect_timeout_s, self.read_timeout_s = timeout
        self.chunk_size = chunk_size
        self._cafile, self._insecure = cafile, insecure
        self._tls: ssl.SSLContext | None = None
        self._local = threading.local()

    def get(self, url: str, headers: dict[str, str]) -> LeanResponse:
        """GET `url`. Raises what `http.client` and the socket raise (`failure_kind` tells).
        A body to read comes back open: read it to its end, or `close()` it."""
        parts = urllib.parse.urlsplit(url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        key = (parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
        for attempt in (1, 2):
            conn, reused = self._connection(key)
            try:
                conn.request("GET", target, headers=headers)
                sock = conn.sock  # taken now: a "Connection: close" answer drops it from `conn`
                response = conn.getresponse()
            except _STALE:
                conn.close()
                if reused and attempt == 1:
                    continue  # the server closed it while idle: once more on a new one
                raise
            except BaseException:
                conn.close()
                raise
            break
        names = {name.lower(): value for name, value in response.getheaders()}
        if response.status < 300:
            body = LeanBody(self._body(key, conn, response, sock), (response, conn))
            return LeanResponse(response.status, response.reason, names, body)
        try:
            error_body = response.read(_ERROR_BODY)
            if not response.isclosed():  # longer than an error's: not worth reading to keep the connection
                conn.close()
                response.close()
                return LeanResponse(response.status, response.reason, names, error_body=error_body)
        except BaseException:
            conn.close()
            raise
        self._keep(key, conn, response)
        return LeanResponse(response.status, response.reason, names, error_body=error_body)

    def close(self) -> None:
        """Close the calling thread's idle connections."""
        for conn in self._idle().values():
            conn.close()
        self._idle().clear()

    # -- connections -----------------------------------------------------------------------
    def _idle(self) -> dict[tuple, http.client.HTTPConnection]:
        return self._local.__dict__.setdefault("idle", _IdleConnections())

    def _connection(self, key: tuple) -> tuple[http.client.HTTPConnection, bool]:
        """The thread's idle connection to `key`'s host (taken: a connection is idle only
        between one answer read to its end and the next request), else a new one."""
        conn = self._idle().pop(key, None)
        if conn is not None:
            return conn, True
        scheme, host, port = key
        if scheme == "https":
            conn = http.client.HTTPSConnection(host, port, timeout=self.connect_timeout_s, context=self._tls_context())
        elif scheme == "http":
            conn = http.client.HTTPConnection(host, port, timeout=self.connect_timeout_s)
        else:
            raise ValueError(f"not an HTTP URL scheme: {scheme!r}")
        try:
            conn.connect()
        except BaseException:
            conn.close()  # a refused handshake leaves the TCP socket open otherwise
            raise
        conn.sock.settimeout(self.read_timeout_s)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn, False

    def _tls_context(self) -> ssl.SSLContext:
        """Trust as the client libraries do: the store's CA bundle (a file or a directory),
        else requests' (certifi's)."""
        if self._tls is None:
            trust = self._cafile or requests.utils.DEFAULT_CA_BUNDLE_PATH
            if os.path.isdir(trust):
                context = ssl.create_default_context(capath=trust)
            else:
                context = ssl.create_default_context(cafile=trust)
            if self._insecure:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            self._tls = context
        return self._tls

    def _keep(self, key: tuple, conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        response.close()
        if response.will_close:
            conn.close()
            return
        old = self._idle().pop(key, None)
        if old is not None:
            old.close()
        self._idle()[key] = conn

    # -- bodies ----------------------------------------------------------------------------
    def _body(
        self, key: tuple, conn: http.client.HTTPConnection, response: http.client.HTTPResponse, sock: socket.socket
    ) -> Iterator[bytearray]:
        """The body in new chunks, read from the socket after what `http.client` buffered with
        the headers. The connection is kept for the thread's next GET only when the body was
        read to its end and the server did not ask to close it; any other end closes it (one
        never started: `LeanBody.close`)."""
        complete = False
        try:
            if response.length is None or response.chunked or "content-encoding" in response.headers:
                while chunk := response.read(self.chunk_size):  # not a plain body: http.client frames it
                    yield bytearray(chunk)
            else:
                remaining = response.length
                # First the bytes the response's reader took in with the headers (all of them:
                # `peek` gives its whole buffer, or one read of the socket when it is empty)...
                early = response.fp.read1(min(len(response.fp.peek()), remaining)) if remaining else b""
                for at in range(0, len(early), self.chunk_size):
                    yield bytearray(early[at : at + self.chunk_size])
                remaining -= len(early)
                # ... then the socket itself.
                while remaining:
                    chunk = bytearray(min(self.chunk_size, remaining))
                    view = memoryview(chunk)
                    got = 0
                    while got < len(chunk):
                        n = sock.recv_into(view[got:])
                        if n == 0:
                            break  # the server closed early: the caller sees a short body
                        got += n
                    remaining -= got
                    yield chunk if got == len(chunk) else chunk[:got]
                    if got < len(chunk):
                        return
                response.length = 0
            complete = True
        finally:
            if complete:
                self._keep(key, conn, response)
            else:
                response.close()
                conn.close()
