"""`examples/slurm_train.sbatch` under a real one-node Slurm (issue 13, item 6), training from the
local Swift server.

The job script is the example itself: its shell lines (rendezvous from `SLURM_JOB_NODELIST`,
`MASTER_PORT` from the job ID, `srun` with its options, the exit-75 requeue), its
`--signal=USR1@180`, `--requeue` and `--open-mode=append`; only the training command is
swapped for a tiny CPU run (2 tasks, MobileNetV3-small at 32 px), the GPU request is dropped,
and the size of the job is given on the sbatch command line. Every run of it is a real
`sbatch`, so the ranks see Slurm's own `SLURM_*` variables.

* `scancel --signal=USR1` in the middle of training: both tasks checkpoint at the same step and
  exit 75, the script runs `scontrol requeue`, Slurm starts the job again (after its requeue
  hold, about 6 s on this cluster) and `--resume auto` continues: every logged step has the loss of
  an uninterrupted run of the same job.
* The same through the time limit: slurmctld itself sends the example's `USR1@180` once the
  job is within 180 s of its end. Slurm checks time limits every 30 s, so the test freezes the
  tasks (`scancel --signal=STOP`) before it shortens the limit to 3 minutes: the training then
  cannot end before the warning comes, whenever in those 30 s it comes. The warning arrives
  with Slurm's own SIGCONT. The limit is set back before the requeued run starts.

Each test is bounded (`JOB_DEADLINE_S`); on a timeout it fails with the job's output and
cancels the job. The cluster (`tests/support/slurm_server.py`) is stopped at the end of the session,
and any job process still running is killed. It needs root and Debian's slurmctld, slurmd and
munge (`tools/setup.sh --test` installs them); without those binaries the tests are skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from swiftclient.exceptions import ClientException

from dlstore.config import StoreConfig
from dlstore.storage import open_store
from dlstore.train import CheckpointStore
from dlstore.train.checkpoint import checkpoint_key
from dlstore.train.loop import EXIT_PREEMPTED
from tests.support import env_with_repo
from tests.support.launch_support import REPO
from tests.support.loader_support import write_dataset
from tests.support.swift_fixtures import read_env_file

pytestmark = [pytest.mark.swift, pytest.mark.slurm, pytest.mark.slow]

EXAMPLE = REPO / "examples" / "slurm_train.sbatch"
JOB_DEADLINE_S = 150  # one job, first run to requeued run's end (the time-limit case waits up to 30 s)
TOTAL_STEPS = 36  # 6 epochs of 6 steps: 89 samples, 2 tasks x 8 a step, padded
# Signalled in epoch 0: many steps left for the signal to land before the end (some 30 steps of
# 30-200 ms), and the requeued run crosses the five epoch boundaries after it.
SIGNAL_AT_STEP = 3
STARTING = ("PENDING", "CONFIGURING", "RUNNING")
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "DEADLINE"}
DETERMINISTIC_FIELDS = ("split", "step", "epoch", "loss", "top1", "lr", "image_size", "samples")


# -- the cluster ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SlurmCluster:
    """The running one-node cluster: Slurm commands with its `SLURM_CONF`."""

    conf: str
    data_dir: Path

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": self.conf, **(extra or {})}

    def run(self, *cmd: str, env: dict[str, str] | None = None) -> str:
        out = subprocess.run(cmd, env=env or self.env(), capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            pytest.fail(f"`{shlex.join(cmd)}` exited {out.returncode}: {out.stderr.strip()}", pytrace=False)
        return out.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """JobState, Restarts, ExitCode, ... of a job (`scontrol show job`)."""
        return dict(re.findall(r"(\w+)=(\S*)", self.run("scontrol", "-o", "show", "job", job_id)))

    def cancel(self, job_id: str) -> None:
        """Cancel the job and wait (bounded) until none of its processes runs."""
        subprocess.run(["scancel", job_id], env=self.env(), capture_output=True, timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.job(job_id).get("JobState") in ("RUNNING", "COMPLETING"):
            time.sleep(0.2)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A one-node Slurm started by `tests/support/slurm_server.py` for this session (stopped with it)."""
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin"])
    absent = [name for name in ("slurmctld", "slurmd", "munged", "sbatch") if not shutil.which(name, path=search)]
    if absent:
        pytest.skip(
            f"Slurm is not installed ({', '.join(absent)} missing): `python -m tests.support.slurm_server install`"
        )
    tool = [sys.executable, "-m", "tests.support.slurm_server"]
    data_dir = tmp_path_factory.mktemp("slurm")
    env = env_with_repo({k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    start = [*tool, "start", "--data-dir", str(data_dir), "--stop-with-pid", str(os.getpid())]
    try:
        started = subprocess.run(start, capture_output=True, text=True, timeout=90, env=env)
    except subprocess.TimeoutExpired:
        started = None
    if started is None or started.returncode != 0:
        subprocess.run([*tool, "stop", "--data-dir", str(data_dir)], capture_output=True, timeout=90, env=env)
        why = started.stderr[-6000:] if started else "`slurm_server.py start` hung for 90 s"
        pytest.fail(f"could not start the local Slurm:\n{why}", pytrace=False)
    try:
        yield SlurmCluster(read_env_file(data_dir / "env.sh")["SLURM_CONF"], data_dir)
    finally:
        subprocess.run([*tool, "stop", "--data-dir", str(data_dir)], capture_output=True, timeout=90, env=env)


# -- the job ------------------------------------------------------------------------------------------
def job_script(train_args: list[str]) -> str:
    """The example batch script with its training command replaced and no GPU request."""
    lines = [
        line
        for line in EXAMPLE.read_text().splitlines()
        if not re.match(r"#SBATCH\s+--(gpus|gres)", line)  # this node has no GPUs
    ]
    first = next((i for i, line in enumerate(lines) if line.startswith("srun ")), None)
    if first is None or " python -m dlstore train " not in lines[first]:
        pytest.fail(f"{EXAMPLE} no longer has a `srun ... python -m dlstore train` line: update this test")
    last = first
    while lines[last].rstrip().endswith("\\"):
        last += 1
    srun = lines[first].split(" python ", 1)[0]  # srun and its options, as the example has them
    command = shlex.join([sys.executable, "-m", "dlstore", "train", *train_args])
    return "\n".join([*lines[:first], f"{srun} {command}", *lines[last + 1 :]]) + "\n"


@dataclass(frozen=True)
class TrainingJob:
    """One submission of the example job: its directory, output and metrics."""

    job_id: str
    workdir: Path

    @property
    def output(self) -> str:
        path = self.workdir / f"job-{self.job_id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def records(self) -> list[dict]:
        path = self.workdir / "out" / "metrics.jsonl"
        records = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                record = json.loads(line)
            except ValueError:  # a line being written as we read
                continue
            records.append({k: record.get(k) for k in DETERMINISTIC_FIELDS})
        return records

    def last_step(self) -> int:
        return max((r["step"] for r in self.records() if r["split"] == "train"), default=0)


@dataclass(frozen=True)
class ExampleJobs:
    """Submits the example job: the dataset in Swift, and the credentials file the example sources."""

    cluster: SlurmCluster
    container: str
    openrc: Path
    store_config: StoreConfig

    def checkpoint(self, job: TrainingJob, step: int) -> dict:
        """The job's checkpoint of `step`, from Swift."""
        store = open_store(f"swift://{self.container}/ckpt-{job.workdir.name}", self.store_config)
        return CheckpointStore(store).load(checkpoint_key(step))

    def submit(self, workdir: Path) -> TrainingJob:
        workdir.mkdir(parents=True)
        args = [
            *(f"swift://{self.container}/data", "--model", "mobilenet_v3_small", "--image-size", "32"),
            *("--epochs", "6", "--batch-size", "8", "--workers", "1", "--log-every", "1", "--seed", "5"),
            *("--deterministic", "--base-lr", "0.2", "--warmup-epochs", "0.5", "--checkpoint-every-minutes", "0"),
            *("--cache-dir", str(workdir / "cache"), "--cache-limit", "1GB", "--output-dir", str(workdir / "out")),
            *("--checkpoint-url", f"swift://{self.container}/ckpt-{workdir.name}", "--resume", "auto"),
            *("--dist-timeout-minutes", "2", "--no-progress", "--no-tensorboard"),
        ]
        script = workdir / "job.sbatch"
        script.write_text(job_script(args))
        # The example asks for 2 nodes x 4 GPUs and 12 hours: the command line overrides its #SBATCH lines.
        size = ("--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10")
        where = (f"--job-name=dlstore-{workdir.name}", f"--output={workdir}/job-%j.out", f"--chdir={workdir}")
        # No launcher variables or credentials of our own: the job gets them from Slurm and OPENRC.
        drop = ("SLURM_", "ST_", "OS_", "AWS_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_")
        env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        env.update(OPENRC=str(self.openrc), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        out = self.cluster.run("sbatch", "--parsable", *size, *where, str(script), env=self.cluster.env(env))
        return TrainingJob(out.strip().split(";")[0], workdir)


@pytest.fixture(scope="module")
def example_jobs(slurm_cluster, swift_server, tmp_path_factory) -> Iterator[ExampleJobs]:
    """89 samples in 8 shards (5 classes) in a fresh container, deleted afterwards."""
    node = socket.gethostname().split(".")[0]
    try:
        socket.getaddrinfo(node, None)
    except OSError as exc:
        pytest.fail(f"the example's MASTER_ADDR, the node name {node!r}, does not resolve here: {exc}", pytrace=False)
    container = f"dlstore-slurm-{uuid.uuid4().hex[:8]}"
    conn = swift_server.swift_connection()
    conn.put_container(container)
    try:
        config = StoreConfig.from_env(swift_server.swift_env())
        write_dataset(open_store(f"swift://{container}/data", config), [12, 9, 14, 11, 10, 8, 13, 12])
        openrc = tmp_path_factory.mktemp("slurm-openrc") / "openrc.sh"
        openrc.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in swift_server.swift_env().items()))
        yield ExampleJobs(slurm_cluster, container, openrc, config)
    finally:
        with contextlib.suppress(ClientException, OSError):  # cleanup only: keep the test's own error
            _, objects = conn.get_container(container, full_listing=True)
            for obj in objects:
                conn.delete_object(container, obj["name"])
            conn.delete_container(container)


@pytest.fixture(scope="module")
def reference(example_jobs, tmp_path_factory) -> list[dict]:
    """The metrics of the job run once, never signalled."""
    job = example_jobs.submit(tmp_path_factory.mktemp("slurm-reference") / "reference")
    try:
        wait_for_end(example_jobs.cluster, job, time.monotonic() + JOB_DEADLINE_S)
    finally:
        example_jobs.cluster.cancel(job.job_id)
    state = example_jobs.cluster.job(job.job_id)
    assert (state["JobState"], state["Restarts"], state["ExitCode"]) == ("COMPLETED", "0", "0:0"), job.output
    records = job.records()
    assert [r["step"] for r in records if r["split"] == "train"] == list(range(1, TOTAL_STEPS + 1)), job.output
    return records


# -- waiting, bounded -------------------------------------------------------------------------------
def _fail(cluster: SlurmCluster, job: TrainingJob, what: str) -> None:
    show = ["scontrol", "show", "job", job.job_id]
    state = subprocess.run(show, env=cluster.env(), capture_output=True, text=True, timeout=30)
    cluster.cancel(job.job_id)
    pytest.fail(f"{what}\n--- scontrol show job\n{state.stdout}\n--- job output\n{job.output[-6000:]}", pytrace=False)


def wait_for_step(cluster: SlurmCluster, job: TrainingJob, step: int, deadline: float) -> None:
    while job.last_step() < step:
        if time.monotonic() > deadline or cluster.job(job.job_id).get("JobState") not in STARTING:
            _fail(cluster, job, f"job {job.job_id} did not reach step {step} while running")
        time.sleep(0.05)


def wait_for_end(cluster: SlurmCluster, job: TrainingJob, deadline: float, on_requeue=None) -> None:
    """Until the job has ended for good (COMPLETED, FAILED, ...); `on_requeue()` once it was requeued."""
    while True:
        state = cluster.job(job.job_id)
        if on_requeue is not None and int(state.get("Restarts", "0")) > 0:
            on_requeue()
            on_requeue = None
        if state.get("JobState") in ENDED:
            return
        if time.monotonic() > deadline:
            _fail(cluster, job, f"job {job.job_id} did not end in {JOB_DEADLINE_S} s")
        time.sleep(0.2)


def tasks_exited_with(output: str, code: int) -> set[int]:
    """The task numbers srun reported as `Exited with exit code CODE` (e.g. `tasks 0-1: ...`)."""
    tasks: set[int] = set()
    for spec in re.findall(rf"tasks? ([\d,-]+): Exited with exit code {code}\b", output):
        for part in spec.split(","):
            low, _, high = part.partition("-")
            tasks.update(range(int(low), int(high or low) + 1))
    return tasks


def check_stopped_and_resumed(jobs: ExampleJobs, job: TrainingJob, reference: list[dict]) -> int:
    """What both signal paths must leave behind; returns the step the job stopped at."""
    state = jobs.cluster.job(job.job_id)
    output = job.output
    assert (state["JobState"], state["Restarts"], state["ExitCode"]) == ("COMPLETED", "1", "0:0"), output
    assert tasks_exited_with(output, EXIT_PREEMPTED) == {0, 1}, output  # both tasks, one srun
    assert output.count(f"requeueing job {job.job_id}") == 1, output
    stopped = re.findall(r"stopped at step (\d+) for SIGUSR1 after a checkpoint", output)
    resumed = re.findall(r"resumed from \S+ at epoch \d+, step (\d+)", output)
    assert len(stopped) == 1 and resumed == stopped, output  # the requeued run starts at that checkpoint
    step = int(stopped[0])
    assert SIGNAL_AT_STEP <= step < TOTAL_STEPS, output  # mid-run
    saved = jobs.checkpoint(job, step)  # one checkpoint, with the state of both tasks at that step
    assert (saved["step"], saved["world_size"], len(saved["ranks"]), saved["finished"]) == (step, 2, 2, False)
    assert job.records() == reference  # every logged step's loss, as if never stopped
    return step


# -- the tests --------------------------------------------------------------------------------------
def test_scancel_usr1_checkpoints_requeues_and_resumes_like_an_uninterrupted_run(example_jobs, reference, tmp_path):
    t0 = time.monotonic()
    cluster, deadline = example_jobs.cluster, t0 + JOB_DEADLINE_S
    job = example_jobs.submit(tmp_path / "scancel")
    try:
        wait_for_step(cluster, job, SIGNAL_AT_STEP, deadline)
        cluster.run("scancel", "--signal=USR1", job.job_id)
        wait_for_end(cluster, job, deadline)
        step = check_stopped_and_resumed(example_jobs, job, reference)
    finally:
        cluster.cancel(job.job_id)
    print(f"\nSLURM scancel --signal=USR1: stopped at step {step}, requeued, resumed; {time.monotonic() - t0:.0f} s")


def test_time_limit_warning_usr1_checkpoints_requeues_and_resumes(example_jobs, reference, tmp_path):
    t0 = time.monotonic()
    cluster, deadline = example_jobs.cluster, t0 + JOB_DEADLINE_S
    job = example_jobs.submit(tmp_path / "timelimit")
    try:
        wait_for_step(cluster, job, SIGNAL_AT_STEP, deadline)
        # Hold the training where it is until slurmctld's next time-limit check (every 30 s).
        cluster.run("scancel", "--signal=STOP", job.job_id)
        frozen_at = job.last_step()
        # 3 minutes from its start: within the example's USR1@180 of the end, so the warning is due.
        cluster.run("scontrol", "update", f"JobId={job.job_id}", "TimeLimit=3")

        def restore_limit() -> None:  # the requeued run gets its full time again
            cluster.run("scontrol", "update", f"JobId={job.job_id}", "TimeLimit=10")

        wait_for_end(cluster, job, deadline, on_requeue=restore_limit)
        step = check_stopped_and_resumed(example_jobs, job, reference)
        assert step >= frozen_at, job.output  # frozen there until the warning
    finally:
        cluster.cancel(job.job_id)
    print(f"\nSLURM time-limit USR1@180: stopped at step {step}, requeued, resumed; {time.monotonic() - t0:.0f} s")
