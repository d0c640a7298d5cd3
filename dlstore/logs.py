"""Log output a user can read: dlstore's own lines at the asked level, the libraries under
it (HTTP clients, storage SDKs) at WARNING unless `-vv`, so a run prints what it does, not
every request, and expected misses (a checkpoint that does not exist yet) stay silent."""

from __future__ import annotations

import logging

__all__ = ["THIRD_PARTY", "configure_logging"]

# Loggers of the libraries under the storage layer; python-swiftclient logs every failed
# request (404 probes included) with its curl line and headers at INFO.
THIRD_PARTY = ("swiftclient", "keystoneauth", "botocore", "boto3", "s3transfer", "urllib3", "fsspec", "PIL")

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(verbosity: int = 0, level: int | None = None) -> None:
    """Set up the root logger for a command-line run: WARNING, INFO with `verbosity=1`, DEBUG
    with 2 (or `level`); the third-party loggers stay at WARNING below `verbosity=2`.

    >>> configure_logging(1)     # what `dlstore -v ...` does
    """
    if level is None:
        level = logging.WARNING - 10 * min(max(verbosity, 0), 2)
    logging.basicConfig(level=level, format=FORMAT)
    logging.getLogger().setLevel(level)
    for name in THIRD_PARTY:
        logging.getLogger(name).setLevel(logging.DEBUG if verbosity >= 2 else logging.WARNING)
