"""dlstore: data loading and storage for GPU training on cloud testbeds.

>>> import dlstore
>>> store = dlstore.open_store("file:///tmp/example")    # doctest: +SKIP
"""

from dlstore.config import DataConfig, StoreConfig, TransformConfig
from dlstore.errors import (
    AuthError,
    ConfigError,
    CorruptSample,
    CorruptShard,
    DlstoreError,
    FormatError,
    NoSpace,
    NotFound,
    ProgramExiting,
    TransientError,
)
from dlstore.storage import ObjectInfo, Store, open_object, open_store
from dlstore.world import World

__version__ = "0.1.0"

# Dataset and Loader pull in torch; import them on first use so `dlstore ls` stays quick.
_LAZY = {"Dataset": "dlstore.dataset", "Loader": "dlstore.loader"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dlstore' has no attribute {name!r}")


__all__ = [
    "AuthError",
    "ConfigError",
    "CorruptSample",
    "CorruptShard",
    "DataConfig",
    "Dataset",
    "DlstoreError",
    "FormatError",
    "Loader",
    "NoSpace",
    "NotFound",
    "ObjectInfo",
    "ProgramExiting",
    "Store",
    "StoreConfig",
    "TransformConfig",
    "TransientError",
    "World",
    "__version__",
    "open_object",
    "open_store",
]
