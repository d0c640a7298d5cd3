"""The one family of errors dlstore raises.

Callers catch `DlstoreError` for anything dlstore-specific, or one subclass to
react to one kind of failure: only `TransientError` is worth retrying.
"""

from __future__ import annotations

import signal
import threading

__all__ = [
    "AuthError",
    "ConfigError",
    "CorruptSample",
    "CorruptShard",
    "DamagedObject",
    "DlstoreError",
    "FormatError",
    "NoSpace",
    "NotFound",
    "ObjectChanged",
    "ProgramExiting",
    "StoppedBySignal",
    "TransientError",
]


class DlstoreError(Exception):
    """Base of every error dlstore raises on purpose."""


class NotFound(DlstoreError):
    """The object, container or bucket does not exist. Never retried."""


class AuthError(DlstoreError):
    """Credentials were missing, wrong, expired or revoked. Never retried."""


class TransientError(DlstoreError):
    """A failure that may pass: timeout, reset, 408/429/5xx, short read.

    Raised to the caller only once the retry policy's attempts or deadline are spent.
    """


class StalledRead(TransientError):
    """A streamed read whose next chunk took longer than `RetryConfig.stall_timeout_s`: a server
    that trickles bytes, each within the read timeout. The read was cut; it resumes from its
    next byte; cuts that move less than a chunk between them are no progress for the retry budget."""


class ObjectChanged(DlstoreError):
    """The object was replaced while it was read (a resumed read found another version, or
    fewer bytes): what was read so far is not one object's. Not retried."""


class DamagedObject(DlstoreError):
    """The store lists the object but cannot serve it whole: a large object whose segments are
    missing or were changed (Swift answers 409). Never retried."""


class CorruptShard(DlstoreError):
    """A shard's bytes do not match its manifest (size or checksum), or its tar is malformed."""


class CorruptSample(DlstoreError):
    """One sample could not be decoded (bad image bytes, bad label)."""


class FormatError(DlstoreError):
    """Input does not have the expected layout (a source dataset, a manifest, an index)."""


class ConfigError(DlstoreError):
    """A setting is missing, contradictory or out of range."""


class NoSpace(DlstoreError):
    """The local disk (cache or destination), or /dev/shm, is full; nothing partial was left behind."""


class ProgramExiting(DlstoreError):
    """The program's exit has begun, and it joins every non-daemon thread (a decode pool's among
    them): a wait in one for a shard another process holds, for room in the cache or for a
    download would hold that exit (up to `CacheConfig.wait_timeout_s`), and each batch still
    queued would run in full first. Such work gives up instead (`raise_if_exiting`)."""


def raise_if_exiting(what: str) -> None:
    """`ProgramExiting` in dlstore's own threads (and daemon ones) once the program's exit has
    begun: `threading` raises its flag before the exit's first hooks, one of which joins every
    `ThreadPoolExecutor`'s threads (private, there from 3.9 on). A thread of the program's own
    may go on working past the main thread's end, and is left to."""
    if not getattr(threading, "_SHUTTING_DOWN", False):
        return
    thread = threading.current_thread()
    if thread.daemon or thread.name.startswith("dlstore-"):
        raise ProgramExiting(f"the program is exiting: {what} given up")


class StoppedBySignal(BaseException):
    """A stop signal (SIGTERM, SIGUSR1) ended a command where it stood, as Ctrl-C does: not an
    error, and a BaseException, so that no `except Exception` on its way (a retry) holds it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
