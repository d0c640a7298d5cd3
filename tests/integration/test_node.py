"""Reliability of a node's processes (issue 6, cases 8 and 9, and the file half of case 7),
against the real Swift server.

* Case 8: 8 processes on one node share one cache directory: every shard is fetched once
  (the fault proxy counts the GETs); then one process is SIGKILLed in the middle of a
  download (held there by a stalled response): the others finish, and no partial file
  survives.
* Case 9: a 2-rank training run loses rank 1 to SIGKILL (no chance to checkpoint); the same
  command with `--resume auto` continues from the last complete checkpoint and logs, step by
  step, what an uninterrupted run logs (same losses: same batches in the same order), and
  ends with the same weights. All runs read and write through the fault proxy with 10% of
  their GETs faulted (case 1 with a real trainer: training finishes, on the same data).
* Case 7 (files): that run reads its data and writes its checkpoints through Keystone
  application credentials; neither the secret nor the token appears in the metrics, the
  resolved config, the rank logs or any object under the checkpoint URL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch

from dlstore.config import StoreConfig
from dlstore.format.manifest import Manifest
from dlstore.storage import open_store
from tests.support.fault_proxy import FaultProxy
from tests.support.launch_support import REPO, latest_checkpoint, launch_ranks, logs, metrics_records, wait_all
from tests.support.loader_support import write_dataset

pytestmark = pytest.mark.swift


def report(case: str, **fields: object) -> None:
    print(f"\nRELIABILITY {case}: " + ", ".join(f"{k}={v}" for k, v in fields.items()))


def server_port(server) -> int:
    return urlsplit(server.storage_url).port


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """This environment without credentials or launcher variables of its own, plus `extra`."""
    drop = ("ST_", "OS_", "AWS_", "SWIFTCLIENT_", "DLSTORE_", "SLURM_")
    launcher = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and k not in launcher}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


# -- case 8: 8 processes, one cache directory --------------------------------------------------------
FETCHER = r"""
import json, os, sys, time
from dlstore.format.checksums import checksum_of
from dlstore.cache import CacheConfig, ShardCache
from dlstore.storage import open_store
args = json.loads(sys.argv[1])
cache = ShardCache(CacheConfig(args["cache_dir"], args["limit"], prefetch=0, wait_timeout_s=120), open_store(args["url"]))
while not os.path.exists(args["go"]):  # all start together, so that they race for the same shards
    time.sleep(0.01)
shards = args["shards"]
rotated = shards[args["me"] % len(shards):] + shards[:args["me"] % len(shards)]
for name, size, checksum in rotated:
    path = cache.fetch(name, size, checksum)
    with open(path, "rb") as f:
        assert checksum_of(f.read(), checksum.partition(":")[0]) == checksum, name
print("done", os.getpid(), flush=True)
"""


def _start_fetchers(n: int, args: dict, env: dict[str, str], log_dir: Path) -> list[subprocess.Popen]:
    procs = []
    for me in range(n):
        with open(log_dir / f"fetcher-{me}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", FETCHER, json.dumps({**args, "me": me})],
                    cwd=REPO,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs


@pytest.mark.slow
def test_eight_processes_share_one_cache_then_one_is_killed_mid_download(swift_server, swift_container, tmp_path):
    url = f"swift://{swift_container}/shared"
    store = open_store(url, StoreConfig.from_env(swift_server.env()))
    write_dataset(store, [40] * 6)  # 6 shards of ~100 KB
    shards = [(s.name, s.size, s.checksum) for s in Manifest.load(store).shards]
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    with FaultProxy(server_port(swift_server), stall_s=60) as proxy:
        env = clean_env({"ST_AUTH": f"{proxy.url}/auth/v1.0", "ST_USER": swift_server.user, "ST_KEY": swift_server.key})
        # All at once: each shard is downloaded by one of them, the others wait and read it.
        args = dict(url=url, cache_dir=str(tmp_path / "cache"), limit="50MB", shards=shards, go=str(tmp_path / "go"))
        procs = _start_fetchers(8, args, env, log_dir)
        time.sleep(1.0)
        (tmp_path / "go").touch()
        assert [p.wait(timeout=120) for p in procs] == [0] * 8, logs(log_dir)
        gets = proxy.per_object("GET", r"/shard-\d+\.tar$")
        assert sorted(gets) == sorted(f"/v1/AUTH_test/{swift_container}/shared/{name}" for name, _, _ in shards)
        assert set(gets.values()) == {1}, gets  # every shard fetched once for the 8 of them

        # Again in a fresh directory, one shard's response stalls half-way: kill its downloader.
        victim_shard = shards[3][0]
        proxy.add_rule("stall_body", method="GET", path=rf"/{victim_shard}$", times=1)
        proxy.reset_counts()
        cache_dir = tmp_path / "cache2"
        args.update(cache_dir=str(cache_dir), go=str(tmp_path / "go2"))
        procs = _start_fetchers(8, args, env, log_dir)
        time.sleep(1.0)
        (tmp_path / "go2").touch()
        deadline = time.monotonic() + 60
        partial = []
        while time.monotonic() < deadline and not partial:
            partial = [p for p in (cache_dir / "tmp").glob(f"*{victim_shard}.*.part")] if cache_dir.exists() else []
            time.sleep(0.02)
        assert partial, "no download of the stalled shard started"
        while proxy.count("GET", rf"/{victim_shard}$") < 1:
            time.sleep(0.02)
        time.sleep(0.3)  # the response is stalled half-way now
        victim_pid = int(partial[0].name.split(".")[-4])
        victim = next(p for p in procs if p.pid == victim_pid)
        victim.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        codes = [p.wait(timeout=120) for p in procs]
        recovered = time.monotonic() - killed_at
        victim_gets = proxy.count("GET", rf"/{victim_shard}$")
    assert codes.count(-signal.SIGKILL) == 1 and codes.count(0) == 7, logs(log_dir)
    assert victim_gets == 2  # the killed download, and one by a survivor: no storm
    assert list((cache_dir / "tmp").iterdir()) == []  # the dead process's temp file was removed
    published = {p.name.split("-", 1)[1]: p.read_bytes() for p in (cache_dir / "shards").iterdir()}
    for name, size, _ in shards:
        assert len(published[name]) == size and published[name] == store.get_bytes(name)
    report("case 8", processes=8, gets_per_shard=1, killed_mid_download=1, recovered_s=f"{recovered:.1f}")


# -- case 9: SIGKILL of a training process, then --resume auto ------------------------------------
@pytest.mark.torchrun
@pytest.mark.slow
def test_sigkill_then_resume_auto_continues_from_the_last_complete_checkpoint(swift_server, swift_container, tmp_path):
    secret, app_id = swift_server.app_cred_secret, swift_server.app_cred_id
    keystone = {
        "OS_AUTH_URL": swift_server.keystone_url,
        "OS_IDENTITY_API_VERSION": "3",
        "OS_AUTH_TYPE": "v3applicationcredential",
        "OS_APPLICATION_CREDENTIAL_ID": app_id,
        "OS_APPLICATION_CREDENTIAL_SECRET": secret,
        "OS_REGION_NAME": "RegionOne",
    }
    config = StoreConfig.from_env(keystone)  # this test's own reads and writes: straight to the server
    # The ranks' data and checkpoints go through the fault proxy, 10% of their GETs faulted.
    proxy = FaultProxy(server_port(swift_server), seed=3, stall_s=2.5).start()
    proxy.set_rate(0.1, method="GET", cycle=True)
    storage = f"{proxy.url}{urlsplit(swift_server.storage_url).path}"
    env = clean_env(
        {**keystone, "OS_STORAGE_URL": storage, "DLSTORE_READ_TIMEOUT": "1", "DLSTORE_RETRY_BACKOFF": "0.05"}
    )
    try:
        _kill_and_resume(swift_server, swift_container, tmp_path, config, env, secret, proxy)
    finally:
        proxy.close()


def _kill_and_resume(swift_server, swift_container, tmp_path, config, env, secret, proxy) -> None:
    data = f"swift://{swift_container}/data"
    write_dataset(open_store(data, config), [12, 9, 14, 11, 10, 8, 13, 12])  # 89 samples, 5 classes

    def args(run: str) -> list[str]:
        return [
            # MobileNetV3-small: small checkpoints, and its dropout needs each rank's RNG restored.
            *(data, "--model", "mobilenet_v3_small", "--image-size", "16", "--epochs", "2", "--batch-size", "8"),
            *("--workers", "0", "--log-every", "1", "--seed", "5", "--deterministic", "--base-lr", "0.2"),
            *("--warmup-epochs", "0.5", "--checkpoint-every-steps", "3", "--checkpoint-every-minutes", "0"),
            *("--cache-dir", str(tmp_path / run / "cache"), "--cache-limit", "1GB", "--keep-checkpoints", "2"),
            *("--output-dir", str(tmp_path / run / "out"), "--checkpoint-url", f"swift://{swift_container}/ckpt-{run}"),
            *("--resume", "auto", "--dist-timeout-minutes", "1", "--no-progress", "--no-tensorboard"),
        ]

    # The reference: uninterrupted.
    assert wait_all(launch_ranks(args("a"), 2, tmp_path / "a", env), tmp_path / "a") == [0, 0], logs(tmp_path / "a")
    steps_per_epoch = json.loads((tmp_path / "a" / "out" / "config.json").read_text())["resolved"]["steps_per_epoch"]
    total = 2 * steps_per_epoch

    # The same run; rank 1 is SIGKILLed in the second epoch, a step or more after a checkpoint.
    ckpt_b = open_store(f"swift://{swift_container}/ckpt-b", config)
    metrics_b = tmp_path / "b" / "out" / "metrics.jsonl"
    procs = launch_ranks(args("b"), 2, tmp_path / "b", env)
    deadline = time.monotonic() + 120
    ready = False
    while time.monotonic() < deadline and all(p.poll() is None for p in procs) and not ready:
        latest = latest_checkpoint(ckpt_b)
        logged = metrics_records(metrics_b) if metrics_b.exists() else []
        done = max((r["step"] for r in logged if r["split"] == "train"), default=0)
        ready = bool(latest) and steps_per_epoch < latest["step"] < done < total
        time.sleep(0.02)
    assert ready, f"the run ended before it could be killed:\n{logs(tmp_path / 'b')}"
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        survivor = procs[0].wait(timeout=120)  # its collectives fail: it must not hang
    except subprocess.TimeoutExpired:
        procs[0].kill()
        pytest.fail(f"rank 0 hung after rank 1 was killed:\n{logs(tmp_path / 'b')}")
    survivor_exit_s = time.monotonic() - killed_at
    assert survivor != 0
    at_kill = latest_checkpoint(ckpt_b)
    assert at_kill is not None and ckpt_b.exists(at_kill["key"])  # `latest` names a complete checkpoint
    logged = metrics_records(tmp_path / "b" / "out" / "metrics.jsonl")
    killed_after = max(r["step"] for r in logged if r["split"] == "train")

    # The same command again: it resumes from that checkpoint and ends as the reference did.
    assert wait_all(launch_ranks(args("b"), 2, tmp_path / "b", env), tmp_path / "b") == [0, 0], logs(tmp_path / "b")
    assert f"ckpt-b/{at_kill['key']} at epoch" in (tmp_path / "b" / "rank0.log").read_text()
    reference = metrics_records(tmp_path / "a" / "out" / "metrics.jsonl")
    resumed = metrics_records(tmp_path / "b" / "out" / "metrics.jsonl")
    assert [r["step"] for r in reference if r["split"] == "train"] == list(range(1, total + 1))
    assert resumed == reference  # every step's loss: the same batches, in the same order

    ckpt_a = open_store(f"swift://{swift_container}/ckpt-a", config)
    finals = [torch.load(_bytes_io(s.get_bytes(f"ckpt-{total:09d}.pt")), weights_only=True) for s in (ckpt_a, ckpt_b)]
    assert all(f["finished"] for f in finals)
    for name, tensor in finals[0]["model"].items():
        assert torch.equal(tensor, finals[1]["model"][name]), name
    report(
        "case 9",
        killed_after_step=killed_after,
        resumed_from=at_kill["key"],
        steps_redone=killed_after - at_kill["step"],
        rank0_exit_s=f"{survivor_exit_s:.1f}",
        faults=dict(proxy.injected_kinds()),
        lost=0,
        repeated=0,
    )

    # Case 7, the files: no secret or token in anything the run wrote.
    _, token = swift_server.swift_connection().get_auth()
    needles = [secret.encode(), token.encode(), token.removeprefix("AUTH_tk")[:12].encode()]
    files = {str(p): p.read_bytes() for run in ("a", "b") for p in (tmp_path / run).rglob("*") if p.is_file()}
    files = {k: v for k, v in files.items() if "/cache/" not in k}  # the shard cache holds the dataset only
    for store in (ckpt_a, ckpt_b):
        files.update({store.join(i.key): store.get_bytes(i.key) for i in store.list()})
    assert any(k.endswith(".pt") for k in files) and any(k.endswith("metrics.jsonl") for k in files)
    leaks = [(where, n[:6]) for where, blob in files.items() for n in needles if n in blob]
    assert not leaks, leaks
    report("case 7 (files)", scanned=len(files), leaks=0)


def _bytes_io(data: bytes):
    import io

    return io.BytesIO(data)
