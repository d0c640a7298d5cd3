"""`file://` store: a directory on a local or network file system."""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from collections.abc import Iterator
from typing import BinaryIO
from urllib.parse import unquote, urlsplit

from dlstore.config import StoreConfig
from dlstore.errors import DlstoreError, NoSpace, NotFound
from dlstore.storage.base import ObjectInfo, Store, read_chunks

__all__ = ["LocalStore"]


def _os_error(exc: OSError, what: str) -> DlstoreError:
    if isinstance(exc, (FileNotFoundError, NotADirectoryError)):  # "a/b" when "a" is a file: no such object
        return NotFound(f"{what}: no such file")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpace(f"{what}: no space left on device")
    return DlstoreError(f"{what}: {exc.strerror or exc}")


class LocalStore(Store):
    """Objects are files under a root directory; puts are atomic, a temp file and `os.replace`."""

    scheme = "file"

    def __init__(self, url: str, config: StoreConfig | None = None) -> None:
        parts = urlsplit(url)
        root = unquote(parts.netloc + parts.path) if parts.scheme == "file" else url
        self.root = os.path.abspath(root or "/")
        super().__init__("file://" + self.root, config)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        # Walk only the directory the prefix points into, in sorted order, lazily.
        base_dir, _, _ = prefix.rpartition("/")
        start = os.path.join(self.root, *base_dir.split("/")) if base_dir else self.root
        if not os.path.isdir(start):
            return
        yield from self._walk(start, base_dir, prefix)

    def _walk(self, directory: str, rel: str, prefix: str) -> Iterator[ObjectInfo]:
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name + ("/" if e.is_dir() else ""))
        except OSError as exc:
            raise _os_error(exc, f"listing {directory}") from None
        for entry in entries:
            key = f"{rel}/{entry.name}" if rel else entry.name
            if entry.is_dir(follow_symlinks=False):
                if (key + "/").startswith(prefix) or prefix.startswith(key + "/"):
                    yield from self._walk(entry.path, key, prefix)
            elif key.startswith(prefix) and not entry.name.startswith(".dlstore-tmp-"):
                stat = entry.stat()
                yield ObjectInfo(key=key, size=stat.st_size, mtime=stat.st_mtime)

    def _stat(self, key: str) -> ObjectInfo:
        try:
            stat = os.stat(self._path(key))
        except OSError as exc:
            raise _os_error(exc, f"{self.url}/{key}") from None
        if not os.path.isfile(self._path(key)):
            raise NotFound(f"{self.url}/{key}: not a file")
        return ObjectInfo(key=key, size=stat.st_size, mtime=stat.st_mtime)

    def _read(self, key: str, start: int, end: int | None) -> Iterator[bytes]:
        chunk_size = self.config.chunk_size
        try:
            with open(self._path(key), "rb") as file:
                file.seek(start)
                yield from read_chunks(file, None if end is None else end - start, chunk_size)
        except OSError as exc:
            raise _os_error(exc, f"{self.url}/{key}") from None

    def _write(self, key: str, stream: BinaryIO) -> None:
        path = self._path(key)
        directory = os.path.dirname(path)
        temp_path = None
        try:
            os.makedirs(directory, exist_ok=True)
            fd, temp_path = _new_temp_file(directory)
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(stream, out, self.config.chunk_size)
            os.replace(temp_path, path)
            temp_path = None
        except OSError as exc:
            raise _os_error(exc, f"{self.url}/{key}") from None
        finally:
            if temp_path is not None:
                try:
                    os.unlink(temp_path)
                except OSError:
                    pass

    def _ensure_container(self) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise _os_error(exc, self.url) from None

    def _delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except OSError as exc:
            raise _os_error(exc, f"{self.url}/{key}") from None


def _new_temp_file(directory: str) -> tuple[int, str]:
    """A new file in `directory` to write an object into before it is renamed into place.
    It has the permissions the umask gives. `tempfile.mkstemp` gives 0600, which would make
    a dataset in a shared NFS folder unreadable to the rest of the team."""
    while True:
        path = os.path.join(directory, f".dlstore-tmp-{secrets.token_hex(8)}")
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), path
        except FileExistsError:
            continue
