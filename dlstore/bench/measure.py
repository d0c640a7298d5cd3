"""The measurements: the loader's rate from a cold and a warm cache, its stage split, and the
model's demand, its training-step rate on synthetic data. `run_bench` puts them together."""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import os
import threading
import time

import numpy as np
import torch

from dlstore.bench.config import BenchConfig
from dlstore.bench.report import BenchReport, LoaderResult, LoaderRun, StageSplit
from dlstore.cache import CacheStats, cache_report, clear_cache
from dlstore.config import DataConfig
from dlstore.dataset import Dataset
from dlstore.errors import ConfigError, CorruptSample, DlstoreError
from dlstore.loader import GpuPrefetcher, Loader, LoaderConfig
from dlstore.sample_path import StageClock
from dlstore.train.demand import measure_training_rate
from dlstore.train.step import amp_dtype_for, image_dtype_for
from dlstore.transforms import device_jpeg, device_jpeg_decoder
from dlstore.world import World

__all__ = ["image_dtype", "open_dataset", "measure_demand", "measure_loader", "measure_stages", "time_loader"]

log = logging.getLogger(__name__)

CPU_DEMAND_MAX_BATCH = 32  # CPU steps are slow and memory-hungry; their img/s hardly depends on batch


def open_dataset(cfg: BenchConfig, cache_dir: str, limit: str | int, batch_size: int, world: World | None = None):
    """The bench's dataset: `cfg.data` at `batch_size`, in the bench's own cache."""
    data = cfg.data.replace(cache_dir=cache_dir, cache_limit=limit, batch_size=batch_size)
    return Dataset(data, world=world or World())


def image_dtype(cfg: BenchConfig, device: torch.device) -> str:
    """What the trainer asks the loader for: bf16 images under bf16 autocast, else float32."""
    return str(image_dtype_for(amp_dtype_for(cfg.amp, device))).removeprefix("torch.")


# -- loader side ----------------------------------------------------------------------------------
def time_loader(
    ds,
    workers: int,
    batches: int,
    device: torch.device,
    dtype: str,
    channels_last: bool,
    engine: str = "auto",
    beside_python: bool = False,
) -> LoaderRun:
    """At least `batches` batches of epoch 0 through a fresh `Loader` with fresh workers.

    The workers start together, so the first batches arrive in a burst, one per worker. Timing
    from the first arrival would count the others' head start. So the rate is taken over whole
    rounds after the first: from batch `workers` to the last, a whole number of rounds. With
    `beside_python`, a thread runs pure Python meanwhile, as a training loop's dispatch does.
    """
    if beside_python:
        stop = threading.Event()
        busy = threading.Thread(target=_run_python, args=(stop,), name="dlstore-bench-python", daemon=True)
        busy.start()
        try:
            return time_loader(ds, workers, batches, device, dtype, channels_last, engine)
        finally:
            stop.set()
            busy.join()
    created = time.perf_counter()
    loader = Loader(
        ds, num_workers=workers, device=str(device), dtype=dtype, channels_last=channels_last, engine=engine
    )
    loader.set_epoch(0)
    engine = loader.cfg.engine  # "auto" resolved
    per_round, available = max(workers, 1), len(loader)
    if available >= 2 * per_round:
        untimed = per_round
        # At least three rounds: a worker that started late would shorten a one-round window.
        total = per_round * min(max(3, math.ceil(batches / per_round)), available // per_round)
    elif available >= 2:  # a tiny dataset: time what there is after the first batch
        untimed, total = 1, available
    else:
        raise ConfigError(f"{ds.store.url}: fewer than 2 batches of {ds.cfg.batch_size} per epoch; use smaller batches")
    started = time.perf_counter()
    window_start = first_batch = None
    images = count = 0
    try:
        for batch in loader:
            count += 1
            if first_batch is None:
                first_batch = time.perf_counter()
            if count == untimed:
                # The clock starts with this batch on the device. After it the loop syncs only at
                # the end: a sync per batch would cancel the loader's copies ahead.
                _sync(device)
                window_start = time.perf_counter()
            elif count > untimed:
                images += batch[0].shape[0]
            if count >= total:
                break
        _sync(device)
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
        first_batch_s=(first_batch or ended) - created,
        engine=engine,
    )


def measure_loader(
    ds, cfg: BenchConfig, device: torch.device, workers: int, cache_dir: str, engine: str = "auto"
) -> LoaderResult:
    """A cold pass on an emptied cache, then a warm one, on `engine`.
    Each `LoaderRun` records what the node cache fetched meanwhile."""
    dtype = image_dtype(cfg, device)
    log.info("loader: batch %d, %d workers, engine %s, cold cache", ds.cfg.batch_size, workers, engine)
    ds.cache.close()  # the last run's background prefetch must not refill the emptied cache
    _empty_cache(cache_dir, reset_stats=True)
    # A dataset of its own: its counters and download engine start from zero in this process,
    # so the connections counted are this pass's.
    run_ds = Dataset(ds.cfg, world=ds.world)
    try:
        cold = time_loader(run_ds, workers, cfg.batches, device, dtype, cfg.channels_last, engine)
        after_cold = _cache_totals(run_ds)
        log.info("loader: batch %d, %d workers, engine %s, warm cache", ds.cfg.batch_size, workers, engine)
        warm = time_loader(run_ds, workers, cfg.batches, device, dtype, cfg.channels_last, engine)
        after_warm = _cache_totals(run_ds)
        log.info(
            "loader: batch %d, %d workers, engine %s, beside a Python-busy thread", ds.cfg.batch_size, workers, engine
        )
        beside = time_loader(run_ds, workers, cfg.batches, device, dtype, cfg.channels_last, engine, beside_python=True)
    finally:
        run_ds.cache.close()
    cold = _with_fetches(cold, after_cold.bytes_fetched, after_cold.max_connections)
    warm = _with_fetches(warm, after_warm.bytes_fetched - after_cold.bytes_fetched, 0)
    return LoaderResult(batch_size=ds.cfg.batch_size, workers=workers, cold=cold, warm=warm, beside_python=beside)


def _run_python(stop: threading.Event) -> None:
    """Pure Python until `stop`: a training loop's dispatch, optimiser and hooks, as far as the GIL sees."""
    while not stop.is_set():
        for _ in range(1000):
            pass


def _cache_totals(ds) -> CacheStats:
    """The node cache's counters, all processes', once this process's prefetch has stopped."""
    ds.cache.close()  # its downloads in flight end and are counted; the next pass starts it again
    return cache_report(ds.cache.config.cache_dir).totals


def _with_fetches(run: LoaderRun, fetched: int, connections: int) -> LoaderRun:
    pass_s = run.startup_s + run.seconds
    rate = fetched / pass_s / 1e6 if fetched and pass_s > 0 else None
    return dataclasses.replace(run, bytes_fetched=fetched, fetch_mb_per_s=rate, connections=connections)


def _empty_cache(cache_dir: str, reset_stats: bool = False) -> None:
    if os.path.isdir(cache_dir):
        clear_cache(cache_dir, reset_stats=reset_stats)


# -- the stage split --------------------------------------------------------------------------------
def measure_stages(report: BenchReport, ds, cfg: BenchConfig, device: torch.device, cache_dir: str) -> None:
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
        report.gpu_decoder, report.gpu_decode_images_per_s = _gpu_decode_rate(encoded, device, ds.cfg.device_decoder)


def _stage_pass(ds, cfg: BenchConfig, device: torch.device, cache: str, encoded: list, pixels: list) -> StageSplit:
    """`Dataset.build_batch` timed stage by stage by a `StageClock`, then the prefetcher.
    One process runs both, so nothing overlaps. With `decode_on="device"`, "decode" is the
    header read and crop plan; the device decode falls in "host_to_device"."""
    clock = StageClock()
    fetched_before = ds.cache.stats.bytes_fetched
    plan = ds.plan(0)
    batches = []
    for j in range(min(cfg.stage_batches, plan.num_batches)):
        request = ds.request(plan, 0, j)
        batch = ds.build_batch(request, clock=clock)
        if cache == "cold":
            _collect_jpegs(ds, request.ids, encoded, pixels)
        if len(batch["labels"]):
            batches.append(batch)
    host_to_device = _time_prefetcher(batches, cfg, device, ds.cfg)
    images = sum(len(batch["labels"]) for batch in batches)
    return StageSplit(
        cache=cache,
        batch_size=ds.cfg.batch_size,
        images=images,
        seconds={**clock.seconds, "host_to_device": host_to_device},
        bytes_fetched=ds.cache.stats.bytes_fetched - fetched_before,
    )


def _time_prefetcher(batches: list[dict], cfg: BenchConfig, device: torch.device, data: DataConfig) -> float:
    """Seconds of the loader's device side for `batches`, through one `GpuPrefetcher`.
    On a GPU they come from page-locked memory, as the loader's slots do. One untimed batch
    first pays the one-off set-up of kernels and streams."""
    if not batches:
        return 0.0
    loader_cfg = LoaderConfig(device=str(device), dtype=image_dtype(cfg, device), channels_last=cfg.channels_last)
    if device.type == "cuda":
        batches = [{k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in batches]
    background = data.decode_on == "device"
    decoder = device_jpeg_decoder(data.device_decoder, device) if background else None
    for _ in GpuPrefetcher(iter(batches[:1]), loader_cfg, device, background=background, decoder=decoder):
        _sync(device)
    started = time.perf_counter()
    for _ in GpuPrefetcher(iter(batches), loader_cfg, device, background=background, decoder=decoder):
        pass
    _sync(device)
    return time.perf_counter() - started


def _collect_jpegs(ds, ids, encoded: list, pixels: list) -> None:
    """Up to 256 of the batch's JPEGs and their pixel counts from the header.
    They feed the GPU decode rate and the advice on stored sizes, read outside the clock."""
    for sample in ds.samples.read(ids):
        if len(encoded) >= 256:
            return
        try:
            data = ds.samples.image_bytes(sample)
            if data[:2] != b"\xff\xd8":
                continue
            _, width, height = device_jpeg(data)
        except CorruptSample:
            continue
        encoded.append(data)
        pixels.append(width * height)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gpu_decode_rate(encoded: list[bytes], device: torch.device, name: str) -> tuple[str | None, float | None]:
    """The device decoder the loader would use, and its batched decode-only img/s here."""
    try:
        # torchvision is the optional "train" extra; without it this is skipped.
        decoder = device_jpeg_decoder(name, device)
        tensors = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in encoded]
        decoder.decode(tensors[:8])  # initialise it
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        for _ in range(3):
            decoder.decode(tensors)
        torch.cuda.synchronize(device)
        return decoder.name, 3 * len(tensors) / (time.perf_counter() - started)
    except Exception as exc:  # an optional measurement: any failure only leaves it out
        log.warning("GPU decode not measured: %s", exc)
        return None, None


# -- demand side ----------------------------------------------------------------------------------
def measure_demand(cfg: BenchConfig, device: torch.device) -> list[dict]:
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
                    seed=cfg.data.seed,
                )
                measured[run_batch] = result.to_dict()
            except (RuntimeError, DlstoreError) as exc:  # e.g. out of memory at this batch size
                log.warning("demand at batch %d not measured: %s", run_batch, exc)
                measured[run_batch] = {"batch_size": run_batch, "error": str(exc)}
        out.append({**measured[run_batch], "for_batch_size": batch_size})
    return out
