"""The result of one doctor check, and how it is printed."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace

__all__ = ["FAIL", "OK", "WARN", "Check", "exit_code", "format_check", "redact"]

OK = "ok"
WARN = "warn"
FAIL = "FAIL"
_STATUSES = (OK, WARN, FAIL)


@dataclass(frozen=True)
class Check:
    """One finding: what was checked, how it went, what was seen, and the fix when it is not ok.

    >>> print(format_check(Check("shm", WARN, "/dev/shm: 1.0 GB free", fix="docker run --shm-size=8g")))
    warn  shm          /dev/shm: 1.0 GB free
          fix: docker run --shm-size=8g
    """

    name: str
    status: str
    summary: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.status not in _STATUSES:
            raise ValueError(f"status must be one of {_STATUSES}, not {self.status!r}")


def format_check(check: Check) -> str:
    """One line; a second with the fix for warn and FAIL."""
    line = f"{check.status:<5} {check.name:<12} {check.summary}"
    if check.status != OK and check.fix:
        line += f"\n{'':<5} fix: {check.fix}"
    return line


def exit_code(checks: Iterable[Check]) -> int:
    """1 when anything failed, else 0; warnings do not fail a run."""
    return 1 if any(check.status == FAIL for check in checks) else 0


def redact(check: Check, secrets: Iterable[str]) -> Check:
    """`check` with every secret value blanked.
    The checks never print one; this makes sure a third-party error message cannot either. A
    short secret is blanked only where it stands alone, not inside a longer word. Otherwise a
    key `test` would mangle `ST_USER=test:tester` and tell the key's length and place."""
    summary, fix = check.summary, check.fix
    for secret in secrets:
        if secret:
            pattern = re.escape(secret)
            if len(secret) < _LONG_SECRET:
                pattern = rf"(?<![A-Za-z0-9]){pattern}(?![A-Za-z0-9])"
            summary, fix = re.sub(pattern, "***", summary), re.sub(pattern, "***", fix)
    return replace(check, summary=summary, fix=fix)


#: Secrets at least this long are blanked wherever they appear, even inside a longer word.
_LONG_SECRET = 12
