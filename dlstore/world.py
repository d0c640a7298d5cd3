"""Who this process is in a data-parallel job: the one `World` every layer takes.

The plan partitions by it, and the dataset and loader read this rank's share with it.
The trainer joins the process group with it. The bench runs its scaling rounds with it.
`World.from_env` is the one place that reads the launchers' variables.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from dlstore.errors import ConfigError

__all__ = ["LAUNCHERS", "World", "available_cores"]

log = logging.getLogger(__name__)

# How the process was started: torchrun sets TORCHELASTIC_RUN_ID, "env" has plain RANK and
# WORLD_SIZE. Then Slurm's srun, a process group made by the caller, or a single process.
LAUNCHERS = ("torchrun", "env", "slurm", "torch.distributed", "none")


def _tasks_per_node(layout: str) -> int:
    """The tasks on every node from Slurm's list ("4(x2)", "4,4", "4"); uneven ones are refused."""
    counts = set()
    for part in layout.split(","):
        count, _, _repeat = part.partition("(")
        counts.add(int(count))
    if len(counts) != 1:
        raise ConfigError(
            f"the tasks per node differ ({layout}): dlstore needs as many on every node (srun --ntasks-per-node)"
        )
    return counts.pop()


def _int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def available_cores() -> int:
    """CPU cores this process may run on: its affinity, not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class World:
    """One rank's place in the job, with ranks numbered node by node as torchrun and srun do.
    So the node index and the local rank follow from the rank.

    >>> w = World(rank=5, world_size=8, local_world_size=4)
    >>> (w.node, w.local_rank, w.num_nodes)
    (1, 1, 2)
    """

    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    # How the process was started; not part of its identity (equal worlds compare equal).
    launcher: str = field(default="none", compare=False)

    def __post_init__(self) -> None:
        for name, minimum in (("rank", 0), ("world_size", 1), ("local_world_size", 1)):
            object.__setattr__(self, name, _int(name, getattr(self, name), minimum))
        if self.rank >= self.world_size:
            raise ConfigError(f"rank {self.rank} is outside a world of {self.world_size}")
        if self.world_size % self.local_world_size:
            raise ConfigError(
                f"world size {self.world_size} is not a multiple of the ranks per node ({self.local_world_size})"
            )
        if self.launcher not in LAUNCHERS:
            raise ConfigError(f"launcher must be one of {LAUNCHERS}, not {self.launcher!r}")

    @property
    def node(self) -> int:
        return self.rank // self.local_world_size

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> World:
        """From torchrun's variables, else Slurm's, else a torch.distributed group, else alone.

        >>> World.from_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}).node
        0
        """
        env = os.environ if env is None else env
        try:
            if "WORLD_SIZE" in env and "RANK" in env:
                size = int(env["WORLD_SIZE"])
                launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "env"
                return cls(int(env["RANK"]), size, int(env.get("LOCAL_WORLD_SIZE", size)), launcher)
            if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
                return cls.from_slurm(env)
        except ValueError as exc:
            raise ConfigError(f"cannot read the distributed world from the environment: {exc}") from None
        return cls._from_process_group(env)

    @classmethod
    def from_slurm(cls, env: Mapping[str, str]) -> World:
        """This task of an srun step: the step's size and tasks per node, not the job's.

        A batch script itself, with a job's variables but no step's, is one process.

        >>> World.from_slurm({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
        ...                   "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_LOCALID": "1"}).node
        1
        """
        if "SLURM_STEP_NUM_TASKS" not in env and "SLURM_JOB_ID" in env:
            tasks = int(env["SLURM_NTASKS"])
            if tasks > 1:
                log.warning(
                    "a Slurm job of %d tasks, but this is its batch script, not an srun step: one process; "
                    "launch with srun to run them all",
                    tasks,
                )
            return cls()
        size = int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"])
        layout = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE") or str(size)
        world = cls(int(env["SLURM_PROCID"]), size, _tasks_per_node(layout), "slurm")
        local = env.get("SLURM_LOCALID")
        if local not in (None, "") and int(local) != world.local_rank:
            raise ConfigError(
                f"SLURM_LOCALID={local}, but rank {world.rank} is local rank {world.local_rank} when ranks are "
                "numbered node by node: srun --distribution=block (the default) numbers them so"
            )
        return world

    @classmethod
    def _from_process_group(cls, env: Mapping[str, str]) -> World:
        # torch is the heaviest import here: only a caller-made process group needs it.
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            size = dist.get_world_size()
            return cls(dist.get_rank(), size, int(env.get("LOCAL_WORLD_SIZE", size)), "torch.distributed")
        return cls()
