"""Shared pytest configuration for dlstore's tests.

The local Swift server fixtures (``swift_server``, ``swift_container``, ``s3_bucket``)
live in ``swift_fixtures.py``, loaded here as a plugin, so its hooks do not clash with
hooks defined in this file.

The fault proxy, its loop server and the loader-run helpers (`loader_support`) live in
``tools/``, where `tools/soak.py` uses them too; tools/ goes on ``sys.path`` here, so tests
import them by name (tools never import from tests).
"""

from __future__ import annotations

import faulthandler
import logging
import sys
from pathlib import Path

import pytest

from dlstore.logs import THIRD_PARTY

sys.path.append(str(Path(__file__).resolve().parents[1] / "tools"))

# "tests.swift_fixtures" if tests/ is a package, else "swift_fixtures" (tests/ is on sys.path).
pytest_plugins = [f"{__package__}.swift_fixtures" if __package__ else "swift_fixtures"]

#: How long the process may take to exit once the session is over.
EXIT_GRACE_S = 120


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """A process that does not exit after its last test (a thread left blocked, an exit hook
    waiting) would hold CI until its time limit, with nothing said: after `EXIT_GRACE_S`
    every thread's stack goes to stderr and the process ends with status 1 (the join of the
    interpreter's exit, and `atexit` hooks, come after this hook; pytest-timeout's limit
    covers only tests). Only where pytest is the program: one that runs `pytest.main()` and
    goes on must not be ended."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    as_program = (spec is not None and spec.name.split(".")[0] == "pytest") or Path(sys.argv[0]).name in (
        "pytest",
        "py.test",
    )
    if as_program and sys.__stderr__ is not None:
        faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True, file=sys.__stderr__)


@pytest.fixture(autouse=True)
def restore_log_levels():
    """`dlstore.cli.main` sets up logging for a terminal (`configure_logging`: the storage SDKs'
    loggers at WARNING); tests run in one process, so each gets the levels it started with."""
    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in THIRD_PARTY)]
    levels = [logger.level for logger in loggers]
    yield
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)
