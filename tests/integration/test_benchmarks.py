"""`python -m benchmarks.cold loader` end to end, at toy size, against the local Swift: the cold and
warm epochs, the WAN emulator, WebDataset streaming the same shards (`--peers`) and the store
side kept on cores of its own (`--store-cores`). Its figures are not checked (no timed
assertion): that it runs, reports every setting, gives Swift its cores back, and never prints or writes
the credentials."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]


def _bench(swift_server, tmp_path: Path, *options: str) -> subprocess.CompletedProcess:
    env_file = tmp_path / "env.sh"
    env_file.write_text("".join(f"export {name}={value}\n" for name, value in swift_server.env().items()))
    args = [sys.executable, "-m", "benchmarks.cold", "loader", "--images", "48", "--shards", "3"]
    args += ["--batch-size", "8", "--workers", "1", "--rounds", "1", "--workdir", str(tmp_path / "work")]
    args += ["--env-file", str(env_file), *options]
    return subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT)


def _swift_affinities(swift_server) -> dict[int, set[int]]:
    """Every thread of the local Swift's processes (their command lines name its directory)."""
    found = {}
    for proc in psutil.process_iter(["cmdline"]):
        if any(swift_server.data_dir in part for part in proc.info["cmdline"] or ()):
            for thread in proc.threads():
                found[thread.id] = os.sched_getaffinity(thread.id)
    return found


def test_bench_cold_loader_runs_with_its_peers_and_leaks_no_secret(swift_server, tmp_path):
    report = tmp_path / "report.json"
    store_cores = ["--store-cores", "0"] if len(os.sched_getaffinity(0)) > 1 else []
    before = _swift_affinities(swift_server)
    run = _bench(
        swift_server, tmp_path, "--rates", "40MB", "--peers", "--checksums", "xxh3_128,sha256", *store_cores,
        "--unmarked-warm", "--json", str(report),
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    result = json.loads(report.read_text())
    settings = ["loopback", "40MB/s+5ms"]
    assert list(result["settings"]) == [f"{s} | default {c}" for s in settings for c in ("xxh3_128", "sha256")]
    for figures in result["settings"].values():
        assert figures["cold_img_s"]["median"] > 0 and figures["warm_img_s"]["median"] > 0
        # The cold epoch's extra CPU by thread kind (too little to time at this size: only reported).
        assert set(figures["cold_ms_per_mb"]) == {"decode", "download", "prefetch", "other"}
        # --unmarked-warm: a warm first epoch beside the warm one, and the cold one against it.
        assert figures["cold_over_unmarked_warm"]["median"] > 0 and figures["unmarked_warm_over_warm"]["median"] > 0
        assert set(figures["cold_ms_per_mb_over_unmarked"]) == set(figures["cold_ms_per_mb"])
    assert list(result["peers"]) == settings
    assert all(p["webdataset_img_s"]["median"] > 0 for p in result["peers"].values())
    printed = run.stdout + run.stderr + report.read_text()
    assert swift_server.key not in printed
    assert "AUTH_tk" not in printed  # tempauth's tokens
    after = _swift_affinities(swift_server)  # --store-cores gave Swift its cores back
    assert before and {t: after[t] for t in before if t in after} == {t: c for t, c in before.items() if t in after}


def test_bench_cold_refuses_store_cores_that_leave_the_loader_none(swift_server, tmp_path):
    every = ",".join(str(core) for core in sorted(os.sched_getaffinity(0)))
    run = _bench(swift_server, tmp_path, "--rates", "", "--store-cores", every)
    assert run.returncode != 0 and "leaves no core" in run.stderr
