"""The loader: batches of this rank on the device, in plan order, with an exact position.

`loader.py` (`Loader`) composes an engine that builds batches (`threads.py`, or `processes.py`;
`choose_engine` says which by default), the batch buffers (`slots.py`) and the GPU prefetcher (`prefetch.py`).
"""

from __future__ import annotations

from dlstore.loader.config import ENGINES, LoaderConfig, default_workers
from dlstore.loader.loader import Loader, choose_engine, resolve_auto
from dlstore.loader.prefetch import GpuPrefetcher
from dlstore.loader.slots import BatchSlots

__all__ = [
    "ENGINES",
    "BatchSlots",
    "GpuPrefetcher",
    "Loader",
    "LoaderConfig",
    "choose_engine",
    "default_workers",
    "resolve_auto",
]
