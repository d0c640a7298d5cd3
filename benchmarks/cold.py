"""Cold against warm: one shard fetched across an emulated WAN, or whole loader epochs.

``shard`` (the default): for each per-connection rate, a WAN emulator runs in front of
the local Swift, in a process of its own. It times a cold `ShardCache.fetch` of one
object, in a fresh cache each run, along these paths:

* ``single``: one GET stream per shard (``parts_in_flight=1``)
* ``parallel``: ranged parts, ``--parts`` at once: the cache's default
* ``parallel-noverify``: the same without the checksum, to show what hashing costs
* ``parallel-s3``: the same through the S3 API (``--s3``)
* ``curl``, ``curl-parallel``: one curl of the object, or ``--parts`` curls of a range each

It prints MB/s, the connections and GETs the emulator saw, and single/curl and
parallel/curl-parallel (the goal: >= 0.9). When curl-parallel stays well under parts x
rate, the emulator or the local Swift is the limit, for curl and the cache alike.

``loader``: generated JPEGs written into the local Swift, read by `dlstore.Loader` with
uint8 batches on one rank. Each round times, for each setting (Swift on loopback, then
behind the emulator at each rate), a warm epoch over a full cache and then a cold epoch
over an empty one. It reports cold/warm img/s, the same from the first batch on, and
the time to the first batch when cold. ``--fetch`` compares fetch settings in the same
rounds. ``--store-cores`` keeps Swift and the emulators on cores of their own, as a
remote store would be. With the thread engine it splits the cold epoch's extra CPU per
MB of shards by thread kind. ``--unmarked-warm`` adds a warm epoch with the cache's decode
marks cleared, which splits the cold gap into the first epoch's decode and the downloads'.
``--unchecked-too`` adds the same dataset converted without the decode check. ``--peers``
adds WebDataset streaming the same shards with ``pipe:curl``: it has no cache, so each
of its epochs is cold.

Credentials come from the environment (``ST_*``, ``AWS_*``) or ``--env-file``.
Examples (small smoke runs; the defaults are full ones)::

    eval "$(python -m tests.support.swift_server start)"
    python -m benchmarks.cold --size 16MB --rates 10MB --runs 1
    python -m benchmarks.cold loader --rounds 3 --workdir /tmp/cold
    python -m benchmarks.cold loader --rates 40MB --fetch "" --fetch fetch_parts=1,fetch_shards=1
    python -m benchmarks.cold loader --rates 40MB --workers 1 --store-cores 1   # the store as if remote
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import urlsplit

from dlstore.cache import CacheConfig, ShardCache
from dlstore.config import StoreConfig, parse_size
from dlstore.format.checksums import ALGORITHMS, DEFAULT_ALGORITHM, checksum_of, new_hasher
from dlstore.storage import Store, open_store
from tests.support.wan_proxy import WanProxyProcess

from . import pipelines, runner, store_side
from .data import make_payload, prepare_data, store_env, upload_to_swift
from .runner import Spread, interleave, spread, write_json

CONTAINER = "dlstore-bench"
KEY = "cold/shard-000000.tar"
CACHE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(CacheConfig)}
PEER = "webdataset"  # the variant name of `--peers`' runs
KINDS = (*runner.THREAD_KINDS.values(), "other")


# -- shard: one object, the cache against curl -----------------------------------------------------
@dataclasses.dataclass
class Run:
    """One timed fetch: MB/s, what the emulator saw, and this process's CPU."""

    mb_s: float
    connections: int
    gets: int
    cpu_s: float


def cache_fetch(store: Store, size: int, checksum: str, tmp: str, **cache_options) -> int:
    """A cold fetch into a fresh cache; the bytes fetched."""
    cache_dir = tempfile.mkdtemp(prefix="cache-", dir=tmp)
    cache = ShardCache(CacheConfig(cache_dir, 2 * size + 2**20, prefetch=0, fsync=False, **cache_options), store)
    try:
        return os.path.getsize(cache.fetch(KEY, size, checksum))
    finally:
        cache.close()
        shutil.rmtree(cache_dir, ignore_errors=True)


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


def paths_at(rate: float, size: int, checksum: str, env: Mapping[str, str], args, tmp: str) -> dict[str, list[Run]]:
    """Every path, `args.runs` times round-robin, through one emulator at `rate`."""
    # In a process of its own: here its loop would take the interpreter lock from the downloads.
    with WanProxyProcess(store_side.swift_port(env), rate=rate, delay_s=args.delay_ms / 1000, lifetime_s=3600) as wan:
        via = store_side.proxied(env, wan)
        config = StoreConfig.from_env(via)
        swift, s3 = open_store(f"swift://{CONTAINER}", config), open_store(f"s3://{CONTAINER}", config)
        swift.stat(KEY)  # authenticated before any timing
        if args.s3:
            s3.stat(KEY)
        storage_url, _, header = store_side.token_header(via, tmp)
        url = f"{storage_url}/{CONTAINER}/{KEY}"
        parallel = {"parts_in_flight": args.parts, "part_size": parse_size(args.part_size)}
        fetchers: dict[str, Callable[[], int]] = {
            "single": lambda: cache_fetch(swift, size, checksum, tmp, parts_in_flight=1),
            "parallel": lambda: cache_fetch(swift, size, checksum, tmp, **parallel),
            "parallel-noverify": lambda: cache_fetch(swift, size, checksum, tmp, verify=False, **parallel),
            "parallel-s3": lambda: cache_fetch(s3, size, checksum, tmp, **parallel),
            "curl": lambda: store_side.curl(url, header),
            "curl-parallel": lambda: store_side.curl(url, header, args.parts, size),
        }
        chosen = [p for p in args.paths.split(",") if p and (p != "parallel-s3" or args.s3)]
        rounds = interleave(args.runs, {name: (lambda n=name: timed(wan, size, fetchers[n])) for name in chosen},
                            rotate=False)  # fmt: skip
    return {name: [r[name] for r in rounds] for name in chosen}


def summarize_paths(runs: dict[str, list[Run]]) -> dict:
    out: dict = {}
    for name, series in runs.items():
        out[name] = {"median_mb_s": round(statistics.median(r.mb_s for r in series), 1),
                     "runs_mb_s": [round(r.mb_s, 1) for r in series],
                     "connections": max(r.connections for r in series), "gets": max(r.gets for r in series),
                     "client_cpu_s": round(statistics.median(r.cpu_s for r in series), 2)}  # fmt: skip
    for a, b in (("single", "curl"), ("parallel", "curl-parallel"), ("parallel", "single")):
        if a in out and b in out:
            out[f"{a}/{b}"] = round(out[a]["median_mb_s"] / out[b]["median_mb_s"], 3)
    return out


def hash_gb_s(algorithm: str) -> float:
    """One core's rate of `algorithm` over 64 MB in memory."""
    block, hasher = os.urandom(64 * 2**20), new_hasher(algorithm)
    started = time.perf_counter()
    hasher.update(block)
    hasher.hexdigest()
    return len(block) / (time.perf_counter() - started) / 1e9


def print_shard_report(report: dict) -> None:
    print(f"cold fetch of one {report['object_bytes'] / 1e6:.0f} MB shard through the WAN emulator "
          f"({report['delay_ms']:g} ms per request; checksum {report['checksum']}, "
          f"{report['hash_gb_s']:.2f} GB/s on one core)")  # fmt: skip
    for rate, result in report["rates"].items():
        print(f"  {rate} per connection:")
        for name, res in result.items():
            if isinstance(res, dict):
                print(f"    {name:<18} {res['median_mb_s']:>8.1f} MB/s   {res['connections']:>3} connections"
                      f"   {res['gets']:>4} GETs   client CPU {res['client_cpu_s']:.2f} s")  # fmt: skip
        print("    " + "   ".join(f"{k} {v:.2f}" for k, v in result.items() if not isinstance(v, dict)))


def shard_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.cold shard", description="Cold fetch of one shard against curl.")
    add = parser.add_argument
    add("--size", default="256MB", help="object size (default 256MB)")
    add("--rates", default="10MB,40MB,200MB", help="per-connection rates, bytes/s")
    add("--delay-ms", type=float, default=5.0, help="delay per request (default 5)")
    add("--parts", type=int, default=CACHE_DEFAULTS["parts_in_flight"], help="parts at once")
    add("--part-size", default=CACHE_DEFAULTS["part_size"], help="smallest part, bytes")
    add("--runs", type=int, default=3, help="fetches per path, round-robin (default 3)")
    add("--paths", default="single,parallel,parallel-noverify,parallel-s3,curl,curl-parallel", help="which paths")
    add("--s3", action="store_true", help="also time parallel-s3 (the S3 API)")
    add("--checksum", choices=sorted(ALGORITHMS), default=DEFAULT_ALGORITHM, help="the shard's checksum")
    add("--env-file", help="env.sh from tests/support/swift_server.py (default: the environment)")
    add("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if shutil.which("curl") is None:
        args.paths = ",".join(p for p in args.paths.split(",") if not p.startswith("curl"))
        print("curl is not installed: the curl paths are left out", file=sys.stderr)
    env, size = store_env(args.env_file), parse_size(args.size)
    payload = make_payload(size)
    direct = StoreConfig.from_env(env)
    # One plain object, no segments, so that curl and the cache read the same thing.
    direct = dataclasses.replace(direct, swift=dataclasses.replace(direct.swift, segment_size=size + 1))
    store = open_store(f"swift://{CONTAINER}", direct)
    store.ensure_container()
    store.put(KEY, payload)
    checksum = checksum_of(payload, args.checksum)
    del payload
    report: dict = {"object_bytes": size, "delay_ms": args.delay_ms, "checksum": args.checksum,
                    "hash_gb_s": round(hash_gb_s(args.checksum), 2), "rates": {}}  # fmt: skip
    try:
        with tempfile.TemporaryDirectory(prefix="dlstore-bench-cold-") as tmp:
            for rate in args.rates.split(","):
                runs = paths_at(parse_size(rate), size, checksum, env, args, tmp)
                report["rates"][f"{rate}/s"] = summarize_paths(runs)
    finally:
        store.delete(KEY)
    print_shard_report(report)
    write_json(args.json, report)
    return 0


# -- loader: whole epochs, cold against warm -------------------------------------------------------
@dataclasses.dataclass
class Epoch:
    """One timed epoch of a fresh loader, from `iter()`."""

    images_per_s: float
    first_batch_s: float
    seconds: float
    cpu_s: float = 0.0  # the loader's: this process and its workers
    store_cpu_s: float = 0.0  # the local Swift's and the emulators'
    connections: int | None = None  # the most open at once through the emulator
    after_first_img_s: float = 0.0  # from the first batch on: the streaming, without the start
    threads_cpu_s: dict[str, float] = dataclasses.field(default_factory=dict)  # by thread kind


def loader_epoch(url: str, store_config: StoreConfig, cache_dir: str, args, fetch: dict) -> Epoch:
    """Epoch 0 of a fresh `Dataset` and `Loader` over `cache_dir`."""
    loader, _ = pipelines.dlstore_loader(url, cache_dir, args, "uint8", store_config, fetch, engine=args.engine)
    try:
        images, first, first_images = 0, None, 0
        store = store_side.store_processes(args.env, args.wan_pids)
        threads_before, store_cpu = runner.threads_cpu(), runner.cpu_of(store)
        before, started = runner.tree_usage(), time.perf_counter()
        for batch, _ in loader:
            if first is None:
                first, first_images = time.perf_counter() - started, batch.shape[0]
            images += batch.shape[0]
        seconds = time.perf_counter() - started
        cpu, threads_after = (
            runner.cpu_since(before, set(args.wan_pids)),
            runner.threads_cpu(),
        )  # before close() ends them
        store_cpu = runner.cpu_of(store) - store_cpu
    finally:
        loader.close()
        loader.dataset.cache.close()
        del loader
        gc.collect()  # the downloads' connections, in reference cycles, close now
    after = (images - first_images) / max(seconds - (first or 0.0), 1e-9)
    return Epoch(images / seconds, first or 0.0, seconds, cpu, store_cpu, after_first_img_s=after,
                 threads_cpu_s=runner.cpu_by_kind(threads_before, threads_after))  # fmt: skip


def cold_epoch(url: str, store_config: StoreConfig, args, fetch: dict, tmp: str) -> Epoch:
    """A cold epoch with `fetch`'s settings: `DataConfig` fields and `StoreConfig` ones."""
    store_fields = {f.name for f in dataclasses.fields(StoreConfig)}
    store_config = dataclasses.replace(store_config, **{k: v for k, v in fetch.items() if k in store_fields})
    cache_dir = tempfile.mkdtemp(prefix="cold-cache-", dir=tmp)
    try:
        return loader_epoch(
            url, store_config, cache_dir, args, {k: v for k, v in fetch.items() if k not in store_fields}
        )
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


def parse_fetch(text: str) -> dict:
    """Fetch settings from text; sizes stay text.

    >>> parse_fetch("fetch_parts=8,window_ramp=false")
    {'fetch_parts': 8, 'window_ramp': False}
    """
    out: dict = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        value = value.strip()
        out[name.strip()] = int(value) if value.isdigit() else {"true": True, "false": False}.get(value.lower(), value)
    return out


def webdataset_epoch(urls: list[str], decode: str, args) -> Epoch:
    """One epoch of a fresh `WebLoader` streaming `urls`; a stalled curl ends the run."""
    images, first, started = 0, None, time.perf_counter()
    for batch in pipelines.webdataset_loader(urls, decode, args, persistent_workers=False):
        first = time.perf_counter() - started if first is None else first
        images += batch[0].shape[0]
    seconds = time.perf_counter() - started
    return Epoch(images / seconds, first or 0.0, seconds)


def pair_runs(urls: dict[str, str], warm_dirs: dict, config: StoreConfig, wan, fetch: dict, dataset: str, args, tmp):
    """A warm epoch, with `--unmarked-warm` one more with the decode marks cleared, then a cold one."""
    direct = StoreConfig.from_env(args.env)
    warm = loader_epoch(urls[dataset], direct, warm_dirs[dataset], args, {})
    runs = [warm]
    if args.unmarked_warm:  # a first epoch over a warm cache: every image decoded checked
        shutil.rmtree(os.path.join(warm_dirs[dataset], "marks"), ignore_errors=True)
        unmarked = loader_epoch(urls[dataset], direct, warm_dirs[dataset], args, {})
    if wan is not None:
        wan.reset_counts()
    cold = cold_epoch(urls[dataset], config, args, fetch, tmp)
    if wan is not None:
        cold.connections = wan.stats()["most_open"]
    runs.append(cold)
    if args.unmarked_warm:
        runs.append(unmarked)
    return tuple(runs)


def loader_rounds(urls: dict[str, str], env: Mapping[str, str], args, tmp: str) -> list[dict]:
    """`args.rounds` rounds; in each, per setting, fetch variant and dataset, a warm epoch then a cold one."""
    direct = StoreConfig.from_env(env)
    warm_dirs = {name: os.path.join(tmp, f"warm-cache-{name.replace(' ', '-')}") for name in urls}
    for name, dataset in urls.items():
        loader_epoch(dataset, direct, warm_dirs[name], args, {})  # fills the warm cache and the page cache
    variants = {f"{text or 'default'}{f' {name}' if len(urls) > 1 else ''}": (parse_fetch(text), name)
                for text in args.fetch or [""] for name in urls}  # fmt: skip
    with contextlib.ExitStack() as stack:
        settings: dict[str, tuple[StoreConfig, WanProxyProcess | None]] = {"loopback": (direct, None)}
        envs: dict[str, Mapping[str, str]] = {"loopback": env}
        for rate in filter(None, args.rates.split(",")):
            link = parse_size(args.link_rate) if args.link_rate else None
            wan = stack.enter_context(WanProxyProcess(store_side.swift_port(env), rate=parse_size(rate), link_rate=link,
                                                      delay_s=args.delay_ms / 1000, lifetime_s=3600))  # fmt: skip
            args.wan_pids.append(wan.pid)
            name = f"{rate}/s+{args.delay_ms:g}ms" + (f", link {args.link_rate}/s" if link else "")
            envs[name] = store_side.proxied(env, wan)
            settings[name] = (StoreConfig.from_env(envs[name]), wan)
        where = urlsplit(next(iter(urls.values())))
        prefix = where.path.strip("/") + "/"
        peer_urls = {s: store_side.curl_urls(envs[s], where.netloc, prefix, tmp) for s in settings if args.peers}
        stack.enter_context(store_side.store_apart(args.store_cores, env, args.wan_pids))
        runs: dict[tuple[str, str], Callable[[], tuple]] = {}
        for setting, (config, wan) in settings.items():
            for variant, (fetch, dataset) in variants.items():
                runs[setting, variant] = lambda c=config, w=wan, f=fetch, d=dataset: pair_runs(
                    urls, warm_dirs, c, w, f, d, args, tmp
                )
            if args.peers:
                runs[setting, PEER] = lambda s=setting: (webdataset_epoch(peer_urls[s], args.wds_decode, args),)
        return interleave(args.rounds, runs, rotate=False, done=said)


def said(number: int, got: dict) -> None:
    for (setting, variant), epochs in got.items():
        if variant == PEER:
            line = f"streamed {epochs[0].images_per_s:7.0f} img/s  first batch {epochs[0].first_batch_s:.2f}s"
        else:
            warm, cold = epochs[:2]
            line = (f"warm {warm.images_per_s:7.0f} img/s  cold {cold.images_per_s:7.0f} img/s  ratio "
                    f"{cold.images_per_s / warm.images_per_s:.3f}  cold first batch {cold.first_batch_s:.2f}s"
                    + (f"  warm unmarked {epochs[2].images_per_s:7.0f} img/s" if len(epochs) > 2 else ""))  # fmt: skip
        print(f"round {number + 1} {setting:<18} {variant:<30} {line}", file=sys.stderr)


def extra_cpu_per_mb(pairs: list[tuple[Epoch, Epoch]], megabytes: float) -> dict:
    """The cold epoch's CPU beyond the other's, per MB of shards, by thread kind."""
    return {kind: spread([1e3 * (c.threads_cpu_s.get(kind, 0.0) - b.threads_cpu_s.get(kind, 0.0)) / megabytes
                          for b, c in pairs]) for kind in KINDS}  # fmt: skip


def summarize_loader(rounds: list[dict], megabytes: float) -> dict:
    out: dict = {}
    for key in (k for k in rounds[0] if k[1] != PEER):
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
            "cold_ms_per_mb": extra_cpu_per_mb(pairs, megabytes),
        }
        if len(rounds[0][key]) == 3:  # --unmarked-warm
            unmarked = [(r[key][2], r[key][1]) for r in rounds]
            entry["cold_over_unmarked_warm"] = spread([c.images_per_s / u.images_per_s for u, c in unmarked])
            entry["unmarked_warm_over_warm"] = spread([r[key][2].images_per_s / r[key][0].images_per_s for r in rounds])
            entry["cold_ms_per_mb_over_unmarked"] = extra_cpu_per_mb(unmarked, megabytes)
    return out


def summarize_peers(rounds: list[dict]) -> dict:
    """Per setting: WebDataset streaming, and each dlstore variant's cold epoch against it."""
    out: dict = {}
    for setting in (s for s, v in rounds[0] if v == PEER):
        out[setting] = {
            "webdataset_img_s": spread([r[setting, PEER][0].images_per_s for r in rounds]),
            "webdataset_first_batch_s": spread([r[setting, PEER][0].first_batch_s for r in rounds]),
            "dlstore_cold_over_webdataset": {
                v: spread([r[s, v][1].images_per_s / r[s, PEER][0].images_per_s for r in rounds])
                for s, v in rounds[0] if s == setting and v != PEER
            },
        }  # fmt: skip
    return out


def span(values: dict, fmt: str = "{:.3f}") -> str:
    return Spread.of(values["runs"]).text(fmt)


def print_loader_report(report: dict) -> None:
    print(f"one epoch of {report['images']} images in {report['shards']} shards (~{report['shard_mb']:.0f} MB), "
          f"batch {report['batch_size']}, {report['workers']} {report['engine']}, {report['rounds']} rounds; "
          + (f"store on cores {report['store_cores']}, the loader on the rest; " if report["store_cores"] else "")
          + "median [min .. max]")  # fmt: skip
    print(f"  {'setting | fetch':<46} {'cold/warm':<22} {'after 1st batch':<22} {'cold 1st batch s':<22}"
          f" {'warm img/s':>10} {'cold img/s':>10}  loader CPU cold/warm   store CPU/warm loader CPU   connections")  # fmt: skip
    for name, res in report["settings"].items():
        print(f"  {name:<46} {span(res['cold_over_warm'])}   {span(res['after_first_batch_cold_over_warm'])}"
              f"   {span(res['cold_first_batch_s'], '{:.2f}')}   {res['warm_img_s']['median']:>10.0f}"
              f" {res['cold_img_s']['median']:>10.0f}  {res['cold_over_warm_cpu_s']['median']:>20.2f}"
              f"  {res['cold_store_cpu_over_warm_cpu']['median']:>26.2f}   {res['cold_most_connections'] or '-':>11}")  # fmt: skip
        kinds = ", ".join(f"{kind} {value['median']:.2f} ms" for kind, value in res["cold_ms_per_mb"].items())
        print(f"      cold - warm CPU per MB of shards (this process's threads; medians): {kinds}")
        if "cold_over_unmarked_warm" in res:
            kinds = ", ".join(f"{k} {v['median']:.2f} ms" for k, v in res["cold_ms_per_mb_over_unmarked"].items())
            print(f"      warm first epoch (decode marks cleared)/warm {span(res['unmarked_warm_over_warm'])};"
                  f" cold/warm first epoch {span(res['cold_over_unmarked_warm'])}; CPU per MB beyond it: {kinds}")  # fmt: skip
    if report["peers"]:
        print("WebDataset streaming the same shards from the same Swift (pipe:curl, no cache: every epoch cold)")
        for setting, res in report["peers"].items():
            img, first = res["webdataset_img_s"], res["webdataset_first_batch_s"]
            ratios = "  ".join(f"dlstore cold ({v}) / webdataset {span(r, '{:.2f}')}"
                               for v, r in res["dlstore_cold_over_webdataset"].items())  # fmt: skip
            print(f"  {setting:<18} {span(img, '{:.0f}')} img/s  first batch {first['median']:.2f} s   {ratios}")


def loader_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.cold loader", description="Loader epochs, cold against warm.")
    add = parser.add_argument
    add("--images", type=int, default=2000, help="images (default 2000)")
    add("--shards", type=int, default=6, help="shards (default 6: ~32 MB each)")
    add("--batch-size", type=int, default=128)
    add("--workers", type=int, default=2, help="decode threads (default 2)")
    add("--engine", default="threads", help="the loader's engine: threads (default) or processes")
    add("--image-size", type=int, default=224)
    add("--rounds", type=int, default=3, help="rounds (default 3)")
    add("--rates", default="10MB,40MB,200MB", help="per-connection rates of the emulator")
    add("--link-rate", help="the emulator's cap on all connections together, e.g. 80MB (default: none)")
    add("--delay-ms", type=float, default=5.0, help="emulator delay per request (default 5)")
    add("--fetch", action="append", help='fetch settings of the cold loaders, e.g. "fetch_parts=4"; repeat to compare')
    add("--checksums", default=DEFAULT_ALGORITHM, help="the datasets' checksum algorithms, comma-separated")
    add("--workdir", help="where the generated data is kept between runs (default: a temp dir)")
    add("--env-file", help="env.sh from tests/support/swift_server.py (default: the environment)")
    add("--store-cores", help='cores for the local Swift and the emulators, e.g. "1"; the loader gets the rest')
    add("--peers", action="store_true", help="also WebDataset streaming the shards from Swift (pipe:curl)")
    add("--unmarked-warm", action="store_true", help="also a warm epoch with the cache's decode marks cleared")
    add("--unchecked-too", action="store_true", help="also each dataset converted with --no-check-decode")
    add("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.store_cores:
        store_side.store_cores(args.store_cores)  # refused before any work
    args.env, args.wan_pids, args.batch_timeout = store_env(args.env_file), [], 600
    with tempfile.TemporaryDirectory(prefix="dlstore-bench-cold-") as tmp:
        data = prepare_data(Path(args.workdir or tmp), args.images, args.shards)
        checks = (True, False) if args.unchecked_too else (True,)
        urls = {algorithm + ("" if check else " unchecked"): upload_to_swift(
                    data.store_dir.parents[1], dict(args.env), -(-args.images // args.shards), algorithm, check)[0]
                for algorithm in args.checksums.split(",") for check in checks}  # fmt: skip
        sizes = [p.stat().st_size for p in data.store_dir.glob("*.tar")]
        if args.peers:  # webdataset's faster decoder on these images
            args.wds_decode = pipelines.fastest_decodes(data, args)["webdataset"][0]
        rounds = loader_rounds(urls, args.env, args, tmp)
    report = {"images": args.images, "shards": len(sizes), "shard_mb": statistics.mean(sizes) / 1e6,
              "batch_size": args.batch_size, "workers": args.workers, "engine": args.engine, "rounds": args.rounds,
              "delay_ms": args.delay_ms, "store_cores": args.store_cores,
              "settings": summarize_loader(rounds, sum(sizes) / 1e6),
              "peers": summarize_peers(rounds) if args.peers else None}  # fmt: skip
    print_loader_report(report)
    write_json(args.json, report)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "loader":
        return loader_main(argv[1:])
    return shard_main(argv[1:] if argv and argv[0] == "shard" else argv)


if __name__ == "__main__":
    sys.exit(main())
