"""The process engine: DataLoader worker processes, each building whole batches.

The default for a GPU (`choose_engine`: decode threads would share the training loop's GIL),
and for Python-heavy custom transforms that hold the GIL. The main process owns the epoch plan:
a sampler walks this rank's batches in order and hands each worker a whole batch request;
persistent workers decode and collate into a slot of a shared-memory ring (`BatchSlots`,
page-locked on a GPU node); the DataLoader returns batches in plan order.

The first batch of each pass (loader start, each epoch, a resume) is the exception: built
whole by one worker, it kept the loop waiting a whole batch's decode (~1 s for 256 images on
an H100 node's worker) while the others built later batches. It goes out as one chunk of
consecutive samples per worker instead, all written into the batch's slot, and the engine
joins the chunks into the batch a whole build would give. Later batches stay whole: handing
a worker a whole batch costs the least per image.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from dlstore.dataset import Dataset
from dlstore.loader.config import LoaderConfig
from dlstore.loader.slots import BatchSlots
from dlstore.sample_path import BatchRequest

__all__ = ["ProcessEngine"]


def start_fork_server() -> None:
    """Start the fork server that `start_method="forkserver"` workers come from, with torch and
    this module imported in it once, now (at the loader's construction): it starts while the
    model is built, and each worker is then a fork of it instead of a fresh interpreter
    importing torch (1.2 s less to the first batch on a 2-core box). Idempotent; the preload
    list is this process's `multiprocessing` setting.

    The server and multiprocessing's resource tracker start with SIGUSR1 ignored (an ignored
    signal stays ignored across their exec): Slurm's pre-emption warning
    (`--signal=USR1@180`) goes to every process of the step, and its default action would end
    the server, and with it the workers, before the training process checkpoints."""
    multiprocessing.get_context("forkserver").set_forkserver_preload([__name__])
    if threading.current_thread() is not threading.main_thread():  # signal() works only there
        multiprocessing.forkserver.ensure_running()
        return
    before = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        multiprocessing.resource_tracker.ensure_running()
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGUSR1, before)


def _ignore_stop_signals(_worker_id: int) -> None:
    """Workers leave SIGUSR1 (Slurm's pre-emption warning, `--signal=USR1@180`) to the
    training process, which checkpoints and then stops them. SIGTERM keeps its default:
    multiprocessing ends workers with it when the process exits, and a worker that ignored
    it would hang that exit."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


@dataclass(frozen=True)
class _Chunk:
    """Rows `start:start + len(part.ids)` of a batch built in `count` chunks; `part` is a request
    for those samples alone (a sample's augmentation depends on its id, not on its row)."""

    part: BatchRequest
    start: int
    count: int


def _chunks(request: BatchRequest, count: int) -> Iterator[BatchRequest | _Chunk]:
    """`request` as up to `count` chunks of consecutive samples (itself when that is one)."""
    n = len(request.ids)
    bounds = np.linspace(0, n, min(count, n) + 1).astype(int).tolist()
    if len(bounds) <= 2:
        yield request
        return
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        part = replace(request, ids=request.ids[lo:hi], is_padding=request.is_padding[lo:hi])
        yield _Chunk(part, lo, len(bounds) - 1)


class _BatchWriter(torch.utils.data.Dataset):
    """What the workers run: the dataset's batch or a chunk of it, its images written into the
    batch's slot (at the chunk's rows) when there are slots."""

    def __init__(self, dataset: Dataset, slots: BatchSlots | None) -> None:
        self.dataset = dataset
        self.buffers = slots.buffers if slots is not None else None

    def __getitem__(self, item: BatchRequest | _Chunk) -> dict:
        chunk = item if isinstance(item, _Chunk) else None
        request = chunk.part if chunk is not None else item
        if self.buffers is None:
            batch = self.dataset.build_batch(request)
        else:
            slot = request.index % len(self.buffers)
            start = chunk.start if chunk is not None else 0
            batch = self.dataset.build_batch(request, out=self.buffers[slot, start:])
            batch["images"], batch["slot"] = None, slot
        if chunk is not None:
            worker = torch.utils.data.get_worker_info()
            batch["chunk"] = (chunk.start, chunk.count, worker.id if worker is not None else None)
        return batch


class _PlanSampler(Sampler):
    """Yields this rank's batch requests for the current epoch, from a start batch; the
    first one as its chunks, one per worker (see the module docstring)."""

    def __init__(self, dataset: Dataset, slots: BatchSlots | None = None, chunks: int = 1) -> None:
        self.dataset = dataset
        self.slots = slots
        self.chunks = chunks  # of the first batch
        self.epoch = 0
        self.history: tuple = ()

    def __len__(self) -> int:
        return self.dataset.plan(self.epoch, self.history).num_batches

    def __iter__(self) -> Iterator[BatchRequest]:
        # The plan of what this epoch has left after `history`: it starts at its batch 0.
        plan = self.dataset.plan(self.epoch, self.history)
        if self.slots is not None:
            self.slots.forget_claims()
        for index in range(plan.num_batches):
            if self.slots is not None:
                self.slots.claim(index)  # once per batch: its chunks share its slot
            request = self.dataset.request(plan, self.epoch, index)
            yield from _chunks(request, self.chunks) if index == 0 else (request,)
            self.dataset.prefetch_after(plan, index)


class ProcessEngine:
    """Batches of an epoch from DataLoader worker processes, in plan order."""

    # Skipped samples are counted in a worker's copy of the dataset: the loader adds them up.
    counts_in_workers = True

    def __init__(self, dataset: Dataset, cfg: LoaderConfig, slots: BatchSlots | None) -> None:
        workers = cfg.num_workers
        if workers > 0 and cfg.start_method == "forkserver":
            start_fork_server()
        self.slots = slots
        # Chunks of the first batch: one per worker (the DataLoader hands its items to the
        # workers in turn, so consecutive ones go to different workers).
        self.sampler = _PlanSampler(dataset, slots, chunks=workers)
        self.counts_in_workers = workers > 0
        self._dataloader = DataLoader(
            _BatchWriter(dataset, slots),
            sampler=self.sampler,
            batch_size=None,
            num_workers=workers,
            persistent_workers=workers > 0,
            prefetch_factor=cfg.prefetch_factor if workers > 0 else None,
            pin_memory=torch.device(cfg.device).type == "cuda",
            timeout=cfg.timeout_s,
            worker_init_fn=_ignore_stop_signals,
            multiprocessing_context=cfg.start_method if workers > 0 else None,
            # Its own generator: starting workers must not draw from the training loop's RNG.
            generator=torch.Generator().manual_seed(dataset.cfg.seed),
        )

    @staticmethod
    def slot_count(cfg: LoaderConfig) -> int:
        return cfg.prefetch_factor * cfg.num_workers + 2

    def batches(self, epoch: int, history: tuple) -> Iterator[dict]:
        self.sampler.epoch, self.sampler.history = epoch, history
        # The DataLoader's iterator is made here, in the caller's (main) thread, not at the first
        # batch, which device decode takes in its prefetch thread: torch watches its workers
        # with a SIGCHLD handler only when they start from the main thread.
        return self._with_chunks_joined(iter(self._dataloader))

    def _with_chunks_joined(self, items: Iterator[dict]) -> Iterator[dict]:
        for batch in items:
            if "chunk" in batch:  # the first of the batch's chunks: the others follow it
                batch = self._joined([batch] + [next(items) for _ in range(batch["chunk"][1] - 1)])
            yield batch

    def _joined(self, parts: list[dict]) -> dict:
        """One batch from its chunks, in order, equal to what a whole build gives; under
        "chunk_workers", the worker that built each chunk.

        Its slot is released (and may be claimed again) only after this batch is handed on,
        so only after every chunk written into it is done."""
        batch = {name: value for name, value in parts[0].items() if name != "chunk"}
        batch["labels"] = torch.cat([part["labels"] for part in parts])
        batch["padding"] = torch.cat([part["padding"] for part in parts])
        if "keys" in batch:
            batch["keys"] = [key for part in parts for key in part["keys"]]
        batch["corrupt"] = sum(part["corrupt"] for part in parts)
        batch["chunk_workers"] = [part["chunk"][2] for part in parts]
        if "encoded" in batch:  # decoded on the device: the JPEGs and their crop rows
            data = torch.cat([part["encoded"][0] for part in parts])
            batch["encoded"] = (data, [n for part in parts for n in part["encoded"][1]])
            batch["boxes"] = torch.cat([part["boxes"] for part in parts])
        elif batch.get("slot") is None:
            batch["images"] = torch.cat([part["images"] for part in parts])
        else:
            # Each chunk's good rows start at its first row; after a skipped (corrupt) sample the
            # rows after it move up, as a whole build leaves them (a copy, but a rare one).
            rows = [row for part in parts for row in range(part["chunk"][0], part["chunk"][0] + len(part["labels"]))]
            if rows != list(range(len(rows))):
                images = self.slots.buffers[batch["slot"]]
                images[: len(rows)] = images[torch.as_tensor(rows, dtype=torch.long)]
        return batch

    def close(self) -> None:
        iterator = getattr(self._dataloader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self._dataloader._iterator = None
