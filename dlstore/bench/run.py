"""`run_bench`: the bench's measurements in order, in one temporary cache, then the verdict."""

from __future__ import annotations

import os
import platform
import shutil
import tempfile

import torch

from dlstore.bench.config import BenchConfig
from dlstore.bench.measure import measure_demand, measure_loader, measure_stages, open_dataset
from dlstore.bench.report import BenchReport, demand_for, verdict_for
from dlstore.bench.scaling import check_procs_fit, measure_scaling
from dlstore.config import writable_dir
from dlstore.format.manifest import Manifest
from dlstore.storage import open_store
from dlstore.train.step import check_model_name, resolve_device
from dlstore.world import available_cores

__all__ = ["run_bench"]


def run_bench(cfg: BenchConfig) -> BenchReport:
    """Measure the loader and the model's demand as `cfg` says; see `dlstore.bench`.

    For example::

        report = run_bench(BenchConfig.quick("file:///tmp/demo/train"))
        report.verdict.ratio  # the loader's img/s over the model's demand
    """
    device = resolve_device(cfg.device)
    check_procs_fit(cfg, device)  # before anything is measured
    if cfg.demand:
        check_model_name(cfg.model)
    cache_root = tempfile.mkdtemp(
        prefix="dlstore-bench-", dir=writable_dir(cfg.cache_dir, "--cache-dir") if cfg.cache_dir else None
    )
    try:
        cache_dir = os.path.join(cache_root, "cache")
        manifest = Manifest.load(open_store(cfg.url, cfg.data.store))
        limit = cfg.cache_limit or _auto_limit(manifest)
        report = BenchReport(
            config=cfg.to_dict(),
            environment=_environment(device),
            dataset=_dataset_info(cfg.url, manifest),
        )
        for batch_size in cfg.batch_sizes:
            ds = open_dataset(cfg, cache_dir, limit, batch_size)
            try:
                if batch_size == cfg.batch_sizes[0]:
                    measure_stages(report, ds, cfg, device, cache_dir)
                for workers in cfg.worker_counts:
                    for engine in cfg.engines:
                        report.loader.append(measure_loader(ds, cfg, device, workers, cache_dir, engine))
            finally:
                ds.cache.close()
        if cfg.demand:
            report.demand = measure_demand(cfg, device)
        if cfg.procs != (1,):
            report.scaling = measure_scaling(cfg, device, cache_root, limit)
        report.verdicts = [
            verdict_for(report, row, cfg, device.type) for row in report.loader if demand_for(report, row)
        ]
        if report.verdicts:
            report.verdict = max(report.verdicts, key=lambda v: v.delivered_images_per_s)
        return report
    finally:
        shutil.rmtree(cache_root, ignore_errors=True)


def _auto_limit(manifest) -> int:
    # Big enough for every shard, so the warm pass finds them all cached. The bench reads only
    # the first batches' shards, so this is a bound, not a disk use.
    sizes = [s.size for s in manifest.shards]
    return sum(sizes) + 2 * max(sizes, default=0) + 2**20


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
