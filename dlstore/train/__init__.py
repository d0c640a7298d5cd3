"""The bundled trainer: torchvision models trained with DDP from a dataset, resumed exactly.

>>> from dlstore.train import TrainConfig, main
>>> main(TrainConfig(train_url="swift://imagenet/train", val_url="swift://imagenet/val",
...                  model="resnet50", checkpoint_url="swift://ckpt/run1", resume="auto"))  # doctest: +SKIP
0

Launch one process per GPU with `torchrun` or `srun`. Names are imported on first use, so
`dlstore.train.config` loads without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EXIT_PREEMPTED": "loop",
    "CheckpointStore": "checkpoint",
    "DemandResult": "demand",
    "DistContext": "dist",
    "Rendezvous": "dist",
    "MetricsLog": "metrics",
    "TrainConfig": "config",
    "Trainer": "loop",
    "build_model": "step",
    "image_size_for_epoch": "config",
    "load_checkpoint_url": "checkpoint",
    "lr_factor": "schedule",
    "main": "loop",
    "measure_training_rate": "demand",
    "read_metrics": "metrics",
    "setup_distributed": "dist",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dlstore.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"dlstore.train.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
