"""The scaling table: the loader's rate with 1, 2, ... data-parallel ranks.
Each rank is a fresh interpreter with its own loader, over gloo on CPUs and NCCL on GPUs."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from dlstore.bench.config import BenchConfig
from dlstore.bench.measure import image_dtype, open_dataset, time_loader
from dlstore.bench.report import ScalingRow
from dlstore.errors import ConfigError, DlstoreError
from dlstore.world import World

__all__ = ["check_procs_fit", "measure_scaling", "scaling_rank"]

log = logging.getLogger(__name__)

# The package folder's parent, which the ranks put on their path.
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def check_procs_fit(cfg: BenchConfig, device: torch.device) -> None:
    """On CUDA each scaling process has a GPU of its own, as a training rank has.
    Raises `ConfigError` for more processes than GPUs."""
    most = max(cfg.procs)
    if device.type == "cuda" and most > (gpus := torch.cuda.device_count()):
        raise ConfigError(
            f"--procs {most} needs {most} GPUs, one per process; this node has {gpus}. "
            "Give at most that many, or --device cpu to measure CPU processes"
        )


def measure_scaling(cfg: BenchConfig, device: torch.device, cache_root: str, limit: str | int) -> list[ScalingRow]:
    """One row per process count in `cfg.procs`, at the first batch size and worker count.
    The ranks share one node cache under `cache_root`, as the ranks of one node would."""
    batch_size, workers = cfg.batch_sizes[0], cfg.worker_counts[0]
    rows: list[ScalingRow] = []
    base: tuple[int, float] | None = None
    for procs in cfg.procs:
        use_nccl = device.type == "cuda"  # a GPU each, as `check_procs_fit` ensures
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
    """Start `procs` fresh interpreters, as torchrun or srun would, and wait for all of them.
    If one fails, stop the others, which would wait at a barrier. Not multiprocessing's spawn:
    workers forked from a spawned gloo rank die with a C++ "terminate called" at exit."""
    # The ranks import this very dlstore, installed or not.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_PARENT, os.environ.get("PYTHONPATH")]))}
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


def scaling_rank(rank: int, spec: dict) -> None:
    """One rank of the scaling run: a warm-up pass fills the node cache, then the timed pass.
    Barriers around it make every rank run at the same time."""
    cfg: BenchConfig = spec["cfg"]
    procs = spec["procs"]
    device = torch.device(spec["device"])
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(spec["backend"], init_method=spec["init"], rank=rank, world_size=procs)
    ds = None
    try:
        ds = open_dataset(cfg, spec["cache_dir"], spec["cache_limit"], spec["batch_size"], World(rank, procs, procs))
        dtype = image_dtype(cfg, device)
        barrier = {"device_ids": [rank]} if spec["backend"] == "nccl" else {}
        time_loader(ds, spec["workers"], cfg.batches, device, dtype, cfg.channels_last)
        dist.barrier(**barrier)
        run = time_loader(ds, spec["workers"], cfg.batches, device, dtype, cfg.channels_last)
        dist.barrier(**barrier)
        with open(os.path.join(spec["out"], f"rank-{rank}.json"), "w") as out:
            json.dump(dataclasses.asdict(run), out)
    finally:
        if ds is not None:
            ds.cache.close()
        dist.destroy_process_group()
