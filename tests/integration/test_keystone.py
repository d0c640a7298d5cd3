"""dlstore against a real Keystone in front of a real Swift (`tests/support/keystone_server.py`).

Debian's Keystone 22 and Debian's Swift 2.30 with ``authtoken`` and ``keystoneauth``: openrc
password and application-credential logins through dlstore's API and CLI, the endpoint that
OS_REGION_NAME and OS_INTERFACE pick, a token that expires mid-run, a revoked application
credential, another project's container, wrong domains and projects, TLS in front of both, and
`dlstore doctor`. No secret may show in any log line, error, traceback or repr.

The session fixture starts the cloud (about 10 s) unless ``DLSTORE_KEYSTONE_ENV`` names the
``env.sh`` of a running one. ``DLSTORE_SKIP_SWIFT=1`` skips these tests, as it does Swift's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

import dlstore
from dlstore.config import DataConfig, RetryConfig, StoreConfig
from dlstore.demo.datagen import make_imagefolder
from dlstore.doctor import FAIL, OK, DoctorOptions, format_check, run_doctor
from dlstore.errors import AuthError, ConfigError, DlstoreError, StalledRead, TransientError
from dlstore.storage import open_store
from tests.integration.test_auth import server_context, tls_files  # noqa: F401 (a fixture)
from tests.support import REPO, env_with_repo
from tests.support.fault_proxy import FaultProxy
from tests.support.keystone_server import openrc, read_env_file
from tests.support.loader_support import write_dataset
from tests.support.swift_fixtures import delete_container

pytestmark = pytest.mark.swift

SHORT_TOKEN_S = 5  # the lifetime of the tokens of KEYSTONE_SHORT_AUTH_URL
SLOW_RETRY = RetryConfig(max_attempts=5, initial_backoff_s=3.0, max_backoff_s=10.0, deadline_s=60, read_timeout_s=10)
FAST_RETRY = RetryConfig(initial_backoff_s=0.05, max_backoff_s=0.5, deadline_s=30, read_timeout_s=10)
FERNET_TOKEN = re.compile(r"gAAAAA[\w-]{20,}")  # any Keystone token, whoever's
_SKIP_HINT = "set DLSTORE_SKIP_SWIFT=1 to skip the tests that need it"


# -- the cloud ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cloud:
    """The running cloud, from its env.sh: openrcs, tokens and application credentials."""

    env: dict[str, str] = field(repr=False)

    @property
    def auth_url(self) -> str:
        return self.env["KEYSTONE_AUTH_URL"]

    def port(self, short: bool = False) -> int:
        return urlsplit(self.env["KEYSTONE_SHORT_AUTH_URL" if short else "KEYSTONE_AUTH_URL"]).port

    def openrc(self, user: str = "A", **overrides: str) -> dict[str, str]:
        return openrc(self.env, user, **overrides)

    def app_cred_env(self, app_id: str, secret: str, **overrides: str) -> dict[str, str]:
        return {
            "OS_AUTH_URL": self.auth_url,
            "OS_IDENTITY_API_VERSION": "3",
            "OS_AUTH_TYPE": "v3applicationcredential",
            "OS_APPLICATION_CREDENTIAL_ID": app_id,
            "OS_APPLICATION_CREDENTIAL_SECRET": secret,
            **overrides,
        }

    def storage_url(self, user: str = "A") -> str:
        return self.env[f"KEYSTONE_{user}_STORAGE_URL"]

    def passwords(self) -> list[str]:
        return [self.env[f"KEYSTONE_{user}_PASSWORD"] for user in ("A", "B", "ADMIN")]

    def login(self, user: str = "A") -> tuple[str, str]:
        """(token, user id) of a project-scoped password login, through Keystone's API."""
        body = {
            "auth": {
                "identity": {
                    "methods": ["password"],
                    "password": {
                        "user": {
                            "name": self.env[f"KEYSTONE_{user}_USERNAME"],
                            "domain": {"name": "Default"},
                            "password": self.env[f"KEYSTONE_{user}_PASSWORD"],
                        }
                    },
                },
                "scope": {"project": {"id": self.env[f"KEYSTONE_{user}_PROJECT_ID"]}},
            }
        }
        answer = requests.post(f"{self.auth_url}/auth/tokens", json=body, timeout=30)
        answer.raise_for_status()
        return answer.headers["X-Subject-Token"], answer.json()["token"]["user"]["id"]

    def create_app_cred(self, user: str = "A") -> tuple[str, str]:
        """(id, secret) of a new application credential of `user`, made through Keystone's API."""
        token, user_id = self.login(user)
        answer = requests.post(
            f"{self.auth_url}/users/{user_id}/application_credentials",
            json={"application_credential": {"name": f"dlstore-test-{uuid.uuid4().hex[:8]}"}},
            headers={"X-Auth-Token": token},
            timeout=30,
        )
        answer.raise_for_status()
        made = answer.json()["application_credential"]
        return made["id"], made["secret"]

    def delete_app_cred(self, app_id: str, user: str = "A") -> None:
        token, user_id = self.login(user)
        answer = requests.delete(
            f"{self.auth_url}/users/{user_id}/application_credentials/{app_id}",
            headers={"X-Auth-Token": token},
            timeout=30,
        )
        assert answer.status_code in (204, 404), answer.status_code

    def swift(self, user: str = "A"):
        """A swiftclient Connection on `user`'s own account, with a token from Keystone."""
        import swiftclient

        token, _ = self.login(user)
        return swiftclient.Connection(preauthurl=self.storage_url(user), preauthtoken=token, retries=2)


def _tool(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tests.support.keystone_server", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        cwd=REPO,
        env=env_with_repo(),
    )


def _tail(text: str, lines: int = 80) -> str:
    return "\n".join(text.splitlines()[-lines:])


@pytest.fixture(scope="session")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cloud]:
    """The Keystone and Swift of `keystone_server.py`: a running one's, else one for the session."""
    if os.environ.get("DLSTORE_SKIP_SWIFT") == "1":
        pytest.skip("DLSTORE_SKIP_SWIFT=1: tests that need the local Swift server are skipped")
    env_file = os.environ.get("DLSTORE_KEYSTONE_ENV")
    if env_file:
        try:
            env = read_env_file(env_file)
        except OSError as exc:
            pytest.fail(f"DLSTORE_KEYSTONE_ENV={env_file}: {exc}; {_SKIP_HINT}", pytrace=False)
        if "KEYSTONE_SHORT_AUTH_URL" not in env:
            pytest.fail(f"{env_file}: start it with --short-token-expiration {SHORT_TOKEN_S}", pytrace=False)
        yield Cloud(env)
        return
    installed = _tool("install", timeout=900)
    if installed.returncode != 0:
        pytest.fail(
            f"could not install Keystone (`keystone_server install` exited {installed.returncode}; no network, "
            f"no root?); {_SKIP_HINT}.\n{_tail(installed.stderr)}",
            pytrace=False,
        )
    data_dir = tmp_path_factory.mktemp("keystone")
    started = _tool(
        "start",
        "--data-dir",
        str(data_dir),
        "--short-token-expiration",
        str(SHORT_TOKEN_S),
        "--listing-limit",
        "100",
        "--stop-with-pid",
        str(os.getpid()),
        timeout=180,
    )
    if started.returncode != 0:
        _tool("stop", "--data-dir", str(data_dir), timeout=60)
        pytest.fail(f"could not start Keystone and Swift; {_SKIP_HINT}.\n{_tail(started.stderr, 150)}", pytrace=False)
    try:
        yield Cloud(read_env_file(data_dir / "env.sh"))
    finally:
        stopped = _tool("stop", "--data-dir", str(data_dir), timeout=60)
        if stopped.returncode != 0:
            print(f"test_keystone: stop failed:\n{stopped.stderr}", file=sys.stderr)


@pytest.fixture(scope="module")
def app_cred(cloud: Cloud) -> Iterator[tuple[str, str]]:
    """An application credential of user A, made through Keystone's API."""
    app_id, secret = cloud.create_app_cred()
    yield app_id, secret
    cloud.delete_app_cred(app_id)


@pytest.fixture
def container(cloud: Cloud) -> Iterator[str]:
    """A fresh container of project A; deleted with its contents afterwards."""
    conn = cloud.swift()
    name = f"dlstore-ks-{uuid.uuid4().hex[:12]}"
    conn.put_container(name)
    try:
        yield name
    finally:
        delete_container(conn, name)
        conn.close()


@pytest.fixture
def debug_logs(caplog):
    caplog.set_level(logging.DEBUG)
    for name in ("urllib3", "swiftclient", "keystoneauth", "dlstore"):
        caplog.set_level(logging.DEBUG, logger=name)
    return caplog


def config_for(env: dict[str, str], retry: RetryConfig = FAST_RETRY) -> StoreConfig:
    return dataclasses.replace(StoreConfig.from_env(env), retry=retry)


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`python -m dlstore ARGS` with no credentials but `env`'s."""
    dropped = ("OS_", "ST_", "AWS_", "KS_", "KEYSTONE_")
    base = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    return subprocess.run(
        [sys.executable, "-m", "dlstore", *args],
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
        cwd=REPO,
        env={**base, **env},
    )


def leaks(secrets: list[str], texts: dict[str, str]) -> list[str]:
    """Where a secret, or any Keystone token, shows in `texts`."""
    found = [f"{where}: {s[:4]}…" for s in secrets for where, text in texts.items() if s in text]
    return found + [f"{where}: a token" for where, text in texts.items() if FERNET_TOKEN.search(text)]


def texts_of(error: BaseException | None, *objects: object, log_text: str = "") -> dict[str, str]:
    texts = {"log": log_text}
    if error is not None:
        texts["str(error)"], texts["repr(error)"] = str(error), repr(error)
        texts["traceback"] = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    for obj in objects:
        texts[f"repr({type(obj).__name__})"] = repr(obj)
    return texts


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


# -- logins, and what the CLI does with them -------------------------------------------------------
@pytest.mark.parametrize("method", ["password", "application credential"])
def test_login_then_ls_put_and_get_with_the_cli(cloud, container, app_cred, tmp_path, method):
    env = cloud.openrc() if method == "password" else cloud.app_cred_env(*app_cred)
    source, back = tmp_path / "hello.txt", tmp_path / "back.txt"
    source.write_bytes(f"via {method}".encode())
    url = f"swift://{container}/d/hello.txt"
    outputs = []
    for args in (("cp", str(source), url), ("ls", f"swift://{container}/d"), ("cp", url, str(back))):
        done = cli(*args, env=env)
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
    assert "hello.txt" in outputs[1]
    assert back.read_bytes() == source.read_bytes()
    assert cloud.swift().get_object(container, "d/hello.txt")[1] == source.read_bytes()  # project A's account


@pytest.mark.slow
def test_convert_verify_train_and_resume_through_an_application_credential(cloud, container, app_cred, tmp_path):
    """The main job as a testbed user runs it: an ImageFolder converted into project A's
    container, verified, trained from with checkpoints to it, then resumed for a second epoch."""
    env = cloud.app_cred_env(*app_cred)
    made = make_imagefolder(tmp_path / "src", num_classes=3, per_class=8, image_size=(24, 24), formats=("jpg",))
    data, ckpt = f"swift://{container}/data", f"swift://{container}/ckpt"
    train = ["train", data, "--model", "resnet18", "--image-size", "16", "--batch-size", "4", "--workers", "1"]
    train += ["--checkpoint-url", ckpt, "--checkpoint-every-steps", "2", "--checkpoint-every-minutes", "0"]
    train += ["--cache-dir", str(tmp_path / "cache"), "--output-dir", str(tmp_path / "out"), "--no-progress"]
    train += ["--no-tensorboard", "--resume", "auto", "--log-every", "1"]
    steps = [
        ("convert", "imagefolder", str(made.root), data, "--samples-per-shard", "6", "--workers", "1", "-q"),
        ("verify", data, "--deep"),
        (*train, "--epochs", "1"),
        (*train, "--epochs", "2"),
    ]
    outputs = []
    for args in steps:
        done = cli(*args, env=env)
        assert done.returncode == 0, f"{args[0]}: {done.stderr[-3000:]}"
        outputs.append(done.stdout + done.stderr)
    assert "resumed from" in outputs[3] and "at epoch 1" in outputs[3]
    objects = {o["name"] for o in cloud.swift().get_container(container, full_listing=True)[1]}
    assert "data/index.json" in objects and sum(name.startswith("ckpt/ckpt-") for name in objects) >= 2
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == list(range(1, 13))  # 24 images, 6 steps an epoch
    assert not leaks([app_cred[1]], {f"step {n}": text for n, text in enumerate(outputs)})


def test_a_wrong_application_credential_secret_is_an_auth_error_at_once(cloud, container, app_cred, debug_logs):
    wrong = f"Wr0ng-{uuid.uuid4().hex}"
    with FaultProxy(cloud.port()) as keystone:
        env = cloud.app_cred_env(app_cred[0], wrong, OS_AUTH_URL=f"{keystone.url}/v3")
        config = config_for(env, SLOW_RETRY)
        started = time.monotonic()
        with pytest.raises(AuthError, match=f"refused application credential {app_cred[0]}") as caught:
            list(open_store(f"swift://{container}/d", config).list())
        took = time.monotonic() - started
        assert keystone.count() == 1  # one login, no retry
    assert took < 5
    assert not leaks([wrong, app_cred[1]], texts_of(caught.value, config, log_text=debug_logs.text))


# -- the endpoint the catalog gives ----------------------------------------------------------------
@pytest.mark.parametrize("region", ["RegionOne", "RegionTwo"])
@pytest.mark.parametrize("interface", ["public", "internal", "internalURL"])
def test_region_and_interface_pick_the_endpoint(cloud, container, region, interface):
    """RegionTwo's endpoints are a forwarder's port; an internal endpoint's path says v1.0."""
    store = open_store(
        f"swift://{container}/r", config_for(cloud.openrc(OS_REGION_NAME=region, OS_INTERFACE=interface))
    )
    store.put("obj", f"{region} {interface}".encode())
    assert store.get_bytes("obj") == f"{region} {interface}".encode()
    login = store.login()
    host = cloud.env["KEYSTONE_SWIFT_URL" if region == "RegionOne" else "KEYSTONE_REGION_TWO_SWIFT_URL"]
    version = "v1" if interface == "public" else "v1.0"
    assert login.storage_url == f"{host}/{version}/AUTH_{cloud.env['KEYSTONE_A_PROJECT_ID']}"
    assert (login.region, login.interface) == (region, interface.removesuffix("URL"))
    assert (login.user, login.project, login.project_id) == ("user-a", "project-a", cloud.env["KEYSTONE_A_PROJECT_ID"])
    assert cloud.swift().get_object(container, "r/obj")[1] == f"{region} {interface}".encode()


@pytest.mark.parametrize(("region", "interface"), [("RegionThree", "public"), ("RegionOne", "admin")])
def test_an_endpoint_the_catalog_lacks_is_a_config_error_listing_what_it_has(cloud, container, region, interface):
    store = open_store(
        f"swift://{container}/r", config_for(cloud.openrc(OS_REGION_NAME=region, OS_INTERFACE=interface))
    )
    with pytest.raises(ConfigError) as caught:
        store.stat("obj")
    message = str(caught.value)
    assert f"region {region} and interface {interface}" in message
    assert "RegionOne internal, RegionOne public, RegionTwo internal, RegionTwo public" in message


# -- tokens that expire, credentials that are revoked ----------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_token_that_expires_during_a_run_is_renewed_once_and_nothing_is_lost(cloud, container, tmp_path, debug_logs):
    """Tokens of KEYSTONE_SHORT_AUTH_URL last 5 s. Swift's authtoken refuses one that has
    expired, dlstore logs in again once and the run goes on. keystoneauth logs in afresh for a
    token with less than 2 minutes left: asked for the catalog and the token apart, each
    login was two."""
    url = f"swift://{container}/d"
    keys = write_dataset(open_store(url, config_for(cloud.openrc())), [4] * 6)
    with FaultProxy(cloud.port(short=True)) as keystone:
        config = config_for(cloud.openrc(OS_AUTH_URL=f"{keystone.url}/v3"), SLOW_RETRY)
        ds = dataset(url, tmp_path, config, shuffle_window=1)
        loader = dlstore.Loader(ds, num_workers=0, device="cpu")
        seen = []
        for step, (_, _, meta) in enumerate(loader):
            seen += [k for k, p in zip(meta["keys"], meta["padding"].tolist()) if not p]
            if step == 0:
                time.sleep(SHORT_TOKEN_S + 1.5)  # the token expires
        ds.cache.close()
        logins = keystone.count("POST", r"/auth/tokens$")
    assert sorted(seen) == sorted(keys)
    assert logins == 2  # the first login, and one after the token expired
    assert not leaks(cloud.passwords(), texts_of(None, config, ds.store, log_text=debug_logs.text))


def test_a_revoked_application_credential_is_an_auth_error_at_once(cloud, container, debug_logs):
    """Keystone answers 404 for a deleted application credential: that is an AuthError that
    names it, after one request, not "identity service error (NotFound)"."""
    app_id, secret = cloud.create_app_cred()
    cloud.delete_app_cred(app_id)
    with FaultProxy(cloud.port()) as keystone:
        config = config_for(cloud.app_cred_env(app_id, secret, OS_AUTH_URL=f"{keystone.url}/v3"), SLOW_RETRY)
        started = time.monotonic()
        with pytest.raises(AuthError) as caught:
            open_store(f"swift://{container}/d", config).stat("anything")
        took = time.monotonic() - started
        assert keystone.count() == 1  # no retry
    assert took < 5
    assert f"no application credential {app_id}" in str(caught.value) and "deleted" in str(caught.value)
    assert not leaks([secret], texts_of(caught.value, config, log_text=debug_logs.text))


@pytest.mark.slow
def test_an_application_credential_revoked_mid_run_stops_the_loader(cloud, container, tmp_path, debug_logs):
    """Revoked mid-run: Swift refuses the token once its cached validation (2 s) is stale,
    dlstore logs in once more, Keystone has no such credential: AuthError, no retry loop."""
    url = f"swift://{container}/d"
    keys = write_dataset(open_store(url, config_for(cloud.openrc())), [4] * 8)
    app_id, secret = cloud.create_app_cred()
    with FaultProxy(cloud.port()) as keystone:
        config = config_for(cloud.app_cred_env(app_id, secret, OS_AUTH_URL=f"{keystone.url}/v3"), SLOW_RETRY)
        ds = dataset(url, tmp_path, config, shuffle_window=1)
        loader = dlstore.Loader(ds, num_workers=0, device="cpu")
        seen, error = [], None
        try:
            for step, (_, _, meta) in enumerate(loader):
                seen += meta["keys"]
                if step == 0:
                    cloud.delete_app_cred(app_id)
                    before, revoked_at = keystone.count(), time.monotonic()
                    time.sleep(3)  # Swift's authtoken caches a validation 2 s
        except AuthError as exc:
            error, took = exc, time.monotonic() - revoked_at
        ds.cache.close()
        after = keystone.count() - before
    assert isinstance(error, AuthError), "the run went on with a revoked application credential"
    assert took < 10
    assert 1 <= after <= 1 + ds.cache.config.shards_in_flight, after  # one login per fetcher at most
    assert len(seen) < len(keys)
    assert f"no application credential {app_id}" in str(error)
    assert not leaks([secret], texts_of(error, config, ds.store, loader, log_text=debug_logs.text))


# -- other projects, wrong domains and projects ----------------------------------------------------
def test_a_user_of_project_b_may_not_read_or_write_project_a_s_container(cloud, container, tmp_path):
    open_store(f"swift://{container}/a", config_for(cloud.openrc())).put("obj", b"project A's")
    env_b = cloud.openrc("B", OS_STORAGE_URL=cloud.storage_url("A"))  # B's token on A's account
    store_b = open_store(f"swift://{container}/a", config_for(env_b, SLOW_RETRY))
    for attempt in (lambda: store_b.get_bytes("obj"), lambda: list(store_b.list()), lambda: store_b.put("new", b"B")):
        started = time.monotonic()
        with pytest.raises(AuthError) as caught:
            attempt()
        assert time.monotonic() - started < 5  # never retried
        message = f"{type(caught.value).__name__}: {caught.value}"
        assert container in message and "403" in message, message
        assert not re.search(r"\b_[A-Z]\w*", message), message  # no private class name
    source = tmp_path / "new"
    source.write_bytes(b"B's")
    done = cli("cp", str(source), f"swift://{container}/a/cli-new", env=env_b)
    assert done.returncode != 0 and container in done.stderr and "Traceback" not in done.stderr
    assert not re.search(r"\b_[A-Z]\w*", done.stderr), done.stderr
    assert [o["name"] for o in cloud.swift().get_container(container)[1]] == ["a/obj"]  # nothing written


WRONG_LOGINS = {
    "user domain": ({"OS_USER_DOMAIN_NAME": "NoSuchDomain"}, ["'NoSuchDomain'", "OS_USER_DOMAIN_NAME"]),
    "password": ({"OS_PASSWORD": "Wr0ng-password-value"}, ["wrong password", "OS_PASSWORD"]),
    "project": ({"OS_PROJECT_NAME": "project-b"}, ["'project-b'", "OS_PROJECT_NAME", "project-a (domain id default)"]),
    "project domain": (
        {"OS_PROJECT_DOMAIN_NAME": "NoSuchDomain"},
        ["'project-a' of domain 'NoSuchDomain'", "OS_PROJECT_DOMAIN_NAME"],
    ),
}


@pytest.mark.parametrize("what", list(WRONG_LOGINS))
def test_a_wrong_domain_or_project_is_an_auth_error_that_says_which(cloud, container, debug_logs, what):
    overrides, expected = WRONG_LOGINS[what]
    with FaultProxy(cloud.port()) as keystone:
        config = config_for(cloud.openrc(OS_AUTH_URL=f"{keystone.url}/v3", **overrides), SLOW_RETRY)
        started = time.monotonic()
        with pytest.raises(AuthError) as caught:
            open_store(f"swift://{container}/d", config).stat("obj")
        took = time.monotonic() - started
        requests_made = keystone.count()
    for text in expected:
        assert text in str(caught.value), caught.value
    assert took < 5
    assert requests_made <= 3  # the login, once more without a project, and the user's projects
    assert not leaks(
        [*cloud.passwords(), "Wr0ng-password-value"], texts_of(caught.value, config, log_text=debug_logs.text)
    )


def test_no_secret_or_token_in_the_stderr_of_verbose_runs(cloud, container, tmp_path):
    app_id, secret = cloud.create_app_cred()
    source = tmp_path / "f"
    source.write_bytes(b"x" * 100)
    outputs = {}
    for name, env in {
        "password": cloud.openrc(),
        "application credential": cloud.app_cred_env(app_id, secret),
        "wrong password": cloud.openrc(OS_PASSWORD="Wr0ng-password-value"),
    }.items():
        done = cli("-vv", "cp", str(source), f"swift://{container}/v/{uuid.uuid4().hex}", env=env)
        outputs[name] = done.stdout + done.stderr
        assert (done.returncode == 0) == (name != "wrong password"), done.stderr
        assert "keystoneauth" in done.stderr  # the identity client's debug lines are there
    cloud.delete_app_cred(app_id)
    done = cli("-vv", "ls", f"swift://{container}", env=cloud.app_cred_env(app_id, secret))
    assert done.returncode != 0 and f"AuthError: authenticating for swift://{container}" in done.stderr
    assert "identity service error" not in done.stderr
    outputs["revoked application credential"] = done.stdout + done.stderr
    assert not leaks([*cloud.passwords(), secret, "Wr0ng-password-value"], outputs)


# -- TLS in front of Keystone and Swift ------------------------------------------------------------
def _tls_env(cloud: Cloud, swift: FaultProxy, keystone: FaultProxy, ca: str | None) -> dict[str, str]:
    # Swift sees plain HTTP behind the TLS proxy, and the catalog names Swift itself: an
    # openrc's OS_STORAGE_URL says where the object store really is.
    env = cloud.openrc(OS_AUTH_URL=f"{keystone.url}/v3")
    env["OS_STORAGE_URL"] = f"{swift.url}{urlsplit(cloud.storage_url()).path}"
    if ca:
        env["OS_CACERT"] = ca
    return env


def test_tls_with_a_custom_ca_bundle(cloud, container, tls_files):  # noqa: F811
    context = server_context(tls_files["server"])
    swift_port = urlsplit(cloud.storage_url()).port
    with FaultProxy(swift_port, ssl_context=context) as swift, FaultProxy(cloud.port(), ssl_context=context) as ks:
        store = open_store(f"swift://{container}/tls", config_for(_tls_env(cloud, swift, ks, tls_files["ca"])))
        store.put("hello", b"over TLS")
        assert store.get_bytes("hello") == b"over TLS"
        assert [i.key for i in store.list()] == ["hello"]
        assert swift.count() >= 3 and ks.count("POST", r"/auth/tokens") == 1


@pytest.mark.parametrize("trust", ["another CA", "no CA bundle", "wrong host name"])
def test_tls_verification_toward_keystone_is_never_silently_off(cloud, container, tls_files, trust):  # noqa: F811
    server_pem = tls_files["wrong_host" if trust == "wrong host name" else "server"]
    ca = {"another CA": tls_files["other_ca"], "no CA bundle": None, "wrong host name": tls_files["ca"]}[trust]
    context = server_context(server_pem)
    swift_port = urlsplit(cloud.storage_url()).port
    with FaultProxy(swift_port, ssl_context=context) as swift, FaultProxy(cloud.port(), ssl_context=context) as ks:
        store = open_store(f"swift://{container}/tls", config_for(_tls_env(cloud, swift, ks, ca), SLOW_RETRY))
        started = time.monotonic()
        with pytest.raises(DlstoreError) as caught:
            store.get_bytes("anything")
        took = time.monotonic() - started
        sent = swift.count() + ks.count()
    error = caught.value
    assert not isinstance(error, (TransientError, AuthError)), error  # a configuration problem: not retried
    assert "TLS" in str(error) and "OS_CACERT" in str(error)
    assert sent == 0  # no request ever left over an unverified connection
    assert took < 5


# -- logins that stall ----------------------------------------------------------------------------
def test_a_login_whose_answer_trickles_is_cut_and_asked_again(cloud, container, app_cred):
    """Keystone's answer a byte every 0.2 s never trips the read timeout: the stall timeout
    cuts it. Once, the login is asked again and the read goes on; for good, it ends in
    `StalledRead` within the deadline, not in a hang."""
    open_store(f"swift://{container}/auth", config_for(cloud.openrc())).put("obj", b"x" * 1000)
    with FaultProxy(cloud.port(), trickle_s=0.2) as keystone:
        env = cloud.app_cred_env(*app_cred, OS_AUTH_URL=f"{keystone.url}/v3")
        policy = dataclasses.replace(FAST_RETRY, stall_timeout_s=2.0)
        keystone.add_rule("trickle_head", method="POST", path=r"/auth/tokens$")
        started = time.monotonic()
        assert open_store(f"swift://{container}/auth", config_for(env, policy)).get_bytes("obj") == b"x" * 1000
        assert keystone.injected_kinds() == {"trickle_head": 1}
        assert time.monotonic() - started < 30

        keystone.add_rule("trickle_head", method="POST", path=r"/auth/tokens$", times=None)
        impatient = dataclasses.replace(policy, deadline_s=3.0)
        started = time.monotonic()
        with pytest.raises(StalledRead, match="authenticating for .*no answer within 2 s"):
            open_store(f"swift://{container}/auth", config_for(env, impatient)).stat("obj")
        assert time.monotonic() - started < 30


def test_threads_waiting_for_a_login_that_stalls_share_its_failure(cloud, container, app_cred):
    """Five threads of one store wait for one stalled login and share its error."""
    from concurrent import futures

    open_store(f"swift://{container}/auth", config_for(cloud.openrc())).put("obj", b"x")
    with FaultProxy(cloud.port(), trickle_s=0.2) as keystone:
        keystone.add_rule("trickle_head", method="POST", path=r"/auth/tokens$", times=None)
        once = dataclasses.replace(FAST_RETRY, stall_timeout_s=2.0, max_attempts=1)
        env = cloud.app_cred_env(*app_cred, OS_AUTH_URL=f"{keystone.url}/v3")
        store = open_store(f"swift://{container}/auth", config_for(env, once))
        with futures.ThreadPoolExecutor(5) as pool:
            errors = [call.exception(timeout=60) for call in [pool.submit(store.stat, "obj") for _ in range(5)]]
        logins = keystone.count("POST", r"/auth/tokens$")
    assert all(isinstance(error, StalledRead) and "authenticating for" in str(error) for error in errors), errors
    assert logins == 1


# -- dlstore doctor --------------------------------------------------------------------------------
def clean_env(extra: dict[str, str]) -> dict[str, str]:
    dropped = ("OS_", "ST_", "AWS_", "KS_", "KEYSTONE_", "SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_")
    return {**{k: v for k, v in os.environ.items() if not k.startswith(dropped)}, **extra}


def small_run(url: str, tmp_path: Path) -> DoctorOptions:
    settings = dict(cache_dir=str(tmp_path / "cache"), cache_limit=10**8, batch_size=2, workers=1, image_size=32)
    return DoctorOptions(DataConfig(url, **settings))


@pytest.mark.parametrize("method", ["password", "application credential"])
def test_doctor_shows_the_login_its_project_and_the_endpoint(cloud, container, app_cred, tmp_path, method):
    write_dataset(open_store(f"swift://{container}/d", config_for(cloud.openrc())), [2])
    where = {"OS_REGION_NAME": "RegionTwo", "OS_INTERFACE": "internal"}
    env = cloud.openrc(**where) if method == "password" else cloud.app_cred_env(*app_cred, **where)
    checks = {check.name: check for check in run_doctor(small_run(f"swift://{container}/d", tmp_path), clean_env(env))}
    for name in ("credentials", "endpoint", "auth", "catalog", "listing", "manifest", "read"):
        assert checks[name].status == OK, format_check(checks[name])
    project_id = cloud.env["KEYSTONE_A_PROJECT_ID"]
    assert f"Keystone {method}" in checks["auth"].summary
    assert (
        f"user user-a (domain Default), project project-a (id {project_id}, domain Default)" in checks["auth"].summary
    )
    endpoint = f"{cloud.env['KEYSTONE_REGION_TWO_SWIFT_URL']}/v1.0/AUTH_{project_id}"
    assert f"region RegionTwo, interface internal: {endpoint}" in checks["catalog"].summary
    assert app_cred[1] not in "\n".join(map(format_check, checks.values()))


def test_doctor_shows_a_revoked_application_credential_as_an_auth_failure(cloud, container, tmp_path):
    app_id, secret = cloud.create_app_cred()
    cloud.delete_app_cred(app_id)
    args = ["doctor", f"swift://{container}/d", "--cache-dir", str(tmp_path / "c"), "--cache-limit", "100MB"]
    done = cli(*args, env=cloud.app_cred_env(app_id, secret))
    assert done.returncode == 1
    fail = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert fail and fail[0].startswith("FAIL  auth") and app_id in fail[0], done.stdout
    assert "server error" not in done.stdout and "listing" not in done.stdout
    assert secret not in done.stdout + done.stderr


def test_doctor_names_the_endpoints_of_the_catalog_when_the_region_has_none(cloud, container, tmp_path):
    env = clean_env(cloud.openrc(OS_REGION_NAME="RegionThree"))
    checks = {check.name: check for check in run_doctor(small_run(f"swift://{container}/d", tmp_path), env)}
    assert checks["catalog"].status == FAIL and "RegionOne public, RegionTwo" in checks["catalog"].summary
    assert "auth" not in checks and "listing" not in checks
