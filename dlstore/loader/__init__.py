"""The loader: batches of this rank on the device, in plan order, with an exact position.

`loader.py` (`Loader`) composes an engine that builds batches (`threads.py`, or `processes.py`;
`choose_engine` says which by default), the batch buffers (`slots.py`) and the GPU prefetcher (`prefetch.py`).
"""

from __future__ import annotations

from dlstore.loader.config import ENGINES, LoaderConfig, default_workers

# The rest pulls in torch: imported on first use, so that the settings (`dlstore.loader.config`,
# which the CLI's parsers read) do not make `dlstore ls` wait for it.
_LAZY = {
    "Loader": "dlstore.loader.loader",
    "choose_engine": "dlstore.loader.loader",
    "resolve_auto": "dlstore.loader.loader",
    "GpuPrefetcher": "dlstore.loader.prefetch",
    "BatchSlots": "dlstore.loader.slots",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dlstore.loader' has no attribute {name!r}")


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
