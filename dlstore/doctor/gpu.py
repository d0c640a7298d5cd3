"""torch and torchvision, the GPU, the driver's CUDA against the wheel's, and NCCL.

`gather_torch_facts` looks, importing torch. The checks judge the facts it returns, so tests
can hand them any situation, a GPU node's included.
"""

from __future__ import annotations

import ctypes
import re
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

from dlstore.doctor.check import FAIL, OK, WARN, Check

__all__ = ["TorchFacts", "cuda_check", "driver_cuda_version", "gather_torch_facts", "nccl_check", "torch_check"]

_WHEELS = "https://pytorch.org/get-started/locally (pip install torch torchvision --index-url .../whl/cuXYZ)"


@dataclass(frozen=True)
class TorchFacts:
    """What this process sees of torch, torchvision, CUDA and NCCL."""

    torch_version: str | None = None
    torch_error: str | None = None
    torchvision_version: str | None = None
    torchvision_error: str | None = None
    cuda_build: str | None = None  # torch.version.cuda: None for a CPU-only wheel
    cuda_available: bool = False
    cuda_error: str | None = None  # why torch cannot use the GPU, when it says
    devices: tuple[str, ...] = ()
    driver_cuda: tuple[int, int] | None = None  # what the installed driver supports
    dist_available: bool = False
    nccl_available: bool = False
    nccl_version: str | None = None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def driver_cuda_version() -> tuple[int, int] | None:
    """The CUDA version the NVIDIA driver supports, or None without a driver."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return version.value // 1000, (version.value % 1000) // 10


def gather_torch_facts() -> TorchFacts:
    """Import torch and torchvision and ask them; never raises."""
    driver = driver_cuda_version()
    try:
        # Imported here, not at the top: a broken torch install is what this check reports.
        import torch
        import torch.distributed
    except Exception as exc:  # an ImportError, or an OSError from a missing CUDA library
        return TorchFacts(torch_error=_first_line(exc), driver_cuda=driver)
    tv_version, tv_error = _torchvision(torch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    cuda_error = next((str(w.message).splitlines()[0] for w in caught if "CUDA" in str(w.message)), None)
    devices: tuple[str, ...] = ()
    if available:
        devices = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    elif cuda_error is None and torch.version.cuda and driver is not None:
        try:
            torch.cuda.init()
        except Exception as exc:
            cuda_error = _first_line(exc)
    dist_ok = torch.distributed.is_available()
    nccl_ok = dist_ok and torch.distributed.is_nccl_available()
    nccl_version = None
    if nccl_ok and available:
        version = torch.cuda.nccl.version()
        nccl_version = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return TorchFacts(
        torch_version=torch.__version__,
        torchvision_version=tv_version,
        torchvision_error=tv_error,
        cuda_build=torch.version.cuda,
        cuda_available=available,
        cuda_error=cuda_error,
        devices=devices,
        driver_cuda=driver,
        dist_available=dist_ok,
        nccl_available=nccl_ok,
        nccl_version=nccl_version,
    )


def _torchvision(torch) -> tuple[str | None, str | None]:
    """torchvision's version, and the error of importing it or of running one of its C++ ops.
    A torchvision built for another torch fails there: "operator torchvision::nms does not exist"."""
    try:
        # Imported here: see gather_torch_facts.
        import torchvision
        import torchvision.ops

        torchvision.ops.nms(torch.zeros((0, 4)), torch.zeros(0), 0.5)
    except Exception as exc:
        version = getattr(sys.modules.get("torchvision"), "__version__", None)
        return version, _first_line(exc)
    return torchvision.__version__, None


def _major_minor(version: str | None) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match[1]), int(match[2])) if match else None


def _variant(version: str) -> str:
    """`cu121` of `2.5.1+cu121`; "" for a wheel without one."""
    return version.partition("+")[2]


def torch_check(facts: TorchFacts) -> Check:
    """torch and torchvision import together, as a matching pair."""
    if facts.torch_error:
        return Check("torch", FAIL, f"torch does not import: {facts.torch_error}", f"reinstall torch: {_WHEELS}")
    torch_v = facts.torch_version or "?"
    torch_mm = _major_minor(torch_v)
    expected = f"0.{torch_mm[1] + 15}" if torch_mm and torch_mm[0] == 2 else None  # torch 2.x <-> torchvision 0.(x+15)
    pin = f"torchvision=={expected}.*" if expected else "the torchvision release made for this torch"
    fix = f"pip install {pin} from the same index as torch ({_variant(torch_v) or 'default'} wheels)"
    if facts.torchvision_error:
        tv = f" {facts.torchvision_version}" if facts.torchvision_version else ""
        return Check("torch", FAIL, f"torch {torch_v}, torchvision{tv} fails: {facts.torchvision_error}", fix)
    tv_v = facts.torchvision_version or "?"
    seen = f"torch {torch_v}, torchvision {tv_v}"
    tv_mm = _major_minor(tv_v)
    if expected and tv_mm and f"{tv_mm[0]}.{tv_mm[1]}" != expected:
        return Check(
            "torch", WARN, f"{seen}: torch {torch_mm[0]}.{torch_mm[1]} is made for torchvision {expected}", fix
        )
    if _variant(torch_v) != _variant(tv_v) and _variant(tv_v):
        return Check("torch", WARN, f"{seen}: built for different CUDA variants", fix)
    return Check("torch", OK, f"{seen} import together")


def cuda_check(facts: TorchFacts, env: Mapping[str, str]) -> Check | None:
    """A GPU is visible to torch, and the driver supports the CUDA the wheel was built for."""
    if facts.torch_error:
        return None
    driver, build = facts.driver_cuda, facts.cuda_build
    driver_text = f"{driver[0]}.{driver[1]}" if driver else "none"
    build_mm = _major_minor(build)
    if facts.cuda_available:
        names = sorted(set(facts.devices))
        seen = f"{len(facts.devices)} GPU(s) ({', '.join(names)}); driver CUDA {driver_text}, torch built for {build}"
        if driver and build_mm and build_mm > driver:
            return Check(
                "cuda",
                WARN,
                seen + ": the wheel is newer than the driver (runs by minor-version compatibility)",
                "if kernels fail to load (PTX JIT), update the driver or install a wheel for CUDA "
                f"<= {driver_text}: {_WHEELS}",
            )
        return Check("cuda", OK, seen)
    if driver is None:
        return Check(
            "cuda",
            WARN,
            "no NVIDIA driver (libcuda) on this node: training runs on the CPU",
            "on a GPU node `nvidia-smi` must list the GPUs: Slurm --gres=gpu:N / --gpus-per-task, docker --gpus all",
        )
    if build is None:
        return Check(
            "cuda",
            FAIL,
            f"a CPU-only torch wheel ({facts.torch_version}) on a node whose driver supports CUDA {driver_text}",
            f"install a CUDA wheel for CUDA <= {driver_text}: {_WHEELS}",
        )
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "NoDevFiles"):
        return Check(
            "cuda",
            FAIL,
            f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU",
            "unset it, or let the launcher set it (srun --gpus-per-task=1)",
        )
    if build_mm and build_mm[0] > driver[0]:
        return Check(
            "cuda",
            FAIL,
            f"the driver supports CUDA {driver_text}; this torch wheel needs CUDA {build}",
            f"install a wheel for CUDA <= {driver_text} ({_WHEELS}) or a newer NVIDIA driver",
        )
    return Check(
        "cuda",
        FAIL,
        f"torch cannot use the GPU (driver CUDA {driver_text}, wheel CUDA {build}): {facts.cuda_error or 'no reason given'}",
        "`nvidia-smi` must work; in a container run with --gpus all (NVIDIA container toolkit); dmesg shows Xid errors",
    )


def nccl_check(facts: TorchFacts, world_size: int) -> Check | None:
    """NCCL, which DDP on GPUs needs; gloo does on CPUs."""
    if facts.torch_error:
        return None
    status = FAIL if world_size > 1 else WARN
    fix = f"install the CUDA torch wheel from download.pytorch.org (it bundles NCCL): {_WHEELS}"
    if not facts.dist_available:
        return Check("nccl", status, "this torch is built without torch.distributed", fix)
    if not facts.cuda_available:
        return Check("nccl", OK, "not needed without a GPU (DDP uses gloo)")
    if not facts.nccl_available:
        return Check("nccl", status, "torch.distributed has no NCCL: DDP over GPUs cannot start", fix)
    return Check("nccl", OK, f"NCCL {facts.nccl_version or 'available'}")
