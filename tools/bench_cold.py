#!/usr/bin/env python3
"""Cold against warm: one shard fetched into the node cache across an emulated WAN (against
curl), or whole loader epochs from an empty cache (against a full one).

Two subcommands (``shard`` is the default when none is given).

``shard``: for each per-connection rate (10, 40 and 200 MB/s by default) it puts a WAN emulator
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

``loader``: issue 12's setup. ~2,000 generated JPEGs (~95 KB, 400x350) in 6 shards of ~32 MB,
made by `bench_peers.prepare_data` and written into the local Swift by
`bench_loader.upload_to_swift`; `dlstore.Loader(ds, num_workers=2, device="cpu",
dtype="uint8")`, batch 128, RandomResizedCrop 224, one rank. Each round times, for each
setting (Swift on loopback, then Swift behind the WAN emulator at each rate with
``--delay-ms`` per request), one warm epoch (a fresh loader over a full cache) and then one
cold epoch (a fresh loader over an empty cache directory), each from `iter()` to its last
batch. It reports per setting cold/warm img/s (median and range over the rounds: each
round's cold run against the warm run just before it), the same ratio from the first batch
on (the streaming alone: whether the downloads keep ahead of the readers once the first
shuffle window is in) and the time to the first batch when cold (from `iter()`). ``--fetch`` passes fetch settings (`DataConfig` fields, or
`StoreConfig` fields) to the cold loaders, several ``--fetch`` compare variants in the same rounds. ``--store-cores`` keeps
the local Swift and the emulators on cores of their own, as a remote store would be. With
the thread engine it also says where the cold epoch's extra CPU goes, per MB of shards and
by thread kind (`THREAD_KINDS`: decode, the downloads' receive and write, the prefetch's checksums).
A warm epoch decodes crop-only what the cache's decode marks (`dlstore.cache.marks`) know to
decode cleanly, a cold one (a fresh cache directory) every image checked, as any first epoch
does, unless `dlstore convert` decoded every JPEG once (`ConvertOptions.check_decode`, the
default); ``--unmarked-warm`` adds a warm epoch with the marks cleared, so that the cold epoch's
gap splits into the first epoch's decode and the downloads'; ``--unchecked-too`` adds the same
dataset converted without that check.

Examples (small smoke runs; the defaults are full ones)::

    eval "$(python tools/swift_server.py start)"
    python tools/bench_cold.py --size 16MB --rates 10MB --runs 1
    python tools/bench_cold.py loader --rounds 3 --workdir /tmp/cold
    python tools/bench_cold.py loader --rates 40MB --fetch "" --fetch fetch_parts=1,fetch_shards=1
    python tools/bench_cold.py loader --rates 40MB --workers 1 --store-cores 1   # the store as if remote
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from urllib.parse import urlsplit

import bench_loader
import bench_peers
import cold_peers
import psutil
import swiftclient
from bench_loader import spread
from bench_storage import curl, make_payload, read_env_file
from wan_proxy import WanProxyProcess

from dlstore.cache import CacheConfig, ShardCache
from dlstore.config import StoreConfig, parse_size
from dlstore.format.checksums import ALGORITHMS, DEFAULT_ALGORITHM, checksum_of, new_hasher
from dlstore.storage import Store, open_store

CONTAINER = "dlstore-bench"
KEY = "cold/shard-000000.tar"
CACHE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(CacheConfig)}
PEER = "webdataset"  # the variant name of `--peers`' runs


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


def hash_gb_s(algorithm: str) -> float:
    """One core's rate of `algorithm` over 64 MB in memory."""
    block = os.urandom(64 * 2**20)
    hasher = new_hasher(algorithm)
    started = time.perf_counter()
    hasher.update(block)
    hasher.hexdigest()
    return len(block) / (time.perf_counter() - started) / 1e9


def print_report(report: dict) -> None:
    print(
        f"cold fetch of one {report['object_bytes'] / 1e6:.0f} MB shard through the WAN emulator "
        f"({report['delay_ms']:g} ms per request; checksum {report['checksum']}, "
        f"{report['hash_gb_s']:.2f} GB/s on one core)"
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


def shard_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_cold.py shard", description="Cold fetch of one shard against curl.")
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
    parser.add_argument(
        "--checksum",
        choices=sorted(ALGORITHMS),
        default=DEFAULT_ALGORITHM,
        help=f"the shard's checksum, which the cache verifies (default {DEFAULT_ALGORITHM})",
    )
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
        checksum=checksum_of(payload, args.checksum),
        env=env,
        swift_port=urlsplit(env["ST_AUTH"]).port or 80,
        parts=args.parts,
        part_size=parse_size(args.part_size),
    )
    del payload
    report: dict = {
        "object_bytes": size,
        "delay_ms": args.delay_ms,
        "checksum": args.checksum,
        "hash_gb_s": round(hash_gb_s(args.checksum), 2),
    }
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


# -- loader: whole epochs, cold against warm ------------------------------------------------------
@dataclasses.dataclass
class Epoch:
    """One timed epoch of a fresh loader, from `iter()`."""

    images_per_s: float
    first_batch_s: float
    seconds: float
    cpu_s: float  # the loader's: this process (its threads, the cache's) and its worker processes
    store_cpu_s: float  # the local Swift's and the WAN emulators' (not on a real node)
    connections: int | None = None  # the most open at once through the WAN emulator
    after_first_img_s: float = 0.0  # from the first batch on: the streaming, without the start
    threads_cpu_s: dict[str, float] = dataclasses.field(default_factory=dict)  # this process's, by `thread_kind`


#: The loader's threads by what they do (their name's prefix): the decode (thread engine; a
#: reader's own download is hashed there), the download engine's GETs (receive, write), and
#: the prefetch (mostly its downloads' checksums). The direct reads' short-lived threads have
#: ended by the second look, and are counted nowhere.
THREAD_KINDS = {"dlstore-decode": "decode", "dlstore-cache-download": "download", "dlstore-cache-prefetch": "prefetch"}


def threads_cpu() -> dict[int, tuple[str, float]]:
    """{thread id: (its kind, CPU seconds)} of this process's live threads (`THREAD_KINDS`,
    else "other"): where a cold epoch's extra CPU goes, kind by kind."""
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    out = {}
    for thread in psutil.Process().threads():
        name = names.get(thread.id, "")
        kind = next((k for prefix, k in THREAD_KINDS.items() if name.startswith(prefix)), "other")
        out[thread.id] = (kind, thread.user_time + thread.system_time)
    return out


def cpu_by_kind(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per thread kind between two `threads_cpu` (threads that ended between them
    are not counted: the download workers end only after 30 s idle)."""
    out: dict[str, float] = {}
    for tid, (kind, cpu) in after.items():
        out[kind] = out.get(kind, 0.0) + cpu - before.get(tid, (kind, 0.0))[1]
    return out


def store_processes(env: Mapping[str, str], wan_pids: list[int]) -> list[psutil.Process]:
    """The local Swift's processes (their command lines name its data directory) and the WAN
    emulators (`wan_pids`): the store side, which on a real node runs elsewhere, but here
    takes its CPU from the same cores as the decode threads."""
    swift_dir = env.get("DLSTORE_SWIFT_DIR") or "/nonexistent"
    found = []
    for pid in wan_pids:
        with contextlib.suppress(psutil.Error):  # an emulator that died: no store side of ours
            found.append(psutil.Process(pid))
    ours = {os.getpid(), *(child.pid for child in psutil.Process().children(recursive=True))} - set(wan_pids)
    for proc in psutil.process_iter(["cmdline"]):
        # Not this process nor its workers: their command lines may name the directory too (--env-file).
        if proc.pid not in ours and any(swift_dir in part for part in proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def pin(processes: list[psutil.Process], cores: set[int]) -> dict[int, set[int]]:
    """Every thread of `processes` to `cores` (Linux affinity is per thread); each thread's
    affinity before, for `unpin`."""
    before: dict[int, set[int]] = {}
    for proc in processes:
        with contextlib.suppress(psutil.Error, OSError):
            for thread in proc.threads():
                before[thread.id] = os.sched_getaffinity(thread.id)
                os.sched_setaffinity(thread.id, cores)
    return before


def unpin(before: dict[int, set[int]]) -> None:
    for thread, cores in before.items():
        with contextlib.suppress(OSError):  # the thread may have ended
            os.sched_setaffinity(thread, cores)


def store_cores(text: str) -> set[int]:
    """`--store-cores`' cores: some of this process's, not all (the loader needs the rest)."""
    mine, store = os.sched_getaffinity(0), {int(c) for c in text.split(",")}
    if not store < mine:
        raise SystemExit(f"--store-cores {text}: leaves no core of {sorted(mine)} to the loader")
    return store


@contextlib.contextmanager
def store_apart(args: argparse.Namespace) -> Iterator[None]:
    """With `--store-cores`: the store side (the local Swift, the WAN emulators) on those
    cores, this process and its workers on the others, so the store looks remote (on a real
    node it takes none of the loader's CPU); every thread's affinity as it was afterwards,
    whatever happened."""
    if not args.store_cores:
        yield
        return
    mine, store = os.sched_getaffinity(0), store_cores(args.store_cores)
    before: dict[int, set[int]] = {}
    try:
        before = pin(store_processes(args.env, args.wan_pids), store)
        os.sched_setaffinity(0, mine - store)  # threads and processes started from here on inherit it
        yield
    finally:
        unpin(before)
        os.sched_setaffinity(0, mine)


def cpu_of(processes: list[psutil.Process]) -> float:
    total = 0.0
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def loader_epoch(url: str, store_config: StoreConfig, cache_dir: str, args: argparse.Namespace, fetch: dict) -> Epoch:
    """Epoch 0 of a fresh `Dataset` + `Loader` (the issue's settings) over `cache_dir`."""
    loader, _ = bench_loader.dlstore_loader(
        url, cache_dir, args, "uint8", store_config, dataset_options=fetch, engine=args.engine
    )
    try:
        images, first, first_images = 0, None, 0
        store_side = store_processes(args.env, args.wan_pids)
        wan = set(args.wan_pids)
        threads_before = threads_cpu()
        store_cpu, before, started = cpu_of(store_side), bench_loader.tree_usage(), time.perf_counter()
        for batch, _ in loader:
            if first is None:
                first, first_images = time.perf_counter() - started, batch.shape[0]
            images += batch.shape[0]
        seconds = time.perf_counter() - started
        now, threads_after = bench_loader.tree_usage(), threads_cpu()  # before close() ends them
        cpu = sum(c - before.get(pid, (0.0, 0))[0] for pid, (c, _) in now.items() if pid not in wan)
        store_cpu = cpu_of(store_side) - store_cpu
    finally:
        loader.close()
        loader.dataset.cache.close()
        del loader
        gc.collect()  # the download workers' connections (in reference cycles) close now, not in a later run
    after = (images - first_images) / max(seconds - (first or 0.0), 1e-9)
    return Epoch(
        images / seconds,
        first or 0.0,
        seconds,
        cpu,
        store_cpu,
        after_first_img_s=after,
        threads_cpu_s=cpu_by_kind(threads_before, threads_after),
    )


def cold_epoch(url: str, store_config: StoreConfig, args: argparse.Namespace, fetch: dict, tmp: str) -> Epoch:
    """A cold epoch with `fetch`'s settings: the dataset's, and `StoreConfig` fields (`chunk_size`)."""
    store_fields = {f.name for f in dataclasses.fields(StoreConfig)}
    store_config = dataclasses.replace(store_config, **{k: v for k, v in fetch.items() if k in store_fields})
    fetch = {k: v for k, v in fetch.items() if k not in store_fields}
    cache_dir = tempfile.mkdtemp(prefix="cold-cache-", dir=tmp)
    try:
        return loader_epoch(url, store_config, cache_dir, args, fetch)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


def parse_fetch(text: str) -> dict:
    """ "fetch_parts=8,window_ramp=false" -> {"fetch_parts": 8, "window_ramp": False} (sizes stay text)."""
    out: dict = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        value = value.strip()
        booleans = {"true": True, "false": False}
        out[name.strip()] = int(value) if value.isdigit() else booleans.get(value.lower(), value)
    return out


def loader_rounds(urls: dict[str, str], env: Mapping[str, str], args: argparse.Namespace, tmp: str) -> list[dict]:
    """`args.rounds` rounds; in each, per setting and fetch variant (and each dataset of
    `urls`: a checksum algorithm, converted with or without the decode check), a warm epoch
    then a cold one."""
    direct = StoreConfig.from_env(env)
    url = next(iter(urls.values()))
    warm_dirs = {name: os.path.join(tmp, f"warm-cache-{name.replace(' ', '-')}") for name in urls}
    for algorithm, dataset in urls.items():
        loader_epoch(dataset, direct, warm_dirs[algorithm], args, {})  # fills the warm cache (and the page cache)
    variants = {
        f"{text or 'default'}{f' {algorithm}' if len(urls) > 1 else ''}": (parse_fetch(text), algorithm)
        for text in args.fetch or [""]
        for algorithm in urls
    }
    rates = [r for r in args.rates.split(",") if r]
    with contextlib.ExitStack() as stack:
        settings: dict[str, tuple[StoreConfig, WanProxyProcess | None]] = {"loopback": (direct, None)}
        envs: dict[str, Mapping[str, str]] = {"loopback": env}
        for rate_text in rates:
            link = parse_size(args.link_rate) if args.link_rate else None
            wan = WanProxyProcess(
                swift_port_of(env),
                rate=parse_size(rate_text),
                link_rate=link,
                delay_s=args.delay_ms / 1000,
                lifetime_s=3600,
            )
            stack.enter_context(wan)
            args.wan_pids.append(wan.pid)
            name = f"{rate_text}/s+{args.delay_ms:g}ms" + (f", link {args.link_rate}/s" if link else "")
            envs[name] = proxied(env, wan)
            settings[name] = (StoreConfig.from_env(envs[name]), wan)
        container, prefix = urlsplit(url).netloc, urlsplit(url).path.strip("/") + "/"
        peer_urls = {name: cold_peers.curl_urls(envs[name], container, prefix, tmp) for name in settings if args.peers}
        stack.enter_context(store_apart(args))
        rounds = []
        for number in range(args.rounds):
            runs: dict = {}
            for setting, (config, wan) in settings.items():
                for variant, (fetch, algorithm) in variants.items():
                    warm = loader_epoch(urls[algorithm], direct, warm_dirs[algorithm], args, {})
                    unmarked = None
                    if args.unmarked_warm:  # a first epoch over a warm cache: every image decoded checked
                        shutil.rmtree(
                            os.path.join(warm_dirs[algorithm], "marks"), ignore_errors=True
                        )  # the layout's marks/
                        unmarked = loader_epoch(urls[algorithm], direct, warm_dirs[algorithm], args, {})
                    if wan is not None:
                        wan.reset_counts()
                    cold = cold_epoch(urls[algorithm], config, args, fetch, tmp)
                    if wan is not None:
                        cold.connections = wan.stats()["most_open"]
                    runs[(setting, variant)] = (warm, cold) if unmarked is None else (warm, cold, unmarked)
                    print(
                        f"round {number + 1} {setting:<18} {variant:<30} warm {warm.images_per_s:7.0f} img/s"
                        f"  cold {cold.images_per_s:7.0f} img/s  ratio {cold.images_per_s / warm.images_per_s:.3f}"
                        f"  cold first batch {cold.first_batch_s:.2f}s"
                        + ("" if unmarked is None else f"  warm unmarked {unmarked.images_per_s:7.0f} img/s"),
                        file=sys.stderr,
                    )
                if args.peers:
                    peer = runs[(setting, PEER)] = cold_peers.webdataset_epoch(
                        peer_urls[setting], args.wds_decode, args
                    )
                    print(
                        f"round {number + 1} {setting:<18} {PEER:<30} streamed {peer.images_per_s:7.0f} img/s"
                        f"  first batch {peer.first_batch_s:.2f}s",
                        file=sys.stderr,
                    )
            rounds.append(runs)
    return rounds


def swift_port_of(env: Mapping[str, str]) -> int:
    return urlsplit(env["ST_AUTH"]).port or 80


def summarize_loader(rounds: list[dict], megabytes: float) -> dict:
    out: dict = {}
    for key in rounds[0]:
        if key[1] == PEER:
            continue
        pairs = [r[key][:2] for r in rounds]
        out[" | ".join(key)] = entry = {
            "cold_over_warm": spread([c.images_per_s / w.images_per_s for w, c in pairs]),
            "cold_first_batch_s": spread([c.first_batch_s for _, c in pairs]),
            "after_first_batch_cold_over_warm": spread([c.after_first_img_s / w.after_first_img_s for w, c in pairs]),
            "warm_first_batch_s": spread([w.first_batch_s for w, _ in pairs]),
            "warm_img_s": spread([w.images_per_s for w, _ in pairs]),
            "cold_img_s": spread([c.images_per_s for _, c in pairs]),
            "cold_over_warm_cpu_s": spread([c.cpu_s / w.cpu_s for w, c in pairs]),
            "cold_store_cpu_over_warm_cpu": spread([c.store_cpu_s / w.cpu_s for w, c in pairs]),
            "cold_most_connections": max((c.connections or 0 for _, c in pairs), default=0) or None,
            # The cold epoch's extra CPU by thread kind, per MB of shards fetched (every shard once).
            "cold_ms_per_mb": {
                kind: spread(
                    [
                        1e3 * (c.threads_cpu_s.get(kind, 0.0) - w.threads_cpu_s.get(kind, 0.0)) / megabytes
                        for w, c in pairs
                    ]
                )
                for kind in (*THREAD_KINDS.values(), "other")
            },
        }
        if len(rounds[0][key]) == 3:  # --unmarked-warm: the cold epoch against a warm first epoch
            unmarked = [(r[key][2], r[key][1]) for r in rounds]
            entry["cold_over_unmarked_warm"] = spread([c.images_per_s / u.images_per_s for u, c in unmarked])
            entry["unmarked_warm_over_warm"] = spread(
                [u.images_per_s / w.images_per_s for (w, _), (u, _) in zip(pairs, unmarked)]
            )
            entry["cold_ms_per_mb_over_unmarked"] = {
                kind: spread(
                    [
                        1e3 * (c.threads_cpu_s.get(kind, 0.0) - u.threads_cpu_s.get(kind, 0.0)) / megabytes
                        for u, c in unmarked
                    ]
                )
                for kind in (*THREAD_KINDS.values(), "other")
            }
    return out


def print_loader_report(report: dict) -> None:
    print(
        f"one epoch of {report['images']} images in {report['shards']} shards (~{report['shard_mb']:.0f} MB), "
        f"batch {report['batch_size']}, {report['workers']} {report['engine']}, {report['rounds']} rounds; "
        + (f"store on cores {report['store_cores']}, the loader on the rest; " if report["store_cores"] else "")
        + "median [min .. max]"
    )
    print(
        f"  {'setting | fetch':<46} {'cold/warm':<22} {'after 1st batch':<22} {'cold 1st batch s':<22}"
        f" {'warm img/s':>10} {'cold img/s':>10}"
        "  loader CPU cold/warm   store CPU/warm loader CPU   connections"
    )
    for name, res in report["settings"].items():
        ratio, first = res["cold_over_warm"], res["cold_first_batch_s"]
        after = res["after_first_batch_cold_over_warm"]
        print(
            f"  {name:<46} {ratio['median']:.3f} [{ratio['min']:.3f} .. {ratio['max']:.3f}]"
            f"   {after['median']:.3f} [{after['min']:.3f} .. {after['max']:.3f}]"
            f"   {first['median']:.2f} [{first['min']:.2f} .. {first['max']:.2f}]"
            f"   {res['warm_img_s']['median']:>10.0f} {res['cold_img_s']['median']:>10.0f}"
            f"  {res['cold_over_warm_cpu_s']['median']:>20.2f}"
            f"  {res['cold_store_cpu_over_warm_cpu']['median']:>26.2f}"
            f"   {res['cold_most_connections'] or '-':>11}"
        )
        extra = res.get("cold_ms_per_mb")
        if extra:
            print(
                "      cold - warm CPU per MB of shards (this process's threads; medians): "
                + ", ".join(f"{kind} {value['median']:.2f} ms" for kind, value in extra.items())
            )
        if "cold_over_unmarked_warm" in res:
            ratio, share = res["cold_over_unmarked_warm"], res["unmarked_warm_over_warm"]
            print(
                f"      warm first epoch (decode marks cleared)/warm {share['median']:.3f}"
                f" [{share['min']:.3f} .. {share['max']:.3f}];"
                f" cold/warm first epoch {ratio['median']:.3f} [{ratio['min']:.3f} .. {ratio['max']:.3f}]; CPU per MB beyond it: "
                + ", ".join(
                    f"{kind} {value['median']:.2f} ms" for kind, value in res["cold_ms_per_mb_over_unmarked"].items()
                )
            )


def loader_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_cold.py loader", description="Loader epochs, cold against warm.")
    parser.add_argument("--images", type=int, default=2000, help="images (default 2000)")
    parser.add_argument("--shards", type=int, default=6, help="shards (default 6: ~32 MB each)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2, help="decode threads (default 2)")
    parser.add_argument("--engine", default="threads", help="the loader's engine: threads (default) or processes")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--rates", default="10MB,40MB,200MB", help="per-connection rates of the emulator")
    parser.add_argument(
        "--link-rate",
        help="the emulator's cap on all connections together, e.g. 80MB (default: none, per connection only)",
    )
    parser.add_argument("--delay-ms", type=float, default=5.0, help="emulator delay per request (default 5)")
    parser.add_argument(
        "--fetch",
        action="append",
        help='fetch settings of the cold loaders, e.g. "fetch_parts=4", or a StoreConfig field '
        '("chunk_size=4194304"); repeat to compare',
    )
    parser.add_argument(
        "--checksums",
        default=DEFAULT_ALGORITHM,
        help=f"the datasets' checksum algorithms, comma-separated: one dataset each (default {DEFAULT_ALGORITHM})",
    )
    parser.add_argument("--workdir", help="where the generated data is kept between runs (default: a temp dir)")
    parser.add_argument("--env-file", help="env.sh from tools/swift_server.py (default: the environment)")
    parser.add_argument(
        "--store-cores",
        help='cores for the local Swift and the emulators, e.g. "1", the loader on the rest (default: all share all)',
    )
    parser.add_argument(
        "--peers", action="store_true", help="also WebDataset streaming the shards from Swift (pipe:curl), each setting"
    )
    parser.add_argument(
        "--unmarked-warm",
        action="store_true",
        help="also a warm epoch with the cache's decode marks cleared (every image decoded checked, as in any "
        "first epoch, as in the cold one): what of cold/warm is the downloads'",
    )
    parser.add_argument(
        "--unchecked-too",
        action="store_true",
        help="also each dataset converted with --no-check-decode (the same bytes): its first epochs decode every "
        "image checked, which a dataset whose JPEGs convert decoded need not",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.store_cores:
        store_cores(args.store_cores)  # before any work
    env: Mapping[str, str] = read_env_file(args.env_file) if args.env_file else os.environ
    args.env, args.wan_pids, args.batch_timeout = env, [], 600
    with tempfile.TemporaryDirectory(prefix="dlstore-bench-cold-") as tmp:
        data = bench_peers.prepare_data(Path(args.workdir or tmp), args.images, args.shards)
        root = data.store_dir.parents[1]
        checks = (True, False) if args.unchecked_too else (True,)
        urls = {
            algorithm + ("" if check else " unchecked"): bench_loader.upload_to_swift(
                root, dict(env), -(-args.images // args.shards), checksum_algorithm=algorithm, check_decode=check
            )[0]
            for algorithm in args.checksums.split(",")
            for check in checks
        }
        sizes = [p.stat().st_size for p in data.store_dir.glob("*.tar")]
        if args.peers:  # webdataset's faster decoder on these images, as bench_peers picks it
            args.wds_decode = bench_peers.fastest_decodes(data, args)["webdataset"][0]
        rounds = loader_rounds(urls, env, args, tmp)
    report = {
        "images": args.images,
        "shards": len(sizes),
        "shard_mb": statistics.mean(sizes) / 1e6,
        "batch_size": args.batch_size,
        "workers": args.workers,
        "engine": args.engine,
        "rounds": args.rounds,
        "delay_ms": args.delay_ms,
        "store_cores": args.store_cores,
        "settings": summarize_loader(rounds, sum(sizes) / 1e6),
        "peers": cold_peers.summarize(rounds, PEER) if args.peers else None,
    }
    print_loader_report(report)
    if report["peers"]:
        cold_peers.print_report(report["peers"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "loader":
        return loader_main(argv[1:])
    return shard_main(argv[1:] if argv and argv[0] == "shard" else argv)


if __name__ == "__main__":
    sys.exit(main())
