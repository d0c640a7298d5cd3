"""Object storage: one `Store` interface, backends chosen by URL scheme."""

from dlstore.logs import redact_storage_secrets
from dlstore.storage.base import ObjectInfo, Store
from dlstore.storage.registry import open_object, open_store, split_object_url

__all__ = ["ObjectInfo", "Store", "open_object", "open_store", "split_object_url"]

# Before any backend is imported or any SDK client made: their log lines never carry a secret.
redact_storage_secrets()
