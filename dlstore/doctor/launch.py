"""The launcher's variables, torchrun's or Slurm's, agree with each other and with the GPUs.

`dlstore.world.World.from_env` decides who this process is. This check looks at the raw
variables around it. It finds the mistakes that hang a job at the rendezvous or put two
ranks on one GPU.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

from dlstore.doctor.check import FAIL, OK, WARN, Check
from dlstore.errors import ConfigError
from dlstore.world import World

__all__ = ["distributed_check"]

_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_TORCHRUN_FIX = "launch with torchrun (it sets them all) or set " + ", ".join(_TORCHRUN) + " together"


def _int(env: Mapping[str, str], name: str) -> int | None:
    try:
        return int(env[name]) if env.get(name) else None
    except ValueError:
        return None


def _rendezvous_problems(env: Mapping[str, str], world: World) -> list[tuple[str, str, str]]:
    problems = []
    addr = env.get("MASTER_ADDR")
    if world.launcher == "slurm" and not addr and world.num_nodes > 1 and not env.get("SLURM_JOB_NODELIST"):
        problems.append((FAIL, "no MASTER_ADDR and no SLURM_JOB_NODELIST to find rank 0", "export MASTER_ADDR"))
    if world.launcher != "slurm" and not addr:
        problems.append((FAIL, "MASTER_ADDR is not set", _TORCHRUN_FIX))
    if addr:
        try:
            socket.getaddrinfo(addr, None)
        except OSError:
            problems.append((FAIL, f"MASTER_ADDR={addr} does not resolve", "give rank 0's host name or IP address"))
    port = env.get("MASTER_PORT")
    if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
        problems.append((FAIL, f"MASTER_PORT={port!r} is not a port number", "a free port, e.g. 29500"))
    return problems


def _launcher_problems(env: Mapping[str, str], world: World) -> list[tuple[str, str, str]]:
    problems = []
    if world.launcher == "slurm":
        local_name, local = "SLURM_LOCALID", _int(env, "SLURM_LOCALID")
        nodes = _int(env, "SLURM_STEP_NUM_NODES") or _int(env, "SLURM_NNODES")
        if nodes and nodes > 1 and not (env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")):
            problems.append(
                (FAIL, f"{nodes} nodes but SLURM_NTASKS_PER_NODE is not set", "srun --ntasks-per-node=GPUS_PER_NODE")
            )
        elif nodes and nodes != world.num_nodes:
            problems.append(
                (FAIL, f"SLURM_NNODES={nodes}, but the tasks per node make {world.num_nodes} nodes", "srun -N and -n")
            )
    else:
        local_name, local = "LOCAL_RANK", _int(env, "LOCAL_RANK")
        if world.world_size > 1 and "LOCAL_WORLD_SIZE" not in env:
            problems.append((WARN, "LOCAL_WORLD_SIZE is not set: taken as WORLD_SIZE (one node)", _TORCHRUN_FIX))
    if local is not None and local != world.local_rank:
        problems.append(
            (
                FAIL,
                f"{local_name}={local} but rank {world.rank} is local rank {world.local_rank} in a node-by-node "
                "numbering",
                "number ranks node by node: srun --distribution=block, torchrun does so",
            )
        )
    return problems


def _gpu_problems(world: World, visible_gpus: int | None) -> list[tuple[str, str, str]]:
    # One visible GPU per task is fine: the launcher bound it, as srun --gpus-per-task=1 does.
    if not visible_gpus or visible_gpus == 1 or world.local_world_size <= visible_gpus:
        return []
    return [
        (
            FAIL,
            f"{world.local_world_size} ranks per node but this process sees {visible_gpus} GPUs",
            "one rank per GPU: torchrun --nproc-per-node=GPUS, srun --ntasks-per-node=GPUS --gpus-per-task=1",
        )
    ]


def distributed_check(env: Mapping[str, str], visible_gpus: int | None = None) -> Check:
    """One line: who this process is in the job, or what in its variables is wrong."""
    torchrun = [name for name in ("RANK", "WORLD_SIZE") if name in env]
    if len(torchrun) == 1:
        missing = "WORLD_SIZE" if torchrun == ["RANK"] else "RANK"
        return Check("distributed", FAIL, f"{torchrun[0]} is set but {missing} is not", _TORCHRUN_FIX)
    if not torchrun and not ("SLURM_PROCID" in env and "SLURM_NTASKS" in env):
        return Check("distributed", OK, "single process (no torchrun or srun variables)")
    try:
        world = World.from_env(env)
    except ConfigError as exc:
        return Check("distributed", FAIL, str(exc), _TORCHRUN_FIX if torchrun else "check the srun options")
    seen = (
        f"{world.launcher}: rank {world.rank} of {world.world_size}, local rank {world.local_rank} of "
        f"{world.local_world_size}, node {world.node} of {world.num_nodes}"
    )
    if torchrun and "SLURM_PROCID" in env:
        seen += " (torchrun's variables win over Slurm's)"
    problems = []
    if world.world_size > 1:
        problems += _rendezvous_problems(env, world)
    problems += _launcher_problems(env, world) + _gpu_problems(world, visible_gpus)
    if not problems:
        where = env.get("MASTER_ADDR") or env.get("SLURM_JOB_NODELIST") or "local"
        port = f":{env['MASTER_PORT']}" if env.get("MASTER_PORT") else ""
        return Check("distributed", OK, seen + (f"; rendezvous {where}{port}" if world.world_size > 1 else ""))
    status = FAIL if any(p[0] == FAIL for p in problems) else WARN
    return Check(
        "distributed",
        status,
        f"{seen}: " + "; ".join(p[1] for p in problems),
        "; ".join(dict.fromkeys(p[2] for p in problems)),
    )
