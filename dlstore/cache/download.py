"""One download: stream a shard from the store into its reserved temp file, hashing as it is
written, and check its size and checksum before the cache publishes it."""

from __future__ import annotations

import errno
import hashlib
import os

from dlstore.cache.config import CacheConfig, ShardSpec
from dlstore.errors import ConfigError, CorruptShard
from dlstore.storage.base import Store

_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _parse_checksum(checksum: str) -> tuple[str, str]:
    algo, sep, digest = checksum.partition(":")
    if not sep or not digest:
        raise ConfigError(f"checksum {checksum!r} is not 'algo:hexdigest' (e.g. 'sha256:9f86d0...')")
    try:
        hashlib.new(algo)
    except ValueError:
        raise ConfigError(f"checksum {checksum!r}: unknown hash algorithm {algo!r}") from None
    return algo, digest.lower()


def _file_digest(path: str, algo: str) -> str:
    hasher = hashlib.new(algo)
    with open(path, "rb") as file:
        while chunk := file.read(4 * 2**20):
            hasher.update(chunk)
    return hasher.hexdigest()


def _write_verified(fd: int, store: Store, spec: ShardSpec, size: int, config: CacheConfig) -> None:
    """Write shard `spec` of `store` into `fd` (exactly `size` bytes, never more), then check
    its size and, when `config.verify`, its checksum; raises `CorruptShard` if either fails."""
    if config.preallocate and size:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in _NO_SPACE_ERRNOS:
                raise
            # EOPNOTSUPP, EINVAL: the file system cannot preallocate; writing still works.
    hasher = expected = None
    if config.verify and spec.checksum is not None:
        algo, expected = _parse_checksum(spec.checksum)
        hasher = hashlib.new(algo)
    written = 0
    for chunk in store.get(spec.name):
        if written + len(chunk) > size:
            raise CorruptShard(f"shard {spec.name!r} in {store.url} is larger than the {size} bytes its manifest says")
        view = memoryview(chunk)
        while view:
            view = view[os.pwrite(fd, view, written + len(chunk) - len(view)) :]
        if hasher is not None:
            hasher.update(chunk)
        written += len(chunk)
    if written != size:
        raise CorruptShard(f"shard {spec.name!r} in {store.url} has {written} bytes; its manifest says {size}")
    if hasher is not None and hasher.hexdigest() != expected:
        raise CorruptShard(
            f"shard {spec.name!r} in {store.url} fails its checksum: "
            f"{hasher.name} {hasher.hexdigest()}, manifest {expected}"
        )
    if config.fsync:
        os.fsync(fd)
