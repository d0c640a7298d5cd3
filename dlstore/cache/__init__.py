"""The node-local shard cache: one directory on local SSD shared by every rank and DataLoader
worker of a node. The processes share no memory, only files and `flock`.

    cache = ShardCache(CacheConfig("/mnt/ssd/dlstore", "150GB"), store)
    cache.check_fits(max_shard_size)              # a limit below one shard fails here, not later
    cache.prefetch(upcoming)                      # (name, size, checksum) in read order
    cache.hint(names_in_order)                    # this epoch's rest, then the next: evict by the plan
    with cache.hold("train/shard-000007.tar", size, "sha256:...") as path:
        read(path)                                # not evicted while held

Layout of the directory::

    cache.lock          cache-wide lock: reservations, eviction, stats (held for milliseconds)
    stats.json          counters summed over every process, in all and per epoch, padded to 1 KiB
    shards/<stem>       published entries, complete and verified; mtime = last access (LRU).
                        A run of samples of a shard is an entry too (`spec.SampleRange`)
    locks/<stem>.lock   per-shard lock: readers hold LOCK_SH, a downloader or evictor LOCK_EX
    indexes/<stem>.idx  the sample index of a cached shard, kept by its readers (`dlstore.read`)
    tmp/<stem>.<pid>.<token>.<size>.part
                        downloads in flight; the name records the bytes reserved, and the
                        downloader holds LOCK_EX on the file while it lives
    hints/<namespace>.<pid>.<token>.json
                        each reader's order of upcoming shards; its writer holds LOCK_SH (`policy`)
    slots/slot-<i>.lock the node's connection slots: each GET holds one with LOCK_EX (`slots`)
    marks/<namespace>-<dataset>.bin
                        one byte a sample, set once it decoded cleanly (`dlstore.read`); kept by
                        `clear_cache`, since a dataset's bytes never change

Invariants (DESIGN.md, "Cache invariants") and how they hold:

* **Byte limit.** Bytes on disk = published entries + reservations of downloads in flight +
  the 1 KiB stats file. Hint files, kept sample indexes and decode marks are small and not
  counted. A download reserves its full size under the cache-wide lock, by creating its temp
  file, after evicting entries no reader holds (`room`). If that cannot make room it waits,
  and raises `CacheFull` after `wait_timeout_s`. So the directory never exceeds the limit,
  not even by the shard being fetched. Every scan holds the cache-wide lock, and a download
  moves from `tmp/` to `shards/` only under it, so a scan counts it exactly once. A failed
  download gives up its temp file's lock before unlinking it, so no scan misses its bytes.
* **Atomic publish.** An entry is fetched into its temp file as ranged GETs written at their
  offsets (`engine`), hashed as its prefix grows, and its size and checksum verified
  (`download`). A copy that fails is fetched once more, then `CorruptShard`. It is fsynced,
  then `os.replace`d to its final name under the cache-wide lock. A name under `shards/`
  always holds a complete, verified file. No part writes past the reserved size, and a
  failed download waits until none of its parts can write before it gives up its file.
* **One download per node.** The downloader holds the shard's lock exclusively, however many
  parts it uses. Other processes poll it, shared and non-blocking, and find the published
  file once it is released (`fetcher.Step`).
* **Crash safety.** `flock`s die with their process. A temp file whose lock can be taken
  belongs to a dead process and is removed, at start and at every scan. Lock files are empty
  and kept: deleting a lock file others may have open would split the lock.
* **Readers are safe.** Eviction takes the shard's lock with `LOCK_EX | LOCK_NB`; a reader's
  `LOCK_SH` makes that fail, so a held shard is skipped. `flock` conflicts between separate
  open files even within one process, so a thread's eviction respects its own process's
  readers. Locks are released with `LOCK_UN` before closing, because a forked child shares
  open file descriptions: closing alone would leave the lock held by the child's copy.

Locking order: a thread holding the cache-wide lock only ever *tries* shard and temp-file
locks, never blocks on them. So their holders may take the cache-wide lock without deadlock,
as a downloader does to publish.

The directory must be on a local file system: over NFS `flock` becomes a POSIX lock with
per-process semantics, and the guarantees above no longer hold within a process.

A `ShardCache` pickles into DataLoader workers and survives `fork`. Its pickled state holds
no open file, lock or thread; it rebuilds its per-process state on first use (`runtime`).

Eviction (`policy`): with hints, the shard needed furthest ahead goes first (Belady's rule),
and shards no hint names before any hinted one. A prefetch never evicts a shard needed no
later than its own. Without hints, the least recently used goes first.

Downloads: each process has one `engine.DownloadEngine`, at most `CacheConfig.connections`
worker threads, shared by its reader and its prefetch. A shard comes as up to
`parts_in_flight` ranged GETs at once, each retried on its own from its next byte. The
prefetch keeps up to `shards_in_flight` shards in flight, as many and as wide as the
measured rates call for (`pace`). The shard a reader waits for goes first, at full width.
The node's processes together hold at most `CacheConfig.node_connections` GETs (`slots`),
a waiting reader's first. Each shard in flight holds its own reservation.

The modules, in the order data flows through them: `config` and `spec` (what the cache is
configured with and asked for), `layout` (the directory: paths, locks, temp files, scan,
stats), `shard_cache` (the facade), `fetcher` (an entry's lock, as a state machine, and its
download), `room` (reservations and eviction), `policy` (eviction order from the hints),
`download` (fetch one entry and verify it) on `engine` (parallel ranged GETs, each holding
one of the node's `slots`), `prefetch` (the background threads, paced by `pace`), `runtime`
(the state of one process), and `report` (`cache_report`, `clear_cache` for the CLI).
"""

from __future__ import annotations

from dlstore.cache.config import STATS_FILE_BYTES, CacheConfig
from dlstore.cache.layout import CacheStats, EpochStats
from dlstore.cache.report import CacheReport, ClearResult, cache_report, clear_cache
from dlstore.cache.room import CacheFull
from dlstore.cache.shard_cache import ShardCache
from dlstore.cache.spec import SampleRange, ShardSpec

__all__ = [
    "STATS_FILE_BYTES",
    "CacheConfig",
    "CacheFull",
    "CacheReport",
    "CacheStats",
    "ClearResult",
    "EpochStats",
    "SampleRange",
    "ShardCache",
    "ShardSpec",
    "cache_report",
    "clear_cache",
]
