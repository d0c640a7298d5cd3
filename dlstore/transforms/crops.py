"""Crop planning: the random part of the presets, drawn from a per-sample generator.

The generator is seeded by seed, epoch and sample id. A resumed run then crops and flips
exactly as the uninterrupted one, whatever the worker count. The row builder's C threads draw
the same numbers (crop_draw.c): a change here must change that too, or its test fails.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from dlstore.config import TransformConfig


def sample_rng(seed: int, epoch: int, sample_id: int) -> np.random.Generator:
    """The augmentation randomness of one sample in one epoch; independent of workers and ranks."""
    return np.random.Generator(np.random.Philox(key=_sample_key(seed, epoch, sample_id)))


def _sample_key(seed: int, epoch: int, sample_id: int) -> np.ndarray:
    """Philox's 128-bit key as two uint64 words, made from the ints themselves.
    A Python list would pass through float64, where large and negative seeds collide."""
    mask = 0xFFFFFFFFFFFFFFFF
    return np.array([seed & mask, ((epoch << 40) ^ sample_id) & mask], dtype=np.uint64)


class SampleRngs:
    """`sample_rng`'s generators, with the same draws, for the loader's hot loop.
    One generator per thread is re-keyed for each sample. That is cheaper than a new `Philox`,
    which also reads OS entropy. A generator stays good until its thread asks for the next."""

    def __init__(self) -> None:
        self._mine = threading.local()

    def __call__(self, seed: int, epoch: int, sample_id: int) -> np.random.Generator:
        mine = self._mine
        generator = getattr(mine, "generator", None)
        if generator is None:
            generator = mine.generator = np.random.Generator(np.random.Philox(0))
        generator.bit_generator.state = {  # a fresh Philox: counter and buffer zeroed, buffer used up
            "bit_generator": "Philox",
            "state": {"counter": _ZERO_WORDS, "key": _sample_key(seed, epoch, sample_id)},
            "buffer": _ZERO_WORDS,
            "buffer_pos": 4,
            "has_uint32": 0,
            "uinteger": 0,
        }
        return generator

    def __reduce__(self):  # a thread-local holds nothing worth sending to a worker process
        return (SampleRngs, ())


_ZERO_WORDS = np.zeros(4, dtype=np.uint64)


def _random_resized_box(width: int, height: int, cfg: TransformConfig, rng: np.random.Generator):
    """torchvision's RandomResizedCrop box sampling, driven by our per-sample generator."""
    area = width * height
    log_ratio = (math.log(cfg.ratio[0]), math.log(cfg.ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(cfg.scale[0], cfg.scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            left = int(rng.integers(0, width - w + 1))
            top = int(rng.integers(0, height - h + 1))
            return left, top, left + w, top + h
    # Fallback: centre crop at the nearest allowed aspect ratio.
    in_ratio = width / height
    if in_ratio < cfg.ratio[0]:
        w, h = width, int(round(width / cfg.ratio[0]))
    elif in_ratio > cfg.ratio[1]:
        h, w = height, int(round(height * cfg.ratio[1]))
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def _centre_box(width: int, height: int, cfg: TransformConfig):
    # Resize-then-centre-crop done as one crop of the source and one resize.
    crop = min(width, height) * cfg.crop_ratio
    left, top = (width - crop) / 2, (height - crop) / 2
    return left, top, left + crop, top + crop


def crop_plan(width: int, height: int, cfg: TransformConfig, rng: np.random.Generator | None = None):
    """The source box `(left, top, right, bottom)` and the flip of one sample.
    The CPU path and the device decode share it, so both draw the same crops."""
    if cfg.preset == "train":
        rng = rng if rng is not None else np.random.default_rng()
        box = _random_resized_box(width, height, cfg, rng)
        return box, bool(cfg.hflip and rng.random() < 0.5)
    if cfg.preset == "eval":
        return _centre_box(width, height, cfg), False
    return (0, 0, width, height), False
