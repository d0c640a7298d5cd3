"""Can dlstore feed the GPU? The model's synthetic rate next to `dlstore train` fed from shards.

The default run:

1. data: ImageNet-like JPEGs, 500x375 by default, converted into shards in a local store.
   ``--stored full,341`` also converts them shrunk to 341 px on the long side.
2. demand: `measure_training_rate`, the trainer's step on one batch kept on the device.
3. fed: `dlstore.train.main` on the shards for ``--steps`` steps, once per decode mode
   and engine. Its metrics after ``--skip-steps`` give img/s and the share of time the
   loop waited for data. Each epoch's first record holds the workers' restart, so it is
   left out; the rate with it is reported too.
4. the table: synthetic, fed, fed / synthetic (goal >= 0.95), data stall.

``workers``: decode threads against worker processes at each worker count, on this
box's CPU. Threads share one GIL, so many of them meet; the sweep finds where
processes win. ``--step-ms`` makes the loop wait after each batch as a GPU step would,
and the report adds the pause at each epoch start.

Examples::

    python -m benchmarks.gpu --json bench_gpu.json
    python -m benchmarks.gpu workers --workers 2,4,8,14 --images 4000 --rounds 1
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from . import pipelines
from .data import make_images, prepare_data
from .pipelines import Candidate
from .runner import Spread, interleave, machine, workdir, write_json

ENGINES = ("threads", "processes")


# -- fed against synthetic -------------------------------------------------------------------------
def make_dataset(root: Path, images: int, classes: int, size: tuple[int, int], procs: int) -> Path:
    """An ImageFolder train tree of generated JPEGs; a tree of the same settings is reused."""
    train = root / "source" / "train"
    made = root / "source" / "made.json"  # written last: a tree without it is half made
    settings = json.dumps({"images": images, "classes": classes, "size": list(size)})
    if not made.exists() or made.read_text() != settings:
        shutil.rmtree(root / "source", ignore_errors=True)
        shutil.rmtree(root / "store", ignore_errors=True)
        make_images(train, images, classes, size, procs)
        made.write_text(settings)
    return train


def convert_dataset(train: Path, root: Path, stored: str, procs: int) -> str:
    """`train` in shards: as it is ("full"), or shrunk to `stored` px on the long side."""
    from dlstore.convert import ConvertOptions, convert

    max_side = None if stored == "full" else int(stored)
    url = f"file://{root}/store/train" + ("" if max_side is None else f"-max{max_side}")
    convert("imagefolder", train, url, ConvertOptions(shard_size=64 * 10**6, workers=procs, resize_max_side=max_side))
    return url


class EngineLog(logging.Handler):
    """The engine the trainer's loader for `url` ran, read from its log line."""

    def __init__(self, url: str) -> None:
        super().__init__(logging.INFO)
        self.prefix, self.engine = f"{url}: engine ", None
        self.logger = logging.getLogger("dlstore.train.loop")

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(self.prefix):
            self.engine = message[len(self.prefix) :].split(",")[0]

    def __enter__(self) -> EngineLog:
        self.level_before = self.logger.level
        self.logger.setLevel(min(self.level_before or logging.INFO, logging.INFO))
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)


def rate_of(records: list[dict], batch_size: int) -> dict:
    """img/s over `records`, and the share of their time the loop waited for a batch."""
    wall = sum(r["samples"] / r["img_per_s"] for r in records)
    waited = sum(r["data_wait_pct"] / 100 * r["samples"] / r["img_per_s"] for r in records)
    samples = sum(r["samples"] for r in records)
    return {"images_per_s": samples / wall if wall else None, "data_wait_pct": 100 * waited / wall if wall else None,
            "steps_timed": round(samples / batch_size)}  # fmt: skip


def fed_rate(url: str, root: Path, args, mode: str, engine: str) -> dict:
    """`dlstore train` from the shards, decoding on `mode`: worker, or device[:decoder]."""
    from dlstore.config import DataConfig
    from dlstore.train import TrainConfig, main, read_metrics

    decode_on, _, decoder = mode.partition(":")
    out = root / f"run-{url.rsplit('/', 1)[-1]}-{decode_on}-{decoder or 'torchvision'}-{engine}"
    shutil.rmtree(out, ignore_errors=True)  # an earlier run is not resumed
    data = DataConfig.from_env(url, batch_size=args.batch_size, workers=args.workers, cache_dir=str(root / "cache"),
                               decode_on=decode_on, device_decoder=decoder or "torchvision")  # fmt: skip
    cfg = TrainConfig(data, output_dir=str(out), model=args.model, device=args.device, compile=args.compile,
                      engine=engine, epochs=10**6, max_steps=args.steps, warmup_epochs=0, log_every=10,
                      progress=False, tensorboard=False)  # fmt: skip
    started = time.perf_counter()
    with EngineLog(url) as used:
        code = main(cfg)
    if code != 0:
        raise SystemExit(f"training with decode on {mode}, engine={engine} exited {code}")
    records = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["split"] == "train"]
    timed = [r for r in records if r["step"] > args.skip_steps and r.get("img_per_s")]
    # A short epoch's first window holds the workers' restart; a real epoch would hide it.
    within = [r for r, before in zip(records[1:], records) if r in timed and r["epoch"] == before["epoch"]]
    if not within:
        raise SystemExit(f"no metrics record after step {args.skip_steps} within an epoch: more --steps")
    return {"decode_on": mode, "engine": engine, "engine_used": used.engine, **rate_of(within, args.batch_size),
            "with_epoch_starts": rate_of(timed, args.batch_size), "run_seconds": time.perf_counter() - started,
            "records": records}  # fmt: skip


def print_fed_table(result: dict, demand, args) -> None:
    print(f"\n{result['machine']['gpu']}, {result['machine']['cores']} cores, {args.model} batch {args.batch_size}, "
          f"{args.workers} workers")  # fmt: skip
    print(f"  {'run':<40}{'img/s':>10}{'/ synthetic':>13}{'waited for data':>17}")
    print(f"  {'synthetic (no data path)':<40}{demand.images_per_s:>10,.0f}{1:>13.3f}{'-':>17}")
    for fed in result["fed"]:
        size = "full size" if fed["stored"] == "full" else f"max side {fed['stored']}"
        label = f"{size}, decode on {fed['decode_on']}, {fed['engine_used']}"
        print(f"  {label:<40}{fed['images_per_s']:>10,.0f}{fed['vs_synthetic']:>13.3f}{fed['data_wait_pct']:>16.1f}%")
    print("  goal: dlstore-fed >= 0.95 of synthetic")


def fed_main(argv: list[str]) -> int:
    cores = len(os.sched_getaffinity(0))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--images", type=int, default=8000)
    add("--classes", type=int, default=100)
    add("--image-width", type=int, default=500)
    add("--image-height", type=int, default=375)
    add("--model", default="resnet50")
    add("--batch-size", type=int, default=256)
    add("--workers", type=int, default=max(1, cores - 2), help="default: cores - 2")
    add("--steps", type=int, default=150, help="training steps per fed run")
    add("--skip-steps", type=int, default=40, help="warm-up steps left out of the rates")
    add("--demand-steps", type=int, default=30)
    add("--compile", action="store_true", help="torch.compile the model (both sides)")
    add("--device", default="cuda", help="cuda (default), or cpu for a dry run of this script")
    add("--decode", default="worker,device", help="decode modes: worker, device, device:torchvision, device:nvimgcodec")
    add("--engines", default="auto", help="loader engines to run (auto, threads, processes), comma-separated")
    add("--stored", default="full", help="stored image sizes, comma-separated: full, or a long side in px")
    add("--workdir", help="keep the data here (default: a temp dir, removed afterwards)")
    add("--json", metavar="FILE")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this benchmark measures a GPU (--device cpu for a dry run)", file=sys.stderr)
        return 2
    from dlstore.train import measure_training_rate

    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "none (CPU)"
    result: dict = {"machine": machine(gpu=gpu, torch=torch.__version__),
                    "settings": {k: v for k, v in vars(args).items() if k not in ("json", "workdir")}}  # fmt: skip
    with workdir(args.workdir, "dlstore-bench-gpu-") as root:
        started, procs = time.perf_counter(), min(cores, 16)
        train = make_dataset(root, args.images, args.classes, (args.image_width, args.image_height), procs)
        urls = {stored: convert_dataset(train, root, stored, procs) for stored in args.stored.split(",")}
        result["data_seconds"] = time.perf_counter() - started
        print(f"data: {', '.join(urls.values())} in {result['data_seconds']:.0f} s", flush=True)
        demand = measure_training_rate(args.model, batch_size=args.batch_size, device=args.device,
                                       compile=args.compile, steps=args.demand_steps,
                                       warmup_steps=min(10, args.demand_steps))  # fmt: skip
        result["synthetic"] = demand.to_dict()
        print(f"synthetic: {demand.images_per_s:,.0f} img/s ({demand.precision}, channels_last)", flush=True)
        result["fed"] = []
        for (stored, url), mode, engine in itertools.product(urls.items(), args.decode.split(","),
                                                             args.engines.split(",")):  # fmt: skip
            fed = fed_rate(url, root, args, mode, engine)
            fed["stored"], fed["vs_synthetic"] = stored, fed["images_per_s"] / demand.images_per_s
            result["fed"].append(fed)
            print(f"fed, {stored} images, decode on {mode}, {engine} ({fed['engine_used']}): "
                  f"{fed['images_per_s']:,.0f} img/s = {fed['vs_synthetic']:.3f} of synthetic, "
                  f"loop waited for data {fed['data_wait_pct']:.1f}% of the time "
                  f"(with epoch starts: {fed['with_epoch_starts']['images_per_s']:,.0f} img/s)", flush=True)  # fmt: skip
    print_fed_table(result, demand, args)
    write_json(args.json, result)
    return 0


# -- workers: threads against processes ------------------------------------------------------------
def stepped(candidate: Candidate, step_s: float) -> Candidate:
    """The batches with a loop that waits `step_s` after each, using no CPU: a GPU's step."""
    if not step_s:
        return candidate

    def batches(epoch: int):
        for batch in candidate.batches(epoch):
            yield batch
            time.sleep(step_s)

    return Candidate(batches, candidate.close)


def workers_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.gpu workers", description="Decode threads against processes.")
    add = parser.add_argument
    add("--workers", default="1,2,4,8", help="worker counts, comma-separated")
    add("--images", type=int, default=2000)
    add("--shards", type=int, default=16)
    add("--rounds", type=int, default=2)
    add("--epochs", type=int, default=1, help="timed epochs per run, after 1 warm-up epoch")
    add("--batch-size", type=int, default=256)
    add("--step-ms", type=float, default=0.0, help="the loop waits this long after each batch")
    add("--workdir", help="keep the data here and reuse it (default: a temp dir)")
    add("--json", metavar="FILE")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.workers.split(",")]
    started = time.perf_counter()
    with workdir(args.workdir, "dlstore-bench-workers-") as root:
        data = prepare_data(root, args.images, args.shards)
        print(f"data: {args.images} JPEGs in {args.shards} shards, ready in {time.perf_counter() - started:.0f} s")

        def run(n: int, engine: str):
            options = argparse.Namespace(workers=n, batch_size=args.batch_size, image_size=224, batch_timeout=300.0)
            make = lambda: stepped(pipelines.dlstore_candidate(data, options, engine), args.step_ms / 1000)  # noqa: E731
            return pipelines.time_run(make, args.epochs)

        def said(number: int, got: dict) -> None:
            for (n, engine), times in got.items():
                print(f"round {number + 1}: {n} workers, {engine}: {times.images_per_s:,.0f} img/s, "
                      f"epoch-start pauses {[round(p, 3) for p in times.pauses_s]} s", flush=True)  # fmt: skip

        runs = {(n, e): (lambda n=n, e=e: run(n, e)) for n in counts for e in ENGINES}
        rounds = interleave(args.rounds, runs, done=said)
    step = f", a {args.step_ms:g} ms step per batch" if args.step_ms else ""
    print(f"\n{len(os.sched_getaffinity(0))} cores, batch {args.batch_size}{step}, median [min .. max] "
          f"over {args.rounds} rounds")  # fmt: skip
    print(f"  {'workers':>7}  {'threads img/s':>22}  {'processes img/s':>22}  {'processes / threads':>22}")
    summary = []
    for n in counts:
        rates = {e: [r[n, e].images_per_s for r in rounds] for e in ENGINES}
        pauses = {e: [statistics.median(r[n, e].pauses_s[1:] or r[n, e].pauses_s) for r in rounds] for e in ENGINES}
        ratios = [p / t for t, p in zip(rates["threads"], rates["processes"])]
        summary.append({"workers": n, **rates, "processes_over_threads": ratios, "pauses_s": pauses})
        cells = [Spread.of(rates["threads"]).text("{:,.0f}"), Spread.of(rates["processes"]).text("{:,.0f}"),
                 Spread.of(ratios).text("{:.2f}")]  # fmt: skip
        print(f"  {n:>7}  " + "  ".join(f"{c:>22}" for c in cells))
    each = f"; one step is {args.step_ms / 1000:g} s" if args.step_ms else ""
    print(f"\n  epoch-start pause, s (median per run, the warm-up's left out{each}): threads, processes")
    for row in summary:
        cells = [Spread.of(row["pauses_s"][e]).text("{:.3f}") for e in ENGINES]
        print(f"  {row['workers']:>7}  " + "  ".join(f"{c:>22}" for c in cells))
    print(f"took {time.perf_counter() - started:.0f} s")
    write_json(args.json, {"cores": len(os.sched_getaffinity(0)), "settings": vars(args), "runs": summary})
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return workers_main(argv[1:]) if argv and argv[0] == "workers" else fed_main(argv)


if __name__ == "__main__":
    sys.exit(main())
