"""The node-local shard cache: one directory on local SSD for a whole node. Every rank and
DataLoader worker shares it, through files and `flock` only.

    cache = ShardCache(CacheConfig("/mnt/ssd/dlstore", "150GB"), store)
    cache.check_fits(max_shard_size)    # a limit below one shard fails here, not later
    cache.prefetch(upcoming)            # name, size, checksum, in read order
    cache.hint(names_in_order)          # this epoch's rest, then the next: evict by the plan
    with cache.hold("train/shard-000007.tar", size, "sha256:...") as path:
        read(path)                      # not evicted while held

Layout of the directory::

    cache.lock          the cache-wide lock: reservations, eviction, stats. Held briefly.
    stats.json          counters summed over every process, in all and per epoch. 1 KiB.
    shards/<stem>       published entries, complete and verified. Mtime is the last access.
                        A run of samples of a shard is an entry too: `spec.SampleRange`.
    locks/<stem>.lock   per-shard lock. Readers hold LOCK_SH, a downloader or evictor LOCK_EX.
    indexes/<stem>.idx  the sample index of a cached shard, kept by its readers.
    tmp/<stem>.<pid>.<token>.<size>.part
                        a download in flight. The name records the bytes reserved.
                        The downloader holds LOCK_EX on the file while it lives.
    hints/<namespace>.<pid>.<token>.json
                        a reader's order of upcoming shards. Its writer holds LOCK_SH.
    slots/slot-<i>.lock the node's connection slots. Each GET holds one with LOCK_EX.
    marks/<namespace>-<dataset>.bin
                        one byte a sample, set once it decoded cleanly. `clear_cache`
                        keeps them, since a dataset's bytes never change.

The invariants of DESIGN.md, "Cache invariants", and how they hold:

* **Byte limit.** Bytes on disk are published entries, reservations of downloads in flight and
  the 1 KiB stats file. Hint files, sample indexes and decode marks are small and not counted.
  Under the cache-wide lock, a download evicts entries no reader holds, in `room`. Then it
  reserves its full size by creating its temp file. If it cannot make room, it waits, and raises
  `CacheFull` after `wait_timeout_s`. So the directory never exceeds the limit, not even by the
  shard being fetched. Every scan holds the cache-wide lock. A download moves from `tmp/` to
  `shards/` only under it, so a scan counts it exactly once. A failed download gives up its temp
  file's lock before unlinking it, so no scan misses its bytes.
* **Atomic publish.** An entry is fetched into its temp file by ranged GETs written at their
  offsets, in `engine`. It is hashed as its prefix grows. Then `download` verifies its size and
  checksum. A copy that fails is fetched once more, then raises `CorruptShard`. A good copy is
  fsynced, then `os.replace`d to its final name under the cache-wide lock. So a name under
  `shards/` always holds a complete, verified file. No part writes past the reserved size. A
  failed download waits until none of its parts can write, then gives up its file.
* **One download per node.** The downloader holds the shard's lock exclusively, however many
  parts it uses. Other processes poll that lock, shared and non-blocking. They find the
  published file once it is released: see `fetcher.Step`.
* **Crash safety.** `flock`s die with their process. A temp file whose lock can be taken belongs
  to a dead process. It is removed at start and at every scan. Lock files are empty and kept:
  deleting a lock file others may have open would split the lock.
* **Readers are safe.** Eviction takes the shard's lock with `LOCK_EX | LOCK_NB`. A reader's
  `LOCK_SH` makes that fail, so a held shard is skipped. `flock` conflicts between separate open
  files even within one process. So a thread's eviction respects its own process's readers.
  Locks are released with `LOCK_UN` before closing, because a forked child shares open file
  descriptions. Closing alone would leave the lock held by the child's copy.

Locking order: a thread holding the cache-wide lock only ever *tries* shard and temp-file locks.
It never blocks on them. So their holders may take the cache-wide lock without deadlock, as a
downloader does to publish.

The directory must be on a local file system. Over NFS, `flock` becomes a POSIX lock with
per-process semantics, and the guarantees above fail within a process.

A `ShardCache` pickles into DataLoader workers and survives `fork`. Its pickled state holds no
open file, lock or thread. It rebuilds its per-process state on first use: see `runtime`.

Eviction, in `policy`: with hints, the shard needed furthest ahead goes first, by Belady's rule.
Shards no hint names go before any hinted one. A prefetch evicts only shards no hint names: it
waits rather than displace one the plan keeps. Without hints, the least recently used goes first.

Downloads: each process has one `engine.DownloadEngine`, shared by its reader and prefetch. It
runs at most `CacheConfig.connections` worker threads. A shard comes as up to `parts_in_flight`
ranged GETs at once. Each GET is retried on its own from its next byte. The prefetch keeps up to
`shards_in_flight` shards in flight; `pace` sets how many and how wide. The shard a reader waits
for goes first, at full width. The node's processes together hold at most
`CacheConfig.node_connections` GETs, in `slots`. A waiting reader's GETs come first. Each shard
in flight holds its own reservation.

The modules, in the order data flows through them: `config` and `spec` say what the cache is
configured with and asked for. `layout` is the directory: paths, locks, temp files, scan and
stats. `shard_cache` is the facade. `fetcher` takes an entry's lock, as a state machine, and
downloads it. `room` makes reservations and evicts, in the order `policy` reads from the hints.
`download` fetches one entry and verifies it, on `engine`: parallel ranged GETs, each holding
one of the node's `slots`. `prefetch` runs the background threads, paced by `pace`. `runtime` is
the state of one process. `report` has `cache_report` and `clear_cache` for the CLI.
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
