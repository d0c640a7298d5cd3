"""A node-wide cap on connections to the store, set by `CacheConfig.node_connections`.
Every ranged GET of every process sharing the cache directory holds one of `count` slot
files while it runs. It locks the file with a non-blocking `flock`.

    slots = NodeSlots("/mnt/ssd/dlstore", 64)
    index = slots.try_take(urgent=False)     # None: all taken, or a reader waits
    ...                                      # the GET
    slots.give_back(index)

Why files and `flock`: the processes of a node share nothing but the cache directory. A lock
dies with its holder, so a crashed process's slots free themselves. A part holds at most one
slot, from the start of its GET to its end. It never waits for one while holding one, so no
deadlock.

**The reader's shard first.** A reader waiting for a slot, an `urgent` part, holds a shared
lock on ``readers-waiting.lock`` while it waits. A prefetch's part takes no slot while anyone
holds it. So each slot that frees goes to a waiting reader before any prefetch, on every
process of the node. Slots are not set aside for readers: an idle slot would be a connection
the node could have used. A reader may wait for another process's prefetch of the same shard.
It says so on the shard's `.wanted` lock, and that process hurries the download: see
`CacheDir.reader_waits`.

Not thread-safe: the `DownloadEngine` calls it under its own lock. Its descriptors are opened
when first needed and closed when the engine closes with no part running. A forked child
closes the descriptors it inherited when it first uses the cache, in `forget_after_fork`.
Until then, a slot its parent held at the fork stays locked. All the processes sharing a
directory should use the same count.
"""

from __future__ import annotations

import fcntl
import os

from dlstore.cache.config import CacheConfig
from dlstore.cache.layout import try_flock
from dlstore.errors import ConfigError

__all__ = ["NodeSlots", "node_slots"]

_WAITING = "readers-waiting.lock"


class NodeSlots:
    """`count` connection slots shared by the processes using `cache_dir`. See the module docstring."""

    def __init__(self, cache_dir: str, count: int) -> None:
        if count < 1:
            raise ConfigError(f"NodeSlots needs at least one slot, not {count}")
        self.directory = os.path.join(cache_dir, "slots")
        self.count = count
        self._fds: list[int | None] = [None] * count
        self._held: set[int] = set()  # by this process's parts: its own descriptor would re-lock them
        self._first = os.getpid() % count  # processes start their scans apart
        self._waiting_fd: int | None = None  # LOCK_SH on the waiting file while this process's reader waits
        self._probe_fd: int | None = None
        self.waiting = False
        # The last scan found every slot taken and none was given back since: the next scan
        # waits for `look_again`, so that workers woken together do not each scan every slot.
        self._full = False

    def try_take(self, urgent: bool) -> int | None:
        """The index of a free slot, now held, or None. A prefetch's part is not `urgent`. It
        gets none while a reader anywhere on the node waits for one."""
        if (not urgent and self._readers_wait()) or self._full:
            return None
        for step in range(self.count):
            index = (self._first + step) % self.count
            if index not in self._held and try_flock(self._slot_fd(index), fcntl.LOCK_EX):
                self._held.add(index)
                return index
        self._full = True
        return None

    def look_again(self) -> None:
        """Let the next `try_take` scan the slots again: others may have freed some."""
        self._full = False

    def give_back(self, index: int) -> None:
        """Free slot `index`, taken by `try_take`."""
        self._held.discard(index)
        self._full = False
        fd = self._fds[index]
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def set_waiting(self, waiting: bool) -> None:
        """Whether this process's reader is waiting for a slot. Prefetches yield to it."""
        if waiting == self.waiting:
            return
        if waiting:
            if self._waiting_fd is None:
                self._waiting_fd = self._open(_WAITING)
            # Fails only against a probe's instant of LOCK_EX: the engine asks again at its next try.
            if not try_flock(self._waiting_fd, fcntl.LOCK_SH):
                return
        elif self._waiting_fd is not None:
            fcntl.flock(self._waiting_fd, fcntl.LOCK_UN)
        self.waiting = waiting

    def close(self) -> None:
        """Free every slot and close the files: the engine's process is done with them."""
        for index, fd in enumerate(self._fds):
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
                self._fds[index] = None
        for fd in (self._waiting_fd, self._probe_fd):
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        self._waiting_fd = self._probe_fd = None
        self._held.clear()
        self.waiting = False

    def forget_after_fork(self) -> None:
        """In a forked child: close the descriptors inherited from the parent without unlocking
        them. An unlock would free the parent's slots; closing this copy does not."""
        for fd in (*self._fds, self._waiting_fd, self._probe_fd):
            if fd is not None:
                os.close(fd)
        self._fds = [None] * self.count
        self._waiting_fd = self._probe_fd = None
        self._held.clear()
        self.waiting = False

    def _readers_wait(self) -> bool:
        """Whether a reader holds the waiting file, this process's own included. A separate
        open file of it conflicts even within one process."""
        if self._probe_fd is None:
            self._probe_fd = self._open(_WAITING)
        if self.waiting or not try_flock(self._probe_fd, fcntl.LOCK_EX):
            return True
        fcntl.flock(self._probe_fd, fcntl.LOCK_UN)
        return False

    def _slot_fd(self, index: int) -> int:
        fd = self._fds[index]
        if fd is None:
            fd = self._fds[index] = self._open(f"slot-{index:04d}.lock")
        return fd

    def _open(self, name: str) -> int:
        path = os.path.join(self.directory, name)
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except FileNotFoundError:
            os.makedirs(self.directory, exist_ok=True)
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)


def node_slots(config: CacheConfig) -> NodeSlots | None:
    """A process's handle on the connection slots of `config`'s node. None without a cap."""
    return NodeSlots(config.cache_dir, config.node_connections) if config.node_connections else None
