"""The store as the loader will meet it: endpoint, credentials, login, listing, manifest and a read.

Each check runs only when the one before it passed: one root cause, one FAIL.
A Swift store logs in first: who it is, its project, and the endpoint its requests go to.
"""

from __future__ import annotations

import dataclasses
import itertools
import socket
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

from dlstore.config import RetryConfig, StoreConfig, format_size
from dlstore.doctor.check import FAIL, OK, WARN, Check
from dlstore.errors import AuthError, ConfigError, DlstoreError, FormatError, NotFound
from dlstore.format.manifest import MANIFEST_NAME, Manifest
from dlstore.storage import ObjectInfo, Store, open_store
from dlstore.storage.swift.auth import NoEndpoint, SwiftClient, SwiftLogin

__all__ = ["ProbeResult", "endpoint_check", "probe_store"]

# Short: a doctor that waits out the loader's two-minute deadline on a dead endpoint helps no one.
DOCTOR_RETRY = RetryConfig(
    max_attempts=2,
    initial_backoff_s=0.2,
    max_backoff_s=1.0,
    deadline_s=15.0,
    connect_timeout_s=5.0,
    read_timeout_s=20.0,
    stall_timeout_s=20.0,
)
LISTED_AT_MOST = 1000
SLOW_STREAM_MB_S = 25.0  # one stream slower than this is a slow path: a proxy, a VPN, a far region
SPEED_NEEDS_BYTES = 4 * 10**6  # smaller reads measure latency, not bandwidth


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What the store probe found: its checks, and the manifest when one was read."""

    checks: list[Check]
    manifest: Manifest | None = None


def _endpoints(scheme: str, config: StoreConfig) -> list[str]:
    if scheme == "swift":
        return [url for url in (config.swift.auth_url, config.swift.storage_url) if url]
    if scheme == "s3":
        return [config.s3.endpoint_url] if config.s3.endpoint_url else []
    return []


def endpoint_check(scheme: str, config: StoreConfig, env: Mapping[str, str], timeout_s: float = 5.0) -> Check | None:
    """A TCP connection to each endpoint the store will call first; None for file:// and fsspec."""
    if scheme not in ("swift", "s3"):
        return None
    urls = _endpoints(scheme, config)
    if not urls:
        if scheme == "s3":
            return Check(
                "endpoint",
                WARN,
                "no endpoint set: requests go to AWS S3 itself",
                "for Swift's S3 API, Ceph or MinIO export AWS_ENDPOINT_URL=https://host:port",
            )
        return None  # no Swift credentials: the credentials line says so
    seen = []
    for url in urls:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
        started = time.monotonic()
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
        except OSError as exc:
            reason = "no such host" if isinstance(exc, socket.gaierror) else type(exc).__name__
            return Check(
                "endpoint",
                FAIL,
                f"cannot connect to {host}:{port} ({reason}) for {url}",
                "check the URL and the network path from this node (firewall, security group, VPN); "
                "`curl -sS URL` from here shows the same",
            )
        seen.append(f"{host}:{port} ({(time.monotonic() - started) * 1000:.1f} ms)")
    proxy = next((name for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy") if env.get(name)), None)
    note = f"; {proxy} is set: HTTP requests may go through the proxy (NO_PROXY lists exceptions)" if proxy else ""
    return Check("endpoint", OK, f"TCP connect to {', '.join(seen)}{note}")


def _auth_fix(scheme: str) -> str:
    if scheme == "swift":
        return (
            "the key, password or application credential is wrong or expired, or the project is not the one "
            "(OS_PROJECT_NAME); `swift stat` with the same variables must work. HTTP 403: the credentials "
            "work but may not read this container; ask its owner for a read ACL"
        )
    return (
        "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (on OpenStack: `openstack ec2 credentials list`) and "
        "that AWS_ENDPOINT_URL is the cluster they belong to; AccessDenied on a bucket: no rights to it"
    )


def _missing_fix(scheme: str, bucket: str, config: StoreConfig) -> str:
    if scheme == "swift":
        return (
            f"check the name (and OS_REGION_NAME / the project: containers are per account); `swift list` shows "
            f"the account's containers; `swift post {bucket}` creates it (`dlstore convert` does that itself)"
        )
    endpoint = f" --endpoint-url {config.s3.endpoint_url}" if config.s3.endpoint_url else ""
    return (
        f"check the name; `aws s3 ls{endpoint}` lists your buckets; `aws s3 mb s3://{bucket}{endpoint}` creates it "
        "(`dlstore convert` does that itself)"
    )


def probe_store(url: str, config: StoreConfig, read_bytes: int) -> ProbeResult:
    """auth, listing, manifest and read checks for the dataset at `url`."""
    scheme = urlsplit(url).scheme if "://" in url else "file"
    config = dataclasses.replace(config, retry=DOCTOR_RETRY)
    try:
        store = open_store(url, config)
    except ConfigError as exc:  # the URL itself: its scheme, its bucket's name
        return ProbeResult([Check("store", FAIL, f"{url}: {exc}", "check the URL")])
    except DlstoreError as exc:
        return ProbeResult([Check("store", FAIL, f"{url}: {exc}", "see the credentials line above")])
    checks: list[Check] = []
    if isinstance(store, SwiftClient) and not _swift_login(store, checks):
        return ProbeResult(checks)
    listed = _list_first(store, scheme, config, checks)
    if listed is None:
        return ProbeResult(checks)
    manifest = _manifest(store, checks)
    target = _read_target(manifest, listed)
    if target is not None:  # nothing listed: the manifest line has said what is missing
        checks.append(_ranged_read(store, target, read_bytes))
    return ProbeResult(checks, manifest)


def _swift_login(store: SwiftClient, checks: list[Check]) -> bool:
    """`auth` and `catalog` lines: who the store logged in as, and where its requests go."""
    try:
        login = store.login()
    except AuthError as exc:
        checks.append(Check("auth", FAIL, f"the store refused the credentials: {exc}", _auth_fix("swift")))
        return False
    except NoEndpoint as exc:
        checks.append(Check("catalog", FAIL, str(exc), "`openstack catalog list` shows the endpoints"))
        return False
    except ConfigError as exc:
        checks.append(Check("auth", FAIL, str(exc), "check OS_AUTH_URL, OS_CACERT and the credentials"))
        return False
    except DlstoreError as exc:
        checks.append(
            Check(
                "auth",
                FAIL,
                f"logging in failed: {type(exc).__name__}: {exc}",
                "the identity service or the proxy did not answer: try again, then ask the storage operators",
            )
        )
        return False
    checks.append(Check("auth", OK, _login_text(login)))
    if login.method in ("password", "application credential"):
        checks.append(Check("catalog", OK, _catalog_text(login)))
    return True


def _login_text(login: SwiftLogin) -> str:
    if login.method == "v1":
        return f"Swift v1 login as {login.user}: storage URL {login.storage_url}"
    if login.method == "token":
        return f"a pre-authenticated token for {login.storage_url}"
    until = f"; token valid until {login.expires_at:%Y-%m-%d %H:%M:%S %Z}" if login.expires_at else ""
    return (
        f"Keystone {login.method} login: user {login.user} (domain {login.user_domain}), project {login.project} "
        f"(id {login.project_id}, domain {login.project_domain}){until}"
    )


def _catalog_text(login: SwiftLogin) -> str:
    where = f"region {login.region}, interface {login.interface}"
    if login.catalog_url is None:
        return f"OS_STORAGE_URL {login.storage_url} (no object-store endpoint with {where} in the catalog)"
    if login.catalog_url != login.storage_url:
        return f"OS_STORAGE_URL {login.storage_url} overrides the catalog's object-store endpoint ({where}: {login.catalog_url})"
    return f"object-store endpoint of {where}: {login.storage_url}"


def _list_first(store: Store, scheme: str, config: StoreConfig, checks: list[Check]) -> list[ObjectInfo] | None:
    """The first objects under the store's root, or None after a FAIL; this request authenticates."""
    logged_in = any(check.name == "auth" for check in checks)
    needs_auth = scheme in ("swift", "s3") and not logged_in
    started = time.monotonic()
    try:
        listed = list(itertools.islice(store.list(), LISTED_AT_MOST))
    except AuthError as exc:
        if logged_in:  # the login worked: this container is what is refused
            checks.append(Check("listing", FAIL, f"the store refused the listing: {exc}", _auth_fix(scheme)))
        else:
            checks.append(Check("auth", FAIL, f"the store refused the credentials: {exc}", _auth_fix(scheme)))
        return None
    except NotFound as exc:
        if needs_auth:
            checks.append(Check("auth", OK, "the store accepted the credentials"))
        bucket = urlsplit(store.url).netloc
        kind = "container" if scheme == "swift" else "bucket"
        checks.append(
            Check("listing", FAIL, f"{kind} {bucket!r} does not exist ({exc})", _missing_fix(scheme, bucket, config))
        )
        return None
    except DlstoreError as exc:
        checks.append(
            Check(
                "listing",
                FAIL,
                f"listing {store.url} failed: {type(exc).__name__}: {exc}",
                "a server error or timeout: try again, then ask the storage operators",
            )
        )
        return None
    elapsed = time.monotonic() - started
    if needs_auth:
        checks.append(Check("auth", OK, "the store accepted the credentials"))
    more = "+" if len(listed) == LISTED_AT_MOST else ""
    checks.append(Check("listing", OK, f"{store.url}: {len(listed)}{more} objects listed in {elapsed:.2f} s"))
    return listed


def _manifest(store: Store, checks: list[Check]) -> Manifest | None:
    fix_other = "`dlstore ls URL` shows what is there; `dlstore index URL` writes the manifest for WebDataset shards"
    try:
        manifest = Manifest.load(store)
    except NotFound:
        checks.append(
            Check(
                "manifest",
                FAIL,
                f"no {MANIFEST_NAME} at {store.url}",
                f"give the dataset root (the destination of `dlstore convert`); {fix_other}",
            )
        )
        return None
    except (FormatError, DlstoreError) as exc:
        checks.append(Check("manifest", FAIL, f"{MANIFEST_NAME} is unreadable: {exc}", fix_other))
        return None
    checks.append(
        Check(
            "manifest",
            OK,
            f"{MANIFEST_NAME}: {manifest.total_samples:,} samples in {len(manifest.shards):,} shards "
            f"({format_size(manifest.total_size)}), {manifest.num_classes:,} classes",
        )
    )
    return manifest


def _read_target(manifest: Manifest | None, listed: list[ObjectInfo]) -> tuple[str, int] | None:
    """The first shard of the manifest, else the largest object listed."""
    if manifest is not None and manifest.shards:
        return manifest.shards[0].name, manifest.shards[0].size
    sized = [info for info in listed if info.size > 0]
    if not sized:
        return None
    largest = max(sized, key=lambda info: info.size)
    return largest.key, largest.size


def _ranged_read(store: Store, target: tuple[str, int], read_bytes: int) -> Check:
    """A ranged GET from the middle of `target`: first-byte time and MB/s of one stream."""
    key, size = target
    length = max(1, min(read_bytes, size))
    start = (size - length) // 2
    started = time.monotonic()
    first_byte: float | None = None
    received = 0
    try:
        for chunk in store.get(key, start, start + length):
            if first_byte is None:
                first_byte = time.monotonic() - started
            received += len(chunk)
    except DlstoreError as exc:
        return Check(
            "read",
            FAIL,
            f"ranged GET of {key} failed: {type(exc).__name__}: {exc}",
            "an object the manifest lists is missing or unreadable: re-run the same `dlstore convert`, "
            "then `dlstore verify URL`",
        )
    elapsed = max(time.monotonic() - started, 1e-9)
    if received != length:
        return Check("read", FAIL, f"ranged GET of {key}: {received} of {length} bytes", "report it: a short read")
    rate = received / elapsed / 1e6
    text = f"ranged GET of {format_size(received)} from {key}: first byte {(first_byte or 0) * 1000:.0f} ms, "
    if received < SPEED_NEEDS_BYTES:
        return Check("read", OK, text + f"{rate:.1f} MB/s (too little to judge the bandwidth)")
    if rate < SLOW_STREAM_MB_S:
        return Check(
            "read",
            WARN,
            text + f"{rate:.1f} MB/s",
            f"one stream under {SLOW_STREAM_MB_S:.0f} MB/s: look for a proxy (HTTPS_PROXY), a VPN or a far region "
            "on the path; the node cache reads several ranges at once, `dlstore bench URL` measures the loader",
        )
    return Check("read", OK, text + f"{rate:.1f} MB/s")
