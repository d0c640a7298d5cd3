"""From the dataset to the training loop: DataLoader workers, pinned memory, and a
GPU prefetcher that copies batches ahead on a side CUDA stream.

The main process owns the epoch plan: a sampler walks this rank's batches in order and
hands each worker a whole batch request; persistent workers decode and collate into a slot
of a shared-memory buffer allocated once (on a GPU node also page-locked, so the copy to the
device reads it directly); the DataLoader returns batches in plan order, so what the
training loop sees does not depend on the number of workers. The loader counts batches
*delivered to the loop* (not those fetched ahead), so `state_dict()` is the exact position.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from dlstore.dataset import Dataset
from dlstore.errors import ConfigError, CorruptSample
from dlstore.plan import EpochState
from dlstore.sample_path import BatchRequest
from dlstore.transforms import IMAGENET_MEAN, IMAGENET_STD, decode_on_device
from dlstore.world import World, available_cores

__all__ = ["GpuPrefetcher", "Loader", "LoaderConfig", "default_workers"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoaderConfig:
    num_workers: int = 8
    device: str = "cuda"
    # Batches decoded ahead per worker, and batches copied to the device ahead of the loop.
    prefetch_factor: int = 2
    device_lookahead: int = 2
    dtype: str = "float32"  # or "bfloat16", "float16", "uint8" (no normalisation)
    normalize: bool = True
    channels_last: bool = True
    timeout_s: float = 0.0
    # Workers write images into slots of one shared-memory buffer (see `BatchSlots`); False
    # hands each batch over as a fresh shared-memory tensor (torch's default, more page faults).
    shared_slots: bool = True


def default_workers(workers: int | None, world: World) -> int:
    """`workers`, or when None one per core this rank gets: the node's cores shared by the
    node's ranks (more only makes them compete; torch warns about it)."""
    if workers is not None:
        return workers
    return max(1, available_cores() // world.local_world_size)


def _ignore_stop_signals(_worker_id: int) -> None:
    """Workers leave SIGUSR1 (Slurm's pre-emption warning, `--signal=USR1@180`) to the
    training process, which checkpoints and then stops them. SIGTERM keeps its default:
    multiprocessing ends workers with it when the process exits, and a worker that ignored
    it would hang that exit."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


class BatchSlots:
    """A ring of image buffers in shared memory that the workers write batches into.

    Why: handing a batch from a worker as an ordinary tensor puts it into a fresh
    shared-memory file each time, which the worker faults in page by page and the training
    process maps again and, on a GPU node, copies once more into pinned memory. Slots are
    allocated once; on CUDA they are page-locked (`cudaHostRegister`), so the host-to-device
    copy reads the worker's bytes directly.

    Batch `i` goes into slot `i % count`. The DataLoader keeps at most
    `prefetch_factor x workers` batches requested but not yet handed on, so with two more
    slots than that, a slot is requested again only after the batch in it has been taken;
    `claim` checks that, and waits for that batch's copy to the device to finish.
    """

    def __init__(self, count: int, batch_size: int, image_size: int, device: torch.device) -> None:
        self.count = count
        self.buffers = torch.empty((count, batch_size, image_size, image_size, 3), dtype=torch.uint8)
        self.buffers.share_memory_()
        self.device = device
        self.claimed: set[int] = set()
        self.copies: dict[int, Any] = {}  # slot -> CUDA event of the copy out of it
        self.page_locked = device.type == "cuda" and _page_lock(self.buffers)
        if self.page_locked:
            weakref.finalize(self, _page_unlock, self.buffers, device)

    def slot_of(self, index: int) -> int:
        return index % self.count

    def claim(self, index: int) -> None:
        """Before batch `index` is requested from a worker: its slot must be free."""
        slot = self.slot_of(index)
        if slot in self.claimed:
            raise RuntimeError(f"batch slot {slot} requested again before its batch was taken (a loader bug)")
        event = self.copies.pop(slot, None)
        if event is not None:
            event.synchronize()
        self.claimed.add(slot)

    def view(self, slot: int, count: int) -> torch.Tensor:
        return self.buffers[slot, :count]

    def release(self, slot: int, copied: Any = None) -> None:
        """The batch in `slot` was taken; `copied` (a CUDA event) marks the end of its copy."""
        self.claimed.discard(slot)
        if copied is not None:
            self.copies[slot] = copied

    def forget_claims(self) -> None:
        """A new pass: batches requested by an abandoned one were drained by the DataLoader."""
        self.claimed.clear()


def _page_lock(buffers: torch.Tensor) -> bool:
    try:
        # 1 = cudaHostRegisterPortable: page-locked for every device, not only the current one.
        error = torch.cuda.cudart().cudaHostRegister(buffers.data_ptr(), buffers.nbytes, 1)
        if int(error) == 0:
            return True
        log.warning("cudaHostRegister failed (%s): batches are copied to the device from pageable memory", error)
    except Exception as exc:  # an old or CPU-only build of torch
        log.warning("cannot page-lock the batch buffers (%s): copies to the device are synchronous", exc)
    return False


def _page_unlock(buffers: torch.Tensor, device: torch.device) -> None:
    torch.cuda.synchronize(device)  # no copy out of the buffers may still be running
    torch.cuda.cudart().cudaHostUnregister(buffers.data_ptr())


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


class GpuPrefetcher:
    """Copies the next `lookahead` batches to `device` on a side stream, then converts them
    (uint8 NHWC → float NCHW channels_last, normalised) on the GPU.

    Why a side stream: the host-to-device copy of batch k+1 overlaps the compute of batch k.
    The consumer's stream waits on an event before it touches a batch, and the tensors are
    marked with `record_stream` so the caching allocator does not reuse their memory early.
    On a CPU device the same code runs without streams.
    """

    def __init__(
        self,
        batches: Iterator[dict],
        cfg: LoaderConfig,
        device: torch.device,
        slots: BatchSlots | None = None,
        on_corrupt: str = "skip",
        background: bool = False,
    ) -> None:
        self.batches = batches
        self.slots = slots
        self.on_corrupt = on_corrupt
        self.background = background
        self.cfg = cfg
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        dtype = getattr(torch, cfg.dtype)
        self.dtype = dtype
        self.mean = torch.tensor(IMAGENET_MEAN, device=device, dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD, device=device, dtype=torch.float32).view(1, 3, 1, 1)
        # (x - mean) / std, written as x * scale + shift so that it can run in place.
        self.scale = 1.0 / self.std
        self.shift = -self.mean / self.std
        self.pending: list[tuple[dict, Any]] = []
        if self.cuda:  # the constants above were made on the current stream; the side stream reads them
            self.stream.wait_stream(torch.cuda.current_stream(device))

    def _to_device(self, batch: dict) -> dict:
        if batch.get("encoded") is not None:
            size = batch["images"].shape[1]
            # nvJPEG reads the encoded bytes from (pinned) host memory itself.
            data, lengths = batch["encoded"]
            parts = data.split(lengths) if lengths else []
            images, bad = decode_on_device(parts, batch["boxes"], size, self.device)
            if bad:
                batch = self._drop_undecodable(batch, bad)
        elif batch["images"] is None:
            images = self.slots.view(batch["slot"], len(batch["labels"]))
            if self.cuda:
                # Page-locked: an asynchronous DMA; the slot is reused after its event.
                images = images.to(self.device, non_blocking=self.slots.page_locked)
            elif self.dtype == torch.uint8:
                images = images.clone()  # the slot is reused once this batch is handed on
        else:
            images = batch["images"].to(self.device, non_blocking=True)
        labels = batch["labels"].to(self.device, non_blocking=True)
        # NHWC uint8 -> NCHW view with channels_last strides: no copy.
        images = images.permute(0, 3, 1, 2)
        if self.dtype != torch.uint8:
            # One float copy (it keeps the channels_last strides), then scale and shift in place:
            # `(images - mean) / std` made two more batch-sized temporaries, and on a CPU device,
            # where this runs in the training process, took 2.7x as long (the loader's bottleneck).
            images = images.to(torch.float32, copy=True)
            if self.cfg.normalize:
                images.mul_(self.scale).add_(self.shift)
            images = images.to(self.dtype)
            if self.cfg.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            else:
                images = images.contiguous()
        out = dict(batch)
        out["images"], out["labels"] = images, labels
        return out

    def _drop_undecodable(self, batch: dict, bad: list[int]) -> dict:
        """The batch without the samples whose JPEG the device could not decode (the worker
        read their headers, so this is rare): skipped and counted, or `CorruptSample`."""
        if self.on_corrupt == "raise":
            raise CorruptSample(f"{len(bad)} JPEG(s) of batch {batch.get('index')} do not decode on {self.device}")
        log.warning("skipping %d sample(s) whose JPEG does not decode on %s", len(bad), self.device)
        keep = [i for i in range(len(batch["labels"])) if i not in bad]
        out = dict(batch, labels=batch["labels"][keep], padding=batch["padding"][keep])
        if "keys" in batch:
            out["keys"] = [batch["keys"][i] for i in keep]
        out["undecodable"] = len(bad)
        return out

    def _prepare(self, batch: dict) -> tuple[dict, Any]:
        """`batch` on the device (on the side stream), and the event that marks it ready."""
        if self.cuda:
            with torch.cuda.stream(self.stream):
                ready = self._to_device(batch)
                event = torch.cuda.Event()
                event.record(self.stream)
        else:
            ready, event = self._to_device(batch), None
        if batch.get("slot") is not None:
            self.slots.release(batch["slot"], event)
        return ready, event

    def _enqueue(self) -> bool:
        try:
            batch = next(self.batches)
        except StopIteration:
            return False
        self.pending.append(self._prepare(batch))
        return True

    def _hand_over(self, batch: dict, event: Any) -> dict:
        """The consumer's stream waits for the batch, whose memory is then also in its use."""
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for value in (batch["images"], batch["labels"]):
                value.record_stream(current)
        return batch

    def __iter__(self) -> Iterator[dict]:
        if self.background:
            yield from self._iter_background()
            return
        while len(self.pending) < max(1, self.cfg.device_lookahead) and self._enqueue():
            pass
        while self.pending:
            batch, event = self.pending.pop(0)
            self._hand_over(batch, event)
            self._enqueue()
            yield batch

    def _iter_background(self) -> Iterator[dict]:
        """`__iter__` with the batches prepared by a thread. Why: decoding on the device
        blocks the calling thread for the whole decode (torchvision waits for nvJPEG), and
        the resize of each image is a handful of kernel launches; in the training thread
        both would hold back the launch of the next training step."""
        ready: queue.Queue = queue.Queue(maxsize=max(1, self.cfg.device_lookahead))
        stop = threading.Event()

        def put(item: Any) -> None:
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return
                except queue.Full:
                    continue

        def produce() -> None:
            try:
                if self.cuda:
                    torch.cuda.set_device(self.device)
                for batch in self.batches:
                    if stop.is_set():
                        return
                    put(self._prepare(batch))
                put(_END)
            except BaseException as exc:  # handed to the consumer, raised there
                put(_Failure(exc))

        thread = threading.Thread(target=produce, name="dlstore-device-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                item = ready.get()
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.error
                yield self._hand_over(*item)
        finally:
            stop.set()
            thread.join()


_END = object()


@dataclass(frozen=True)
class _Failure:
    error: BaseException


class Loader:
    """Batches of this rank, on the device, normalised, channels_last.

    >>> ds = dlstore.Dataset("swift://imagenet/train", batch_size=256)     # doctest: +SKIP
    >>> loader = dlstore.Loader(ds, num_workers=8, device="cuda")
    >>> loader.set_epoch(0)
    >>> for images, labels in loader: ...

    With `Dataset(..., return_keys=True)` each batch comes as `(images, labels, meta)`, where
    `meta["keys"]` are the samples' keys and `meta["padding"]` marks the samples that repeat
    one already delivered this epoch to keep the ranks equal (count them out of evaluation).
    """

    def __init__(self, dataset: Dataset, num_workers: int | None = None, device: str = "cuda", **options: Any) -> None:
        if num_workers is None:
            num_workers = default_workers(dataset.cfg.workers, dataset.world)
        self.cfg = LoaderConfig(num_workers=num_workers, device=device, **options)
        if self.cfg.device.startswith("cuda") and not torch.cuda.is_available():
            log.warning("CUDA is not available: the loader delivers batches on the CPU")
            self.cfg = LoaderConfig(**{**self.cfg.__dict__, "device": "cpu"})
        self.device = torch.device(self.cfg.device)
        self.dataset = dataset
        self.state = EpochState(epoch=0, history=())
        workers = self.cfg.num_workers
        self.slots: BatchSlots | None = None
        # Slots pay where the batch is copied out of them anyway: to the GPU, or into the float
        # batch on a CPU device. A uint8 batch on the CPU is handed over as it is (no copy).
        copied_out = self.device.type == "cuda" or self.cfg.dtype != "uint8"
        if workers > 0 and self.cfg.shared_slots and copied_out and dataset.cfg.decode_on == "worker":
            self.slots = BatchSlots(
                self.cfg.prefetch_factor * workers + 2,
                dataset.cfg.batch_size,
                dataset.cfg.transform.image_size,
                self.device,
            )
        self.sampler = _PlanSampler(dataset, self.slots)
        self._dataloader = DataLoader(
            dataset if self.slots is None else _SlotWriter(dataset, self.slots),
            sampler=self.sampler,
            batch_size=None,
            num_workers=workers,
            persistent_workers=workers > 0,
            prefetch_factor=self.cfg.prefetch_factor if workers > 0 else None,
            pin_memory=self.device.type == "cuda",
            timeout=self.cfg.timeout_s,
            worker_init_fn=_ignore_stop_signals,
            # Its own generator: starting workers must not draw from the training loop's RNG.
            generator=torch.Generator().manual_seed(dataset.cfg.seed),
        )

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning, unless a loaded state resumes this very epoch."""
        if epoch != self.state.epoch:
            self.state = EpochState(epoch=epoch, history=())

    def __len__(self) -> int:
        """Batches this rank has left in the current epoch (the same on every rank)."""
        return self.dataset.plan(self.state.epoch, self.state.history).num_batches

    def __iter__(self) -> Iterator:
        self.sampler.epoch = self.state.epoch
        self.sampler.history = self.state.history
        prefetcher = GpuPrefetcher(
            iter(self._dataloader),
            self.cfg,
            self.device,
            self.slots,
            on_corrupt=self.dataset.cfg.on_corrupt,
            background=self.dataset.cfg.decode_on == "device",
        )
        for batch in prefetcher:
            self.state = self.state.advance(self.dataset.world, self.dataset.cfg.batch_size, 1)
            if self.cfg.num_workers > 0:
                # Skipped samples were counted in a worker's copy of the dataset; count them here.
                self.dataset.corrupt_samples += batch.get("corrupt", 0)
            self.dataset.corrupt_samples += batch.get("undecodable", 0)
            if self.dataset.cfg.return_keys:
                yield batch["images"], batch["labels"], {"keys": batch["keys"], "padding": batch["padding"]}
            else:
                yield batch["images"], batch["labels"]
        # A finished epoch resumes at the next one.
        self.state = EpochState(epoch=self.state.epoch + 1, history=())

    def close(self) -> None:
        """Stop the workers now (they also stop when the loader is garbage-collected)."""
        iterator = getattr(self._dataloader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self._dataloader._iterator = None

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict:
        """The exact position: epoch and the steps done in it (per world layout), with the
        fingerprint of what decides the order (the manifest's shards, the plan settings)."""
        return {"version": 1, "seed": self.dataset.cfg.seed, **self.state.to_dict(), "data": self._fingerprint()}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Continue from `state`. A state saved on other data (a dataset converted again) or
        other plan settings would replay another order, skipping and repeating samples: that
        is a `ConfigError` naming what changed, unless `strict=False` (then a warning)."""
        if state.get("version") != 1:
            raise ConfigError(f"unknown loader state version {state.get('version')!r}")
        if state.get("seed") != self.dataset.cfg.seed:
            raise ConfigError("loader state was saved with another seed; resuming would change the data order")
        saved, now = state.get("data"), self._fingerprint()
        changed = [k for k in now if saved is not None and saved.get(k) != now[k]]
        if changed:
            what = ", ".join(f"{k} (saved {saved.get(k)!r}, now {now[k]!r})" for k in changed)
            message = f"loader state was saved on other data or plan settings: {what}"
            if strict:
                raise ConfigError(message + "; pass strict=False (dlstore train --resume-any-data) to resume anyway")
            log.warning("%s; resuming anyway, as asked", message)
        self.state = EpochState.from_dict(state)

    def _fingerprint(self) -> dict:
        cfg = self.dataset.cfg
        return {
            "manifest": self.dataset.manifest_digest,
            "drop_last": cfg.drop_last,
            "shuffle": cfg.shuffle,
            "shuffle_window": cfg.shuffle_window,
        }
