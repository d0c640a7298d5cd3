"""The process engine: DataLoader worker processes, each building whole batches.

The default on a GPU and for custom transforms that hold the GIL. The main process owns the
epoch plan. A sampler walks this rank's batches in order and hands each worker a whole batch
request. Persistent workers decode and collate into a slot of `BatchSlots`, a shared-memory
ring. The DataLoader returns batches in plan order.

The first batch of each pass is the exception. Built by one worker, it would keep the loop
waiting a whole batch's decode. So it goes out as one chunk of samples per worker, all written
into the batch's slot, and the engine joins them. Later batches stay whole: that is cheapest.

Epochs follow on without a pause. After a fresh epoch's last request the sampler goes on with
the next epoch's, whose plan is a pure function of the epoch. So the workers never run dry, and
the next `iter()` finds that epoch's first batches built. Anything else starts a fresh pass.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import signal
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from dlstore.dataset import Dataset
from dlstore.errors import NoSpace
from dlstore.loader.config import LoaderConfig
from dlstore.loader.slots import BatchSlots
from dlstore.sample_path import BatchRequest

__all__ = ["ProcessEngine"]


def start_fork_server() -> None:
    """Start the fork server for `start_method="forkserver"` now, with torch imported once.

    It starts while the model is built, so each worker is a fork, not a fresh interpreter. The call
    is idempotent. The server and the resource tracker start with SIGUSR1 ignored, and that lasts
    across their exec. Slurm's pre-emption warning goes to every process of the step. Its default
    action would end the server and workers before the training process checkpoints."""
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
    """Workers leave SIGUSR1, Slurm's pre-emption warning, to the training process.

    That process checkpoints and then stops them. SIGTERM keeps its default: multiprocessing
    ends workers with it at exit, and a worker that ignored it would hang that exit."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


@dataclass(frozen=True)
class _Whole:
    """A whole batch, written into `slot` (None: no slots)."""

    request: BatchRequest
    slot: int | None


@dataclass(frozen=True)
class _Chunk:
    """Rows `start:start + len(part.ids)` of a batch built in `count` chunks.

    `part` requests those samples alone: a sample's augmentation depends on its id, not its row."""

    part: BatchRequest
    start: int
    count: int
    slot: int | None


def _chunks(request: BatchRequest, count: int, slot: int | None) -> Iterator[_Whole | _Chunk]:
    """`request` as up to `count` chunks of consecutive samples (whole when that is one)."""
    n = len(request.ids)
    bounds = np.linspace(0, n, min(count, n) + 1).astype(int).tolist()
    if len(bounds) <= 2:
        yield _Whole(request, slot)
        return
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        part = replace(request, ids=request.ids[lo:hi], is_padding=request.is_padding[lo:hi])
        yield _Chunk(part, lo, len(bounds) - 1, slot)


class _BatchWriter(torch.utils.data.Dataset):
    """What the workers run: a batch or a chunk of it, written into the batch's slot if any."""

    def __init__(self, dataset: Dataset, slots: BatchSlots | None) -> None:
        self.dataset = dataset
        self.buffers = slots.buffers if slots is not None else None

    def __getitem__(self, item: _Whole | _Chunk) -> dict:
        chunk = item if isinstance(item, _Chunk) else None
        request = chunk.part if chunk is not None else item.request
        if self.buffers is None or item.slot is None:
            batch = self.dataset.build_batch(request)
        else:
            start = chunk.start if chunk is not None else 0
            batch = self.dataset.build_batch(request, out=self.buffers[item.slot, start:])
            batch["images"], batch["slot"] = None, item.slot
        worker = torch.utils.data.get_worker_info()
        if chunk is not None:
            batch["chunk"] = (chunk.start, chunk.count, worker.id if worker is not None else None)
        if worker is not None:
            _into_shared_memory(batch)
        return batch


def _into_shared_memory(batch: dict) -> None:
    """Move the batch's tensors into /dev/shm here, in the worker, as its hand-off would.

    The hand-off does it in the queue's feeder thread, which only prints a failure and drops the
    batch. The loop would then wait for it forever. Raised here, the error reaches the loop."""
    for name, value in _tensors(batch):
        if not value.is_shared():
            try:
                value.share_memory_()
            except (RuntimeError, OSError) as exc:
                if "No space" not in str(exc) and getattr(exc, "errno", None) != errno.ENOSPC:
                    raise  # another trouble, such as too many open files: not for this advice
                raise NoSpace(
                    f"a worker process cannot put its batch's {name!r} ({value.nbytes} bytes) into /dev/shm "
                    f"({exc}): give /dev/shm more room (docker run --shm-size), or use engine='threads' "
                    "(no /dev/shm)"
                ) from None


def _tensors(batch: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The batch's tensors with their names, including those in tuples and lists."""
    for name, value in batch.items():
        values = value if isinstance(value, (tuple, list)) else (value,)
        for part in values:
            if isinstance(part, torch.Tensor):
                yield name, part


class _PlanSampler(Sampler):
    """Yields this rank's batch requests from `epoch` and `history` on.

    That is the epoch's rest and, for a fresh epoch, the epochs after it. The pass's first batch
    goes as chunks, one per worker. Batches take the ring's slots in turn."""

    def __init__(
        self, dataset: Dataset, slots: BatchSlots | None = None, chunks: int = 1, reads=lambda epoch: True
    ) -> None:
        self.dataset = dataset
        self.reads = reads  # whether the run reads an epoch (`LoaderConfig.reads`)
        self.slots = slots
        self.chunks = chunks  # of the first batch
        self.epoch = 0
        self.history: tuple = ()

    def __len__(self) -> int:  # the first epoch's
        return self.dataset.plan(self.epoch, self.history).num_batches

    def __iter__(self) -> Iterator[_Whole | _Chunk]:
        epoch, history, sequence = self.epoch, self.history, 0
        if self.slots is not None:
            self.slots.forget_claims()
        while True:
            # The plan of what this epoch has left after `history`: it starts at its batch 0.
            plan = self.dataset.plan(epoch, history)
            for index in range(plan.num_batches):
                slot = None
                if self.slots is not None:
                    self.slots.claim(sequence)  # once per batch: its chunks share its slot
                    slot = self.slots.slot_of(sequence)
                request = self.dataset.request(plan, epoch, index, fresh_pass=sequence == 0)
                yield from _chunks(request, self.chunks, slot) if sequence == 0 else (_Whole(request, slot),)
                sequence += 1
                self.dataset.prefetch_after(plan, index)
            if history or plan.num_batches == 0:  # a resumed epoch: the next pass is not known here
                return
            if not self.reads(epoch + 1):  # the run's last epoch: nothing built or fetched past it
                return
            epoch += 1


class ProcessEngine:
    """Batches of an epoch from DataLoader worker processes, in plan order."""

    #: Engines not yet garbage-collected: closed as the program exits (`_close_live_engines`).
    live: weakref.WeakSet[ProcessEngine] = weakref.WeakSet()

    def __init__(self, dataset: Dataset, cfg: LoaderConfig, slots: BatchSlots | None) -> None:
        workers = cfg.num_workers
        if workers > 0 and cfg.start_method == "forkserver":
            start_fork_server()
        self.dataset = dataset
        self.slots = slots
        if workers > 0:
            dataset.samples.share_decode_marks()
        # One chunk of the first batch per worker: the DataLoader hands items to workers in turn.
        self.sampler = _PlanSampler(dataset, slots, chunks=workers, reads=cfg.reads)
        # Batches already requested for the pass after a full one: ((epoch, history), batches).
        self._follow_on: tuple[tuple, Iterator[dict]] | None = None
        self._closes = 0  # close() calls: a pass that ends after one keeps nothing for the next
        # `_guard` orders a pass waiting in the DataLoader against close() in another thread.
        self._guard = threading.Lock()
        self._waiting = 0
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
        ProcessEngine.live.add(self)

    @staticmethod
    def slot_count(cfg: LoaderConfig) -> int:
        return cfg.prefetch_factor * cfg.num_workers + 2

    def batches(self, epoch: int, history: tuple) -> Iterator[dict]:
        """This epoch's batches after `history`: those requested ahead if this pass follows a
        full one, else a fresh pass of the DataLoader."""
        follow_on, self._follow_on = self._follow_on, None
        if follow_on is not None and follow_on[0] == (epoch, history):
            items = follow_on[1]
        else:
            self.sampler.epoch, self.sampler.history = epoch, history
            # Make the iterator here, in the caller's main thread, not in a prefetch thread.
            # Torch watches its workers with a SIGCHLD handler only when started from there.
            try:
                items = self._with_chunks_joined(iter(self._dataloader))
            except OSError as exc:  # its queues' locks are POSIX semaphores, files in /dev/shm
                if exc.errno != errno.ENOSPC:
                    raise
                raise NoSpace(
                    f"cannot start the worker processes' queues: /dev/shm is full ({exc.strerror}): give it more "
                    "room (docker run --shm-size), or use engine='threads' (no /dev/shm)"
                ) from None
        return self._one_epoch(items, epoch, history)

    def _one_epoch(self, items: Iterator[dict], epoch: int, history: tuple) -> Iterator[dict]:
        """The epoch's batches from `items`; the rest of `items` is kept for the next pass."""
        closes, count = self._closes, self.dataset.plan(epoch, history).num_batches
        for index in range(count):
            with self._guard:
                self._check_open(closes)
                self._waiting += 1
            try:
                batch = next(items)
            except StopIteration:
                self._check_open(closes)
                raise RuntimeError(
                    f"epoch {epoch} ended after {index} batches, short of its plan (a loader bug)"
                ) from None
            except RuntimeError:  # the workers ended by a close() in another thread: say that
                self._check_open(closes)
                raise
            finally:
                with self._guard:
                    self._waiting -= 1
            if index == 0:
                self.dataset.first_batch_delivered()
            yield batch
        started_ahead = count and self._dataloader.num_workers > 0 and self.sampler.reads(epoch + 1)
        if not history and started_ahead and closes == self._closes:
            self._follow_on = ((epoch + 1, ()), items)

    def _check_open(self, closes: int) -> None:
        """Raise if `close()` was called since the pass that saw `closes` began.

        Workers ended by a close() from another thread are cleaned up here, in the pass's thread."""
        if self._closes == closes:
            return
        iterator = getattr(self._dataloader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self._dataloader._iterator = None
        raise RuntimeError("the loader was closed during this pass: iterate it again to go on")

    def _with_chunks_joined(self, items: Iterator[dict]) -> Iterator[dict]:
        for batch in items:
            if "chunk" in batch:  # the first of the batch's chunks: the others follow it
                batch = self._joined([batch] + [next(items) for _ in range(batch["chunk"][1] - 1)])
            yield batch

    def _joined(self, parts: list[dict]) -> dict:
        """One batch from its chunks, equal to what a whole build gives.

        "chunk_workers" names the worker that built each chunk. The slot is released only after
        this batch is handed on, so only after every chunk written into it is done."""
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
            # Each chunk's good rows start at its first row. After a skipped corrupt sample, later
            # rows move up, as a whole build leaves them. That copy is rare.
            rows = [row for part in parts for row in range(part["chunk"][0], part["chunk"][0] + len(part["labels"]))]
            if rows != list(range(len(rows))):
                images = self.slots.buffers[batch["slot"]]
                images[: len(rows)] = images[torch.as_tensor(rows, dtype=torch.long)]
        return batch

    def close(self) -> None:
        """Stop the workers.

        The DataLoader's shutdown cannot wake a pass waiting in another thread: it would wait
        forever for workers it no longer watches. So its workers are ended, and the pass raises."""
        with self._guard:
            self._closes += 1
            self._follow_on = None
            waiting = self._waiting > 0
        iterator = getattr(self._dataloader, "_iterator", None)
        if waiting and iterator is not None:
            for worker in getattr(iterator, "_workers", []):
                if worker.is_alive():
                    worker.terminate()
            return
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self._dataloader._iterator = None


@atexit.register  # after multiprocessing's and torch's hooks: it runs before them
def _close_live_engines() -> None:
    """Close the loaders a program left open as it exits.

    Otherwise multiprocessing's exit hook kills their persistent workers. Each would leave its
    `pymp-*` temp folder in /tmp, which its own exit removes."""
    for engine in list(ProcessEngine.live):
        with contextlib.suppress(Exception):  # the exit goes on: what is left is what a kill leaves
            engine.close()
