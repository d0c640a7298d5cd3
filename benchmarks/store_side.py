"""The store side of the cold benchmarks: the local Swift, its WAN emulators, and curl.

On a real node the store runs elsewhere. Here it shares the loader's cores, so its
processes are found, can be kept on cores of their own, and have their CPU counted apart.
Tokens go to curl in a header file of mode 0600, never on a command line.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from urllib.parse import quote, urlsplit

import psutil
import swiftclient

from tests.support.wan_proxy import WanProxyProcess


def swift_port(env: Mapping[str, str]) -> int:
    return urlsplit(env["ST_AUTH"]).port or 80


def proxied(env: Mapping[str, str], wan: WanProxyProcess) -> dict[str, str]:
    """Credentials that reach Swift through `wan`: tempauth hands out the proxy's URL."""
    out = dict(env)
    out["ST_AUTH"] = wan.url + urlsplit(env["ST_AUTH"]).path
    if env.get("AWS_ENDPOINT_URL"):
        out["AWS_ENDPOINT_URL"] = wan.url
    return out


def token_header(env: Mapping[str, str], header_dir: str) -> tuple[str, str, str]:
    """(storage URL, token, header file): a fresh token, and curl's header file holding it."""
    storage_url, token = swiftclient.get_auth(env["ST_AUTH"], env["ST_USER"], env["ST_KEY"])
    fd, header = tempfile.mkstemp(prefix="auth-header-", dir=header_dir)  # mode 0600
    with os.fdopen(fd, "w") as file:
        file.write(f"X-Auth-Token: {token}\n")
    return storage_url, token, header


def curl(url: str, header_file: str, ranges: int = 1, size: int = 0) -> int:
    """`ranges` curls at once, each one range of `url`'s `size` bytes; the bytes they got."""
    bounds = [size * i // ranges for i in range(ranges + 1)]
    command = ["curl", "-sS", "--fail", "-H", f"@{header_file}", "-o", "/dev/null", "-w", "%{size_download}"]
    spans = [["-r", f"{a}-{b - 1}"] for a, b in zip(bounds, bounds[1:])] if ranges > 1 else [[]]
    procs = [subprocess.Popen([*command, *span, url], stdout=subprocess.PIPE, text=True) for span in spans]
    return sum(int(float(p.communicate()[0].strip() or 0)) for p in procs)


def curl_urls(env: Mapping[str, str], container: str, prefix: str, header_dir: str) -> list[str]:
    """webdataset's `pipe:curl` URLs of the shards under `prefix`, reached as `env` reaches Swift."""
    storage_url, token, header = token_header(env, header_dir)
    connection = swiftclient.Connection(preauthurl=storage_url, preauthtoken=token)
    _, objects = connection.get_container(container, prefix=prefix, full_listing=True)
    names = sorted(o["name"] for o in objects if o["name"].endswith(".tar"))
    if not names:
        raise SystemExit(f"no shards under {container}/{prefix} in Swift")
    return [f"pipe:curl -sSf -H @{header} {storage_url}/{container}/{quote(name)}" for name in names]


def store_processes(env: Mapping[str, str], wan_pids: list[int]) -> list[psutil.Process]:
    """The local Swift's processes (their command lines name its directory) and the emulators."""
    swift_dir = env.get("DLSTORE_SWIFT_DIR") or "/nonexistent"
    found = []
    for pid in wan_pids:
        with contextlib.suppress(psutil.Error):  # an emulator that died
            found.append(psutil.Process(pid))
    me = psutil.Process()
    ours = {me.pid, *(child.pid for child in me.children(recursive=True))} - set(wan_pids)
    for proc in psutil.process_iter(["cmdline"]):
        # Not this process nor its workers: their command lines may name the directory too.
        if proc.pid not in ours and any(swift_dir in part for part in proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def store_cores(text: str) -> set[int]:
    """`--store-cores`: some of this process's cores, never all: the loader needs the rest."""
    mine, store = os.sched_getaffinity(0), {int(c) for c in text.split(",")}
    if not store < mine:
        raise SystemExit(f"--store-cores {text}: leaves no core of {sorted(mine)} to the loader")
    return store


@contextlib.contextmanager
def store_apart(cores: str | None, env: Mapping[str, str], wan_pids: list[int]) -> Iterator[None]:
    """The store side on `cores`, this process and its workers on the others.

    Linux affinity is per thread, so every thread is pinned. Afterwards each thread
    gets its affinity back, whatever happened.
    """
    if not cores:
        yield
        return
    mine, store = os.sched_getaffinity(0), store_cores(cores)
    before: dict[int, set[int]] = {}
    try:
        for proc in store_processes(env, wan_pids):
            with contextlib.suppress(psutil.Error, OSError):
                for thread in proc.threads():
                    before[thread.id] = os.sched_getaffinity(thread.id)
                    os.sched_setaffinity(thread.id, store)
        os.sched_setaffinity(0, mine - store)  # what starts from here on inherits it
        yield
    finally:
        for thread, affinity in before.items():
            with contextlib.suppress(OSError):  # the thread may have ended
                os.sched_setaffinity(thread, affinity)
        os.sched_setaffinity(0, mine)
