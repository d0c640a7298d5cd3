#!/usr/bin/env python3
"""Cold fetch of one shard into the node cache across an emulated WAN, against curl.

For each per-connection rate (10, 40 and 200 MB/s by default) it puts a WAN emulator
(`tools/wan_proxy.py`, in a process of its own: that rate per connection, `--delay-ms`
per request) in front of the local Swift, and times a cold `ShardCache.fetch` of one object (a fresh cache each run):

* ``single``: one GET stream per shard (``parts_in_flight=1``: the cache before issue 12)
* ``parallel``: ranged parts, ``--parts`` at once (the cache's default download)
* ``parallel-noverify``: the same without the checksum, to show what hashing costs
* ``parallel-s3``: the same through the S3 API (``--s3``)
* ``curl``: one ``curl -o /dev/null`` of the object's Swift URL
* ``curl-parallel``: ``--parts`` curls at once, each one range of the object

and prints MB/s (10^6 bytes/s), the connections each path opened and its GETs (counted by
the emulator), and the ratios single/curl and parallel/curl-parallel (the goal: >= 0.9).
The emulator is one Python event loop: when curl-parallel stays well under parts x rate,
it (or the local Swift) is the limit, for curl and the cache alike.
Credentials come from the environment (``ST_*``, ``AWS_*``, as ``tools/swift_server.py
start`` prints them) or ``--env-file``.

Example (a small smoke run; the defaults are a full one)::

    eval "$(python tools/swift_server.py start)"
    python tools/bench_cold.py --size 16MB --rates 10MB --runs 1
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import urlsplit

import swiftclient
from bench_storage import curl, make_payload, read_env_file
from wan_proxy import WanProxyProcess

from dlstore.cache import CacheConfig, ShardCache
from dlstore.config import StoreConfig, parse_size
from dlstore.storage import Store, open_store

CONTAINER = "dlstore-bench"
KEY = "cold/shard-000000.tar"
CACHE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(CacheConfig)}


@dataclasses.dataclass
class Run:
    """One timed fetch: MB/s, and what the emulator saw (new connections, GETs)."""

    mb_s: float
    connections: int
    gets: int
    cpu_s: float


@dataclasses.dataclass
class Target:
    """The object, where it is, and how to reach it through the emulator."""

    size: int
    checksum: str
    env: Mapping[str, str]
    swift_port: int
    parts: int
    part_size: int


def cache_fetch(store: Store, target: Target, tmp: str, **cache_options) -> int:
    """A cold fetch into a fresh cache; the bytes fetched."""
    cache_dir = tempfile.mkdtemp(prefix="cache-", dir=tmp)
    config = CacheConfig(cache_dir, 2 * target.size + 2**20, prefetch=0, fsync=False, **cache_options)
    cache = ShardCache(config, store)
    try:
        return os.path.getsize(cache.fetch(KEY, target.size, target.checksum))
    finally:
        cache.close()
        shutil.rmtree(cache_dir, ignore_errors=True)


def curl_ranges(url: str, header_file: str, size: int, parts: int) -> int:
    """`parts` curls at once, each one range of the object; the bytes they got."""
    bounds = [size * i // parts for i in range(parts + 1)]
    procs = [
        subprocess.Popen(
            ["curl", "-sS", "--fail", "-H", f"@{header_file}", "-r", f"{a}-{b - 1}", "-o", "/dev/null"]
            + ["-w", "%{size_download}", url],
            stdout=subprocess.PIPE,
            text=True,
        )
        for a, b in zip(bounds, bounds[1:])
    ]
    return sum(int(float(p.communicate()[0].strip() or 0)) for p in procs)


def timed(wan: WanProxyProcess, size: int, fetch: Callable[[], int]) -> Run:
    wan.reset_counts()
    cpu, started = time.process_time(), time.perf_counter()
    got = fetch()
    elapsed = time.perf_counter() - started
    if got != size:
        raise SystemExit(f"fetched {got} bytes, expected {size}")
    stats = wan.stats()
    gets = sum(1 for method, _, _ in stats["log"] if method == "GET")
    return Run(size / elapsed / 1e6, stats["connections"], gets, time.process_time() - cpu)


def proxied(env: Mapping[str, str], wan: WanProxyProcess) -> dict[str, str]:
    """Credentials that reach Swift through `wan` (tempauth hands out the proxy's own URL)."""
    out = dict(env)
    out["ST_AUTH"] = wan.url + urlsplit(env["ST_AUTH"]).path
    if env.get("AWS_ENDPOINT_URL"):
        out["AWS_ENDPOINT_URL"] = wan.url
    return out


def paths_at(rate: float, target: Target, args: argparse.Namespace, tmp: str) -> dict[str, list[Run]]:
    """Every path, `args.runs` times round-robin, through one emulator at `rate`."""
    # In a process of its own: in this one, the emulator's loop would compete with the
    # cache's download threads for the interpreter lock, and slow them (not curl).
    with WanProxyProcess(target.swift_port, rate=rate, delay_s=args.delay_ms / 1000, lifetime_s=3600) as wan:
        env = proxied(target.env, wan)
        config = StoreConfig.from_env(env)
        swift, s3 = open_store(f"swift://{CONTAINER}", config), open_store(f"s3://{CONTAINER}", config)
        swift.stat(KEY)  # authenticated, and the S3 client made, before any timing
        if args.s3:
            s3.stat(KEY)
        storage_url, token = swiftclient.client.get_auth(env["ST_AUTH"], env["ST_USER"], env["ST_KEY"])
        header_file = os.path.join(tmp, "headers")
        with open(os.open(header_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
            out.write(f"X-Auth-Token: {token}\n")
        url = f"{storage_url}/{CONTAINER}/{KEY}"
        parallel = {"parts_in_flight": target.parts, "part_size": target.part_size}
        fetchers: dict[str, Callable[[], int]] = {
            "single": lambda: cache_fetch(swift, target, tmp, parts_in_flight=1),
            "parallel": lambda: cache_fetch(swift, target, tmp, **parallel),
            "parallel-noverify": lambda: cache_fetch(swift, target, tmp, verify=False, **parallel),
            "parallel-s3": lambda: cache_fetch(s3, target, tmp, **parallel),
            "curl": lambda: curl(url, header_file),
            "curl-parallel": lambda: curl_ranges(url, header_file, target.size, target.parts),
        }
        chosen = [p for p in args.paths.split(",") if p and (p != "parallel-s3" or args.s3)]
        runs: dict[str, list[Run]] = {name: [] for name in chosen}
        for _ in range(args.runs):
            for name in chosen:
                runs[name].append(timed(wan, target.size, fetchers[name]))
    return runs


def summarize(runs: dict[str, list[Run]]) -> dict:
    out: dict = {}
    for name, series in runs.items():
        out[name] = {
            "median_mb_s": round(statistics.median(r.mb_s for r in series), 1),
            "runs_mb_s": [round(r.mb_s, 1) for r in series],
            "connections": max(r.connections for r in series),
            "gets": max(r.gets for r in series),
            "client_cpu_s": round(statistics.median(r.cpu_s for r in series), 2),
        }
    for a, b in (("single", "curl"), ("parallel", "curl-parallel"), ("parallel", "single")):
        if a in out and b in out:
            out[f"{a}/{b}"] = round(out[a]["median_mb_s"] / out[b]["median_mb_s"], 3)
    return out


def sha256_gb_s() -> float:
    block = os.urandom(64 * 2**20)
    started = time.perf_counter()
    hashlib.sha256(block).digest()
    return len(block) / (time.perf_counter() - started) / 1e9


def print_report(report: dict) -> None:
    print(
        f"cold fetch of one {report['object_bytes'] / 1e6:.0f} MB shard through the WAN emulator "
        f"({report['delay_ms']:g} ms per request; SHA-256 {report['sha256_gb_s']:.2f} GB/s on one core)"
    )
    for rate, result in report["rates"].items():
        print(f"  {rate} per connection:")
        for name, res in result.items():
            if isinstance(res, dict):
                print(
                    f"    {name:<18} {res['median_mb_s']:>8.1f} MB/s   {res['connections']:>3} connections"
                    f"   {res['gets']:>4} GETs   client CPU {res['client_cpu_s']:.2f} s"
                )
        ratios = [f"{k} {v:.2f}" for k, v in result.items() if not isinstance(v, dict)]
        print("    " + "   ".join(ratios))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="256MB", help="object size (default 256MB)")
    parser.add_argument("--rates", default="10MB,40MB,200MB", help="per-connection rates, bytes/s")
    parser.add_argument("--delay-ms", type=float, default=5.0, help="delay per request (default 5)")
    parser.add_argument("--parts", type=int, default=CACHE_DEFAULTS["parts_in_flight"], help="parts at once")
    parser.add_argument("--part-size", default=CACHE_DEFAULTS["part_size"], help="smallest part, bytes")
    parser.add_argument("--runs", type=int, default=3, help="fetches per path, round-robin (default 3)")
    parser.add_argument(
        "--paths", default="single,parallel,parallel-noverify,parallel-s3,curl,curl-parallel", help="which paths"
    )
    parser.add_argument("--s3", action="store_true", help="also time parallel-s3 (the S3 API)")
    parser.add_argument("--env-file", help="env.sh from tools/swift_server.py (default: the environment)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if shutil.which("curl") is None:
        args.paths = ",".join(p for p in args.paths.split(",") if not p.startswith("curl"))
        print("curl is not installed: the curl paths are left out", file=sys.stderr)

    env: Mapping[str, str] = read_env_file(args.env_file) if args.env_file else os.environ
    size = parse_size(args.size)
    payload = make_payload(size)
    direct = StoreConfig.from_env(env)
    # One plain object (no segments), so that curl and the cache read exactly the same thing.
    direct = dataclasses.replace(direct, swift=dataclasses.replace(direct.swift, segment_size=size + 1))
    store = open_store(f"swift://{CONTAINER}", direct)
    store.ensure_container()
    store.put(KEY, payload)
    target = Target(
        size=size,
        checksum="sha256:" + hashlib.sha256(payload).hexdigest(),
        env=env,
        swift_port=urlsplit(env["ST_AUTH"]).port or 80,
        parts=args.parts,
        part_size=parse_size(args.part_size),
    )
    del payload
    report: dict = {"object_bytes": size, "delay_ms": args.delay_ms, "sha256_gb_s": round(sha256_gb_s(), 2)}
    report["rates"] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="dlstore-bench-cold-") as tmp:
            for rate_text in args.rates.split(","):
                runs = paths_at(parse_size(rate_text), target, args, tmp)
                report["rates"][f"{rate_text}/s"] = summarize(runs)
    finally:
        store.delete(KEY)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
