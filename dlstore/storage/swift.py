"""`swift://container/prefix` store on python-swiftclient: OpenStack Swift's own API.

Authentication (see `SwiftConfig`): v1 (tempauth/swauth, `ST_*`), Keystone v2/v3
password or v3 application credential (an openrc's `OS_*`, through keystoneauth1),
or a pre-authenticated storage URL and token.

Who retries what:

* swiftclient's `Connection` runs with `retries=0` and without credentials, so it
  never retries or re-authenticates on its own (it would sleep, and it cannot
  replay a streamed PUT).
* This module authenticates once per store and process, and shares the token among
  the per-thread connections. A 401 drops the token and raises `TransientError`, so
  the retry policy authenticates again: once after a token that has worked (or was
  handed in pre-authenticated) expired, and once after a token fresh from the identity
  service was refused (the server may have lost it: a proxy or memcached restart, an
  eviction). A renewed token that is refused too is an `AuthError`: the credentials
  themselves are refused.
* `dlstore.storage.retry` retries everything transient, with backoff and a deadline.

Objects of `segment_size` bytes or more go as static large objects (SLO): segments
in `<container>_segments` (made when missing), each buffered in memory and retried on
its own, then the manifest. A manifest lists at most 1,000 segments: segments are made
larger up front when the size is known, and grow as the upload goes when it is not (a
stream). `ensure_container()` makes the container itself, as
`swift upload` does; a plain put into a missing container is `NotFound`.

Credentials never reach messages or logs: errors are built from the URL and the HTTP
status, and a filter on the `swiftclient` logger blanks token headers::

    store = SwiftStore("swift://datasets/imagenet")  # credentials from ST_* or OS_*
    store.put("train/shard-000000.tar", "/data/shard-000000.tar")
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, BinaryIO

import requests
import requests.exceptions
import swiftclient
import urllib3.exceptions
from swiftclient.exceptions import ClientException

from dlstore.config import StoreConfig, SwiftConfig
from dlstore.errors import AuthError, ConfigError, DamagedObject, DlstoreError, NotFound, ObjectChanged, TransientError
from dlstore.logs import redact_storage_secrets
from dlstore.storage.base import (
    ObjectInfo,
    ReadPin,
    Store,
    answered_range,
    check_key,
    connection_failure,
    grown_part_size,
    read_block,
    remaining_size,
    skip_prefix,
    split_bucket_url,
    unknown_host,
)
from dlstore.storage.retry import call_with_retry
from dlstore.storage.stall import ConnectionRegistry, ProgressBody, watched_pools

__all__ = ["SwiftStore"]

log = logging.getLogger(__name__)

_V1 = ("1", "1.0")
# Swift's defaults: an SLO manifest lists at most 1,000 segments (max_manifest_segments), and
# one segment, an object itself, holds at most 5 GiB (max_file_size). A cluster's own are in
# its /info (`SwiftStore._slo_limits`).
_MAX_SEGMENTS = 1000
_MAX_SEGMENT_SIZE = 5 * 2**30
_TRANSIENT_STATUS = {408, 429, 498, 499}
_TRANSIENT_EXCEPTIONS = (
    requests.exceptions.ConnectionError,
    requests.exceptions.Timeout,
    requests.exceptions.ChunkedEncodingError,
    urllib3.exceptions.ProtocolError,
    urllib3.exceptions.ReadTimeoutError,
    socket.timeout,
    ConnectionError,
    TimeoutError,
)
_auth_lock = threading.Lock()
#: The calls that only wait for an answer (for a GET with a chunk size, its head): cut when it
#: stalls. Not the uploads, whose time grows with their size, nor deletes, which may delete a
#: large object's segments before they answer.
_AWAITED = frozenset(
    {
        "get_object",
        "head_object",
        "get_container",
        "head_container",
        "put_container",
        "put_object",
        "delete_object",
        "get_capabilities",
    }
)


class _Connection(swiftclient.Connection):
    """swiftclient's connection, whose HTTP pools note in `registry` which connection each
    thread sends on, so that the stall watch can cut a call whose answer stalls."""

    def __init__(self, registry: ConnectionRegistry, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.registry = registry

    def http_connection(self, url: str | None = None) -> tuple[Any, Any]:
        parsed, conn = super().http_connection(url)
        _watch_requests(conn.request_session, self.registry)
        return parsed, conn


def _watch_requests(session: requests.Session, registry: ConnectionRegistry) -> None:
    """`session`'s pools made to note in `registry` which connection each thread sends on."""
    for adapter in session.adapters.values():
        manager = getattr(adapter, "poolmanager", None)
        if manager is not None:
            manager.pool_classes_by_scheme = watched_pools(manager.pool_classes_by_scheme, registry)


def _tempauth(cfg: SwiftConfig, timeout: tuple[float, float], registry: ConnectionRegistry) -> tuple[Any, Any]:
    """(storage URL, token) from a v1 auth endpoint, as swiftclient's `get_auth_1_0` asks, on a
    connection whose answer the stall watch can cut."""
    conn = swiftclient.client.HTTPConnection(cfg.auth_url, cacert=cfg.cacert, insecure=cfg.insecure, timeout=timeout)
    _watch_requests(conn.request_session, registry)
    headers = {"X-Auth-User": cfg.user or "", "X-Auth-Key": cfg.key.reveal() if cfg.key else ""}
    try:
        conn.request("GET", conn.parsed_url.path, "", headers)
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    url = resp.getheader("x-storage-url")
    # A 200 with a page and no storage URL is an endpoint that is not a v1 auth (as swiftclient says).
    if resp.status < 200 or resp.status >= 300 or (body and not url):
        raise ClientException.from_response(resp, "Auth GET failed", body)
    return url, resp.getheader("x-storage-token", resp.getheader("x-auth-token"))


def _new_lock_after_fork() -> None:
    # A thread of the parent may have held the lock at fork time; the child has no such thread.
    global _auth_lock
    _auth_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_after_fork)


class _RangeNotSatisfiable(DlstoreError):
    """HTTP 416: the range starts at or past the end of the object."""


class _PreconditionFailed(DlstoreError):
    """HTTP 412: an If-Match named another version than the object's."""


class _Forbidden(AuthError):
    """HTTP 403: the credentials work, but not for this container or operation."""


# -- answers of several byte ranges ---------------------------------------------------------
def parse_byteranges(body: bytes, boundary: bytes) -> dict[int, bytes]:
    """{first byte: bytes} of each part of a multipart/byteranges `body` (RFC 9110 14.6).

    >>> parse_byteranges(b"--b\\r\\nContent-Range: bytes 2-4/9\\r\\n\\r\\nabc\\r\\n--b--", b"b")
    {2: b'abc'}
    """
    parts: dict[int, bytes] = {}
    delimiter = b"--" + boundary
    position = body.find(delimiter)
    while position >= 0 and not body.startswith(b"--", position + len(delimiter)):
        head_end = body.find(b"\r\n\r\n", position)
        found = _CONTENT_RANGE.search(body, position, head_end) if head_end >= 0 else None
        if found is None:
            raise TransientError("a multipart/byteranges answer has a part without its Content-Range")
        start, end = int(found[1]), int(found[2])
        data = head_end + 4
        parts[start] = body[data : data + end - start + 1]
        if len(parts[start]) != end - start + 1:
            raise TransientError(f"a multipart/byteranges answer ends inside its part of bytes {start}-{end}")
        position = body.find(delimiter, data + end - start + 1)
    return parts


_CONTENT_RANGE = re.compile(rb"content-range:\s*bytes\s+(\d+)-(\d+)/", re.IGNORECASE)
_SINGLE_RANGE = re.compile(r"\s*bytes\s+(\d+)-(\d+)/")


# -- errors ---------------------------------------------------------------------------------
def _map_error(exc: BaseException, what: str) -> DlstoreError:
    """Our error for a swiftclient/requests/keystoneauth exception, built from the status and
    reason only: `str(ClientException)` would do, but a message is no place to gamble on."""
    if isinstance(exc, DlstoreError):
        return exc
    if isinstance(exc, ClientException):
        status = exc.http_status
        if status is None:
            return DlstoreError(f"{what}: {exc.msg}")
        text = f"{what}: HTTP {status} {exc.http_reason or ''}".rstrip()
        if exc.transaction_id:
            text += f" (transaction {exc.transaction_id})"
        if status == 404:
            return NotFound(text)
        if status == 416:
            return _RangeNotSatisfiable(text)
        if status == 412:
            return _PreconditionFailed(text)
        if status == 403:
            return _Forbidden(text)
        if status == 401:
            return AuthError(text)
        if status in _TRANSIENT_STATUS or status >= 500:
            return TransientError(text)
        return DlstoreError(text)
    if isinstance(exc, requests.exceptions.SSLError):
        return DlstoreError(f"{what}: TLS failure (check OS_CACERT / SWIFTCLIENT_INSECURE)")
    if unknown_host(exc):
        return ConfigError(f"{what}: no such host{connection_failure(exc)}; check the auth URL or storage URL")
    if isinstance(exc, _TRANSIENT_EXCEPTIONS):
        return TransientError(f"{what}: {type(exc).__name__}{connection_failure(exc)}")
    keystone = _map_keystone_error(exc, what)
    if keystone is not None:
        return keystone
    return DlstoreError(f"{what}: {type(exc).__name__}")


def _map_keystone_error(exc: BaseException, what: str) -> DlstoreError | None:
    try:
        from keystoneauth1 import exceptions as ks
    except ImportError:  # pragma: no cover - keystoneauth1 is a dependency
        return None
    if not isinstance(exc, ks.ClientException):
        return None
    name = type(exc).__name__
    if isinstance(exc, (ks.Unauthorized, ks.Forbidden)):
        return AuthError(f"{what}: the identity service refused the credentials ({name})")
    if isinstance(exc, ks.EndpointNotFound):
        return ConfigError(f"{what}: no object-store endpoint in the catalog (check OS_REGION_NAME / OS_INTERFACE)")
    if isinstance(exc, ks.MissingRequiredOptions):
        return ConfigError(f"{what}: incomplete Keystone credentials ({name})")
    if isinstance(exc, ks.SSLError):
        return DlstoreError(f"{what}: TLS failure talking to the identity service (check OS_CACERT)")
    if isinstance(exc, (ks.ConnectFailure, ks.ConnectTimeout, ks.UnknownConnectionError)):
        return TransientError(f"{what}: identity service unreachable ({name})")
    status = getattr(exc, "http_status", None)
    if status is not None and (status in _TRANSIENT_STATUS or status >= 500):
        return TransientError(f"{what}: identity service HTTP {status}")
    return DlstoreError(f"{what}: identity service error ({name})")


# -- authentication -------------------------------------------------------------------------
@dataclass
class _Token:
    storage_url: str
    token: str = field(repr=False)  # the live credential: never in a repr
    # A token from the identity service that has never worked is not "expired" on a 401:
    # it was refused, or lost by the server before its first use. One more login tells.
    proven: bool
    # Issued because the fresh token before it was refused: a 401 on this one is an AuthError.
    renewal: bool = False


def _keystone_session(cfg: SwiftConfig, timeout: float, registry: ConnectionRegistry) -> Any:
    from keystoneauth1 import session as ks_session
    from keystoneauth1.identity import v2, v3

    auth_url = (cfg.auth_url or "").rstrip("/")
    if cfg.auth_version.startswith("2"):
        plugin: Any = v2.Password(
            auth_url=auth_url,
            username=cfg.user,
            password=cfg.key.reveal() if cfg.key else None,
            tenant_name=cfg.project_name,
            tenant_id=cfg.project_id,
        )
    else:
        if not re.search(r"/v3$", auth_url):
            auth_url += "/v3"
        if cfg.application_credential_id:
            secret = cfg.application_credential_secret
            plugin = v3.ApplicationCredential(
                auth_url=auth_url,
                application_credential_id=cfg.application_credential_id,
                application_credential_secret=secret.reveal() if secret else None,
            )
        else:
            plugin = v3.Password(
                auth_url=auth_url,
                username=cfg.user,
                password=cfg.key.reveal() if cfg.key else None,
                project_name=cfg.project_name,
                project_id=cfg.project_id,
                user_domain_name=cfg.user_domain_name,
                project_domain_name=cfg.project_domain_name,
            )
    verify: Any = cfg.cacert if cfg.cacert else not cfg.insecure
    http = requests.Session()
    _watch_requests(http, registry)  # its answers, awaited inside keystoneauth, can be cut
    return ks_session.Session(auth=plugin, verify=verify, timeout=timeout, session=http)


class SwiftStore(Store):
    """Objects in one Swift container under a prefix; large puts go as static large objects.
    Credentials come from the environment, or from `config` (no connection is made yet):

    >>> config = StoreConfig(swift=SwiftConfig(storage_url="http://127.0.0.1:8080/v1/AUTH_test", auth_token="t"))
    >>> store = SwiftStore("swift://container/train", config)
    >>> store.url
    'swift://container/train'
    """

    scheme = "swift"

    def __init__(self, url: str, config: StoreConfig | None = None) -> None:
        self.container, self.prefix, canonical = split_bucket_url(url, "swift", "container")
        super().__init__(canonical, config)
        cfg = self.config.swift
        if not (cfg.auth_url or (cfg.storage_url and cfg.auth_token)):
            raise ConfigError(
                f"{self.url}: no Swift credentials; set ST_AUTH/ST_USER/ST_KEY, source an openrc (OS_*), "
                "or give OS_STORAGE_URL and OS_AUTH_TOKEN"
            )
        self.segment_container = self.container + cfg.segment_container_suffix
        # Everything named `_client*` is per process and dropped when pickled.
        self._client_pid = 0

    # -- connections and tokens ------------------------------------------------------------
    def _process_state(self) -> None:
        """(Re)create the per-process client state: after unpickling or in a forked child."""
        if getattr(self, "_client_pid", 0) == os.getpid():
            return
        with _auth_lock:
            if getattr(self, "_client_pid", 0) == os.getpid():
                return
            self._client_local = threading.local()
            self._client_token: _Token | None = None
            self._client_session: Any = None
            self._client_segments_ready = False
            self._client_login_failures = 0  # logins that failed in this process, and the last one's error
            self._client_login_failure: DlstoreError | None = None
            # A token handed in (`swift auth`) is tried first, once per process.
            self._client_preauth_unused = True
            # A fresh token was refused: the next one is the last try (see `_on_unauthorized`).
            self._client_fresh_refused = False
            self._client_pid = os.getpid()
        redact_storage_secrets()

    def _token(self) -> _Token:
        self._process_state()
        token = self._client_token
        if token is not None:
            return token
        failed_before = self._client_login_failures
        with _auth_lock:
            if self._client_token is None:
                if self._client_login_failures != failed_before:
                    # A login failed while this thread waited for it: its failure is this
                    # thread's too (the retry's next attempt logs in again). Each thread trying
                    # in turn held the last of K threads K stall timeouts.
                    failure = self._client_login_failure
                    raise type(failure)(str(failure))
                try:
                    self._client_token = self._authenticate()
                except DlstoreError as exc:
                    self._client_login_failures += 1
                    self._client_login_failure = exc
                    raise
            return self._client_token

    def _authenticate(self) -> _Token:
        cfg = self.config.swift
        retry = self.config.retry
        timeout = (retry.connect_timeout_s, retry.read_timeout_s)
        what = f"authenticating for {self.url}"
        try:
            if cfg.auth_token and cfg.storage_url and self._client_preauth_unused:
                # "proven": if it has expired, a 401 leads to one authentication with the credentials.
                self._client_preauth_unused = False
                return _Token(cfg.storage_url, cfg.auth_token.reveal(), proven=True)
            if not cfg.auth_url:
                raise AuthError(f"{self.url}: the pre-authenticated token was refused and there are no credentials")
            with self._answer_watched(what):
                if cfg.auth_version in _V1:
                    url, token = _tempauth(cfg, timeout, self._connections())
                else:
                    if self._client_session is None:
                        self._client_session = _keystone_session(cfg, retry.read_timeout_s, self._connections())
                    session = self._client_session
                    interface = (cfg.interface or "public").removesuffix("URL")
                    url = session.get_endpoint(
                        service_type="object-store", interface=interface, region_name=cfg.region_name
                    )
                    token = session.get_token()
        except Exception as exc:
            raise _map_error(exc, what) from None
        if not url or not token:
            raise AuthError(f"{what}: the identity service returned no storage URL or token")
        renewal, self._client_fresh_refused = self._client_fresh_refused, False
        return _Token(cfg.storage_url or url, token, proven=False, renewal=renewal)

    def _connection(self) -> tuple[swiftclient.Connection, _Token]:
        token = self._token()
        local = self._client_local
        conn = getattr(local, "conn", None)
        if conn is None:
            cfg = self.config.swift
            retry = self.config.retry
            conn = _Connection(
                self._connections(),
                preauthurl=token.storage_url,
                preauthtoken=token.token,
                retries=0,
                starting_backoff=0,
                retry_on_ratelimit=False,
                cacert=cfg.cacert,
                insecure=cfg.insecure,
                timeout=(retry.connect_timeout_s, retry.read_timeout_s),
            )
            local.conn = conn
        # swiftclient clears these after a 401; set them on every call (cheap).
        conn.url, conn.token = token.storage_url, token.token
        return conn, token

    def _call(self, what: str, method: str, *args: Any, **kwargs: Any) -> Any:
        conn, token = self._connection()
        # A call is cut if its answer stalls; an upload's wait restarts at each block sent. Not
        # a manifest's PUT nor a large object's DELETE: Swift checks or deletes every segment
        # before it answers, for as long as there are segments.
        watched = method in _AWAITED and not (
            (method == "put_object" and not hasattr(args[2], "read"))
            or (method == "delete_object" and kwargs.get("query_string"))
        )
        try:
            with self._answer_watched(what) if watched else contextlib.nullcontext() as read:
                if method == "put_object" and read is not None:
                    args = (*args[:2], ProgressBody(args[2], read), *args[3:])
                result = getattr(conn, method)(*args, **kwargs)
        except ClientException as exc:
            if exc.http_status == 401:
                self._on_unauthorized(token, what)
            if exc.http_status == 409 and method == "get_object":
                raise DamagedObject(
                    f"{_map_error(exc, what)}: a large object whose segments are missing or were changed"
                ) from None
            if exc.http_status is None or exc.http_status in (408, 499):
                conn.close()  # a server timeout leaves the request framing in doubt
            raise _map_error(exc, what) from None
        except Exception as exc:
            conn.close()  # a broken connection must not be reused
            raise _map_error(exc, what) from None
        token.proven = True
        return result

    def _on_unauthorized(self, token: _Token, what: str) -> None:
        """401: the token is dropped and the failure is transient (the retry authenticates
        again) when it had worked (it expired), or when it was fresh and not itself a renewal
        (the server may have lost it); a renewal refused too means the credentials are."""
        can_reauthenticate = bool(self.config.swift.auth_url)
        with _auth_lock:
            if self._client_token is token:
                self._client_token = None
                if self._client_session is not None:
                    self._client_session.invalidate()
            fresh_once = not token.proven and not token.renewal
            if fresh_once:
                self._client_fresh_refused = True
        if can_reauthenticate and token.proven:
            raise TransientError(f"{what}: token expired or revoked; authenticating again")
        if can_reauthenticate and fresh_once:
            raise TransientError(f"{what}: a new token was refused; authenticating once more")
        raise AuthError(f"{what}: HTTP 401 Unauthorized (credentials refused)")

    def _name(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    # -- listing ---------------------------------------------------------------------------
    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        full_prefix = self._name(prefix) if prefix else (f"{self.prefix}/" if self.prefix else "")
        strip = len(self.prefix) + 1 if self.prefix else 0
        marker = ""
        while True:
            # One page per request (the cluster's listing limit, 10,000 by default),
            # each retried on its own, resumed from the last name seen.
            try:
                _, page = call_with_retry(
                    self.config.retry,
                    lambda m=marker: self._call(
                        self.url, "get_container", self.container, marker=m, prefix=full_prefix or None
                    ),
                )
            except NotFound as exc:  # a container listing answers 404 only when it is missing
                raise NotFound(f"{exc}: container {self.container!r} does not exist") from None
            if not page:
                return
            for item in page:
                if "name" not in item:  # a `subdir` entry; none without a delimiter
                    continue
                yield ObjectInfo(
                    key=item["name"][strip:],
                    size=int(item["bytes"]),
                    etag=item.get("hash"),
                    mtime=_listing_time(item.get("last_modified")),
                )
            marker = page[-1].get("name") or page[-1].get("subdir")

    def _stat(self, key: str) -> ObjectInfo:
        headers = self._call(self.join(key), "head_object", self.container, self._name(key))
        return ObjectInfo(
            key=key,
            size=int(headers["content-length"]),
            etag=(headers.get("etag") or "").strip('"') or None,
            mtime=float(headers["x-timestamp"]) if headers.get("x-timestamp") else None,
        )

    # -- reading ---------------------------------------------------------------------------
    reads_versions = True

    def _read(self, key: str, start: int, end: int | None, pin: ReadPin | None = None) -> Iterator[bytes]:
        what = self.join(key)
        headers = {}
        if start or end is not None:
            headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        if pin is not None and pin.etag:
            headers["If-Match"] = pin.etag  # a resume: the version read so far, or 412
        answer: dict[str, Any] = {}
        try:
            response_headers, body = self._call(
                what,
                "get_object",
                self.container,
                self._name(key),
                resp_chunk_size=self.config.chunk_size,
                headers=headers or None,
                response_dict=answer,
            )
        except _RangeNotSatisfiable:  # the range starts at or past the end: no bytes
            return
        except _PreconditionFailed:
            raise ObjectChanged(f"{what}: the object was replaced while it was read") from None
        expected = int(response_headers["content-length"]) if "content-length" in response_headers else None
        try:
            status = int(answer.get("status") or (206 if "content-range" in response_headers else 200))
            skip, size = answered_range(what, start, end, status, response_headers.get("content-range"), expected)
        except DlstoreError:
            body.close()
            raise
        if pin is not None:
            pin.note(response_headers.get("etag"), size)
        received = 0
        # The body hands back urllib3's bytes as they come: no copies, no hashing here. Closed
        # at once when this generator is abandoned: it drops a half-read connection.
        with contextlib.closing(self._body_chunks(body, what)) as chunks:
            for chunk in chunks:
                received += len(chunk)
                if skip:  # the whole object came: its bytes before `start` are not the range's
                    chunk, skip = skip_prefix(chunk, skip)
                    if not chunk:
                        continue
                yield chunk
        if expected is not None and received != expected:
            raise TransientError(f"short read of {what}: {received} of {expected} bytes")

    def _body_chunks(self, body: Any, what: str) -> Iterator[bytes]:
        """The chunks of a streamed body, closed at the end (also when the caller abandons it);
        a failure mid-body as our error, and a stall cut from the watch's thread (urllib3's
        `HTTPResponse.shutdown`) as `StalledRead`."""
        read = self._stall_watch().watch(body.resp.raw.shutdown)
        chunks = iter(body)
        try:
            while True:
                with read.waiting():
                    chunk = next(chunks, None)
                if chunk is None:
                    break
                yield chunk
        except Exception as exc:
            raise self._stalled(what) if read.cut else _map_error(exc, what) from None
        finally:
            read.done()
            body.close()  # also drops a connection left half-read by an abandoned generator
        if read.cut:  # a cut body may also just end early
            raise self._stalled(what)

    #: Swift serves up to 50 ascending byte ranges in one GET (`swift.common.swob.MAX_RANGES`).
    ranges_per_get = 50

    def get_ranges(self, key: str, spans: list[tuple[int, int]]) -> list[bytes]:
        """One GET for all `spans` (at most `ranges_per_get`, ascending, apart), answered as
        multipart/byteranges (or as one plain 206 when only one span lies inside the object);
        a span past the end comes back short, as `get_range` gives it. A server that answers
        with the whole object instead is asked one span per GET from then on (its body is not
        read). Retried whole on a transient failure."""
        if len(spans) <= 1 or len(spans) > self.ranges_per_get:
            return super().get_ranges(key, spans)
        key = check_key(key)
        what = self.join(key)
        header = "bytes=" + ",".join(f"{start}-{start + length - 1}" for start, length in spans)

        def attempt() -> list[bytes] | None:
            response_headers, body = self._call(
                what, "get_object", self.container, self._name(key), headers={"Range": header}, resp_chunk_size=2**20
            )
            kind, _, parameters = response_headers.get("content-type", "").partition(";")
            boundary = dict(p.strip().split("=", 1) for p in parameters.split(";") if "=" in p).get("boundary")
            single = _SINGLE_RANGE.match(response_headers.get("content-range", ""))
            if kind.strip() == "multipart/byteranges" and boundary:
                parts = parse_byteranges(b"".join(self._body_chunks(body, what)), boundary.strip('"').encode()).items()
            elif single:  # one span lay inside the object: a plain 206 of it
                parts = {int(single[1]): b"".join(self._body_chunks(body, what))}.items()
            else:  # the whole object: not read
                body.close()
                return None
            # A server may join neighbouring ranges into one part: each span from the part holding it.
            return [
                next((data[s - first : s - first + n] for first, data in parts if first <= s < first + len(data)), b"")
                for s, n in spans
            ]

        got = call_with_retry(self.config.retry, attempt)
        if got is None:
            self.ranges_per_get = 1  # this server's GETs take one range: ask so from now on
            return super().get_ranges(key, spans)
        return got

    # -- writing ---------------------------------------------------------------------------
    def _write(self, key: str, stream: BinaryIO) -> None:
        try:
            self._write_object(key, stream)
        except NotFound as exc:
            self._client_segments_ready = False  # it may be gone too: looked at again by the next write
            # An object PUT answers 404 only when the container is missing.
            raise NotFound(
                f"{exc}: container {self.container!r} does not exist; create it with "
                f"`swift post {self.container}` (dlstore convert creates it)"
            ) from None

    def _slo_limits(self) -> tuple[int, int]:
        """(segments a manifest may list, bytes a segment may hold): this cluster's, from its
        /info, asked once per process; Swift's defaults where it does not say (`expose_info`
        off, an older proxy). A cluster set below the defaults refused a large upload with a
        413 only once all its segments were up."""
        limits = self.__dict__.get("_client_slo_limits")
        if limits is None or limits[0] != os.getpid():
            try:
                info = call_with_retry(self.config.retry, lambda: self._call(f"{self.url} (/info)", "get_capabilities"))
            except DlstoreError as exc:
                log.debug("no /info from the Swift cluster of %s (%s): Swift's default SLO limits", self.url, exc)
                info = {}
            slo, swift = info.get("slo") or {}, info.get("swift") or {}
            try:
                segments = int(slo.get("max_manifest_segments", _MAX_SEGMENTS))
                segment_size = int(swift.get("max_file_size", _MAX_SEGMENT_SIZE))
            except (TypeError, ValueError):
                segments, segment_size = _MAX_SEGMENTS, _MAX_SEGMENT_SIZE
            limits = self.__dict__["_client_slo_limits"] = (os.getpid(), max(segments, 1), max(segment_size, 1))
        return limits[1], limits[2]

    def _write_object(self, key: str, stream: BinaryIO) -> None:
        what = self.join(key)
        name = self._name(key)
        size = remaining_size(stream)
        max_segments, max_segment_size = self._slo_limits()
        # An SLO manifest holds at most `max_segments` segments: when the size is known, the
        # segments are made large enough to fit up front; when not, `_put_slo` grows them.
        configured = max(self.config.swift.segment_size, 1)
        segment_size = max(configured, -(-(size or 0) // max_segments))
        if segment_size > max(configured, max_segment_size):
            # Refused before anything is uploaded, not by a 413 once it all is.
            raise ConfigError(
                f"{what}: {size} bytes are more than one static large object holds here "
                f"({max_segments} segments of at most {max_segment_size} bytes)"
            )
        old_segments = call_with_retry(self.config.retry, lambda: self._segments_of(key))
        if size is not None and size < segment_size:
            # Small and seekable: stream it in one PUT (base.put retries from the start).
            self._call(
                what, "put_object", self.container, name, stream, content_length=size, chunk_size=self.config.chunk_size
            )
        else:
            first = read_block(stream, segment_size)
            if len(first) < segment_size:
                call_with_retry(self.config.retry, lambda: self._put_bytes(what, self.container, name, first))
            else:
                self._put_slo(key, first, stream, segment_size, grow=size is None)
        self._delete_segments(what, old_segments)

    def _put_bytes(self, what: str, container: str, name: str, data: bytes, **kwargs: Any) -> str:
        # A file object, not bytes: swiftclient treats bytes as not replayable.
        return self._call(what, "put_object", container, name, io.BytesIO(data), content_length=len(data), **kwargs)

    def _put_slo(self, key: str, first: bytes, stream: BinaryIO, segment_size: int, grow: bool) -> None:
        """Segments of `segment_size` bytes (`first` is the first one), each retried on its own,
        then the manifest. When the stream's length is unknown (`grow`), the segments grow as
        it goes (`grown_part_size`) so that the manifest's segment limit is not reached."""
        what = self.join(key)
        retry = self.config.retry
        max_segments, max_segment_size = self._slo_limits()
        self._ensure_segment_container()
        upload = f"{time.time():.6f}-{secrets.token_hex(4)}"
        segment_prefix = f"{self._name(key)}/slo/{upload}/"
        manifest: list[dict[str, Any]] = []
        try:
            data = first
            size = segment_size
            while data:
                if len(manifest) >= max_segments:  # before the 413 of a manifest too long
                    raise ConfigError(
                        f"{what}: the stream is longer than {max_segments} segments of up to {size} bytes, "
                        "the most one static large object holds; give a larger segment size "
                        "(DLSTORE_SEGMENT_SIZE) or the size of the source"
                    )
                segment = f"{segment_prefix}{len(manifest):08d}"
                etag = call_with_retry(
                    retry, lambda d=data, s=segment: self._put_bytes(what, self.segment_container, s, d)
                )
                manifest.append(
                    {"path": f"/{self.segment_container}/{segment}", "etag": etag.strip('"'), "size_bytes": len(data)}
                )
                if len(data) < size:
                    break
                if grow:
                    size = grown_part_size(segment_size, len(manifest), max_segments, max_segment_size)
                data = read_block(stream, size)
            body = json.dumps(manifest)
            call_with_retry(
                retry,
                lambda: self._call(
                    what, "put_object", self.container, self._name(key), body, query_string="multipart-manifest=put"
                ),
            )
        except BaseException:
            self._delete_segments(what, [entry["path"] for entry in manifest])
            raise

    def _ensure_segment_container(self) -> None:
        self._process_state()
        if not self._client_segments_ready:
            self._make_container(self.segment_container)
            self._client_segments_ready = True

    def _ensure_container(self) -> None:
        self._make_container(self.container)

    def _make_container(self, container: str) -> None:
        """PUT the container unless a HEAD finds it: a user granted access to an existing
        container by an ACL may not PUT containers, and needs not."""
        what = f"swift://{container}"
        retry = self.config.retry
        how = (
            f"create it with `swift post {container}` as a user who may (the account's owner, a project "
            "member with the object-store role), or use a container you may write to"
        )
        try:
            call_with_retry(retry, lambda: self._call(what, "head_container", container))
            return
        except NotFound:
            pass
        except _Forbidden as exc:  # no access to this container, if it exists at all
            raise AuthError(f"{exc}: these credentials may not read container {container!r}; {how}") from None
        try:
            call_with_retry(retry, lambda: self._call(what, "put_container", container))
        except _Forbidden as exc:
            raise AuthError(
                f"{exc}: container {container!r} does not exist and these credentials may not create it; {how}"
            ) from None
        log.info("created container %s", what)

    def _segments_of(self, key: str) -> list[str]:
        """The segment paths of `key` if it is a static large object now, else []."""
        try:
            headers = self._call(self.join(key), "head_object", self.container, self._name(key))
        except NotFound:
            return []
        if headers.get("x-static-large-object", "").lower() != "true":
            return []
        _, body = self._call(
            self.join(key), "get_object", self.container, self._name(key), query_string="multipart-manifest=get"
        )
        return [entry["name"] for entry in json.loads(body)]

    def remove_abandoned_uploads(self, prefix: str = "", older_than_s: float = 3600.0) -> int:
        """Segments under `prefix` (in the segment container) that no manifest names, of uploads
        whose every segment is older than `older_than_s`: one still going writes new ones."""
        root = f"swift://{self.segment_container}" + (f"/{self.prefix}" if self.prefix else "")
        uploads: dict[tuple[str, str], list[ObjectInfo]] = {}
        try:
            for info in SwiftStore(root, self.config).list(prefix):
                key, slo, rest = info.key.partition("/slo/")
                if slo:
                    uploads.setdefault((key, rest.split("/", 1)[0]), []).append(info)
        except NotFound:  # no segment container: no segments
            return 0
        cutoff = time.time() - older_than_s
        removed = 0
        for (key, _), segments in sorted(uploads.items()):
            if any(info.mtime is None or info.mtime > cutoff for info in segments):
                continue
            named = set(call_with_retry(self.config.retry, lambda k=key: self._segments_of(k)))
            paths = [f"/{self.segment_container}/{self._name(info.key)}" for info in segments]
            stale = [path for path in paths if path not in named]
            if stale:
                log.info("removing %d segments of an upload of %s that never completed", len(stale), self.join(key))
                self._delete_segments(self.join(key), stale)
                removed += 1
        return removed

    def _delete_segments(self, what: str, paths: list[str]) -> None:
        """Best effort: a left-over segment costs space, never correctness."""
        for path in paths:
            container, _, name = path.lstrip("/").partition("/")
            try:
                call_with_retry(self.config.retry, lambda c=container, n=name: self._call(what, "delete_object", c, n))
            except NotFound:
                pass
            except DlstoreError as exc:
                log.warning("could not delete old segment %s of %s: %s", path, what, exc)

    def _delete(self, key: str) -> None:
        # `?multipart-manifest=delete` removes an SLO with its segments, but answers 200 and
        # deletes nothing for a plain object; so look first (which also gives NotFound).
        what = self.join(key)
        headers = self._call(what, "head_object", self.container, self._name(key))
        is_slo = headers.get("x-static-large-object", "").lower() == "true"
        query = "multipart-manifest=delete" if is_slo else None
        self._deleted_once(
            lambda: self._call(what, "delete_object", self.container, self._name(key), query_string=query)
        )


def _listing_time(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None
