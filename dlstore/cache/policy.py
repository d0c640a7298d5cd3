"""Plan-aware eviction: which cached shards go first when the cache must make room.

The epoch plan is a pure function. So a reader knows the order in which it will need shards,
for the rest of this epoch and the whole next one. `ShardCache.hint` records that order
where every process of the node sees it. Eviction then follows Belady's rule: evict the shard
needed furthest in the future. With a cache that holds a fraction f of the node's share, a
node fetches about 1 - f of its share per epoch. LRU, against a shuffled sweep it cannot see,
refetches nearly all of it. The rule needs room for the window being read, the one coming in
and the prefetch, beside the shards kept. `Dataset.hint_cache` gives no hints to a smaller cache.

How the hints are kept, in files, since the processes share nothing else::

    hints/<namespace>.<pid>.<token>.json    {"version": 1, "order": [stem, ...]}, soonest first

* One file per writer, a `ShardCache` in one process, rewritten in place under the cache-wide
  lock. Eviction reads them under the same lock, so it never sees a half-written file.
* The writer holds `LOCK_SH` on its file while it lives. It takes it under the cache-wide lock
  when the file is made. A file whose lock can be taken belongs to a dead process, and the
  reader removes it. A writer's file goes when its `ShardCache` is collected or the process exits.
* A shard's next use is its smallest position over all writers' orders. The plan has the ranks
  of a node read the same window of shards at the same time. So the smallest is the node's
  next need of it. That holds while every order is fresh: a writer rewrites its order as soon
  as it is done with a shard it names for this epoch. A stale order keeps finished shards in
  front of those in use, and other ranks' evictions take this one's.
* A hint file is small, a few bytes per shard of the writer's share, and not counted in the limit.

Victim order, given the hints, in `victim_order`: first the shards no hint names, least
recently used first. Then the hinted ones, furthest next use first. With no live hints the
order is plain LRU. A reader that needs a shard now may evict any shard no one holds. A
prefetch, which may wait, evicts only shards no hint names.

Why a prefetch spares every hinted shard: Belady's rule picks its victim at the time of need.
By then the shards in use now are done, and their next use may be later than any kept one's.
An eviction made ahead of need chooses among fewer, and it keeps a worse set. Each shard
fetched ahead also takes a kept one's place for longer. So in a cache too small for the share,
the prefetch fills only free room, and the readers' fetches make room by the plan. A cache
with room to spare, or one without hints, prefetches as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import weakref
from collections.abc import Callable, Iterable, Sequence

from dlstore.cache.layout import CacheDir, try_flock, unlink_quietly

log = logging.getLogger(__name__)

HINTS_DIR = "hints"
_HINT_VERSION = 1

#: A cached shard as a scan lists it: (mtime_ns, stem, size).
CachedShard = tuple[int, str, int]


def hints_dir(directory: CacheDir) -> str:
    return os.path.join(directory.root, HINTS_DIR)


class HintWriter:
    """The hint file of one `ShardCache` in one process. It is not shared across a fork. The child
    makes its own, and never unlocks the parent's, whose lock its inherited descriptor shares."""

    def __init__(self, directory: CacheDir, namespace: str, stem_of: Callable[[str], str]) -> None:
        self.pid = os.getpid()
        self._dir = directory
        self._stem_of = stem_of
        self._stems: dict[str, str] = {}  # shard name -> file name, for the names seen so far
        self._path = os.path.join(hints_dir(directory), f"{namespace}.{self.pid}.{secrets.token_hex(4)}.json")
        self._fd: int | None = None
        self._last: list[str] | None = None
        self._finalizer: weakref.finalize | None = None

    def write(self, names: Iterable[str]) -> None:
        """Record the order of shard `names`, soonest first, replacing this writer's earlier
        order. An empty order removes the file."""
        stems = self._stems
        order = list(dict.fromkeys(stems.get(n) or stems.setdefault(n, self._stem_of(n)) for n in names))
        if not order:
            self.close()
            return
        if order == self._last:
            return
        payload = json.dumps({"version": _HINT_VERSION, "order": order}, separators=(",", ":")).encode()
        with self._dir.locked():
            if self._fd is None:
                self._fd = self._open()
            os.pwrite(self._fd, payload, 0)
            os.ftruncate(self._fd, len(payload))
        self._last = order

    def _open(self) -> int:
        """Create the file and lock it shared, under the cache-wide lock. No reader sees it unlocked."""
        os.makedirs(os.path.dirname(self._path), exist_ok=True)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a new file: nobody else holds it
        self._finalizer = weakref.finalize(self, _remove_hint_file, fd, self._path, self.pid)
        return fd

    def close(self) -> None:
        """Remove the hint file: this writer has no more to say."""
        if self._finalizer is not None:
            self._finalizer()
        self._fd, self._last, self._finalizer = None, None, None


def _remove_hint_file(fd: int, path: str, owner_pid: int) -> None:
    """Remove a writer's file and release its lock. A forked child only closes the descriptor:
    unlocking there would release the parent's lock too."""
    if os.getpid() != owner_pid:
        with contextlib.suppress(OSError):
            os.close(fd)
        return
    with contextlib.suppress(OSError):
        unlink_quietly(path)
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    with contextlib.suppress(OSError):
        os.close(fd)


def read_next_use(directory: CacheDir) -> dict[str, int]:
    """Under the cache-wide lock: each hinted stem's next use, its smallest position over the
    live writers' orders. Removes the files of dead writers and skips unreadable ones."""
    try:
        entries = list(os.scandir(hints_dir(directory)))
    except FileNotFoundError:
        return {}
    next_use: dict[str, int] = {}
    for entry in entries:
        if not entry.name.endswith(".json"):
            continue
        order = _read_live_order(entry.path)
        for position, stem in enumerate(order):
            if next_use.get(stem, position) >= position:
                next_use[stem] = position
    return next_use


def _read_live_order(path: str) -> list[str]:
    """The order in a writer's file. If its writer is dead, remove the file and return []."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    try:
        if try_flock(fd, fcntl.LOCK_EX):  # no writer holds it: a dead process's hints
            unlink_quietly(path)
            fcntl.flock(fd, fcntl.LOCK_UN)
            log.debug("removed the hint file %s of a dead process", path)
            return []
        with os.fdopen(os.dup(fd), "rb") as file:
            data = json.loads(file.read() or b"{}")
    except (OSError, ValueError) as exc:
        log.debug("ignoring unreadable hint file %s: %s", path, exc)
        return []
    finally:
        os.close(fd)
    order = data.get("order") if isinstance(data, dict) and data.get("version") == _HINT_VERSION else None
    return [stem for stem in order if isinstance(stem, str)] if isinstance(order, list) else []


def victim_order(
    shards: Sequence[CachedShard], next_use: dict[str, int], prefetching: bool = False
) -> list[CachedShard]:
    """The cached shards in the order eviction should try them. See the module docstring.

    With hints, a fetch that is `prefetching` may displace only the shards no hint names.
    Without hints the order is LRU for every fetch.

    >>> victim_order([(1, "a", 9), (2, "b", 9), (3, "c", 9)], {"a": 0, "b": 5})
    [(3, 'c', 9), (2, 'b', 9), (1, 'a', 9)]
    >>> victim_order([(1, "a", 9), (2, "b", 9), (3, "c", 9)], {"a": 0, "b": 5}, prefetching=True)
    [(3, 'c', 9)]
    """
    lru = sorted(shards)
    if not next_use:
        return lru
    unhinted = [s for s in lru if s[1] not in next_use]
    if prefetching:
        return unhinted
    hinted = sorted((s for s in lru if s[1] in next_use), key=lambda s: -next_use[s[1]])  # stable: LRU breaks ties
    return unhinted + hinted
