#!/usr/bin/env python3
"""A real one-node Slurm (Debian's slurmctld + slurmd, with munge) on this machine, for tests and local trials.

Everything lives in one data directory: the munge key and socket, ``slurm.conf``, Slurm's
state and spool, the logs, the PIDs and an ``env.sh``. Nothing is written outside it. The
daemons listen on free ports. Jobs run on one node named after this host, declared with at
least 2 CPUs, as the user who started them. Run it as root, as CI does: slurmd launches
jobs as their owner.

Subcommands::

    install                          # Debian's slurmctld, slurmd, slurm-client and munge (idempotent)
    start  [--data-dir DIR] [--env-file FILE] [--cred-expire S] [--stop-with-pid PID] ...
    stop   [--data-dir DIR]          # cancels the jobs, then kills only what it started
    status [--data-dir DIR]          # exit 0 when everything runs

``start`` brings up munged, slurmctld and slurmd in the foreground of their own sessions,
waits until ``sinfo`` shows the node idle, then prints ``export`` lines on stdout and writes
the same to ``DATA_DIR/env.sh``:

    SLURM_CONF          the slurm.conf every Slurm command (sbatch, srun, scontrol, ...) must read
    DLSTORE_SLURM_DIR   the data directory

A requeued job waits until its last launch credential expires. This cluster sets that to
``--cred-expire`` (default 5 s, Slurm's minimum) and schedules every second, so a requeued
job starts again within about 10 s.

``stop`` cancels every job, stops the daemons and kills what is left of the jobs. A failed
start prints each log's last lines and stops what it started.

Example::

    python -m tests.support.slurm_server install
    eval "$(python -m tests.support.slurm_server start)"
    sbatch --wrap 'srun -n 2 hostname' && squeue
    python -m tests.support.slurm_server stop

Environment: ``DLSTORE_SLURM_DIR`` (default ``~/.cache/dlstore/slurm-data``).
"""

from __future__ import annotations

import argparse
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.support import env_with_repo

# The same process handling as Swift's.
from tests.support.swift_server import (
    add_stop_status_watch,
    apt_install,
    dump_logs,
    env_lines,
    file_lock,
    free_ports,
    is_ours,
    kill_recorded,
    proc_stat,
    read_pids,
    spawn,
    watch,
)

DEBIAN_SLURM_PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
MIN_CPUS = 2  # the tests run 2-task jobs, also on a 1-core machine
PARTITION = "debug"


class StartError(Exception):
    """start failed; the message says why."""


def log(msg: str) -> None:
    print(f"slurm_server: {msg}", file=sys.stderr, flush=True)


def default_data_dir() -> Path:
    return Path(os.environ.get("DLSTORE_SLURM_DIR") or Path.home() / ".cache/dlstore/slurm-data")


def binary(name: str) -> str | None:
    """An executable by name; daemons live in /usr/sbin, which a non-root PATH often lacks."""
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)), None
    )


def missing_binaries() -> list[str]:
    return [
        name for name in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo") if not binary(name)
    ]


def node_name() -> str:
    """slurmd takes its node name from the short host name (another needs a special build)."""
    return socket.gethostname().split(".")[0]


# ---------------------------------------------------------------------------- configs


def write_configs(data_dir: Path, ports: dict[str, int], cred_expire: int, first_job_id: int) -> Path:
    """slurm.conf with every path inside DATA_DIR; returns its path."""
    user = pwd.getpwuid(os.geteuid()).pw_name
    run, node = data_dir / "run", node_name()
    cpus = max(MIN_CPUS, os.cpu_count() or 1)
    settings = {
        "ClusterName": "dlstore",
        "SlurmctldHost": f"{node}(127.0.0.1)",
        "SlurmctldPort": ports["slurmctld"],
        "SlurmdPort": ports["slurmd"],
        "SlurmUser": user,
        "SlurmdUser": user,
        "AuthType": "auth/munge",
        "CredType": "cred/munge",
        # cred_expire: how long a requeued job is held (its old credential must expire first).
        "AuthInfo": f"socket={run / 'munge.socket'},cred_expire={cred_expire}",
        "StateSaveLocation": data_dir / "state",
        "SlurmdSpoolDir": data_dir / "spool",
        "SlurmctldPidFile": run / "slurmctld.pid",
        "SlurmdPidFile": run / "slurmd.pid",
        # No cgroups in containers: track job processes by their parent PIDs.
        "ProctrackType": "proctrack/linuxproc",
        "TaskPlugin": "task/none",
        "JobAcctGatherType": "jobacct_gather/none",
        "AccountingStorageType": "accounting_storage/none",
        "MpiDefault": "none",
        "SchedulerType": "sched/backfill",
        # Schedule every second: a requeued job starts as soon as its hold ends, not a minute later.
        "SchedulerParameters": "sched_interval=1,bf_interval=1",
        "SelectType": "select/cons_tres",
        "SelectTypeParameters": "CR_Core",
        "SlurmdParameters": "config_overrides",
        "ReturnToService": 2,
        "KillWait": 10,
        "MinJobAge": 600,
        # A job ID of its own per cluster: scripts derive ports from it (MASTER_PORT = 20000 + ID).
        "FirstJobId": first_job_id,
        "PlugStackConfig": data_dir / "etc" / "plugstack.conf",
    }
    lines = [f"{key}={value}" for key, value in settings.items()]
    lines.append(f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN")
    lines.append(f"PartitionName={PARTITION} Nodes={node} Default=YES MaxTime=INFINITE State=UP")
    conf = data_dir / "etc" / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    (data_dir / "etc" / "plugstack.conf").write_text("")  # not the host's /etc/slurm/plugstack.conf
    return conf


def write_munge_key(data_dir: Path) -> Path:
    key_dir = data_dir / "munge"
    key_dir.mkdir(mode=0o700, exist_ok=True)
    key = key_dir / "munge.key"
    if not key.exists():
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
    return key


# ---------------------------------------------------------------------------- start / stop


def slurm_env(conf: Path) -> dict[str, str]:
    return dict(os.environ, SLURM_CONF=str(conf))


def node_state(conf: Path) -> str | None:
    """The node's state as sinfo prints it (``idle``, ``down*``, ...), or None if slurmctld does not answer."""
    try:
        out = subprocess.run(
            [binary("sinfo") or "sinfo", "-h", "-N", "-o", "%T"],
            env=slurm_env(conf),
            capture_output=True,
            text=True,
            timeout=10,
        )
    except subprocess.TimeoutExpired:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def wait_idle(conf: Path, procs: dict[str, subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    state = None
    while time.monotonic() < deadline:
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise StartError(f"{name} exited with status {proc.returncode}")
        state = node_state(conf)
        if state == "idle":
            return
        time.sleep(0.2)
    raise StartError(f"the node is not idle after {timeout:.0f} s (sinfo says {state!r})")


def start(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    data_dir = Path(args.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(data_dir / ".lock"):
        pids = read_pids(data_dir)
        alive = [name for name, entry in pids.items() if is_ours(entry)]
        if alive:
            env_file = data_dir / "env.sh"
            if len(alive) == len(pids) and env_file.exists():
                log(f"already running in {data_dir}; printing its env (stop it with `slurm_server.py stop`)")
                text = env_file.read_text()
                if args.env_file:
                    Path(args.env_file).write_text(text)
                sys.stdout.write(text)
                return 0
            log(f"{data_dir} is partly running ({', '.join(alive)} up): run stop first")
            return 1
        pids = {}
        try:
            env = _start_daemons(args, data_dir, pids)
        except (StartError, OSError, subprocess.CalledProcessError) as exc:
            kill_recorded(pids)
            (data_dir / "pids").unlink(missing_ok=True)
            log(f"start failed: {exc}")
            dump_logs(data_dir)
            return 1
        text = env_lines(env)
        for path in filter(None, [data_dir / "env.sh", args.env_file and Path(args.env_file)]):
            path.write_text(text)
    sys.stdout.write(text)
    log(f"started in {time.monotonic() - t0:.1f} s; env in {data_dir / 'env.sh'}")
    return 0


def _start_daemons(args: argparse.Namespace, data_dir: Path, pids: dict[str, dict]) -> dict[str, str]:
    missing = missing_binaries()
    if missing:
        raise StartError(f"{', '.join(missing)} not found: run `slurm_server.py install` first")
    for sub in ("state", "spool", "log"):
        shutil.rmtree(data_dir / sub, ignore_errors=True)  # no jobs or node state from an earlier start
    for sub in ("etc", "state", "spool", "log", "run"):
        (data_dir / sub).mkdir(parents=True, exist_ok=True)
    (data_dir / "env.sh").unlink(missing_ok=True)
    key = write_munge_key(data_dir)
    ports = dict(zip(("slurmctld", "slurmd"), free_ports(2), strict=True))
    first_job_id = args.first_job_id or random.randint(100, 9000)
    conf = write_configs(data_dir, ports, args.cred_expire, first_job_id)
    run = data_dir / "run"

    procs: dict[str, subprocess.Popen] = {}
    munged = [binary("munged"), "--foreground", "--force", f"--socket={run / 'munge.socket'}"]
    munged += [f"--key-file={key}", f"--pid-file={run / 'munged.pid'}", f"--seed-file={data_dir / 'munge' / 'seed'}"]
    procs["munged"] = spawn("munged", munged, data_dir, ["munged", str(run)], pids)
    _wait_for(run / "munge.socket", procs, 10.0)
    for name in ("slurmctld", "slurmd"):
        # SLURM_CONF in slurmd's environment is inherited by slurmstepd: stop() finds leftovers by it.
        # `env` execs the daemon, so the recorded PID is the daemon's.
        cmd = ["env", f"SLURM_CONF={conf}", binary(name), "-D", "-f", str(conf)]
        procs[name] = spawn(name, cmd, data_dir, [name, str(conf)], pids)
    wait_idle(conf, procs, args.timeout)
    return {"SLURM_CONF": str(conf), "DLSTORE_SLURM_DIR": str(data_dir)}


def _wait_for(path: Path, procs: dict[str, subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise StartError(f"{name} exited with status {proc.returncode}")
        if time.monotonic() > deadline:
            raise StartError(f"{path} did not appear in {timeout:.0f} s")
        time.sleep(0.05)


def cancel_jobs(conf: Path, timeout: float = 15.0) -> None:
    """scancel every job of this cluster and wait (bounded) until none is left."""
    squeue = [binary("squeue") or "squeue", "-h", "-o", "%A"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            out = subprocess.run(squeue, env=slurm_env(conf), capture_output=True, text=True, timeout=5)
        except subprocess.TimeoutExpired:
            return
        jobs = out.stdout.split()
        if out.returncode != 0 or not jobs:
            return
        subprocess.run([binary("scancel") or "scancel", *jobs], env=slurm_env(conf), capture_output=True, timeout=5)
        time.sleep(0.5)


def kill_leftovers(conf: Path) -> list[int]:
    """SIGKILL the processes (slurmstepd, batch scripts, tasks) that carry this cluster's SLURM_CONF."""
    marker = f"SLURM_CONF={conf}".encode()
    killed = []
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit() or int(proc_dir.name) == os.getpid():
            continue
        try:
            environ = (proc_dir / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in environ:
            try:
                os.kill(int(proc_dir.name), signal.SIGKILL)
                killed.append(int(proc_dir.name))
            except ProcessLookupError:
                pass
    return killed


def stop(data_dir: Path, spare: int | None = None) -> int:
    data_dir = data_dir.resolve()
    conf = data_dir / "etc" / "slurm.conf"
    with file_lock(data_dir / ".lock"):
        pids = read_pids(data_dir)
        if any(name == "slurmctld" and is_ours(entry) for name, entry in pids.items()):
            cancel_jobs(conf)
        stopped = kill_recorded(pids, spare=spare)
        leftovers = kill_leftovers(conf) if conf.exists() else []
        (data_dir / "pids").unlink(missing_ok=True)
        (data_dir / "env.sh").unlink(missing_ok=True)
    if leftovers:
        log(f"killed {len(leftovers)} leftover job processes")
    log(f"stopped {', '.join(stopped)}" if stopped else f"nothing of ours was running in {data_dir}")
    return 0


def status(data_dir: Path) -> int:
    data_dir = data_dir.resolve()
    pids = read_pids(data_dir)
    if not pids:
        print(f"not running ({data_dir})")
        return 1
    alive = [name for name, entry in pids.items() if is_ours(entry)]
    for name, entry in pids.items():
        print(f"{name:10s} pid {entry['pid']:<8d} {'running' if name in alive else 'GONE'}")
    print(f"node: {node_state(data_dir / 'etc' / 'slurm.conf')}; env: {data_dir / 'env.sh'}")
    return 0 if len(alive) == len(pids) else 1


def _spawn_watchdog(data_dir: Path, watched_pid: int) -> None:
    with file_lock(data_dir / ".lock"):
        pids = read_pids(data_dir)
        watched = proc_stat(watched_pid)
        cmd = [sys.executable, "-m", __spec__.name, "_watch", "--data-dir", str(data_dir)]
        cmd += ["--pid", str(watched_pid), "--pid-start", str(watched[1] if watched else 0)]
        spawn("watchdog", cmd, data_dir, [__spec__.name, "_watch", str(data_dir)], pids, env=env_with_repo())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{install,start,stop,status}")
    sub.add_parser("install", help="install Debian's Slurm and munge packages (idempotent)")

    p_start = sub.add_parser("start", help="start munged, slurmctld and slurmd; print `export` lines")
    p_start.add_argument("--data-dir", default=str(default_data_dir()))
    p_start.add_argument("--env-file", help="also write the export lines here")
    p_start.add_argument("--cred-expire", type=int, default=5, help="seconds a requeued job is held (min 5)")
    p_start.add_argument("--first-job-id", type=int, default=0, help="the first job ID (default: random)")
    p_start.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for an idle node")
    p_start.add_argument("--stop-with-pid", type=int, help="stop the cluster when this process exits")

    add_stop_status_watch(sub, "cancel the jobs, stop the daemons", default_data_dir())

    args = parser.parse_args(argv)
    if args.command == "install":
        try:
            apt_install(DEBIAN_SLURM_PACKAGES)
        except (subprocess.CalledProcessError, OSError) as exc:
            log(f"install failed: {exc}")
            return 1
        return 0
    if args.command == "start":
        if args.cred_expire < 5:
            parser.error("--cred-expire must be at least 5 (Slurm ignores smaller values)")
        code = start(args)
        if code == 0 and args.stop_with_pid:
            _spawn_watchdog(Path(args.data_dir).resolve(), args.stop_with_pid)
        return code
    if args.command == "stop":
        return stop(Path(args.data_dir))
    if args.command == "status":
        return status(Path(args.data_dir))
    return watch(Path(args.data_dir), args.pid, args.pid_start, stop_all=stop)


if __name__ == "__main__":
    sys.exit(main())
