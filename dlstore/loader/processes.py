"""The process engine: DataLoader worker processes, each building whole batches.

The default for a GPU (`choose_engine`: decode threads would share the training loop's GIL),
and for Python-heavy custom transforms that hold the GIL. The main process owns the epoch plan:
a sampler walks this rank's batches in order and hands each worker a whole batch request;
persistent workers decode and collate into a slot of a shared-memory ring (`BatchSlots`,
page-locked on a GPU node); the DataLoader returns batches in plan order.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Sampler

from dlstore.dataset import Dataset
from dlstore.loader.config import LoaderConfig
from dlstore.loader.slots import BatchSlots
from dlstore.sample_path import BatchRequest

__all__ = ["ProcessEngine"]


def _ignore_stop_signals(_worker_id: int) -> None:
    """Workers leave SIGUSR1 (Slurm's pre-emption warning, `--signal=USR1@180`) to the
    training process, which checkpoints and then stops them. SIGTERM keeps its default:
    multiprocessing ends workers with it when the process exits, and a worker that ignored
    it would hang that exit."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


class _SlotWriter(torch.utils.data.Dataset):
    """What the workers run: the dataset's batch, its images written into the batch's slot."""

    def __init__(self, dataset: Dataset, slots: BatchSlots) -> None:
        self.dataset = dataset
        self.buffers = slots.buffers
        self.count = slots.count

    def __getitem__(self, request: BatchRequest) -> dict:
        slot = request.index % self.count
        batch = self.dataset.build_batch(request, out=self.buffers[slot])
        batch["images"], batch["slot"] = None, slot
        return batch


class _PlanSampler(Sampler):
    """Yields this rank's batch requests for the current epoch, from a start batch."""

    def __init__(self, dataset: Dataset, slots: BatchSlots | None = None) -> None:
        self.dataset = dataset
        self.slots = slots
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
                self.slots.claim(index)
            yield self.dataset.request(plan, self.epoch, index)
            self.dataset.prefetch_after(plan, index)


class ProcessEngine:
    """Batches of an epoch from DataLoader worker processes, in plan order."""

    # Skipped samples are counted in a worker's copy of the dataset: the loader adds them up.
    counts_in_workers = True

    def __init__(self, dataset: Dataset, cfg: LoaderConfig, slots: BatchSlots | None) -> None:
        workers = cfg.num_workers
        self.sampler = _PlanSampler(dataset, slots)
        self.counts_in_workers = workers > 0
        self._dataloader = DataLoader(
            dataset if slots is None else _SlotWriter(dataset, slots),
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
        return iter(self._dataloader)

    def close(self) -> None:
        iterator = getattr(self._dataloader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self._dataloader._iterator = None
