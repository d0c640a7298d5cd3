"""The node-local shard cache: one directory on local SSD shared by every rank and
DataLoader worker of a node (many processes, no shared memory, only files and `flock`).

    cache = ShardCache(CacheConfig("/mnt/ssd/dlstore", "150GB"), store)
    cache.check_fits(max_shard_size)              # a limit below one shard fails here, not later
    cache.prefetch(upcoming)                      # (name, size, checksum) in read order
    cache.hint(names_in_order)                    # this epoch's rest, then the next: evict by the plan
    with cache.hold("train/shard-000007.tar", size, "sha256:...") as path:
        read(path)                                # not evicted while held

Layout of the directory::

    cache.lock          cache-wide lock: reservations, eviction, stats (held for milliseconds)
    stats.json          counters summed over every process, in all and per epoch (the
                        latest 16), padded to exactly 1 KiB
    shards/<stem>       published shards, complete and verified; mtime = last access (LRU);
                        a partial entry (`partial`: a run of samples of a boundary shard) is
                        one too, under the stem of its key `<shard>#samples=<start>-<stop>`
    locks/<stem>.lock   per-shard lock: readers hold LOCK_SH, a downloader or evictor LOCK_EX
    indexes/<stem>.idx  the sample index of a cached shard, walked from it once per node
                        (`indexes`); written by a reader holding the shard, removed with it
    tmp/<stem>.<pid>.<token>.<size>.part
                        downloads in flight; the name records the bytes reserved, the
                        downloader holds LOCK_EX on the file itself while it lives
    hints/<namespace>.<pid>.<token>.json
                        each reader's order of upcoming shards (`ShardCache.hint`); its
                        writer holds LOCK_SH on it while it lives (`policy`)
    slots/slot-<i>.lock the node's connection slots (`slots`): each GET to the store holds
                        one with LOCK_EX; readers-waiting.lock: LOCK_SH while a reader waits
    marks/<namespace>-<dataset>.bin
                        one byte a sample: 1 once some process of the node has decoded it
                        cleanly (`marks`); `clear_cache` leaves them (a dataset's bytes, named
                        by `<dataset>`, never change, nor do their marks)

Invariants (DESIGN.md, "Cache invariants") and how they hold:

* **Byte limit.** Bytes on disk = published shards + reservations of downloads in flight
  + the 1 KiB stats file (not counted: the readers' hint files, about 60 bytes per shard
  of a reader's share, the kept sample indexes, 8 bytes per sample, a 4 KiB block at
  least each, and the decode marks, one byte per sample of a dataset). A download reserves its full size under the cache-wide lock
  (creating its temp file, whose name carries the size) after evicting shards that no
  reader holds (in `policy`'s order); if they cannot make room it waits, and raises `CacheFull`
  after `wait_timeout_s`. So the directory never exceeds the limit, not even by the shard
  being fetched. Every scan holds the cache-wide lock, and a download moves from `tmp/` to
  `shards/` only under that lock too, so a scan counts it exactly once: were the rename
  free to land between a scan's pass over `tmp/` and its pass over `shards/`, the scan
  would count the shard twice and a reservation or `cache_report` would see the directory
  over the limit when it is not. A failed download gives up its temp file's lock before
  unlinking it, so no scan misses bytes still allocated to an open, unlinked file.
* **Atomic publish.** A shard is fetched into its temp file as ranged GETs written at their
  offsets (`engine`), its contiguous prefix hashed as it grows, its size and checksum
  verified (a copy that fails its checksum is fetched once more, then `CorruptShard`),
  fsynced, then `os.replace`d to its final name (under the cache-wide lock, see above): a
  name under `shards/` always holds a complete, verified file. No part writes past the
  reserved size, and a failed download waits until none of its parts can write any more
  before it gives up its temp file.
* **One download per node.** The downloader holds the shard's lock exclusively (however
  many parts and connections it uses); other processes poll it (shared, non-blocking) and
  find the published file when it is released.
* **Crash safety.** `flock`s die with their process. A temp file whose lock can be taken
  belongs to a dead process and is removed (at start and at every scan); lock files are
  empty and kept (deleting a lock file others may have open would split the lock).
* **Readers are safe.** Eviction takes the shard's lock with `LOCK_EX | LOCK_NB`; a reader's
  `LOCK_SH` makes that fail, so a held shard is skipped. `flock` conflicts between separate
  open files even within one process, so a thread's eviction respects its own process's
  readers. Locks are released explicitly (`LOCK_UN`) because a forked child shares open file
  descriptions: closing alone would leave the lock held by the child's copy.

Locking order: a thread holding the cache-wide lock only ever *tries* shard and temp-file
locks (never blocks on them), so their holders may take the cache-wide lock without
deadlock (a downloader does, to publish).

The directory must be on a local file system: over NFS `flock` becomes a POSIX lock with
per-process semantics and the in-process guarantees above no longer hold.

A `ShardCache` pickles into DataLoader workers and survives `fork`: it holds no open file,
lock or thread in its pickled state, and rebuilds its per-process state (counters, prefetch
thread) the first time it is used in a new process.

Eviction (`policy`): with hints, the shard needed furthest ahead goes first (Belady's
rule), shards no hint names before any hinted one, and a prefetch never evicts a shard
needed no later than its own; without hints, the least recently used goes first.

Downloads: each process has one `engine.DownloadEngine` (worker threads, at most
`CacheConfig.connections`), shared by its reader and its prefetch threads: a shard is
fetched as up to `parts_in_flight` ranged GETs at once, each retried on its own and
resumed from its next byte; the prefetch keeps up to `shards_in_flight` shards of its
window in flight, as many as the rates measured call for, each on as many connections as
they call for (`pace`); the shard a reader waits for goes first, at full width. All the processes of a node together hold at most
`CacheConfig.node_connections` GETs at once (`slots`), a waiting reader's before any prefetch's. Each in-flight shard holds its
own reservation, so the limit holds with several shards in flight.

The modules, in the order data flows through them: `config` (`CacheConfig`, `ShardSpec`),
`layout` (the directory: paths, locks, temp files, the scan that counts bytes, the stats
file), `shard_cache` (`ShardCache`: hold, fetch, reserve, evict), `download` (fetch one
shard into its temp file and verify it) on `engine` (parallel ranged GETs, each holding
one of the node's `slots`), `partial` (a
run of samples of a shard as an entry of its own, each sample verified by its digest), `policy`
(which shard to evict, from the readers' hint files), `prefetch`
(the background threads, paced by `pace`) with `runtime` (the per-process state it shares with the
reader), and `report` (`cache_report`, `clear_cache` for the CLI).
"""

from __future__ import annotations

from dlstore.cache.config import STATS_FILE_BYTES, CacheConfig, ShardSpec
from dlstore.cache.layout import CacheStats, EpochStats
from dlstore.cache.layout import _CacheDir as _CacheDir  # for the tests of the directory layout
from dlstore.cache.partial import SampleRange
from dlstore.cache.report import CacheReport, ClearResult, cache_report, clear_cache
from dlstore.cache.shard_cache import CacheFull, ShardCache

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
