"""The randomness of one rank: seeds, the RNG states a checkpoint carries, and the switches
that make a CPU run bit for bit reproducible."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

__all__ = ["rng_state", "seed_everything", "set_determinism", "set_rng_state"]


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators.
    The same seed on every rank gives identical initial weights."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_determinism(deterministic: bool) -> None:
    """Deterministic kernels without cuDNN autotuning, or the fastest ones with TF32 and autotuning."""
    if deterministic:
        # cuBLAS reads this when its first handle is made; harmless on the CPU.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    else:
        torch.backends.cudnn.benchmark = True  # fixed input sizes: let cuDNN pick the fastest kernels
        torch.backends.cuda.matmul.allow_tf32 = True  # what is left in float32 under AMP
        torch.backends.cudnn.allow_tf32 = True


def rng_state(device: torch.device) -> dict:
    """This process's RNG states, as tensors and plain values that `weights_only` loads."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "python": random.getstate(),
    }


def set_rng_state(state: dict, device: torch.device) -> None:
    """Restore what `rng_state` returned; on the same rank the streams continue exactly."""
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
