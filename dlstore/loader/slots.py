"""Batch slots: a ring of uint8 image buffers allocated once, page-locked on CUDA."""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import numpy as np
import torch

__all__ = ["BatchSlots", "HandedBuffers"]

log = logging.getLogger(__name__)


class BatchSlots:
    """A ring of image buffers that batches are written into, allocated once.

    Why: a worker's batch as an ordinary tensor goes into a fresh shared-memory file each time.
    The worker faults it in page by page, and the training process maps it again. On a GPU node
    it is copied once more into pinned memory. Slots are allocated once and page-locked on CUDA,
    so the host-to-device copy reads the worker's bytes directly.

    Batch `i` goes into slot `i % count`. An engine keeps a known number of batches requested but
    not yet handed on. With two more slots than that, a slot is requested again only after its
    batch was taken. `claim` checks that, and waits for that batch's copy to the device.

    `shared=True` puts the ring in `/dev/shm`, for worker processes. The thread engine writes into
    ordinary memory of its own process.
    """

    def __init__(self, count: int, batch_size: int, image_size: int, device: torch.device, shared: bool = True) -> None:
        self.count = count
        self.buffers = torch.empty((count, batch_size, image_size, image_size, 3), dtype=torch.uint8)
        if shared:
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
        """The batch in `slot` was taken; `copied`, a CUDA event, marks the end of its copy."""
        self.claimed.discard(slot)
        if copied is not None:
            self.copies[slot] = copied

    def claim_next(self) -> int:
        """Claim the slot after the last one claimed this way.

        This is the thread engine's order. It runs on across epochs, whose batch indexes restart."""
        slot = self._turn = (getattr(self, "_turn", -1) + 1) % self.count
        self.claim(slot)
        return slot

    def forget_claims(self) -> None:
        """A new pass: batches requested by an abandoned one were drained by the DataLoader."""
        self.claimed.clear()


class HandedBuffers:
    """Buffers for uint8 batches on the CPU, reused once the loop has let go of them.

    Decode threads write into them, and worker processes' batches are copied into them. A fresh
    batch would be mapped anew and faulted in page by page. Each batch is a `torch.from_numpy`
    tensor over a pooled array, the root of every view the loop takes. When that tensor is
    garbage, no view is left, and its array goes back to the pool."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.free: list[np.ndarray] = []
        self.lock = threading.Lock()

    def take(self, n: int, batch_size: int, size: int) -> torch.Tensor:
        """A tensor of `n` rows over a pooled whole batch; a short last batch has fewer."""
        shape = (batch_size, size, size, 3)
        with self.lock:
            found = next((i for i, a in enumerate(self.free) if a.shape == shape), None)
            array = self.free.pop(found) if found is not None else None
        if array is None:
            array = np.empty(shape, dtype=np.uint8)
        tensor = torch.from_numpy(array[:n])
        weakref.finalize(tensor, self._give_back, array)
        return tensor

    def _give_back(self, array: np.ndarray) -> None:
        with self.lock:
            if len(self.free) < self.keep:
                self.free.append(array)


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
