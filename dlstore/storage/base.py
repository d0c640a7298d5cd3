"""The `Store` interface every backend implements, and its contract.

Every backend passes `tests/test_store_contract.py` unchanged:

* A store is rooted at a URL `scheme://container/prefix`. Keys are relative to that root,
  use `/` as separator, and never start with `/`.
* `list(prefix)` yields `ObjectInfo` in key order, lazily, page by page, for any number of objects.
* `get(key, start, end)` streams bytes. A read cut off mid-body resumes from the last byte
  received, so the caller sees each byte once. The retry budget starts again each time the
  failed attempts have moved a chunk. A read whose next chunk stalls past `stall_timeout_s`
  is cut and resumed the same way. `get_range` returns exactly the bytes asked for.
* `put(key, data)` streams bytes, a path, a binary file or an iterator of bytes. Large
  objects go as S3 multipart uploads or Swift static large objects. A put is atomic.
* A put into a missing container or bucket is `NotFound`: a typo must not make one.
  Writers that make a dataset call `ensure_container()` first, as `swift upload` does.
* Errors are `NotFound`, `AuthError`, `TransientError`, `NoSpace`, `ConfigError` or
  `DlstoreError`. Only transient ones are retried, with jittered backoff and a deadline.
* Credentials never appear in logs, errors or reprs.
* Stores pickle: clients are made lazily and dropped in `__getstate__`.

Backends implement the underscore methods. The public methods add key checks, retries and
resumption once, here.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import os
import re
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO, Union
from urllib.parse import urlsplit

from dlstore.config import RetryConfig, StoreConfig
from dlstore.errors import ConfigError, DlstoreError, NotFound, ObjectChanged, StalledRead, TransientError
from dlstore.storage.retry import ProgressRetry, call_with_retry
from dlstore.storage.stall import ConnectionRegistry, StallWatch, WatchedRead

__all__ = [
    "ObjectInfo",
    "PutSource",
    "Store",
    "IterReader",
    "connection_failure",
    "read_block",
    "remaining_size",
    "unknown_host",
]

PutSource = Union[bytes, bytearray, memoryview, str, "os.PathLike[str]", BinaryIO, Iterable[bytes]]


@dataclass(frozen=True)
class ObjectInfo:
    """One object: its key relative to the store root, its size, and an etag if the backend has one."""

    key: str
    size: int
    etag: str | None = None
    mtime: float | None = None


class IterReader(io.RawIOBase):
    """A read-only, non-seekable file over an iterator of byte chunks."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = iter(chunks)
        self._buffer = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, out) -> int:  # type: ignore[override]
        while not self._buffer:
            try:
                self._buffer = memoryview(next(self._chunks))
            except StopIteration:
                return 0
        n = min(len(out), len(self._buffer))
        out[:n] = self._buffer[:n]
        self._buffer = self._buffer[n:]
        return n


def read_block(stream: BinaryIO, size: int) -> bytes:
    """Up to `size` bytes; fewer only at the end of the stream, though a pipe reads short."""
    data = stream.read(size)
    if not data or len(data) == size:
        return data or b""
    parts = [data]
    got = len(data)
    while got < size:
        more = stream.read(size - got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def read_chunks(file: BinaryIO, length: int | None, chunk_size: int) -> Iterator[bytes]:
    """`length` bytes of `file` from where it stands, all if None, in chunks of `chunk_size`."""
    while length is None or length > 0:
        chunk = file.read(chunk_size if length is None else min(chunk_size, length))
        if not chunk:
            return
        if length is not None:
            length -= len(chunk)
        yield chunk


def remaining_size(stream: BinaryIO) -> int | None:
    """Bytes left in a seekable stream, or None when it cannot tell."""
    try:
        if not stream.seekable():
            return None
        here = stream.tell()
        end = stream.seek(0, os.SEEK_END)
        stream.seek(here)
        return end - here
    except (AttributeError, OSError, ValueError):
        return None


_CONTENT_RANGE = re.compile(r"\s*bytes\s+(\d+)-(\d+)/(\d+|\*)")


def answered_range(
    what: str, start: int, end: int | None, status: int, content_range: str | None, content_length: int | None
) -> tuple[int, int | None]:
    """Of a GET's answer: the body bytes to skip before byte `start`, and the object's size if told.

    The GET asked for bytes `[start, end)`, and the answer has HTTP `status`. A server may
    ignore the Range header and send the whole object: its first `start` bytes are skipped.
    An answer of another range than the one asked for is an error.

    >>> answered_range("x", 10, 20, 206, "bytes 10-19/100", 10), answered_range("x", 10, 20, 200, None, 100)
    ((0, 100), (10, 100))
    """
    ranged = bool(start or end is not None)
    if status != 206:
        return (start if ranged else 0), content_length
    if content_range is None:  # a 206 that does not say which bytes: taken as asked for
        return 0, None
    found = _CONTENT_RANGE.match(content_range)
    if found is None or int(found[1]) != start:
        raise DlstoreError(f"{what}: asked for bytes {start}-, the server answered {content_range!r}")
    return 0, None if found[3] == "*" else int(found[3])


def split_bucket_url(url: str, scheme: str, what: str) -> tuple[str, str, str]:
    """`(bucket, prefix, canonical URL)` of `scheme://bucket/prefix`; `what` names the bucket."""
    parts = urlsplit(url)
    if parts.scheme != scheme or not parts.netloc:
        raise ConfigError(f"{url!r} is not a {scheme}://{what}/prefix URL")
    prefix = parts.path.strip("/")
    return parts.netloc, prefix, f"{scheme}://{parts.netloc}/{prefix}" if prefix else f"{scheme}://{parts.netloc}"


def check_key(key: str) -> str:
    if not key or key.startswith("/") or "//" in key or key.endswith("/"):
        raise ConfigError(f"invalid object key {key!r}: keys are relative paths like 'train/shard-000000.tar'")
    if any(part in (".", "..") for part in key.split("/")):
        raise ConfigError(f"invalid object key {key!r}: '.' and '..' are not allowed")
    return key


@dataclass
class ReadPin:
    """The ETag and size the first answer of one streamed read gave.

    A resume sends the ETag as If-Match, so it cannot splice two versions of an object.
    """

    etag: str | None = None
    size: int | None = None

    def note(self, etag: str | None, size: int | None) -> None:
        """What an answer says; only the first answer's is kept."""
        self.etag = self.etag or etag
        self.size = self.size if self.size is not None else size


def skip_prefix(chunk: bytes, skip: int) -> tuple[bytes, int]:
    """`chunk` without the first `skip` bytes of what is left to skip, and what is left then."""
    taken = min(skip, len(chunk))
    return chunk[taken:], skip - taken


class Store(ABC):
    """A bucket, container or directory with a key prefix; the module docstring has the contract::

    store = open_store("file:///tmp/data")
    store.put("a/b.txt", b"hello")
    store.get_bytes("a/b.txt")  # b'hello'
    """

    scheme: str = ""

    def __init__(self, url: str, config: StoreConfig | None = None) -> None:
        self.url = url.rstrip("/")
        self.config = config or StoreConfig()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # -- pickling: subclasses keep their clients in attributes starting with "_client"
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_client")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    # -- public API -------------------------------------------------------------------
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Objects whose key starts with `prefix`, in key order, fetched page by page."""
        return self._list(prefix)

    def stat(self, key: str) -> ObjectInfo:
        key = check_key(key)
        return call_with_retry(self.config.retry, lambda: self._stat(key))

    def exists(self, key: str) -> bool:
        try:
            self.stat(key)
        except NotFound:
            return False
        return True

    def get(self, key: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """Stream bytes `[start, end)` of `key`, to its end when `end` is None.

        A transient failure mid-stream re-opens the object at the next byte, so the
        chunks are exactly the object's bytes, once.
        """
        key = check_key(key)
        if start < 0 or (end is not None and end < start):
            raise ConfigError(f"invalid byte range [{start}, {end}) for {key!r}")
        position = start
        # The budget restarts after each chunk that failed attempts moved: one budget for a
        # stream would kill a slow large download, and a restart per byte lets a trickle hold it.
        retry = ProgressRetry(self.config.retry, least=self.config.chunk_size)
        pin = ReadPin()
        while end is None or position < end:
            reached = position
            try:
                # `_read` checks the announced length: ending early here means the object ended.
                chunks = self._read(key, position, end, pin) if self.reads_versions else self._read(key, position, end)
                for chunk in chunks:
                    if end is not None and position + len(chunk) > end:  # never past `end`
                        chunk = chunk[: end - position]
                    position += len(chunk)
                    if chunk:
                        yield chunk
                    if end is not None and position >= end:
                        return
            except TransientError as exc:
                retry.failed(exc, moved=position - reached)
                continue
            if pin.size is not None and position < min(pin.size, end or pin.size):
                raise ObjectChanged(
                    f"{self.join(key)}: a resumed read ended at byte {position} of the {pin.size} the object had"
                )
            return

    def _stall_watch(self) -> StallWatch:
        """This process's watch over this store's streamed reads, for backends that can cut them."""
        watch = self.__dict__.get("_client_stall_watch")
        timeout_s = self.config.retry.stall_timeout_s
        if watch is None or watch.pid != os.getpid() or watch.timeout_s != timeout_s:
            watch = self.__dict__["_client_stall_watch"] = StallWatch(timeout_s)
        return watch

    def _connections(self) -> ConnectionRegistry:
        """Which connection each thread sends on, for `_answer_watched`."""
        return self.__dict__.setdefault("_client_connections", ConnectionRegistry())

    @contextlib.contextmanager
    def _answer_watched(self, what: str) -> Iterator[WatchedRead]:
        """Cut a call whose awaited answer takes longer than `stall_timeout_s`: `StalledRead`.

        The call must send on a connection of the `_connections` pools. A server that sends a
        head a byte at a time never trips the read timeout; this catches it. An upload's body
        wrapped in a `ProgressBody` of the yielded read restarts the wait at each block.
        """
        read = self._stall_watch().watch(self._connections().cutter())
        stalled = StalledRead(
            f"{what}: no answer within {self.config.retry.stall_timeout_s:g} s, nor a block of an upload taken "
            "(a stalled or trickling connection); the request was cut"
        )
        try:
            with read.waiting():
                yield read
        except Exception:
            if read.cut:
                raise stalled from None
            raise
        finally:
            read.done()
        if read.cut:  # http.client takes a head cut short for a whole one: what came is not the answer
            raise stalled

    def _stalled(self, what: str) -> StalledRead:
        return StalledRead(
            f"{what}: no {self.config.chunk_size} bytes came within {self.config.retry.stall_timeout_s:g} s "
            "(a stalled or trickling connection); the read was cut"
        )

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Exactly `length` bytes from offset `start`; fewer only if the object ends first."""
        if length <= 0:
            return b""
        return b"".join(self.get(key, start, start + length))

    def get_bytes(self, key: str) -> bytes:
        return b"".join(self.get(key))

    def with_retry(self, retry: RetryConfig) -> Store:
        """This store under another retry policy, e.g. a short deadline for reads with a fallback.

        The copy makes its own clients, as an unpickled store does.
        """
        other = copy.copy(self)
        other.config = dataclasses.replace(self.config, retry=retry)
        return other

    #: Byte ranges one GET of `get_ranges` may ask for; 1 is a GET per range.
    ranges_per_get: int = 1

    def get_ranges(self, key: str, spans: list[tuple[int, int]]) -> list[bytes]:
        """The bytes of each `(start, length)` of `spans`, ascending and apart, of `key`.

        One GET per span here; a store whose GETs take `ranges_per_get` ranges asks for more at once.
        """
        return [self.get_range(key, start, length) for start, length in spans]

    def put(self, key: str, data: PutSource) -> None:
        """Write `data` to `key`, streaming; large sources go in segments."""
        key = check_key(key)
        if isinstance(data, (bytes, bytearray, memoryview)):
            payload = bytes(data)
            call_with_retry(self.config.retry, lambda: self._write(key, io.BytesIO(payload)))
        elif isinstance(data, (str, os.PathLike)):
            with open(data, "rb") as file:
                self._put_seekable(key, file)
        elif hasattr(data, "read"):
            if getattr(data, "seekable", lambda: False)():
                self._put_seekable(key, data)  # type: ignore[arg-type]
            else:
                self._write(key, data)  # type: ignore[arg-type]
        else:
            self._write(key, io.BufferedReader(IterReader(data), buffer_size=self.config.chunk_size))  # type: ignore[arg-type]

    def _put_seekable(self, key: str, file: BinaryIO) -> None:
        origin = file.tell()

        def attempt() -> None:
            file.seek(origin)
            self._write(key, file)

        call_with_retry(self.config.retry, attempt)

    def ensure_container(self) -> None:
        """Create the container or bucket this store lives in, if it is missing.

        `AuthError` when the credentials may not create it, with the command that would.

        >>> open_store("swift://new-container/imagenet").ensure_container()   # doctest: +SKIP
        """
        self._ensure_container()

    def remove_abandoned_uploads(self, prefix: str = "", older_than_s: float = 3600.0) -> int:
        """Remove what uploads under `prefix` left, begun over `older_than_s` ago and never done.

        A writer killed mid-upload leaves S3 multipart parts, or Swift segments no manifest
        names. They cost space for good. Returns how many uploads' leftovers went.
        """
        return 0

    def delete(self, key: str) -> None:
        """Remove `key` and its segments; `NotFound` if it is not there."""
        key = check_key(key)
        call_with_retry(self.config.retry, lambda: self._delete(key))

    def _deleted_once(self, delete: Callable[[], object]) -> None:
        """A backend's DELETE, retried on its own.

        After an attempt whose answer was lost, a `NotFound` is the object gone, as asked.
        """
        sent = False

        def attempt() -> None:
            nonlocal sent
            try:
                delete()
            except NotFound:
                if sent:
                    return
                raise
            except TransientError:
                sent = True
                raise

        call_with_retry(self.config.retry, attempt)

    def join(self, key: str) -> str:
        """The full URL of `key`."""
        return f"{self.url}/{key}"

    # -- what backends implement --------------------------------------------------------
    @abstractmethod
    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Yield objects under `prefix` in key order; retry each page internally."""

    @abstractmethod
    def _stat(self, key: str) -> ObjectInfo: ...

    @abstractmethod
    def _read(self, key: str, start: int, end: int | None) -> Iterator[bytes]:
        """Stream `[start, end)`; a body shorter than announced is a `TransientError`.

        A backend that tells versions apart sets `reads_versions` and takes a `ReadPin`. It
        fills the pin from its first answer, and its resumes ask for that version only. Another
        version there now is `ObjectChanged`.
        """

    #: Whether `_read` takes a `ReadPin`, as its docstring says.
    reads_versions: bool = False

    @abstractmethod
    def _write(self, key: str, stream: BinaryIO) -> None:
        """Write everything `stream.read()` yields; a seekable source is retried from the start."""

    @abstractmethod
    def _delete(self, key: str) -> None: ...

    @abstractmethod
    def _ensure_container(self) -> None:
        """Make the container, bucket or root directory unless it exists; retry what is transient."""


def connection_failure(exc: BaseException) -> str:
    """Where a connection failed and why, as `" (127.0.0.1:1: Connection refused)"`, or "".

    Only the host, port and reason are taken from the text: never a path or a signed query.
    """
    text = str(exc)
    host = None
    endpoint = (
        getattr(exc, "kwargs", {}).get("endpoint_url") if isinstance(getattr(exc, "kwargs", None), dict) else None
    )
    if endpoint:
        parts = urlsplit(endpoint)
        host = f"{parts.hostname}:{parts.port}" if parts.port else parts.hostname
    else:
        found = re.search(r"host='([^'/@]+)', port=(\d+)", text)
        host = f"{found[1]}:{found[2]}" if found else None
    why = re.search(r"\[Errno -?\d+\] ([A-Za-z][A-Za-z ,.-]*[A-Za-z])", text)
    detail = ": ".join(part for part in (host, why[1] if why else None) if part)
    return f" ({detail})" if detail else ""


#: getaddrinfo's answers that a name does not exist. EAI_AGAIN, a resolver not reached, is retried.
_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def unknown_host(exc: BaseException) -> bool:
    """Whether `exc` or its chain says the store's host name does not exist: no retry mends it."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, socket.gaierror) and error.errno in _NO_SUCH_NAME:
            return True
        # urllib3's MaxRetryError keeps its cause in `reason`, aiohttp's connector errors in `os_error`.
        pending += [
            error.__cause__,
            error.__context__,
            getattr(error, "reason", None),
            getattr(error, "os_error", None),
        ]
        pending = [e for e in pending if e is None or isinstance(e, BaseException)]
    return False


def grown_part_size(part_size: int, index: int, max_parts: int, max_size: int) -> int:
    """The size of part `index` of an upload of unknown length, in at most `max_parts` parts.

    It is the size asked for, doubled after each tenth of `max_parts`, up to `max_size`. A
    stream that fits keeps the size asked for. A part, buffered in memory, stays near 1% of
    what came before it.

    >>> [grown_part_size(1, i, 1000, 2**30) for i in (0, 99, 100, 200, 999)]
    [1, 1, 2, 4, 512]
    """
    step = max(1, max_parts // 10)
    return min(max(part_size, max_size), part_size * 2 ** (index // step))
