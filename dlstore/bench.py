"""Can the data path feed the accelerator? The loader's rate against the model's demand.

`run_bench` measures, on this machine:

* the **loader side**: img/s and MB/s of `dlstore.Loader` from a cold cache (every shard
  fetched from the store) and from a warm one (every shard already cached), for each batch
  size and worker count asked for; plus where the time goes, stage by stage (fetch, read,
  decode, augment, collate, host-to-device), from one instrumented single-process pass;
* the **demand side**: the training-step rate of the model on synthetic data already on the
  device (`dlstore.train.demand.measure_training_rate`), at the same batch size and precision;
* the **verdict**: delivered ÷ demanded, the data stall to expect, and what would help
  (more workers, GPU decode, smaller stored images), read off the stage split;
* optionally a **scaling table** over process counts (gloo on CPU, NCCL on GPUs), each
  process a data-parallel rank running its own loader.

The bench uses its own temporary cache directory (under `cache_dir`, removed at the end), so
"cold" really is cold and the training cache is left alone. With a `file://` store "cold"
reads the store's files (often from the page cache) and copies them into the cache.

    >>> report = run_bench(BenchConfig("swift://imagenet/train", batch_sizes=(128, 256)))  # doctest: +SKIP
    >>> print(format_report(report))
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import os
import pickle
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dlstore.cache import clear_cache
from dlstore.config import StoreConfig, WorldInfo, parse_size
from dlstore.errors import ConfigError, CorruptSample, DlstoreError

__all__ = [
    "BenchConfig",
    "BenchReport",
    "LoaderResult",
    "LoaderRun",
    "ScalingRow",
    "StageSplit",
    "Verdict",
    "advise",
    "format_report",
    "plot_report",
    "run_bench",
]

log = logging.getLogger(__name__)

STAGES = ("fetch", "read", "decode", "augment", "collate", "host_to_device")
WORKER_STAGES = STAGES[:5]  # what DataLoader workers do; host_to_device runs in the training process
CPU_DEMAND_MAX_BATCH = 32  # CPU training steps are slow and memory-hungry; img/s hardly depends on batch


def available_cores() -> int:
    """CPU cores this process may run on (affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class BenchConfig:
    """What to measure. `workers=()` means one worker per core; `demand_steps=None` means 20
    timed steps on a GPU and 3 on a CPU. `cache_dir` is where the bench's own temporary cache
    goes (default: the system temp dir); `cache_limit=""` sizes it to hold the dataset.

    >>> BenchConfig("file:///data/train", batch_sizes=(64, 128), workers=(2, 4)).batch_sizes
    (64, 128)
    """

    url: str
    batch_sizes: tuple[int, ...] = (256,)
    workers: tuple[int, ...] = ()
    procs: tuple[int, ...] = (1,)
    image_size: int = 224
    transform: str = "train"
    decode_on: str = "worker"  # or "device": JPEG decode on the GPU (nvJPEG), see DatasetConfig
    batches: int = 20
    stage_batches: int = 2
    model: str = "resnet50"
    device: str = "auto"
    amp: str = "auto"
    channels_last: bool = True
    compile: bool = False
    demand: bool = True
    demand_steps: int | None = None
    demand_warmup: int | None = None
    cache_dir: str = ""
    cache_limit: str | int = ""
    seed: int = 0
    store_config: StoreConfig | None = None

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ConfigError("batch_sizes must list at least one size, each at least 1")
        if self.workers and min(self.workers) < 0:
            raise ConfigError("workers must be 0 or more")
        if not self.procs or min(self.procs) < 1:
            raise ConfigError("procs must list at least one process count, each at least 1")
        if self.batches < 2:
            raise ConfigError("batches must be at least 2 (the first round, which starts the workers, is not timed)")
        if self.stage_batches < 1:
            raise ConfigError("stage_batches must be at least 1")
        if self.transform not in ("train", "eval"):
            raise ConfigError(f"transform must be 'train' or 'eval', not {self.transform!r}")
        if self.decode_on not in ("worker", "device"):
            raise ConfigError(f"decode_on must be 'worker' or 'device', not {self.decode_on!r}")

    @classmethod
    def quick(cls, url: str, **changes: Any) -> BenchConfig:
        """A few seconds on a laptop: small batches, few of them, ResNet-18 at 64 px.

        >>> BenchConfig.quick("file:///tmp/demo/train").model
        'resnet18'
        """
        preset: dict[str, Any] = dict(
            batch_sizes=(32,),
            image_size=64,
            batches=6,
            stage_batches=1,
            model="resnet18",
            demand_steps=2,
            demand_warmup=1,
        )
        return cls(url, **{**preset, **changes})

    @property
    def worker_counts(self) -> tuple[int, ...]:
        return self.workers or (available_cores(),)


@dataclass(frozen=True)
class LoaderRun:
    """One timed pass of the loader over the first `batches` batches of epoch 0. The first
    round (one batch per worker: start-up, first fetches) is timed apart, in `startup_s`;
    `images`, `seconds` and the rates are those of the batches after it."""

    batches: int
    images: int
    seconds: float
    startup_s: float
    images_per_s: float
    mb_per_s: float


@dataclass(frozen=True)
class LoaderResult:
    batch_size: int
    workers: int
    cold: LoaderRun
    warm: LoaderRun


@dataclass(frozen=True)
class StageSplit:
    """Seconds per stage over `images` images of one instrumented single-process pass."""

    cache: str  # "cold" or "warm"
    batch_size: int
    images: int
    seconds: dict[str, float]
    bytes_fetched: int = 0

    @property
    def ms_per_image(self) -> dict[str, float]:
        return {s: 1000.0 * t / max(self.images, 1) for s, t in self.seconds.items()}

    @property
    def worker_ms_per_image(self) -> float:
        """CPU time one worker spends per image (all stages but host-to-device)."""
        return sum(self.ms_per_image[s] for s in WORKER_STAGES)

    @property
    def worker_images_per_s(self) -> float:
        """What one worker process can deliver: the single-core pipeline rate."""
        return 1000.0 / max(self.worker_ms_per_image, 1e-9)

    @property
    def fetch_mb_per_s(self) -> float | None:
        fetch = self.seconds.get("fetch", 0.0)
        return self.bytes_fetched / fetch / 1e6 if self.bytes_fetched and fetch > 0 else None

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["ms_per_image"] = self.ms_per_image
        out["worker_images_per_s"] = self.worker_images_per_s
        out["fetch_mb_per_s"] = self.fetch_mb_per_s
        return out


@dataclass(frozen=True)
class ScalingRow:
    """Data-parallel ranks, each with its own loader, reading disjoint parts of the epoch."""

    procs: int
    backend: str
    batch_size: int
    workers_per_proc: int
    images_per_s: float
    speedup: float
    efficiency: float
    per_rank_images_per_s: tuple[float, ...]


@dataclass(frozen=True)
class Verdict:
    """Delivered ÷ demanded for one loader configuration, and what would help."""

    batch_size: int
    workers: int
    delivered_images_per_s: float
    demanded_images_per_s: float
    ratio: float
    stall_pct: float
    cold_ratio: float
    cold_stall_pct: float
    shared_cpu_images_per_s: float | None  # CPU device: loader and model share the cores
    advice: tuple[str, ...]


@dataclass
class BenchReport:
    config: dict
    environment: dict
    dataset: dict
    loader: list[LoaderResult] = field(default_factory=list)
    stages: list[StageSplit] = field(default_factory=list)
    demand: list[dict] = field(default_factory=list)
    scaling: list[ScalingRow] = field(default_factory=list)
    gpu_decode_images_per_s: float | None = None
    verdicts: list[Verdict] = field(default_factory=list)
    verdict: Verdict | None = None

    def to_dict(self) -> dict:
        return {
            "config": self.config,
            "environment": self.environment,
            "dataset": self.dataset,
            "loader": [dataclasses.asdict(r) for r in self.loader],
            "stages": [s.to_dict() for s in self.stages],
            "demand": self.demand,
            "scaling": [dataclasses.asdict(r) for r in self.scaling],
            "gpu_decode_images_per_s": self.gpu_decode_images_per_s,
            "verdicts": [dataclasses.asdict(v) for v in self.verdicts],
            "verdict": dataclasses.asdict(self.verdict) if self.verdict else None,
        }

    def write_json(self, path: str) -> None:
        with open(path, "w") as out:
            json.dump(self.to_dict(), out, indent=2)
            out.write("\n")


# -- the run --------------------------------------------------------------------------------------
def run_bench(cfg: BenchConfig) -> BenchReport:
    """Measure the loader and the model's demand as `cfg` says; see the module docstring.

    >>> report = run_bench(BenchConfig.quick("file:///tmp/demo/train"))   # doctest: +SKIP
    >>> report.verdict.ratio
    41.7
    """
    from dlstore.manifest import Manifest
    from dlstore.storage import open_store

    device = _resolve_device(cfg.device)
    cache_root = tempfile.mkdtemp(prefix="dlstore-bench-", dir=cfg.cache_dir or None)
    try:
        cache_dir = os.path.join(cache_root, "cache")
        manifest = Manifest.load(open_store(cfg.url, cfg.store_config))
        limit = cfg.cache_limit or _auto_limit(manifest)
        report = BenchReport(
            config=_config_dict(cfg),
            environment=_environment(device),
            dataset=_dataset_info(cfg.url, manifest),
        )
        for batch_size in cfg.batch_sizes:
            ds = _open_dataset(cfg, cache_dir, limit, batch_size)
            try:
                if batch_size == cfg.batch_sizes[0]:
                    _measure_stages(report, ds, cfg, device, cache_dir)
                for workers in cfg.worker_counts:
                    report.loader.append(_measure_loader(ds, cfg, device, workers, cache_dir))
            finally:
                ds.cache.close()
        if cfg.demand:
            report.demand = _measure_demand(cfg, device)
        if cfg.procs != (1,):
            report.scaling = _measure_scaling(cfg, device, cache_root, limit)
        report.verdicts = [_verdict(report, row, cfg, device) for row in report.loader if _demand_for(report, row)]
        if report.verdicts:
            report.verdict = max(report.verdicts, key=lambda v: v.delivered_images_per_s)
        return report
    finally:
        shutil.rmtree(cache_root, ignore_errors=True)


def _open_dataset(cfg: BenchConfig, cache_dir: str, limit: str | int, batch_size: int, world: WorldInfo | None = None):
    from dlstore.dataset import Dataset

    return Dataset(
        cfg.url,
        cache_dir=cache_dir,
        cache_limit=limit,
        transform=cfg.transform,
        image_size=cfg.image_size,
        batch_size=batch_size,
        seed=cfg.seed,
        world=world or WorldInfo(),
        store_config=cfg.store_config,
        decode_on=cfg.decode_on,
    )


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for, but torch sees no CUDA device")
    return dev


def _image_dtype(cfg: BenchConfig, device: torch.device) -> str:
    """What the trainer asks the loader for: bf16 images under bf16 autocast, else float32."""
    from dlstore.train.step import amp_dtype_for

    return "bfloat16" if amp_dtype_for(cfg.amp, device) == torch.bfloat16 else "float32"


def _auto_limit(manifest) -> int:
    # Big enough for every shard the bench reads, so the warm pass finds them all cached;
    # the bench reads only the first batches' shards, so this is a bound, not a disk use.
    sizes = [s.size for s in manifest.shards]
    return sum(sizes) + 2 * max(sizes, default=0) + 2**20


def _config_dict(cfg: BenchConfig) -> dict:
    # Credentials (store_config) stay out of the report.
    out = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "store_config"}
    out["workers"] = cfg.worker_counts
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def _environment(device: torch.device) -> dict:
    env = {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cores": available_cores(),
        "device": str(device),
        "device_name": "cpu",
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    return env


def _dataset_info(url: str, manifest) -> dict:
    shards = manifest.shards
    samples = int(sum(s.samples for s in shards))
    total = int(sum(s.size for s in shards))
    return {
        "url": url,
        "shards": len(shards),
        "samples": samples,
        "bytes": total,
        "mean_sample_bytes": total / max(samples, 1),
    }


# -- loader side ----------------------------------------------------------------------------------
def _time_loader(ds, workers: int, batches: int, device: torch.device, dtype: str, channels_last: bool) -> LoaderRun:
    """At least `batches` batches of epoch 0 through a fresh `Loader` (fresh workers).

    The workers start together, so the first batches arrive in a burst, one per worker, after
    the start-up; timing from the first arrival would count the others' head start. The rate
    is therefore taken over whole rounds after the first one: from the arrival of batch
    `workers` to that of the last batch, the pass being a whole number of rounds long.
    """
    from dlstore.loader import Loader

    loader = Loader(ds, num_workers=workers, device=str(device), dtype=dtype, channels_last=channels_last)
    loader.set_epoch(0)
    per_round, available = max(workers, 1), len(loader)
    if available >= 2 * per_round:
        untimed = per_round
        # At least three rounds: the first one's stragglers (a worker that started late) would
        # otherwise shorten a one-round window.
        total = per_round * min(max(3, math.ceil(batches / per_round)), available // per_round)
    elif available >= 2:  # a tiny dataset: time what there is after the first batch
        untimed, total = 1, available
    else:
        raise ConfigError(f"{ds.store.url}: fewer than 2 batches of {ds.cfg.batch_size} per epoch; use smaller batches")
    started = time.perf_counter()
    window_start = None
    images = count = 0
    try:
        for batch in loader:
            _sync(device)  # the batch is on the device, normalised
            count += 1
            if count == untimed:
                window_start = time.perf_counter()
            elif count > untimed:
                images += batch[0].shape[0]
            if count >= total:
                break
        ended = time.perf_counter()
    finally:
        # Dropping the loader shuts its persistent workers down before the next run starts.
        del loader
        gc.collect()
    if window_start is None:
        raise ConfigError(f"{ds.store.url}: the loader delivered no batch (an empty dataset?)")
    seconds = ended - window_start
    rate = images / seconds if images and seconds > 0 else 0.0
    sample_bytes = sum(s.size for s in ds.manifest.shards) / max(int(ds.shard_sizes.sum()), 1)
    return LoaderRun(
        batches=count,
        images=images,
        seconds=seconds,
        startup_s=window_start - started,
        images_per_s=rate,
        mb_per_s=rate * sample_bytes / 1e6,
    )


def _measure_loader(ds, cfg: BenchConfig, device: torch.device, workers: int, cache_dir: str) -> LoaderResult:
    dtype = _image_dtype(cfg, device)
    log.info("loader: batch %d, %d workers, cold cache", ds.cfg.batch_size, workers)
    ds.cache.close()  # the last run's background prefetch must not refill the emptied cache
    _empty_cache(cache_dir)
    cold = _time_loader(ds, workers, cfg.batches, device, dtype, cfg.channels_last)
    log.info("loader: batch %d, %d workers, warm cache", ds.cfg.batch_size, workers)
    warm = _time_loader(ds, workers, cfg.batches, device, dtype, cfg.channels_last)
    return LoaderResult(batch_size=ds.cfg.batch_size, workers=workers, cold=cold, warm=warm)


def _empty_cache(cache_dir: str) -> None:
    if os.path.isdir(cache_dir):
        clear_cache(cache_dir)


# -- the stage split --------------------------------------------------------------------------------
def _measure_stages(report: BenchReport, ds, cfg: BenchConfig, device: torch.device, cache_dir: str) -> None:
    """One instrumented single-process pass over the first batches, cold then warm."""
    _empty_cache(cache_dir)
    encoded: list[bytes] = []
    pixels: list[int] = []
    for cache in ("cold", "warm"):
        log.info("stages: batch %d, %s cache", ds.cfg.batch_size, cache)
        report.stages.append(_stage_pass(ds, cfg, device, cache, encoded, pixels))
    if pixels:
        report.dataset["mean_source_pixels"] = float(np.mean(pixels))
    if device.type == "cuda" and encoded:
        report.gpu_decode_images_per_s = _gpu_decode_rate(encoded, device)


def _stage_pass(ds, cfg: BenchConfig, device: torch.device, cache: str, encoded: list, pixels: list) -> StageSplit:
    """What a worker does for a batch (dataset.py), and what the prefetcher does with it
    (loader.py), stage by stage with a clock around each; one process, so no overlap."""
    from dlstore.loader import GpuPrefetcher, LoaderConfig
    from dlstore.plan import locate
    from dlstore.shards import read_sample_from_file, read_shard_index
    from dlstore.transforms import augment_image, decode_image, sample_rng

    clock = time.perf_counter
    seconds = dict.fromkeys(STAGES, 0.0)
    fetched_before = ds.cache.stats.bytes_fetched
    loader_cfg = LoaderConfig(device=str(device), dtype=_image_dtype(cfg, device), channels_last=cfg.channels_last)
    plan = ds.plan(0)
    indexes: dict[int, Any] = {}
    images = 0
    warmed_up = False
    for j in range(min(cfg.stage_batches, plan.num_batches)):
        ids = ds.request(plan, 0, j).ids
        shards, offsets = locate(ids, ds.shard_sizes)
        raw: list[dict | None] = [None] * len(ids)
        for shard in np.unique(shards).tolist():
            info = ds.manifest.shards[shard]
            t0 = clock()
            with ds.cache.hold(info.name, info.size, info.checksum) as path:
                t1 = clock()
                if shard not in indexes:
                    indexes[shard] = read_shard_index(path)
                with open(path, "rb") as file:
                    for position in np.flatnonzero(shards == shard).tolist():
                        raw[position] = read_sample_from_file(file, indexes[shard][int(offsets[position])])
                seconds["fetch"] += t1 - t0
                seconds["read"] += clock() - t1
        arrays, labels = [], []
        for sample_id, sample in zip(ids.tolist(), raw):
            data = next((sample[f] for f in ds.image_fields if f in sample), None) if sample else None
            if data is None:
                continue
            t0 = clock()
            try:
                image = decode_image(data)
            except CorruptSample:
                continue
            t1 = clock()
            arrays.append(augment_image(image, ds.cfg.transform, sample_rng(ds.cfg.seed, 0, sample_id)))
            seconds["decode"] += t1 - t0
            seconds["augment"] += clock() - t1
            labels.append(int(sample.get("cls", b"0") or 0))
            if cache == "cold" and len(encoded) < 256 and data[:2] == b"\xff\xd8" and image.mode in ("RGB", "L"):
                encoded.append(data)
                pixels.append(image.width * image.height)
        if not arrays:
            continue
        t0 = clock()
        batch = {"images": torch.from_numpy(np.stack(arrays)), "labels": torch.tensor(labels, dtype=torch.int64)}
        seconds["collate"] += clock() - t0
        if not warmed_up:  # the first call pays one-off set-up (kernels, streams): not a per-batch cost
            next(iter(GpuPrefetcher(iter([batch]), loader_cfg, device)))
            _sync(device)
            warmed_up = True
        t0 = clock()
        if device.type == "cuda":
            batch = {k: v.pin_memory() for k, v in batch.items()}  # the DataLoader's pin thread
        next(iter(GpuPrefetcher(iter([batch]), loader_cfg, device)))
        _sync(device)
        seconds["host_to_device"] += clock() - t0
        images += len(arrays)
    return StageSplit(
        cache=cache,
        batch_size=ds.cfg.batch_size,
        images=images,
        seconds=seconds,
        bytes_fetched=ds.cache.stats.bytes_fetched - fetched_before,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gpu_decode_rate(encoded: list[bytes], device: torch.device) -> float | None:
    """nvJPEG through torchvision, batched: img/s for these images (decode only)."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg

        tensors = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in encoded]
        decode_jpeg(tensors[:8], mode=ImageReadMode.RGB, device=device)  # initialise nvJPEG
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        for _ in range(3):
            decode_jpeg(tensors, mode=ImageReadMode.RGB, device=device)
        torch.cuda.synchronize(device)
        return 3 * len(tensors) / (time.perf_counter() - started)
    except Exception as exc:  # an optional measurement: any failure only leaves it out
        log.warning("GPU decode not measured: %s", exc)
        return None


# -- demand side ----------------------------------------------------------------------------------
def _measure_demand(cfg: BenchConfig, device: torch.device) -> list[dict]:
    from dlstore.train.demand import measure_training_rate

    cpu = device.type == "cpu"
    steps = cfg.demand_steps or (3 if cpu else 20)
    warmup = cfg.demand_warmup if cfg.demand_warmup is not None else (1 if cpu else 5)
    measured: dict[int, dict] = {}
    out = []
    for batch_size in cfg.batch_sizes:
        run_batch = min(batch_size, CPU_DEMAND_MAX_BATCH) if cpu else batch_size
        if run_batch not in measured:
            log.info("demand: %s, batch %d on %s", cfg.model, run_batch, device)
            try:
                result = measure_training_rate(
                    cfg.model,
                    batch_size=run_batch,
                    image_size=cfg.image_size,
                    device=str(device),
                    amp=cfg.amp,
                    channels_last=cfg.channels_last,
                    compile=cfg.compile,
                    warmup_steps=warmup,
                    steps=steps,
                    seed=cfg.seed,
                )
                measured[run_batch] = result.to_dict()
            except (RuntimeError, DlstoreError) as exc:  # e.g. out of memory at this batch size
                log.warning("demand at batch %d not measured: %s", run_batch, exc)
                measured[run_batch] = {"batch_size": run_batch, "error": str(exc)}
        out.append({**measured[run_batch], "for_batch_size": batch_size})
    return out


def _demand_for(report: BenchReport, row: LoaderResult) -> float | None:
    for entry in report.demand:
        if entry.get("for_batch_size") == row.batch_size and "images_per_s" in entry:
            return float(entry["images_per_s"])
    return None


# -- the verdict ----------------------------------------------------------------------------------
def _stall_pct(delivered: float, demanded: float) -> float:
    # A step waits for data whenever the loader is slower than the model: with perfect overlap
    # the step rate is min(delivered, demanded), and the wait is the rest of each step.
    return max(0.0, 1.0 - delivered / demanded) * 100.0 if demanded > 0 else 0.0


def _verdict(report: BenchReport, row: LoaderResult, cfg: BenchConfig, device: torch.device) -> Verdict:
    demanded = _demand_for(report, row) or 0.0
    delivered = row.warm.images_per_s
    warm = next((s for s in report.stages if s.cache == "warm"), None)
    cold = next((s for s in report.stages if s.cache == "cold"), None)
    shared = None
    if device.type == "cpu" and delivered > 0 and demanded > 0:
        # On a CPU the loader's workers and the training step take turns on the same cores.
        shared = 1.0 / (1.0 / delivered + 1.0 / demanded)
    advice = advise(
        delivered=delivered,
        cold_delivered=row.cold.images_per_s,
        demanded=demanded,
        workers=row.workers,
        cores=available_cores(),
        warm=warm,
        cold=cold,
        cuda=device.type == "cuda",
        gpu_decode_images_per_s=report.gpu_decode_images_per_s,
        mean_source_pixels=report.dataset.get("mean_source_pixels"),
        image_size=cfg.image_size,
    )
    return Verdict(
        batch_size=row.batch_size,
        workers=row.workers,
        delivered_images_per_s=delivered,
        demanded_images_per_s=demanded,
        ratio=delivered / demanded if demanded else math.inf,
        stall_pct=_stall_pct(delivered, demanded),
        cold_ratio=row.cold.images_per_s / demanded if demanded else math.inf,
        cold_stall_pct=_stall_pct(row.cold.images_per_s, demanded),
        shared_cpu_images_per_s=shared,
        advice=tuple(advice),
    )


def advise(
    *,
    delivered: float,
    cold_delivered: float,
    demanded: float,
    workers: int,
    cores: int,
    warm: StageSplit | None,
    cold: StageSplit | None = None,
    cuda: bool = False,
    gpu_decode_images_per_s: float | None = None,
    mean_source_pixels: float | None = None,
    image_size: int = 224,
) -> list[str]:
    """What would make the loader keep up, read off the stage split (a pure function).

    >>> advise(delivered=900, cold_delivered=850, demanded=3000, workers=4, cores=32, warm=None)[0]
    'The loader delivers 0.30 of what the model consumes: expect ~70% of each step waiting for data.'
    """
    tips: list[str] = []
    if demanded <= 0:
        return ["No demand measured: nothing to compare the loader with."]
    ratio = delivered / demanded
    if ratio >= 1.0:
        tips.append(f"The loader keeps up: it delivers {ratio:.2f}x what the model consumes (warm cache).")
    else:
        tips.append(
            f"The loader delivers {ratio:.2f} of what the model consumes: "
            f"expect ~{_stall_pct(delivered, demanded):.0f}% of each step waiting for data."
        )
    if cold_delivered < min(demanded, delivered) * 0.9:
        fetch_rate = cold.fetch_mb_per_s if cold else None
        via = f" (the store gives {fetch_rate:.0f} MB/s per fetch)" if fetch_rate else ""
        tips.append(
            f"From a cold cache it delivers {cold_delivered:.0f} img/s{via}: the first epoch is fetch-bound. "
            "A cache_limit that holds the dataset keeps later epochs warm; more prefetch_shards hides the fetches."
        )
    if ratio >= 1.0 or warm is None:
        return tips
    per_worker = warm.worker_images_per_s
    needed = math.ceil(demanded / (per_worker * 0.9))  # ~90% parallel efficiency
    if needed > workers and needed <= cores:
        tips.append(
            f"More workers: each delivers ~{per_worker:.0f} img/s, so {needed} workers would cover "
            f"{demanded:.0f} img/s (you ran {workers}; this machine has {cores} cores)."
        )
    elif needed > cores:
        tips.append(
            f"CPU-bound: keeping up needs ~{needed} cores of decode and augment at {per_worker:.0f} img/s each; "
            f"this machine has {cores}."
        )
    ms = warm.ms_per_image
    worker_ms = warm.worker_ms_per_image
    decode_share = ms["decode"] / worker_ms if worker_ms else 0.0
    if decode_share > 0.3:
        gain = worker_ms / max(worker_ms - ms["decode"], 1e-9)
        where = f" (nvJPEG decodes {gpu_decode_images_per_s:.0f} img/s here)" if gpu_decode_images_per_s else ""
        if cuda:
            tips.append(
                f"GPU decode: JPEG decoding is {decode_share:.0%} of a worker's time; moving it to the GPU"
                f"{where} would raise the CPU side up to {gain:.1f}x."
            )
        else:
            tips.append(f"JPEG decoding is {decode_share:.0%} of a worker's time; on a GPU machine, GPU decode helps.")
    if mean_source_pixels:
        wanted = (image_size / 0.875) ** 2  # a short side of image_size/0.875 leaves room for the crops
        if mean_source_pixels > 1.5 * wanted:
            share = wanted / mean_source_pixels
            side = round(math.sqrt(mean_source_pixels) * math.sqrt(share) * 1.15)
            tips.append(
                f"Smaller stored images: they average {mean_source_pixels / 1e6:.2f} MP for {image_size} px "
                f"training; re-converting with `--resize-max-side {side}` cuts decode time roughly to "
                f"{share:.0%} of now."
            )
    if not cuda and ms["host_to_device"] > 0.15 * worker_ms:
        tips.append(
            f"On a CPU device the training process converts and normalises each batch ({ms['host_to_device']:.2f} ms "
            "per image); most of that is page faults on the fresh float batch, which PyTorch's huge-page "
            "allocation (THP_MEM_ALLOC_ENABLE=1 in the environment) cuts."
        )
    elif cuda and ms["host_to_device"] > 0.25 * worker_ms / max(workers, 1):
        tips.append(
            f"The training process spends {ms['host_to_device']:.2f} ms per image on pinning, copying and "
            "normalising: a larger device_lookahead or a lower-precision dtype shortens it."
        )
    return tips


# -- process-count scaling ------------------------------------------------------------------------
def _measure_scaling(cfg: BenchConfig, device: torch.device, cache_root: str, limit: str | int) -> list[ScalingRow]:
    batch_size, workers = cfg.batch_sizes[0], cfg.worker_counts[0]
    rows: list[ScalingRow] = []
    base: tuple[int, float] | None = None
    for procs in cfg.procs:
        use_nccl = device.type == "cuda" and torch.cuda.device_count() >= procs
        backend = "nccl" if use_nccl else "gloo"
        out_dir = tempfile.mkdtemp(prefix=f"procs{procs}-", dir=cache_root)
        spec = {
            "cfg": cfg,
            "procs": procs,
            "backend": backend,
            "device": "cuda" if use_nccl else "cpu",
            "batch_size": batch_size,
            "workers": workers,
            "cache_dir": os.path.join(cache_root, "cache"),
            "cache_limit": limit,
            "init": f"file://{os.path.join(out_dir, 'rendezvous')}",
            "out": out_dir,
        }
        log.info("scaling: %d processes (%s), batch %d, %d workers each", procs, backend, batch_size, workers)
        _run_ranks(spec, procs)
        rates = []
        for rank in range(procs):
            with open(os.path.join(out_dir, f"rank-{rank}.json")) as file:
                rates.append(float(json.load(file)["images_per_s"]))
        total = sum(rates)
        if base is None:
            base = (procs, total)
        speedup = total / (base[1] / base[0]) if base[1] > 0 else 0.0
        rows.append(
            ScalingRow(
                procs=procs,
                backend=backend,
                batch_size=batch_size,
                workers_per_proc=workers,
                images_per_s=total,
                speedup=speedup,
                efficiency=speedup / procs,
                per_rank_images_per_s=tuple(rates),
            )
        )
    return rows


def _run_ranks(spec: dict, procs: int) -> None:
    """Start `procs` fresh interpreters, as torchrun or srun would, and wait for all of them;
    if one fails, stop the others (they would wait at a barrier). Fresh interpreters rather
    than multiprocessing's spawn: DataLoader workers forked from a spawned gloo rank die with
    a C++ "terminate called" message at exit, which real launches do not show."""
    # The ranks import this very dlstore, installed or not.
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")]))}
    ranks = []
    for rank in range(procs):
        command = [sys.executable, "-m", "dlstore.bench", "--scaling-rank", str(rank)]
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, env=env)
        pickle.dump(spec, proc.stdin)  # through a pipe: the store's credentials never touch the disk
        proc.stdin.close()
        ranks.append(proc)
    try:
        while any(proc.poll() is None for proc in ranks):
            if any(proc.returncode for proc in ranks):
                break
            time.sleep(0.05)
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    codes = [proc.returncode for proc in ranks]
    if any(codes):
        raise DlstoreError(
            f"the scaling run with {procs} processes failed (exit codes {codes}); see the messages above"
        )


def _scaling_rank(rank: int, spec: dict) -> None:
    """One rank of the scaling run (a spawned process): a warm-up pass fills the node cache,
    then the timed pass, between barriers so that every rank runs at the same time."""
    import torch.distributed as dist

    cfg: BenchConfig = spec["cfg"]
    procs = spec["procs"]
    device = torch.device(spec["device"])
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(spec["backend"], init_method=spec["init"], rank=rank, world_size=procs)
    ds = None
    try:
        ds = _open_dataset(
            cfg, spec["cache_dir"], spec["cache_limit"], spec["batch_size"], WorldInfo(rank, procs, procs)
        )
        dtype = _image_dtype(cfg, device)
        barrier = {"device_ids": [rank]} if spec["backend"] == "nccl" else {}
        _time_loader(ds, spec["workers"], cfg.batches, device, dtype, cfg.channels_last)
        dist.barrier(**barrier)
        run = _time_loader(ds, spec["workers"], cfg.batches, device, dtype, cfg.channels_last)
        dist.barrier(**barrier)
        with open(os.path.join(spec["out"], f"rank-{rank}.json"), "w") as out:
            json.dump(dataclasses.asdict(run), out)
    finally:
        if ds is not None:
            ds.cache.close()
        dist.destroy_process_group()


# -- output ---------------------------------------------------------------------------------------
def _fmt_rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def _table(headers: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return indent + "  ".join(c.rjust(w) for c, w in zip(cells, widths))

    return [line(headers), indent + "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def format_report(report: BenchReport) -> str:
    """The report as the terminal tables `dlstore bench` prints."""
    cfg, env, data = report.config, report.environment, report.dataset
    lines = [
        f"dlstore bench {data['url']}",
        f"  {data['samples']:,} samples in {data['shards']} shards, {data['mean_sample_bytes'] / 1e3:.1f} KB per sample; "
        f"{cfg['transform']} transform at {cfg['image_size']} px; {env['device']} ({env['device_name']}), "
        f"{env['cores']} cores",
        "",
        f"loader (>= {cfg['batches']} batches per pass; the first batch of each worker not timed)",
    ]
    rows = []
    for r in report.loader:
        demanded = next((d for d in report.demand if d.get("for_batch_size") == r.batch_size), {})
        rate = demanded.get("images_per_s")
        rows.append(
            [
                str(r.batch_size),
                str(r.workers),
                _fmt_rate(r.cold.images_per_s),
                _fmt_rate(r.cold.mb_per_s),
                _fmt_rate(r.warm.images_per_s),
                _fmt_rate(r.warm.mb_per_s),
                _fmt_rate(rate),
                f"{r.warm.images_per_s / rate:.2f}" if rate else "-",
                f"{_stall_pct(r.warm.images_per_s, rate):.0f}%" if rate else "-",
            ]
        )
    lines += _table(
        [
            "batch",
            "workers",
            "cold img/s",
            "cold MB/s",
            "warm img/s",
            "warm MB/s",
            "demand img/s",
            "warm/demand",
            "stall",
        ],
        rows,
    )
    if report.stages:
        split = {s.cache: s for s in report.stages}
        lines += ["", f"stages (one process, batch {report.stages[0].batch_size}, ms per image)"]
        stage_rows = []
        for stage in STAGES:
            cells = [stage.replace("_", "-")]
            for cache in ("cold", "warm"):
                s = split.get(cache)
                if s is None:
                    cells.append("-")
                    continue
                ms = s.ms_per_image[stage]
                share = ms / sum(s.ms_per_image.values()) if s.images else 0.0
                cells.append(f"{ms:.3f} ({share:.0%})")
            stage_rows.append(cells)
        stage_rows.append(
            ["one worker img/s"]
            + [_fmt_rate(split[c].worker_images_per_s) if c in split else "-" for c in ("cold", "warm")]
        )
        lines += _table(["stage", "cold", "warm"], stage_rows)
        fetch = split.get("cold").fetch_mb_per_s if "cold" in split else None
        if fetch:
            lines.append(f"  cold fetch: {fetch:.0f} MB/s from the store (one shard at a time)")
        if report.gpu_decode_images_per_s:
            lines.append(f"  GPU decode (nvJPEG, batched): {report.gpu_decode_images_per_s:,.0f} img/s")
    if report.demand:
        lines += ["", "demand: training steps on synthetic data already on the device"]
        seen = set()
        for d in report.demand:
            if d["batch_size"] in seen:
                continue
            seen.add(d["batch_size"])
            if "error" in d:
                lines.append(f"  batch {d['batch_size']}: not measured ({d['error']})")
                continue
            lines.append(
                f"  {d['model']} {d['precision']}{' channels_last' if d['channels_last'] else ''}"
                f"{' compiled' if d['compiled'] else ''} on {d['device']}, batch {d['batch_size']}: "
                f"{_fmt_rate(d['images_per_s'])} img/s ({d['step_ms']:.0f} ms per step)"
            )
    if report.scaling:
        first = report.scaling[0]
        lines += [
            "",
            f"scaling (warm cache, batch {first.batch_size} and {first.workers_per_proc} workers per process, "
            f"{first.backend})",
        ]
        lines += _table(
            ["procs", "img/s", "speed-up", "efficiency"],
            [
                [str(r.procs), _fmt_rate(r.images_per_s), f"{r.speedup:.2f}x", f"{r.efficiency:.0%}"]
                for r in report.scaling
            ],
        )
    v = report.verdict
    if v is not None:
        lines += [
            "",
            f"verdict (batch {v.batch_size}, {v.workers} workers): delivered {_fmt_rate(v.delivered_images_per_s)} "
            f"/ demanded {_fmt_rate(v.demanded_images_per_s)} img/s = {v.ratio:.2f}; expected data stall "
            f"{v.stall_pct:.0f}% warm, {v.cold_stall_pct:.0f}% cold",
        ]
        if v.shared_cpu_images_per_s:
            lines.append(
                f"  (CPU training: loader and model share the cores, so expect about "
                f"{_fmt_rate(v.shared_cpu_images_per_s)} img/s end to end)"
            )
        lines += [f"  - {tip}" for tip in v.advice]
    return "\n".join(lines)


def plot_report(report: BenchReport, path: str) -> None:
    """Loader img/s (warm solid, cold dashed) against workers, or batch size when only that
    varies, with the model's demand as dotted lines; the scaling table beside, if measured."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    panels = 2 if report.scaling else 1
    fig = Figure(figsize=(6.5 * panels, 4.5), layout="constrained")
    ax = fig.add_subplot(1, panels, 1)
    batch_sizes = sorted({r.batch_size for r in report.loader})
    worker_counts = sorted({r.workers for r in report.loader})
    by_batch = len(worker_counts) == 1 and len(batch_sizes) > 1
    demand = {d["for_batch_size"]: d["images_per_s"] for d in report.demand if "images_per_s" in d}
    colours = [f"C{i}" for i in range(10)]
    values: list[float] = []
    if by_batch:
        for colour, workers in zip(colours, worker_counts):
            rows = sorted((r for r in report.loader if r.workers == workers), key=lambda r: r.batch_size)
            xs = [r.batch_size for r in rows]
            ax.plot(xs, [r.warm.images_per_s for r in rows], "o-", color=colour, label=f"{workers} workers, warm")
            ax.plot(xs, [r.cold.images_per_s for r in rows], "s--", color=colour, label=f"{workers} workers, cold")
            values += [r.warm.images_per_s for r in rows] + [r.cold.images_per_s for r in rows]
        if demand:
            xs = sorted(demand)
            ax.plot(xs, [demand[x] for x in xs], "k:", linewidth=2, label="GPU demand")
            values += list(demand.values())
        ax.set_xlabel("batch size")
        ax.set_xscale("log", base=2)
        ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    else:
        for colour, batch_size in zip(colours, batch_sizes):
            rows = sorted((r for r in report.loader if r.batch_size == batch_size), key=lambda r: r.workers)
            xs = [r.workers for r in rows]
            ax.plot(xs, [r.warm.images_per_s for r in rows], "o-", color=colour, label=f"batch {batch_size}, warm")
            ax.plot(xs, [r.cold.images_per_s for r in rows], "s--", color=colour, label=f"batch {batch_size}, cold")
            values += [r.warm.images_per_s for r in rows] + [r.cold.images_per_s for r in rows]
            if batch_size in demand:
                ax.axhline(
                    demand[batch_size], color=colour, linestyle=":", linewidth=2, label=f"demand, batch {batch_size}"
                )
                values.append(demand[batch_size])
        ax.set_xlabel("workers")
        ax.set_xticks(worker_counts)
    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) > 30:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_ylabel("images/s")
    ax.set_title(f"loader vs demand ({report.environment['device_name']})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    if report.scaling:
        ax2 = fig.add_subplot(1, 2, 2)
        procs = [r.procs for r in report.scaling]
        rates = [r.images_per_s for r in report.scaling]
        per_proc = rates[0] / procs[0]
        ax2.plot(procs, rates, "o-", label="measured")
        ax2.plot(procs, [per_proc * p for p in procs], "k--", alpha=0.5, label="linear")
        for r in report.scaling:
            ax2.annotate(f"{r.efficiency:.0%}", (r.procs, r.images_per_s), textcoords="offset points", xytext=(4, -12))
        ax2.set_xlabel(f"processes ({report.scaling[0].backend})")
        ax2.set_ylabel("images/s (all processes)")
        ax2.set_xticks(procs)
        ax2.set_ylim(bottom=0)
        ax2.set_title("scaling over processes")
        ax2.grid(True, alpha=0.3)
        ax2.legend(fontsize="small")
    fig.savefig(path, dpi=110)


def parse_int_list(text: str) -> tuple[int, ...]:
    """Parse a comma-separated list of integers (`--batch-sizes 32,64,128`).

    >>> parse_int_list("1, 2,4")
    (1, 2, 4)
    """
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"expected comma-separated integers, not {text!r}") from None
    if not values:
        raise ConfigError("expected at least one integer")
    return values


def size_or_auto(text: str) -> int | str:
    return "" if text in ("", "auto") else parse_size(text)


if __name__ == "__main__":  # one rank of the scaling run: python -m dlstore.bench --scaling-rank N < spec
    if len(sys.argv) != 3 or sys.argv[1] != "--scaling-rank":
        sys.exit("usage: python -m dlstore.bench --scaling-rank RANK < pickled spec (run by `dlstore bench --procs`)")
    _scaling_rank(int(sys.argv[2]), pickle.load(sys.stdin.buffer))
