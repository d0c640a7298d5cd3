"""One training step and what it is made of: the model, its parameter groups, the precision.

The trainer runs these. The bench and `train.demand` time the very same step on synthetic
data, so "what the GPU demands" is what training asks for.
"""

from __future__ import annotations

import contextlib
import difflib

import torch
from torch import nn

from dlstore.errors import ConfigError

__all__ = [
    "amp_dtype_for",
    "autocast",
    "build_model",
    "image_dtype_for",
    "param_groups",
    "resolve_device",
    "training_step",
]


def resolve_device(device: str) -> torch.device:
    """`device` as a torch device: "cpu", "cuda", "cuda:N", or "auto" for CUDA when there is one.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for, but torch sees no CUDA device")
    return dev


def check_model_name(name: str) -> None:
    """`ConfigError` unless `name` is one of torchvision's classification models.
    Checked before the datasets open, so a typo is not found after minutes of listing and caching."""
    import torchvision

    known = torchvision.models.list_models(module=torchvision.models)
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else f"e.g. {', '.join(known[:12])}, ..."
        raise ConfigError(f"unknown model {name!r}: not a torchvision classification model; {hint}")


def build_model(name: str, num_classes: int) -> nn.Module:
    """A torchvision classification model by name, such as `resnet50`.
    It is randomly initialised with `num_classes` outputs.

    >>> build_model("resnet18", num_classes=10).fc.out_features   # doctest: +SKIP
    10
    """
    # torchvision is the optional "train" extra, and slow to import: loaded only to build a model.
    import torchvision

    try:
        return torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    except ValueError as exc:
        choices = ", ".join(torchvision.models.list_models(module=torchvision.models)[:12])
        raise ConfigError(f"unknown model {name!r} ({exc}); e.g. {choices}, ...") from None


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """SGD parameter groups: `weight_decay` on weight matrices and kernels, none on 1-d ones."""
    # No weight decay on BatchNorm weights and biases, the 1-d parameters. Decaying them only
    # fights the normalisation and costs accuracy, as Goyal et al. 2017, FFCV and timm note.
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim <= 1 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def amp_dtype_for(amp: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype that `amp`, one of "auto", "bf16", "fp16", "none", means on `device`."""
    if amp == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}[amp]


def image_dtype_for(amp_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype the loader hands the step: bf16 under bf16 autocast, else float32.
    The first convolution would cast to bf16 anyway, and normalising writes half the bytes."""
    return torch.bfloat16 if amp_dtype == torch.bfloat16 else torch.float32


def autocast(device: torch.device, amp_dtype: torch.dtype | None):
    """Autocast to `amp_dtype` on `device`, or nothing when it is None."""
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=amp_dtype)


def training_step(
    model: nn.Module,
    criterion: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    amp_dtype: torch.dtype | None,
    images: torch.Tensor,
    labels: torch.Tensor,
    keep_grads: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimiser step: forward under autocast, backward, step. Returns loss and logits.
    No host sync: the caller decides when to look at the numbers. `train.demand` times it.

    `keep_grads` zeroes the gradients rather than dropping them. Under DDP with
    `gradient_as_bucket_view` they are views of the all-reduce buckets. Dropped ones
    would be allocated again and copied into the buckets at every step."""
    with autocast(images.device, amp_dtype):
        logits = model(images)
        loss = criterion(logits, labels)
    optimizer.zero_grad(set_to_none=not keep_grads)
    scaler.scale(loss).backward()  # DDP all-reduces gradients during backward
    scaler.step(optimizer)
    scaler.update()
    return loss, logits
