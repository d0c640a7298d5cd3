"""Decode and augmentation presets: bytes in, uint8 HWC arrays out.

Images stay uint8 until they reach the GPU (a quarter of the bytes of float32 through
pinned memory and PCIe); normalisation happens there (`loader.GpuPrefetcher`).
Samples are laid out HWC and batches NHWC, which *is* `channels_last` NCHW memory,
so the GPU side gets channels_last for free with a `permute`.

Augmentation randomness comes from a per-sample generator seeded by
(seed, epoch, sample id), so a resumed run crops and flips exactly as the
uninterrupted one would have, whatever the worker count.
"""

from __future__ import annotations

import io
import math
import threading

import numpy as np
from PIL import Image

from dlstore.config import TransformConfig
from dlstore.errors import CorruptSample

try:  # libjpeg-turbo through simplejpeg: ~1.2x Pillow's JPEG decode here
    import simplejpeg
except ImportError:  # pragma: no cover - optional speed-up
    simplejpeg = None

__all__ = [
    "crop_plan",
    "decode_on_device",
    "device_jpeg",
    "TransformConfig",
    "augment_image",
    "decode_image",
    "sample_rng",
    "transform_image",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
]

IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)

_JPEG_MAGIC = b"\xff\xd8"


def sample_rng(seed: int, epoch: int, sample_id: int) -> np.random.Generator:
    """The augmentation randomness of one sample in one epoch; independent of workers and ranks."""
    return np.random.Generator(np.random.Philox(key=[seed & 0xFFFFFFFFFFFFFFFF, (epoch << 40) ^ sample_id]))


def decode_image(data: bytes) -> Image.Image:
    """Decode image bytes (JPEG fast path via libjpeg-turbo; anything Pillow reads) to RGB.

    Raises `CorruptSample` for bytes that are not a readable image.
    """
    try:
        if simplejpeg is not None and data[:2] == _JPEG_MAGIC:
            array = simplejpeg.decode_jpeg(data, colorspace="RGB")
            return Image.frombuffer("RGB", (array.shape[1], array.shape[0]), array, "raw", "RGB", 0, 1)
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as exc:  # decoders raise many types; all mean "bad bytes"
        raise CorruptSample(f"cannot decode image ({len(data)} bytes): {exc}") from None
    return image if image.mode == "RGB" else image.convert("RGB")


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
    """The source box `(left, top, right, bottom)` and the flip of one sample: the random part
    of the presets, shared by the CPU path and the on-device decode (`decode_on_device`)."""
    if cfg.preset == "train":
        rng = rng if rng is not None else np.random.default_rng()
        box = _random_resized_box(width, height, cfg, rng)
        return box, bool(cfg.hflip and rng.random() < 0.5)
    if cfg.preset == "eval":
        return _centre_box(width, height, cfg), False
    return (0, 0, width, height), False


def device_jpeg(data: bytes) -> tuple[bytes, int, int]:
    """`data` as a JPEG the device decoder takes, with its (width, height), read from the
    header without decoding. nvJPEG (through torchvision) reads baseline and progressive
    RGB or greyscale JPEGs; the rare other image (ImageNet has a few CMYK JPEGs and a PNG
    named .JPEG) is decoded and re-encoded here, on the worker's CPU. `CorruptSample` when
    it is no image."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            if data[:2] == _JPEG_MAGIC and image.mode in ("RGB", "L"):
                return data, image.width, image.height
    except Exception as exc:
        raise CorruptSample(f"cannot read the image header ({len(data)} bytes): {exc}") from None
    image = decode_image(data)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=95)
    return out.getvalue(), image.width, image.height


def decode_on_device(encoded, boxes, image_size: int, device):
    """Decode JPEGs on `device` (nvJPEG on CUDA, batched) and crop, resize and flip them by
    `boxes` rows `(left, top, right, bottom, flip)`; uint8 NHWC out, as the CPU path gives,
    and the positions of the JPEGs that did not decode (left out of the output).

    Decode is most of a sample's CPU cost; on a GPU node with few cores per GPU moving it to
    the device is what lets the loader keep up."""
    import torch
    from torch.nn import functional as F

    device = torch.device(device)
    if not len(encoded):
        return torch.empty((0, image_size, image_size, 3), dtype=torch.uint8, device=device), []
    bad: list[int] = []
    try:
        images = _decode_jpegs(list(encoded), device)
    except (RuntimeError, ValueError):
        # A batched decode gives nothing when one JPEG fails: one at a time finds which.
        images = []
        for position, data in enumerate(encoded):
            try:
                images += _decode_jpegs([data], device)
            except (RuntimeError, ValueError):
                bad.append(position)
        boxes = boxes[[i for i in range(len(encoded)) if i not in bad]]
    out = torch.empty((len(images), image_size, image_size, 3), dtype=torch.uint8, device=device)
    for i, (image, (left, top, right, bottom, flip)) in enumerate(zip(images, boxes.tolist())):
        crop = image[:, int(round(top)) : int(round(bottom)), int(round(left)) : int(round(right))]
        resized = F.interpolate(
            crop[None].float(), size=(image_size, image_size), mode="bilinear", antialias=True, align_corners=False
        )[0]
        if flip:
            resized = resized.flip(-1)
        out[i] = resized.round_().clamp_(0, 255).permute(1, 2, 0).to(torch.uint8)
    return out, bad


def _decode_jpegs(encoded: list, device) -> list:
    import torch
    import torch.utils.deterministic
    import torchvision.io as tio

    if device.type != "cuda":
        return tio.decode_jpeg(encoded, mode=tio.ImageReadMode.RGB, device=device)
    # torchvision's CUDA decoder allocates its outputs on the current stream but writes them
    # from its own, without waiting: memory this stream freed (the last batch's decoded
    # images, still read by queued resize kernels) could be overwritten. Wait here first. In
    # deterministic mode `torch.empty` also queues a fill of new tensors on the current
    # stream, which could land on top of the decoded pixels: off for this call.
    torch.cuda.current_stream(device).synchronize()
    if not torch.are_deterministic_algorithms_enabled():
        return tio.decode_jpeg(encoded, mode=tio.ImageReadMode.RGB, device=device)
    with _FILL_FLAG:  # a process-wide flag: one decode at a time changes it
        fill = torch.utils.deterministic.fill_uninitialized_memory
        torch.utils.deterministic.fill_uninitialized_memory = False
        try:
            return tio.decode_jpeg(encoded, mode=tio.ImageReadMode.RGB, device=device)
        finally:
            torch.utils.deterministic.fill_uninitialized_memory = fill


_FILL_FLAG = threading.Lock()


def transform_image(data: bytes, cfg: TransformConfig, rng: np.random.Generator | None = None) -> np.ndarray:
    """Bytes → uint8 array (image_size, image_size, 3) by the preset in `cfg`.

    >>> transform_image(jpeg_bytes, TransformConfig("eval", 224)).shape   # doctest: +SKIP
    (224, 224, 3)
    """
    return augment_image(decode_image(data), cfg, rng)


def augment_image(image: Image.Image, cfg: TransformConfig, rng: np.random.Generator | None = None) -> np.ndarray:
    """The crop, resize and flip of `transform_image`, on an image already decoded (the
    second half of `transform_image`, apart so that `dlstore bench` can time the two).

    >>> augment_image(decode_image(jpeg_bytes), TransformConfig("train", 224), rng).shape   # doctest: +SKIP
    (224, 224, 3)
    """
    size = (cfg.image_size, cfg.image_size)
    if cfg.preset == "none":
        return np.asarray(image)
    box, flip = crop_plan(image.width, image.height, cfg, rng)
    # One resample from the crop box: crop and resize in a single pass over the pixels.
    out = image.resize(size, Image.Resampling.BILINEAR, box=box, reducing_gap=None)
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(out)
