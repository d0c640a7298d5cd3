#!/usr/bin/env python3
"""GET throughput of one large object through dlstore's backends, against curl in the same run.

It uploads one object (256 MB by default) into a Swift container, then reads it back,
round-robin, several times each way:

* ``swift``: `SwiftStore.get` (python-swiftclient)
* ``s3``: `S3Store.get` (boto3 through s3api; the same object, as a bucket is a container)
* ``curl``: ``curl -o /dev/null`` of the object's Swift URL with ``X-Auth-Token``
* ``file``: `LocalStore.get` of a copy in a temp dir, and ``curl file://`` of that copy
  (``curl-file``), both from the page cache

and prints MB/s (10^6 bytes per second; median and best of the runs), the client CPU per
GB for the Python paths, and the ratios swift/curl, s3/curl and file/curl-file.
Credentials come from the environment (``ST_*`` and ``AWS_*``, as ``tools/swift_server.py
start`` prints them) or from ``--env-file``.

Example::

    eval "$(python tools/swift_server.py start)"
    python tools/bench_storage.py --size 256MB --runs 3 --json bench.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swift_server import read_env_file  # noqa: E402

from dlstore.config import StoreConfig  # noqa: E402
from dlstore.storage import Store, open_store  # noqa: E402

CONTAINER = "dlstore-bench"
KEY = "bench/object.bin"


def make_payload(size: int) -> bytes:
    # Incompressible enough and cheap to make: a random MiB repeated.
    block = os.urandom(2**20)
    return (block * (size // len(block) + 1))[:size]


def read_store(store: Store, key: str) -> int:
    received = 0
    for chunk in store.get(key):
        received += len(chunk)
    return received


def curl(url: str, header_file: str | None) -> int:
    command = ["curl", "-sS", "--fail", "-o", "/dev/null", "-w", "%{size_download}", url]
    if header_file:
        command[1:1] = ["-H", f"@{header_file}"]  # the token stays out of the process list
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return int(float(result.stdout.strip()))


@dataclasses.dataclass
class Series:
    name: str
    mb_s: list[float] = dataclasses.field(default_factory=list)
    cpu_s_per_gb: list[float] = dataclasses.field(default_factory=list)

    def summary(self) -> dict:
        out = {"median_mb_s": round(statistics.median(self.mb_s), 1), "best_mb_s": round(max(self.mb_s), 1)}
        out["runs_mb_s"] = [round(x, 1) for x in self.mb_s]
        if self.cpu_s_per_gb:
            out["client_cpu_s_per_gb"] = round(statistics.median(self.cpu_s_per_gb), 2)
        return out


def timed(series: Series, size: int, read: Callable[[], int], python: bool) -> None:
    cpu = time.process_time()
    started = time.perf_counter()
    received = read()
    elapsed = time.perf_counter() - started
    if received != size:
        raise SystemExit(f"{series.name}: read {received} bytes, expected {size}")
    series.mb_s.append(size / elapsed / 1e6)
    if python:
        series.cpu_s_per_gb.append((time.process_time() - cpu) / (size / 1e9))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="256MB", help="object size (default 256MB)")
    parser.add_argument("--runs", type=int, default=3, help="reads per path, round-robin (default 3)")
    parser.add_argument("--paths", default="swift,s3,curl,file,curl-file", help="which paths to time")
    parser.add_argument("--env-file", help="env.sh from tools/swift_server.py (default: the environment)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON ('-' for stdout only)")
    parser.add_argument("--chunk-size", default="1MiB", help="dlstore's read chunk size (default 1MiB)")
    parser.add_argument("--keep", action="store_true", help="leave the object in the container")
    args = parser.parse_args(argv)

    from dlstore.config import parse_size

    size = parse_size(args.size)
    env: Mapping[str, str] = read_env_file(args.env_file) if args.env_file else os.environ
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if shutil.which("curl") is None and any(p.startswith("curl") for p in paths):
        raise SystemExit("curl is not installed (apt-get install -y curl), or leave it out with --paths")

    config = StoreConfig.from_env(env)
    # One plain object (no segments), so that curl and the clients read exactly the same thing.
    config = dataclasses.replace(
        config,
        chunk_size=parse_size(args.chunk_size),
        swift=dataclasses.replace(config.swift, segment_size=size + 1),
    )
    swift_store = open_store(f"swift://{CONTAINER}", config)
    s3_store = open_store(f"s3://{CONTAINER}", config)

    import swiftclient

    conn = swiftclient.Connection(
        config.swift.auth_url, config.swift.user, config.swift.key.reveal() if config.swift.key else None
    )
    storage_url, token = conn.get_auth()
    conn.put_container(CONTAINER)
    payload = make_payload(size)
    started = time.perf_counter()
    swift_store.put(KEY, payload)
    upload_mb_s = size / (time.perf_counter() - started) / 1e6

    with tempfile.TemporaryDirectory(prefix="dlstore-bench-") as tmp:
        file_store = open_store(f"file://{tmp}", config)
        file_store.put(KEY, payload)
        del payload
        header_file = os.path.join(tmp, "headers")
        with open(os.open(header_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as out:
            out.write(f"X-Auth-Token: {token}\n")
        object_url = f"{storage_url}/{CONTAINER}/{KEY}"
        readers: dict[str, tuple[Callable[[], int], bool]] = {
            "swift": (lambda: read_store(swift_store, KEY), True),
            "s3": (lambda: read_store(s3_store, KEY), True),
            "curl": (lambda: curl(object_url, header_file), False),
            "file": (lambda: read_store(file_store, KEY), True),
            "curl-file": (lambda: curl(f"file://{tmp}/{KEY}", None), False),
        }
        unknown = set(paths) - set(readers)
        if unknown:
            raise SystemExit(f"unknown paths {sorted(unknown)}; choose from {sorted(readers)}")
        series = {name: Series(name) for name in paths}
        for name in paths:  # warm-up: connections, auth, page cache
            readers[name][0]()
        for _ in range(args.runs):
            for name in paths:
                read, python = readers[name]
                timed(series[name], size, read, python)

    if not args.keep:
        swift_store.delete(KEY)
    results = {name: s.summary() for name, s in series.items()}

    def ratio(a: str, b: str) -> float | None:
        if a in results and b in results:
            return round(results[a]["median_mb_s"] / results[b]["median_mb_s"], 3)
        return None

    report = {
        "object_bytes": size,
        "runs": args.runs,
        "upload_mb_s": round(upload_mb_s, 1),
        "chunk_size": config.chunk_size,
        "results": results,
        "ratios": {
            "swift/curl": ratio("swift", "curl"),
            "s3/curl": ratio("s3", "curl"),
            "file/curl-file": ratio("file", "curl-file"),
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "system": platform.platform()},
    }
    print(f"GET of one {size / 1e6:.0f} MB object over loopback, {args.runs} runs each (MB/s = 10^6 B/s)")
    for name, res in results.items():
        cpu = f"   client CPU {res['client_cpu_s_per_gb']:.2f} s/GB" if "client_cpu_s_per_gb" in res else ""
        print(f"  {name:<10} median {res['median_mb_s']:>8.1f}  best {res['best_mb_s']:>8.1f}{cpu}")
    for name, value in report["ratios"].items():
        if value is not None:
            print(f"  {name:<15} {value:.2f}")
    if args.json:
        text = json.dumps(report, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
