"""Which samples of a dataset are known to decode cleanly, kept for the whole node in the
cache directory (`marks/<store>-<dataset>.bin`, one byte a sample).

Why: a crop-only decode reads the rows below its crop until a sample has once decoded whole
without error (`transforms.decode_for_crop`), so that corrupt samples are counted as before;
from then on it reads only the rows it needs (~12% less decode here). A rank's samples change
every epoch (the node's stream is dealt to its ranks afresh), so with marks kept per rank a
node of 8 ranks would decode 7/8 of its samples the slow way in epoch 2, 49/64 in epoch 3, ...
Kept here, every process of the node (ranks, their worker processes, a job restarted on the
node) knows what any of them decoded.

How: `pread` and `pwrite` of one byte, no memory map, so that a full disk or a read-only
cache is an `OSError` (after which this process keeps its marks in memory only), never a
SIGBUS. Readers keep what they found in memory (`SamplePath`), so a sample costs the file at
most a read and a write per process. The bytes of a sample never change (the file's name
holds the digest of the dataset's shard table, checksums included), so neither does the
verdict. A damaged file can only make a corrupt sample's damage below its crop go uncounted.
"""

from __future__ import annotations

import logging
import os
import threading

__all__ = ["NodeMarks"]

log = logging.getLogger(__name__)

_MARKED = b"\x01"


class NodeMarks:
    """The node's marks of one dataset in the file at `path`; picklable (a worker process opens
    the file again), safe to use from several threads."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._pid = -1
        self._failed = False
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"NodeMarks({self.path!r})"

    def __del__(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            try:
                os.close(self._fd)
            except OSError:
                pass

    def known(self, sample: int) -> bool:
        """Whether some process of the node has marked `sample` (False when the file cannot be read)."""
        fd = self._file()
        if fd is None:
            return False
        try:
            return os.pread(fd, 1, sample) == _MARKED
        except OSError as exc:
            self._give_up(exc)
            return False

    def mark(self, sample: int) -> None:
        """Mark `sample` for the node; a file that cannot take it is given up (no error)."""
        fd = self._file()
        if fd is None:
            return
        try:
            os.pwrite(fd, _MARKED, sample)
        except OSError as exc:
            self._give_up(exc)

    def _file(self) -> int | None:
        if self._failed:
            return None
        if self._pid == os.getpid():
            return self._fd
        with self._lock:
            if self._pid != os.getpid():  # first use in this process (a fork shares the parent's fd: kept apart)
                try:
                    os.makedirs(os.path.dirname(self.path), exist_ok=True)
                    self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                except OSError as exc:
                    self._fd = None
                    self._give_up(exc)
                self._pid = os.getpid()
        return self._fd

    def _give_up(self, exc: OSError) -> None:
        if not self._failed:
            self._failed = True
            log.info("decode marks kept per process: %s: %s", self.path, exc)
