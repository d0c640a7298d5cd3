"""The demo, and the synthetic data that it, the tests and the benchmarks use.

* `dlstore.demo.run`: `run_demo`, behind `dlstore demo`, runs the README's main job end to end.
* `dlstore.demo.datagen`: small datasets in the real on-disk formats of ImageNet, ImageFolder,
  CIFAR-10 and MNIST; also `python -m dlstore.demo.datagen`.

>>> from dlstore.demo import make_cifar10
>>> make_cifar10("/tmp/cifar", per_batch=100, test=100).classes[:2]   # doctest: +SKIP
['airplane', 'automobile']

Names are imported on first use. The generators need only NumPy and Pillow, while the demo
pulls in torch, so `dlstore.demo.datagen` stays quick to import.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CIFAR10_CLASSES": "datagen",
    "DemoConfig": "run",
    "GeneratedDataset": "datagen",
    "make_cifar10": "datagen",
    "make_imagefolder": "datagen",
    "make_imagenet": "datagen",
    "make_mnist": "datagen",
    "run_demo": "run",
    "synthetic_image": "datagen",
    "synthetic_jpeg": "datagen",
    "wnids": "datagen",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dlstore.demo' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"dlstore.demo.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
