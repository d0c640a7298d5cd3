"""The bundled trainer (`dlstore.train`), on the CPU with gloo, through the real Dataset and
Loader on data made by `dlstore.demo.datagen` and `dlstore.convert`.

The end-to-end tests launch `dlstore train` as separate processes (one per rank), exactly
as torchrun or srun would, so signals, exit codes and process groups are the real ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

import dlstore
from dlstore.cli import build_parser
from dlstore.cli import main as cli
from dlstore.config import DataConfig
from dlstore.convert import ConvertOptions, convert
from dlstore.demo.datagen import make_cifar10
from dlstore.errors import ConfigError, DlstoreError, FormatError, NoSpace, NotFound
from dlstore.format.manifest import Manifest
from dlstore.storage import open_store
from dlstore.storage.local import LocalStore
from dlstore.train import (
    CheckpointStore,
    MetricsLog,
    TrainConfig,
    image_size_for_epoch,
    lr_factor,
    measure_training_rate,
    read_metrics,
)
from dlstore.train.checkpoint import checkpoint_key, checkpoint_named, load_checkpoint_at, load_checkpoint_url
from dlstore.train.config import config_from_args
from dlstore.train.demand import precision_name
from dlstore.train.dist import Rendezvous, first_slurm_host, warn_of_a_shared_store
from dlstore.train.loop import EXIT_PREEMPTED, Trainer, main
from dlstore.train.signals import START_UP_STOP_GRACE_S
from dlstore.train.step import amp_dtype_for
from dlstore.world import World
from tests.support.launch_support import REPO, launch_ranks, logs, wait_all
from tests.support.loader_support import write_dataset

# What is compared between an interrupted and an uninterrupted run (not the timings).
DETERMINISTIC_FIELDS = ("split", "step", "epoch", "loss", "top1", "top5", "lr", "image_size", "samples")


# -- helpers --------------------------------------------------------------------------------
def make_dataset(workdir: Path, url: str, *, per_batch: int, test: int) -> None:
    """A small learnable CIFAR-10-like dataset (32x32, 10 classes) converted to `url`/train and /val."""
    source = workdir / "cifar-source"
    make_cifar10(source, per_batch=per_batch, test=test, seed=0)
    convert("cifar10", source, f"{url}/train", ConvertOptions(split="train", samples_per_shard=64))
    convert("cifar10", source, f"{url}/val", ConvertOptions(split="test", samples_per_shard=32))


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without any launcher's variables, one thread per process."""
    launcher = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
    )
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("SLURM_")}
    # One intra-op thread: no oversubscription on small CI machines, and bit-exact CPU kernels.
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(extra or {}))
    return env


def train_records(path: Path) -> list[dict]:
    return [{k: r.get(k) for k in DETERMINISTIC_FIELDS} for r in read_metrics(str(path))]


# -- end to end -----------------------------------------------------------------------------
@pytest.mark.torchrun
@pytest.mark.slow
def test_two_rank_ddp_training_from_swift_learns(tmp_path, swift_server, swift_container, monkeypatch):
    """2-process gloo DDP (launched by torchrun) reading from the real Swift server learns the
    generated classes far above chance; eval counts every val sample exactly once."""
    for name, value in swift_server.swift_env().items():
        monkeypatch.setenv(name, value)
    data = f"swift://{swift_container}/cifar"
    make_dataset(tmp_path, data, per_batch=64, test=80)  # 320 train, 80 val samples
    out = tmp_path / "out"
    ckpt_url = f"swift://{swift_container}/checkpoints/run1"
    args = [
        *("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
        *("-m", "dlstore", "train", f"{data}/train", "--val-url", f"{data}/val"),
        *("--model", "resnet18", "--image-size", "32", "--batch-size", "16", "--epochs", "4"),
        *("--base-lr", "0.4", "--warmup-epochs", "0.5", "--workers", "1", "--log-every", "5"),
        *("--cache-dir", str(tmp_path / "cache"), "--cache-limit", "1GB", "--output-dir", str(out)),
        *("--checkpoint-url", ckpt_url, "--checkpoint-every-steps", "15", "--keep-checkpoints", "2"),
        "--no-progress",
    ]
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    with open(log_dir / "torchrun.log", "wb") as log:
        proc = subprocess.Popen(  # torchrun's torchelastic_* log folder: in the test's temp dir
            [sys.executable, *args],
            cwd=REPO,
            env=dict(child_env(), TMPDIR=str(tmp_path)),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    assert wait_all([proc], log_dir) == [0], logs(log_dir)

    records = read_metrics(str(out / "metrics.jsonl"))
    val = [r for r in records if r["split"] == "val"]
    train = [r for r in records if r["split"] == "train"]
    assert [r["epoch"] for r in val] == [0, 1, 2, 3]
    assert all(r["samples"] == 80 for r in val), val  # padding excluded, nothing counted twice
    assert val[-1]["top1"] >= 0.5, val  # 10 classes: chance is 0.1
    assert [r["step"] for r in train] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert all(r["samples"] == 5 * 32 for r in train)  # 5 steps x 16 per rank x 2 ranks
    assert all(0 <= r["data_wait_pct"] <= 100 and r["img_per_s"] > 0 for r in train)
    resolved = json.loads((out / "config.json").read_text())
    assert resolved["resolved"]["world_size"] == 2 and resolved["resolved"]["global_batch"] == 32
    assert resolved["resolved"]["peak_lr"] == pytest.approx(0.4 * 32 / 256)
    assert any("tfevents" in p.name for p in (out / "tensorboard").iterdir())
    assert (out / "metrics.csv").read_text().count("\n") == len(records) + 1

    ckpts = CheckpointStore(ckpt_url)
    assert ckpts.keys() == [checkpoint_key(30), checkpoint_key(40)]  # 15, 30, 40 (final); keep 2
    final = ckpts.load(ckpts.latest_key())
    assert final["finished"] and final["step"] == 40 and final["world_size"] == 2
    assert final["metrics"] == records


@pytest.mark.torchrun
@pytest.mark.slow
def test_sigterm_mid_epoch_then_resume_auto_matches_uninterrupted_run(tmp_path):
    """A 2-rank run that gets SIGTERM (on one rank only) mid-epoch checkpoints at the same step
    on both ranks, exits with EXIT_PREEMPTED, and, restarted with `--resume auto`, logs the same
    metrics step by step and ends with the same weights as a run that never stopped.

    MobileNetV3-small: cheap on the CPU, and its dropout makes the result depend on each rank's
    RNG stream being restored exactly (and not disturbed by the loader's start-up)."""
    data = f"file://{tmp_path}/data"
    make_dataset(tmp_path, data, per_batch=25, test=40)  # 125 train: 8 steps per epoch at 2 ranks x 8, padded

    def args(run: str) -> list[str]:
        return [
            *(f"{data}/train", "--val-url", f"{data}/val", "--model", "mobilenet_v3_small", "--epochs", "2"),
            *("--batch-size", "8", "--workers", "1", "--log-every", "1", "--seed", "3", "--deterministic"),
            # Progressive resizing: epoch 0 at 32 px, epoch 1 at 40 px (the resume crosses it).
            *("--image-size", "40", "--resize-min", "32", "--resize-step", "8", "--resize-end-epoch", "1"),
            *("--base-lr", "0.2", "--warmup-epochs", "0.5", "--checkpoint-every-minutes", "0"),
            *("--cache-dir", str(tmp_path / "cache"), "--cache-limit", "1GB"),
            *("--output-dir", str(tmp_path / run / "out"), "--checkpoint-url", f"file://{tmp_path}/{run}/ckpt"),
            *("--resume", "auto", "--no-progress", "--no-tensorboard"),
        ]

    env = child_env()
    # The reference: uninterrupted.
    assert wait_all(launch_ranks(args("a"), 2, tmp_path / "a", env), tmp_path / "a") == [0, 0], logs(tmp_path / "a")
    steps_per_epoch = json.loads((tmp_path / "a" / "out" / "config.json").read_text())["resolved"]["steps_per_epoch"]
    assert steps_per_epoch == 8

    # The same run, sent SIGTERM in its second epoch, on rank 1 only.
    procs = launch_ranks(args("b"), 2, tmp_path / "b", env)
    metrics = tmp_path / "b" / "out" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if metrics.exists() and any(r["step"] >= steps_per_epoch + 2 for r in read_metrics(str(metrics))):
            break
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
    assert wait_all(procs, tmp_path / "b") == [EXIT_PREEMPTED, EXIT_PREEMPTED], logs(tmp_path / "b")
    ckpts = CheckpointStore(f"file://{tmp_path}/b/ckpt")
    stopped = ckpts.load(ckpts.latest_key())
    assert steps_per_epoch < stopped["step"] < 2 * steps_per_epoch, "the stop should fall mid-epoch"
    assert not stopped["finished"] and stopped["epoch"] == 1
    assert stopped["loader"]["epoch"] == 1
    assert sum(s["steps"] for s in stopped["loader"]["history"]) == stopped["step"] - steps_per_epoch

    # Restarted with the same command line, but worker processes (started by a fork server, as
    # the trainer starts them) where the threads ran: it resumes from that checkpoint, and the
    # engine changes nothing of what is trained.
    restart = [*args("b"), "--engine", "processes"]
    assert wait_all(launch_ranks(restart, 2, tmp_path / "b", env), tmp_path / "b") == [0, 0], logs(tmp_path / "b")
    assert "resumed from" in (tmp_path / "b" / "rank0.log").read_text()
    assert "train: engine processes, 1 workers" in (tmp_path / "b" / "rank0.log").read_text()

    reference = train_records(tmp_path / "a" / "out" / "metrics.jsonl")
    resumed = train_records(metrics)
    assert [r["step"] for r in reference if r["split"] == "train"] == list(range(1, 2 * steps_per_epoch + 1))
    first_of_epoch = (1, steps_per_epoch + 1)
    assert [r["image_size"] for r in reference if r["step"] in first_of_epoch and r["split"] == "train"] == [32, 40]
    assert resumed == reference

    # The final checkpoints: same weights, bit for bit, readable with plain torch.load.
    final_a = torch.load(tmp_path / "a" / "ckpt" / checkpoint_key(2 * steps_per_epoch), weights_only=True)
    final_b = torch.load(tmp_path / "b" / "ckpt" / checkpoint_key(2 * steps_per_epoch), weights_only=True)
    assert final_a["finished"] and final_b["finished"]
    assert final_a["model"].keys() == final_b["model"].keys()
    for name, tensor in final_a["model"].items():
        assert torch.equal(tensor, final_b["model"][name]), name
    for state in (final_a["optimizer"]["state"], final_b["optimizer"]["state"]):
        assert state, "momentum buffers are saved"


# -- checkpoints ----------------------------------------------------------------------------
class RecordingStore(LocalStore):
    """A local store that records the order of its writes and deletes."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.events: list[tuple[str, str]] = []

    def put(self, key, data):
        super().put(key, data)
        self.events.append(("put", key))

    def delete(self, key):
        super().delete(key)
        self.events.append(("delete", key))


def test_checkpoint_published_after_it_is_complete_and_pruned_keep_n(tmp_path):
    store = RecordingStore(f"file://{tmp_path}")
    ckpts = CheckpointStore(store, keep=2)
    for step in (100, 200, 300):
        ckpts.save({"model": {"w": torch.full((3,), float(step))}, "metrics": [{"step": step}]}, step)
    names = [checkpoint_key(s) for s in (100, 200, 300)]
    assert store.events == [
        ("put", names[0]),
        ("put", "latest"),
        ("put", names[1]),
        ("put", "latest"),
        ("put", names[2]),
        ("put", "latest"),
        ("delete", names[0]),  # pruned only after the newer one is published
    ]
    assert ckpts.keys() == names[1:]
    assert json.loads((tmp_path / "latest").read_bytes())["key"] == names[2]
    # Plain torch.load, nothing from dlstore needed, weights_only.
    state = torch.load(tmp_path / names[2], weights_only=True)
    assert state["step"] == 300 and torch.equal(state["model"]["w"], torch.full((3,), 300.0))
    assert load_checkpoint_url(f"file://{tmp_path}/{names[1]}")["step"] == 200


def test_a_checkpoint_that_does_not_fit_its_temp_disk_is_a_clear_error_that_leaves_nothing(tmp_path):
    """A full temp disk ended the run in torch's "[enforce fail at inline_container.cc:672] .
    unexpected pos 704 vs 598", which names neither the disk nor the way out."""
    from tests.loader.test_bad_data import small_disk

    ckpts = CheckpointStore(f"file://{tmp_path}/ckpt", tmp_dir=str(tmp_path / "tmp"))
    with small_disk(tmp_path / "tmp", 2**20) as kind:
        if kind != "tmpfs":
            pytest.skip(f"needs a small tmpfs (root): {kind}")
        many_small = {f"w{i}": torch.zeros(64) for i in range(5000)}  # torch's own writes fit; the last flush fails
        for model in ({"w": torch.zeros(2**20)}, many_small):  # 4 MB and 1.3 MB
            with pytest.raises(NoSpace, match=rf"no space in {tmp_path / 'tmp'} for step 5's checkpoint .*TMPDIR"):
                ckpts.save({"model": model}, 5)
            assert list((tmp_path / "tmp").iterdir()) == []
    assert ckpts.keys() == [] and not (tmp_path / "ckpt" / "latest").exists()


def test_a_save_removes_the_temp_files_killed_saves_left_and_no_other(tmp_path):
    """A save killed (kill -9, the OOM killer) left its whole checkpoint in $TMPDIR, on a lease's
    small local disk, for good: the next save removes such files. One that a save in progress
    holds (locked), one just made, and other files stay."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    hour_ago = time.time() - 3600
    for name in ("dlstore-ckpt-dead.pt", "dlstore-ckpt-saving.pt", "dlstore-ckpt-new.pt", "other.pt"):
        (tmp / name).write_bytes(b"x" * 1000)
        if name != "dlstore-ckpt-new.pt":
            os.utime(tmp / name, (hour_ago, hour_ago))
    saving = os.open(tmp / "dlstore-ckpt-saving.pt", os.O_RDONLY)
    try:
        fcntl.flock(saving, fcntl.LOCK_EX)  # as a save in progress holds its file
        CheckpointStore(f"file://{tmp_path}/ckpt", tmp_dir=str(tmp)).save({"x": torch.zeros(1)}, 1)
    finally:
        os.close(saving)
    assert sorted(p.name for p in tmp.iterdir()) == ["dlstore-ckpt-new.pt", "dlstore-ckpt-saving.pt", "other.pt"]
    assert (tmp_path / "ckpt" / checkpoint_key(1)).exists()


def test_a_checkpoint_is_saved_where_the_temp_folder_has_no_file_locks(tmp_path, monkeypatch):
    """The lock a save holds on its temp file (so that a later save's sweep passes it over)
    failed every save on a file system without flock (Lustre without -o flock, NFS without
    lockd): it is best effort."""
    import dlstore.train.checkpoint as checkpoint

    def no_locks(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(checkpoint.fcntl, "flock", no_locks)
    ckpts = CheckpointStore(f"file://{tmp_path}/ckpt", tmp_dir=str(tmp_path))
    ckpts.save({"x": torch.ones(3)}, 1)
    assert ckpts.latest_key() == checkpoint_key(1) and torch.equal(ckpts.load(checkpoint_key(1))["x"], torch.ones(3))


def test_latest_key_without_pointer_takes_newest_complete_checkpoint(tmp_path):
    ckpts = CheckpointStore(f"file://{tmp_path}", keep=5)
    assert ckpts.latest_key() is None
    for step in (7, 8):
        ckpts.save({"x": torch.zeros(1)}, step)
    assert ckpts.latest_key() == checkpoint_key(8)
    (tmp_path / "latest").unlink()  # a crash between the checkpoint and its pointer
    assert ckpts.latest_key() == checkpoint_key(8)
    (tmp_path / "latest").write_text(json.dumps({"key": checkpoint_key(99)}))  # names a missing one
    assert ckpts.latest_key() == checkpoint_key(8)


def test_a_foreign_file_is_not_taken_for_a_checkpoint(tmp_path):
    torch.save({"model": {}}, tmp_path / checkpoint_key(1))
    with pytest.raises(ConfigError, match="not a dlstore training checkpoint"):
        CheckpointStore(f"file://{tmp_path}").load(checkpoint_key(1))


def test_a_resume_url_may_name_the_checkpoint_folder_or_its_latest_and_junk_says_so_in_a_line(tmp_path):
    """`--resume` given the checkpoint folder (the --checkpoint-url) was a bare 404, and given
    its `latest` pointer (JSON), or any other file, torch's page of unpickler advice ("Please
    file an issue", "weights_only=False will likely succeed"). The folder and its pointer now
    load the checkpoint published there; what is not a checkpoint says so in a line."""
    ckpts = CheckpointStore(f"file://{tmp_path}/run", keep=5)
    for step in (3, 4):
        ckpts.save({"x": torch.full((2,), float(step))}, step)
    for url in (f"file://{tmp_path}/run", f"file://{tmp_path}/run/", f"file://{tmp_path}/run/latest"):
        assert checkpoint_named(url) == (f"file://{tmp_path}/run", checkpoint_key(4)), url
        state, where = load_checkpoint_at(*checkpoint_named(url))
        assert torch.equal(state["x"], torch.full((2,), 4.0)) and where.endswith(checkpoint_key(4)), url
    assert torch.equal(load_checkpoint_url(f"file://{tmp_path}/run/{checkpoint_key(3)}")["x"], torch.full((2,), 3.0))
    (tmp_path / "junk.bin").write_bytes(b'{"key": "not a checkpoint"}')
    with pytest.raises(FormatError) as caught:
        load_checkpoint_url(f"file://{tmp_path}/junk.bin")
    assert "not a whole torch.save archive" in str(caught.value) and "\n" not in str(caught.value)
    assert "weights_only" not in str(caught.value)
    with pytest.raises(NotFound, match="no such object, and no checkpoint"):
        load_checkpoint_url(f"file://{tmp_path}/nothing-here")


# -- configuration, schedule, launch environment -------------------------------------------
def test_lr_schedule_warmup_then_cosine_or_step():
    cfg = TrainConfig("x", epochs=10, warmup_epochs=2, warmup_start_factor=0.1)
    assert lr_factor(0, cfg, 10, 100) == pytest.approx(0.1)
    assert lr_factor(10, cfg, 10, 100) == pytest.approx(0.55)
    assert lr_factor(20, cfg, 10, 100) == pytest.approx(1.0)
    assert lr_factor(60, cfg, 10, 100) == pytest.approx(0.5)
    assert lr_factor(100, cfg, 10, 100) == pytest.approx(0.0)
    step = cfg.replace(schedule="step", warmup_epochs=0, step_milestones=(3, 6), step_gamma=0.1)
    assert [lr_factor(s, step, 10, 100) for s in (0, 29, 30, 59, 60, 99)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])


def test_progressive_resizing_schedule():
    cfg = TrainConfig(DataConfig("x", image_size=224), resize_min=160, resize_start_epoch=10, resize_end_epoch=20)
    sizes = [image_size_for_epoch(cfg, e) for e in range(25)]
    assert sizes[:11] == [160] * 11 and sizes[20:] == [224] * 5
    assert sizes == sorted(sizes) and all(s % 32 == 0 for s in sizes)
    assert image_size_for_epoch(TrainConfig(DataConfig("x", image_size=64)), 7) == 64


def test_cli_arguments_build_the_config():
    args = build_parser().parse_args(
        [
            *("train", "swift://imagenet/train", "--val-url", "swift://imagenet/val", "--model", "resnet18"),
            *("--checkpoint-url", "swift://ckpt/run1", "--resume", "auto", "--no-channels-last", "--compile"),
            *("--step-milestones", "2", "4", "--batch-size", "64", "--base-lr", "0.2", "--decode-on", "device"),
        ]
    )
    cfg = config_from_args(args)
    assert cfg == TrainConfig(
        DataConfig.from_env("swift://imagenet/train", batch_size=64, decode_on="device"),
        val_url="swift://imagenet/val",
        model="resnet18",
        checkpoint_url="swift://ckpt/run1",
        resume="auto",
        channels_last=False,
        compile=True,
        step_milestones=(2, 4),
        base_lr=0.2,
    )
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_config_rejects_contradictions():
    with pytest.raises(ConfigError, match="checkpoint_url"):
        TrainConfig("x", resume="auto")
    with pytest.raises(ConfigError, match="amp"):
        TrainConfig("x", amp="fp8")
    with pytest.raises(ConfigError, match="resize_min"):
        TrainConfig(DataConfig("x", image_size=64), resize_min=128)
    with pytest.raises(ConfigError, match="decode_on"):
        TrainConfig(DataConfig("x", decode_on="gpu"))
    with pytest.raises(ConfigError, match="unknown"):
        TrainConfig.from_dict({"train_url": "x", "lr": 1})


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--base-lr", "-1"),
        ("--base-lr", "0"),
        ("--label-smoothing", "2"),
        ("--momentum", "1.5"),
        ("--weight-decay", "-1"),
        ("--warmup-epochs", "-1"),
        ("--warmup-start-factor", "-2"),
        ("--min-lr-factor", "3"),
        ("--step-gamma", "-1"),
        ("--dist-timeout-minutes", "0"),
    ],
)
def test_an_optimiser_setting_out_of_range_is_refused_before_the_run(flag, value, tmp_path, capsys):
    """`--base-lr -1` and `--label-smoothing 2` ended in torch's traceback at the first step;
    `--momentum 1.5`, a negative weight decay and the like trained with them. Each is now a
    one-line error naming the flag and its range, before the data is even opened."""
    args = ["train", f"file://{tmp_path}/no-data", "--output-dir", str(tmp_path / "out"), flag, value]
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert flag in err and "must be in" in err and "Traceback" not in err, err


def test_step_milestones_must_rise_for_the_step_schedule():
    with pytest.raises(ConfigError, match="--step-milestones .* rising order, not \\[5, 1\\]"):
        TrainConfig("x", schedule="step", step_milestones=(5, 1))
    # repeated (gamma twice), from 0, or unused by the cosine schedule (an old config.json): as they were
    for milestones, schedule in (((1, 5), "step"), ((3, 3), "step"), ((0,), "step"), ((5, 1), "cosine")):
        assert TrainConfig("x", schedule=schedule, step_milestones=milestones).step_milestones == milestones
    assert TrainConfig("x", warmup_start_factor=0).warmup_start_factor == 0  # warm-up from 0


def test_launch_env_from_torchrun_and_slurm():
    torchrun = Rendezvous.from_env(
        {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "n1",
         "MASTER_PORT": "1234", "TORCHELASTIC_RUN_ID": "x"}
    )  # fmt: skip
    assert (torchrun.world.rank, torchrun.world.world_size, torchrun.local_rank) == (5, 8, 1)
    assert (torchrun.master_addr, torchrun.master_port, torchrun.launcher) == ("n1", 1234, "torchrun")
    slurm = Rendezvous.from_env(
        {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2(x2)",
         "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242", "SLURM_STEP_NUM_TASKS": "4",
         "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    )  # fmt: skip
    assert (slurm.world.rank, slurm.world.world_size, slurm.world.local_world_size) == (3, 4, 2)
    assert (slurm.local_rank, slurm.master_addr, slurm.launcher) == (1, "gpu07", "slurm")
    assert slurm.master_port == 20000 + 4242
    assert Rendezvous.from_env({}).world.world_size == 1
    assert first_slurm_host("a-1,b-2") == "a-1"


def test_torchrun_restarts_over_a_shared_store_are_warned_of(caplog):
    """A torchrun that may restart its workers, with its store shared: rank 0 names the remedy."""
    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "1"}
    with caplog.at_level(logging.WARNING, logger="dlstore.train.dist"):
        assert warn_of_a_shared_store(shared, rank=0)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in caplog.text
    assert not warn_of_a_shared_store(shared, rank=1)
    assert not warn_of_a_shared_store({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"}, rank=0)
    assert not warn_of_a_shared_store({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}, rank=0)


def test_metrics_files_are_rebuilt_from_the_checkpoint_records(tmp_path):
    first = MetricsLog(str(tmp_path), tensorboard=True)
    first.start()
    for step in range(1, 6):
        first.write({"split": "train", "step": step, "epoch": 0, "loss": 1.0 / step})
    kept = first.records[:3]  # what a checkpoint at step 3 holds; steps 4 and 5 are lost
    first.close()
    again = MetricsLog(str(tmp_path), tensorboard=True)
    again.start(kept, resume_step=3)
    again.write({"split": "train", "step": 4, "epoch": 0, "loss": 0.2})
    again.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [
        (1, 1.0),
        (2, 0.5),
        (3, 1 / 3),
        (4, 0.2),
    ]
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("split,step,epoch,epoch_done,loss") and len(rows) == 5


@pytest.mark.slow
def test_measure_training_rate_times_the_training_step_on_cpu():
    result = measure_training_rate(
        "resnet18", batch_size=4, image_size=32, num_classes=10, device="cpu", warmup_steps=1, steps=2
    )
    assert result.device == "cpu" and result.precision == "float32" and result.steps == 2
    assert result.images_per_s == pytest.approx(4 * 2 / result.seconds)


@pytest.mark.parametrize("amp", ["bf16", "fp16", "none"])
def test_the_measured_precision_is_named_as_the_amp_flag_names_it(amp):
    """`--amp bf16` is reported as "bf16" (test_gpu checks it on CUDA, where "auto" is bf16)."""
    name = precision_name(amp_dtype_for(amp, torch.device("cpu")))
    assert name == {"none": "float32"}.get(amp, amp)


def test_measure_training_rate_reports_bf16_as_bf16_on_cpu():
    result = measure_training_rate(
        "resnet18", batch_size=2, image_size=32, num_classes=10, device="cpu", amp="bf16", warmup_steps=0, steps=1
    )
    assert result.precision == "bf16"


# -- batches with no samples ------------------------------------------------------------------
EMPTY_BATCH_DATA = dict(batch_size=4, seed=5, image_size=16, workers=1)


def _dataset_with_an_empty_batch(tmp_path: Path, world: World, sizes: list[int], batch: int) -> str:
    """A dataset of `sizes` shards in which every sample of the `batch`-th batch that `world`'s
    rank reads in epoch 0 is corrupt: that batch arrives empty. Which samples those are comes
    from a clean copy (the plan depends on the sample counts, the seed and the world only)."""
    clean = f"file://{tmp_path}/clean"
    write_dataset(open_store(clean), sizes)
    cfg = DataConfig(clean, cache_dir=str(tmp_path / "clean-cache"), return_keys=True, **EMPTY_BATCH_DATA)
    loader = dlstore.Loader(dlstore.Dataset(cfg, world=world), device="cpu")
    loader.set_epoch(0)
    keys = [meta["keys"] for _, _, meta in loader][batch]
    loader.close()
    url = f"file://{tmp_path}/data"
    write_dataset(open_store(url), sizes, corrupt_keys=frozenset(keys))
    return url


def _cpu_run(tmp_path: Path, url: str, *, return_keys: bool = False, **changes) -> TrainConfig:
    """A ResNet-18 run on the CPU over the small data of these tests, into tmp_path."""
    settings = dict(
        output_dir=str(tmp_path / "run"),
        model="resnet18",
        device="cpu",
        amp="none",
        epochs=1,
        log_every=1,
        checkpoint_url=f"file://{tmp_path}/ckpt",
        progress=False,
        tensorboard=False,
        warmup_epochs=0,
    )
    data = DataConfig(url, cache_dir=str(tmp_path / "cache"), return_keys=return_keys, **EMPTY_BATCH_DATA)
    return TrainConfig(data, **{**settings, **changes})


def _assert_finite_weights(checkpoint: Path) -> None:
    state = torch.load(checkpoint, weights_only=True, map_location="cpu")
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())


def test_a_batch_of_only_corrupt_samples_is_skipped_not_trained_on(tmp_path, caplog):
    """Its samples all corrupt, a batch arrives empty: cross-entropy over nothing is NaN, and
    so are BatchNorm's statistics of nothing. The step is skipped; the others train as usual."""
    url = _dataset_with_an_empty_batch(tmp_path, World(0, 1, 1), [4, 4, 4], batch=1)
    cfg = _cpu_run(tmp_path, url)
    assert main(cfg) == 0
    records = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["split"] == "train"]
    assert [(r["step"], r["samples"]) for r in records] == [(1, 4), (2, 4)]
    assert all(r["loss"] == r["loss"] for r in records)  # not NaN
    _assert_finite_weights(tmp_path / "ckpt" / checkpoint_key(2))
    assert "no samples" in caplog.text


def test_a_model_name_with_a_typo_is_refused_before_the_data_is_opened(tmp_path):
    cfg = _cpu_run(tmp_path, f"file://{tmp_path}/no-such-dataset/train", model="resnet5o")
    with pytest.raises(ConfigError, match="unknown model 'resnet5o'.*did you mean resnet50"):
        main(cfg)


def test_a_val_set_of_other_classes_is_refused_before_training(tmp_path):
    """A val set converted from another dataset (or another class list) would be evaluated
    against the wrong outputs: a crash after the first epoch, or a top-1 that means nothing."""
    train_url, val_url = f"file://{tmp_path}/train", f"file://{tmp_path}/val"
    write_dataset(open_store(train_url), [8])
    write_dataset(open_store(val_url), [8])
    val_store = open_store(val_url)
    manifest = Manifest.load(val_store)
    dataclasses.replace(manifest, classes=tuple(reversed(manifest.classes))).save(val_store)
    cfg = _cpu_run(tmp_path, train_url, val_url=val_url)
    with pytest.raises(ConfigError, match=r"other classes than the training set.*label 0 is 'class0' in training"):
        main(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not read_metrics(
        str(tmp_path / "run" / "metrics.jsonl")
    )


def test_a_run_stopped_by_max_steps_mid_epoch_goes_on_when_resumed_with_more(tmp_path):
    """`--max-steps 2` stops in the middle of epoch 0 (6 steps); resumed without it, the run
    trains that epoch's other 4 batches, then epoch 1. It used to count the cut epoch as done
    and the run as finished: 'nothing to do', whatever the new settings."""
    url, val_url = f"file://{tmp_path}/data", f"file://{tmp_path}/val"
    write_dataset(open_store(url), [8, 8, 8])
    write_dataset(open_store(val_url), [8])
    cfg = _cpu_run(tmp_path, url, return_keys=True, epochs=2, max_steps=2, val_url=val_url)
    assert main(cfg) == 0
    assert main(dataclasses.replace(cfg, max_steps=2, resume="auto")) == 0  # the same settings: done
    assert main(dataclasses.replace(cfg, max_steps=None, resume="auto")) == 0
    records = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["split"] == "train"]
    assert [(r["epoch"], r["step"]) for r in records] == [(0, s) for s in range(1, 7)] + [(1, s) for s in range(7, 13)]
    assert sum(r["samples"] for r in records) == 2 * 24  # every sample once in each epoch
    # The cut epoch was scored at the cut and again when finished: the records say which is its.
    val = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["split"] == "val"]
    assert [(r["epoch"], r["step"], r["epoch_done"]) for r in val] == [(0, 2, False), (0, 6, True), (1, 12, True)]
    # The finished run, started again (a requeue, the same command): nothing to do, no epoch again.
    assert main(dataclasses.replace(cfg, max_steps=None, resume="auto")) == 0
    assert read_metrics(str(tmp_path / "run" / "metrics.jsonl")) == read_metrics(
        str(tmp_path / "ckpt" / "metrics.jsonl")
    )
    assert len([r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["split"] == "train"]) == 12


def test_sigterm_during_evaluation_then_resume_matches_an_uninterrupted_run(tmp_path, monkeypatch):
    """A stop at an epoch boundary (SIGTERM while the epoch is evaluated): the checkpoint must
    place the run at the next epoch, where its loader already is. Once it said the epoch it had
    finished, and the resumed run trained that epoch again."""
    url, val_url = f"file://{tmp_path}/data", f"file://{tmp_path}/val"
    write_dataset(open_store(url), [8, 8, 8])
    write_dataset(open_store(val_url), [8])
    whole = _cpu_run(tmp_path / "whole", url, val_url=val_url, epochs=2)
    assert main(whole) == 0
    cut = _cpu_run(tmp_path / "cut", url, val_url=val_url, epochs=2)
    real_evaluate = Trainer._evaluate

    def signalled_during_the_first(self, epoch, *args):
        if epoch == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # handled at the next step boundary: the epoch's end
        return real_evaluate(self, epoch, *args)

    with monkeypatch.context() as patched:
        patched.setattr(Trainer, "_evaluate", signalled_during_the_first)
        assert main(cut) == EXIT_PREEMPTED
    assert main(dataclasses.replace(cut, resume="auto")) == 0
    assert train_records(tmp_path / "cut" / "run" / "metrics.jsonl") == train_records(
        tmp_path / "whole" / "run" / "metrics.jsonl"
    )


@pytest.mark.parametrize("broken", [0, 1])
def test_a_group_sigterm_that_ends_the_val_workers_still_checkpoints_and_the_resume_evaluates(
    tmp_path, monkeypatch, broken
):
    """Slurm signals every process of the job: with worker processes, the val loader's workers
    died of the SIGTERM too, and the run crashed in evaluation ("DataLoader worker exited
    unexpectedly"), with no checkpoint and exit 1, so it was not requeued. Now it checkpoints and
    exits 75, and the resumed run evaluates the broken-off epoch first: records as one run's.
    The last epoch's too (1 of 0-1): its checkpoint is of a finished run, and the resume said
    "nothing to do", without that evaluation."""
    import multiprocessing

    url, val_url = f"file://{tmp_path}/data", f"file://{tmp_path}/val"
    write_dataset(open_store(url), [8, 8, 8])
    write_dataset(open_store(val_url), [8] * 6)  # 12 val batches: more than the workers build ahead
    settings = dict(val_url=val_url, epochs=2, engine="processes")
    whole = _cpu_run(tmp_path / "whole", url, **settings)
    assert main(whole) == 0
    cut = _cpu_run(tmp_path / "cut", url, **settings)
    real_evaluate = Trainer._evaluate

    def group_sigterm_during_the_first(self, epoch, *args):
        if epoch != broken or getattr(self, "_signalled", False):
            return real_evaluate(self, epoch, *args)
        self._signalled = True
        val_loader = self.val_loader

        class SignalledAfterOneBatch:
            def __getattr__(self, name):
                return getattr(val_loader, name)

            def __iter__(self):
                batches = iter(val_loader)
                yield next(batches)
                os.kill(os.getpid(), signal.SIGTERM)
                for worker in multiprocessing.active_children():  # the rest of the process group
                    os.kill(worker.pid, signal.SIGTERM)
                yield from batches

        self.val_loader = SignalledAfterOneBatch()
        try:
            return real_evaluate(self, epoch, *args)
        finally:
            self.val_loader = val_loader

    with monkeypatch.context() as patched:
        patched.setattr(Trainer, "_evaluate", group_sigterm_during_the_first)
        assert main(cut) == EXIT_PREEMPTED
    assert main(dataclasses.replace(cut, resume="auto")) == 0

    def records(run: Path) -> list[tuple]:
        kept = ("split", "step", "epoch", "loss", "top1", "samples")
        return [tuple(r.get(k) for k in kept) for r in read_metrics(str(run / "run" / "metrics.jsonl"))]

    assert records(tmp_path / "cut") == records(tmp_path / "whole")
    assert sum(r[0] == "val" for r in records(tmp_path / "whole")) == 2


def test_a_group_sigterm_that_ends_the_training_workers_still_checkpoints_and_loses_nothing(tmp_path, monkeypatch):
    """Slurm signals every process of the job: with worker processes, the training loader's
    workers died of the SIGTERM too, and a rank waiting for its next batch then crashed on
    "DataLoader worker exited unexpectedly", with no checkpoint and exit 1 (not requeued).
    Now the ranks stop together, checkpoint before that step, and exit 75; the resumed run's
    records are an uninterrupted run's."""
    import multiprocessing

    url = f"file://{tmp_path}/data"
    write_dataset(open_store(url), [8, 8, 8])
    settings = dict(epochs=2, engine="processes")
    whole = _cpu_run(tmp_path / "whole", url, **settings)
    assert main(whole) == 0
    cut = _cpu_run(tmp_path / "cut", url, **settings)
    real_train_epoch = Trainer._train_epoch

    def group_sigterm_while_waiting_for_the_third_batch(self, epoch, *args):
        if epoch != 0:
            return real_train_epoch(self, epoch, *args)
        train_loader = self.train_loader

        class WorkersEndedAfterTwoBatches:
            def __getattr__(self, name):
                return getattr(train_loader, name)

            def __setattr__(self, name, value):
                setattr(train_loader, name, value)

            def __len__(self):
                return len(train_loader)

            def __iter__(self):
                batches = iter(train_loader)
                yield next(batches)
                yield next(batches)
                os.kill(os.getpid(), signal.SIGTERM)
                workers = multiprocessing.active_children()  # the rest of the process group
                for worker in workers:
                    os.kill(worker.pid, signal.SIGTERM)
                for worker in workers:
                    worker.join(10)
                # What the wait for the next batch then raises (the DataLoader's own check,
                # which comes only after its batches built ahead run out).
                raise RuntimeError(f"DataLoader worker (pid(s) {workers[0].pid}) exited unexpectedly")

        self.train_loader = WorkersEndedAfterTwoBatches()
        try:
            return real_train_epoch(self, epoch, *args)
        finally:
            self.train_loader = train_loader

    with monkeypatch.context() as patched:
        patched.setattr(Trainer, "_train_epoch", group_sigterm_while_waiting_for_the_third_batch)
        assert main(cut) == EXIT_PREEMPTED
    saved = torch.load(tmp_path / "cut" / "ckpt" / checkpoint_key(2), weights_only=True)
    assert saved["step"] == 2 and saved["loader"]["history"][0]["steps"] == 2
    assert main(dataclasses.replace(cut, resume="auto")) == 0

    def records(run: Path) -> list[tuple]:
        kept = ("split", "step", "epoch", "loss", "samples")
        return [tuple(r.get(k) for k in kept) for r in read_metrics(str(run / "run" / "metrics.jsonl"))]

    assert records(tmp_path / "cut") == records(tmp_path / "whole")


def test_a_run_resumed_from_another_runs_checkpoint_does_not_say_its_own_store_holds_it(tmp_path, caplog, monkeypatch):
    """Resumed from a checkpoint outside --checkpoint-url, a stop at that same step wrote
    nothing there and said "after a checkpoint" (Ctrl-C: "the last checkpoint is step 4 in
    ..."), and `--resume auto` then started afresh."""
    url = f"file://{tmp_path}/data"
    write_dataset(open_store(url), [8, 8, 8])
    first = _cpu_run(tmp_path / "a", url, max_steps=4)
    assert main(first) == 0
    other = f"file://{tmp_path}/a/ckpt/{checkpoint_key(4)}"
    second = _cpu_run(tmp_path / "b", url, max_steps=6, resume=other)

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "_train", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(second)
    # It has a --checkpoint-url: "(--checkpoint-url, ...)" read as if it were missing.
    assert "no checkpoint was written to file://" in caplog.text and "--checkpoint-every-minutes)" in caplog.text
    assert "the last checkpoint is step 4" not in caplog.text


def test_resume_auto_goes_back_past_a_checkpoint_that_cannot_be_read(tmp_path, caplog):
    """The newest checkpoint cut short (a damaged disk, a store without atomic puts): every
    requeue failed on torch's own error, naming no file. Now it is named, and the one before
    it is loaded; an explicit --resume of it says which file."""
    url = f"file://{tmp_path}/data"
    write_dataset(open_store(url), [8, 8, 8])
    cfg = _cpu_run(tmp_path, url, max_steps=4, checkpoint_every_steps=2)
    assert main(cfg) == 0
    newest = tmp_path / "ckpt" / checkpoint_key(4)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    assert main(dataclasses.replace(cfg, max_steps=6, resume="auto")) == 0
    assert f"checkpoint file://{tmp_path}/ckpt/{checkpoint_key(4)} cannot be read" in caplog.text
    records = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["split"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # on from step 2's checkpoint
    newest.write_bytes(newest.read_bytes()[:1000])  # the resumed run wrote step 4 again: cut it once more
    with pytest.raises(FormatError, match=f"checkpoint file://{newest} cannot be read"):
        load_checkpoint_url(f"file://{newest}")


def test_resume_auto_goes_back_past_a_flipped_bit_and_a_latest_that_names_no_checkpoint(tmp_path, caplog):
    """A bit flipped in the newest checkpoint's weights loaded silently (torch.load checks no
    CRC), and a `latest` naming "../x" or a number ended the resume with a raw error. Both now
    send the resume to the checkpoint before."""
    url = f"file://{tmp_path}/data"
    write_dataset(open_store(url), [8, 8, 8])
    cfg = _cpu_run(tmp_path, url, max_steps=4, checkpoint_every_steps=2)
    assert main(cfg) == 0
    ckpt = tmp_path / "ckpt"
    newest = ckpt / checkpoint_key(4)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside the weights, far from the zip's headers
    newest.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="fails its checksum"):
        load_checkpoint_url(f"file://{newest}")
    for named in ("../x", 5, "config.json"):
        (ckpt / "latest").write_text(json.dumps({"key": named}))
        store = CheckpointStore(open_store(f"file://{ckpt}"))
        key, state = store.newest_loadable()
        assert key == checkpoint_key(2) and state["step"] == 2, named
    assert main(dataclasses.replace(cfg, max_steps=6, resume="auto")) == 0
    records = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["split"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # on from step 2's checkpoint


def test_resume_auto_goes_back_past_a_checkpoint_that_lost_a_segment(
    swift_server, swift_container, monkeypatch, caplog
):
    """A checkpoint stored as a Swift static large object whose segment is gone (deleted by
    hand, expired) answers 409 Conflict: the resume stopped there with the bare 'HTTP 409',
    instead of taking the checkpoint before it."""
    for name, value in swift_server.swift_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DLSTORE_SEGMENT_SIZE", str(2**20))
    ckpts = CheckpointStore(f"swift://{swift_container}/segments-lost")
    for step in (1, 2):
        ckpts.save({"model": {"w": torch.full((2**19,), float(step))}}, step)  # 2 MiB: 3 segments
    segments = open_store(f"swift://{ckpts.store.segment_container}")
    newest = sorted(info.key for info in segments.list() if f"/{checkpoint_key(2)}/" in info.key)
    assert len(newest) == 3
    for lost in newest[1:]:  # the second (the body breaks off) and the third
        segments.delete(lost)
        key, state = CheckpointStore(f"swift://{swift_container}/segments-lost").newest_loadable()
        assert key == checkpoint_key(1) and float(state["model"]["w"][0]) == 1.0
        assert "a large object whose segments are missing" in caplog.text
    with pytest.raises(FormatError, match="409"):
        load_checkpoint_url(f"swift://{swift_container}/segments-lost/{checkpoint_key(2)}")


def test_a_checkpoint_container_deleted_during_the_run_is_made_again(swift_server, monkeypatch, caplog):
    """The checkpoint container deleted during a run (by hand, a clean-up script): the next
    checkpoint ended the run with "container does not exist; create it with `swift post`",
    though the run makes its container itself. It makes it again and the checkpoint is kept."""
    for name, value in swift_server.swift_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DLSTORE_SEGMENT_SIZE", str(2**20))
    container = f"ckpt-gone-{uuid.uuid4().hex[:8]}"
    ckpts = CheckpointStore(f"swift://{container}/run", keep=5)
    ckpts.save({"model": {"w": torch.full((2**19,), 1.0)}}, 1)  # 2 MiB: a large object, with segments
    conn = swift_server.swift_connection()
    for name in (container, ckpts.store.segment_container):
        for obj in conn.get_container(name, full_listing=True)[1]:
            conn.delete_object(name, obj["name"])
        conn.delete_container(name)
    for step in (2, 3):  # a large object and a small one
        ckpts.save({"model": {"w": torch.full((2**19,) if step == 2 else (4,), float(step))}}, step)
    assert "is gone (deleted during the run?): making it again" in caplog.text
    assert ckpts.keys() == [checkpoint_key(2), checkpoint_key(3)]
    assert float(ckpts.load(checkpoint_key(2))["model"]["w"][0]) == 2.0
    assert ckpts.newest_loadable()[0] == checkpoint_key(3)


_KILLED_SAVE = """
import sys, time
from dlstore.storage import open_store

class Endless:  # a checkpoint being written: its size not known up front, so it goes in parts
    def read(self, size=-1):
        time.sleep(0.05)
        return bytes(max(size, 0) or 2**20)

open_store(sys.argv[1]).put("ckpt-000000005.pt", Endless())
"""


@pytest.mark.parametrize("api", ["swift", "s3"])
def test_the_parts_a_killed_checkpoint_upload_left_are_removed_by_a_later_save(
    swift_server, swift_container, monkeypatch, api
):
    """A save killed mid-upload (kill -9, a lost node) left its S3 multipart parts or Swift
    segments in the store for good, a checkpoint's size each time. A later save's pruning
    removes the leftovers of uploads begun over an hour ago (here: any), and keeps the
    segments that checkpoints name."""
    env = swift_server.swift_env() if api == "swift" else swift_server.s3_env()
    env = {**env, "DLSTORE_SEGMENT_SIZE": str(2**20 if api == "swift" else 5 * 2**20)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    url = f"{api}://{swift_container}/killed-{api}"
    ckpts = CheckpointStore(url)
    ckpts.save({"model": {"w": torch.full((2**20,), 1.0)}}, 1)  # 4 MiB: in parts on Swift, kept

    def leftovers() -> int:
        if api == "swift":
            segments = open_store(f"swift://{ckpts.store.segment_container}/killed-{api}")
            return sum(1 for info in segments.list() if info.key.startswith("ckpt-000000005.pt/"))
        client, bucket = ckpts.store.client, swift_container
        uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=f"killed-{api}/").get("Uploads", [])
        return sum(
            len(client.list_parts(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"]).get("Parts", []))
            for u in uploads
        )

    writer = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, url], env={**os.environ, **env})
    try:
        deadline = time.monotonic() + 120
        while leftovers() < 2:
            assert writer.poll() is None and time.monotonic() < deadline, "the upload never got going"
            time.sleep(0.2)
    finally:
        writer.kill()
        writer.wait()
    assert leftovers() >= 2
    monkeypatch.setattr(CheckpointStore, "abandoned_after_s", 0.0)
    time.sleep(1.5)  # S3's times are rounded up to the second (Swift's s3api): the upload is older than now
    ckpts.save({"model": {"w": torch.full((4,), 2.0)}}, 2)
    assert leftovers() == 0
    assert ckpts.keys() == [checkpoint_key(1), checkpoint_key(2)]
    assert float(ckpts.load(checkpoint_key(1))["model"]["w"][0]) == 1.0  # its segments kept


def test_a_checkpoint_url_with_credentials_is_named_without_them(tmp_path):
    """A --resume URL's password or presigned signature was printed whole in the error (and
    the "resumed from" line)."""
    from tests.storage.test_storage_edges import http_server

    with http_server() as server:  # it serves bytes that are no checkpoint
        parts = server["url"].split("://", 1)
        url = f"{parts[0]}://alice:hunter2@{parts[1]}/ckpt-000000008.pt?X-Amz-Signature=SECRETSIG"
        with pytest.raises(FormatError) as caught:
            load_checkpoint_url(url)
    assert "hunter2" not in str(caught.value) and "SECRETSIG" not in str(caught.value)
    assert "alice:***@" in str(caught.value)


def test_a_resume_urls_credentials_stay_out_of_the_saved_configs(tmp_path, caplog):
    """A --resume URL's password and presigned signature were kept whole in the run's
    config.json, in every checkpoint's config and in the config's repr."""
    url = f"file://{tmp_path}/data"
    write_dataset(open_store(url), [8, 8, 8])
    first = _cpu_run(tmp_path / "first", url, max_steps=2)
    assert main(first) == 0
    caplog.set_level("INFO", logger="dlstore.train")

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(tmp_path / "first" / "ckpt"))
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            resume = (
                f"http://alice:hunter2@127.0.0.1:{server.server_port}/{checkpoint_key(2)}?X-Amz-Signature=SECRETSIG"
            )
            cfg = _cpu_run(tmp_path / "second", url, max_steps=3, resume=resume)
            assert main(cfg) == 0
        finally:
            server.shutdown()
    checkpoint = torch.load(tmp_path / "second" / "ckpt" / checkpoint_key(3), weights_only=True)
    saved = [(tmp_path / "second" / "run" / "config.json").read_text(), json.dumps(checkpoint["config"]), repr(cfg)]
    for text in saved:
        assert "hunter2" not in text and "SECRETSIG" not in text
        assert "alice:***@127.0.0.1" in text  # still says where it resumed from
    assert "resumed from http://alice:***@127.0.0.1" in caplog.text and "step 2" in caplog.text


@pytest.mark.parametrize("cut", ["epochs", "max_steps"])
def test_a_checkpoint_due_at_the_runs_last_step_is_written_once(tmp_path, caplog, cut):
    """A save due at the run's last step (every 3 steps, 6 in all) was written, and then the
    run's final one, of the same step, again: a second upload of the whole checkpoint. The
    final one alone is written now, and a resume from it finds the run finished."""
    url = f"file://{tmp_path}/data"
    write_dataset(open_store(url), [8, 8, 8])  # 6 batches of 4 an epoch
    limits = dict(epochs=1) if cut == "epochs" else dict(epochs=3, max_steps=6)
    run = _cpu_run(tmp_path, url, checkpoint_every_steps=3, checkpoint_every_minutes=0, **limits)
    with caplog.at_level(logging.INFO, logger="dlstore.train"):
        assert main(run) == 0
    written = re.findall(r"checkpoint \S+/(ckpt-\d+\.pt) \([\d.]+ MB\) written", caplog.text)
    assert written == [checkpoint_key(3), checkpoint_key(6)], written
    assert torch.load(tmp_path / "ckpt" / checkpoint_key(6), weights_only=True)["finished"]


def _two_ranks_checkpoint_at_epoch_1(tmp_path: Path, url: str) -> TrainConfig:
    """A one-rank run of 2 epochs of 6 steps whose only checkpoint is as 2 ranks would have
    saved it at the end of epoch 0: 3 steps, their scheduler at step 3, one entry per rank, and
    twice the peak rate (the linear scaling rule for their global batch of 8)."""
    first = _cpu_run(tmp_path, url, epochs=2, warmup_epochs=0.5, max_steps=6)
    assert main(first) == 0  # one rank: epoch 0 in 6 steps, the loader at epoch 1's start
    ckpt = tmp_path / "ckpt" / checkpoint_key(6)
    state = torch.load(ckpt, weights_only=True)
    state.update(step=3, world_size=2, ranks=state["ranks"] * 2, finished=False)
    state["scheduler"]["last_epoch"] = state["scheduler"]["_step_count"] = 3
    state["scheduler"]["base_lrs"] = [2 * lr for lr in state["scheduler"]["base_lrs"]]
    for group in state["optimizer"]["param_groups"]:
        group["lr"], group["initial_lr"] = 2 * group["lr"], 2 * group["initial_lr"]
    torch.save(state, tmp_path / "ckpt" / checkpoint_key(3))
    ckpt.unlink()
    (tmp_path / "ckpt" / "latest").unlink()
    return first


def _train_lrs(run: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_metrics(str(run / "run" / "metrics.jsonl")) if r["split"] == "train"}


def test_a_resume_with_another_model_is_refused_saying_which(tmp_path):
    """Resumed with another --model, the run ended in load_state_dict's raw traceback (hundreds
    of missing and unexpected keys)."""
    url = f"file://{tmp_path}/data"
    write_dataset(open_store(url), [8, 8, 8])
    cfg = _cpu_run(tmp_path, url, max_steps=2)
    assert main(cfg) == 0
    with pytest.raises(ConfigError, match="holds a resnet18, this run builds a resnet34: resume with --model resnet18"):
        main(dataclasses.replace(cfg, model="resnet34", max_steps=4, resume="auto"))


def test_a_resume_with_more_steps_trains_its_first_step_at_the_new_schedules_rate(tmp_path):
    """Resumed with a larger --max-steps (or more --epochs), the first step ran at the rate the
    old schedule had set for its end (0 for a cosine), not at the new schedule's."""
    url = f"file://{tmp_path}/data"
    write_dataset(open_store(url), [8, 8, 8])
    straight = _cpu_run(tmp_path / "straight", url, epochs=2, warmup_epochs=0.5, max_steps=8)
    assert main(straight) == 0
    cut = _cpu_run(tmp_path / "cut", url, epochs=2, warmup_epochs=0.5, max_steps=4)
    assert main(cut) == 0
    assert main(dataclasses.replace(cut, max_steps=8, resume="auto")) == 0
    lrs = _train_lrs(tmp_path / "cut")
    assert lrs[5] > 0  # it was 0: the rate the old schedule set after its last step
    assert [lrs[step] for step in (5, 6, 7, 8)] == pytest.approx(
        [_train_lrs(tmp_path / "straight")[s] for s in (5, 6, 7, 8)]
    )


def test_a_resume_with_another_base_lr_momentum_or_weight_decay_trains_with_them(tmp_path):
    """The optimiser's saved settings won over the resumed run's: with another --base-lr the
    run went on at the old peak, with another --momentum or --weight-decay at the old ones,
    though the run warned of the change as taken."""
    url = f"file://{tmp_path}/data"
    write_dataset(open_store(url), [8, 8, 8])
    new = dict(base_lr=0.2, momentum=0.8, weight_decay=1e-4)
    straight = _cpu_run(tmp_path / "straight", url, epochs=2, warmup_epochs=0.5, max_steps=8, **new)
    assert main(straight) == 0
    cut = _cpu_run(tmp_path / "cut", url, epochs=2, warmup_epochs=0.5, max_steps=4)
    assert main(cut) == 0
    assert main(dataclasses.replace(cut, max_steps=8, resume="auto", **new)) == 0
    want, got = _train_lrs(tmp_path / "straight"), _train_lrs(tmp_path / "cut")
    assert [got[step] for step in range(5, 9)] == pytest.approx([want[step] for step in range(5, 9)])
    groups = torch.load(tmp_path / "cut" / "ckpt" / checkpoint_key(8), weights_only=True)["optimizer"]["param_groups"]
    assert {g["momentum"] for g in groups} == {0.8} and {g["weight_decay"] for g in groups} == {1e-4, 0.0}


def test_a_second_resume_after_a_world_size_change_keeps_the_schedules_shift(tmp_path):
    """Resumed on another number of ranks, the schedule stands ahead of the run's step count
    (it goes on where the data is), and --max-steps, which counts the run's steps, ends it that
    much later. The shift was not saved: resumed once more, the schedule ended at --max-steps
    of the scheduler's own count, behind where it stood, and the rates broke off."""
    url = f"file://{tmp_path}/data"
    write_dataset(open_store(url), [8, 8, 8])
    straight = _two_ranks_checkpoint_at_epoch_1(tmp_path / "straight", url)
    assert main(dataclasses.replace(straight, max_steps=7, resume="auto")) == 0  # steps 4 to 7 at once
    twice = _two_ranks_checkpoint_at_epoch_1(tmp_path / "twice", url)
    assert main(dataclasses.replace(twice, max_steps=5, resume="auto")) == 0
    assert main(dataclasses.replace(twice, max_steps=7, resume="auto")) == 0  # steps 6 and 7
    want, got = _train_lrs(tmp_path / "straight"), _train_lrs(tmp_path / "twice")
    assert want[7] > 0
    assert [got[6], got[7]] == pytest.approx([want[6], want[7]])


def test_a_resume_with_another_batch_size_goes_on_with_the_schedule_where_the_data_is(tmp_path):
    """Resumed with twice the batch size, the scheduler stood at the saved step count (3 steps
    of batch 4) in a schedule of batch 8's steps, at the old peak: the rate fell to 0 two steps
    before the data ended. It goes on from the data's place (12 samples: step 1 of 6, rounded
    down) at the new global batch's peak, as the uninterrupted run of batch 8 does."""
    url = f"file://{tmp_path}/data"
    write_dataset(open_store(url), [8, 8, 8])
    straight = _cpu_run(tmp_path / "straight", url, epochs=2, warmup_epochs=0.5)
    assert main(dataclasses.replace(straight, data=straight.data.replace(batch_size=8))) == 0
    cut = _cpu_run(tmp_path / "cut", url, epochs=2, warmup_epochs=0.5, max_steps=3)
    assert cut.data.batch_size == 4
    assert main(cut) == 0
    assert main(dataclasses.replace(cut, data=cut.data.replace(batch_size=8), max_steps=None, resume="auto")) == 0
    want, got = _train_lrs(tmp_path / "straight"), _train_lrs(tmp_path / "cut")
    # Resumed steps 4 to 8 (8 and 4 samples to end epoch 0, then 3 of 8) at positions 1 to 5.
    assert [got[step] for step in range(4, 9)] == pytest.approx([want[step] for step in range(2, 7)])


def test_a_checkpoint_of_another_world_size_goes_on_with_the_schedule_where_the_data_is(tmp_path, caplog):
    """A checkpoint 2 ranks wrote at the end of epoch 0 (3 steps of 2 x 4 samples), resumed on
    one rank (6 steps an epoch): its step 3 is mid-epoch 0 of this world's schedule, whose
    learning rate then rose again and ended before the data did. It goes on from the data's
    place, at this world's peak: the learning rates are an uninterrupted one-rank run's."""
    url = f"file://{tmp_path}/data"
    write_dataset(open_store(url), [8, 8, 8])
    whole = _cpu_run(tmp_path / "whole", url, epochs=2, warmup_epochs=0.5)
    assert main(whole) == 0
    first = _two_ranks_checkpoint_at_epoch_1(tmp_path / "cut", url)
    assert main(dataclasses.replace(first, max_steps=None, resume="auto")) == 0
    resumed = [r["lr"] for r in read_metrics(str(tmp_path / "cut" / "run" / "metrics.jsonl")) if r["split"] == "train"]
    uninterrupted = [r["lr"] for r in read_metrics(str(tmp_path / "whole" / "run" / "metrics.jsonl"))
                     if r["split"] == "train" and r["epoch"] == 1]  # fmt: skip
    assert resumed[-6:] == pytest.approx(uninterrupted)
    assert "resumed on 1 of batch 4: the learning-rate schedule goes on from step 6 of this world's 12" in caplog.text


def test_a_checkpoint_of_another_world_size_keeps_its_partial_metrics_window(tmp_path):
    """A checkpoint at step 2 of a 4-step log window, as 2 ranks would have saved it (each rank
    half the window's sums), resumed on one rank: the step-4 record counts the samples of all 4
    steps, as an uninterrupted run's does. The saved windows were dropped: steps 1-2 were in no
    record."""
    url = f"file://{tmp_path}/data"
    write_dataset(open_store(url), [8, 8, 8])
    whole = _cpu_run(tmp_path / "whole", url, log_every=4, max_steps=4)
    assert main(whole) == 0
    first = _cpu_run(tmp_path / "cut", url, log_every=4, max_steps=3, checkpoint_every_steps=2)
    assert main(first) == 0
    (tmp_path / "cut" / "ckpt" / checkpoint_key(3)).unlink()  # as if stopped between steps 2 and 3
    (tmp_path / "cut" / "ckpt" / "latest").unlink()
    ckpt = tmp_path / "cut" / "ckpt" / checkpoint_key(2)
    state = torch.load(ckpt, weights_only=True)
    rank = state["ranks"][0]
    assert rank["window"]["samples"] == 8 and rank["window"]["steps"] == 2
    half = {**rank["window"], "loss_sum": rank["window"]["loss_sum"] / 2, "correct": rank["window"]["correct"] / 2}
    half["samples"] = 4
    state.update(world_size=2, ranks=[{**rank, "window": half}, {**rank, "window": dict(half)}])
    torch.save(state, ckpt)
    assert main(dataclasses.replace(first, max_steps=4, resume="auto")) == 0
    train = [r for r in read_metrics(str(tmp_path / "cut" / "run" / "metrics.jsonl")) if r["split"] == "train"]
    expected = [r for r in read_metrics(str(tmp_path / "whole" / "run" / "metrics.jsonl")) if r["split"] == "train"]
    assert [(r["step"], r["samples"]) for r in train] == [(r["step"], r["samples"]) for r in expected] == [(4, 16)]


def test_a_data_urls_credentials_stay_out_of_the_saved_configs(tmp_path):
    """The val split found beside a data URL with a password was written whole into both
    config.json files (the resolved settings' val_url)."""
    root = tmp_path / "served"
    for split in ("train", "val"):
        write_dataset(open_store(f"file://{root}/{split}"), [8, 8, 8])

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root))) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            url = f"http://alice:hunter2@127.0.0.1:{server.server_port}/train"  # the val split found beside it
            cfg = _cpu_run(tmp_path, url, max_steps=1)
            assert main(cfg) == 0
        finally:
            server.shutdown()
    saved = [(tmp_path / "run" / "config.json").read_text(), (tmp_path / "ckpt" / "config.json").read_text()]
    saved.append(json.dumps(torch.load(tmp_path / "ckpt" / checkpoint_key(1), weights_only=True)["config"]))
    for text in saved:
        assert "hunter2" not in text
        assert "alice:***@127.0.0.1" in text
    assert "/val" in saved[0]  # the val split was found and used


@pytest.mark.torchrun
@pytest.mark.parametrize(
    "other", [["--batch-size", "4"], ["--seed", "1"], ["--log-every", "1"], ["--checkpoint-every-steps", "1"]]
)
def test_ranks_launched_with_other_settings_all_stop_at_once_saying_which(tmp_path, other):
    """Rank 1 with another batch size made both ranks hang until the collective timeout (30
    minutes by default); with another seed, some samples were read twice an epoch and others
    never, silently; another --log-every or --checkpoint-every-steps hung too (a rank alone in
    a log line's all-reduce or a checkpoint's). Every rank now stops before training, and rank
    1 names the setting."""
    url = f"file://{tmp_path}/data"
    write_dataset(open_store(url), [8, 8, 8])
    args = [
        *(url, "--model", "resnet18", "--image-size", "16", "--batch-size", "8", "--epochs", "1"),
        *("--log-every", "10", "--checkpoint-url", f"file://{tmp_path}/ckpt"),
        *("--workers", "0", "--device", "cpu", "--amp", "none", "--no-progress", "--no-tensorboard"),
        *("--cache-dir", str(tmp_path / "cache"), "--output-dir", str(tmp_path / "out")),
        *("--dist-timeout-minutes", "2"),
    ]
    log_dir = tmp_path / "logs"
    codes = wait_all(launch_ranks(args, 2, log_dir, child_env(), rank_args={1: other}), log_dir, timeout=100)
    assert all(code != 0 for code in codes), logs(log_dir)
    name = other[0].removeprefix("--").replace("-", "_")
    rank1 = (log_dir / "rank1.log").read_text()
    assert f"rank 1 runs with other settings than rank 0: {name}=" in rank1, logs(log_dir)
    assert "1 rank(s) run with other settings than rank 0" in (log_dir / "rank0.log").read_text(), logs(log_dir)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_during_start_up_ends_the_run_saying_so(tmp_path, sig):
    """A SIGTERM or SIGUSR1 before the training loop had installed its handlers (opening the
    data, building the model, loading a checkpoint) ended `dlstore train` where it stood, with
    exit 143 or 138 and not a word. It now ends start-up at once, says so, and exits 75 (run it
    again): there is nothing to save yet."""
    asked, release = threading.Event(), threading.Event()

    class Stalling(BaseHTTPRequestHandler):  # the data's store, answering nothing for now
        def do_GET(self) -> None:
            asked.set()
            release.wait(60)
            self.send_error(404)

        do_HEAD = do_GET

        def log_message(self, *args) -> None:
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), Stalling) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        command = [sys.executable, "-m", "dlstore", "train", f"http://127.0.0.1:{server.server_port}/data"]
        command += ["--model", "resnet18", "--device", "cpu", "--cache-dir", str(tmp_path / "cache")]
        command += ["--output-dir", str(tmp_path / "out"), "--no-progress", "--no-tensorboard"]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
        try:
            assert asked.wait(60), "the run never asked for its data"
            process.send_signal(sig)
            _, stderr = process.communicate(timeout=30)
        finally:
            release.set()
            process.kill()
            server.shutdown()
    assert process.returncode == EXIT_PREEMPTED, stderr[-3000:]
    assert f"stopped by {sig.name} during start-up" in stderr and "Traceback" not in stderr, stderr[-3000:]


def _running(pid: int) -> bool:
    """Whether process `pid` runs: not gone, nor a zombie (a container's PID 1 may not reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _children_of(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                children.append(int(entry.name))
    return children


@pytest.mark.torchrun
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_ranks_whose_torchrun_agent_is_killed_checkpoint_and_stop(tmp_path):
    """A torchrun agent killed with SIGKILL (by hand, by the OOM killer) left its ranks training
    and checkpointing on their own, for the whole run. Each rank now gets SIGTERM when the agent
    goes: the ranks checkpoint together and exit."""
    url = f"file://{tmp_path}/data"
    write_dataset(open_store(url), [8, 8, 8])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "dlstore", "train", url, "--model", "resnet18", "--image-size", "16", "--batch-size", "4"]
    command += ["--epochs", "100000", "--workers", "0", "--device", "cpu", "--amp", "none", "--log-every", "1"]
    command += ["--no-progress", "--no-tensorboard", "--cache-dir", str(tmp_path / "cache")]
    command += ["--output-dir", str(tmp_path / "out"), "--checkpoint-url", f"file://{tmp_path}/ckpt"]
    log_path = tmp_path / "torchrun.log"
    with open(log_path, "wb") as log:
        env = dict(child_env(), TMPDIR=str(tmp_path))  # torchrun's torchelastic_* log folder: in the test's
        agent = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 120
        metrics = tmp_path / "out" / "metrics.jsonl"
        while not (metrics.exists() and '"train"' in metrics.read_text()):  # both ranks are training
            assert agent.poll() is None and time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.2)
        ranks = _children_of(agent.pid)
        assert len(ranks) == 2, ranks
        agent.kill()
        agent.wait()
        deadline = time.monotonic() + 90
        while any(_running(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = [pid for pid in ranks if _running(pid)]
        assert not alive, f"ranks {alive} still run 90 s after their agent was killed"
    finally:
        for pid in [*ranks, agent.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        agent.wait()
    text = log_path.read_text()
    assert "for SIGTERM after a checkpoint; rerun with --resume auto" in text, text[-4000:]
    assert list((tmp_path / "ckpt").glob("ckpt-*.pt")), text[-4000:]


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_a_stop_while_the_rendezvous_waits_for_a_rank_ends_the_run_at_once(tmp_path):
    """A stop signal reaches the Python handler only once the main thread is back in Python:
    rank 0 of two, waiting in the rendezvous for a rank that never comes, held a SIGTERM until
    the rendezvous timed out (30 minutes by default) and was then killed by the scheduler
    with no word. It ends within the grace period now, saying why, with exit 75."""
    url = f"file://{tmp_path}/data"
    write_dataset(open_store(url), [8, 8, 8])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = child_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    command = [sys.executable, "-m", "dlstore", "train", url, "--model", "resnet18", "--device", "cpu"]
    command += ["--cache-dir", str(tmp_path / "cache"), "--output-dir", str(tmp_path / "out"), "--no-progress"]
    command += ["--no-tensorboard", "--dist-timeout-minutes", "5"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not _listening(port):  # rank 0's store is up: it waits in the rendezvous
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
            time.sleep(0.2)
        time.sleep(1.0)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=START_UP_STOP_GRACE_S + 50)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == EXIT_PREEMPTED, stderr[-3000:]
    assert "stopped by SIGTERM during start-up" in stderr, stderr[-3000:]


_RANK_UNDER_PID_1 = """
import time
from dlstore.train.dist import stop_when_the_parent_dies
assert stop_when_the_parent_dies()
time.sleep(1.0)
print("still running")
"""


@pytest.mark.torchrun
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_rank_whose_launcher_is_pid_1_is_not_taken_for_an_orphan(tmp_path):
    """In a container torchrun is often PID 1, so its ranks' parent is PID 1 from the start:
    taking that for "the launcher has died" stopped every rank at start-up (exit 75)."""
    launcher = [
        sys.executable,
        "-c",
        f"import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', {_RANK_UNDER_PID_1!r}]))",
    ]
    namespace = ["unshare", "--pid", "--fork", "--mount-proc"]
    if subprocess.run([*namespace, "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a PID namespace here (needs root and unshare)")
    done = subprocess.run([*namespace, *launcher], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0 and "still running" in done.stdout, done.stdout + done.stderr


def test_ctrl_c_in_training_says_which_checkpoint_a_resume_would_take(tmp_path, monkeypatch, caplog):
    url = f"file://{tmp_path}/data"
    write_dataset(open_store(url), [8, 8, 8])
    cfg = _cpu_run(tmp_path, url, checkpoint_every_steps=2)
    real_step = Trainer._train_step

    def interrupted_at_step_3(self, *batch):
        if self.step == 3:
            raise KeyboardInterrupt
        return real_step(self, *batch)

    monkeypatch.setattr(Trainer, "_train_step", interrupted_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        main(cfg)
    assert f"interrupted at step 3; the last checkpoint is step 2 in file://{tmp_path}/ckpt" in caplog.text
    assert "--resume auto" in caplog.text


@pytest.mark.torchrun
@pytest.mark.slow
def test_two_ranks_skip_the_step_where_one_rank_has_an_empty_batch(tmp_path):
    """Rank 1's first batch is empty, rank 0's is not: both skip that step (a rank that skipped
    alone would leave the other waiting in DDP's all-reduce), train on their second batches,
    and end with finite weights (a step on nothing would have spread NaN to both)."""
    url = _dataset_with_an_empty_batch(tmp_path, World(1, 2, 2), [4, 4, 4, 4], batch=0)
    args = [
        *(url, "--model", "resnet18", "--device", "cpu", "--amp", "none", "--epochs", "1", "--log-every", "1"),
        *("--batch-size", "4", "--seed", "5", "--image-size", "16", "--workers", "1", "--warmup-epochs", "0"),
        *("--cache-dir", str(tmp_path / "cache"), "--output-dir", str(tmp_path / "run")),
        *("--checkpoint-url", f"file://{tmp_path}/ckpt", "--no-progress", "--no-tensorboard"),
    ]
    assert wait_all(launch_ranks(args, 2, tmp_path / "logs", child_env()), tmp_path / "logs") == [0, 0]
    records = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["split"] == "train"]
    assert [(r["step"], r["samples"]) for r in records] == [(1, 8)] and records[0]["loss"] == records[0]["loss"]
    _assert_finite_weights(tmp_path / "ckpt" / checkpoint_key(1))
    assert "no samples" in (tmp_path / "logs" / "rank1.log").read_text()
    assert "no samples" not in (tmp_path / "logs" / "rank0.log").read_text()


def test_a_rank_learns_that_rank_0_found_no_checkpoint_to_resume_from(tmp_path):
    """Rank 0 chooses the checkpoint; when it fails (none loads, the store is down) the other
    ranks get its error from the broadcast instead of waiting there for the group's timeout."""
    from dlstore.train.resume import find_resume_state

    class OtherRank:  # what rank 1 sees: rank 0's broadcast
        is_main = False

        def broadcast_object(self, obj):
            assert obj == (None, None)  # rank 1 sends nothing of its own
            return None, "FormatError: none of the 2 checkpoints under file:///ckpt can be read"

    cfg = TrainConfig(DataConfig("file:///data"), checkpoint_url=f"file://{tmp_path}", resume="auto")
    with pytest.raises(DlstoreError, match="rank 0 found no checkpoint to resume from: FormatError: none of the 2"):
        find_resume_state(cfg, CheckpointStore(f"file://{tmp_path}"), OtherRank())


def test_ranks_sharing_one_gpu_under_torchrun_are_refused_with_what_to_do(monkeypatch):
    """torchrun --nproc-per-node 2 on a one-GPU node put every rank on cuda:0, and NCCL failed
    later with "Duplicate GPU detected"; srun --gpus-per-task=1 shows each task one GPU of its own."""
    from dlstore.train.dist import _pick_device
    from dlstore.world import World

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    two = dict(rank=1, world_size=2, local_world_size=2)
    with pytest.raises(ConfigError, match="2 ranks on this node and 1 GPU: .*--nproc-per-node 1"):
        _pick_device(1, True, World(**two, launcher="torchrun"))
    assert _pick_device(1, True, World(**two, launcher="slurm")) == torch.device("cuda", 0)
    assert _pick_device(0, True, World(launcher="torchrun")) == torch.device("cuda", 0)
    assert _pick_device(1, False, World(**two, launcher="torchrun")) == torch.device("cpu")
