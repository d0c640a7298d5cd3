#!/usr/bin/env python3
"""What a cold epoch costs the loader's own CPU, stage by stage, and the cold ÷ warm that
leaves a loader whose decode keeps every core it has busy (issue 12's setup).

A cold epoch does the warm epoch's work and, besides, receives, writes and checks every
byte of its shards. Where the decode threads already use all of the loader's cores (the
``bench_cold.py loader --workers 1 --store-cores 1`` runs: one core for the loader, one for
the store), every CPU second of that comes out of decoding, so::

    cold / warm  <=  warm CPU / (warm CPU + download CPU)

whatever the overlap. This measures both sides in this process on the same data as
``bench_cold.py loader`` (~2,000 generated JPEGs of ~95 KB in 6 shards, written into the
local Swift), one shard at a time, with `--rounds` interleaved rounds:

* ``warm epoch``: a fresh `Loader` (`--workers` decode threads, batch 128, 224 px, uint8)
  over a full cache: the CPU of one epoch;
* ``GET``: each shard's bytes through the Swift client, dropped (one GET per shard);
* ``GET + write``: written into a file as well;
* ``GET + write + <algorithm>``: hashed as well, with the manifest's algorithm: the least a
  checked download can cost;
* ``GET + splice``: the body moved from the socket into a file by the kernel (``os.splice``
  through a pipe, on a plain ``http.client`` GET): no byte passes through Python, so this is
  about the least any client on this box spends receiving and writing the bytes;
* ``cache, 1 part`` and ``cache, N parts``: `ShardCache.fetch` of every shard into an empty
  cache (one GET per shard; the default ranged parts): what the loader's downloads cost;
* ``SHA-256 alone``, ``XXH3-128 alone``, ``CRC-32 alone``: hashing the shards' bytes from
  memory (what each checksum costs by itself).

CPU is the process's (every thread; user + system). The store's CPU (the local Swift, in
processes of its own) is not counted: as if it were remote.

    eval "$(python tools/swift_server.py start)"
    python tools/bench_fetch_cpu.py --rounds 3 --workdir /tmp/cold
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import resource
import select
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import urlsplit

import bench_loader
import bench_peers
from bench_loader import spread
from swift_server import read_env_file

from dlstore.cache import CacheConfig, ShardCache
from dlstore.config import StoreConfig
from dlstore.format.checksums import new_hasher
from dlstore.storage import Store, open_store


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cpu_of(work: Callable[[], object]) -> float:
    before = cpu_s()
    work()
    return cpu_s() - before


def stream(store: Store, shards: list[dict], tmp: str, write: bool, hash_: bool) -> None:
    """Every shard through one GET each; written into a file and hashed when asked."""
    fd, path = tempfile.mkstemp(dir=tmp)
    try:
        for shard in shards:
            algorithm = shard["checksum"].partition(":")[0]
            hasher, position = new_hasher(algorithm) if hash_ else None, 0
            for chunk in store.get(shard["name"]):
                if write:
                    os.pwrite(fd, chunk, position)
                if hasher is not None:
                    hasher.update(chunk)
                position += len(chunk)
            if hasher is not None and f"{algorithm}:{hasher.hexdigest()}" != shard["checksum"]:
                raise SystemExit(f"{shard['name']}: checksum differs from the manifest's")
    finally:
        os.close(fd)
        os.unlink(path)


def splice_stream(config: StoreConfig, url: str, shards: list[dict], tmp: str) -> None:
    """Every shard through one plain GET whose body the kernel moves into a file (socket →
    pipe → file with `os.splice`); the first bytes, read with the headers, are written as they
    are. Checked by size (the splice never sees the bytes to hash them)."""
    import swiftclient

    swift = config.swift
    storage_url, token = swiftclient.get_auth(swift.auth_url, swift.user, swift.key.reveal() if swift.key else None)
    parsed = urlsplit(storage_url)
    container, _, prefix = url.removeprefix("swift://").partition("/")
    fd, path = tempfile.mkstemp(dir=tmp)
    pipe_out, pipe_in = os.pipe()
    try:
        for shard in shards:
            connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
            try:
                connection.request(
                    "GET", f"{parsed.path}/{container}/{prefix}/{shard['name']}", headers={"X-Auth-Token": token}
                )
                response = connection.getresponse()
                if response.status != 200:
                    raise SystemExit(f"{shard['name']}: GET answered {response.status}")
                size = int(response.getheader("content-length"))
                head = response.fp.read1(size) if size else b""  # what the header read already buffered
                os.pwrite(fd, head, 0)
                position = len(head)
                sock = connection.sock  # non-blocking under its timeout: wait for bytes, at most 60 s each time
                while position < size:
                    if not select.select([sock], [], [], 60)[0]:
                        raise SystemExit(f"{shard['name']}: no bytes for 60 s at {position} of {size}")
                    try:
                        moved = os.splice(sock.fileno(), pipe_in, min(1 << 20, size - position))
                    except BlockingIOError:
                        continue
                    if not moved:
                        raise SystemExit(f"{shard['name']}: the body ended at {position} of {size} bytes")
                    while moved:
                        written = os.splice(pipe_out, fd, moved, offset_dst=position)
                        position, moved = position + written, moved - written
                if position != shard["size"]:
                    raise SystemExit(f"{shard['name']}: {position} bytes, the manifest says {shard['size']}")
            finally:
                connection.close()
    finally:
        for descriptor in (fd, pipe_in, pipe_out):
            os.close(descriptor)
        os.unlink(path)


def cache_fetch(store: Store, shards: list[dict], tmp: str, parts: int | None) -> None:
    """Every shard into an empty cache, one after another, as `ShardCache.fetch` does it."""
    cache_dir = tempfile.mkdtemp(prefix="cache-", dir=tmp)
    options = {} if parts is None else {"parts_in_flight": parts}
    cache = ShardCache(CacheConfig(cache_dir, 2**40, prefetch=0, fsync=False, **options), store)
    try:
        for shard in shards:
            cache.fetch(shard["name"], shard["size"], shard["checksum"])
    finally:
        cache.close()
        shutil.rmtree(cache_dir, ignore_errors=True)


def warm_epoch(url: str, config: StoreConfig, cache_dir: str, args: argparse.Namespace) -> tuple[float, float]:
    """(CPU s, img/s) of one epoch of a fresh loader over `cache_dir`."""
    loader, _ = bench_loader.dlstore_loader(url, cache_dir, args, "uint8", config)
    try:
        before, started, images = cpu_s(), time.perf_counter(), 0
        for batch, _ in loader:
            images += batch.shape[0]
        return cpu_s() - before, images / (time.perf_counter() - started)
    finally:
        loader.close()
        loader.dataset.cache.close()


def measure(url: str, env: Mapping[str, str], args: argparse.Namespace, tmp: str) -> dict:
    config = StoreConfig.from_env(env)
    store = open_store(url, config)
    shards = json.loads(b"".join(store.get("index.json")))["shards"]
    data = [b"".join(store.get(shard["name"])) for shard in shards[:1]]  # for the hashes alone
    scale = sum(shard["size"] for shard in shards) / len(data[0])
    warm_dir = os.path.join(tmp, "warm-cache")
    warm_epoch(url, config, warm_dir, args)  # fills the cache
    stages: dict[str, Callable[[], object]] = {
        "GET": lambda: stream(store, shards, tmp, False, False),
        "GET + write": lambda: stream(store, shards, tmp, True, False),
        f"GET + write + {shards[0]['checksum'].partition(':')[0]}": lambda: stream(store, shards, tmp, True, True),
        **({"GET + splice": lambda: splice_stream(config, url, shards, tmp)} if hasattr(os, "splice") else {}),
        "cache, 1 part": lambda: cache_fetch(store, shards, tmp, 1),
        f"cache, {CacheConfig.parts_in_flight} parts": lambda: cache_fetch(store, shards, tmp, None),
    }
    hashes = {
        "SHA-256 alone": lambda: hashlib.sha256(data[0]).digest(),
        "XXH3-128 alone": lambda: new_hasher("xxh3_128").update(data[0]),
        "CRC-32 alone": lambda: zlib.crc32(data[0]),
    }
    runs: dict[str, list[float]] = {"warm epoch": [], **{name: [] for name in [*stages, *hashes]}}
    rates: list[float] = []
    for number in range(args.rounds):
        cpu, rate = warm_epoch(url, config, warm_dir, args)
        runs["warm epoch"].append(cpu)
        rates.append(rate)
        for name, work in stages.items():
            runs[name].append(cpu_of(work))
        for name, work in hashes.items():
            runs[name].append(cpu_of(work) * scale)
        print(f"round {number + 1}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in runs.items()), file=sys.stderr)
    return {"bytes": sum(shard["size"] for shard in shards), "warm_img_s": spread(rates), "cpu_s": runs}


def print_report(report: dict, args: argparse.Namespace) -> None:
    runs, megabytes = report["cpu_s"], report["bytes"] / 1e6
    warm = statistics.median(runs["warm epoch"])
    print(
        f"one epoch: {args.images} images, {megabytes:.0f} MB in shards; {args.workers} decode threads; "
        f"warm {report['warm_img_s']['median']:.0f} img/s; {args.rounds} rounds, median [min .. max]"
    )
    print(f"  {'CPU per epoch':<24} {'s':>22} {'ms/MB':>7}  {'cold/warm at most':>17}")
    for name, values in runs.items():
        cost, low, high = statistics.median(values), min(values), max(values)
        spread_text = f"{cost:.3f} [{low:.3f} .. {high:.3f}]"
        if name == "warm epoch":
            print(f"  {name:<24} {spread_text:>22}")
        else:
            print(f"  {name:<24} {spread_text:>22} {1e3 * cost / megabytes:7.2f}  {warm / (warm + cost):17.3f}")
    print("  (cold/warm at most: warm CPU / (warm CPU + the stage's CPU), for a loader with no idle core)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2000, help="images (default 2000)")
    parser.add_argument("--shards", type=int, default=6, help="shards (default 6: ~32 MB each)")
    parser.add_argument("--workers", type=int, default=1, help="decode threads of the warm epoch (default 1)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", help="where the generated data is kept between runs (default: a temp dir)")
    parser.add_argument("--env-file", help="env.sh from tools/swift_server.py (default: the environment)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    env: Mapping[str, str] = read_env_file(args.env_file) if args.env_file else os.environ
    with tempfile.TemporaryDirectory(prefix="dlstore-bench-fetch-cpu-") as tmp:
        data = bench_peers.prepare_data(Path(args.workdir or tmp), args.images, args.shards)
        url, _ = bench_loader.upload_to_swift(data.store_dir.parents[1], dict(env), -(-args.images // args.shards))
        report = measure(url, env, args, tmp)
    print_report(report, args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
