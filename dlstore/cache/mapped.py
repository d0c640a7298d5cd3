"""The entries a process reads, kept mapped and held between reads: `ShardCache.mapped`.

Why: a `pread` per sample, and a hold per batch, are system calls. Each releases the GIL, and
beside a training loop's Python each release costs a decode thread a wait of up to the switch
interval (5 ms). A slice of a mapping takes none. So an entry is held and mapped once, and its
samples are sliced from memory until it goes idle. The prefetch maps the shards in use ahead of
their first read, in its own thread.

A mapped entry keeps its shared lock: the cache cannot evict it, so its disk space is counted
while it is mapped. Once no read uses it, the lock goes when it has been idle for `LINGER_S` (a
thread looks each `LINGER_S` while there are entries), when more than `KEEP` entries are
mapped, when this process's hints name it past the first `NEAR` shards, when a reader of this
process waits for room, and at `close()`; after a close, until
the next pass, at the end of each read. Its mapping goes with the lock.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["KEEP", "LINGER_S", "MappedEntries", "map_file"]

# About two shuffle windows of shards, and how long one may go unread before its lock goes.
KEEP = 16
LINGER_S = 1.0
# With the readers' hints, the entries kept are among the first NEAR shards this process names.
NEAR = KEEP // 2


def map_file(path: str) -> mmap.mmap | bytes:
    """The file at `path`, mapped read-only and faulted in now: a page first touched by a slice
    would be faulted with the GIL held. An empty file is an empty buffer."""
    with open(path, "rb") as file:
        try:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            return mmap.mmap(file.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
        except ValueError:  # an empty file cannot be mapped
            return b""


@dataclass
class _Entry:
    memory: mmap.mmap | bytes
    path: str
    fd: int  # the shared lock
    last_used: float
    users: int = 1  # reads using it now
    ahead: bool = False  # mapped by the prefetch, and not read since


class MappedEntries:
    """One process's mapped entries by name, each with the lock fd it keeps."""

    def __init__(self, release: Callable[[int], None]) -> None:
        self._release = release  # unlocks and closes a lock fd
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._sweeper: threading.Thread | None = None
        self.read_here = False  # whether a reader of this process has used an entry

    def use(self, name: str) -> tuple[mmap.mmap | bytes, str, bool] | None:
        """Entry `name`'s mapping and path for one read, ended by `done`, and whether the
        prefetch mapped it ahead of this, its first read. None if not mapped."""
        with self._lock:
            self.read_here = True
            entry = self._entries.get(name)
            if entry is None:
                return None
            entry.users += 1
            self._entries.move_to_end(name)
            first, entry.ahead = entry.ahead, False
            return entry.memory, entry.path, first

    def holds(self, name: str) -> bool:
        """Whether entry `name` is mapped here: cached, and held until it goes idle."""
        with self._lock:
            return name in self._entries

    def add(self, name: str, memory: mmap.mmap | bytes, path: str, fd: int, ahead: bool = False) -> None:
        """Keep `memory`, the entry at `path`, and `fd`, its shared lock, for a read ended by
        `done`. `ahead`: mapped by the prefetch before any read, with no read using it."""
        with self._lock:
            old = self._entries.pop(name, None)  # two threads mapped it at once: one lock each
            self._entries[name] = _Entry(memory, path, fd, time.monotonic(), users=0 if ahead else 1, ahead=ahead)
            if old is not None:
                self._entries[name].users += old.users
            gone = [old] if old is not None else []
            gone += self._take(lambda entry: True, over_keep=True)
            if self._sweeper is None or not self._sweeper.is_alive():
                self._sweeper = threading.Thread(target=self._sweep, name="dlstore-cache-mapped", daemon=True)
                self._sweeper.start()
        self._let_go(gone)

    def done(self, name: str, keep: bool) -> None:
        """One read of entry `name` ended; unless `keep`, it goes once no read uses it."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return
            entry.users -= 1
            entry.last_used = time.monotonic()
            gone = [self._entries.pop(name)] if entry.users <= 0 and not keep else []
        self._let_go(gone)

    def forget(self, name: str) -> None:
        """Let go of entry `name` at once, as before its copy is replaced."""
        with self._lock:
            entry = self._entries.pop(name, None)
        self._let_go([entry] if entry is not None else [])

    def let_go_idle(self) -> bool:
        """Let go of every entry no read uses, as when a reader needs room. Whether there was one."""
        with self._lock:
            gone = self._take(lambda entry: True)
        self._let_go(gone)
        return bool(gone)

    def keep_only(self, names: list[str]) -> None:
        """Let go of the entries no read uses that are not in `names`."""
        near = set(names)
        with self._lock:
            gone = self._take(lambda entry: True, names=near)
        self._let_go(gone)

    def forget_after_fork(self) -> None:
        """In a forked child: close the parent's descriptors, not its locks (see `unlock_and_close`)."""
        for entry in self._entries.values():
            with contextlib.suppress(OSError):
                os.close(entry.fd)
        self._entries.clear()
        self._sweeper = None

    def _sweep(self) -> None:
        """Let go of idle entries while there are any, so a reader that stopped holds nothing."""
        while True:
            time.sleep(LINGER_S)
            with self._lock:
                cutoff = time.monotonic() - LINGER_S
                idle = self._take(lambda entry, cutoff=cutoff: entry.last_used < cutoff)
                if not self._entries:
                    self._sweeper = None
            self._let_go(idle)
            if self._sweeper is None:
                return

    def _take(
        self, which: Callable[[_Entry], bool], over_keep: bool = False, names: set[str] | None = None
    ) -> list[_Entry]:
        """Under the lock: pop the entries no read uses for which `which` holds, and not in
        `names` if given; with `over_keep`, the oldest of them past `KEEP` only."""
        spared = names or set()
        names = [n for n, entry in self._entries.items() if entry.users <= 0 and n not in spared and which(entry)]
        if over_keep:
            names = names[: max(0, len(self._entries) - KEEP)]
        return [self._entries.pop(n) for n in names]

    def _let_go(self, entries: list[_Entry]) -> None:
        for entry in entries:
            self._release(entry.fd)
