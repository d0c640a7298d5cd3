"""Any other fsspec URL: `memory://`, a read-only `https://`, `gcs://`, `abfs://`, ...

The native `file`, `s3` and `swift` backends are faster and retry more precisely. This one
exists so a dataset can live anywhere fsspec reaches.

    >>> store = FsspecStore("memory://scratch")
    >>> store.put("a.txt", b"hi"); store.get_bytes("a.txt")
    b'hi'
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any, BinaryIO

from dlstore.config import StoreConfig
from dlstore.errors import AuthError, ConfigError, DlstoreError, NotFound, TransientError
from dlstore.logs import redact_url, redact_urls_in
from dlstore.storage.base import ObjectInfo, Store, read_chunks, unknown_host

__all__ = ["FsspecStore"]

_TEMP_PREFIX = ".dlstore-tmp-"


def _map_error(exc: BaseException, what: str) -> DlstoreError:
    if isinstance(exc, DlstoreError):
        return exc
    if unknown_host(exc):
        return ConfigError(f"{what}: the URL's host name does not resolve (no such host); check the URL")
    if isinstance(exc, FileNotFoundError):
        # fsspec's HTTP `info` turns every failed HEAD or GET, 503 or 401 say, into
        # FileNotFoundError. The answer's status, kept in the chain, says what it was.
        # So does a failed connection, a server down or a resolver that cannot answer: retried.
        cause = _http_cause(exc)
        if cause is not None and _response_status(cause) != 404:
            return _map_error(cause, what)
        if cause is None and (failure := _connection_cause(exc)) is not None:
            return TransientError(f"{what}: {type(failure).__name__}")
        return NotFound(f"{what}: not found")
    if isinstance(exc, PermissionError):
        return AuthError(f"{what}: permission denied")
    status = _response_status(exc)
    if status is not None:
        # Status and reason only: the exception's text holds the URL, maybe with a signed query.
        text = f"{what}: HTTP {status} {getattr(exc, 'message', '') or ''}".rstrip()
        if status == 404:
            return NotFound(text)
        if status in (401, 403):
            return AuthError(text)
        if status in (408, 429) or status >= 500:
            return TransientError(text)
        return DlstoreError(text)
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return TransientError(f"{what}: {type(exc).__name__}")
    if isinstance(exc, NotImplementedError):
        return DlstoreError(f"{what}: this file system does not support the operation (read-only?)")
    transient = _transient_client_errors()
    if transient and isinstance(exc, transient):
        return TransientError(f"{what}: {type(exc).__name__}")
    return DlstoreError(f"{what}: {type(exc).__name__}: {redact_urls_in(str(exc))}")


def _response_status(exc: BaseException | None) -> int | None:
    """The HTTP status of an aiohttp `ClientResponseError` from fsspec's http, gcs or abfs, else None."""
    try:
        from aiohttp import ClientResponseError
    except ImportError:
        return None
    return exc.status if isinstance(exc, ClientResponseError) and isinstance(exc.status, int) else None


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """The errors of the cause/context chain of `exc`, `exc` excluded."""
    seen: set[int] = set()
    cause = exc.__cause__ or exc.__context__
    while cause is not None and id(cause) not in seen:
        yield cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__


def _http_cause(exc: BaseException) -> BaseException | None:
    """The first HTTP error answer in the cause/context chain of `exc`, if any."""
    return next((cause for cause in _causes(exc) if _response_status(cause) is not None), None)


def _connection_cause(exc: BaseException) -> BaseException | None:
    """The first failed connection in the cause/context chain of `exc`, if any."""
    transient = (ConnectionError, TimeoutError, *_transient_client_errors())
    return next((cause for cause in _causes(exc) if isinstance(cause, transient)), None)


def _transient_client_errors() -> tuple[type[BaseException], ...]:
    """aiohttp's connection errors, as fsspec's http, gcs and abfs raise, when aiohttp is installed."""
    try:
        import aiohttp
    except ImportError:
        return ()
    return (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)


class FsspecStore(Store):
    """Objects are files of an fsspec file system under a root path.

    Puts write a temporary file beside the target and copy it into place, so readers never
    see half an object. On object stores that costs a server-side copy: use the native backends.
    """

    def __init__(self, url: str, config: StoreConfig | None = None) -> None:
        try:
            import fsspec
        except ImportError as exc:  # pragma: no cover - fsspec is a dependency
            raise ConfigError("fsspec URLs need fsspec: pip install fsspec") from exc
        super().__init__(url, config)
        self.scheme = url.split("://", 1)[0]
        # The URL as given opens the file system. `url`, in every message, log line and repr,
        # hides its credentials: a password in it, a signed query's signature.
        self._opens = self.url
        self.url = redact_url(self.url)
        try:
            fs, root = fsspec.core.url_to_fs(self._opens, **self._fs_options())
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"cannot open {self.url!r} with fsspec: {type(exc).__name__}") from None
        self.root = root.rstrip("/")
        # `_client*` attributes are dropped when pickled and made again on first use.
        self._client_fs = fs

    @property
    def fs(self) -> Any:
        fs = getattr(self, "_client_fs", None)
        if fs is None:
            import fsspec

            fs, _ = fsspec.core.url_to_fs(self._opens, **self._fs_options())
            self._client_fs = fs
        return fs

    def _fs_options(self) -> dict[str, Any]:
        """For http:// and https://, aiohttp's timeouts from the retry config.

        No byte for `read_timeout_s` fails the attempt, retried from the next byte. A long
        answer is not cut.
        """
        if self.scheme not in ("http", "https"):
            return {}
        try:
            import aiohttp
        except ImportError:  # pragma: no cover - fsspec's http needs it anyway
            return {}
        retry = self.config.retry
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=retry.connect_timeout_s, sock_read=retry.read_timeout_s
        )
        return {"client_kwargs": {"timeout": timeout}}

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root else key

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        # `find` below the deepest directory the prefix names, then filter and sort:
        # the whole subtree is listed at once, which is what fsspec offers.
        base, _, _ = prefix.rpartition("/")
        start = self._path(base) if base else self.root
        try:
            found = self.fs.find(start, detail=True)
        except FileNotFoundError:
            return
        except Exception as exc:
            raise _map_error(exc, self.url) from None
        entries = []
        for path, info in found.items():
            if not path.startswith(self.root):
                continue
            key = path[len(self.root) :].lstrip("/")
            if key.startswith(prefix) and not key.rpartition("/")[2].startswith(_TEMP_PREFIX):
                entries.append((key, info))
        for key, info in sorted(entries, key=lambda item: item[0]):
            yield ObjectInfo(key=key, size=int(info.get("size") or 0), etag=_etag(info), mtime=_mtime(info))

    def _stat(self, key: str) -> ObjectInfo:
        try:
            info = self.fs.info(self._path(key))
        except Exception as exc:
            raise _map_error(exc, self.join(key)) from None
        if info.get("type") == "directory":
            raise NotFound(f"{self.join(key)}: a directory, not an object")
        return ObjectInfo(key=key, size=int(info.get("size") or 0), etag=_etag(info), mtime=_mtime(info))

    def _read(self, key: str, start: int, end: int | None) -> Iterator[bytes]:
        what = self.join(key)
        path = self._path(key)
        position = start
        try:
            try:
                for chunk in self._read_file(path, start, end, self.config.chunk_size):
                    position += len(chunk)
                    yield chunk
            except ValueError:
                # An HTTP server without range requests, found on the first read past fsspec's
                # first block: stream from byte 0 and skip what was delivered.
                yield from self._read_file(path, position, end, 0)
        except Exception as exc:
            raise _map_error(exc, what) from None

    def _read_file(self, path: str, start: int, end: int | None, block_size: int) -> Iterator[bytes]:
        chunk_size = self.config.chunk_size
        with self.fs.open(path, "rb", block_size=block_size) as file:
            if block_size:
                file.seek(start)
            else:
                skip = start
                while skip > 0:
                    skipped = len(file.read(min(skip, chunk_size)))
                    if not skipped:
                        return
                    skip -= skipped
            yield from read_chunks(file, None if end is None else end - start, chunk_size)

    def _write(self, key: str, stream: BinaryIO) -> None:
        what = self.join(key)
        path = self._path(key)
        parent, _, name = path.rpartition("/")
        temp = f"{parent}/{_TEMP_PREFIX}{secrets.token_hex(8)}-{name}" if parent else f"{_TEMP_PREFIX}{name}"
        fs = self.fs
        try:
            if parent:
                fs.makedirs(parent, exist_ok=True)
            with fs.open(temp, "wb") as out:
                while True:
                    chunk = stream.read(self.config.chunk_size)
                    if not chunk:
                        break
                    out.write(chunk)
            # cp_file and rm_file, not mv: mv and rm expand glob characters such as "?" in names.
            fs.cp_file(temp, path)
        except Exception as exc:
            raise _map_error(exc, what) from None
        finally:
            try:
                fs.rm_file(temp)
            except Exception:
                pass

    def _ensure_container(self) -> None:
        # A bucket on fsspec's object stores such as gcsfs and adlfs, a directory elsewhere.
        try:
            if self.root and not self.fs.exists(self.root):
                self.fs.makedirs(self.root, exist_ok=True)
        except Exception as exc:
            raise _map_error(exc, self.url) from None

    def _delete(self, key: str) -> None:
        path = self._path(key)
        try:
            if not self.fs.isfile(path):
                raise NotFound(f"{self.join(key)}: not found")
            self.fs.rm_file(path)
        except Exception as exc:
            raise _map_error(exc, self.join(key)) from None


def _etag(info: dict) -> str | None:
    value = info.get("ETag") or info.get("etag") or info.get("md5Hash")
    return str(value).strip('"') if value else None


def _mtime(info: dict) -> float | None:
    value = info.get("mtime") or info.get("created") or info.get("LastModified") or info.get("last_modified")
    if value is None:
        return None
    if hasattr(value, "timestamp"):
        return value.timestamp()
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
