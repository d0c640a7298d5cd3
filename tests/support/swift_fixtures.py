"""pytest fixtures for the local OpenStack Swift server (``swift_server.py``), a plugin of conftest.

* ``swift_server`` (session): a :class:`SwiftEndpoint`. ``DLSTORE_SWIFT_ENV`` may name the
  ``env.sh`` of a running server, which is then used as it is. Otherwise the fixture
  installs Swift if needed and runs a server in a temp dir for the session; a watchdog stops
  it should the run be killed. A server that cannot start FAILS the tests that need it;
  ``DLSTORE_SKIP_SWIFT=1`` skips them instead.
* ``swift_container`` and ``s3_bucket`` (function): a fresh, empty container or bucket.

Tests that use ``swift_server``, directly or not, get the ``swift`` marker. A fixture-started
server reads ``DLSTORE_SWIFT_FLAVOR`` (``pypi`` or ``debian``) and
``DLSTORE_SWIFT_LISTING_LIMIT`` (default 100, so that listings page without 10,000 objects).

Example::

    def test_roundtrip(swift_server, swift_container):
        conn = swift_server.swift_connection()
        conn.put_object(swift_container, "a", b"data")
        assert conn.get_object(swift_container, "a")[1] == b"data"
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import http.client
import json
import os
import subprocess
import sys
import urllib.parse
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.swift_server import read_env_file

__all__ = ["SwiftEndpoint", "delete_container", "read_env_file", "swift_server", "swift_container", "s3_bucket"]

SWIFT_SERVER_SCRIPT = Path(__file__).resolve().with_name("swift_server.py")
DEFAULT_LISTING_LIMIT = 100
_SKIP_HINT = "set DLSTORE_SKIP_SWIFT=1 to skip the tests that need it"


@dataclass(frozen=True)
class SwiftEndpoint:
    """Where the local Swift server answers, and with which (test) credentials."""

    auth_url: str  # tempauth v1 URL (ST_AUTH)
    user: str  # ST_USER, account:user
    key: str = field(repr=False)  # ST_KEY
    storage_url: str  # http://127.0.0.1:PORT/v1/AUTH_test
    s3_endpoint: str  # AWS_ENDPOINT_URL
    s3_access_key: str
    s3_secret_key: str = field(repr=False)
    keystone_url: str  # Keystone v3 stand-in, ends in /v3
    app_cred_id: str
    app_cred_secret: str = field(repr=False)
    data_dir: str
    region: str = "us-east-1"
    listing_limit: int = 10000  # Swift's container_listing_limit; S3 pages hold at most this - 1

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SwiftEndpoint:
        """Build from the variables ``swift_server.py start`` exports; KeyError names a missing one."""
        auth_url = env["ST_AUTH"]
        storage_url = env.get("DLSTORE_SWIFT_STORAGE_URL") or auth_url.split("/auth/", 1)[0] + "/v1/AUTH_test"
        return cls(
            auth_url=auth_url,
            user=env["ST_USER"],
            key=env["ST_KEY"],
            storage_url=storage_url,
            s3_endpoint=env["AWS_ENDPOINT_URL"],
            s3_access_key=env["AWS_ACCESS_KEY_ID"],
            s3_secret_key=env["AWS_SECRET_ACCESS_KEY"],
            keystone_url=env["KS_AUTH_URL"],
            app_cred_id=env["KS_APP_CRED_ID"],
            app_cred_secret=env["KS_APP_CRED_SECRET"],
            data_dir=env["DLSTORE_SWIFT_DIR"],
            region=env.get("AWS_DEFAULT_REGION", "us-east-1"),
        )

    def swift_env(self) -> dict[str, str]:
        """``ST_*`` only (the swift CLI and python-swiftclient read these)."""
        return {"ST_AUTH": self.auth_url, "ST_USER": self.user, "ST_KEY": self.key}

    def s3_env(self) -> dict[str, str]:
        """``AWS_*`` only, with boto3's checksums limited to what the operation requires."""
        return {
            "AWS_ENDPOINT_URL": self.s3_endpoint,
            "AWS_ACCESS_KEY_ID": self.s3_access_key,
            "AWS_SECRET_ACCESS_KEY": self.s3_secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
            "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
        }

    def env(self) -> dict[str, str]:
        """Everything ``swift_server.py start`` exports, plus the two boto3 checksum settings."""
        return {
            **self.swift_env(),
            **self.s3_env(),
            "KS_AUTH_URL": self.keystone_url,
            "KS_APP_CRED_ID": self.app_cred_id,
            "KS_APP_CRED_SECRET": self.app_cred_secret,
            "DLSTORE_SWIFT_DIR": self.data_dir,
            "DLSTORE_SWIFT_STORAGE_URL": self.storage_url,
        }

    def swift_connection(self, **kwargs: Any):
        """A ``swiftclient.Connection`` with tempauth credentials (kwargs override)."""
        import swiftclient

        options = {"authurl": self.auth_url, "user": self.user, "key": self.key, "retries": 2}
        return swiftclient.Connection(**{**options, **kwargs})

    def s3_client(self, **config: Any):
        """A boto3 S3 client: path-style addressing, checksums only when required (config overrides).

        It also sends Content-MD5 with DeleteObjects, which older s3api (Swift 2.30) requires.
        """
        import boto3
        from botocore.config import Config

        options = {
            "s3": {"addressing_style": "path"},
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
            "retries": {"max_attempts": 2, "mode": "standard"},
            **config,
        }
        client = boto3.client(
            "s3",
            endpoint_url=self.s3_endpoint,
            aws_access_key_id=self.s3_access_key,
            aws_secret_access_key=self.s3_secret_key,
            region_name=self.region,
            config=Config(**options),
        )
        # s3api before Swift 2.3x insists on Content-MD5 for DeleteObjects, which boto3 >= 1.36
        # replaced by a CRC32 even with "when_required" (Debian's Swift 2.30 needs this).
        client.meta.events.register("before-sign.s3.DeleteObjects", _add_content_md5)
        return client


def _add_content_md5(request: Any, **_: Any) -> None:
    body = request.body or b""
    body = body.encode() if isinstance(body, str) else body
    request.headers["Content-MD5"] = base64.b64encode(hashlib.md5(body).digest()).decode()


def _proxy_info(endpoint: SwiftEndpoint) -> dict:
    """GET /info from the proxy (raises OSError or ValueError when it does not answer)."""
    parts = urllib.parse.urlsplit(endpoint.s3_endpoint)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("GET", "/info")
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise ValueError(f"GET /info answered {resp.status}")
        return json.loads(body)
    finally:
        conn.close()


def _with_limit(endpoint: SwiftEndpoint) -> SwiftEndpoint:
    info = _proxy_info(endpoint)
    limit = int(info.get("swift", {}).get("container_listing_limit", 10000))
    return dataclasses.replace(endpoint, listing_limit=limit)


def _run_tool(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SWIFT_SERVER_SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


@pytest.fixture(scope="session")
def swift_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SwiftEndpoint]:
    """The local Swift server (Swift API, S3 API, Keystone v3 stand-in); see the module docstring."""
    if os.environ.get("DLSTORE_SKIP_SWIFT") == "1":
        pytest.skip("DLSTORE_SKIP_SWIFT=1: tests that need the local Swift server are skipped")
    env_file = os.environ.get("DLSTORE_SWIFT_ENV")
    if env_file:
        try:
            endpoint = _with_limit(SwiftEndpoint.from_env(read_env_file(env_file)))
        except (OSError, KeyError, ValueError) as exc:
            pytest.fail(
                f"DLSTORE_SWIFT_ENV={env_file}: no running Swift server there ({type(exc).__name__}: {exc}); "
                f"start one with `python -m tests.support.swift_server start --env-file {env_file}`, or {_SKIP_HINT}",
                pytrace=False,
            )
        yield endpoint
        return

    flavor = os.environ.get("DLSTORE_SWIFT_FLAVOR", "pypi")
    try:
        installed = _run_tool("install", "--flavor", flavor, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.fail(f"installing Swift ({flavor}) took over 15 minutes; {_SKIP_HINT}", pytrace=False)
    if installed.returncode != 0:
        pytest.fail(
            f"could not install the local Swift server (`swift_server.py install --flavor {flavor}` "
            f"exited {installed.returncode}; no network?); {_SKIP_HINT}.\n{_tail(installed.stdout + installed.stderr)}",
            pytrace=False,
        )
    data_dir = tmp_path_factory.mktemp("swift")
    limit = os.environ.get("DLSTORE_SWIFT_LISTING_LIMIT", str(DEFAULT_LISTING_LIMIT))
    start_args = ["start", "--flavor", flavor, "--data-dir", str(data_dir), "--listing-limit", limit]
    try:
        started = _run_tool(*start_args, "--stop-with-pid", str(os.getpid()), timeout=120)
    except subprocess.TimeoutExpired:
        _run_tool("stop", "--data-dir", str(data_dir), timeout=60)
        pytest.fail(f"`swift_server.py start` hung for 2 minutes; {_SKIP_HINT}", pytrace=False)
    if started.returncode != 0:
        pytest.fail(
            f"could not start the local Swift server (exit {started.returncode}); {_SKIP_HINT}.\n"
            f"{_tail(started.stderr, 120)}",
            pytrace=False,
        )
    try:
        yield _with_limit(SwiftEndpoint.from_env(read_env_file(data_dir / "env.sh")))
    finally:
        stopped = _run_tool("stop", "--data-dir", str(data_dir), timeout=60)
        if stopped.returncode != 0:
            print(f"swift_fixtures: stop failed:\n{stopped.stderr}", file=sys.stderr)


def delete_container(conn: Any, name: str) -> None:
    """Best effort: delete ``name`` and its segment containers with everything in them.

    Objects go in one bulk-delete request per listing page (one round trip each, not one per
    object), so a test that filled a container with thousands of objects cleans up quickly.
    """
    from swiftclient.exceptions import ClientException

    for container in (name, f"{name}_segments", f"{name}+segments"):
        with contextlib.suppress(ClientException, OSError):
            while True:
                _, objects = conn.get_container(container)  # one page: the server's listing limit
                if not objects:
                    break
                paths = [f"/{container}/{obj['name']}" for obj in objects]
                if not _bulk_delete(conn, paths):
                    for obj in objects:
                        with contextlib.suppress(ClientException):
                            conn.delete_object(container, obj["name"])
            conn.delete_container(container)


def _bulk_delete(conn: Any, paths: list[str]) -> bool:
    """One ``POST ?bulk-delete`` (Swift's bulk middleware); False if it did not delete them all."""
    storage_url, token = conn.get_auth()
    parts = urllib.parse.urlsplit(storage_url)
    body = "\n".join(urllib.parse.quote(p) for p in paths).encode()
    client = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        headers = {"X-Auth-Token": token, "Content-Type": "text/plain", "Accept": "application/json"}
        client.request("POST", f"{parts.path}?bulk-delete", body=body, headers=headers)
        resp = client.getresponse()
        result = json.loads(resp.read() or b"{}")
    except (OSError, ValueError):
        return False
    finally:
        client.close()
    return resp.status == 200 and not result.get("Errors") and result.get("Response Status", "").startswith("200")


def _unique_name() -> str:
    # Lower case, digits and '-' only: valid as a Swift container and as an S3 bucket name.
    return f"dlstore-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def swift_container(swift_server: SwiftEndpoint) -> Iterator[str]:
    """A fresh, empty Swift container (its name); deleted with its contents afterwards."""
    conn = swift_server.swift_connection()
    name = _unique_name()
    conn.put_container(name)
    try:
        yield name
    finally:
        delete_container(conn, name)
        conn.close()


@pytest.fixture
def s3_bucket(swift_server: SwiftEndpoint) -> Iterator[str]:
    """A fresh, empty S3 bucket (its name), made with boto3; deleted with its contents afterwards.

    Clean-up goes through the Swift API (a bucket is a container), which also removes
    the ``<bucket>+segments`` container that S3 multipart uploads leave behind.
    """
    name = _unique_name()
    swift_server.s3_client().create_bucket(Bucket=name)
    conn = swift_server.swift_connection()
    try:
        yield name
    finally:
        delete_container(conn, name)
        conn.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "swift_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.swift)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if os.environ.get("DLSTORE_SKIP_SWIFT") == "1" and item.get_closest_marker("swift"):
        pytest.skip("DLSTORE_SKIP_SWIFT=1: tests that need the local Swift server are skipped")
