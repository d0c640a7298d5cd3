"""Whole-directory operations for the CLI: `cache_report` for `dlstore cache stats DIR`, and
`clear_cache` for `dlstore cache clear DIR`. Both are safe while other processes use the cache.
They work under its cache-wide lock and skip held shards."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

from dlstore.cache.layout import CacheDir, CacheStats, EpochStats, read_epochs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheReport:
    """What `dlstore cache stats DIR` shows. `epochs` holds the counters of the latest epochs
    the readers named with `ShardCache.set_epoch`, oldest first."""

    cache_dir: str
    files: int
    bytes: int
    in_flight: int
    in_flight_bytes: int
    limit_bytes: int | None
    totals: CacheStats
    epochs: dict[int, EpochStats] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class ClearResult:
    """What `clear_cache` removed, and what it left because readers hold it."""

    removed: int
    removed_bytes: int
    skipped_held: int
    skipped_bytes: int
    stale_temps: int


def cache_report(cache_dir: str | os.PathLike[str]) -> CacheReport:
    """Files, bytes, limit and counters of `cache_dir`, summed over every process that used it.
    The counters come in all and per epoch.

    >>> cache_report("/mnt/ssd/dlstore").totals.hits  # doctest: +SKIP
    1234
    >>> cache_report("/mnt/ssd/dlstore").epochs[1].bytes_fetched  # doctest: +SKIP
    150123456789
    """
    directory = CacheDir(os.path.abspath(os.fspath(cache_dir)))
    directory.require()
    with directory.locked():
        usage = directory.scan()
        data = directory.read_stats()
    limit = data.get("limit_bytes")
    return CacheReport(
        cache_dir=directory.root,
        files=len(usage.shards),
        bytes=usage.total,
        in_flight=usage.in_flight,
        in_flight_bytes=usage.in_flight_bytes,
        limit_bytes=limit if isinstance(limit, int) else None,
        totals=CacheStats.from_dict(data),
        epochs=read_epochs(data),
    )


def clear_cache(cache_dir: str | os.PathLike[str], reset_stats: bool = False) -> ClearResult:
    """Remove every shard no reader holds, and stale temp files. It is safe while the cache is
    in use: held shards are left and counted in the result.

    >>> clear_cache("/mnt/ssd/dlstore").removed  # doctest: +SKIP
    40
    """
    directory = CacheDir(os.path.abspath(os.fspath(cache_dir)))
    directory.require()
    removed = removed_bytes = skipped = skipped_bytes = 0
    with directory.locked():
        usage = directory.scan()
        for _, stem, size in sorted(usage.shards):
            freed = directory.try_evict(stem)
            if freed is None:
                skipped += 1
                skipped_bytes += size
            else:
                removed += 1
                removed_bytes += freed
        if reset_stats:
            data = directory.read_stats()
            data.update(dataclasses.asdict(CacheStats()))
            data.pop("epochs", None)
            directory.write_stats(data)
        elif removed:
            directory.add_stats(CacheStats(evictions=removed))
    if skipped:
        log.warning("kept %d shards (%d bytes) that readers hold in %s", skipped, skipped_bytes, directory.root)
    return ClearResult(removed, removed_bytes, skipped, skipped_bytes, usage.stale_removed)
