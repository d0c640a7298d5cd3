"""Shared pytest configuration for dlstore's tests.

The local Swift server fixtures (``swift_server``, ``swift_container``, ``s3_bucket``)
live in ``swift_fixtures.py``, loaded here as a plugin, so its hooks do not clash with
hooks defined in this file.

The fault proxy, its loop server and the loader-run helpers (`loader_support`) live in
``tools/``, where `tools/soak.py` uses them too; tools/ goes on ``sys.path`` here, so tests
import them by name (tools never import from tests).
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

sys.path.append(str(Path(__file__).resolve().parents[1] / "tools"))

# "tests.swift_fixtures" if tests/ is a package, else "swift_fixtures" (tests/ is on sys.path).
pytest_plugins = [f"{__package__}.swift_fixtures" if __package__ else "swift_fixtures"]

#: How long the process may take to exit once the session is over.
EXIT_GRACE_S = 120


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """A process that does not exit after its last test (a thread left blocked, an exit hook
    waiting) would hold CI until its time limit, with nothing said. After `EXIT_GRACE_S` a
    watch says where the main thread waits and which threads are alive, and ends the process
    with the session's own status: every test has run and reported by then, and the report
    is what the status says (the join of the interpreter's exit, and `atexit` hooks, come
    after this hook; pytest-timeout's limit covers only tests). faulthandler's dump of every
    thread follows if even that watch cannot run. Only where pytest is the program: one that
    runs `pytest.main()` and goes on must not be ended."""
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
    """After `EXIT_GRACE_S`: the main thread's stack, the live threads by name (non-daemon ones,
    which the exit joins, marked), then `os._exit(status)`."""
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
    """`dlstore.cli.main` sets up logging for a terminal (`configure_logging`: the storage SDKs'
    loggers at WARNING); tests run in one process, so each gets the levels it started with."""
    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in THIRD_PARTY)]
    levels = [logger.level for logger in loggers]
    yield
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)
