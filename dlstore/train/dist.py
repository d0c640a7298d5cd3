"""Process-group setup for torchrun, Slurm (`srun`) and single-process runs.

DDP gradients go over NCCL on GPUs and gloo on CPUs. The trainer's small control messages
go over a separate gloo group: the stop flag, whether a checkpoint is due, RNG states.
So they never need a CUDA tensor, and never make the host wait for the GPU's queue.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import re
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dlstore.errors import ConfigError
from dlstore.world import World

__all__ = ["DistContext", "Rendezvous", "first_slurm_host", "setup_distributed"]

log = logging.getLogger(__name__)

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class Rendezvous:
    """Where this process meets the others: the `World` it is in and rank 0's address.

    torchrun sets `MASTER_ADDR` and `MASTER_PORT`. Under `srun` the address is the job's first
    host, and the port, unless given, comes from the job id.
    """

    world: World
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT

    @property
    def local_rank(self) -> int:
        return self.world.local_rank

    @property
    def launcher(self) -> str:
        return self.world.launcher

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, world: World | None = None) -> Rendezvous:
        env = os.environ if env is None else env
        world = world or World.from_env(env)
        try:
            if world.launcher == "slurm":
                addr = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST", "")) or "127.0.0.1"
                job = int(env.get("SLURM_JOB_ID", "0") or 0)
                return cls(world, addr, int(env.get("MASTER_PORT") or 20000 + job % 20000))
            return cls(world, env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", DEFAULT_PORT)))
        except ValueError as exc:
            raise ConfigError(f"cannot read the rendezvous address from the environment: {exc}") from None


def first_slurm_host(nodelist: str) -> str | None:
    """The first host of a Slurm hostlist expression, without calling `scontrol`.

    >>> first_slurm_host("gpu[07-10,12],login1")
    'gpu07'
    >>> first_slurm_host("node3")
    'node3'
    """
    nodelist = nodelist.strip()
    if not nodelist:
        return None
    match = re.match(r"([^,\[]+)(?:\[([^\],\-]+))?", nodelist)
    if not match:
        return None
    return match.group(1) + (match.group(2) or "")


@dataclass
class DistContext:
    """This process's place in the job and the groups it talks over.

    With `world_size == 1` no process group is created and every collective here is a no-op.
    """

    world: World
    device: torch.device
    backend: str | None
    control_group: Any = None
    owns_group: bool = False

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def world_size(self) -> int:
        return self.world.world_size

    @property
    def local_rank(self) -> int:
        return self.world.local_rank

    @property
    def local_world_size(self) -> int:
        return self.world.local_world_size

    @property
    def is_main(self) -> bool:
        return self.world.is_main

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def any_flags(self, *flags: bool) -> list[bool]:
        """Each flag OR-ed over all ranks, so that all act on what one saw, at the same step."""
        if not self.distributed:
            return [bool(f) for f in flags]
        values = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.control_group)
        return [bool(v) for v in values.tolist()]

    def gather_objects(self, obj: Any) -> list[Any]:
        """`obj` of every rank in rank order, pickled over the gloo control group."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control_group)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.control_group)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks in place, over the main NCCL or gloo group; `tensor` is on `device`."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def broadcast_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's values of `tensors` on every rank, in place, over the main group."""
        if self.distributed:
            for tensor in tensors:
                dist.broadcast(tensor, src=0)

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


def _pick_device(local_rank: int, want_cuda: bool, world: World | None = None) -> torch.device:
    if want_cuda and torch.cuda.is_available():
        visible = torch.cuda.device_count()
        shared = visible == 1 and world is not None and world.local_world_size > 1 and world.launcher != "slurm"
        if shared:
            # torchrun gives its processes the same GPUs, unlike srun --gpus-per-task. Every
            # rank would take cuda:0 and fail later with NCCL's "Duplicate GPU detected".
            raise ConfigError(
                f"{world.local_world_size} ranks on this node and 1 GPU: start one process per GPU "
                f"(torchrun --nproc-per-node {visible})"
            )
        if visible > 1 and local_rank >= visible:
            # Two ranks on one GPU would fail later, in NCCL, with a less clear message.
            raise ConfigError(
                f"local rank {local_rank} has no GPU of its own: this process sees {visible}; "
                "start one process per GPU (torchrun --nproc-per-node, srun --gpus-per-task=1)"
            )
        # One visible GPU: the launcher bound this task to it, as srun --gpus-per-task=1 does.
        index = local_rank if visible > 1 else 0
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: This process's parent when the trainer was imported. If it has changed by the time the
#: death signal is asked for, it has ended. A parent of PID 1 is no sign of that: in a
#: container, torchrun itself is often PID 1.
_PARENT_AT_IMPORT = os.getppid()


def stop_when_the_parent_dies() -> bool:
    """Have the kernel send this process SIGTERM when its parent, the launcher, ends.

    Ranks of a killed torchrun agent would train on with no one to stop them. The SIGTERM is
    a stop signal like any other. A run started from a shell that exits must go on, so only a
    launcher's child asks. Whether it is set; Linux only.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as exc:
        log.warning(
            "cannot ask for SIGTERM when the launcher dies (%s): a killed launcher leaves this rank running", exc
        )
        return False
    if os.getppid() != _PARENT_AT_IMPORT:  # the parent ended before the request: nothing will send it now
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def warn_of_a_shared_store(env: Mapping[str, str], rank: int) -> bool:
    """Warn, on rank 0, when torchrun may restart its workers over the store it gave the last ones.

    A restarted attempt then can read the failed one's addresses, and its group fails to
    connect (pytorch issue 135712; seen here after a lost node). Without the shared store,
    each attempt's rank 0 starts a store of its own. Whether it warned."""
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0")
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if rank != 0 or not shared or not restarts.isdigit() or int(restarts) == 0:
        return False
    log.warning(
        "torchrun --max-restarts %s shares one store across restarts: a restart may fail to connect to "
        "addresses of the failed attempt. Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun",
        restarts,
    )
    return True


def setup_distributed(
    launch: Rendezvous | None = None, *, device: str = "auto", timeout_minutes: float = 30.0
) -> DistContext:
    """Join the job's process group when there is more than one process, and pick the device.

    `device` is "auto", "cuda" or "cpu"; the backend follows it: NCCL for CUDA, gloo for CPU.

    >>> ctx = setup_distributed()                          # doctest: +SKIP
    >>> ctx.rank, ctx.world_size, ctx.device               # doctest: +SKIP
    (0, 1, device(type='cuda', index=0))
    """
    launch = launch or Rendezvous.from_env()
    if launch.launcher == "torchrun":
        stop_when_the_parent_dies()
        warn_of_a_shared_store(os.environ, launch.world.rank)
    if device not in ("auto", "cuda", "cpu"):
        raise ConfigError(f"device must be 'auto', 'cuda' or 'cpu', not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' was asked for, but torch sees no CUDA device")
    world = launch.world
    dev = _pick_device(launch.local_rank, device != "cpu", launch.world)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    ctx = DistContext(world, dev, None)
    if world.world_size == 1:
        return ctx
    ctx.backend = backend
    if dist.is_initialized():
        # The caller made the group; use it as it is.
        if dist.get_world_size() != world.world_size or dist.get_rank() != world.rank:
            raise ConfigError("an existing process group disagrees with the launcher's rank/world size")
    else:
        timeout = datetime.timedelta(minutes=timeout_minutes)
        # torchrun: env:// reuses the agent's store. srun or plain env: rendezvous at rank 0's host.
        init = "env://" if launch.launcher == "torchrun" else f"tcp://{launch.master_addr}:{launch.master_port}"
        kwargs: dict[str, Any] = {}
        if dev.type == "cuda":
            kwargs["device_id"] = dev  # binds NCCL to this GPU now, not lazily at the first collective
        dist.init_process_group(
            backend, init_method=init, rank=world.rank, world_size=world.world_size, timeout=timeout, **kwargs
        )
        ctx.owns_group = True
    ctx.control_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    log.info(
        "rank %d/%d (local %d/%d) on %s, backend %s",
        world.rank,
        world.world_size,
        launch.local_rank,
        world.local_world_size,
        dev,
        backend,
    )
    return ctx
