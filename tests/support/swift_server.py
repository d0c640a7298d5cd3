#!/usr/bin/env python3
"""A real OpenStack Swift (Swift API + S3 API) on 127.0.0.1, for tests and local trials.

Everything lives in one data directory: configs, single-replica rings, the object data,
the logs, the PIDs and an ``env.sh`` with the credentials. Nothing is written outside it.
The servers listen on free loopback ports only. It imports only the standard library, so it
runs by path too, as it starts its own watchdog and ``keystone_standin.py``.

Subcommands::

    install [--flavor pypi|debian]   # pypi: swift==2.38.3 in a venv; debian: Debian's swift packages.
                                     # Both: Debian's memcached. Idempotent, fast when already there.
    start   [--data-dir DIR] [--flavor pypi|debian] [--listing-limit N] [--env-file FILE] ...
    stop    [--data-dir DIR]         # kills only the processes it started (checked via /proc)
    status  [--data-dir DIR]         # exit 0 when everything runs

``start`` brings up memcached, the account, container, object and proxy servers
(pipeline with tempauth and s3api) and a Keystone v3 stand-in
(``keystone_standin.py``), waits until all of them answer, then prints
``export`` lines on stdout and writes the same to ``DATA_DIR/env.sh``:

    ST_AUTH ST_USER ST_KEY                      Swift v1 auth (tempauth user test:tester)
    AWS_ENDPOINT_URL AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_DEFAULT_REGION   S3 API (s3api)
    KS_AUTH_URL KS_APP_CRED_ID KS_APP_CRED_SECRET    Keystone v3 stand-in (KS_*, not OS_*: the
                                                swift CLI mixes OS_* with ST_* and then fails)
    DLSTORE_SWIFT_DIR DLSTORE_SWIFT_STORAGE_URL  the data directory; the account's storage URL

A second tempauth account, ``test2:tester2`` / ``testing2``, is there for ACL and
wrong-account tests.

``start`` on a data dir whose server runs prints its ``env.sh`` and exits 0, so it is
idempotent; a server that runs only in part is refused until ``stop``. A failed start
prints each log's last lines and stops what it started.

Example::

    python -m tests.support.swift_server install
    eval "$(python -m tests.support.swift_server start)"
    swift upload mycontainer README.md && aws s3 ls s3://mycontainer
    python -m tests.support.swift_server stop

Environment: ``DLSTORE_SWIFT_VENV`` (default ``~/.cache/dlstore/swift-venv``),
``DLSTORE_SWIFT_DIR`` (default ``~/.cache/dlstore/swift-data``) and
``DLSTORE_SWIFT_FLAVOR`` (default ``pypi``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import http.client
import json
import os
import pwd
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

SWIFT_VERSION = "2.38.3"
DEBIAN_SWIFT_PACKAGES = ["swift", "swift-proxy", "swift-account", "swift-container", "swift-object"]
DEBIAN_PYTHON = "/usr/bin/python3"
SERVERS = ("account", "container", "object", "proxy")
USERS = {"test:tester": "testing", "test2:tester2": "testing2"}  # tempauth; test:tester is .admin of test
MAIN_USER = "test:tester"
REGION = "us-east-1"

# Run by the Swift interpreter (venv or Debian's python3), one process per server.
# Swift reads swift.conf from a hard-coded path; set_swift_dir() moves it into the
# data dir, and the reloads make the constraints and storage policies follow.
LAUNCHER = '''\
"""Start one Swift server with all its config inside the data dir (written by swift_server.py)."""
import logging.handlers
import os
import sys

data_dir, server = sys.argv[1], sys.argv[2]
etc = os.path.join(data_dir, "etc")
# No syslog: with /dev/log absent Swift would send UDP to 127.0.0.1:514, with it present it
# would fill the host's system log. verbose=True below logs to stderr = DATA_DIR/log/<server>.log.
logging.handlers.SysLogHandler.emit = lambda self, record: None

from swift.common import utils  # noqa: E402

utils.set_swift_dir(etc)
from swift.common import constraints, storage_policy  # noqa: E402

constraints.reload_constraints()
storage_policy.reload_storage_policies()
from swift.common.wsgi import run_wsgi  # noqa: E402

sys.exit(run_wsgi(os.path.join(etc, server + "-server.conf"), server + "-server", verbose=True))
'''

RING_BUILDER = """\
import sys
from swift.common.ring import RingBuilder

etc = sys.argv[1]
for name, port in zip(("account", "container", "object"), sys.argv[2:5]):
    builder = RingBuilder(6, 1, 0)  # part power 6, 1 replica, min_part_hours 0
    builder.add_dev({"id": 0, "region": 1, "zone": 1, "ip": "127.0.0.1", "port": int(port),
                     "device": "d1", "weight": 100.0, "meta": ""})
    builder.rebalance(seed=1)
    builder.get_ring().save("%s/%s.ring.gz" % (etc, name))
"""

PROXY_PIPELINE = (
    "catch_errors gatekeeper healthcheck proxy-logging cache listing_formats bulk s3api tempauth "
    "copy slo dlo versioned_writes symlink proxy-logging proxy-server"
)


class StartError(Exception):
    """start failed; the message says why."""


def log(msg: str) -> None:
    print(f"swift_server: {msg}", file=sys.stderr, flush=True)


def default_venv() -> Path:
    return Path(os.environ.get("DLSTORE_SWIFT_VENV") or Path.home() / ".cache/dlstore/swift-venv")


def default_data_dir() -> Path:
    return Path(os.environ.get("DLSTORE_SWIFT_DIR") or Path.home() / ".cache/dlstore/swift-data")


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive flock, so two installs (or two starts of one data dir) do not interleave."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------- install


def _as_root(cmd: list[str]) -> list[str]:
    if os.geteuid() == 0:
        return cmd
    if shutil.which("sudo"):
        return ["sudo", "-n", *cmd]
    raise SystemExit(f"swift_server: {cmd[0]} needs root and there is no sudo")


def _dpkg_installed(pkg: str) -> bool:
    if not shutil.which("dpkg-query"):
        return False
    out = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True)
    return out.returncode == 0 and out.stdout.strip().endswith(" installed")


def apt_install(packages: list[str]) -> None:
    """Install the Debian packages not yet installed; `apt-get update` once if one is unknown."""
    missing = [p for p in packages if not _dpkg_installed(p)]
    if not missing:
        return
    if not shutil.which("apt-get"):
        raise SystemExit(f"swift_server: need Debian packages {missing} but there is no apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    lock_wait = ["-o", "DPkg::Lock::Timeout=300"]  # wait for another apt/dpkg run instead of failing
    unknown = [p for p in missing if subprocess.run(["apt-cache", "show", p], capture_output=True).returncode != 0]
    updated = False
    if unknown:
        log(f"apt-get update (no package list for {unknown})")
        subprocess.run(_as_root(["apt-get", *lock_wait, "update", "-qq"]), env=env, check=True)
        updated = True
    install = _as_root(["apt-get", *lock_wait, "install", "-y", "-qq", "--no-install-recommends", *missing])
    log(f"apt-get install {' '.join(missing)}")
    if subprocess.run(install, env=env).returncode != 0:
        if updated:
            raise SystemExit(f"swift_server: apt-get install {missing} failed")
        subprocess.run(_as_root(["apt-get", *lock_wait, "update", "-qq"]), env=env, check=True)
        subprocess.run(install, env=env, check=True)


def venv_swift_version(venv: Path) -> str | None:
    if not (venv / "bin" / "python").exists():
        return None
    found = glob.glob(str(venv / "lib" / "python3*" / "site-packages" / "swift-*.dist-info"))
    return Path(found[0]).name[len("swift-") : -len(".dist-info")] if found else None


def memcached_binary() -> str | None:
    return shutil.which("memcached") or next(
        (p for p in ("/usr/bin/memcached", "/usr/sbin/memcached") if os.access(p, os.X_OK)), None
    )


def install(flavor: str, venv: Path, python: str) -> None:
    t0 = time.monotonic()
    if flavor == "pypi":
        with file_lock(venv.with_name(venv.name + ".lock")):
            if venv_swift_version(venv) != SWIFT_VERSION:
                if not (venv / "bin" / "python").exists():
                    shutil.rmtree(venv, ignore_errors=True)  # a venv whose interpreter is gone
                    log(f"creating venv {venv}")
                    subprocess.run([python, "-m", "venv", str(venv)], check=True)
                log(f"pip install swift=={SWIFT_VERSION}")
                subprocess.run(
                    [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"swift=={SWIFT_VERSION}"],
                    check=True,
                )
    else:
        apt_install(DEBIAN_SWIFT_PACKAGES)
    if memcached_binary() is None:
        apt_install(["memcached"])
    log(f"install ({flavor}) done in {time.monotonic() - t0:.1f} s")


def swift_python(flavor: str, venv: Path) -> str:
    """The interpreter that runs the servers; raise StartError when Swift is not installed."""
    if flavor == "pypi":
        if venv_swift_version(venv) is None:
            raise StartError(f"Swift is not installed in {venv}: run `swift_server.py install` first")
        return str(venv / "bin" / "python")
    if not _dpkg_installed("python3-swift"):
        raise StartError("Debian's swift is not installed: run `swift_server.py install --flavor debian` first")
    return DEBIAN_PYTHON


# ---------------------------------------------------------------------------- processes


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) of a process, or None if there is none."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def is_ours(entry: dict) -> bool:
    """True when the recorded process still runs and is the one we started (not a reused PID)."""
    stat = proc_stat(entry["pid"])
    if stat is None or stat[0] in ("Z", "X") or stat[1] != entry["start"]:
        return False
    cmdline = _cmdline(entry["pid"])
    return all(marker in cmdline for marker in entry["markers"])


def read_pids(data_dir: Path) -> dict[str, dict]:
    try:
        return json.loads((data_dir / "pids").read_text())
    except (OSError, ValueError):
        return {}


def write_pids(data_dir: Path, pids: dict[str, dict]) -> None:
    tmp = data_dir / "pids.tmp"
    tmp.write_text(json.dumps(pids, indent=1))
    os.replace(tmp, data_dir / "pids")


def spawn(
    name: str, cmd: list[str], data_dir: Path, markers: list[str], pids: dict[str, dict], env: dict | None = None
) -> subprocess.Popen:
    """Start a process in its own session with its output in DATA_DIR/log/NAME.log, and record it.

    Its own session matters: a Swift server's SIGTERM handler signals its whole process
    group, which would otherwise include us (and pytest, or the CI step). Only the log
    file is inherited (close_fds), so a `$(...)` around us sees EOF as soon as we exit.
    """
    with open(data_dir / "log" / f"{name}.log", "ab") as logf:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            cwd=data_dir,
            env=env,
            start_new_session=True,
        )
    stat = proc_stat(proc.pid)
    pids[name] = {"pid": proc.pid, "start": stat[1] if stat else 0, "markers": markers}
    write_pids(data_dir, pids)
    return proc


def kill_recorded(pids: dict[str, dict], timeout: float = 10.0, spare: int | None = None) -> list[str]:
    """SIGTERM (then SIGKILL) the process groups of the recorded processes that are still ours."""
    live = {name: e for name, e in pids.items() if e["pid"] != spare and is_ours(e)}
    for entry in live.values():
        _signal_group(entry["pid"], signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(is_ours(e) for e in live.values()):
        time.sleep(0.05)
    for entry in live.values():
        if is_ours(entry):
            _signal_group(entry["pid"], signal.SIGKILL)
    return sorted(live)


def _signal_group(pid: int, sig: int) -> None:
    # Each process leads its own session and group (start_new_session), so the group also
    # holds a server's forked workers; fall back to the single PID if that is not so.
    with contextlib.suppress(ProcessLookupError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


# ---------------------------------------------------------------------------- configs


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def probe_xattrs(directory: Path) -> None:
    probe = directory / ".xattr-probe"
    probe.write_bytes(b"")
    try:
        os.setxattr(probe, "user.dlstore.probe", b"1")
    except OSError as exc:
        raise StartError(
            f"{directory} does not support user xattrs ({exc.strerror}), which Swift's object server needs: "
            "use a --data-dir on ext4, xfs or btrfs (tmpfs needs Linux >= 6.6)"
        ) from None
    finally:
        probe.unlink()


def write_configs(
    data_dir: Path, ports: dict[str, int], listing_limit: int, workers: int, auth: dict[str, str] | None = None
) -> None:
    """The configs of the four servers, the proxy's pipeline with tempauth and s3api.

    `auth` (filter name -> its section's lines, `use` included) replaces those two, in order:
    ``keystone_server.py`` passes Keystone's ``authtoken`` and ``keystoneauth`` so.
    """
    etc, srv, run = data_dir / "etc", data_dir / "srv", data_dir / "run"
    user = pwd.getpwuid(os.geteuid()).pw_name  # Swift defaults to user "swift", which may not exist
    (etc / "swift.conf").write_text(
        "[swift-hash]\nswift_hash_path_prefix = dlstore-local\nswift_hash_path_suffix = dlstore-local\n\n"
        "[storage-policy:0]\nname = Policy-0\ndefault = yes\n\n"
        f"[swift-constraints]\ncontainer_listing_limit = {listing_limit}\naccount_listing_limit = {listing_limit}\n"
    )
    common = (
        f"[DEFAULT]\nbind_ip = 127.0.0.1\nworkers = {workers}\nuser = {user}\nswift_dir = {etc}\n"
        f"devices = {srv}\nmount_check = false\ndisable_fallocate = true\nrecon_cache_path = {run}\n"
        # A port taken between free_ports() and the bind fails fast (default: retry for 30 s).
        "bind_timeout = 2\n"
        "log_level = INFO\n"
    )
    for server in ("account", "container", "object"):
        (etc / f"{server}-server.conf").write_text(
            f"{common}bind_port = {ports[server]}\nlog_name = {server}-server\n\n"
            f"[pipeline:main]\npipeline = healthcheck {server}-server\n\n"
            f"[app:{server}-server]\nuse = egg:swift#{server}\n\n"
            "[filter:healthcheck]\nuse = egg:swift#healthcheck\n"
        )
    users = "".join(
        f"user_{name.replace(':', '_')} = {key} .admin\n" for name, key in USERS.items()
    )  # tempauth: user_<account>_<user> = <key> [groups]
    filters = {
        "catch_errors": "",
        "gatekeeper": "",
        "healthcheck": "",
        "proxy-logging": "",
        "cache": f"memcache_servers = 127.0.0.1:{ports['memcached']}\n",
        "listing_formats": "",
        "bulk": "",
        # s3api asks Swift for max-keys + 1 names, and Swift answers 412 above its listing limit.
        "s3api": f"location = {REGION}\nmax_bucket_listing = {min(1000, max(1, listing_limit - 1))}\n",
        "tempauth": users,
        "copy": "",
        "slo": "",
        "dlo": "",
        "versioned_writes": "allow_versioned_writes = true\n",
        "symlink": "",
    }
    egg = {"cache": "memcache", "proxy-logging": "proxy_logging"}
    pipeline = PROXY_PIPELINE
    if auth is not None:  # s3api would need s3token before authtoken, and EC2 credentials
        del filters["s3api"], filters["tempauth"]
        pipeline = pipeline.replace("s3api tempauth", " ".join(auth))
    sections = "".join(
        f"[filter:{name}]\nuse = egg:swift#{egg.get(name, name)}\n{extra}\n" for name, extra in filters.items()
    )
    sections += "".join(f"[filter:{name}]\n{lines}\n" for name, lines in (auth or {}).items())
    (etc / "proxy-server.conf").write_text(
        f"{common}bind_port = {ports['proxy']}\nlog_name = proxy-server\n\n"
        f"[pipeline:main]\npipeline = {pipeline}\n\n"
        # account_autocreate: without it the first container PUT of a new account gets a 404
        "[app:proxy-server]\nuse = egg:swift#proxy\naccount_autocreate = true\n\n"
        f"{sections}"
    )
    (data_dir / "bin" / "launch.py").write_text(LAUNCHER)


def env_lines(env: dict[str, str]) -> str:
    return "".join(f"export {name}={shlex.quote(value)}\n" for name, value in env.items())


def read_env_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """Parse the ``export NAME=value`` lines `env_lines` wrote (an env.sh of `start`)."""
    env = {}
    for line in Path(path).read_text().splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0] == "export":
            words = words[1:]
        for word in words:
            name, sep, value = word.partition("=")
            if sep:
                env[name] = value
    return env


# ---------------------------------------------------------------------------- health


def http_status(port: int, method: str, path: str, headers: dict[str, str] | None = None, timeout: float = 2.0):
    """(status, headers) of one request to 127.0.0.1:port, or None if it could not be made."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        resp.read()
        return resp.status, resp.headers
    except OSError:
        return None
    finally:
        conn.close()


def wait_healthy(ports: dict[str, int], procs: dict[str, subprocess.Popen], timeout: float) -> str:
    """Wait until every server answers and tempauth works; return the storage URL."""
    deadline = time.monotonic() + timeout
    pending = {name: ports[name] for name in SERVERS}
    while True:
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise StartError(f"{name} exited with status {proc.returncode}")
        for name, port in list(pending.items()):
            answer = http_status(port, "GET", "/healthcheck", timeout=1.0)
            if answer and answer[0] == 200:
                del pending[name]
        if not pending:
            storage_url = _auth_ready(ports)
            if storage_url and _keystone_ready(ports["keystone"]):
                return storage_url
        if time.monotonic() > deadline:
            waiting = ", ".join(pending) or "tempauth login / account HEAD / keystone"
            raise StartError(f"not healthy after {timeout:.0f} s (waiting for {waiting})")
        time.sleep(0.05)


def _auth_ready(ports: dict[str, int]) -> str | None:
    """Log in with tempauth (this exercises memcached) and HEAD the account; return the storage URL."""
    answer = http_status(
        ports["proxy"], "GET", "/auth/v1.0", {"X-Auth-User": MAIN_USER, "X-Auth-Key": USERS[MAIN_USER]}
    )
    if not answer or answer[0] != 200:
        return None
    storage_url, token = answer[1].get("X-Storage-Url"), answer[1].get("X-Auth-Token")
    path = "/" + storage_url.split("/", 3)[3]
    head = http_status(ports["proxy"], "HEAD", path, {"X-Auth-Token": token})
    return storage_url if head and head[0] // 100 == 2 else None


def _keystone_ready(port: int) -> bool:
    answer = http_status(port, "GET", "/v3", timeout=1.0)
    return bool(answer and answer[0] == 200)


def _lost_port_race(data_dir: Path) -> bool:
    """True when a server failed because its free port was taken before it could bind it."""
    return any(
        marker in logfile.read_text(errors="replace")
        for logfile in (data_dir / "log").glob("*.log")
        for marker in ("Address already in use", "Could not bind to")
    )


def dump_logs(data_dir: Path, lines: int = 15) -> None:
    for logfile in sorted((data_dir / "log").glob("*.log")):
        tail = logfile.read_text(errors="replace").splitlines()[-lines:]
        print(f"----- {logfile} (last {len(tail)} lines)", file=sys.stderr)
        for line in tail:
            print(f"  {line}", file=sys.stderr)


# ---------------------------------------------------------------------------- start / stop


def running_state(data_dir: Path) -> tuple[list[str], list[str]]:
    """(names running, names recorded but gone) for DATA_DIR's pid file."""
    pids = read_pids(data_dir)
    alive = [name for name, e in pids.items() if is_ours(e)]
    return alive, [name for name in pids if name not in alive]


def start(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir).resolve()

    def copy(text: str) -> None:
        if args.env_file:  # the caller's file, written where and as it is
            Path(args.env_file).write_text(text)

    return start_in(
        data_dir,
        "swift_server.py",
        lambda pids: _start_servers(args, data_dir, pids),
        lambda env: _write_private(data_dir / "env.sh", env_lines(env)),
        copy,
    )


def start_in(
    data_dir: Path,
    tool: str,
    start_servers: Callable[[dict[str, dict]], dict[str, str]],
    write_env: Callable[[dict[str, str]], None],
    copy: Callable[[str], None] = lambda text: None,
) -> int:
    """`tool start` in `data_dir`, under its lock, and its exit status. A set already running
    prints its env.sh. Else `start_servers(pids)` starts every server, recording each in
    `pids`, and once more after a lost port race; `write_env(env)` writes env.sh and the rest.
    `copy(text)` gets env.sh's text either way, which is then printed."""
    t0 = time.monotonic()
    data_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(data_dir / ".lock"):
        alive, gone = running_state(data_dir)
        if alive:
            env_file = data_dir / "env.sh"
            if not gone and env_file.exists():
                log(f"already running in {data_dir}; printing its env (stop it with `{tool} stop`)")
                text = env_file.read_text()
                copy(text)
                sys.stdout.write(text)
                return 0
            log(f"{data_dir} is partly running ({', '.join(alive)} up, {', '.join(gone)} gone): run stop first")
            return 1
        for attempt in (1, 2):
            pids: dict[str, dict] = {}
            try:
                env = start_servers(pids)
                break
            except (StartError, OSError, subprocess.CalledProcessError) as exc:
                kill_recorded(pids)
                (data_dir / "pids").unlink(missing_ok=True)
                if attempt == 1 and _lost_port_race(data_dir):
                    log("a port was taken between choosing and binding it; trying again with new ports")
                    continue
                log(f"start failed: {exc}")
                dump_logs(data_dir)
                return 1
        write_env(env)
        text = (data_dir / "env.sh").read_text()
        copy(text)
    sys.stdout.write(text)
    log(f"started in {time.monotonic() - t0:.1f} s; env in {data_dir / 'env.sh'}")
    return 0


def _write_private(path: Path, text: str) -> None:
    """`text` in a file that only this user reads (it holds keys), made anew."""
    path.unlink(missing_ok=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(text)


def _start_servers(args: argparse.Namespace, data_dir: Path, pids: dict[str, dict]) -> dict[str, str]:
    python = swift_python(args.flavor, Path(args.venv))
    memcached = memcached_binary()
    if memcached is None:
        raise StartError("memcached is not installed: run `swift_server.py install` first")
    if args.fresh:
        for sub in ("srv", "etc", "log", "run"):
            shutil.rmtree(data_dir / sub, ignore_errors=True)
    for sub in ("etc", "srv/d1", "log", "run", "bin"):
        (data_dir / sub).mkdir(parents=True, exist_ok=True)
    for old in (data_dir / "log").glob("*.log"):
        old.unlink()
    (data_dir / "env.sh").unlink(missing_ok=True)
    probe_xattrs(data_dir / "srv" / "d1")
    if args.port and port_taken(args.port):
        raise StartError(f"port {args.port} on 127.0.0.1 is taken")
    names = ("memcached", "account", "container", "object", "proxy", "keystone")
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    if args.port:
        ports["proxy"] = args.port
    write_configs(data_dir, ports, args.listing_limit, args.workers)

    procs: dict[str, subprocess.Popen] = {}
    # memcached refuses to run as root unless told which user to become.
    root = ["-u", "nobody"] if os.geteuid() == 0 else []
    procs["memcached"] = spawn(
        "memcached",
        [memcached, "-l", "127.0.0.1", "-p", str(ports["memcached"]), "-U", "0", "-m", "64", *root],
        data_dir,
        ["memcached", f"-p {ports['memcached']}"],
        pids,
    )
    proxy_url = f"http://127.0.0.1:{ports['proxy']}"
    app_id, app_secret = uuid.uuid4().hex, secrets.token_urlsafe(24)
    # The keys and the secret go in a file only this user reads: a command line is anyone's (ps).
    credentials = {
        "users": [f"{name}:{key}" for name, key in USERS.items()],
        "app_creds": [f"{app_id}:{app_secret}:{MAIN_USER}"],
    }
    credentials_path = data_dir / "keystone-credentials.json"
    _write_private(credentials_path, json.dumps(credentials))
    keystone_cmd = [
        sys.executable,
        str(Path(__file__).with_name("keystone_standin.py")),
        "--port",
        str(ports["keystone"]),
        "--swift-auth-url",
        f"{proxy_url}/auth/v1.0",
        "--credentials",
        str(credentials_path),
        "--tag",
        str(data_dir),
    ]
    procs["keystone"] = spawn("keystone", keystone_cmd, data_dir, ["keystone_standin.py", str(data_dir)], pids)
    # Rings carry the ports, so they are rebuilt on every start (about 0.3 s, one process).
    ring_ports = [str(ports[s]) for s in ("account", "container", "object")]
    subprocess.run([python, "-c", RING_BUILDER, str(data_dir / "etc"), *ring_ports], check=True)
    launcher = str(data_dir / "bin" / "launch.py")
    for server in SERVERS:
        procs[server] = spawn(server, [python, launcher, str(data_dir), server], data_dir, [launcher], pids)
    if args.stop_with_pid:
        watched = proc_stat(args.stop_with_pid)
        watch_cmd = [sys.executable, str(Path(__file__).resolve()), "_watch", "--data-dir", str(data_dir)]
        watch_cmd += ["--pid", str(args.stop_with_pid), "--pid-start", str(watched[1] if watched else 0)]
        procs["watchdog"] = spawn("watchdog", watch_cmd, data_dir, [Path(__file__).name, "_watch", str(data_dir)], pids)

    storage_url = wait_healthy(ports, procs, args.timeout)
    user, key = MAIN_USER, USERS[MAIN_USER]
    return {
        "ST_AUTH": f"{proxy_url}/auth/v1.0",
        "ST_USER": user,
        "ST_KEY": key,
        "AWS_ENDPOINT_URL": proxy_url,
        "AWS_ACCESS_KEY_ID": user,
        "AWS_SECRET_ACCESS_KEY": key,
        "AWS_DEFAULT_REGION": REGION,
        "KS_AUTH_URL": f"http://127.0.0.1:{ports['keystone']}/v3",
        "KS_APP_CRED_ID": app_id,
        "KS_APP_CRED_SECRET": app_secret,
        "DLSTORE_SWIFT_DIR": str(data_dir),
        "DLSTORE_SWIFT_STORAGE_URL": storage_url,
    }


def stop(data_dir: Path, spare: int | None = None) -> int:
    data_dir = data_dir.resolve()
    with file_lock(data_dir / ".lock"):
        pids = read_pids(data_dir)
        stopped = kill_recorded(pids, spare=spare)
        (data_dir / "pids").unlink(missing_ok=True)
        (data_dir / "env.sh").unlink(missing_ok=True)
    log(f"stopped {', '.join(stopped)}" if stopped else f"nothing of ours was running in {data_dir}")
    return 0


def status(data_dir: Path) -> int:
    data_dir = data_dir.resolve()
    pids = read_pids(data_dir)
    if not pids:
        print(f"not running ({data_dir})")
        return 1
    alive, _ = running_state(data_dir)
    for name, entry in pids.items():
        print(f"{name:10s} pid {entry['pid']:<8d} {'running' if name in alive else 'GONE'}")
    print(f"env: {data_dir / 'env.sh'}")
    return 0 if len(alive) == len(pids) else 1


def watch(data_dir: Path, pid: int, pid_start: int, stop_all=None) -> int:
    """Stop DATA_DIR's servers with `stop_all` (default: `stop`) once process PID is gone."""
    stop_all = stop_all or stop
    me = os.getpid()
    while True:
        time.sleep(1.0)
        if not (data_dir / "pids").exists():
            return 0  # stopped by someone else
        stat = proc_stat(pid)
        if stat is None or stat[0] in ("Z", "X") or stat[1] != pid_start:
            return stop_all(data_dir, spare=me)


def add_stop_status_watch(sub: argparse._SubParsersAction, stop_help: str, data_dir: Path) -> None:
    """The `stop`, `status` and internal `_watch` subcommands that every server tool shares."""
    for name, text in (("stop", stop_help), ("status", "show what runs")):
        sub.add_parser(name, help=text).add_argument("--data-dir", default=str(data_dir))
    p_watch = sub.add_parser("_watch")  # internal: the --stop-with-pid watchdog
    p_watch.add_argument("--data-dir", required=True)
    p_watch.add_argument("--pid", type=int, required=True)
    p_watch.add_argument("--pid-start", type=int, required=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{install,start,stop,status}")

    def add_common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--flavor",
            choices=["pypi", "debian"],
            default=os.environ.get("DLSTORE_SWIFT_FLAVOR") or "pypi",
            help=f"pypi: swift=={SWIFT_VERSION} in a venv; debian: Debian's packages (default: $DLSTORE_SWIFT_FLAVOR or pypi)",
        )
        p.add_argument("--venv", default=str(default_venv()), help="venv of the pypi flavor (default: %(default)s)")

    p_install = sub.add_parser("install", help="install Swift and memcached (idempotent)")
    add_common(p_install)
    p_install.add_argument("--python", default=sys.executable, help="interpreter for a new venv")

    p_start = sub.add_parser("start", help="start the servers and print `export` lines")
    add_common(p_start)
    p_start.add_argument("--data-dir", default=str(default_data_dir()))
    p_start.add_argument("--listing-limit", type=int, default=10000, help="Swift's container/account listing limit")
    p_start.add_argument("--env-file", help="also write the export lines here")
    p_start.add_argument("--port", type=int, default=0, help="proxy port (default: a free one)")
    p_start.add_argument("--workers", type=int, default=1, help="worker processes per Swift server")
    p_start.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for health")
    p_start.add_argument("--fresh", action="store_true", help="delete the stored objects and logs first")
    p_start.add_argument("--stop-with-pid", type=int, help="stop the servers when this process exits")

    add_stop_status_watch(sub, "stop the processes that start recorded", default_data_dir())

    args = parser.parse_args(argv)
    if args.command == "install":
        try:
            install(args.flavor, Path(args.venv), args.python)
        except (subprocess.CalledProcessError, OSError) as exc:
            log(f"install ({args.flavor}) failed: {exc}")
            return 1
        return 0
    if args.command == "start":
        return start(args)
    if args.command == "stop":
        return stop(Path(args.data_dir))
    if args.command == "status":
        return status(Path(args.data_dir))
    return watch(Path(args.data_dir), args.pid, args.pid_start)


if __name__ == "__main__":
    sys.exit(main())
