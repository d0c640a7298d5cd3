"""The GPU prefetcher: batches copied ahead of the loop on a side stream, normalised there."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dlstore.errors import CorruptSample
from dlstore.loader.config import LoaderConfig
from dlstore.loader.slots import BatchSlots, HandedBuffers
from dlstore.transforms import IMAGENET_MEAN, IMAGENET_STD, DeviceJpegDecoder, decode_on_device

__all__ = ["GpuPrefetcher"]

log = logging.getLogger(__name__)


class GpuPrefetcher:
    """Copies the next `lookahead` batches to `device` on a side stream, then converts them.

    Conversion turns uint8 NHWC into normalised float NCHW, channels_last, on the GPU. The side
    stream lets the copy of batch k+1 overlap the compute of batch k. The consumer's stream waits
    on an event before it touches a batch. `record_stream` keeps the caching allocator from
    reusing their memory early. On a CPU device the same code runs without streams.
    """

    def __init__(
        self,
        batches: Iterator[dict],
        cfg: LoaderConfig,
        device: torch.device,
        slots: BatchSlots | None = None,
        on_corrupt: str = "skip",
        background: bool = False,
        decoder: DeviceJpegDecoder | None = None,
        padding_to_device: bool = False,
    ) -> None:
        self.batches = batches
        self.padding_to_device = padding_to_device  # `return_keys` hands the marks on: on the device too
        self.decoder = decoder  # decodes batches of JPEGs on the device; torchvision's if None
        self.slots = slots
        self.on_corrupt = on_corrupt
        self.background = background
        self.cfg = cfg
        self.cuda = device.type == "cuda"
        if self.cuda and device.index is None:
            # An index-less "cuda" is the current device. A background thread must be told which:
            # `torch.cuda.set_device` refuses a device without an index.
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        dtype = getattr(torch, cfg.dtype)
        self.dtype = dtype
        self.mean = torch.tensor(IMAGENET_MEAN, device=device, dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD, device=device, dtype=torch.float32).view(1, 3, 1, 1)
        # x * scale + shift is (x - mean) / std, written to run in place.
        self.scale = 1.0 / self.std
        self.shift = -self.mean / self.std
        self.pending: list[tuple[dict, Any]] = []
        # uint8 CPU batches copied out of slots go into reused buffers: fresh ones cost page faults.
        self.handed = HandedBuffers(keep=cfg.device_lookahead + 2)
        if self.cuda:  # the constants above were made on the current stream; the side stream reads them
            self.stream.wait_stream(torch.cuda.current_stream(device))

    def _to_device(self, batch: dict) -> dict:
        if batch.get("encoded") is not None:
            size = batch["image_size"]  # the data config's, carried by the batch
            # nvJPEG reads the encoded bytes from pinned host memory itself.
            data, lengths = batch["encoded"]
            parts = data.split(lengths) if lengths else []
            images, bad = decode_on_device(parts, batch["boxes"], size, self.device, self.decoder)
            if bad:
                batch = self._drop_undecodable(batch, bad)
        elif batch["images"] is None:
            images = self.slots.view(batch["slot"], len(batch["labels"]))
            if self.cuda:
                # Page-locked: an asynchronous DMA; the slot is reused after its event.
                images = images.to(self.device, non_blocking=self.slots.page_locked)
            elif self.dtype == torch.uint8:  # the slot is reused once this batch is handed on
                size = self.slots.buffers.shape[2]
                images = self.handed.take(len(images), self.slots.buffers.shape[1], size).copy_(images)
        else:
            images = self._moved(batch["images"])
        labels = self._moved(batch["labels"])
        # Beside the labels, on this side stream. A consumer's copy on its own stream might wait
        # there for the work queued before it.
        padding = self._moved(batch["padding"]) if self.padding_to_device else None
        # NHWC uint8 -> NCHW view with channels_last strides: no copy.
        images = images.permute(0, 3, 1, 2)
        if self.dtype != torch.uint8:
            # One float copy keeps the channels_last strides; scale and shift then run in place.
            # `(images - mean) / std` would make two more batch-sized temporaries.
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
        if padding is not None:
            out["padding"] = padding
        else:  # not handed on: left behind, not passed on in host memory
            out.pop("padding", None)
        return out

    def _moved(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` on the device. One there already is passed as it is: even a no-op `to` lets
        go of the GIL (see `dlstore.loader.threads`)."""
        return tensor if tensor.device == self.device else tensor.to(self.device, non_blocking=True)

    def _drop_undecodable(self, batch: dict, bad: list[int]) -> dict:
        """The batch without samples whose JPEG the device could not decode.

        The worker read their headers, so this is rare. They are skipped and counted, or raise
        `CorruptSample`."""
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
        """`batch` on the device via the side stream, and the event that marks it ready."""
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
            for name in ("images", "labels", "padding"):
                if name in batch and batch[name].is_cuda:  # record_stream has no CPU kernel
                    batch[name].record_stream(current)
        return batch

    def __iter__(self) -> Iterator[dict]:
        if self.background:
            yield from self._iter_background()
            return
        # Copies ahead are topped up after each hand-over, not before the first. Taking a batch
        # waits for its decode, and the loop should start once the first is ready. On a CPU
        # device a batch is ready when prepared, so nothing is prepared ahead.
        ahead = max(1, self.cfg.device_lookahead) if self.cuda else 1
        self._enqueue()
        while self.pending:
            batch, event = self.pending.pop(0)
            self._hand_over(batch, event)
            yield batch
            while len(self.pending) < ahead and self._enqueue():
                pass

    def _iter_background(self) -> Iterator[dict]:
        """`__iter__` with the batches prepared by a thread.

        Decoding on the device blocks the calling thread for the whole decode. Each image's resize
        is a handful of kernel launches. In the training thread both would delay the next step."""
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
                # Check the stop before each batch: taking one builds it or waits for retries.
                # A loop that has left need not wait for that.
                while not stop.is_set():
                    try:
                        batch = next(self.batches)
                    except StopIteration:
                        put(_END)
                        return
                    put(self._prepare(batch))
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
