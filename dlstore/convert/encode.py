"""Encoding one input for a shard: a complete JPEG that need not shrink is stored as it is
(checked by walking its markers, not decoded); anything else is opened with Pillow, resized
when asked, and stored as JPEG (or, with `keep_format`, in its own format). An input that is
not a usable image raises `CorruptSample`.

A cheap check catches truncated files: Pillow parses the header, and a JPEG without its
end-of-image marker near the end is decoded fully before it is accepted.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, UnidentifiedImageError

from dlstore.convert.options import ConvertOptions
from dlstore.errors import CorruptSample

__all__ = ["encode_input", "jpeg_header"]

_EXT_OF_FORMAT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "BMP": "bmp", "GIF": "gif", "TIFF": "tiff", "PPM": "ppm"}


def _jpeg_bytes(image: Image.Image, quality: int) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", quality=quality)
    return out.getvalue()


def _shrink(image: Image.Image, max_side: int) -> Image.Image:
    """Scale so the longer side is `max_side`: a DCT-domain downscale first when the JPEG
    allows (decoding at 1/2, 1/4 or 1/8 is several times cheaper), then an antialiased resize."""
    w, h = image.size
    scale = max_side / max(w, h)
    target = (max(1, round(w * scale)), max(1, round(h * scale)))
    if image.format == "JPEG":
        image.draft("RGB", target)
    image = image.convert("RGB")
    if image.size != target:
        image = image.resize(target, Image.Resampling.LANCZOS, reducing_gap=3.0)
    return image


_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def jpeg_header(data: bytes) -> tuple[int, int, int] | None:
    """(width, height, components) from a JPEG's frame header, walking its marker segments
    (~100x cheaper than `PIL.Image.open`), or None when this is not a well-formed JPEG start.

    >>> jpeg_header(b"\\xff\\xd8\\xff\\xc0\\x00\\x11\\x08\\x01\\x5e\\x01\\x90\\x03" + bytes(9))
    (400, 350, 3)
    """
    if data[:2] != b"\xff\xd8":
        return None
    pos, end = 2, len(data)
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            pos += 2
            continue
        length = (data[pos + 2] << 8) | data[pos + 3]
        if marker in _SOF_MARKERS:
            if length < 8 or pos + 10 > end:
                return None
            height = (data[pos + 5] << 8) | data[pos + 6]
            width = (data[pos + 7] << 8) | data[pos + 8]
            return (width, height, data[pos + 9]) if width and height else None
        if marker == 0xDA or length < 2:  # scan data before any frame header: malformed
            return None
        pos += 2 + length
    return None


def _encode_array(pixels: np.ndarray, options: ConvertOptions) -> tuple[str, bytes]:
    """A CIFAR/MNIST row as PNG (lossless) or JPEG, as `options.image_format` says."""
    image = Image.fromarray(pixels)
    if options.resize_max_side and max(image.size) > options.resize_max_side:
        image = _shrink(image, options.resize_max_side)
    if options.image_format == "jpeg":
        return "jpg", _jpeg_bytes(image, options.quality)
    out = io.BytesIO()
    image.save(out, "PNG")
    return "png", out.getvalue()


def encode_input(raw: bytes | np.ndarray, options: ConvertOptions) -> tuple[str, bytes]:
    """(field, bytes) to store for one input; `CorruptSample` if it is not a usable image."""
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
        return "jpg", raw
    try:
        image = Image.open(io.BytesIO(raw))
        fmt = image.format
        if options.resize_max_side and max(image.size) > options.resize_max_side:
            return "jpg", _jpeg_bytes(_shrink(image, options.resize_max_side), options.quality)
        if fmt == "JPEG" and image.mode in ("RGB", "L"):
            if raw.rfind(b"\xff\xd9", max(0, len(raw) - 4096)) < 0:
                image.load()  # no end-of-image marker near the end: decode to tell truncation from trailing junk
            return "jpg", raw
        if options.keep_format and fmt in _EXT_OF_FORMAT:
            image.verify()
            return _EXT_OF_FORMAT[fmt], raw
        # Other formats and JPEG modes decoders handle badly (CMYK): re-encode as RGB JPEG.
        return "jpg", _jpeg_bytes(image.convert("RGB"), options.quality)
    except UnidentifiedImageError:
        raise CorruptSample("not an image format Pillow reads") from None
    except Exception as exc:  # Pillow raises many types for bad input (OSError, SyntaxError, ValueError, …)
        raise CorruptSample(f"{type(exc).__name__}: {exc}") from None
