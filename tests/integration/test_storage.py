"""The Swift and S3 backends against the real local Swift server: long listings, cut-off
reads, wrong credentials, Keystone v3, and large objects in segments.

The 12,000-object listing fixture takes a minute or two to build (about 150 small PUTs
per second here), so it is built once per session, in a container with a fixed name that
both APIs read (s3api maps a bucket to a container). It is not deleted: a later session on
the same server finds it complete and reuses it, and a test server's data dir goes with it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest
import torch
from botocore.stub import Stubber
from swiftclient.exceptions import ClientException

from dlstore.cli import main as cli_main
from dlstore.config import RetryConfig, S3Config, Secret, StoreConfig, SwiftConfig
from dlstore.demo.datagen import make_imagefolder
from dlstore.errors import AuthError, ConfigError, NotFound
from dlstore.format.manifest import Manifest
from dlstore.storage import open_store
from dlstore.train.checkpoint import CheckpointStore
from tests.storage.test_store_contract import TEST_RETRY, payload, swift_store_config
from tests.support.swift_fixtures import delete_container
from tests.support.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.swift, pytest.mark.compat]

LISTING_CONTAINER = "dlstore-test-listing-12k"
LISTING_COUNT = 12_000
LISTING_PREFIX = "many"


def _listing_names() -> list[str]:
    # Unpadded numbers: byte order (10 < 2) differs from upload order.
    return [f"{LISTING_PREFIX}/{i}.bin" for i in range(LISTING_COUNT)]


def _listing_size(i: int) -> int:
    return i % 7


@pytest.fixture(scope="session")
def listing_container(swift_server) -> str:
    """A container holding LISTING_COUNT small objects under `many/` (built once; see module doc)."""
    conn = swift_server.swift_connection()
    conn.put_container(LISTING_CONTAINER)
    headers = conn.head_container(LISTING_CONTAINER)
    if int(headers.get("x-container-object-count", 0)) == LISTING_COUNT:
        return LISTING_CONTAINER
    local = threading.local()

    def upload(i: int) -> None:
        # One connection per thread: a swiftclient Connection is not thread-safe, and a new
        # one per PUT would authenticate every time.
        if not hasattr(local, "conn"):
            local.conn = swift_server.swift_connection(retries=5)
        # swiftclient cannot rewind a bytes body after a failed attempt ("no ability to reset
        # contents"), so a busy server's 503 or a reset is retried here, with fresh bytes.
        for attempt in range(6):
            try:
                local.conn.put_object(LISTING_CONTAINER, f"{LISTING_PREFIX}/{i}.bin", b"x" * _listing_size(i))
                return
            except ClientException:
                if attempt == 5:
                    raise
                time.sleep(0.2 * 2**attempt)

    started = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(upload, range(LISTING_COUNT)))
    logging.getLogger(__name__).info("uploaded %d objects in %.0f s", LISTING_COUNT, time.monotonic() - started)
    return LISTING_CONTAINER


def _expected_listing() -> list[tuple[str, int]]:
    names = _listing_names()
    sizes = {name: _listing_size(i) for i, name in enumerate(names)}
    return [(name[len(LISTING_PREFIX) + 1 :], sizes[name]) for name in sorted(names, key=str.encode)]


@pytest.mark.slow
@pytest.mark.timeout(600)  # the first one uploads the 12000 objects (listing_container): 110 s on two busy cores
@pytest.mark.parametrize("scheme", ["swift", "s3"])
def test_list_12000_objects_in_order(swift_server, listing_container, scheme):
    store = open_store(f"{scheme}://{listing_container}/{LISTING_PREFIX}", swift_store_config(swift_server))
    listed = [(info.key, info.size) for info in store.list()]
    assert listed == _expected_listing()
    # A prefix that is not a directory boundary, deep into the listing (pages of 100 / 99).
    assert [info.key for info in store.list("1199")] == [
        "1199.bin",
        "11990.bin",
        *(f"1199{d}.bin" for d in range(1, 10)),
    ]


@pytest.mark.slow
def test_cli_ls_prints_all_12000(swift_server, listing_container, monkeypatch, capsys):
    for name in ("OS_AUTH_URL", "OS_AUTH_TOKEN", "OS_STORAGE_URL", "OS_APPLICATION_CREDENTIAL_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in swift_server.swift_env().items():
        monkeypatch.setenv(name, value)
    assert cli_main(["ls", f"swift://{listing_container}/{LISTING_PREFIX}"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [key for key, _ in _expected_listing()]


# -- reads cut off mid-body -------------------------------------------------------------------------
def _proxied(config: StoreConfig, scheme: str, server, proxy: TcpProxy) -> StoreConfig:
    """`config` with data requests (not authentication) going through `proxy`."""
    if scheme == "swift":
        path = urlsplit(server.storage_url).path
        return dataclasses.replace(
            config, swift=dataclasses.replace(config.swift, storage_url=f"http://127.0.0.1:{proxy.port}{path}")
        )
    return dataclasses.replace(config, s3=dataclasses.replace(config.s3, endpoint_url=proxy.url))


def _server_port(server) -> int:
    return urlsplit(server.storage_url).port


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
@pytest.mark.parametrize("scheme", ["swift", "s3"])
def test_read_cut_off_midway_is_resumed(swift_server, swift_container, scheme, reset, caplog):
    config = swift_store_config(swift_server)
    data = payload(3_000_000, seed=5)
    open_store(f"{scheme}://{swift_container}/cut", config).put("obj", data)
    with TcpProxy(_server_port(swift_server)) as proxy:
        store = open_store(f"{scheme}://{swift_container}/cut", _proxied(config, scheme, swift_server, proxy))
        proxy.drop_after_bytes(1_000_000, reset=reset)
        assert store.get_bytes("obj") == data
        assert proxy.requests == 2  # the cut GET, then one ranged GET from the next byte
        proxy.drop_after_bytes(200_000, reset=reset)
        assert store.get_range("obj", 1_500_000, 1_000_000) == data[1_500_000:2_500_000]
        assert proxy.requests == 4
    assert "transient storage error" in caplog.text


# -- wrong credentials ------------------------------------------------------------------------------
def _assert_secret_hidden(secret: str, exc: BaseException, *objects: object, log_text: str) -> None:
    texts = {
        "log": log_text,
        "str(exc)": str(exc),
        "repr(exc)": repr(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    }
    for obj in objects:
        texts[f"repr({type(obj).__name__})"] = repr(obj)
        texts[f"str({type(obj).__name__})"] = str(obj)
    leaks = [where for where, text in texts.items() if secret in text]
    assert not leaks, f"the secret appears in {leaks}"


# Backoff long enough that a single retry would blow the 5 s budget.
SLOW_RETRY = RetryConfig(max_attempts=5, initial_backoff_s=3.0, max_backoff_s=10.0, deadline_s=60)


def test_swift_wrong_key_is_auth_error_at_once(swift_server, swift_container, caplog):
    caplog.set_level(logging.DEBUG)
    wrong = f"wrong-key-{uuid.uuid4().hex}"
    with TcpProxy(_server_port(swift_server)) as proxy:
        auth_path = urlsplit(swift_server.auth_url).path
        swift = SwiftConfig(auth_url=f"{proxy.url}{auth_path}", user=swift_server.user, key=Secret(wrong))
        config = StoreConfig(retry=SLOW_RETRY, swift=swift)
        store = open_store(f"swift://{swift_container}/x", config)
        started = time.monotonic()
        with pytest.raises(AuthError) as caught:
            store.get_bytes("anything")
        assert time.monotonic() - started < 5
        assert proxy.requests == 1  # one auth request, no retry, no second auth
        with pytest.raises(AuthError):
            list(store.list())
        with pytest.raises(AuthError):
            store.put("k", b"data")
    _assert_secret_hidden(wrong, caught.value, store, config, swift, log_text=caplog.text)


@pytest.mark.parametrize("wrong_part", ["secret", "access_key"])
def test_s3_wrong_key_is_auth_error_at_once(swift_server, swift_container, caplog, wrong_part):
    caplog.set_level(logging.DEBUG)
    wrong = f"wrong-{uuid.uuid4().hex}"
    with TcpProxy(_server_port(swift_server)) as proxy:
        s3 = S3Config(
            endpoint_url=proxy.url,
            region=swift_server.region,
            access_key_id=wrong if wrong_part == "access_key" else swift_server.s3_access_key,
            secret_access_key=Secret(wrong if wrong_part == "secret" else swift_server.s3_secret_key),
        )
        config = StoreConfig(retry=SLOW_RETRY, s3=s3)
        store = open_store(f"s3://{swift_container}/x", config)
        started = time.monotonic()
        with pytest.raises(AuthError) as caught:
            store.get_bytes("anything")
        assert time.monotonic() - started < 5
        assert proxy.requests == 1  # botocore's own retries are off too
        with pytest.raises(AuthError):
            store.put("k", b"data")
    if wrong_part == "secret":  # an access key id is not a secret: S3 errors may name it
        _assert_secret_hidden(wrong, caught.value, store, config, s3, log_text=caplog.text)


def test_swift_token_is_kept_out_of_logs_and_errors(swift_server, swift_container, caplog):
    caplog.set_level(logging.DEBUG)
    storage_url, token = swift_server.swift_connection().get_auth()
    swift = SwiftConfig(storage_url=storage_url, auth_token=Secret(token))
    store = open_store(f"swift://{swift_container}/t", StoreConfig(retry=TEST_RETRY, swift=swift))
    store.put("present", b"x")
    with pytest.raises(NotFound) as caught:  # swiftclient logs failed requests with their headers
        store.get_bytes("absent")
    assert "X-Auth-Token" in caplog.text  # the log line is there...
    secret_part = token.removeprefix("AUTH_tk")[:8]  # ...but not even the prefix swiftclient would show
    _assert_secret_hidden(secret_part, caught.value, store, swift, log_text=caplog.text)


def test_swift_expired_token_reauthenticates_once(swift_server, swift_container):
    config = swift_store_config(swift_server)
    open_store(f"swift://{swift_container}/e", config).put("obj", b"payload")
    with TcpProxy(_server_port(swift_server)) as proxy:
        auth_path = urlsplit(swift_server.auth_url).path
        storage_path = urlsplit(swift_server.storage_url).path
        stale = Secret("AUTH_tk" + "0" * 32)
        swift = dataclasses.replace(
            config.swift, auth_url=f"{proxy.url}{auth_path}", storage_url=f"{proxy.url}{storage_path}", auth_token=stale
        )
        store = open_store(f"swift://{swift_container}/e", dataclasses.replace(config, swift=swift))
        assert store.get_bytes("obj") == b"payload"
        assert proxy.requests == 3  # GET with the stale token (401), auth, GET
        assert store.get_bytes("obj") == b"payload"
        assert proxy.requests == 4  # the new token is kept

        # Without credentials to fall back on, the same stale token is an AuthError at once.
        no_creds = SwiftConfig(storage_url=f"{proxy.url}{storage_path}", auth_token=stale)
        store = open_store(f"swift://{swift_container}/e", StoreConfig(retry=SLOW_RETRY, swift=no_creds))
        started = time.monotonic()
        with pytest.raises(AuthError):
            store.get_bytes("obj")
        assert time.monotonic() - started < 5
        assert proxy.requests == 5


# -- Keystone v3 (the stand-in) ---------------------------------------------------------------------
def _keystone_env(server, **extra: str) -> dict[str, str]:
    return {
        "OS_AUTH_URL": server.keystone_url,
        "OS_IDENTITY_API_VERSION": "3",
        "OS_REGION_NAME": "RegionOne",
        "OS_INTERFACE": "public",
        **extra,
    }


def _app_cred_env(server, secret: str) -> dict[str, str]:
    return _keystone_env(
        server,
        OS_AUTH_TYPE="v3applicationcredential",
        OS_APPLICATION_CREDENTIAL_ID=server.app_cred_id,
        OS_APPLICATION_CREDENTIAL_SECRET=secret,
    )


def _password_env(server) -> dict[str, str]:
    account, user = server.user.split(":")
    return _keystone_env(
        server,
        OS_USERNAME=user,
        OS_PASSWORD=server.key,
        OS_PROJECT_NAME=account,
        OS_USER_DOMAIN_NAME="Default",
        OS_PROJECT_DOMAIN_NAME="Default",
    )


@pytest.mark.parametrize("method", ["application_credential", "password"])
def test_keystone_v3_reads_and_writes(swift_server, swift_container, method):
    env = (
        _app_cred_env(swift_server, swift_server.app_cred_secret)
        if method != "password"
        else _password_env(swift_server)
    )
    swift = SwiftConfig.from_env(env)
    assert swift.auth_version == "3"
    store = open_store(f"swift://{swift_container}/ks", StoreConfig(retry=TEST_RETRY, swift=swift))
    data = payload(100_000)
    store.put("a/obj", data)
    assert store.get_bytes("a/obj") == data
    assert store.get_range("a/obj", 10, 20) == data[10:30]
    assert [info.key for info in store.list()] == ["a/obj"]
    store.delete("a/obj")
    assert not store.exists("a/obj")
    # The same container through tempauth: it is the same account.
    conn = swift_server.swift_connection()
    store.put("b", b"via keystone")
    assert conn.get_object(swift_container, "ks/b")[1] == b"via keystone"


def test_keystone_wrong_secret_is_auth_error(swift_server, swift_container, caplog):
    caplog.set_level(logging.DEBUG)
    wrong = f"wrong-secret-{uuid.uuid4().hex}"
    keystone = urlsplit(swift_server.keystone_url)
    with TcpProxy(keystone.port) as proxy:
        env = {**_app_cred_env(swift_server, wrong), "OS_AUTH_URL": f"{proxy.url}{keystone.path}"}
        swift = SwiftConfig.from_env(env)
        config = StoreConfig(retry=SLOW_RETRY, swift=swift)
        store = open_store(f"swift://{swift_container}/ks", config)
        started = time.monotonic()
        with pytest.raises(AuthError) as caught:
            store.get_bytes("x")
        assert time.monotonic() - started < 5
        assert proxy.requests == 1  # one POST /v3/auth/tokens
    _assert_secret_hidden(wrong, caught.value, store, config, swift, log_text=caplog.text)


# -- missing containers ------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["swift", "s3"])
def test_missing_container_is_not_found(swift_server, scheme):
    store = open_store(f"{scheme}://dlstore-no-such-{uuid.uuid4().hex[:8]}/p", swift_store_config(swift_server))
    for action in (lambda: list(store.list()), lambda: store.get_bytes("k"), lambda: store.stat("k")):
        with pytest.raises(NotFound):
            action()
    with pytest.raises(NotFound):
        store.put("k", b"x")


# -- large objects ----------------------------------------------------------------------------------
BIG = 50_000_000


@pytest.fixture(scope="module")
def big_payload() -> bytes:
    return payload(BIG, seed=11)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["swift", "s3"])
def test_50mb_object_in_5mb_segments(swift_server, swift_container, big_payload, scheme, tmp_path):
    segment = 5_000_000 if scheme == "swift" else 5 * 2**20
    config = swift_store_config(swift_server, segment_size=segment, part_size=segment)
    store = open_store(f"{scheme}://{swift_container}/big", config)
    source = tmp_path / "big.bin"
    source.write_bytes(big_payload)
    store.put("obj", source)
    assert store.stat("obj").size == BIG
    assert store.get_bytes("obj") == big_payload
    for boundary in range(segment, BIG, segment):
        assert store.get_range("obj", boundary - 7, 14) == big_payload[boundary - 7 : boundary + 7]
    span = store.get_range("obj", segment // 2, 2 * segment)  # three segments in one request
    assert span == big_payload[segment // 2 : segment // 2 + 2 * segment]

    conn = swift_server.swift_connection()
    headers = conn.head_object(swift_container, "big/obj")
    assert headers.get("x-static-large-object") == "True"  # an SLO either way (s3api stores multipart so)
    if scheme == "swift":
        _, segments = conn.get_container(f"{swift_container}_segments", prefix="big/obj/")
        assert len(segments) == 10
    else:
        assert store.stat("obj").etag.endswith("-10")  # ten parts
    store.delete("obj")
    assert not store.exists("obj")
    if scheme == "swift":
        assert conn.get_container(f"{swift_container}_segments", prefix="big/obj/")[1] == []


def _pieces(data: bytes, size: int, on_piece=None):
    for index, start in enumerate(range(0, len(data), size)):
        if on_piece is not None:
            on_piece(index)
        yield data[start : start + size]


@pytest.mark.parametrize("scheme", ["swift", "s3"])
def test_a_failed_segment_upload_is_retried(swift_server, swift_container, scheme, caplog):
    segment = 5 * 2**20
    config = swift_store_config(swift_server, segment_size=segment, part_size=segment)
    data = payload(3 * segment + 123, seed=2)
    with TcpProxy(_server_port(swift_server)) as proxy:
        store = open_store(f"{scheme}://{swift_container}/retry", _proxied(config, scheme, swift_server, proxy))

        def arm(index: int) -> None:
            if index == 6:  # 6 MiB read: the first segment is stored, the second is being filled
                proxy.reset_next(1)

        # An iterator cannot be rewound: only the per-segment retry can save this upload.
        store.put("obj", _pieces(data, 2**20, arm))
    assert "transient storage error" in caplog.text
    assert open_store(f"{scheme}://{swift_container}/retry", config).get_bytes("obj") == data


@pytest.mark.parametrize("scheme", ["swift", "s3"])
def test_a_failed_large_upload_leaves_nothing_behind(swift_server, swift_container, scheme):
    segment = 5 * 2**20
    config = swift_store_config(swift_server, segment_size=segment, part_size=segment)
    store = open_store(f"{scheme}://{swift_container}/abort", config)
    data = payload(3 * segment, seed=4)

    def explode(index: int) -> None:
        if index == 12:
            raise RuntimeError("the source failed")

    with pytest.raises(RuntimeError, match="the source failed"):
        store.put("obj", _pieces(data, 2**20, explode))
    assert not store.exists("obj")
    conn = swift_server.swift_connection()
    if scheme == "swift":
        assert conn.get_container(f"{swift_container}_segments")[1] == []
    else:
        uploads = swift_server.s3_client().list_multipart_uploads(Bucket=swift_container)
        assert uploads.get("Uploads", []) == []


# -- AWS profiles -------------------------------------------------------------------------------------
def test_s3_credentials_from_a_profile(swift_server, swift_container, tmp_path, monkeypatch):
    credentials = tmp_path / "credentials"
    credentials.write_text(
        "[dlstore-test]\n"
        f"aws_access_key_id = {swift_server.s3_access_key}\n"
        f"aws_secret_access_key = {swift_server.s3_secret_key}\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    base = swift_store_config(swift_server)
    s3 = dataclasses.replace(base.s3, access_key_id=None, secret_access_key=None, profile="dlstore-test")
    store = open_store(f"s3://{swift_container}/profile", dataclasses.replace(base, s3=s3))
    store.put("obj", b"via a profile")
    assert store.get_bytes("obj") == b"via a profile"

    missing = dataclasses.replace(s3, profile="no-such-profile")
    with pytest.raises(ConfigError, match="no-such-profile"):
        open_store(f"s3://{swift_container}/profile", dataclasses.replace(base, s3=missing)).get_bytes("obj")


def test_s3_delete_objects_carries_content_md5(swift_server, swift_container):
    # Swift's s3api before 2.38 refuses DeleteObjects without Content-MD5, which boto3 >= 1.36
    # no longer sends by itself; the store's client adds it.
    store = open_store(f"s3://{swift_container}/multi", swift_store_config(swift_server))
    store.put("a", b"1")
    store.put("b", b"2")
    seen: dict[str, str] = {}

    def capture(request, **_):
        seen.update(request.headers)

    store.client.meta.events.register("before-send.s3.DeleteObjects", capture)
    store.client.delete_objects(Bucket=swift_container, Delete={"Objects": [{"Key": "multi/a"}, {"Key": "multi/b"}]})
    assert "Content-MD5" in seen
    assert [info.key for info in store.list()] == []


# -- containers and buckets made on demand (issue 13) -------------------------------------------------
@pytest.fixture
def new_container(swift_server):
    """A container/bucket name that does not exist yet; deleted (with its segments) afterwards."""
    name = f"dlstore-new-{uuid.uuid4().hex[:12]}"
    yield name
    conn = swift_server.swift_connection()
    delete_container(conn, name)
    conn.close()


@pytest.mark.parametrize("scheme", ["swift", "s3"])
def test_ensure_container_creates_a_missing_container(swift_server, new_container, scheme):
    config = swift_store_config(swift_server, segment_size=1_000_000)
    store = open_store(f"{scheme}://{new_container}/ds", config)
    with pytest.raises(NotFound, match=new_container):  # a plain put does not make it, but says how
        store.put("k", b"x")
    store.ensure_container()
    store.ensure_container()  # idempotent
    data = payload(2_500_000, seed=3)  # in segments: the segments container is made too
    store.put("big", data)
    store.put("small", b"small")
    assert store.get_bytes("big") == data
    assert store.get_range("big", 999_990, 20) == data[999_990:1_000_010]
    assert [info.key for info in store.list()] == ["big", "small"]
    # The other API sees the same container.
    other = "s3" if scheme == "swift" else "swift"
    assert open_store(f"{other}://{new_container}/ds", config).get_bytes("small") == b"small"


@pytest.mark.parametrize("scheme", ["swift", "s3"])
def test_checkpoints_into_a_container_that_does_not_exist(swift_server, new_container, scheme, tmp_path):
    store = open_store(f"{scheme}://{new_container}/run1", swift_store_config(swift_server))
    ckpts = CheckpointStore(store, tmp_dir=str(tmp_path))
    assert ckpts.latest_key() is None  # `--resume auto` on a new container: a fresh start
    ckpts.put_json("config.json", {"model": "resnet18"})  # what a run writes first
    key = ckpts.save({"weights": torch.arange(6)}, step=7)
    assert ckpts.latest_key() == key
    assert torch.equal(ckpts.load(key)["weights"], torch.arange(6))


@pytest.mark.parametrize("scheme", ["swift", "s3"])
def test_cp_into_a_container_that_does_not_exist(swift_server, new_container, scheme, tmp_path, monkeypatch):
    source = tmp_path / "shard.bin"
    source.write_bytes(payload(300_000, seed=5))
    for name in ("OS_AUTH_URL", "OS_AUTH_TOKEN", "OS_STORAGE_URL", "OS_APPLICATION_CREDENTIAL_ID", "ST_AUTH"):
        monkeypatch.delenv(name, raising=False)
    env = swift_server.swift_env() if scheme == "swift" else swift_server.s3_env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli_main(["cp", "-q", str(source), f"{scheme}://{new_container}/ds/"]) == 0
    store = open_store(f"{scheme}://{new_container}/ds", swift_store_config(swift_server))
    assert store.get_bytes("shard.bin") == source.read_bytes()


@pytest.mark.parametrize("scheme", ["swift", "s3"])
def test_convert_into_a_container_that_does_not_exist(swift_server, new_container, scheme, tmp_path, monkeypatch):
    source = make_imagefolder(tmp_path / "src", num_classes=2, per_class=3)
    for name in ("OS_AUTH_URL", "OS_AUTH_TOKEN", "OS_STORAGE_URL", "OS_APPLICATION_CREDENTIAL_ID", "ST_AUTH"):
        monkeypatch.delenv(name, raising=False)
    env = swift_server.swift_env() if scheme == "swift" else swift_server.s3_env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    url = f"{scheme}://{new_container}/ds"
    assert cli_main(["convert", "imagefolder", str(source.root), url, "--workers", "1", "-q"]) == 0
    store = open_store(url, swift_store_config(swift_server))
    manifest = Manifest.load(store)
    assert manifest.total_samples == 6
    for shard in manifest.shards:
        assert len(store.get_bytes(shard.name)) == shard.size


def test_swift_container_creation_refused_says_how(swift_server, new_container):
    """test2:tester2 may read account test (an account ACL) but not create containers in it."""
    owner = swift_server.swift_connection()
    owner.post_account({"X-Account-Access-Control": json.dumps({"read-only": ["test2:tester2"]})})
    try:
        reader = SwiftConfig(
            auth_url=swift_server.auth_url,
            user="test2:tester2",
            key=Secret("testing2"),
            storage_url=swift_server.storage_url,  # the account of test:tester
        )
        store = open_store(f"swift://{new_container}/ds", StoreConfig(retry=TEST_RETRY, swift=reader))
        with pytest.raises(AuthError, match=rf"`swift post {new_container}`"):
            store.ensure_container()
    finally:
        owner.post_account({"X-Account-Access-Control": ""})
    # Without the ACL even a HEAD is refused: the error still says what to do.
    with pytest.raises(AuthError, match=rf"`swift post {new_container}`"):
        store.ensure_container()


def test_s3_bucket_creation_refused_says_how(swift_server):
    """AccessDenied on CreateBucket names the command that makes the bucket (stubbed: every
    tempauth user of the test server may create buckets)."""
    store = open_store("s3://dlstore-denied/ds", swift_store_config(swift_server))
    with Stubber(store.client) as stub:
        stub.add_client_error("head_bucket", service_error_code="404", http_status_code=404)
        stub.add_client_error("create_bucket", service_error_code="AccessDenied", http_status_code=403)
        with pytest.raises(AuthError) as caught:
            store.ensure_container()
    assert f"aws s3 mb s3://dlstore-denied --endpoint-url {swift_server.s3_endpoint}" in str(caught.value)
