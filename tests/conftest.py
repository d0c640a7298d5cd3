"""Shared pytest configuration for dlstore's tests.

The Swift server fixtures live in ``tests/support/swift_fixtures.py``, loaded here as a
plugin so that its hooks do not clash with this file's. The markers are in pyproject.toml.
"""

from __future__ import annotations

import collections
import faulthandler
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest

from dlstore.logs import THIRD_PARTY

pytest_plugins = ["tests.support.swift_fixtures"]

#: How long the process may take to exit once the session is over.
EXIT_GRACE_S = 120


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End a process that hangs after its last test, with the session's own status.

    A blocked thread or an exit hook would hold CI until its time limit, saying nothing;
    pytest-timeout covers only the tests. After `EXIT_GRACE_S` a watch says where the main
    thread waits and which threads live, then exits. faulthandler dumps every thread if even
    that watch cannot run. Only where pytest is the program: a caller of `pytest.main()` goes on.
    """
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    as_program = (spec is not None and spec.name.split(".")[0] == "pytest") or Path(sys.argv[0]).name in (
        "pytest",
        "py.test",
    )
    if not as_program or sys.__stderr__ is None:
        return
    status = config.stash.get(_EXIT_STATUS, 1)
    faulthandler.dump_traceback_later(EXIT_GRACE_S + 30, exit=True, file=sys.__stderr__)
    threading.Thread(target=_end_a_stuck_exit, args=(status,), name="dlstore-exit-watch", daemon=True).start()


_EXIT_STATUS = pytest.StashKey[int]()


def _end_a_stuck_exit(status: int) -> None:
    """After `EXIT_GRACE_S`: the main thread's stack, the live threads, then `os._exit(status)`.

    Non-daemon threads are marked: the exit joins them."""
    time.sleep(EXIT_GRACE_S)
    out = sys.__stderr__
    frames = sys._current_frames()
    main = threading.main_thread()
    print(f"\nthe test process has not exited {EXIT_GRACE_S} s after its last test; its main thread is at:", file=out)
    frame = frames.get(main.ident)
    print("".join(traceback.format_stack(frame)) if frame is not None else "  (no frame)", file=out)
    alive = collections.Counter(
        f"{thread.name.rstrip('0123456789_-')}{'' if thread.daemon else ' (non-daemon)'}"
        for thread in threading.enumerate()
        if thread is not main
    )
    print("live threads:", ", ".join(f"{name} x{n}" for name, n in alive.most_common()), file=out)
    for thread in threading.enumerate():
        if thread is not main and not thread.daemon and thread.ident in frames:
            print(f"non-daemon thread {thread.name}:", file=out)
            print("".join(traceback.format_stack(frames[thread.ident])), file=out)
    print(f"ending it with the session's status, {status}", file=out, flush=True)
    os._exit(status)


@pytest.fixture(autouse=True)
def restore_log_levels():
    """Give each test the log levels it started with; `dlstore.cli.main` sets them for a terminal."""
    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in THIRD_PARTY)]
    levels = [logger.level for logger in loggers]
    yield
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)
