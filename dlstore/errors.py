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
    """A streamed read whose next chunk took longer than `RetryConfig.stall_timeout_s`.

    The read was cut, and resumes from its next byte."""


class ObjectChanged(DlstoreError):
    """The object was replaced while it was read, so what was read is not one object's. Not retried."""


class DamagedObject(DlstoreError):
    """The store lists the object but cannot serve it whole, e.g. a large object's lost segment."""


class CorruptShard(DlstoreError):
    """A shard's size or checksum does not match its manifest, or its tar is malformed."""


class CorruptSample(DlstoreError):
    """One sample could not be decoded: bad image bytes or a bad label."""


class FormatError(DlstoreError):
    """Input does not have the expected layout: a source dataset, a manifest or an index."""


class ConfigError(DlstoreError):
    """A setting is missing, contradictory or out of range."""


class NoSpace(DlstoreError):
    """The cache's or destination's disk, or /dev/shm, is full. Nothing partial was left behind."""


class ProgramExiting(DlstoreError):
    """The program's exit has begun: waits and queued work in dlstore's threads give up.

    The exit joins every non-daemon thread. A wait there for a shard, for room or for a
    download would hold the exit, so `raise_if_exiting` raises this instead.
    """


def raise_if_exiting(what: str) -> None:
    """`ProgramExiting` in dlstore's own threads and daemon ones, once the exit has begun.

    `threading` sets its flag before the exit's hook that joins every pool's threads. A thread
    of the program's own may work on past the main thread's end, and is left to.
    """
    if not getattr(threading, "_SHUTTING_DOWN", False):
        return
    thread = threading.current_thread()
    if thread.daemon or thread.name.startswith("dlstore-"):
        raise ProgramExiting(f"the program is exiting: {what} given up")


class StoppedBySignal(BaseException):
    """A stop signal, SIGTERM or SIGUSR1, ended a command as Ctrl-C does.

    A BaseException, so no `except Exception` on its way, a retry say, holds it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
