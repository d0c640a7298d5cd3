"""Servers, proxies and data helpers that only the tests (and the benchmarks) use.

Import them as ``tests.support.<module>`` from the checkout's root, which pytest puts on
``sys.path``. The programs among them run as ``python -m tests.support.<module>``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["REPO", "env_with_repo"]

#: The checkout's root, where ``tests`` is importable from.
REPO = Path(__file__).resolve().parents[2]


def env_with_repo(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with the checkout first on PYTHONPATH.

    A child process started elsewhere then imports ``tests.support`` too.

    >>> env_with_repo({})["PYTHONPATH"] == str(REPO)
    True
    """
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env
