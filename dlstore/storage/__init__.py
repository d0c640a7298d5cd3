"""Object storage: one `Store` interface, backends chosen by URL scheme."""

from dlstore.storage.base import ObjectInfo, Store
from dlstore.storage.registry import open_object, open_store, split_object_url

__all__ = ["ObjectInfo", "Store", "open_object", "open_store", "split_object_url"]
