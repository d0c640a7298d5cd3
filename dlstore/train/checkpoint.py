"""Training checkpoints in any store: `file://`, `swift://`, `s3://` or an fsspec URL.

Layout under the checkpoint URL::

    ckpt-000001200.pt     one complete checkpoint per save, named by the global step
    ckpt-000001500.pt
    latest                {"key": "ckpt-000001500.pt", "step": 1500, ...}: written last
    config.json           the run's resolved config
    metrics.jsonl         a copy of the metrics so far; the checkpoint holds them too

A store `put` is atomic, and `latest` is written only after the checkpoint's put returned,
so the object it names is complete. A crash between the two leaves an unpublished checkpoint
that `latest_key` still finds. Pruning never deletes what `latest` names.

A checkpoint is a plain `dict` saved with `torch.save`, every tensor on the CPU, so
`torch.load(path, weights_only=True)` reads it without dlstore.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import json
import logging
import os
import re
import shutil
import tempfile
import time
import zipfile
from typing import Any

import torch

from dlstore.errors import ConfigError, DamagedObject, DlstoreError, FormatError, NoSpace, NotFound
from dlstore.logs import redact_url
from dlstore.storage import Store, open_object, open_store

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointStore",
    "checkpoint_key",
    "load_checkpoint_at",
    "load_checkpoint_url",
    "to_cpu",
]

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "dlstore.train.checkpoint/1"
LATEST = "latest"
_NAME = re.compile(r"^ckpt-(\d{9,})\.pt$")


def checkpoint_key(step: int) -> str:
    """`ckpt-000001200.pt`: zero-padded so key order is step order.

    >>> checkpoint_key(1200)
    'ckpt-000001200.pt'
    """
    return f"ckpt-{step:09d}.pt"


def to_cpu(value: Any) -> Any:
    """`value` with every tensor in its nested dicts, lists and tuples moved to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def _damaged_zip(data: bytes) -> bool:
    """Whether torch's zip archive has a member whose bytes fail its CRC.
    That is a cut or damaged checkpoint, not one holding what a safe load refuses."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return archive.testzip() is not None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError):
        return True


def _load_bytes(data: bytes, where: str) -> dict:
    # torch.save writes a zip whose members carry CRCs, which torch.load does not check.
    # A bit flipped in the weights would load silently, so they are checked here.
    archive = zipfile.is_zipfile(io.BytesIO(data))
    if archive and _damaged_zip(data):
        raise FormatError(f"checkpoint {where} cannot be read ({len(data)} bytes): a part of it fails its checksum")
    # weights_only: a checkpoint must never be able to run code when it is read.
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises what its parsers meet: ValueError, KeyError, UnicodeDecodeError...
        if archive and "Weights only load failed" in str(exc):  # whole, but holding what may run code
            # torch's page of advice, cut down to its line that says what was refused
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            refused = next((line for line in lines if "Unpickler error" in line), lines[0] if lines else "")
            raise ConfigError(f"checkpoint {where} holds objects a safe load refuses: {refused}") from None
        if not archive:  # torch's unpickler's page of advice: not what this is
            raise FormatError(
                f"checkpoint {where} cannot be read ({len(data)} bytes): not a whole torch.save archive "
                "(cut short, or not a checkpoint: give a ckpt-*.pt URL, or the folder that holds them)"
            ) from None
        # torch's own errors for a file cut short or damaged: say which file
        raise FormatError(
            f"checkpoint {where} cannot be read ({len(data)} bytes): {type(exc).__name__}: {exc}"
        ) from None
    found = state.get("format") if isinstance(state, dict) else type(state).__name__
    if found != CHECKPOINT_FORMAT:
        raise ConfigError(f"not a dlstore training checkpoint (format {found!r}, expected {CHECKPOINT_FORMAT!r})")
    return state


_TEMP_PREFIX = "dlstore-ckpt-"
#: A temp file younger than this is never swept: a save starting now may not have locked it yet.
_SWEEP_MIN_AGE_S = 60.0
#: Less free space than this where a save failed means a full disk; torch says only "unexpected pos".
_FULL_BELOW_BYTES = 64 * 2**20


def _remove_what_killed_saves_left(tmp_dir: str) -> None:
    """Delete the temp files of saves that were killed, each a whole checkpoint's size.

    A save holds its file's lock until its upload is done, so an unlocked one is a dead save's.
    """
    try:
        names = [n for n in os.listdir(tmp_dir) if n.startswith(_TEMP_PREFIX) and n.endswith(".pt")]
    except OSError:
        return
    for name in names:
        path = os.path.join(tmp_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if time.time() - info.st_mtime < _SWEEP_MIN_AGE_S or info.st_uid != os.getuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a save in progress (this process's, or another's)
            os.unlink(path)
            log.warning("removed %s (%.0f MB), which a killed checkpoint save left", path, info.st_size / 1e6)
        except OSError:
            pass
        finally:
            os.close(fd)


def _raise_if_no_space(exc: BaseException, tmp_dir: str, path: str, step: int) -> None:
    """A `NoSpace` naming the folder, when `torch.save` failed because its disk is full."""
    try:
        free = shutil.disk_usage(tmp_dir).free
        written = os.path.getsize(path)
    except OSError:
        return
    if free < _FULL_BELOW_BYTES or getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        raise NoSpace(
            f"no space in {tmp_dir} for step {step}'s checkpoint ({written / 1e6:.0f} MB written, {free / 1e6:.0f} MB"
            " free): free some there, or point TMPDIR at a larger disk (the checkpoint is written there first, then"
            " uploaded)"
        ) from exc


class CheckpointStore:
    """Save, publish, find and prune checkpoints under one store URL.

    For example::

        ckpts = CheckpointStore("swift://ckpt/run1", keep=3)
        ckpts.save({"model": model.state_dict(), ...}, step=1200)  # 'ckpt-000001200.pt'
        ckpts.load(ckpts.latest_key())["step"]  # 1200
    """

    #: An upload begun this long ago and not complete is a killed save's parts or segments.
    #: Pruning removes them. Longer than any save takes.
    abandoned_after_s = 3600.0

    def __init__(self, target: str | Store, keep: int = 3, tmp_dir: str | None = None) -> None:
        if keep < 1:
            raise ConfigError("keep must be at least 1: the latest checkpoint is never pruned")
        self.store = open_store(target) if isinstance(target, str) else target
        self.keep = keep
        self.tmp_dir = tmp_dir
        self._container_ready = False

    def __repr__(self) -> str:
        return f"CheckpointStore({self.store.url!r}, keep={self.keep})"

    # -- writing ------------------------------------------------------------------------
    def save(self, state: dict, step: int) -> str:
        """Write `state` as `ckpt-{step}.pt`, then point `latest` at it, then prune.

        The state is serialised to a temporary file first, not to memory. The store streams
        that file, in segments when it is large.
        """
        self._make_container()
        key = checkpoint_key(step)
        state = {"format": CHECKPOINT_FORMAT, "step": step, **to_cpu(state)}
        started = time.monotonic()
        tmp_dir = self.tmp_dir or tempfile.gettempdir()
        _remove_what_killed_saves_left(tmp_dir)
        fd, path = tempfile.mkstemp(prefix=_TEMP_PREFIX, suffix=".pt", dir=tmp_dir)
        lock = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            # Held until the upload is done, so a later sweep passes it over. Best effort: a file
            # system without flock, Lustre without -o flock or NFS without lockd, saves all the same.
            with contextlib.suppress(OSError):
                fcntl.flock(lock, fcntl.LOCK_EX)
            file = os.fdopen(fd, "wb")
            try:
                torch.save(state, file)
                file.close()  # its last buffer goes out here, and may not fit either
            except (OSError, RuntimeError) as exc:
                with contextlib.suppress(OSError):
                    file.close()
                _raise_if_no_space(exc, tmp_dir, path, step)
                raise
            size = os.path.getsize(path)
            self._put(key, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            os.close(lock)
        # Only now, with the checkpoint complete in the store, is it published.
        pointer = {"key": key, "step": step, "bytes": size, "saved_at": time.time()}
        self._put(LATEST, json.dumps(pointer).encode())
        log.info(
            "checkpoint %s (%.1f MB) written in %.1f s", self.store.join(key), size / 1e6, time.monotonic() - started
        )
        self.prune(protect=key)
        return key

    def put_json(self, name: str, value: Any) -> None:
        self._make_container()
        self._put(name, json.dumps(value, indent=1).encode())

    def put_text(self, name: str, text: str) -> None:
        self._make_container()
        self._put(name, text.encode())

    def _put(self, name: str, data: bytes | str) -> None:
        """`store.put`, making the container again if it was deleted during the run."""
        try:
            self.store.put(name, data)
        except NotFound:
            log.warning("%s is gone (deleted during the run?): making it again", redact_url(self.store.url))
            self._container_ready = False
            self._make_container()
            self.store.put(name, data)

    def _make_container(self) -> None:
        """A run pointed at a new container makes it before it writes there, as `convert` does.
        Its config and first checkpoint then land rather than fail."""
        if not self._container_ready:
            self.store.ensure_container()
            self._container_ready = True

    def prune(self, protect: str | None = None) -> list[str]:
        """Delete all but the newest `keep` checkpoints, never `protect`; returns what went."""
        keys = self.keys()
        doomed = [k for k in keys[: max(0, len(keys) - self.keep)] if k != protect]
        for key in doomed:
            try:
                self.store.delete(key)
            except NotFound:  # another process pruned it first
                pass
        try:
            self.store.remove_abandoned_uploads("ckpt-", self.abandoned_after_s)
        except DlstoreError as exc:  # space, not correctness: the next save looks again
            log.warning("could not look for the leftovers of killed saves under %s: %s", self.store.url, exc)
        return doomed

    # -- reading ------------------------------------------------------------------------
    def keys(self) -> list[str]:
        """Checkpoint keys, oldest first; none in a container not made yet."""
        try:
            return sorted(info.key for info in self.store.list("ckpt-") if _NAME.match(info.key))
        except NotFound:
            return []

    def latest_key(self) -> str | None:
        """The checkpoint `latest` publishes; failing that, the newest complete one listed."""
        try:
            pointer = json.loads(self.store.get_bytes(LATEST))
            key = pointer["key"]
            if not isinstance(key, str) or not _NAME.match(key):
                raise ValueError(f"it names {str(key)[:80]!r}, not a checkpoint")
            if self.store.exists(key):
                return key
            log.warning("%s names %s, which is missing; looking for another checkpoint", self.store.join(LATEST), key)
        except NotFound:
            pass
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("cannot read %s (%s); looking for another checkpoint", self.store.join(LATEST), exc)
        keys = self.keys()
        if keys:
            log.warning("no usable 'latest' pointer; taking the newest checkpoint listed, %s", keys[-1])
            return keys[-1]
        return None

    def load(self, key: str) -> dict:
        return _load_bytes(_damaged_is_unreadable(self.store, key), self.store.join(key))

    def newest_loadable(self) -> tuple[str, dict] | None:
        """The newest checkpoint that loads, and its state: `latest_key`'s, else the next older.

        Each unreadable one is named in a warning. None when there is no checkpoint, and
        `FormatError` when none loads. A store error is raised as it is: a dropped connection
        must not send a run back to an older checkpoint.
        """
        first = self.latest_key()
        if first is None:
            return None
        candidates = [first, *(key for key in reversed(self.keys()) if key < first)]
        for key in candidates:
            try:
                return key, self.load(key)
            except NotFound:
                continue  # pruned meanwhile
            except FormatError as exc:
                log.warning("%s; trying the checkpoint before it", exc)
        raise FormatError(f"none of the {len(candidates)} checkpoints under {redact_url(self.store.url)} can be read")


def load_checkpoint_url(url: str) -> dict:
    """Load one checkpoint by its URL, e.g. `swift://ckpt/run1/ckpt-000001200.pt`.

    A checkpoint folder's URL, or its `latest`'s, loads the checkpoint published there.
    """
    return load_checkpoint_at(*checkpoint_named(url))[0]


def checkpoint_named(url: str) -> tuple[str, str | None]:
    """Where `--resume URL` points: `(url, None)` for a checkpoint object.

    For a checkpoint folder or its `latest`, it is the folder's URL and the published key.
    """
    url = url.rstrip("/")
    store, key = open_object(url)
    if key.rsplit("/", 1)[-1] == LATEST:
        folder = url[: -len(LATEST)].rstrip("/")
    elif store.exists(key):
        return url, None
    else:
        folder = url  # no such object: a folder of checkpoints?
    found = CheckpointStore(folder).latest_key()
    if found is None:
        raise NotFound(f"no checkpoint at {redact_url(url)}: no such object, and no checkpoint (ckpt-*.pt) under it")
    return folder, found


def load_checkpoint_at(url: str, published: str | None = None) -> tuple[dict, str]:
    """The state of the checkpoint `checkpoint_named` found, and its URL with credentials hidden."""
    if published is None:
        store, key = open_object(url)
        return _load_bytes(_damaged_is_unreadable(store, key), redact_url(url)), redact_url(url)
    ckpts = CheckpointStore(url)
    where = redact_url(ckpts.store.join(published))
    log.info("%s: resuming from the checkpoint published there, %s", redact_url(url), where)
    return ckpts.load(published), where


def _damaged_is_unreadable(store: Store, key: str) -> bytes:
    """The object's bytes. One the store cannot serve whole is an unreadable checkpoint, not a
    store failure: `FormatError`, so `--resume auto` goes back past it."""
    try:
        return store.get_bytes(key)
    except DamagedObject as exc:
        raise FormatError(f"checkpoint {redact_url(store.join(key))} cannot be read: {exc}") from None
