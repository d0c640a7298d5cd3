"""Sizes and paths as settings take them: `parse_size`, `format_size`, writable folders."""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping

from dlstore.errors import ConfigError, NoSpace

__all__ = ["default_cache_dir", "format_size", "parse_size", "writable_dir", "writable_file"]

# Decimal units end in B ("KB"); binary ones do not, or end in iB ("K", "KiB").
_SIZE_UNITS = {"": 1, "B": 1} | {unit + "B": 10 ** (3 * i) for i, unit in enumerate("KMGT", 1)}
_SIZE_UNITS |= {unit + tail: 2 ** (10 * i) for i, unit in enumerate("KMGT", 1) for tail in ("", "IB")}


def parse_size(text: str | int) -> int:
    """Bytes from `"150GB"`, `"64MiB"`, `"5M"` or a plain integer.

    >>> parse_size("1.5KB")
    1500
    """
    if isinstance(text, int):
        return text
    raw = text.strip().upper().replace(" ", "")
    number = raw.rstrip("KMGTIB")
    unit = raw[len(number) :]
    if unit not in _SIZE_UNITS or not number:
        raise ConfigError(f"cannot read {text!r} as a size; use e.g. 500MB, 64MiB or 1048576")
    try:
        return int(float(number) * _SIZE_UNITS[unit])
    except ValueError:
        raise ConfigError(f"cannot read {text!r} as a size; use e.g. 500MB, 64MiB or 1048576") from None


def format_size(n: float) -> str:
    """`"1.5 GB"`: decimal units, as `parse_size` reads them and `df -H` prints them.

    >>> format_size(1500), format_size(50 * 10**9)
    ('1.5 KB', '50.0 GB')
    """
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def writable_dir(path: str, flag: str) -> str:
    """`path`, made if missing, before a run spends time on anything.

    A folder that cannot be made or written to is a `ConfigError` naming it and `flag`,
    the option that chose it.
    """
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NoSpace(f"cannot make {path} ({flag}): {exc.strerror}") from None
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.ENOENT, errno.EEXIST):
            raise ConfigError(f"cannot use {path} ({flag}): {exc.strerror}") from None
        raise  # EIO, ESTALE, a timeout: the file system's trouble, not the setting's
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot use {path} ({flag}): not writable")
    return path


def writable_file(path: str, flag: str) -> str:
    """`path`, checked before a run spends time on what it will hold.

    Its folder must exist and be writable, and it must not be a folder itself. Otherwise a
    `ConfigError` names it and `flag`.
    """
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"cannot write {path} ({flag}): it is a folder; name a file")
    if not os.path.isdir(folder):
        raise ConfigError(f"cannot write {path} ({flag}): no folder {folder}")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ConfigError(f"cannot write {path} ({flag}): not writable")
    return path


def default_cache_dir(env: Mapping[str, str] | None = None) -> str:
    """`DLSTORE_CACHE_DIR`, else `~/.cache/dlstore/shards`."""
    env = os.environ if env is None else env
    return env.get("DLSTORE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "dlstore", "shards")
