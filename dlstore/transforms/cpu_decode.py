"""CPU decode and resize: image bytes in, uint8 HWC arrays out.

Three optional native parts speed it up: simplejpeg, OpenCV and `jpeg_region`, this package's
C part. `jpeg_region` decodes a crop's region only, and `crop_rows` builds many rows of a batch
from JPEGs in one call, with the GIL released once: decode, antialiased resize and flip. Without
them Pillow works. `dlstore doctor` says which ran.
"""

from __future__ import annotations

import functools
import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from dlstore.config import TransformConfig
from dlstore.errors import ConfigError, CorruptSample
from dlstore.transforms.crops import crop_plan

try:  # libjpeg-turbo through simplejpeg
    import simplejpeg
except ImportError:  # pragma: no cover - optional speed-up
    simplejpeg = None

try:  # built at install where libjpeg-turbo's headers are there
    import dlstore.transforms.jpeg_region as jpeg_region
except ImportError:  # pragma: no cover - optional speed-up; whole images are decoded instead
    jpeg_region = None

try:  # OpenCV's SIMD resize
    import cv2
except ImportError:  # pragma: no cover - optional speed-up; Pillow resizes instead
    cv2 = None


JPEG_MAGIC = b"\xff\xd8"


def decode_image(data: bytes) -> Image.Image:
    """Decode image bytes to RGB: JPEGs by libjpeg-turbo if present, the rest by Pillow.
    Raises `CorruptSample` for bytes that are not a readable image."""
    try:
        if simplejpeg is not None and data[:2] == JPEG_MAGIC:
            array = simplejpeg.decode_jpeg(data, colorspace="RGB")
            return Image.frombuffer("RGB", (array.shape[1], array.shape[0]), array, "raw", "RGB", 0, 1)
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as exc:  # decoders raise many types; all mean "bad bytes"
        raise CorruptSample(f"cannot decode image ({len(data)} bytes): {exc}") from None
    return image if image.mode == "RGB" else image.convert("RGB")


def transform_image(data: bytes, cfg: TransformConfig, rng: np.random.Generator | None = None) -> np.ndarray:
    """Bytes to a uint8 array of `image_size` x `image_size` x 3, by the preset in `cfg`.

    >>> transform_image(jpeg_bytes, TransformConfig("eval", 224)).shape   # doctest: +SKIP
    (224, 224, 3)
    """
    return resize_crop(decode_for_crop(data, cfg, rng), cfg)


@dataclass(frozen=True)
class CropSource:
    """A decoded uint8 HWC RGB image, its crop box in the image's pixels, and its flip.
    `decode_for_crop` gives it and `resize_crop` takes it."""

    pixels: np.ndarray
    box: tuple[float, float, float, float]
    flip: bool


def decode_for_crop(
    data: bytes, cfg: TransformConfig, rng: np.random.Generator | None = None, known_to_decode: bool = False
) -> CropSource:
    """Decode `data` and draw its crop: the first half of `transform_image`.
    It stands apart so a caller can time it. The draws are `augment_image`'s. A JPEG decodes at
    the smallest of 1/2, 1/4 and 1/8 scale where the box still covers `cfg.image_size`. The box is
    scaled with the image. With `jpeg_region`, a box on whole pixels decodes alone, to the same
    pixels. The rows below it are still read, so bad data fails as a whole decode would. With
    `known_to_decode`, for bytes that decoded before, they are not read at all.

    >>> resize_crop(decode_for_crop(jpeg_bytes, cfg, rng), cfg).shape   # doctest: +SKIP
    (224, 224, 3)
    """
    if simplejpeg is None or data[:2] != JPEG_MAGIC:
        image = decode_image(data)
        box, flip = crop_plan(image.width, image.height, cfg, rng)
        return CropSource(np.asarray(image), box, flip)
    height, width = _jpeg_size(data)
    box, flip = crop_plan(width, height, cfg, rng)
    scale = _decode_scale(box, cfg)
    if jpeg_region is not None and cfg.preset != "none":
        region = _decode_region(data, (height, width), box, scale, check_all=not known_to_decode)
        if region is not None:
            return CropSource(region[0], region[1], flip)
    scaled = (math.ceil(height * scale), math.ceil(width * scale))
    pixels = _decode_jpeg(data, scaled)
    if pixels.shape[:2] != scaled:  # libjpeg-turbo chose another scale, for tiny images only
        pixels, scale = _decode_jpeg(data, (height, width)), 1.0
    return CropSource(pixels, tuple(v * scale for v in box), flip)


def resize_crop(source: CropSource, cfg: TransformConfig, out: np.ndarray | None = None) -> np.ndarray:
    """The crop, resize and flip of `transform_image`, its second half, on a `CropSource`.
    The "none" preset keeps the decoded image as it is. `out`, such as a batch row, receives the
    image and is returned. OpenCV and torch write into it directly."""
    if cfg.preset == "none":
        pixels = source.pixels
    else:
        pixels = _resize(source.pixels, source.box, source.flip, cfg.image_size, out)
    if out is None or pixels is out:
        return pixels
    if pixels.shape != out.shape:  # only "none" keeps a size of its own
        raise _kept_size_error(pixels.shape[1], pixels.shape[0], out.shape[1], out.shape[0])
    out[...] = pixels
    return out


def builds_rows_natively(cfg: TransformConfig) -> bool:
    """Whether `crop_rows` serves `cfg`: the C part is built, and the preset crops."""
    return jpeg_region is not None and hasattr(jpeg_region, "crop_rows") and cfg.preset != "none"


def is_jpeg(data) -> bool:
    """Whether `data` starts as a JPEG: `crop_rows` takes it, else the per-image path decodes it."""
    return data[:2] == JPEG_MAGIC


def crop_rows(jobs: list[tuple], cfg: TransformConfig, out: np.ndarray) -> list[str | None]:
    """Decode, crop, resize and flip each JPEG of `jobs` into its row of `out`, in one C call.

    A job is `(data, seed, epoch, sample_id, check_all, row)`: C reads the JPEG's size and draws
    the box and flip that `crop_plan` draws with `sample_rng(seed, epoch, sample_id)`, the same
    numbers, so no Python runs per sample. Or `(data, left, top, right, bottom, flip, check_all,
    row)`, for a box of the caller's. `row` is a row of `out` (uint8, rows x size x size x 3,
    C-contiguous); `check_all`, whether to read the whole stream. Each JPEG decodes at
    `decode_for_crop`'s scale. The pixels are within rounding of `transform_image`'s. The result
    is None per row written, else libjpeg's complaint; the caller then takes the per-image path,
    which raises `CorruptSample` where it should."""
    return jpeg_region.crop_rows(jobs, out, crop_params(cfg))


def crop_params(cfg: TransformConfig) -> tuple:
    """`cfg`'s crop as `crop_rows`' C call takes it, as `jpeg_region.start_rows` does too."""
    return (cfg.image_size, cfg.preset == "train", cfg.hflip, *cfg.scale, *cfg.ratio, cfg.crop_ratio)


def check_kept_size(data: bytes, size: int) -> None:
    """Raise `ConfigError` for a JPEG stored at another size than `size` x `size`.
    For the "none" preset. The header tells, so a huge image is refused before its decode."""
    if data[:2] != JPEG_MAGIC or simplejpeg is None:
        return
    height, width = _jpeg_size(data)
    if (width, height) != (size, size):
        raise _kept_size_error(width, height, size, size)


def _kept_size_error(width: int, height: int, batch_width: int, batch_height: int) -> ConfigError:
    return ConfigError(
        f"transform 'none' keeps images as stored, and this one is {width}x{height} where the batch holds "
        f"{batch_width}x{batch_height}: store the images at the image size, or use another transform"
    )


def augment_image(
    image: Image.Image | np.ndarray, cfg: TransformConfig, rng: np.random.Generator | None = None
) -> np.ndarray:
    """The crop, resize and flip of `transform_image`, on an image decoded at its stored size.

    `image` is a Pillow image or a uint8 HWC RGB array. `decode_for_crop` + `resize_crop`
    is cheaper: it may decode at a reduced scale and builds no Pillow image.

    >>> augment_image(decode_image(jpeg_bytes), TransformConfig("train", 224), rng).shape   # doctest: +SKIP
    (224, 224, 3)
    """
    if cfg.preset == "none":
        return np.asarray(image)
    height, width = (image.height, image.width) if isinstance(image, Image.Image) else image.shape[:2]
    box, flip = crop_plan(width, height, cfg, rng)
    return _resize(image, box, flip, cfg.image_size)


def _jpeg_size(data: bytes) -> tuple[int, int]:
    try:
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    except Exception as exc:  # decoders raise many types; all mean "bad bytes"
        raise CorruptSample(f"cannot decode image ({len(data)} bytes): {exc}") from None
    return height, width


def _decode_jpeg(data: bytes, size: tuple[int, int]) -> np.ndarray:
    """The JPEG as uint8 HWC RGB, at the smallest libjpeg-turbo scale of at least `size`."""
    try:
        return simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=size[0], min_width=size[1])
    except Exception as exc:  # decoders raise many types; all mean "bad bytes"
        raise CorruptSample(f"cannot decode image ({len(data)} bytes): {exc}") from None


def _decode_region(data: bytes, shape: tuple[int, int], box, scale: float, check_all: bool = True):
    """The part of the JPEG that the resize of `box` reads, decoded at `scale`, and its box.
    None where the crop-only decoder does not serve: a fractional box, or a JPEG it does not take.
    The caller then decodes the whole image, which also tells a corrupt one. The result is bit for
    bit the whole-image transform's. The region reaches one pixel past the box, so that column's
    upsampling sees the region's edge. Pillow's output for a fractional box would shift here."""
    left, top, right, bottom = (v * scale for v in box)
    if not all(float(v).is_integer() for v in (left, top, right, bottom)):
        return None
    denom = round(1 / scale)
    height, width = -(-shape[0] // denom), -(-shape[1] // denom)  # libjpeg's scaled size
    x, y = max(0, int(left) - 1), max(0, int(top) - 1)
    x_end, y_end = min(width, int(right) + 1), min(height, int(bottom) + 1)
    try:
        buffer, x0, region_width = jpeg_region.decode_region(data, x, y, x_end - x, y_end - y, denom, check_all)
    except ValueError:
        return None
    pixels = np.frombuffer(buffer, dtype=np.uint8).reshape(y_end - y, region_width, 3)
    return pixels, (left - x0, top - y, right - x0, bottom - y)


def can_check_decodes() -> bool:
    """Whether `check_decodes` checks JPEGs as the crop-only decode does.
    Not without simplejpeg: Pillow decodes past damaged data."""
    return simplejpeg is not None


def check_decodes(data: bytes) -> None:
    """Raise `CorruptSample` where `decode_for_crop` would for these bytes, whatever the crop.
    It checks as a sample's first decode does: every row read, libjpeg's warnings as errors. At
    1/8 scale the cost is mostly the entropy decode that finds bad data. `dlstore convert` runs
    it on every JPEG, so a first epoch may decode crop-only. The verdict is this build's."""
    if simplejpeg is None or data[:2] != JPEG_MAGIC:
        decode_image(data)
        return
    height, width = _jpeg_size(data)
    if jpeg_region is not None:
        try:
            jpeg_region.decode_region(data, 0, 0, -(-width // 8), -(-height // 8), 8, True)
            return
        except ValueError:
            pass  # as in `decode_for_crop`, the whole decode decides
    _decode_jpeg(data, (1, 1))


def _decode_scale(box, cfg: TransformConfig) -> float:
    """The smallest of 1/8, 1/4 and 1/2 at which `box` still covers the output size, else 1.
    The resize then shrinks, antialiased, and loses no detail the output could show. Other k/8
    scales do not pay: libjpeg-turbo has no SIMD inverse DCT for them."""
    if cfg.preset == "none":
        return 1.0
    short_side = min(box[2] - box[0], box[3] - box[1])
    return next((scale for scale in (0.125, 0.25, 0.5) if short_side * scale >= cfg.image_size), 1.0)


def _resize(image: Image.Image | np.ndarray, box, flip: bool, size: int, out: np.ndarray | None = None) -> np.ndarray:
    """Crop `box`, resize to `size` x `size`, antialiased when shrinking, and flip if asked.
    A whole-pixel box goes to torch's SIMD resize, exactly torchvision's antialiased
    `resized_crop`, or else to OpenCV. A fractional box goes to Pillow, which resamples it
    exactly: rounding would move the crop by up to half a pixel."""
    whole_pixels = all(float(v).is_integer() for v in box)
    if whole_pixels and torch_resizes_uint8():
        return _resize_with_torch(np.asarray(image), box, flip, size, out)
    if cv2 is None or not whole_pixels:
        return _resize_with_pillow(image, box, flip, size)
    return _resize_with_opencv(np.asarray(image), box, flip, size, out)


@functools.cache
def torch_resizes_uint8() -> bool:
    """Whether torch has its SIMD antialiased resize of uint8 images, on x86 AVX2 and up.
    The generic kernel is slower than OpenCV's and splits work over torch's threads."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency; the transforms need not be
        return False
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _resize_with_torch(pixels: np.ndarray, box, flip: bool, size: int, out: np.ndarray | None = None) -> np.ndarray:
    """torch's antialiased bilinear resize of the crop: torchvision's RandomResizedCrop step.
    It is serial for uint8, and writes into `out` or a new HWC array. HWC arrays are NCHW
    tensors in channels_last memory, the SIMD kernel's layout. Its out= form keeps that layout;
    `interpolate` would return NCHW and need a copy back."""
    import torch

    left, top, right, bottom = (int(v) for v in box)
    crop = pixels[top:bottom, left:right]
    if not (crop.flags.c_contiguous and crop.flags.writeable):  # torch takes no read-only arrays
        crop = np.array(crop)
    target = out if out is not None else np.empty((size, size, 3), dtype=np.uint8)
    # NCHW views made by numpy, one torch call each: every torch call lets go of the GIL.
    source = torch.from_numpy(crop.transpose(2, 0, 1)[np.newaxis])
    dest = torch.from_numpy(target.transpose(2, 0, 1)[np.newaxis])
    try:
        torch.ops.aten._upsample_bilinear2d_aa.out(source, [size, size], False, None, None, out=dest)
    except (AttributeError, RuntimeError, TypeError):  # pragma: no cover - a torch without that form
        import torch.nn.functional as functional

        dest.copy_(functional.interpolate(source, size=(size, size), mode="bilinear", antialias=True))
    if flip:
        if cv2 is not None:
            cv2.flip(target, 1, dst=target)
        else:
            target[...] = target[:, ::-1].copy()
    return target


def _resize_with_pillow(image: Image.Image | np.ndarray, box, flip: bool, size: int) -> np.ndarray:
    if isinstance(image, np.ndarray):
        pixels = np.ascontiguousarray(image)
        image = Image.frombuffer("RGB", (pixels.shape[1], pixels.shape[0]), pixels, "raw", "RGB", 0, 1)
    # One resample from the crop box: crop and resize in a single pass over the pixels.
    out = image.resize((size, size), Image.Resampling.BILINEAR, box=box, reducing_gap=None)
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(out)


def _resize_with_opencv(pixels: np.ndarray, box, flip: bool, size: int, out: np.ndarray | None = None) -> np.ndarray:
    """OpenCV's resize of the crop: INTER_AREA where it shrinks, INTER_LINEAR where it grows.
    OpenCV releases the GIL and keeps no state between calls. The last step writes into `out`
    when it fits; otherwise OpenCV makes a new array and `resize_crop` copies."""
    left, top, right, bottom = (int(v) for v in box)
    crop = pixels[top:bottom, left:right]
    crop_height, crop_width = crop.shape[:2]
    # If one side shrinks and the other grows, INTER_AREA would sample the shrinking side.
    # So that side is shrunk alone first.
    if crop_width > size > crop_height:
        crop = cv2.resize(crop, (size, crop_height), interpolation=cv2.INTER_AREA)
    elif crop_height > size > crop_width:
        crop = cv2.resize(crop, (crop_width, size), interpolation=cv2.INTER_AREA)
    shrinks = crop.shape[0] >= size and crop.shape[1] >= size
    interpolation = cv2.INTER_AREA if shrinks else cv2.INTER_LINEAR
    if flip:
        return cv2.flip(cv2.resize(crop, (size, size), interpolation=interpolation), 1, dst=out)
    return cv2.resize(crop, (size, size), dst=out, interpolation=interpolation)
