"""The README's main job on an embedded default: generated data, a local store, the whole flow.

    python -m dlstore demo [--workdir DIR] [--store URL] [--no-train]

1. generates a small ImageNet-style dataset of real JPEGs with class-dependent textures;
2. converts train and val into shards in a `file://` store and verifies them;
3. copies a shard out and back with `copy_object`, which `dlstore cp` runs;
4. streams the shards through the node cache and loader, and reports img/s;
5. trains a ResNet-18 at low resolution for a short run from those shards, and
6. prints the loader-vs-GPU-demand verdict of `dlstore bench --quick`.
The same flow works against Swift or S3: give `--store swift://container/demo`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

from dlstore.bench import BenchConfig, format_report, run_bench
from dlstore.config import DataConfig, writable_dir
from dlstore.convert import ConvertOptions, convert, verify_dataset
from dlstore.dataset import Dataset
from dlstore.demo.datagen import make_imagenet
from dlstore.errors import ConfigError
from dlstore.loader import Loader
from dlstore.storage import open_object, open_store
from dlstore.storage.transfer import copy_object
from dlstore.train.config import TrainConfig
from dlstore.train.loop import main as train_main
from dlstore.world import World

__all__ = ["DemoConfig", "run_demo"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoConfig:
    workdir: str = ""  # default: a fresh temporary folder, removed afterwards
    store_url: str = ""  # default: file://<workdir>/store
    num_classes: int = 4
    train_per_class: int = 64
    val_per_class: int = 16
    image_px: tuple[int, int] = (160, 128)
    epochs: int = 2
    # The data settings of the loader and the trainer; the URL and cache are the demo's own.
    data: DataConfig = field(
        default_factory=lambda: DataConfig("", batch_size=32, image_size=64, workers=2, cache_limit="1GB")
    )
    train: bool = True

    def __post_init__(self) -> None:
        # Checked before the images are made, not minutes later where they are used.
        if self.train and self.epochs < 1:
            raise ConfigError(f"epochs must be at least 1, not {self.epochs} (no training: --no-train)")
        if min(self.num_classes, self.train_per_class, self.val_per_class) < 1:
            raise ConfigError("the demo needs at least one class and one image per class and split")

    def data_for(self, url: str, workdir: str) -> DataConfig:
        """`data` for the dataset at `url`, cached under `workdir`, the environment read once."""
        return self.data.replace(url=url, cache_dir=os.path.join(workdir, "cache")).resolved()


def _say(text: str) -> None:
    # The demo is a walk-through for a terminal: its steps are printed, not logged.
    print(f"[demo] {text}", flush=True)


def run_demo(cfg: DemoConfig) -> dict:
    """Run the flow above, print what it measured, and return it.

    >>> run_demo(DemoConfig(train=False))["loader_img_s"]   # doctest: +SKIP
    1483.0
    """
    if cfg.store_url:
        open_store(cfg.store_url)  # a bad URL fails now, before the images are made
    own_workdir = not cfg.workdir
    workdir = writable_dir(cfg.workdir, "--workdir") if cfg.workdir else tempfile.mkdtemp(prefix="dlstore-demo-")
    store_url = cfg.store_url or f"file://{os.path.abspath(workdir)}/store"
    results: dict = {"store": store_url}
    try:
        started = time.perf_counter()
        _generate(cfg, workdir)
        results.update(_convert(cfg, workdir, store_url))
        _copy_round_trip(store_url, workdir)
        results["loader_img_s"] = _loader_rate(cfg, store_url, workdir)
        _say(f"loader: {results['loader_img_s']:.0f} img/s at {cfg.data.image_size} px with {cfg.data.workers} workers")
        if cfg.train:
            results.update(_train(cfg, store_url, workdir))
        report = run_bench(BenchConfig.quick(f"{store_url}/train", image_size=cfg.data.image_size))
        print(format_report(report), flush=True)
        if report.verdict is not None:
            results["bench_ratio"] = report.verdict.ratio
        results["seconds"] = time.perf_counter() - started
        _say(f"done in {results['seconds']:.0f} s")
        return results
    finally:
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def _generate(cfg: DemoConfig, workdir: str) -> None:
    source = os.path.join(workdir, "source")
    make_imagenet(
        source,
        num_classes=cfg.num_classes,
        train_per_class=cfg.train_per_class,
        val_per_class=cfg.val_per_class,
        image_size=cfg.image_px,
        val_layout="folders",
    )
    _say(f"generated {cfg.num_classes * (cfg.train_per_class + cfg.val_per_class)} JPEGs in {source}")


def _convert(cfg: DemoConfig, workdir: str, store_url: str) -> dict:
    results = {}
    source = os.path.join(workdir, "source")
    for split in ("train", "val"):
        summary = convert(
            "imagenet", source, f"{store_url}/{split}", ConvertOptions(split=split, samples_per_shard=48, seed=0)
        )
        report = verify_dataset(f"{store_url}/{split}", deep=True)
        if not report.ok:
            raise RuntimeError(f"verify failed: {report.problems[:3]}")
        _say(f"converted {split}: {summary.samples} samples in {summary.shards} shards, verified")
        results[f"{split}_samples"] = summary.samples
    return results


def _copy_round_trip(store_url: str, workdir: str) -> None:
    """A shard out of the store to a local file and back under another name: the bytes must match."""
    store = open_store(f"{store_url}/train")
    first = next(info for info in store.list("shard-") if info.key.endswith(".tar"))
    local_copy = os.path.join(workdir, "copy.tar")
    copy_object(store, first.key, local_copy)
    copy_object(*open_object(local_copy), store.join("roundtrip.tar"))
    same = store.get_bytes("roundtrip.tar") == store.get_bytes(first.key)
    store.delete("roundtrip.tar")
    if not same:
        raise RuntimeError("cp round trip changed the bytes")
    _say(f"cp round trip of {first.key} ({first.size} bytes): identical")


def _loader_rate(cfg: DemoConfig, store_url: str, workdir: str) -> float:
    ds = Dataset(cfg.data_for(f"{store_url}/train", workdir), world=World())
    loader = Loader(ds, device="cpu")
    count, started = 0, time.perf_counter()
    for images, _ in loader:
        count += images.shape[0]
    return count / (time.perf_counter() - started)


def _train(cfg: DemoConfig, store_url: str, workdir: str) -> dict:
    config = TrainConfig(
        cfg.data_for(f"{store_url}/train", workdir),
        val_url=f"{store_url}/val",
        output_dir=os.path.join(workdir, "run"),
        model="resnet18",
        epochs=cfg.epochs,
        base_lr=0.4,
        warmup_epochs=0.5,
        checkpoint_url=f"{store_url}/checkpoints/demo",
        checkpoint_every_minutes=0,
        progress=False,
        tensorboard=False,
    )
    if train_main(config) != 0:
        raise RuntimeError("training stopped before the end")
    with open(os.path.join(config.output_dir, "metrics.jsonl")) as file:
        records = [json.loads(line) for line in file]
    train_steps = [r for r in records if r["split"] == "train"]
    val = [r for r in records if r["split"] == "val"]
    for r in val:
        _say(f"epoch {r['epoch']}: val top-1 {r['top1']:.2f} (chance {1 / cfg.num_classes:.2f}), loss {r['loss']:.3f}")
    rate = sum(r.get("img_per_s") or 0 for r in train_steps) / max(len(train_steps), 1)
    _say(
        f"trained resnet18 at {cfg.data.image_size} px for {cfg.epochs} epochs on the CPU, ~{rate:.0f} img/s; "
        f"checkpoints in {config.checkpoint_url}"
    )
    return {"val_top1": val[-1]["top1"] if val else None, "train_img_s": rate}
