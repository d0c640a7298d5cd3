"""An asyncio server running its own event loop in a daemon thread: the lifecycle the
proxies share (`fault_proxy.FaultProxy`, `tcp_proxy.TcpProxy`, `wan_proxy.WanProxy`)."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading


class LoopThreadServer:
    """Subclasses set `target`, and implement `_handle` and `_shutdown` (close the server and
    cancel their connections); `listen_host` and `ssl_context` may be overridden."""

    listen_host = "127.0.0.1"
    ssl_context = None
    stream_limit = 2**16
    target: tuple[str, int]

    def __init__(self) -> None:
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def _shutdown(self) -> None:
        raise NotImplementedError

    def start(self):
        ready = threading.Event()
        error: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(
                        self._handle, self.listen_host, 0, ssl=self.ssl_context, limit=self.stream_limit
                    )
                )
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:  # reported to start()'s caller
                error.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=run, name=f"{type(self).__name__}-{self.target[1]}", daemon=True)
        self._thread.start()
        ready.wait()
        if error:
            raise error[0]
        return self

    def close(self) -> None:
        if self._loop is None or self._thread is None:
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop = self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def close_writer(writer: asyncio.StreamWriter | None, rst: bool) -> None:
    """Close one side of a proxied connection: with RST (a crashed or reset peer) or FIN."""
    if writer is None or writer.transport.is_closing():
        return
    if rst:
        sock = writer.transport.get_extra_info("socket")
        if sock is not None:
            # SO_LINGER 0: the close sends RST instead of FIN.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
    else:
        writer.close()
