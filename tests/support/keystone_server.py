#!/usr/bin/env python3
"""A real Keystone in front of a real Swift on 127.0.0.1, for tests and local trials.

Debian's Keystone 22 runs on sqlite with fernet tokens. Debian's Swift 2.30 authenticates
through ``authtoken`` and ``keystoneauth`` (keystonemiddleware 10.1), reseller prefix
``AUTH_``, operator roles ``admin`` and ``member``. Everything lives in one data directory,
and every ``start`` makes a fresh cloud there:

* projects ``project-a`` and ``project-b``, each with a user (``user-a``, ``user-b``) holding
  the ``member`` role; ``admin`` of project ``admin``; ``swift``, the proxy's service user.
* object-store endpoints: region ``RegionOne`` public ``http://127.0.0.1:P/v1/AUTH_<project>``
  and internal ``.../v1.0/AUTH_<project>``; ``RegionTwo`` the same through a forwarder's port.
* with ``--short-token-expiration S``, a second Keystone process on the same database and
  keys issues tokens that last S seconds (``KEYSTONE_SHORT_AUTH_URL``), for token-expiry tests.

Subcommands::

    install                      # Debian's python3-keystone, keystonemiddleware, swift, memcached
    start   --data-dir DIR [--token-expiration S] [--short-token-expiration S] ...
    stop    --data-dir DIR       # kills only the processes it started (checked via /proc)
    status  --data-dir DIR

``start`` prints ``export`` lines and writes them to ``DIR/env.sh``: the openrc (``OS_*``) of
``user-a``, and for each user ``U`` of ``A``, ``B`` and ``ADMIN`` the variables
``KEYSTONE_U_USERNAME``, ``_PASSWORD``, ``_PROJECT_NAME``, ``_PROJECT_ID`` and ``_STORAGE_URL``.
``DIR/openrc-a.sh``, ``openrc-b.sh`` and ``openrc-admin.sh`` are each user's openrc.

Keystone is served by the standard library's threaded ``wsgiref``. Debian's uwsgi resets
keep-alive connections on ``--http-socket``, and cheroot or gunicorn would be one more
package; a test server needs neither speed nor TLS. The database runs in sqlite's WAL mode:
in its default journal mode a reading connection blocks writers, and deleting an application
credential fails with "database is locked" (HTTP 500 after 5 s). What ``keystone-manage``
would make is made without it: the fernet and credential keys here, the schema and the
bootstrap inside the serving process, so Keystone is imported once. bcrypt runs 4 rounds, so
logins are quick. Only ``python3-keystone`` is installed: the ``keystone`` package adds its service's
set-up (dbconfig-common, an init script), which a test server does not need.

Example::

    python -m tests.support.keystone_server install
    python -m tests.support.keystone_server start --data-dir /tmp/ks
    . /tmp/ks/openrc-a.sh && python -m dlstore ls swift://mycontainer
    python -m tests.support.keystone_server stop --data-dir /tmp/ks
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.support import env_with_repo
from tests.support.swift_server import (
    DEBIAN_PYTHON,
    DEBIAN_SWIFT_PACKAGES,
    RING_BUILDER,
    SERVERS,
    StartError,
    add_stop_status_watch,
    apt_install,
    env_lines,
    file_lock,
    free_ports,
    http_status,
    kill_recorded,
    memcached_binary,
    probe_xattrs,
    proc_stat,
    read_env_file,
    read_pids,
    spawn,
    start_in,
    status,
    watch,
    write_configs,
)

__all__ = ["KEYSTONE_PACKAGES", "USERS", "install", "main", "openrc", "read_env_file"]

KEYSTONE_PACKAGES = ["python3-keystone", "python3-keystonemiddleware"]
#: The users of a fresh cloud: env name -> (user, project, role).
USERS = {
    "A": ("user-a", "project-a", "member"),
    "B": ("user-b", "project-b", "member"),
    "ADMIN": ("admin", "admin", "admin"),
}
SERVICE_USER = ("swift", "service", "service")
REGIONS = ("RegionOne", "RegionTwo")
ROLES = ("admin", "member", "reader", "service")

# Run by Debian's python3: Keystone's public app, and the cloud's setup when a spec is there.
# Setup runs after the app is made, in the same process: Keystone is imported once.
KEYSTONE_APP = '''\
"""Keystone's public WSGI app on 127.0.0.1:PORT; written by keystone_server.py."""
import json
import os
import socketserver
import sqlite3
import sys
import uuid
from wsgiref import simple_server

data_dir, conf, port, set_up_first = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:] == ["--set-up"]
del sys.argv[1:]  # oslo.config parses the command line
os.environ["OS_KEYSTONE_CONFIG_FILES"] = conf
from keystone.server.wsgi import initialize_public_application  # noqa: E402

app = initialize_public_application()


def set_up(spec):
    """The schema, then the domain, roles, projects, users, regions and catalog of `spec`."""
    from keystone.common import provider_api
    from keystone.common.sql import upgrades

    apis = provider_api.ProviderAPIs
    upgrades.offline_sync_database_to_version()
    with sqlite3.connect(os.path.join(data_dir, "keystone", "keystone.db")) as db:
        db.execute("PRAGMA journal_mode=WAL")  # readers must not block writers
    domain = {"id": "default", "name": "Default", "enabled": True, "description": "The default domain"}
    apis.resource_api.create_domain("default", domain)
    roles = {}
    for name in spec["roles"]:
        role_id = uuid.uuid4().hex
        roles[name] = apis.role_api.create_role(role_id, {"id": role_id, "name": name})["id"]
    for prior, implied in (("admin", "member"), ("member", "reader")):
        apis.role_api.create_implied_role(roles[prior], roles[implied])
    for name, project_id in spec["projects"].items():
        project = {"id": project_id, "name": name, "domain_id": "default", "enabled": True, "description": ""}
        apis.resource_api.create_project(project_id, project)
    for user in spec["users"]:
        project_id = spec["projects"][user["project"]]
        ref = {"name": user["name"], "domain_id": "default", "enabled": True, "password": user["password"],
               "default_project_id": project_id}
        user_id = apis.identity_api.create_user(ref)["id"]
        apis.assignment_api.add_role_to_user_and_project(user_id, project_id, roles[user["role"]])
        if user["role"] == "admin":
            apis.assignment_api.create_system_grant_for_user(user_id, roles["admin"])
    for region in spec["regions"]:
        apis.catalog_api.create_region({"id": region})
    for service in spec["services"]:
        service_id = uuid.uuid4().hex
        ref = {"id": service_id, "type": service["type"], "name": service["name"], "enabled": True}
        apis.catalog_api.create_service(service_id, ref)
        for region, interface, url in service["endpoints"]:
            endpoint_id = uuid.uuid4().hex
            ref = {"id": endpoint_id, "service_id": service_id, "interface": interface, "url": url,
                   "region_id": region, "enabled": True}
            apis.catalog_api.create_endpoint(endpoint_id, ref)


spec_path = os.path.join(data_dir, "keystone", "setup.json")
if set_up_first:
    with open(spec_path) as file:
        set_up(json.load(file))
    os.unlink(spec_path)  # it holds the passwords


class Server(socketserver.ThreadingMixIn, simple_server.WSGIServer):
    daemon_threads = True


server = simple_server.make_server("127.0.0.1", port, app, server_class=Server)
print(f"keystone: serving {conf} on 127.0.0.1:{port}", file=sys.stderr, flush=True)
server.serve_forever()
'''

# A TCP forwarder: RegionTwo's endpoints are another host:port in front of the same proxy.
FORWARDER = '''\
"""Forward 127.0.0.1:LISTEN to 127.0.0.1:TARGET; written by keystone_server.py."""
import asyncio
import sys

listen, target = int(sys.argv[1]), int(sys.argv[2])


async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        pass


async def handle(client_reader, client_writer):
    try:
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target)
    except OSError:
        client_writer.close()
        return
    await asyncio.gather(pipe(client_reader, server_writer), pipe(server_reader, client_writer))
    server_writer.close()
    client_writer.close()


async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    async with server:
        await server.serve_forever()


asyncio.run(main())
'''


def log(msg: str) -> None:
    print(f"keystone_server: {msg}", file=sys.stderr, flush=True)


def install() -> None:
    """Debian's Keystone, keystonemiddleware, Swift and memcached; fast when they are there."""
    t0 = time.monotonic()
    apt_install([*KEYSTONE_PACKAGES, *DEBIAN_SWIFT_PACKAGES])
    if memcached_binary() is None:
        apt_install(["memcached"])
    log(f"install done in {time.monotonic() - t0:.1f} s")


def openrc(env: dict[str, str], user: str = "A", **overrides: str) -> dict[str, str]:
    """The openrc (`OS_*`) of `user` (A, B or ADMIN) from an env.sh's variables.

    >>> env = {"KEYSTONE_AUTH_URL": "http://k/v3", "KEYSTONE_B_USERNAME": "user-b",
    ...        "KEYSTONE_B_PASSWORD": "pw", "KEYSTONE_B_PROJECT_NAME": "project-b"}
    >>> openrc(env, "B", OS_REGION_NAME="RegionTwo")["OS_REGION_NAME"]
    'RegionTwo'
    """
    values = {
        "OS_AUTH_URL": env["KEYSTONE_AUTH_URL"],
        "OS_IDENTITY_API_VERSION": "3",
        "OS_USERNAME": env[f"KEYSTONE_{user}_USERNAME"],
        "OS_PASSWORD": env[f"KEYSTONE_{user}_PASSWORD"],
        "OS_PROJECT_NAME": env[f"KEYSTONE_{user}_PROJECT_NAME"],
        "OS_USER_DOMAIN_NAME": "Default",
        "OS_PROJECT_DOMAIN_NAME": "Default",
        "OS_REGION_NAME": REGIONS[0],
        "OS_INTERFACE": "public",
    }
    return {**values, **overrides}


# ---------------------------------------------------------------------------- configs


def _write_private(path: Path, text: str) -> None:
    """`text` in a file that only this user reads (it holds passwords), made anew."""
    path.unlink(missing_ok=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(text)


def _fernet_keys(directory: Path) -> None:
    """A key repository as `keystone-manage fernet_setup` makes it: a staged key 0 and a primary 1."""
    directory.mkdir(mode=0o700)
    for name in ("0", "1"):
        _write_private(directory / name, base64.urlsafe_b64encode(os.urandom(32)).decode())


def _keystone_conf(ks_dir: Path, expiration: int) -> str:
    return (
        "[DEFAULT]\nuse_stderr = true\n\n"
        # Each request runs in a thread of its own, and a connection may be closed in another.
        f"[database]\nconnection = sqlite:///{ks_dir / 'keystone.db'}?check_same_thread=false\n\n"
        # 4 bcrypt rounds, not 12: each login and each app credential checks a hash.
        "[identity]\npassword_hash_rounds = 4\nmax_password_length = 72\n\n"
        f"[token]\nprovider = fernet\nexpiration = {expiration}\n\n"
        f"[fernet_tokens]\nkey_repository = {ks_dir / 'fernet'}\n\n"
        f"[fernet_receipts]\nkey_repository = {ks_dir / 'fernet'}\n\n"
        f"[credential]\nkey_repository = {ks_dir / 'credential'}\n"
    )


def _auth_filters(ports: dict[str, int], service_password: str) -> dict[str, str]:
    """Swift's `authtoken` and `keystoneauth` sections, for `write_configs(auth=...)`."""
    user, project, _ = SERVICE_USER
    return {
        "authtoken": (
            "paste.filter_factory = keystonemiddleware.auth_token:filter_factory\n"
            f"www_authenticate_uri = http://127.0.0.1:{ports['keystone']}/v3\n"
            f"auth_url = http://127.0.0.1:{ports['keystone']}/v3\n"
            f"interface = public\nauth_type = password\nusername = {user}\npassword = {service_password}\nproject_name = {project}\n"
            "user_domain_id = default\nproject_domain_id = default\n"
            f"memcached_servers = 127.0.0.1:{ports['memcached']}\n"
            # A validation is cached 2 s, not 300: a revoked credential shows within 2 s.
            "token_cache_time = 2\n"
            "delay_auth_decision = true\ninclude_service_catalog = false\nservice_token_roles_required = true\n"
        ),
        "keystoneauth": "use = egg:swift#keystoneauth\nreseller_prefix = AUTH_\noperator_roles = admin, member\n",
    }


def _setup_spec(ports: dict[str, int], passwords: dict[str, str], projects: dict[str, str]) -> dict:
    swift = f"http://127.0.0.1:{ports['proxy']}"
    forwarded = f"http://127.0.0.1:{ports['forwarder']}"
    users = [*USERS.values(), SERVICE_USER]
    store = "AUTH_$(project_id)s"
    return {
        "roles": list(ROLES),
        "projects": projects,
        "users": [
            {"name": name, "project": project, "role": role, "password": passwords[name]}
            for name, project, role in users
        ],
        "regions": list(REGIONS),
        "services": [
            {
                "type": "identity",
                "name": "keystone",
                "endpoints": [[REGIONS[0], "public", f"http://127.0.0.1:{ports['keystone']}/v3"]],
            },
            {
                "type": "object-store",
                "name": "swift",
                "endpoints": [
                    [REGIONS[0], "public", f"{swift}/v1/{store}"],
                    [REGIONS[0], "internal", f"{swift}/v1.0/{store}"],
                    [REGIONS[1], "public", f"{forwarded}/v1/{store}"],
                    [REGIONS[1], "internal", f"{forwarded}/v1.0/{store}"],
                ],
            },
        ],
    }


# ---------------------------------------------------------------------------- health


def _login(port: int, user: str, password: str, project: str) -> str | None:
    """A project-scoped token for `user`, or None while Keystone does not give one."""
    import http.client

    body = {
        "auth": {
            "identity": {
                "methods": ["password"],
                "password": {"user": {"name": user, "domain": {"id": "default"}, "password": password}},
            },
            "scope": {"project": {"name": project, "domain": {"id": "default"}}},
        }
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/v3/auth/tokens", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.getheader("X-Subject-Token") if resp.status == 201 else None
    except OSError:
        return None
    finally:
        conn.close()


def _wait_healthy(ports: dict[str, int], procs: dict, env: dict[str, str], timeout: float) -> None:
    """Every server answers, user A logs in, and the proxy lets that token HEAD A's account."""
    deadline = time.monotonic() + timeout
    pending = {name: ports[name] for name in SERVERS}
    keystones = [name for name in ("keystone", "keystone-short") if name in procs]
    while True:
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise StartError(f"{name} exited with status {proc.returncode}")
        for name, port in list(pending.items()):
            answer = http_status(port, "GET", "/healthcheck", timeout=1.0)
            if answer and answer[0] == 200:
                del pending[name]
        for name in list(keystones):
            answer = http_status(ports[name], "GET", "/v3", timeout=1.0)
            if answer and answer[0] == 200:
                keystones.remove(name)
        if not pending and not keystones and _account_ready(ports, env):
            return
        if time.monotonic() > deadline:
            waiting = ", ".join([*pending, *keystones]) or "a Keystone login and HEAD of the account"
            raise StartError(f"not healthy after {timeout:.0f} s (waiting for {waiting})")
        time.sleep(0.1)


def _account_ready(ports: dict[str, int], env: dict[str, str]) -> bool:
    token = _login(ports["keystone"], env["KEYSTONE_A_USERNAME"], env["KEYSTONE_A_PASSWORD"], "project-a")
    if token is None:
        return False
    path = f"/v1/AUTH_{env['KEYSTONE_A_PROJECT_ID']}"
    for port in (ports["proxy"], ports["forwarder"]):  # RegionOne, RegionTwo
        answer = http_status(port, "HEAD", path, {"X-Auth-Token": token}, timeout=10)
        if not answer or answer[0] // 100 != 2:
            return False
    return True


# ---------------------------------------------------------------------------- start / stop


def start(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir).resolve()
    starting = lambda pids: _start_servers(args, data_dir, pids)  # noqa: E731
    return start_in(data_dir, "keystone_server.py", starting, lambda env: _write_env_files(data_dir, env))


def _write_env_files(data_dir: Path, env: dict[str, str]) -> None:
    for user in USERS:
        _write_private(data_dir / f"openrc-{user.lower()}.sh", env_lines(openrc(env, user)))
    _write_private(data_dir / "env.sh", env_lines({**openrc(env, "A"), **env}))


def _start_servers(args: argparse.Namespace, data_dir: Path, pids: dict[str, dict]) -> dict[str, str]:
    memcached = memcached_binary()
    if memcached is None or not Path("/usr/bin/keystone-manage").exists():
        raise StartError("Keystone, Swift or memcached is not installed: run `keystone_server.py install` first")
    for sub in ("srv", "etc", "log", "run", "bin", "keystone"):
        shutil.rmtree(data_dir / sub, ignore_errors=True)  # every start is a fresh cloud
    for sub in ("etc", "srv/d1", "log", "run", "bin", "keystone"):
        (data_dir / sub).mkdir(parents=True, exist_ok=True)
    for name in ("env.sh", *(f"openrc-{user.lower()}.sh" for user in USERS)):
        (data_dir / name).unlink(missing_ok=True)
    probe_xattrs(data_dir / "srv" / "d1")
    names = ("memcached", "account", "container", "object", "proxy", "keystone", "keystone-short", "forwarder")
    ports = dict(zip(names, free_ports(len(names)), strict=True))

    ks_dir = data_dir / "keystone"
    _fernet_keys(ks_dir / "fernet")
    _fernet_keys(ks_dir / "credential")
    passwords = {name: secrets.token_urlsafe(18) for name, _, _ in [*USERS.values(), SERVICE_USER]}
    projects = {project: uuid.uuid4().hex for _, project, _ in [*USERS.values(), SERVICE_USER]}
    _write_private(ks_dir / "setup.json", json.dumps(_setup_spec(ports, passwords, projects)))
    keystones = {"keystone": args.token_expiration}
    if args.short_token_expiration:
        keystones["keystone-short"] = args.short_token_expiration
    app = data_dir / "bin" / "keystone_app.py"
    app.write_text(KEYSTONE_APP)
    # An openrc in our environment is no business of Keystone's or Swift's.
    clean_env = {name: value for name, value in os.environ.items() if not name.startswith("OS_")}
    procs = {}
    for name, expiration in keystones.items():  # first: they take longest to come up
        conf = data_dir / "etc" / f"{name}.conf"
        conf.write_text(_keystone_conf(ks_dir, expiration))
        cmd = [DEBIAN_PYTHON, str(app), str(data_dir), str(conf), str(ports[name])]
        cmd += ["--set-up"] if name == "keystone" else []  # one sets the database up; both serve it
        procs[name] = spawn(name, cmd, data_dir, [str(app), str(conf)], pids, env=clean_env)

    write_configs(data_dir, ports, args.listing_limit, 1, auth=_auth_filters(ports, passwords[SERVICE_USER[0]]))
    os.chmod(data_dir / "etc" / "proxy-server.conf", 0o600)  # the service user's password
    root = ["-u", "nobody"] if os.geteuid() == 0 else []  # memcached refuses to run as root otherwise
    procs["memcached"] = spawn(
        "memcached",
        [memcached, "-l", "127.0.0.1", "-p", str(ports["memcached"]), "-U", "0", "-m", "64", *root],
        data_dir,
        ["memcached", f"-p {ports['memcached']}"],
        pids,
    )
    ring_ports = [str(ports[s]) for s in ("account", "container", "object")]
    subprocess.run([DEBIAN_PYTHON, "-c", RING_BUILDER, str(data_dir / "etc"), *ring_ports], check=True)
    launcher = str(data_dir / "bin" / "launch.py")
    for server in SERVERS:
        cmd = [DEBIAN_PYTHON, launcher, str(data_dir), server]
        procs[server] = spawn(server, cmd, data_dir, [launcher, str(data_dir)], pids, env=clean_env)
    forwarder = data_dir / "bin" / "forwarder.py"
    forwarder.write_text(FORWARDER)
    cmd = [sys.executable, str(forwarder), str(ports["forwarder"]), str(ports["proxy"])]
    procs["forwarder"] = spawn("forwarder", cmd, data_dir, [str(forwarder)], pids)
    if args.stop_with_pid:
        watched = proc_stat(args.stop_with_pid)
        cmd = [sys.executable, "-m", "tests.support.keystone_server", "_watch", "--data-dir", str(data_dir)]
        cmd += ["--pid", str(args.stop_with_pid), "--pid-start", str(watched[1] if watched else 0)]
        markers = ["tests.support.keystone_server", "_watch", str(data_dir)]
        procs["watchdog"] = spawn("watchdog", cmd, data_dir, markers, pids, env=env_with_repo())

    swift = f"http://127.0.0.1:{ports['proxy']}"
    env = {
        "KEYSTONE_AUTH_URL": f"http://127.0.0.1:{ports['keystone']}/v3",
        "KEYSTONE_TOKEN_EXPIRATION": str(args.token_expiration),
    }
    if args.short_token_expiration:
        env["KEYSTONE_SHORT_AUTH_URL"] = f"http://127.0.0.1:{ports['keystone-short']}/v3"
        env["KEYSTONE_SHORT_TOKEN_EXPIRATION"] = str(args.short_token_expiration)
    for key, (name, project, _) in USERS.items():
        env[f"KEYSTONE_{key}_USERNAME"] = name
        env[f"KEYSTONE_{key}_PASSWORD"] = passwords[name]
        env[f"KEYSTONE_{key}_PROJECT_NAME"] = project
        env[f"KEYSTONE_{key}_PROJECT_ID"] = projects[project]
        env[f"KEYSTONE_{key}_STORAGE_URL"] = f"{swift}/v1/AUTH_{projects[project]}"
    env["KEYSTONE_SWIFT_URL"] = swift
    env["KEYSTONE_REGION_TWO_SWIFT_URL"] = f"http://127.0.0.1:{ports['forwarder']}"
    env["KEYSTONE_DIR"] = str(data_dir)
    _wait_healthy(ports, procs, env, args.timeout)
    return env


def stop(data_dir: Path, spare: int | None = None) -> int:
    data_dir = data_dir.resolve()
    with file_lock(data_dir / ".lock"):
        stopped = kill_recorded(read_pids(data_dir), spare=spare)
        (data_dir / "pids").unlink(missing_ok=True)
        for name in ("env.sh", *(f"openrc-{user.lower()}.sh" for user in USERS)):
            (data_dir / name).unlink(missing_ok=True)
    log(f"stopped {', '.join(stopped)}" if stopped else f"nothing of ours was running in {data_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{install,start,stop,status}")
    sub.add_parser("install", help="install Debian's Keystone, keystonemiddleware, Swift and memcached")
    p_start = sub.add_parser("start", help="start a fresh cloud and print `export` lines")
    p_start.add_argument("--data-dir", required=True)
    p_start.add_argument("--token-expiration", type=int, default=3600, help="seconds a token lasts")
    p_start.add_argument(
        "--short-token-expiration", type=int, default=0, help="also serve tokens of this many seconds (0: no)"
    )
    p_start.add_argument("--listing-limit", type=int, default=10000, help="Swift's container/account listing limit")
    p_start.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for health")
    p_start.add_argument("--stop-with-pid", type=int, help="stop the servers when this process exits")
    add_stop_status_watch(sub, "stop the processes that start recorded", Path("."))
    args = parser.parse_args(argv)
    if args.command == "install":
        try:
            install()
        except (subprocess.CalledProcessError, OSError) as exc:
            log(f"install failed: {exc}")
            return 1
        return 0
    if args.command == "start":
        return start(args)
    if args.command == "stop":
        return stop(Path(args.data_dir))
    if args.command == "status":
        return status(Path(args.data_dir))
    return watch(Path(args.data_dir), args.pid, args.pid_start, stop_all=stop)


if __name__ == "__main__":
    sys.exit(main())
