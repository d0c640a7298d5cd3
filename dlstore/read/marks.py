"""Which samples of a dataset are known to decode cleanly, kept for the whole node.
The file is `marks/<store>-<dataset>.bin` in the cache directory, one byte a sample.

Why: a crop-only decode, `transforms.decode_for_crop`, reads the rows below its crop until a
sample has once decoded whole without error. So corrupt samples are still counted. From then
on it reads only the rows it needs. A rank's samples change every epoch, so marks kept per
rank would leave most samples to the slow decode for several epochs. Kept here, every process
of the node knows what any of them decoded, a restarted job's included.

How: `pread` and `pwrite` of one byte, no memory map. So a full disk or a read-only cache is an
`OSError`, never a SIGBUS. A file that cannot be written is still read. One that cannot be
read is not used, and the process keeps its marks in memory from then on. `SamplePath` keeps
what it found in memory, so a sample costs the file at most a read and a write per process.
The file name holds the digest of the shard table. So a sample's bytes never change, and
neither does the verdict. A damaged file can only leave a corrupt sample's damage below its
crop uncounted.
"""

from __future__ import annotations

import errno
import logging
import os

__all__ = ["NodeMarks"]

log = logging.getLogger(__name__)

_MARKED = b"\x01"
# Errors of an open for writing after which the file may still be read.
_READ_ONLY = (errno.EACCES, errno.EPERM, errno.EROFS)


class NodeMarks:
    """The node's marks of one dataset in the file at `path`. Picklable: a worker process opens
    the file again. Safe from several threads and across a fork, since no lock is held."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._pid = -1
        self._unreadable = False  # no file, or a read failed: nothing known, nothing marked
        self._unwritable = False  # read-only file, or a write failed on a full disk: marks still read
        self._said = False

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
        """Whether some process of the node has marked `sample`. False when the file cannot be read."""
        fd = self._file()
        if fd is None:
            return False
        try:
            return os.pread(fd, 1, sample) == _MARKED
        except OSError as exc:
            self._unreadable = True
            self._say(exc)
            return False

    def mark(self, sample: int) -> None:
        """Mark `sample` for the node. A file that cannot take it is no longer written, without error."""
        fd = self._file()
        if fd is None or self._unwritable:
            return
        try:
            os.pwrite(fd, _MARKED, sample)
        except OSError as exc:
            self._unwritable = True
            self._say(exc)

    def _file(self) -> int | None:
        if self._unreadable:
            return None
        pid = os.getpid()
        if self._pid == pid:
            return self._fd
        # First use in this process: a fork's inherited fd is not used. Two threads may both
        # open it: the one published last wins, the other's descriptor stays open.
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)  # as the cache's shared files
        except OSError as exc:
            fd = None
            if exc.errno in _READ_ONLY:  # another user's file, or a read-only cache: read it
                try:
                    fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    pass
            self._unreadable, self._unwritable = fd is None, True
            self._say(exc)
        self._fd, self._pid = fd, pid
        return fd

    def _say(self, exc: OSError) -> None:
        """Log the first trouble with the file, once per process."""
        if not self._said:
            self._said = True
            what = "read, not written" if not self._unreadable else "not used"
            log.info("the node's decode marks %s: %s (%s); this process keeps its own", self.path, exc, what)
