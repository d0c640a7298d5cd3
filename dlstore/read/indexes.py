"""Sample indexes of cached shards, kept in the cache beside them as `indexes/<stem>.idx`.

Why: a sample is read with one `pread` of the span its shard's `SampleIndex` gives. Built from
the cached file, that index is a walk over every tar header of the shard. Without a kept copy,
every process that reads the shard walks it again. Kept in the cache, it is walked once per
node while the shard stays cached, and read back quickly.

A kept index carries the manifest's checksum of its shard. So a shard cached again with other
content never meets an old index. A shard without a manifest checksum keeps none. Eviction
removes an index with its shard. Indexes are small and not counted against the limit.
Writing one is best effort: a full disk or a read-only cache costs the walk again, not the
read. A writer that dies before its rename leaves a temp file. The cache removes it later, in
`CacheDir.remove_stale_index_temps`.
"""

from __future__ import annotations

import logging
import os
import secrets

from dlstore.errors import ConfigError, FormatError
from dlstore.format.sample_index import SampleIndex, digest_field
from dlstore.format.shards import read_shard_index

__all__ = ["cached_sample_index", "forget_sample_index"]

log = logging.getLogger(__name__)


def cached_sample_index(index_path: str, shard_path: str, checksum: str | None) -> SampleIndex:
    """The sample index of the cached shard at `shard_path`, which the caller holds. It is the
    one kept at `index_path` when that matches the shard's size and `checksum`. Otherwise it is
    walked from the file and kept there for the next reader."""
    digest = _digest_field(checksum)
    shard_size = os.path.getsize(shard_path)
    if digest is not None:
        kept = _read_kept(index_path, shard_size, digest)
        if kept is not None:
            return kept
    index = read_shard_index(shard_path)
    if digest is None:
        return index
    index = SampleIndex(index.offsets, index.shard_size, digest, index.recipe, index.sample_digests)
    _keep(index_path, index)
    return index


def _digest_field(checksum: str | None) -> bytes | None:
    """What an index of the shard of `checksum` holds for it. None for a checksum given by hand
    in none of the manifest's algorithms: the index is then not kept."""
    try:
        return None if checksum is None else digest_field(checksum)
    except ConfigError:
        return None


def _read_kept(index_path: str, shard_size: int, digest: bytes) -> SampleIndex | None:
    try:
        with open(index_path, "rb") as file:
            index = SampleIndex.from_bytes(file.read())
    except FileNotFoundError:
        return None
    except (OSError, FormatError) as exc:  # damaged or unreadable: walked again, and replaced
        log.info("sample index %s not used: %s", index_path, exc)
        return None
    if index.shard_size != shard_size or index.shard_digest != digest:
        return None  # another shard's, cached under this name before
    return index


def _keep(index_path: str, index: SampleIndex) -> None:
    """Write the index atomically, as a temp file renamed over it. Readers never see half of one."""
    temp = f"{index_path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        os.makedirs(os.path.dirname(index_path), exist_ok=True)
        with open(temp, "wb") as file:
            file.write(index.to_bytes())
        os.replace(temp, index_path)
    except OSError as exc:
        log.debug("sample index %s not kept: %s", index_path, exc)
        try:
            os.unlink(temp)
        except OSError:
            pass


def forget_sample_index(index_path: str) -> None:
    """Drop a kept index: a read through it failed, so it is walked again."""
    try:
        os.unlink(index_path)
    except FileNotFoundError:
        pass
