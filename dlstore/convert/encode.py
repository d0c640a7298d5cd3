"""Encoding one input for a shard. A complete JPEG that need not shrink is stored as it is. Its
markers are walked, and with `check_decode` its data is decoded once. Anything else is opened
with Pillow, resized when asked, and stored as JPEG. With `keep_format` it keeps its own format.
An input that is not a usable image raises `CorruptSample`.

A cheap check catches truncated files. Pillow parses the header, and a JPEG without its end-of-image
marker near the end is decoded fully before it is accepted. With `check_decode`, the default, every
JPEG input is also entropy-decoded whole. That is what the loader's first decode of a sample does,
so the loader need not (`Manifest.decode_checked`).
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, UnidentifiedImageError

from dlstore.convert.options import ConvertOptions
from dlstore.errors import CorruptSample
from dlstore.transforms import check_decodes, jpeg_frame

__all__ = ["encode_input", "jpeg_header", "stored_fields"]

_EXT_OF_FORMAT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "BMP": "bmp", "GIF": "gif", "TIFF": "tiff", "PPM": "ppm"}


def stored_fields() -> set[str]:
    """The members an input can be stored as: JPEG, or with `keep_format` a kept format's."""
    return {"jpg", *_EXT_OF_FORMAT.values()}


def _jpeg_bytes(image: Image.Image, quality: int) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", quality=quality)
    return out.getvalue()


def _shrink(image: Image.Image, max_side: int) -> Image.Image:
    """Scale so the longer side is `max_side`. A DCT-domain downscale at 1/2, 1/4 or 1/8 comes first
    when the JPEG allows, being much cheaper. An antialiased resize follows."""
    w, h = image.size
    scale = max_side / max(w, h)
    target = (max(1, round(w * scale)), max(1, round(h * scale)))
    if image.format == "JPEG":
        image.draft("RGB", target)
    image = image.convert("RGB")
    if image.size != target:
        image = image.resize(target, Image.Resampling.LANCZOS, reducing_gap=3.0)
    return image


def jpeg_header(data: bytes) -> tuple[int, int, int] | None:
    """Width, height and components from a JPEG's frame header, without a decode
    (`transforms.jpeg_frame`). None when this is not a well-formed JPEG start.

    >>> jpeg_header(b"\\xff\\xd8\\xff\\xc0\\x00\\x11\\x08\\x01\\x5e\\x01\\x90\\x03" + bytes(9))
    (400, 350, 3)
    """
    frame = jpeg_frame(data)
    if frame is None or not (frame[2] and frame[3]):
        return None
    return frame[2], frame[3], len(frame[4])


def _encode_array(pixels: np.ndarray, options: ConvertOptions) -> tuple[str, bytes]:
    """A CIFAR/MNIST row as lossless PNG or as JPEG, as `options.image_format` says."""
    image = Image.fromarray(pixels)
    if options.resize_max_side and max(image.size) > options.resize_max_side:
        image = _shrink(image, options.resize_max_side)
    if options.image_format == "jpeg":
        return "jpg", _jpeg_bytes(image, options.quality)
    out = io.BytesIO()
    image.save(out, "PNG")
    return "png", out.getvalue()


def _checked(jpeg: bytes, options: ConvertOptions) -> bytes:
    """`jpeg`, once it decodes as the loader's first decode of it would (`check_decodes`), when
    `options.check_decode`. A JPEG that fails would be skipped in every epoch. Or Pillow, which
    decodes past damage, would shrink or re-encode it with its damage stored as pixels."""
    if options.check_decode:
        check_decodes(jpeg)
    return jpeg


def encode_input(raw: bytes | np.ndarray, options: ConvertOptions) -> tuple[str, bytes]:
    """The field and bytes to store for one input; `CorruptSample` if it is not a usable image."""
    if isinstance(raw, np.ndarray):
        return _encode_array(raw, options)
    # The common case: a complete grey or colour JPEG that need not shrink is stored as it is.
    header = jpeg_header(raw)
    if (
        header is not None
        and header[2] in (1, 3)
        and (not options.resize_max_side or max(header[:2]) <= options.resize_max_side)
        and raw.rfind(b"\xff\xd9", max(0, len(raw) - 4096)) >= 0
    ):
        return "jpg", _checked(raw, options)
    try:
        image = Image.open(io.BytesIO(raw))
        fmt = image.format
        if fmt == "JPEG":  # any mode: a Pillow re-encode would make damaged data a clean JPEG
            _checked(raw, options)
        if options.resize_max_side and max(image.size) > options.resize_max_side:
            return "jpg", _jpeg_bytes(_shrink(image, options.resize_max_side), options.quality)
        if fmt == "JPEG" and image.mode in ("RGB", "L"):
            if raw.rfind(b"\xff\xd9", max(0, len(raw) - 4096)) < 0:
                image.load()  # no end-of-image marker near the end: tell truncation from trailing junk
            return "jpg", raw
        if options.keep_format and fmt in _EXT_OF_FORMAT:
            image.verify()
            return _EXT_OF_FORMAT[fmt], raw
        # Other formats, and JPEG modes decoders handle badly such as CMYK: re-encode as RGB JPEG.
        return "jpg", _jpeg_bytes(image.convert("RGB"), options.quality)
    except CorruptSample:
        raise
    except UnidentifiedImageError:
        raise CorruptSample("not an image format Pillow reads") from None
    except Exception as exc:  # Pillow raises many types for bad input: OSError, SyntaxError, ValueError, …
        raise CorruptSample(f"{type(exc).__name__}: {exc}") from None
