"""Copying one object between any two stores, streamed: what `dlstore cp` runs."""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator

from dlstore.errors import AuthError, DlstoreError, NotFound, ObjectChanged
from dlstore.storage.base import Store
from dlstore.storage.registry import open_object, open_store

__all__ = ["copy_object"]


def copy_object(
    src_store: Store, src_key: str, dst: str, progress: Callable[[int], object] | None = None
) -> tuple[Store, str]:
    """Stream `src_key` of `src_store` to `dst`, an object URL or local path; returns where the copy is.
    A `dst` ending in "/" or "://", or a local folder, keeps the source's name. `progress` gets each
    chunk's size as it goes. A missing destination container or bucket is made first, as
    `swift upload` and `rclone copy` do.

    >>> copy_object(*open_object("swift://data/train/shard-000000.tar"), "/tmp/")   # doctest: +SKIP
    (LocalStore('file:///tmp'), 'shard-000000.tar')
    """
    local = dst.removeprefix("file://") if dst.startswith("file://") or "://" not in dst else None
    if local and os.path.isdir(local):  # as `cp` does, and before the whole download
        dst = local + "/"
    if dst.endswith("/") or dst.endswith("://"):
        dst_store, dst_key = open_store(dst.rstrip("/")), src_key.rsplit("/", 1)[-1]
    else:
        dst_store, dst_key = open_object(dst)

    # The size, when the source tells it, lets the destination size its segments or parts for
    # the whole object up front. A stream of unknown length may outgrow their limits.
    try:
        size: int | None = src_store.stat(src_key).size
    except NotFound:
        raise
    except DlstoreError:
        size = None  # e.g. a server without HEAD: copied as a stream of unknown length
    try:
        dst_store.ensure_container()
    except AuthError:
        pass  # e.g. a write-only ACL may not even HEAD the container; the put says what is wrong
    if size:  # fsspec may say 0 for unknown: an empty object goes as well as a stream
        with io.BufferedReader(_SourceReader(src_store, src_key, size, progress), src_store.config.chunk_size) as file:
            dst_store.put(dst_key, file)
        return dst_store, dst_key

    def chunks() -> Iterator[bytes]:
        for chunk in src_store.get(src_key):
            if progress is not None:
                progress(len(chunk))
            yield chunk

    dst_store.put(dst_key, chunks())
    return dst_store, dst_key


class _SourceReader(io.RawIOBase):
    """An object of a store as a read-only file of known size, which a put takes as a file.

    A seek re-opens the object where asked; a changed size is `ObjectChanged`. `progress`
    hears of each byte once."""

    def __init__(self, store: Store, key: str, size: int, progress: Callable[[int], object] | None) -> None:
        self._store, self._key, self._size, self._progress = store, key, size, progress
        self._position = 0  # where the next read starts
        self._chunks: Iterator[bytes] | None = None  # the open read; it stands at `_read_to`
        self._read_to = 0
        self._pending = memoryview(b"")
        self._reported = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._position = base + offset  # nothing is read or opened until the next read
        return self._position

    def readinto(self, out) -> int:  # type: ignore[override]
        if self._chunks is None or self._read_to != self._position:
            self._close_read()
            if self._position >= self._size:
                return 0
            self._chunks = self._store.get(self._key, self._position)
            self._read_to = self._position
        while not self._pending:
            try:
                self._pending = memoryview(next(self._chunks))
            except StopIteration:
                if self._position < self._size:
                    raise ObjectChanged(
                        f"{self._store.join(self._key)}: ended at byte {self._position} of the {self._size} "
                        "it had when the copy began"
                    ) from None
                return 0
        n = min(len(out), len(self._pending))
        if self._position + n > self._size:
            raise ObjectChanged(f"{self._store.join(self._key)}: longer than the {self._size} bytes it had")
        out[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        self._position = self._read_to = self._position + n
        if self._progress is not None and self._position > self._reported:
            self._progress(self._position - self._reported)
            self._reported = self._position
        return n

    def _close_read(self) -> None:
        if self._chunks is not None:
            getattr(self._chunks, "close", lambda: None)()
        self._chunks, self._pending = None, memoryview(b"")

    def close(self) -> None:
        self._close_read()
        super().close()
