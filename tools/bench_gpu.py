#!/usr/bin/env python3
"""Can dlstore feed the GPU? The model's training rate on synthetic data next to the rate of
`dlstore train` reading the same model's batches from shards, with JPEG decode in CPU workers
and on the GPU (nvJPEG).

1. data: an ImageNet-like train set (default 8,000 JPEGs of 500x375, ~130 KB, like
   ImageNet's average) made by `dlstore.demo.datagen` in parallel, converted into shards in a
   local store (a warm node cache reads the same way); `--stored full,341` also converts them
   shrunk to 341 px on the long side (`dlstore convert --resize-max-side 341`) and runs both;
2. demand: `measure_training_rate`, the trainer's own step on one synthetic batch kept on the
   device (no data path at all);
3. fed: `dlstore.train.main` on the shards for `--steps` steps, once per decode mode; its
   metrics records after the first `--skip-steps` steps give img/s and the share of time
   the loop waited for data (each epoch's first record, which holds the workers' restart,
   left out; the rate with it is reported too);
4. the table: synthetic, fed, fed / synthetic (goal >= 0.95), data stall.

Example (one GPU node; about 5 minutes on an H100 with 16 cores)::

    python tools/bench_gpu.py --json bench_gpu.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_loader import make_images  # noqa: E402


def make_dataset(workdir: Path, images: int, classes: int, size: tuple[int, int], procs: int) -> Path:
    """`images` generated JPEGs of `size` in `classes` classes, an ImageFolder-like train tree
    under `workdir/source/train`. A tree made with the same settings is reused; another or a
    half-made one is made anew."""
    train = workdir / "source" / "train"
    made = workdir / "source" / "made.json"  # written last: a tree without it is half made
    settings = json.dumps({"images": images, "classes": classes, "size": list(size)})
    if not made.exists() or made.read_text() != settings:
        shutil.rmtree(workdir / "source", ignore_errors=True)
        shutil.rmtree(workdir / "store", ignore_errors=True)
        make_images(train, images, classes, size, procs)
        made.write_text(settings)
    return train


def convert_dataset(train: Path, workdir: Path, stored: str, procs: int) -> str:
    """`train` converted into shards as `dlstore convert` would: as it is (`stored` "full"), or
    with its images shrunk to at most `stored` px on their long side (`--resize-max-side`, how a
    user makes decoding cheaper). A conversion left half done finishes where it stopped."""
    from dlstore.convert import ConvertOptions, convert

    max_side = None if stored == "full" else int(stored)
    url = f"file://{workdir}/store/train" + ("" if max_side is None else f"-max{max_side}")
    convert("imagefolder", train, url, ConvertOptions(shard_size=64 * 10**6, workers=procs, resize_max_side=max_side))
    return url


def fed_rate(url: str, workdir: Path, args, mode: str, engine: str) -> dict:
    """`dlstore train` from the shards; img/s and data wait over the records after warm-up.
    `mode` is where JPEGs are decoded: worker, or device with its decoder (device:torchvision,
    device:nvimgcodec; device alone: torchvision)."""
    from dlstore.config import DataConfig
    from dlstore.train import TrainConfig, main, read_metrics

    decode_on, _, decoder = mode.partition(":")
    out = workdir / f"run-{url.rsplit('/', 1)[-1]}-{decode_on}-{decoder or 'torchvision'}-{engine}"
    shutil.rmtree(out, ignore_errors=True)  # a run of this script before: not resumed
    data = DataConfig.from_env(
        url,
        batch_size=args.batch_size,
        workers=args.workers,
        cache_dir=str(workdir / "cache"),
        decode_on=decode_on,
        device_decoder=decoder or "torchvision",
    )
    cfg = TrainConfig(
        data,
        output_dir=str(out),
        model=args.model,
        device=args.device,
        compile=args.compile,
        engine=engine,
        epochs=10**6,
        max_steps=args.steps,
        warmup_epochs=0,
        log_every=10,
        progress=False,
        tensorboard=False,
    )
    started = time.perf_counter()
    with _EngineLog(url) as used:
        code = main(cfg)
    if code != 0:
        raise SystemExit(f"training with decode on {mode}, engine={engine} exited {code}")
    records = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["split"] == "train"]
    timed = [r for r in records if r["step"] > args.skip_steps and r.get("img_per_s")]
    # Within epochs: each epoch's first window holds the restart of the DataLoader workers
    # (about one batch's decode time). A real epoch (ImageNet: 5,000 steps) hides it; the
    # 30-odd steps of this dataset's epochs would not.
    within = [r for r, before in zip(records[1:], records) if r in timed and r["epoch"] == before["epoch"]]
    if not within:
        raise SystemExit(f"no metrics record after step {args.skip_steps} within an epoch: more --steps")
    return {
        "decode_on": mode,
        "engine": engine,
        "engine_used": used.engine,  # what "auto" chose (threads where /dev/shm is too small)
        **_rate(within, args.batch_size),
        "with_epoch_starts": _rate(timed, args.batch_size),
        "run_seconds": time.perf_counter() - started,
        "records": records,
    }


class _EngineLog(logging.Handler):
    """The engine the trainer's loader for `url` ran, from its log line ("<url>: engine X, ...")."""

    def __init__(self, url: str) -> None:
        super().__init__(logging.INFO)
        self.prefix, self.engine = f"{url}: engine ", None
        self.logger = logging.getLogger("dlstore.train.loop")

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(self.prefix):
            self.engine = message[len(self.prefix) :].split(",")[0]

    def __enter__(self) -> _EngineLog:
        self.level_before = self.logger.level
        self.logger.setLevel(min(self.level_before or logging.INFO, logging.INFO))
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)


def _rate(records: list[dict], batch_size: int) -> dict:
    """img/s over `records` (their samples over their wall time) and the share of that time
    the training loop waited for the next batch (on a GPU partly hidden by queued work)."""
    wall = sum(r["samples"] / r["img_per_s"] for r in records)
    waited = sum(r["data_wait_pct"] / 100 * r["samples"] / r["img_per_s"] for r in records)
    samples = sum(r["samples"] for r in records)
    return {
        "images_per_s": samples / wall if wall else None,
        "data_wait_pct": 100 * waited / wall if wall else None,
        "steps_timed": round(samples / batch_size),
    }


def main(argv: list[str] | None = None) -> int:
    cores = len(os.sched_getaffinity(0))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=8000)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--image-width", type=int, default=500)
    parser.add_argument("--image-height", type=int, default=375)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=max(1, cores - 2), help="default: cores - 2")
    parser.add_argument("--steps", type=int, default=150, help="training steps per fed run")
    parser.add_argument("--skip-steps", type=int, default=40, help="warm-up steps left out of the rates")
    parser.add_argument("--demand-steps", type=int, default=30)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (both sides)")
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu for a dry run of this script")
    parser.add_argument(
        "--decode",
        default="worker,device",
        help="decode modes to run, comma-separated: worker, device (its decoder: torchvision), device:torchvision,"
        " device:nvimgcodec",
    )
    parser.add_argument(
        "--engines", default="auto", help="loader engines to run (auto, threads, processes), comma-separated"
    )
    parser.add_argument(
        "--stored",
        default="full",
        help="stored image sizes to run, comma-separated: full, or a long side in px (convert --resize-max-side)",
    )
    parser.add_argument("--workdir", help="keep the data here (default: a temp dir, removed afterwards)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this benchmark measures a GPU (--device cpu for a dry run)", file=sys.stderr)
        return 2

    from dlstore.train import measure_training_rate

    own = not args.workdir
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dlstore-bench-gpu-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "machine": {
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "none (CPU)",
            "cores": cores,
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "workdir")},
    }
    try:
        started = time.perf_counter()
        procs = min(cores, 16)
        train = make_dataset(workdir, args.images, args.classes, (args.image_width, args.image_height), procs)
        urls = {stored: convert_dataset(train, workdir, stored, procs) for stored in args.stored.split(",")}
        result["data_seconds"] = time.perf_counter() - started
        print(f"data: {', '.join(urls.values())} in {result['data_seconds']:.0f} s", flush=True)

        demand = measure_training_rate(
            args.model,
            batch_size=args.batch_size,
            device=args.device,
            compile=args.compile,
            steps=args.demand_steps,
            warmup_steps=min(10, args.demand_steps),
        )
        result["synthetic"] = demand.to_dict()
        print(f"synthetic: {demand.images_per_s:,.0f} img/s ({demand.precision}, channels_last)", flush=True)

        result["fed"] = []
        runs = itertools.product(urls.items(), args.decode.split(","), args.engines.split(","))
        for (stored, url), mode, engine in runs:
            fed = fed_rate(url, workdir, args, mode, engine)
            fed["stored"] = stored
            fed["vs_synthetic"] = fed["images_per_s"] / demand.images_per_s
            result["fed"].append(fed)
            print(
                f"fed, {stored} images, decode on {mode}, {engine} ({fed['engine_used']}): "
                f"{fed['images_per_s']:,.0f} img/s = {fed['vs_synthetic']:.3f} of synthetic, "
                f"loop waited for data {fed['data_wait_pct']:.1f}% of the time "
                f"(with epoch starts: {fed['with_epoch_starts']['images_per_s']:,.0f} img/s)",
                flush=True,
            )
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)

    print(f"\n{result['machine']['gpu']}, {cores} cores, {args.model} batch {args.batch_size}, {args.workers} workers")
    print(f"  {'run':<40}{'img/s':>10}{'/ synthetic':>13}{'waited for data':>17}")
    print(f"  {'synthetic (no data path)':<40}{demand.images_per_s:>10,.0f}{1:>13.3f}{'-':>17}")
    for fed in result["fed"]:
        size = "full size" if fed["stored"] == "full" else f"max side {fed['stored']}"
        label = f"{size}, decode on {fed['decode_on']}, {fed['engine_used']}"
        print(f"  {label:<40}{fed['images_per_s']:>10,.0f}{fed['vs_synthetic']:>13.3f}{fed['data_wait_pct']:>16.1f}%")
    print("  goal: dlstore-fed >= 0.95 of synthetic")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
