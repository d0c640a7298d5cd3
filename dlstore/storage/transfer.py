"""Copying one object between any two stores, streamed: what `dlstore cp` runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from dlstore.errors import AuthError
from dlstore.storage.base import Store
from dlstore.storage.registry import open_object, open_store

__all__ = ["copy_object"]


def copy_object(
    src_store: Store, src_key: str, dst: str, progress: Callable[[int], object] | None = None
) -> tuple[Store, str]:
    """Stream `src_key` of `src_store` to the object URL (or local path) `dst`; a `dst` ending
    in "/" (or a bare "scheme://") keeps the source's name. `progress` is called with the size
    of each chunk as it goes. A destination container or bucket that does not exist yet is made
    first, as `swift upload` and `rclone copy` do. Returns where the copy is.

    >>> copy_object(*open_object("swift://data/train/shard-000000.tar"), "/tmp/")   # doctest: +SKIP
    (LocalStore('file:///tmp'), 'shard-000000.tar')
    """
    if dst.endswith("/") or dst.endswith("://"):
        dst_store, dst_key = open_store(dst.rstrip("/")), src_key.rsplit("/", 1)[-1]
    else:
        dst_store, dst_key = open_object(dst)

    def chunks() -> Iterator[bytes]:
        for chunk in src_store.get(src_key):
            if progress is not None:
                progress(len(chunk))
            yield chunk

    try:
        dst_store.ensure_container()
    except AuthError:
        pass  # e.g. a write-only ACL may not even HEAD the container; the put says what is wrong
    dst_store.put(dst_key, chunks())
    return dst_store, dst_key
