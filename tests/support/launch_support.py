"""`dlstore train` launched as separate processes, one per rank, with torchrun's variables
(what srun or torchrun set), for the tests that need real signals, exit codes and process groups."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import REPO


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_ranks(
    args: list[str], world: int, log_dir: Path, env: dict[str, str], rank_args: dict[int, list[str]] | None = None
) -> list[subprocess.Popen]:
    """`dlstore train ARGS` as `world` processes on this node (rank N with `rank_args[N]` after
    them, if given); each logs to `log_dir/rankN.log`."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world):
        rank_env = {
            **env,
            **dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)),
            **dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
        }
        with open(log_dir / f"rank{rank}.log", "ab") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "dlstore", "train", *args, *(rank_args or {}).get(rank, [])],
                    cwd=REPO,
                    env=rank_env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs


def logs(log_dir: Path, tail: int = 4000) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-tail:]}" for p in sorted(log_dir.glob("*.log")))


def wait_all(procs: list[subprocess.Popen], log_dir: Path, timeout: float = 150) -> list[int]:
    """Exit codes of `procs`; all killed and the test failed with their logs after `timeout`."""
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
        pytest.fail(f"training did not finish in {timeout} s:\n{logs(log_dir)}")


#: The fields of a metrics record that an exact resume reproduces (not the timings).
DETERMINISTIC_FIELDS = ("split", "step", "epoch", "loss", "top1", "lr", "image_size", "samples")


def metrics_records(path: Path, split: str | None = None) -> list[dict]:
    """The deterministic fields of the metrics records in `path` (of `split` only, if given).
    A line being written as it is read, or a file not there yet, is no record."""
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if split is None or record.get("split") == split:
            records.append({k: record.get(k) for k in DETERMINISTIC_FIELDS})
    return records


def latest_checkpoint(store) -> dict | None:
    """The `latest` pointer under a checkpoint URL's store, or None before one is written."""
    try:
        return json.loads(store.get_bytes("latest"))
    except Exception:  # not written yet
        return None
