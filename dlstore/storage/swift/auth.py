"""Swift logins, connections and error mapping: the client under `SwiftStore`.

Who retries what:

* swiftclient's `Connection` runs with `retries=0` and without credentials: it cannot
  replay a streamed PUT. A store logs in once per process, for all its threads.
* A 401 drops the token and raises `TransientError`, so the retry policy logs in again:
  once after a token that worked expired, once after a fresh token was refused. A renewed
  token refused too is an `AuthError`.
* `dlstore.storage.retry` retries everything transient, with backoff and a deadline.

Errors are built from the URL and the HTTP status only, so no credential reaches a message.
A Keystone login that is refused says what to fix: a deleted application credential, the
user's domain, or a project the user may not use (`_keystone_refusal`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

import requests
import requests.exceptions
import swiftclient
import urllib3.exceptions
from swiftclient.exceptions import ClientException

from dlstore.config import StoreConfig, SwiftConfig
from dlstore.errors import AuthError, ConfigError, DamagedObject, DlstoreError, NotFound, TransientError
from dlstore.logs import redact_storage_secrets
from dlstore.storage.base import Store, connection_failure, split_bucket_url, unknown_host
from dlstore.storage.stall import ConnectionRegistry, ProgressBody, watched_pools

__all__ = [
    "Forbidden",
    "NoEndpoint",
    "PreconditionFailed",
    "RangeNotSatisfiable",
    "SwiftClient",
    "SwiftLogin",
    "SwiftToken",
    "map_error",
]

_V1 = ("1", "1.0")
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
#: Calls that only wait for an answer, cut when it stalls. Not uploads, whose time grows with
#: their size, nor deletes of a large object, which delete its segments before they answer.
_AWAITED = frozenset(("get_object", "head_object", "get_container", "head_container", "put_container"))
_AWAITED |= {"put_object", "delete_object", "get_capabilities"}


def _new_lock_after_fork() -> None:
    # A parent's thread may have held the lock at fork time; the child has no such thread.
    global _auth_lock
    _auth_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_after_fork)


class RangeNotSatisfiable(DlstoreError):
    """HTTP 416: the range starts at or past the end of the object."""


class PreconditionFailed(DlstoreError):
    """HTTP 412: an If-Match named another version than the object's."""


class Forbidden(AuthError):
    """HTTP 403: the credentials work, but not for this container or operation."""


class NoEndpoint(ConfigError):
    """The Keystone catalog has no object-store endpoint for the region and interface asked."""


def map_error(exc: BaseException, what: str) -> DlstoreError:
    """Our error for a swiftclient, requests or keystoneauth exception.

    It is built from the status and reason only: a message is no place to gamble on secrets.
    """
    if isinstance(exc, DlstoreError):
        return exc
    if isinstance(exc, ClientException):
        status = exc.http_status
        if status is None:
            return DlstoreError(f"{what}: {exc.msg}")
        text = f"{what}: HTTP {status} {exc.http_reason or ''}".rstrip()
        if exc.transaction_id:
            text += f" (transaction {exc.transaction_id})"
        kind = {404: NotFound, 416: RangeNotSatisfiable, 412: PreconditionFailed, 403: Forbidden, 401: AuthError}
        if status in kind:
            return kind[status](text)
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


@dataclass
class SwiftToken:
    """A storage URL and the token that opens it; the token never shows in a repr."""

    storage_url: str
    token: str = field(repr=False)
    # A fresh token that never worked is not "expired" on a 401: it was refused, or lost
    # by the server before its first use. One more login tells.
    proven: bool
    # Issued because the fresh token before it was refused: a 401 on this one is an AuthError.
    renewal: bool = False


@dataclass(frozen=True)
class SwiftLogin:
    """Who a store logged in as, and where its requests go. It holds no secret.

    `method` is "v1", "password", "application credential" or "token". The Keystone fields
    come from the token: its user, its project, and the catalog's object-store endpoint.

    >>> SwiftLogin("https://swift.example/v1/AUTH_p", "v1", user="acct:me").project is None
    True
    """

    storage_url: str
    method: str
    user: str | None = None
    user_domain: str | None = None
    project: str | None = None
    project_id: str | None = None
    project_domain: str | None = None
    region: str | None = None
    interface: str | None = None
    catalog_url: str | None = None  # the catalog's choice; OS_STORAGE_URL may override it
    expires_at: datetime.datetime | None = None


class _Connection(swiftclient.Connection):
    """swiftclient's connection, whose pools note which connection each thread sends on.

    The stall watch uses that note to cut a call whose answer stalls.
    """

    def __init__(self, registry: ConnectionRegistry, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.registry = registry

    def http_connection(self, url: str | None = None) -> tuple[Any, Any]:
        parsed, conn = super().http_connection(url)
        _watch_requests(conn.request_session, self.registry)
        return parsed, conn


def _watch_requests(session: requests.Session, registry: ConnectionRegistry) -> None:
    """Make `session`'s pools note in `registry` which connection each thread sends on."""
    for adapter in session.adapters.values():
        manager = getattr(adapter, "poolmanager", None)
        if manager is not None:
            manager.pool_classes_by_scheme = watched_pools(manager.pool_classes_by_scheme, registry)


def _tempauth(cfg: SwiftConfig, timeout: tuple[float, float], registry: ConnectionRegistry) -> tuple[Any, Any]:
    """The storage URL and token from a v1 auth endpoint, on a connection the stall watch can cut."""
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
    # A 200 with a page and no storage URL is not a v1 auth endpoint, as swiftclient says.
    if resp.status < 200 or resp.status >= 300 or (body and not url):
        raise ClientException.from_response(resp, "Auth GET failed", body)
    return url, resp.getheader("x-storage-token", resp.getheader("x-auth-token"))


def _keystone_session(cfg: SwiftConfig, timeout: float, registry: ConnectionRegistry) -> Any:
    from keystoneauth1 import session as ks_session
    from keystoneauth1.identity import v2, v3

    auth_url = (cfg.auth_url or "").rstrip("/")
    password = cfg.key.reveal() if cfg.key else None
    if cfg.auth_version.startswith("2"):
        plugin: Any = v2.Password(
            auth_url=auth_url,
            username=cfg.user,
            password=password,
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
                password=password,
                project_name=cfg.project_name,
                project_id=cfg.project_id,
                user_domain_name=cfg.user_domain_name,
                project_domain_name=cfg.project_domain_name,
            )
    verify: Any = cfg.cacert if cfg.cacert else not cfg.insecure
    http = requests.Session()
    _watch_requests(http, registry)  # its answers, awaited inside keystoneauth, can be cut
    return ks_session.Session(auth=plugin, verify=verify, timeout=timeout, session=http)


def _keystone_login(cfg: SwiftConfig, session: Any) -> tuple[str | None, str, SwiftLogin]:
    """The catalog's storage URL, the token and the login, from one Keystone login.

    Token and catalog come from one answer: keystoneauth logs in again for a token that
    expires within two minutes, so asking for each apart made two logins.
    """
    access = session.auth.get_access(session)
    interface = (cfg.interface or "public").removesuffix("URL")
    endpoint = _object_store_endpoint(access, interface, cfg.region_name, required=not cfg.storage_url)
    url = endpoint.url if endpoint is not None else None
    login = SwiftLogin(
        storage_url=cfg.storage_url or url or "",
        method="application credential" if cfg.application_credential_id else "password",
        user=access.username,
        user_domain=access.user_domain_name,
        project=access.project_name,
        project_id=access.project_id,
        project_domain=access.project_domain_name,
        region=endpoint.region_name if endpoint is not None else cfg.region_name,
        interface=interface,
        catalog_url=url,
        expires_at=access.expires,
    )
    return url, access.auth_token, login


def _object_store_endpoint(access: Any, interface: str, region: str | None, required: bool) -> Any:
    """The catalog's object-store endpoint for `interface` in `region` (any region if None)."""
    from keystoneauth1 import exceptions as ks

    catalog = access.service_catalog
    try:
        return catalog.endpoint_data_for(service_type="object-store", interface=interface, region_name=region)
    except ks.EndpointNotFound:
        if not required:
            return None
    found = catalog.get_endpoints_data(service_type="object-store").get("object-store", [])
    there = ", ".join(sorted({f"{e.region_name or '(no region)'} {e.interface}" for e in found})) or "none"
    raise NoEndpoint(
        f"no object-store endpoint with region {region or '(any)'} and interface {interface} in the catalog; "
        f"it has: {there}. Set OS_REGION_NAME and OS_INTERFACE to one of those"
    )


def _keystone_refusal(exc: BaseException, cfg: SwiftConfig, session: Any, what: str) -> DlstoreError | None:
    """Our error for a login the identity service refused, saying what to fix; else None.

    Keystone answers 404 for an application credential that was deleted. It answers 401 for a
    wrong password, user, domain or project alike. So a refused password login is tried once
    more without a project: if that works, the project or its domain is what is wrong.
    """
    if cfg.auth_version in _V1:
        return None
    from keystoneauth1 import exceptions as ks

    app_id = cfg.application_credential_id
    if isinstance(exc, ks.NotFound) and app_id:
        return AuthError(
            f"{what}: the identity service has no application credential {app_id} (HTTP 404): it was deleted, "
            "or its user was; create another (`openstack application credential create`)"
        )
    if isinstance(exc, ks.NotFound):
        return ConfigError(f"{what}: the identity service answered HTTP 404; is OS_AUTH_URL Keystone's v3 endpoint?")
    if isinstance(exc, ks.Unauthorized) and app_id:
        return AuthError(
            f"{what}: the identity service refused application credential {app_id}: a wrong secret, or it expired"
        )
    if isinstance(exc, ks.Unauthorized) and session is not None and not cfg.auth_version.startswith("2"):
        return _password_refusal(cfg, session, what)
    return None


def _password_refusal(cfg: SwiftConfig, session: Any, what: str) -> AuthError:
    from keystoneauth1 import exceptions as ks
    from keystoneauth1.identity import v3

    auth_url = session.auth.auth_url
    domain = cfg.user_domain_name or "Default"
    who = f"user {cfg.user!r} of domain {domain!r}"
    unscoped = v3.Password(
        auth_url=auth_url, username=cfg.user, password=cfg.key.reveal() if cfg.key else None, user_domain_name=domain
    )
    try:
        token = unscoped.get_token(session)
        answer = session.get(f"{auth_url}/auth/projects", headers={"X-Auth-Token": token}, authenticated=False)
        projects = answer.json().get("projects", [])
    except ks.Unauthorized:
        return AuthError(
            f"{what}: the identity service refused {who}: a wrong password, or no such user in that domain "
            "(check OS_USERNAME, OS_PASSWORD and OS_USER_DOMAIN_NAME)"
        )
    except Exception:  # a best-effort diagnosis
        return AuthError(f"{what}: the identity service refused the credentials (Unauthorized)")
    if cfg.project_name:
        wanted = f"project {cfg.project_name!r} of domain {cfg.project_domain_name or 'Default'!r}"
    else:
        wanted = f"project id {cfg.project_id}"
    theirs = ", ".join(f"{p.get('name')} (domain id {p.get('domain_id')})" for p in projects) or "none"
    return AuthError(
        f"{what}: {who} logs in, but not to {wanted} (check OS_PROJECT_NAME and OS_PROJECT_DOMAIN_NAME); "
        f"its projects: {theirs}"
    )


class SwiftClient(Store):
    """One Swift container under a prefix, and the logins and connections its calls go through."""

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

    def _process_state(self) -> None:
        """Create the per-process client state, again after unpickling or in a forked child."""
        if getattr(self, "_client_pid", 0) == os.getpid():
            return
        with _auth_lock:
            if getattr(self, "_client_pid", 0) == os.getpid():
                return
            self._client_local = threading.local()
            self._client_token: SwiftToken | None = None
            self._client_session: Any = None
            self._client_login: SwiftLogin | None = None
            self._client_segments_ready = False
            self._client_login_failures = 0  # failed logins in this process, and the last one's error
            self._client_login_failure: DlstoreError | None = None
            # A token handed in by `swift auth` is tried first, once per process.
            self._client_preauth_unused = True
            # A fresh token was refused, so `_on_unauthorized` makes the next one the last try.
            self._client_fresh_refused = False
            self._client_pid = os.getpid()
        redact_storage_secrets()

    def _token(self) -> SwiftToken:
        self._process_state()
        token = self._client_token
        if token is not None:
            return token
        failed_before = self._client_login_failures
        with _auth_lock:
            if self._client_token is None:
                if self._client_login_failures != failed_before:
                    # A login failed while this thread waited: its failure is this thread's too,
                    # rather than K threads each waiting a stall timeout in turn.
                    failure = self._client_login_failure
                    raise type(failure)(str(failure))
                try:
                    self._client_token = self._authenticate()
                except DlstoreError as exc:
                    self._client_login_failures += 1
                    self._client_login_failure = exc
                    raise
            return self._client_token

    def _authenticate(self) -> SwiftToken:
        cfg = self.config.swift
        retry = self.config.retry
        timeout = (retry.connect_timeout_s, retry.read_timeout_s)
        what = f"authenticating for {self.url}"
        try:
            if cfg.auth_token and cfg.storage_url and self._client_preauth_unused:
                # "proven": if it has expired, a 401 leads to one login with the credentials.
                self._client_preauth_unused = False
                return SwiftToken(cfg.storage_url, cfg.auth_token.reveal(), proven=True)
            if not cfg.auth_url:
                raise AuthError(f"{self.url}: the pre-authenticated token was refused and there are no credentials")
            with self._answer_watched(what):
                if cfg.auth_version in _V1:
                    url, token = _tempauth(cfg, timeout, self._connections())
                    login = SwiftLogin(cfg.storage_url or url or "", "v1", user=cfg.user, catalog_url=url)
                else:
                    if self._client_session is None:
                        self._client_session = _keystone_session(cfg, retry.read_timeout_s, self._connections())
                    url, token, login = _keystone_login(cfg, self._client_session)
        except Exception as exc:
            refusal = _keystone_refusal(exc, cfg, self._client_session, what)
            raise (refusal or map_error(exc, what)) from None
        if not (cfg.storage_url or url) or not token:
            raise AuthError(f"{what}: the identity service returned no storage URL or token")
        self._client_login = login
        renewal, self._client_fresh_refused = self._client_fresh_refused, False
        return SwiftToken(cfg.storage_url or url, token, proven=False, renewal=renewal)

    def login(self) -> SwiftLogin:
        """Log in unless a token is at hand; who this store is and where its requests go.

        >>> SwiftClient("swift://c", StoreConfig()).login()   # doctest: +SKIP
        SwiftLogin(storage_url='https://swift.example/v1/AUTH_p', method='password', ...)
        """
        token = self._token()
        login = getattr(self, "_client_login", None)
        if login is None or login.storage_url != token.storage_url:  # a pre-authenticated token
            login = SwiftLogin(token.storage_url, "token")
        return login

    def _connection(self) -> tuple[swiftclient.Connection, SwiftToken]:
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
        # swiftclient clears these after a 401, so they are set on every call.
        conn.url, conn.token = token.storage_url, token.token
        return conn, token

    def _call(self, what: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """`method` of this thread's connection, its failure mapped to our errors."""
        conn, token = self._connection()
        # A call is cut if its answer stalls; an upload's wait restarts at each block sent.
        # Not a manifest's PUT nor a large object's DELETE: Swift visits every segment first.
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
                    f"{map_error(exc, what)}: a large object whose segments are missing or were changed"
                ) from None
            if exc.http_status is None or exc.http_status in (408, 499):
                conn.close()  # a server timeout leaves the request framing in doubt
            raise map_error(exc, what) from None
        except Exception as exc:
            conn.close()  # a broken connection must not be reused
            raise map_error(exc, what) from None
        token.proven = True
        return result

    def _on_unauthorized(self, token: SwiftToken, what: str) -> None:
        """A 401: drop the token, and say whether another login may help.

        It is transient when the token had worked and so expired, or was fresh and no renewal:
        the server may have lost it. A refused renewal is an `AuthError`.
        """
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
