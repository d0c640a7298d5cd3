"""What the accelerator demands: the trainer's own training step, timed on synthetic data.

The loader-vs-GPU benchmark compares the images/s the model can consume with what the
data path delivers. The ratio is the expected data stall. The step is `step.training_step`,
the one `dlstore train` runs, with the same model, optimiser, AMP and memory format.
It runs on one batch made once on the device, so no loading or copy is in the number.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from dlstore.errors import ConfigError
from dlstore.train.step import (
    amp_dtype_for,
    build_model,
    image_dtype_for,
    param_groups,
    resolve_device,
    training_step,
)

__all__ = ["DemandResult", "measure_training_rate", "precision_name"]


@dataclass(frozen=True)
class DemandResult:
    """One measurement on `device`: `images_per_s` is batch_size * steps / seconds."""

    model: str
    batch_size: int
    image_size: int
    device: str
    precision: str
    channels_last: bool
    compiled: bool
    steps: int
    seconds: float
    images_per_s: float
    step_ms: float

    def to_dict(self) -> dict:
        return asdict(self)


# The names `--amp` takes, as users type and read them; float32 without AMP.
_PRECISION_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", None: "float32"}


def precision_name(amp_dtype: torch.dtype | None) -> str:
    """The precision a step runs in, named as `--amp` names it, or "float32" without AMP.

    >>> precision_name(torch.bfloat16)
    'bf16'
    """
    return _PRECISION_NAMES[amp_dtype]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(step: Callable[[], object], warmup_steps: int, steps: int, device: torch.device) -> float:
    """Seconds for `steps` calls of `step` after `warmup_steps` untimed ones.
    The device is drained before and after, so queued GPU work counts where it was launched."""
    for _ in range(warmup_steps):  # cuDNN autotuning, compilation, allocator warm-up
        step()
    _sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return time.perf_counter() - started


def measure_training_rate(
    model: str = "resnet50",
    *,
    batch_size: int = 256,
    image_size: int = 224,
    num_classes: int = 1000,
    device: str = "auto",
    amp: str = "auto",
    channels_last: bool = True,
    compile: bool = False,
    warmup_steps: int = 5,
    steps: int = 20,
    seed: int = 0,
) -> DemandResult:
    """Time `steps` training steps of `model` on one synthetic batch kept on the device.
    `warmup_steps` untimed ones go first::

        r = measure_training_rate("resnet50", batch_size=256, device="cuda")
        round(r.images_per_s)  # e.g. 3000
    """
    if steps < 1 or warmup_steps < 0 or batch_size < 1:
        raise ConfigError("steps and batch_size must be at least 1, warmup_steps not negative")
    dev = resolve_device(device)
    amp_dtype = amp_dtype_for(amp, dev)
    torch.manual_seed(seed)
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = True  # as the trainer does without --deterministic

    net: nn.Module = build_model(model, num_classes).to(dev)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    net.to(memory_format=memory_format)
    step_model = torch.compile(net) if compile else net
    optimizer = torch.optim.SGD(param_groups(net, 5e-5), lr=0.01, momentum=0.9, nesterov=True)
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16 and dev.type == "cuda")
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    # What the loader hands the trainer: normalised images in the AMP dtype, channels_last.
    images = torch.randn(batch_size, 3, image_size, image_size, device=dev, dtype=image_dtype_for(amp_dtype))
    images = images.contiguous(memory_format=memory_format)
    labels = torch.randint(0, num_classes, (batch_size,), device=dev)
    net.train()

    one_step = functools.partial(training_step, step_model, criterion, optimizer, scaler, amp_dtype, images, labels)
    seconds = _time_steps(one_step, warmup_steps, steps, dev)
    return DemandResult(
        model=model,
        batch_size=batch_size,
        image_size=image_size,
        device=str(dev),
        precision=precision_name(amp_dtype),
        channels_last=channels_last,
        compiled=compile,
        steps=steps,
        seconds=seconds,
        images_per_s=batch_size * steps / seconds,
        step_ms=1000.0 * seconds / steps,
    )
