"""The loader: batches of this rank on the device, in plan order, with an exact position.

`Loader` composes an engine, `threads.py` or `processes.py`, as `choose_engine` says. It adds the
batch buffers of `slots.py` and the GPU prefetcher of `prefetch.py`.
"""

from __future__ import annotations

from dlstore.loader.config import ENGINES, LoaderConfig, default_workers

# The rest pulls in torch, so it is imported on first use. The CLI's parsers read the settings,
# and `dlstore ls` should not wait for torch.
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
