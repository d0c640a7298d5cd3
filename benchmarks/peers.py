"""dlstore against its peers on the same JPEGs, the same box and the same settings.

Each round runs these one after the other, the order rotated from round to round:

* single_core: dlstore's decode and augment stages in this process, no loader.
  Times the cores, it is the goal's ceiling.
* parallel_processes: the same work in one forked process per core: what this box
  gives for perfectly parallel work.
* dlstore_threads, dlstore_processes: `dlstore.Loader` with each engine, uint8 on the CPU.
* webdataset: its usual pipeline over the very shard files, in a `WebLoader`.
* folder: torchvision's `ImageFolder` over the source JPEGs, in a `DataLoader`.
* dlstore_threads_whole_decode, with `--whole-decode-too`: no crop-only decode.

Each peer decodes with Pillow or torchvision, whichever is faster here.
Both peers augment with torchvision's RandomResizedCrop and flip.
Every loader has the same workers and batch size, and warm caches.
Last, each engine's peak RSS during an epoch runs in a fresh process of its own.

Example (reuses the data under --workdir)::

    python -m benchmarks.peers --workdir /tmp/peers --json peers.json
    python -m benchmarks.peers --quick          # a smoke run, about a minute
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torchvision

from dlstore.convert.encode import jpeg_header

from . import pipelines
from .data import Data, prepare_data
from .pipelines import RunTimes
from .runner import PeakRss, interleave, machine, show, spread, tree_pss, tree_rss, workdir, write_json

ENGINES = ("threads", "processes")
QUICK = {"images": 200, "rounds": 2, "epochs": 1, "batch_size": 32, "rss_workers": 2, "single_core_samples": 100,
         "time_limit": 900}  # fmt: skip
ROOT = Path(__file__).resolve().parents[1]


def describe_data(path, samples: list[tuple[int, dict]]) -> dict:
    encoded = [path.image_bytes(sample) for _, sample in samples]
    sizes = [jpeg_header(data)[:2] for data in encoded]
    return {"samples": int(path.shard_sizes.sum()), "shards": len(path.manifest.shards),
            "mean_jpeg_bytes": float(np.mean([len(d) for d in encoded])),
            "mean_width": float(np.mean([w for w, _ in sizes])),
            "mean_height": float(np.mean([h for _, h in sizes]))}  # fmt: skip


def loader_makers(data: Data, args, decodes: dict[str, str]) -> dict:
    makers = {f"dlstore_{e}": (lambda e=e: pipelines.dlstore_candidate(data, args, e)) for e in ENGINES}
    if args.whole_decode_too:
        makers["dlstore_threads_whole_decode"] = lambda: pipelines.whole_decode_candidate(data, args)
    makers["webdataset"] = lambda: pipelines.webdataset_candidate(data, args, decodes["webdataset"])
    makers["folder"] = lambda: pipelines.folder_candidate(data, args, decodes["folder"])
    return makers


def rss_of_engine(data: Data, args) -> dict:
    """In this fresh process: the peak RSS during one epoch, after a warm-up epoch."""
    before = tree_rss()
    options = argparse.Namespace(**{**vars(args), "workers": args.rss_workers})
    candidate = pipelines.dlstore_candidate(data, options, args.rss_child)
    try:
        pipelines.epoch_marks(candidate.batches, 0)
        with PeakRss() as peak:
            pipelines.epoch_marks(candidate.batches, 1)
        pss, pss_private = tree_pss()
    finally:
        candidate.close()
    return {"engine": args.rss_child, "workers": args.rss_workers, "before_loader_mb": before / 1e6,
            "peak_rss_mb": peak.peak / 1e6, "pss_after_epoch_mb": pss / 1e6,
            "pss_anon_shmem_mb": pss_private / 1e6}  # fmt: skip


def rss_in_fresh_process(args, root: Path, engine: str, seconds: float) -> dict:
    """`rss_of_engine` in a new Python process, so nothing this one holds is counted."""
    command = [sys.executable, "-m", "benchmarks.peers", "--rss-child", engine, "--workdir", str(root)]
    for name in ("images", "shards", "batch_size", "image_size", "rss_workers", "batch_timeout"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    command += ["--time-limit", str(max(30, int(seconds)))]
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 30, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"the RSS run of the {engine} engine failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(rounds: list[dict[str, RunTimes]], cores: int) -> tuple[dict, dict]:
    """Each measure's spread over rounds, and the ratios taken within each round."""
    loaders = pipelines.summarize_runs(rounds)
    for name in ("single_core", "parallel_processes"):
        loaders[name] = {key: loaders[name][key] for key in ("images_per_s", "cpu_ms_per_image")}
    ratios = {}
    for name in (n for n in rounds[0] if n.startswith("dlstore_")):
        for peer, scale in (("webdataset", 1), ("folder", 1), ("single_core", cores), ("parallel_processes", 1)):
            label = "cores x single_core" if scale != 1 else peer
            ratios[f"{name} / {label}"] = spread(
                [r[name].images_per_s / (r[peer].images_per_s * scale) for r in rounds]
            )
        for peer in ("webdataset", "folder"):
            values = [r[name].within_epochs_images_per_s / r[peer].within_epochs_images_per_s for r in rounds]
            ratios[f"{name} / {peer}, within epochs"] = spread(values)
    ratios["parallel_processes / cores x single_core"] = spread(
        [r["parallel_processes"].images_per_s / (r["single_core"].images_per_s * cores) for r in rounds]
    )
    return loaders, ratios


def print_report(results: dict) -> None:
    cores, loaders = results["machine"]["cores"], results["loaders"]
    pipelines.print_runs(loaders, results["settings"]["rounds"])
    ceiling = [cores * v for v in loaders["single_core"]["images_per_s"]["runs"]]
    print(show(f"ceiling: {cores} cores x single_core img/s", ceiling, fmt="{:.0f}"))
    print("\nratios, each taken within one round")
    for label, values in results["ratios"].items():
        print(show(label, values["runs"]))
    print("\ndlstore's resident memory during one epoch, summed over the process and its children")
    for rss in results["rss"].values():
        print(f"  {rss['engine']:<9} x{rss['workers']}: peak RSS {rss['peak_rss_mb']:7.0f} MB "
              f"(before the loader {rss['before_loader_mb']:.0f} MB); PSS after the epoch "
              f"{rss['pss_after_epoch_mb']:.0f} MB, {rss.get('pss_anon_shmem_mb', 0):.0f} MB without file pages")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--images", type=int, default=5000, help="JPEGs generated (10 classes)")
    add("--shards", type=int, help="a multiple of --workers; default: the first from 8")
    add("--rounds", type=int, default=3, help="rounds of interleaved runs")
    add("--epochs", type=int, default=3, help="timed epochs per run, after 1 warm-up epoch")
    add("--workers", type=int, default=2, help="decode threads / worker processes of every loader")
    add("--batch-size", type=int, default=256)
    add("--image-size", type=int, default=224)
    add("--rss-workers", type=int, default=8, help="threads / worker processes of the RSS runs")
    add("--single-core-samples", type=int, default=1000, help="samples the single-core rate decodes")
    add("--batch-timeout", type=float, default=300.0, help="seconds a loader may take for a batch")
    add("--time-limit", type=float, default=3600.0, help="the whole run ends, with tracebacks, after this")
    add("--workdir", help="keep the data here and reuse it (default: a temp dir, removed afterwards)")
    add("--json", metavar="FILE", help="also write the results as JSON")
    add("--quick", action="store_true", help="tiny sizes for a smoke run: " + str(QUICK))
    add("--whole-decode-too", action="store_true", help="also the thread engine decoding whole JPEGs")
    add("--rss-child", choices=ENGINES, help=argparse.SUPPRESS)
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**QUICK)  # what the command line gives still wins
    args = parser.parse_args(argv)
    if args.shards is None:
        args.shards = -(-max(8, args.rss_workers) // args.workers) * args.workers
    if min(args.rounds, args.epochs, args.workers, args.batch_size, args.shards, args.rss_workers) < 1:
        parser.error("--rounds, --epochs, --workers, --batch-size, --shards and --rss-workers must be at least 1")
    if args.shards % args.workers:
        parser.error(f"--shards {args.shards}: not a multiple of --workers {args.workers}, so some WebDataset "
                     "workers would get a shard more than others and the epoch would wait for them")  # fmt: skip
    if args.images < 10 * args.shards:
        parser.error("--images: at least 10 per shard")
    return args


def run_benchmark(args, root: Path, deadline: float) -> dict:
    started = time.perf_counter()
    facts = machine(torch=torch.__version__, torchvision=torchvision.__version__)
    data = prepare_data(root, args.images, args.shards)
    path, samples = pipelines.read_all_samples(data.url, data.cache_dir, args.image_size, args.single_core_samples)
    pipelines.warm_caches(path, data)
    described = describe_data(path, samples)
    picks = pipelines.fastest_decodes(data, args)
    tried = "; ".join(f"{peer} decodes with {pick[0]!r} ("
                      + ", ".join(f"{k} {v:.0f} img/s" for k, v in pick[1].items()) + " in one process)"
                      for peer, pick in picks.items())  # fmt: skip
    print(f"{described['samples']:,} samples in {described['shards']} shards, mean JPEG "
          f"{described['mean_jpeg_bytes'] / 1e3:.0f} KB at {described['mean_width']:.0f}x{described['mean_height']:.0f}, "
          f"ready in {time.perf_counter() - started:.0f} s; batch {args.batch_size}, {args.workers} workers, "
          f"{facts['cores']} cores; {tried}", flush=True)  # fmt: skip
    makers = loader_makers(data, args, {peer: pick[0] for peer, pick in picks.items()})
    runs = {"single_core": lambda: pipelines.single_core_rate(path, samples),
            "parallel_processes": lambda: pipelines.ceiling_rate(path, samples, facts["cores"]),
            **{name: (lambda make=make: pipelines.time_run(make, args.epochs)) for name, make in makers.items()}}  # fmt: skip

    rounds = interleave(args.rounds, runs, done=pipelines.print_rates)
    rss = {e: rss_in_fresh_process(args, root, e, deadline - time.monotonic()) for e in ENGINES}
    loaders, ratios = summarize(rounds, facts["cores"])
    return {"machine": facts, "settings": {k: v for k, v in vars(args).items() if k not in ("json", "workdir", "rss_child")},
            "data": described, "peer_decodes": {p: {"chosen": c, "one_process_images_per_s": r} for p, (c, r) in picks.items()},
            "rounds": [{name: run._asdict() for name, run in r.items()} for r in rounds],
            "loaders": loaders, "ratios": ratios, "rss": rss, "seconds": time.perf_counter() - started}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = time.monotonic() + args.time_limit
    faulthandler.dump_traceback_later(args.time_limit, exit=True)  # past the limit: every stack, and exit
    try:
        with workdir(args.workdir, "dlstore-bench-peers-") as root:
            if args.rss_child:
                print(json.dumps(rss_of_engine(prepare_data(root, args.images, args.shards), args)))
                return 0
            results = run_benchmark(args, root, deadline)
    finally:
        faulthandler.cancel_dump_traceback_later()
    print_report(results)
    print(f"\ntook {results['seconds']:.0f} s")
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
