"""Shared pytest configuration for dlstore's tests.

The local Swift server fixtures (``swift_server``, ``swift_container``, ``s3_bucket``)
live in ``swift_fixtures.py``, loaded here as a plugin, so its hooks do not clash with
hooks defined in this file.
"""

from __future__ import annotations

# "tests.swift_fixtures" if tests/ is a package, else "swift_fixtures" (tests/ is on sys.path).
pytest_plugins = [f"{__package__}.swift_fixtures" if __package__ else "swift_fixtures"]
