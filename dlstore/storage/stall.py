"""Cutting streamed reads that stopped moving, from another thread.

A server that sends a byte a second never trips a socket's read timeout, so a watch thread
shuts the response. The read fails as `StalledRead`, and `Store.get` resumes it.

>>> read = StallWatch(timeout_s=60.0).watch(response.shutdown)   # doctest: +SKIP
>>> try:                                                          # doctest: +SKIP
...     while True:
...         with read.waiting():              # only the wait for the server counts
...             chunk = response.read(2**20)
...         if not chunk:
...             break
...         yield chunk                       # a slow consumer is no stall
... finally:
...     read.done()

A call awaited inside the client library has no response yet to shut, so its socket is shut.
Pools made by `watched_pools` note each thread's socket in a `ConnectionRegistry`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO

__all__ = ["ConnectionRegistry", "ProgressBody", "StallWatch", "WatchedRead", "watched_pools"]

log = logging.getLogger(__name__)


class WatchedRead:
    """One read under a `StallWatch`; `cut` is true once the watch has cut it.
    Wrap each wait for the server's next chunk in `waiting()`, and call `done()` at its end."""

    def __init__(self, watch: StallWatch, cut: Callable[[], bool | None]) -> None:
        self._watch = watch
        self._cut = cut
        self._lock = threading.Lock()  # a cut lands inside the wait it was meant for, or not at all
        self.cut = False
        self.since: float | None = None  # when the current wait began; None between waits

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        self.since = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self.since = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Around the client's own work inside a watched call, such as reading an upload's next
        block. That is no wait for the server. The wait starts again after it."""
        with self._lock:
            self.since = None
        try:
            yield
        finally:
            with self._lock:
                self.since = time.monotonic()

    def done(self) -> None:
        self._watch.forget(self)

    def stalled(self, now: float, timeout_s: float) -> bool:
        since = self.since
        return not self.cut and since is not None and now - since > timeout_s

    def shut(self) -> None:
        """Cut the read if it still waits; with no socket yet, try again while the wait lasts."""
        with self._lock:
            if self.since is None or self.cut:
                return
            try:
                self.cut = self._cut() is not False
            except Exception as exc:  # already closed or released: nothing is blocked on it then
                log.debug("cutting a stalled read: %r", exc)


class ProgressBody:
    """An upload's body that tells its `WatchedRead` each time a block is taken to be sent.

    A server that takes the body a byte at a time shows as a wait that does not end."""

    def __init__(self, raw: BinaryIO, read: WatchedRead) -> None:
        self._raw = raw
        self._watched = read

    def read(self, size: int = -1) -> bytes:
        with self._watched.paused():
            return self._raw.read(size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def __iter__(self) -> Iterator[bytes]:
        while block := self.read(2**16):
            yield block


class StallWatch:
    """One daemon thread that cuts each of a store's reads whose wait passes `timeout_s`.

    It runs only while reads are watched, and is made again in a forked child."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.pid = os.getpid()
        self._reads: set[WatchedRead] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, cut: Callable[[], bool | None]) -> WatchedRead:
        """A `WatchedRead` that the watch's thread ends with `cut()` when it stalls.
        `cut` returns False when it found nothing to shut."""
        read = WatchedRead(self, cut)
        with self._lock:
            self._reads.add(read)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dlstore-stall-watch", daemon=True)
                self._thread.start()
        return read

    def forget(self, read: WatchedRead) -> None:
        with self._lock:
            self._reads.discard(read)

    def _run(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while True:
            time.sleep(period)
            now = time.monotonic()
            with self._lock:
                if not self._reads:
                    self._thread = None  # the next `watch` starts another
                    return
                stalled = [read for read in self._reads if read.stalled(now, self.timeout_s)]
            for read in stalled:
                read.shut()


class ConnectionRegistry:
    """The socket each thread last sent a request on, so a stalled call can be cut.

    The socket, not its connection: http.client drops the socket of a closing connection."""

    def __init__(self) -> None:
        self._by_thread: dict[int, tuple[weakref.ref, float]] = {}

    def note(self, sock: socket.socket) -> None:
        self._by_thread[threading.get_ident()] = (weakref.ref(sock), time.monotonic())

    def cutter(self) -> Callable[[], bool]:
        """A cut of the socket this thread sends its next request on; False while there is none."""
        thread, since = threading.get_ident(), time.monotonic()

        def cut() -> bool:
            ref, noted = self._by_thread.get(thread, (None, 0.0))
            sock = ref() if ref is not None and noted >= since else None
            if sock is None:
                return False
            sock.shutdown(socket.SHUT_RDWR)
            return True

        return cut


def watched_pools(pools: Mapping[str, type], registry: ConnectionRegistry) -> dict[str, type]:
    """Pool classes, by scheme, whose connections note themselves in `registry` as requests go."""
    out = {}
    for scheme, pool in pools.items():

        class Connection(pool.ConnectionCls):  # type: ignore[name-defined,misc]
            def connect(self) -> None:
                super().connect()
                registry.note(self.sock)

            def request(self, *args, **kwargs):  # type: ignore[no-untyped-def]
                if self.sock is not None:  # a kept-alive connection; a new one notes it in `connect`
                    registry.note(self.sock)
                return super().request(*args, **kwargs)

        out[scheme] = type(f"Watched{pool.__name__}", (pool,), {"ConnectionCls": Connection})
    return out
