"""Smoke tests of the local Swift server (tests/support/swift_server.py), its Keystone stand-in and the TCP proxy."""

from __future__ import annotations

import http.client
import importlib.util
import json
import socket
import urllib.parse
from pathlib import Path

import pytest
from swiftclient.exceptions import ClientException

from tests import support
from tests.support.swift_fixtures import SwiftEndpoint
from tests.support.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.swift, pytest.mark.compat]

PAYLOAD = bytes(range(256)) * 400  # 100 KiB, position-dependent content


def _load_tool(name: str):
    path = Path(support.__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"dlstore_tools_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _token(swift_server: SwiftEndpoint) -> str:
    return swift_server.swift_connection().get_auth()[1]


def _port(url: str) -> int:
    return urllib.parse.urlsplit(url).port


def test_endpoint_env(swift_server: SwiftEndpoint) -> None:
    env = swift_server.env()
    for name in ("ST_AUTH", "ST_USER", "ST_KEY", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[name]
    assert env["AWS_DEFAULT_REGION"] == "us-east-1"
    assert set(swift_server.swift_env()) == {"ST_AUTH", "ST_USER", "ST_KEY"}
    assert all(name.startswith("AWS_") for name in swift_server.s3_env())
    assert swift_server.s3_env()["AWS_REQUEST_CHECKSUM_CALCULATION"] == "when_required"
    assert swift_server.key not in repr(swift_server)
    assert swift_server.app_cred_secret not in repr(swift_server)
    assert Path(swift_server.data_dir, "pids").exists()


def test_swift_put_get_list(swift_server: SwiftEndpoint, swift_container: str) -> None:
    conn = swift_server.swift_connection()
    conn.put_object(swift_container, "dir/a.bin", PAYLOAD)
    headers, body = conn.get_object(swift_container, "dir/a.bin")
    assert body == PAYLOAD
    _, part = conn.get_object(swift_container, "dir/a.bin", headers={"Range": "bytes=1000-1999"})
    assert part == PAYLOAD[1000:2000]
    _, listing = conn.get_container(swift_container, prefix="dir/")
    assert [o["name"] for o in listing] == ["dir/a.bin"]
    assert conn.get_capabilities()["swift"]["container_listing_limit"] == swift_server.listing_limit


def test_s3_put_get_list_delete(swift_server: SwiftEndpoint, s3_bucket: str) -> None:
    s3 = swift_server.s3_client()
    s3.put_object(Bucket=s3_bucket, Key="x/y.bin", Body=PAYLOAD)
    assert s3.get_object(Bucket=s3_bucket, Key="x/y.bin")["Body"].read() == PAYLOAD
    ranged = s3.get_object(Bucket=s3_bucket, Key="x/y.bin", Range="bytes=-100")["Body"].read()
    assert ranged == PAYLOAD[-100:]
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket).get("Contents", [])]
    assert keys == ["x/y.bin"]
    s3.delete_objects(Bucket=s3_bucket, Delete={"Objects": [{"Key": "x/y.bin"}]})
    assert s3.list_objects_v2(Bucket=s3_bucket)["KeyCount"] == 0


def test_s3_sees_swift_objects(swift_server: SwiftEndpoint, swift_container: str) -> None:
    swift_server.swift_connection().put_object(swift_container, "shared", b"one store, two APIs")
    body = swift_server.s3_client().get_object(Bucket=swift_container, Key="shared")["Body"].read()
    assert body == b"one store, two APIs"


def test_keystone_app_credential_session(swift_server: SwiftEndpoint, swift_container: str) -> None:
    """keystoneauth1 session → swiftclient (what a client with only keystoneauth1 does)."""
    import swiftclient
    from keystoneauth1 import exceptions as ks_exceptions
    from keystoneauth1 import session
    from keystoneauth1.identity import v3

    auth = v3.ApplicationCredential(
        auth_url=swift_server.keystone_url,
        application_credential_id=swift_server.app_cred_id,
        application_credential_secret=swift_server.app_cred_secret,
    )
    conn = swiftclient.Connection(session=session.Session(auth=auth))
    conn.put_object(swift_container, "via-keystone", b"token from the stand-in")
    assert conn.get_object(swift_container, "via-keystone")[1] == b"token from the stand-in"
    assert conn.url == swift_server.storage_url

    wrong = v3.ApplicationCredential(
        auth_url=swift_server.keystone_url,
        application_credential_id=swift_server.app_cred_id,
        application_credential_secret="wrong",
    )
    with pytest.raises(ks_exceptions.Unauthorized):
        session.Session(auth=wrong).get_token()


def test_keystone_app_credential_os_options(swift_server: SwiftEndpoint, swift_container: str) -> None:
    """swiftclient's own Keystone v3 path (auth_version='3'); it needs python-keystoneclient."""
    pytest.importorskip("keystoneclient.v3", reason="swiftclient's auth_version='3' needs python-keystoneclient")
    import swiftclient

    def connect(secret: str) -> swiftclient.Connection:
        options = {
            "auth_type": "v3applicationcredential",
            "application_credential_id": swift_server.app_cred_id,
            "application_credential_secret": secret,
        }
        return swiftclient.Connection(
            authurl=swift_server.keystone_url, auth_version="3", os_options=options, retries=0
        )

    conn = connect(swift_server.app_cred_secret)
    conn.put_object(swift_container, "via-os-options", b"v3")
    assert conn.get_object(swift_container, "via-os-options")[1] == b"v3"
    with pytest.raises(ClientException, match="Unauthorized"):
        connect("wrong").head_account()


def test_keystone_password_and_discovery(swift_server: SwiftEndpoint) -> None:
    keystone = _load_tool("keystone_standin")
    port = _port(swift_server.keystone_url)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/v3")
    assert json.loads(conn.getresponse().read())["version"]["status"] == "stable"

    def login(password: str) -> http.client.HTTPResponse:
        body = {
            "auth": {
                "identity": {
                    "methods": ["password"],
                    "password": {"user": {"name": "tester", "domain": {"name": "Default"}, "password": password}},
                },
                "scope": {"project": {"name": "test", "domain": {"name": "Default"}}},
            }
        }
        conn.request("POST", "/v3/auth/tokens", body=json.dumps(body), headers={"Content-Type": "application/json"})
        return conn.getresponse()

    ok = login("testing")
    catalog = json.loads(ok.read())["token"]["catalog"]
    assert ok.status == 201 and ok.getheader("X-Subject-Token")
    urls = {e["interface"]: e["url"] for e in catalog[0]["endpoints"] if e["region"] == keystone.REGION}
    assert urls == dict.fromkeys(("public", "internal", "admin"), swift_server.storage_url)
    bad = login("wrong")
    bad.read()
    assert bad.status == 401


def _app_cred_request(app_id: str, secret: str) -> dict:
    identity = {"methods": ["application_credential"], "application_credential": {"id": app_id, "secret": secret}}
    return {"auth": {"identity": identity}}


def test_the_servers_keys_are_on_no_command_line_and_in_no_file_others_read(swift_server: SwiftEndpoint) -> None:
    """Every local user reads a process's command line (`ps`): the Keystone stand-in's users'
    keys and its application credential's secret were on its own. They come from a file now,
    which only this user reads, as env.sh is."""
    data_dir = Path(swift_server.data_dir)
    pid = json.loads((data_dir / "pids").read_text())["keystone"]["pid"]
    command = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
    assert "keystone_standin.py" in command
    for secret in (swift_server.app_cred_secret, f"{swift_server.user}:{swift_server.key}"):
        assert secret not in command
    for name in ("env.sh", "keystone-credentials.json"):
        assert (data_dir / name).stat().st_mode & 0o077 == 0, name


def test_keystone_standin_in_process(swift_server: SwiftEndpoint) -> None:
    keystone = _load_tool("keystone_standin")
    users = {swift_server.user: swift_server.key}
    with keystone.KeystoneStandin(swift_server.auth_url, users, {"cred": ("s3cret", swift_server.user)}) as ks:
        _, body = ks.issue_token(_app_cred_request("cred", "s3cret"))
        assert body["token"]["catalog"][0]["endpoints"][0]["url"] == swift_server.storage_url
        assert ks.url.endswith("/v3")
        with pytest.raises(keystone.AuthFailed):
            ks.issue_token(_app_cred_request("cred", "no"))


# ----------------------------------------------------------------------------- TcpProxy


def _raw_get(port: int, path: str, token: str) -> bytes:
    """Send one GET with Connection: close and return every byte the server sent until EOF."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Auth-Token: {token}\r\nConnection: close\r\n\r\n".encode())
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
    return b"".join(chunks)


def test_tcp_proxy_forwards_and_counts(swift_server: SwiftEndpoint, swift_container: str) -> None:
    token = _token(swift_server)
    with TcpProxy(_port(swift_server.storage_url)) as proxy:
        url = swift_server.storage_url.replace(str(_port(swift_server.storage_url)), str(proxy.port))
        conn = swift_server.swift_connection(preauthurl=url, preauthtoken=token)
        # A chunked upload (generator body) and a Content-Length upload on one keep-alive connection.
        conn.put_object(swift_container, "chunked", (PAYLOAD[i : i + 7000] for i in range(0, len(PAYLOAD), 7000)))
        conn.put_object(swift_container, "sized", PAYLOAD)
        assert conn.get_object(swift_container, "chunked")[1] == PAYLOAD
        assert conn.get_object(swift_container, "sized")[1] == PAYLOAD
        assert proxy.requests == 4
        assert proxy.connections == 1
        assert proxy.bytes_to_server > 2 * len(PAYLOAD) and proxy.bytes_to_client > 2 * len(PAYLOAD)


def test_tcp_proxy_drop_after_bytes(swift_server: SwiftEndpoint, swift_container: str) -> None:
    token = _token(swift_server)
    swift_server.swift_connection().put_object(swift_container, "obj", PAYLOAD)
    path = urllib.parse.urlsplit(swift_server.storage_url).path + f"/{swift_container}/obj"
    with TcpProxy(_port(swift_server.storage_url)) as proxy:
        proxy.drop_after_bytes(1000)
        assert len(_raw_get(proxy.port, path, token)) == 1000  # cut: status line, headers, part of the body
        whole = _raw_get(proxy.port, path, token)  # used up: the next response is whole
        assert whole.endswith(PAYLOAD)

        # A streaming swiftclient GET notices the short body and resumes with a Range request.
        # (A whole-body get_object without resp_chunk_size raises instead: it does not retry a short read.)
        proxy.drop_after_bytes(5000)
        url = swift_server.storage_url.replace(str(_port(swift_server.storage_url)), str(proxy.port))
        conn = swift_server.swift_connection(preauthurl=url, preauthtoken=token, retries=2, starting_backoff=0.01)
        before = proxy.requests
        _, body = conn.get_object(swift_container, "obj", resp_chunk_size=16384)
        assert b"".join(body) == PAYLOAD
        assert proxy.requests - before == 2


def test_tcp_proxy_reset_and_stall(swift_server: SwiftEndpoint) -> None:
    path = "/healthcheck"
    with TcpProxy(_port(swift_server.storage_url)) as proxy:
        proxy.reset_next()
        with pytest.raises(ConnectionError):
            _raw_get(proxy.port, path, "")
        assert _raw_get(proxy.port, path, "").endswith(b"OK")

        proxy.stall_next(1.0)
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=0.3)
        conn.request("GET", path)
        with pytest.raises(TimeoutError):
            conn.getresponse()
        conn.close()
        assert _raw_get(proxy.port, path, "").endswith(b"OK")
        assert proxy.requests == 4

        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
        conn.request("GET", path)
        conn.getresponse().read()
        proxy.close_all()
        with pytest.raises(ConnectionError):  # reset, or RemoteDisconnected (a ConnectionResetError too)
            conn.request("GET", path)
            conn.getresponse()


def test_pid_records_are_checked(swift_server: SwiftEndpoint) -> None:
    tool = _load_tool("swift_server")
    pids = tool.read_pids(Path(swift_server.data_dir))
    assert {"memcached", "keystone", "account", "container", "object", "proxy"} <= set(pids)
    assert all(tool.is_ours(entry) for entry in pids.values())
    proxy = pids["proxy"]
    assert not tool.is_ours({**proxy, "start": proxy["start"] + 1})  # a reused PID is not ours
    assert not tool.is_ours({**proxy, "markers": ["/elsewhere/launch.py"]})
