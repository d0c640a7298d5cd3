"""Credentials and TLS (issue 6, cases 7 and 10), against the real Swift server.

Case 7: wrong, expired and revoked credentials on the Swift API (tempauth) and the S3 API
are an `AuthError` within 5 s, after one or two requests (counted by the
fault proxy), never a retry storm; an expired Swift token is renewed once and the run goes
on. No key, secret or token text appears in any log line (everything at DEBUG, botocore,
urllib3 and swiftclient included), exception text, traceback or repr. (The checkpoint and
metrics files of a training run are scanned in `tests/integration/test_node.py`.)

Case 10: TLS in front of the server (a TLS-terminating `FaultProxy` with a throw-away CA):
`OS_CACERT` and `AWS_CA_BUNDLE` are honoured; another CA, or none, is a clear error before
any request is sent, never a silent fallback to no verification.

Keystone's cases run against a real Keystone in `test_keystone.py`, which imports this
module's TLS fixture. Nothing here uses the Keystone stand-in any more.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import re
import ssl
import time
import traceback
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import dlstore
from dlstore.config import RetryConfig, StoreConfig
from dlstore.errors import AuthError, DlstoreError, TransientError
from dlstore.storage import open_store
from tests.support.fault_proxy import FaultProxy
from tests.support.loader_support import write_dataset

pytestmark = pytest.mark.swift

# Backoff long enough that a single retry would show in the 5 s budget.
SLOW_RETRY = RetryConfig(max_attempts=5, initial_backoff_s=3.0, max_backoff_s=10.0, deadline_s=60, read_timeout_s=10)
FAST_RETRY = RetryConfig(initial_backoff_s=0.05, max_backoff_s=0.5, deadline_s=30, read_timeout_s=10)


def report(case: str, **fields: object) -> None:
    print(f"\nRELIABILITY {case}: " + ", ".join(f"{k}={v}" for k, v in fields.items()))


def server_port(server) -> int:
    return urlsplit(server.storage_url).port


def config_for(env: dict[str, str], retry: RetryConfig = FAST_RETRY) -> StoreConfig:
    import dataclasses

    return dataclasses.replace(StoreConfig.from_env(env), retry=retry)


def find_leaks(secrets: list[str], texts: dict[str, str]) -> list[str]:
    """Where any of `secrets` shows up (whole words for short, common-looking ones)."""
    leaks = []
    for secret in secrets:
        pattern = re.escape(secret) if len(secret) >= 12 else rf"(?<![\w-]){re.escape(secret)}(?![\w-])"
        leaks += [f"{where}: {secret[:4]}…" for where, text in texts.items() if re.search(pattern, text)]
    return leaks


def texts_of(error: BaseException | None, *objects: object, log_text: str) -> dict[str, str]:
    texts = {"log": log_text}
    if error is not None:
        texts["str(error)"] = str(error)
        texts["repr(error)"] = repr(error)
        texts["traceback"] = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    for obj in objects:
        texts[f"repr({type(obj).__name__})"] = repr(obj)
        texts[f"str({type(obj).__name__})"] = str(obj)
    return texts


@pytest.fixture
def debug_logs(caplog):
    """Every logger at DEBUG: dlstore's, and botocore's, urllib3's and swiftclient's."""
    caplog.set_level(logging.DEBUG)
    for name in ("botocore", "boto3", "urllib3", "swiftclient", "keystoneauth", "s3transfer", "dlstore"):
        caplog.set_level(logging.DEBUG, logger=name)
    return caplog


def dataset(url: str, tmp_path: Path, config: StoreConfig, **options) -> dlstore.Dataset:
    return dlstore.Dataset(
        url,
        cache_dir=str(tmp_path / "cache"),
        cache_limit="20MB",
        transform="eval",
        image_size=8,
        batch_size=4,
        seed=1,
        world=dlstore.world.World(0, 1, 1),
        store_config=config,
        return_keys=True,
        prefetch_shards=1,
        **options,
    )


# -- case 7: wrong credentials -------------------------------------------------------------------
WRONG = ["swift key", "s3 secret", "s3 session token", "s3 secret with a session token"]


@pytest.mark.parametrize("what", WRONG)
def test_wrong_credentials_are_an_auth_error_at_once(swift_server, swift_container, tmp_path, debug_logs, what):
    wrong = f"Wr0ng-{uuid.uuid4().hex}"
    api = "s3" if what.startswith("s3") else "swift"
    write_dataset(open_store(f"{api}://{swift_container}/d", config_for(swift_server.env())), [3, 3])
    with FaultProxy(server_port(swift_server)) as proxy:
        if what == "swift key":
            env = {"ST_AUTH": f"{proxy.url}/auth/v1.0", "ST_USER": swift_server.user, "ST_KEY": wrong}
        else:
            env = {**swift_server.s3_env(), "AWS_ENDPOINT_URL": proxy.url}
            if what == "s3 secret":
                env["AWS_SECRET_ACCESS_KEY"] = wrong
            elif what == "s3 secret with a session token":
                # The server's SignatureDoesNotMatch echoes the canonical request, token
                # included, and botocore.parsers logs that body at DEBUG.
                env["AWS_SECRET_ACCESS_KEY"], env["AWS_SESSION_TOKEN"] = f"{wrong}-key", wrong
            else:
                # An expired STS session token: what the server answers for it.
                env["AWS_SESSION_TOKEN"] = wrong
                body = b"<Error><Code>ExpiredToken</Code><Message>The provided token has expired.</Message></Error>"
                proxy.add_rule(400, times=None, body=body, headers={"Content-Type": "application/xml"})
        config = config_for(env, SLOW_RETRY)
        started = time.monotonic()
        with pytest.raises(AuthError) as caught:
            dataset(f"{api}://{swift_container}/d", tmp_path, config)
        took = time.monotonic() - started
        requests = proxy.count()
    assert took < 5
    assert requests == 1  # one request, no retry, no second authentication
    error = caught.value
    leaks = find_leaks([wrong], texts_of(error, config, config.swift, config.s3, log_text=debug_logs.text))
    assert not leaks, leaks
    report(f"case 7 (wrong {what})", error=type(error).__name__, requests=requests, detect_s=f"{took:.2f}")


# -- case 7: credentials expiring or revoked during a run ------------------------------------------
def s3_error(code: str, status: int) -> dict:
    body = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
    return dict(kind=status, times=None, body=body, headers={"Content-Type": "application/xml"})


@pytest.mark.parametrize("api", ["swift", "s3"])
def test_credentials_revoked_mid_run_stop_the_loader_at_once(swift_server, swift_container, tmp_path, debug_logs, api):
    url = f"{api}://{swift_container}/d"
    keys = write_dataset(open_store(url, config_for(swift_server.env())), [4] * 6)
    _, token = swift_server.swift_connection().get_auth()
    with FaultProxy(server_port(swift_server)) as proxy:
        if api == "swift":
            env = {"ST_AUTH": f"{proxy.url}/auth/v1.0", "ST_USER": swift_server.user, "ST_KEY": swift_server.key}
        else:
            env = {**swift_server.s3_env(), "AWS_ENDPOINT_URL": proxy.url}
        config = config_for(env, SLOW_RETRY)
        ds = dataset(url, tmp_path, config, shuffle_window=1)
        loader = dlstore.Loader(ds, num_workers=0, device="cpu")  # in this process: its logs are captured
        seen = []
        error = None
        try:
            for step, (_, _, meta) in enumerate(loader):
                seen += meta["keys"]
                if step == 0:
                    # Revoked: every request refused from now on, a new login included.
                    if api == "swift":
                        proxy.add_rule(401, times=None)
                    else:
                        proxy.add_rule(**s3_error("InvalidAccessKeyId", 403))
                    before, revoked_at = proxy.count(), time.monotonic()
        except AuthError as exc:
            error = exc
            took = time.monotonic() - revoked_at
        ds.cache.close()
        after = proxy.count() - before
    assert isinstance(error, AuthError), "the run went on with revoked credentials"
    assert took < 5
    # A Swift 401 on a token that worked drops it and logs in again once (refused: AuthError);
    # S3 errors are never retried. Each of the cache's fetchers may have had one request out
    # when the credentials went: the reader and the prefetch's shards in flight (one part
    # each: these shards are far smaller than a part).
    fetchers = 1 + ds.cache.config.shards_in_flight
    assert after <= (2 if api == "swift" else 1) * fetchers, after
    assert len(seen) < len(keys)
    secrets = [swift_server.key, token, token.removeprefix("AUTH_tk")[:8]]
    leaks = find_leaks(secrets, texts_of(error, config, ds.store, ds.cache, loader, log_text=debug_logs.text))
    assert not leaks, leaks
    report(f"case 7 (revoked mid-run, {api})", error=type(error).__name__, requests_after=after, detect_s=f"{took:.2f}")


def test_an_expired_swift_token_is_renewed_once_and_nothing_is_lost(
    swift_server, swift_container, tmp_path, debug_logs
):
    """tempauth: the 401 of an expired token is injected. A real Keystone's tokens expire in
    `test_keystone.py`."""
    url = f"swift://{swift_container}/d"
    keys = write_dataset(open_store(url, config_for(swift_server.env())), [4] * 6)
    _, token = swift_server.swift_connection().get_auth()
    with FaultProxy(server_port(swift_server)) as proxy:
        env = {"ST_AUTH": f"{proxy.url}/auth/v1.0", "ST_USER": swift_server.user, "ST_KEY": swift_server.key}
        config = config_for(env, SLOW_RETRY)
        ds = dataset(url, tmp_path, config, shuffle_window=1)
        loader = dlstore.Loader(ds, num_workers=0, device="cpu")
        seen = []
        for step, (_, _, meta) in enumerate(loader):
            seen += [k for k, p in zip(meta["keys"], meta["padding"].tolist()) if not p]
            if step == 0:
                proxy.add_rule(401, method="GET", path=r"/shard-", times=1)  # the token expired
        ds.cache.close()
        logins = proxy.count("GET", r"^/auth/")
    assert sorted(seen) == sorted(keys)
    assert proxy.injected_kinds() == {"401": 1}
    assert logins == 2  # the first login, and one after the 401
    leaks = find_leaks([swift_server.key, token], texts_of(None, config, ds.store, log_text=debug_logs.text))
    assert not leaks, leaks
    report("case 7 (expired token, tempauth)", lost=0, repeated=0, logins=logins)


@contextlib.contextmanager
def _identity_behind_a_proxy(swift_server, swift_container, auth: str):
    """(store env, the identity endpoint's FaultProxy, its login method and path regex), the
    logins of `auth` going through a proxy that trickles at 0.2 s a byte when told to; an
    object `auth/obj` is there. Keystone's logins stall in `test_keystone.py`."""
    open_store(f"swift://{swift_container}/auth", config_for(swift_server.env())).put("obj", b"x" * 1000)
    with FaultProxy(server_port(swift_server), trickle_s=0.2) as proxy:
        env = {"ST_AUTH": f"{proxy.url}/auth/v1.0", "ST_USER": swift_server.user, "ST_KEY": swift_server.key}
        yield env, proxy, "GET", r"^/auth/v1\.0$"


@pytest.mark.parametrize("auth", ["tempauth"])
def test_an_authentication_whose_answer_trickles_is_cut_and_asked_again(swift_server, swift_container, auth):
    """An identity endpoint that sends its answer a byte every 0.2 s never trips the read
    timeout: the stall timeout cuts it. Once, the login is asked again and the read goes on;
    for good, it ends in `StalledRead` within the deadline, not in a hang."""
    import dataclasses

    from dlstore.errors import StalledRead

    with _identity_behind_a_proxy(swift_server, swift_container, auth) as (env, identity, method, path):
        policy = dataclasses.replace(FAST_RETRY, stall_timeout_s=2.0)
        identity.add_rule("trickle_head", method=method, path=path)
        started = time.monotonic()
        assert open_store(f"swift://{swift_container}/auth", config_for(env, policy)).get_bytes("obj") == b"x" * 1000
        took = time.monotonic() - started
        assert identity.injected_kinds() == {"trickle_head": 1}
        assert took < 30

        identity.add_rule("trickle_head", method=method, path=path, times=None)
        impatient = dataclasses.replace(policy, deadline_s=3.0)
        started = time.monotonic()
        with pytest.raises(StalledRead, match="authenticating for .*no answer within 2 s"):
            open_store(f"swift://{swift_container}/auth", config_for(env, impatient)).stat("obj")
        gave_up = time.monotonic() - started
        assert gave_up < 30
    report(f"trickled login ({auth})", resumed_s=f"{took:.2f}", gave_up_s=f"{gave_up:.2f}")


@pytest.mark.parametrize("auth", ["tempauth"])
def test_threads_waiting_for_a_login_that_stalls_share_its_failure(swift_server, swift_container, auth):
    """Threads of one store that need a token wait for one login. When it stalled, each then
    logged in in turn, each cut only after the stall timeout: the last of K threads waited K
    timeouts (the cache's 16 download threads, 16 minutes at the default). The threads that
    waited now share the failed login's error; the next attempt of each logs in afresh."""
    import dataclasses
    from concurrent import futures

    from dlstore.errors import StalledRead

    with _identity_behind_a_proxy(swift_server, swift_container, auth) as (env, identity, method, path):
        identity.add_rule("trickle_head", method=method, path=path, times=None)
        once = dataclasses.replace(FAST_RETRY, stall_timeout_s=2.0, max_attempts=1)
        store = open_store(f"swift://{swift_container}/auth", config_for(env, once))
        with futures.ThreadPoolExecutor(5) as pool:
            calls = [pool.submit(store.stat, "obj") for _ in range(5)]
            errors = [call.exception(timeout=60) for call in calls]
        logins = identity.count(method, path)
    assert all(isinstance(error, StalledRead) for error in errors), errors
    assert all("authenticating for" in str(error) for error in errors), errors
    assert logins == 1  # one login for the five threads, not one each in turn
    report(f"stalled login shared ({auth})", threads=5, logins=logins)


# -- case 10: TLS ---------------------------------------------------------------------------------
def _make_ca(name: str):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _make_server_cert(ca_key, ca_cert, hosts: list[str]):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.IPAddress(ipaddress.ip_address(h)) if h[0].isdigit() else x509.DNSName(h) for h in hosts]
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _pem(path: Path, *items) -> str:
    from cryptography.hazmat.primitives import serialization

    parts = []
    for item in items:
        if hasattr(item, "private_bytes"):
            parts.append(
                item.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                )
            )
        else:
            parts.append(item.public_bytes(serialization.Encoding.PEM))
    path.write_bytes(b"".join(parts))
    return str(path)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 signed by it, another CA, and a certificate
    for another host name signed by the right CA."""
    root = tmp_path_factory.mktemp("tls")
    ca_key, ca = _make_ca("dlstore test CA")
    other_key, other = _make_ca("some other CA")
    key, cert = _make_server_cert(ca_key, ca, ["127.0.0.1", "localhost"])
    wrong_key, wrong_host = _make_server_cert(ca_key, ca, ["storage.invalid"])
    return {
        "ca": _pem(root / "ca.pem", ca),
        "other_ca": _pem(root / "other-ca.pem", other),
        "server": _pem(root / "server.pem", cert, key),
        "wrong_host": _pem(root / "wrong-host.pem", wrong_host, wrong_key),
    }


def server_context(pem: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pem)
    return context


def _tls_env(server, proxy: FaultProxy, api: str, auth: str, ca: str | None) -> dict[str, str]:
    if api == "s3":
        env = {**server.s3_env(), "AWS_ENDPOINT_URL": proxy.url}
        if ca:
            env["AWS_CA_BUNDLE"] = ca
        return env
    # Swift sees plain HTTP behind the TLS proxy, so the storage URL it hands out says http://;
    # an openrc's OS_STORAGE_URL says where the object store really is.
    env = {"OS_STORAGE_URL": f"{proxy.url}{urlsplit(server.storage_url).path}"}
    if auth == "tempauth":
        env.update(ST_AUTH=f"{proxy.url}/auth/v1.0", ST_USER=server.user, ST_KEY=server.key)
    if auth == "token":  # pre-authenticated: the first contact is a read, not a login
        env["OS_AUTH_TOKEN"] = "never-sent"
    if ca:
        env["OS_CACERT"] = ca
    return env


TLS_CASES = [("swift", "tempauth"), ("s3", "")]  # Keystone's: test_keystone.py


@pytest.mark.parametrize(("api", "auth"), TLS_CASES, ids=["swift", "s3"])
def test_tls_with_a_custom_ca_bundle(swift_server, swift_container, tls_files, api, auth):
    context = server_context(tls_files["server"])
    with FaultProxy(server_port(swift_server), ssl_context=context) as proxy:
        env = _tls_env(swift_server, proxy, api, auth, tls_files["ca"])
        store = open_store(f"{api}://{swift_container}/tls", config_for(env))
        store.put("hello", b"over TLS")
        assert store.get_bytes("hello") == b"over TLS"
        assert [i.key for i in store.list()] == ["hello"]
        assert proxy.count() >= 3


@pytest.mark.parametrize("trust", ["another CA", "no CA bundle", "wrong host name"])
@pytest.mark.parametrize(("api", "auth"), [*TLS_CASES, ("swift", "token")], ids=["swift", "s3", "token"])
def test_tls_verification_is_never_silently_off(swift_server, swift_container, tls_files, api, auth, trust):
    server_pem = tls_files["wrong_host" if trust == "wrong host name" else "server"]
    ca = {"another CA": tls_files["other_ca"], "no CA bundle": None, "wrong host name": tls_files["ca"]}[trust]
    context = server_context(server_pem)
    with FaultProxy(server_port(swift_server), ssl_context=context) as proxy:
        env = _tls_env(swift_server, proxy, api, auth, ca)
        store = open_store(f"{api}://{swift_container}/tls", config_for(env, SLOW_RETRY))
        started = time.monotonic()
        with pytest.raises(DlstoreError) as caught:
            store.get_bytes("anything")
        took = time.monotonic() - started
        sent = proxy.count()
    error = caught.value
    assert not isinstance(error, (TransientError, AuthError)), error  # a configuration problem: not retried
    assert "TLS" in str(error) and ("OS_CACERT" in str(error) or "AWS_CA_BUNDLE" in str(error))
    assert sent == 0  # no request ever left over an unverified connection
    assert took < 5
    report(f"case 10 ({api}/{auth or 'sigv4'}, {trust})", error=str(error)[:90], detect_s=f"{took:.2f}")


def test_a_fresh_token_lost_by_the_server_is_renewed_once(swift_server, swift_container, debug_logs):
    """A token can be refused before its first use for reasons that are not the credentials':
    the proxy's memcached restarted or evicted it between the login and the request (found by
    a soak run restarting the server). One new login, then an `AuthError` only if that
    token is refused too."""
    open_store(f"swift://{swift_container}/f", config_for(swift_server.env())).put("obj", b"payload")
    with FaultProxy(server_port(swift_server)) as proxy:
        env = {"ST_AUTH": f"{proxy.url}/auth/v1.0", "ST_USER": swift_server.user, "ST_KEY": swift_server.key}
        proxy.add_rule(401, method="GET", path=r"/f/obj$", times=1)  # the first GET with a brand-new token
        store = open_store(f"swift://{swift_container}/f", config_for(env, SLOW_RETRY))
        started = time.monotonic()
        assert store.get_bytes("obj") == b"payload"
        assert proxy.count("GET", r"^/auth/") == 2 and proxy.count("GET", r"/f/obj$") == 2
        assert time.monotonic() - started < 5

        # Refused every time, however fresh: an AuthError after one renewal, not a loop.
        proxy.add_rule(401, method="GET", path=r"/f/obj$", times=None)
        store = open_store(f"swift://{swift_container}/f", config_for(env, SLOW_RETRY))
        before = proxy.count()
        started = time.monotonic()
        with pytest.raises(AuthError):
            store.get_bytes("obj")
        assert time.monotonic() - started < 5
        assert proxy.count() - before == 4  # login, GET (401), login, GET (401)
