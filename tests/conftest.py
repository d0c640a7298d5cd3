"""Shared pytest configuration for dlstore's tests.

The local Swift server fixtures (``swift_server``, ``swift_container``, ``s3_bucket``)
live in ``swift_fixtures.py``, loaded here as a plugin, so its hooks do not clash with
hooks defined in this file.

The fault proxy, its loop server and the loader-run helpers (`loader_support`) live in
``tools/``, where `tools/soak.py` uses them too; tools/ goes on ``sys.path`` here, so tests
import them by name (tools never import from tests).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from dlstore.logs import THIRD_PARTY

sys.path.append(str(Path(__file__).resolve().parents[1] / "tools"))

# "tests.swift_fixtures" if tests/ is a package, else "swift_fixtures" (tests/ is on sys.path).
pytest_plugins = [f"{__package__}.swift_fixtures" if __package__ else "swift_fixtures"]


@pytest.fixture(autouse=True)
def restore_log_levels():
    """`dlstore.cli.main` sets up logging for a terminal (`configure_logging`: the storage SDKs'
    loggers at WARNING); tests run in one process, so each gets the levels it started with."""
    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in THIRD_PARTY)]
    levels = [logger.level for logger in loggers]
    yield
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)
