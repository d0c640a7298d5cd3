"""dlstore: data loading and storage for GPU training on cloud testbeds.

>>> import dlstore
>>> store = dlstore.open_store("file:///tmp/example")    # doctest: +SKIP
"""

from dlstore.errors import (
    AuthError,
    ConfigError,
    CorruptSample,
    CorruptShard,
    DlstoreError,
    FormatError,
    NoSpace,
    NotFound,
    TransientError,
)
from dlstore.storage import ObjectInfo, Store, open_object, open_store

__version__ = "0.1.0"

__all__ = [
    "AuthError",
    "ConfigError",
    "CorruptSample",
    "CorruptShard",
    "DlstoreError",
    "FormatError",
    "NoSpace",
    "NotFound",
    "ObjectInfo",
    "Store",
    "TransientError",
    "__version__",
    "open_object",
    "open_store",
]
