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

import functools
import importlib
import io
import math
import threading
from dataclasses import dataclass

import numpy as np
from PIL import Image

from dlstore.config import DEVICE_DECODERS, TransformConfig
from dlstore.errors import ConfigError, CorruptSample, DlstoreError

try:  # libjpeg-turbo through simplejpeg: ~1.2x Pillow's JPEG decode here
    import simplejpeg
except ImportError:  # pragma: no cover - optional speed-up
    simplejpeg = None

try:  # the crop-only decode (dlstore/_jpeg_region.c), built at install when libjpeg-turbo's headers are there
    from dlstore import _jpeg_region
except ImportError:  # pragma: no cover - optional speed-up; whole images are decoded instead
    _jpeg_region = None

try:  # OpenCV's SIMD resize: ~1.6x Pillow's resize of a crop here (tools/bench_transform.py)
    import cv2
except ImportError:  # pragma: no cover - optional speed-up; Pillow resizes instead
    cv2 = None

__all__ = [
    "crop_plan",
    "jpeg_frame",
    "decode_on_device",
    "device_jpeg",
    "device_jpeg_decoder",
    "DEVICE_DECODERS",
    "NvImageCodecJpegDecoder",
    "TorchvisionJpegDecoder",
    "TransformConfig",
    "augment_image",
    "CropSource",
    "can_check_decodes",
    "check_decodes",
    "decode_for_crop",
    "decode_image",
    "resize_crop",
    "sample_rng",
    "SampleRngs",
    "transform_image",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
]

IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)

_JPEG_MAGIC = b"\xff\xd8"


def sample_rng(seed: int, epoch: int, sample_id: int) -> np.random.Generator:
    """The augmentation randomness of one sample in one epoch; independent of workers and ranks."""
    return np.random.Generator(np.random.Philox(key=_sample_key(seed, epoch, sample_id)))


def _sample_key(seed: int, epoch: int, sample_id: int) -> np.ndarray:
    """Philox's 128-bit key, as two uint64 words made from the ints themselves: a list went
    through float64 past 2**63, so every negative seed drew the same crops (and seeds past
    2**63 did in blocks of 2,048). Seeds in [0, 2**63) keep their draws."""
    mask = 0xFFFFFFFFFFFFFFFF
    return np.array([seed & mask, ((epoch << 40) ^ sample_id) & mask], dtype=np.uint64)


class SampleRngs:
    """`sample_rng`'s generators for the loader's hot loop, with the same draws: one generator
    per thread, re-keyed for each sample. Why: a new `Philox` costs ~11 us (an OS entropy read
    among it, which also lets go of the GIL), a re-key ~2. A generator it returns is good until
    the same thread asks for the next one."""

    def __init__(self) -> None:
        self._mine = threading.local()

    def __call__(self, seed: int, epoch: int, sample_id: int) -> np.random.Generator:
        mine = self._mine
        generator = getattr(mine, "generator", None)
        if generator is None:
            generator = mine.generator = np.random.Generator(np.random.Philox(0))
        # A fresh Philox's state: counter and buffer zeroed, the buffer used up.
        generator.bit_generator.state = {
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
    frame header without decoding. nvJPEG (through torchvision) reads 8-bit baseline and
    progressive JPEGs, greyscale or YCbCr; the rare other image (ImageNet has a few CMYK
    JPEGs and a PNG named .JPEG; arithmetic-coded, lossless and 12-bit JPEGs exist) is
    decoded and re-encoded here, on the worker's CPU, as the CPU path would read it.
    `CorruptSample` when it is no image, or a JPEG cut short."""
    frame = jpeg_frame(data)
    if frame is not None and _device_decodes(*frame):
        if not _ends_after_its_last_scan(data):
            # nvJPEG's hardware decoder may decode what is there and say nothing.
            raise CorruptSample(f"truncated JPEG ({len(data)} bytes): no end-of-image marker after its last scan")
        return data, frame[2], frame[3]
    image = decode_image(data)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=95)
    return out.getvalue(), image.width, image.height


def _ends_after_its_last_scan(data: bytes) -> bool:
    """Whether the JPEG's last start-of-scan marker is followed by an end-of-image marker: not
    so in a file cut short. (Scan data never holds FF D9: an FF there is followed by 00 or a
    restart marker. An EXIF thumbnail's own scan and end come before the image's scans.)"""
    last_scan = data.rfind(b"\xff\xda")
    return last_scan >= 0 and data.find(b"\xff\xd9", last_scan + 2) >= 0


# Start-of-frame markers (0xC4, 0xC8 and 0xCC, in their range, are other segments).
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# What nvJPEG decodes, its hardware decoder included: Huffman-coded baseline (0xC0) and
# progressive (0xC2) frames of 8-bit samples, greyscale or YCbCr 4:4:4, 4:2:2 or 4:2:0 (chroma
# sampled 1x1, luma 1x1, 2x1 or 2x2). Not: extended sequential (0xC1), lossless (0xC3),
# hierarchical (0xC5-0xC7) and arithmetic-coded (0xC9-0xCB, 0xCD-0xCF) frames, 12-bit
# samples, other chroma layouts (4:4:0, 4:1:1, odd factors) nor four components (CMYK).
_DEVICE_FRAMES = frozenset({0xC0, 0xC2})
_DEVICE_LUMA_SAMPLING = frozenset({(1, 1), (2, 1), (2, 2)})


def jpeg_frame(data: bytes) -> tuple[int, int, int, int, tuple] | None:
    """The frame header of JPEG `data`: (SOF marker, sample precision, width, height, each
    component's (horizontal, vertical) sampling factors), found by walking the marker segments
    before it (no decode, ~100x cheaper than `PIL.Image.open`); None when `data` does not
    start as a well-formed JPEG."""
    if data[:2] != _JPEG_MAGIC:
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
            components = data[pos + 9] if pos + 10 <= end else 0
            if not components or length != 8 + 3 * components or pos + 2 + length > end:
                return None
            factors = data[pos + 11 : pos + 11 + 3 * components : 3]
            width, height = (data[pos + 7] << 8) | data[pos + 8], (data[pos + 5] << 8) | data[pos + 6]
            return marker, data[pos + 4], width, height, tuple((f >> 4, f & 0x0F) for f in factors)
        if marker == 0xDA or length < 2:  # scan data before any frame header: malformed
            return None
        pos += 2 + length
    return None


def _device_decodes(marker: int, precision: int, width: int, height: int, sampling: tuple) -> bool:
    """Whether nvJPEG decodes a JPEG of this frame header (`jpeg_frame`; see `_DEVICE_FRAMES`)."""
    if marker not in _DEVICE_FRAMES or precision != 8 or not (width and height):
        return False
    if len(sampling) == 1:
        return True
    luma, *chroma = sampling
    return len(chroma) == 2 and luma in _DEVICE_LUMA_SAMPLING and chroma == [(1, 1), (1, 1)]


def decode_on_device(encoded, boxes, image_size: int, device, decoder: DeviceJpegDecoder | None = None):
    """Decode JPEGs on `device` (batched, by `decoder`: torchvision's nvJPEG unless given) and
    crop, resize and flip them by `boxes` rows `(left, top, right, bottom, flip)`; uint8 NHWC
    out, as the CPU path gives, and the positions of the JPEGs that did not decode (left out of
    the output).

    Decode is most of a sample's CPU cost; on a GPU node with few cores per GPU moving it to
    the device is what lets the loader keep up."""
    import torch  # loaded on first use, as torchvision below: not needed to decode on the CPU

    device = torch.device(device)
    decoder = decoder if decoder is not None else TorchvisionJpegDecoder(device)
    images, bad = decoder.decode(list(encoded))
    if bad:
        boxes = boxes[[i for i in range(len(encoded)) if i not in bad]]
    out = torch.empty((len(images), image_size, image_size, 3), dtype=torch.uint8, device=device)
    shapes = [tuple(image.shape[1:]) for image in images]
    chunks = list(_resample_chunks(shapes, image_size))
    groups = [_shape_groups(shapes[start:end]) for start, end in chunks]
    # All that the weights are made of, in one copy to the device: a copy from pageable memory
    # waits for the work queued on the stream, and one per chunk made this thread wait for the
    # GPU (under a training load, behind the model's kernels) several times a batch.
    order = [start + i for (start, _), chunk in zip(chunks, groups) for members in chunk.values() for i in members]
    table = torch.cat(
        [boxes.to(torch.float64).reshape(-1, 5), torch.tensor(shapes, dtype=torch.float64).reshape(-1, 2),
         torch.tensor(order, dtype=torch.float64)[:, None]],
        dim=1,
    )  # fmt: skip
    if device.type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)
    for (start, end), chunk in zip(chunks, groups):
        _resample_chunk(images[start:end], table[start:end], chunk, out[start:end])
    decoder.done_with(images)
    return out, bad


class TorchvisionJpegDecoder:
    """nvJPEG through torchvision, batched (on a CPU device torchvision's CPU decoder, which
    the tests use as a stand-in). Each decode waits for the work queued on the caller's stream
    first (`_decode_jpegs` says why)."""

    name = "torchvision"

    def __init__(self, device) -> None:
        import torch

        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # torchvision keeps one nvJPEG decoder and makes another (leaking the first) for a
            # device spelled otherwise: "cuda" and "cuda:0" are two.
            self.device = torch.device("cuda", torch.cuda.current_device())

    def decode(self, encoded: list) -> tuple[list, list[int]]:
        """(3, h, w) uint8 images of the JPEGs (uint8 tensors) that decode, and the positions of
        those that do not."""
        return _decode_all(encoded, self.device)

    def done_with(self, images: list) -> None:
        """Nothing to keep: the next decode waits for the stream that reads them."""


class NvImageCodecJpegDecoder:
    """nvImageCodec (`pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg`), batched. On GPUs
    with JPEG engines (A100, H100, H200) it decodes there rather than on the SMs the model
    trains on, and it releases the GIL while it decodes; JPEGs the engines do not take go to
    its hybrid decoder (Huffman on the CPU, the rest on the GPU). Made once per loader:
    making one starts its threads and streams."""

    name = "nvimgcodec"

    def __init__(self, device) -> None:
        import torch

        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"nvImageCodec decodes on a CUDA device, not {self.device}")
        nvimgcodec = importlib.import_module("nvidia.nvimgcodec")  # ImportError where it is not installed

        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)  # the decoding thread may have another current device
        kinds = (nvimgcodec.BackendKind.HW_GPU_ONLY, nvimgcodec.BackendKind.HYBRID_CPU_GPU)
        self.codec = nvimgcodec
        self.decoder = nvimgcodec.Decoder(device_id=index, backends=[nvimgcodec.Backend(kind) for kind in kinds])
        # As torchvision and the CPU path: RGB, EXIF orientation not applied.
        self.params = nvimgcodec.DecodeParams(
            apply_exif_orientation=False,
            color_spec=nvimgcodec.ColorSpec.SRGB,
            sample_format=nvimgcodec.SampleFormat.I_RGB,
        )
        # Decoded batches whose memory queued kernels may still read: (event, images).
        self._in_use: list[tuple] = []

    def decode(self, encoded: list) -> tuple[list, list[int]]:
        import torch

        stream = torch.cuda.current_stream(self.device)
        sources = [self.codec.CodeStream(part.numpy()) for part in encoded]
        decoded = self.decoder.decode(sources, params=self.params, cuda_stream=stream.cuda_stream)
        bad = [i for i, image in enumerate(decoded) if image is None]
        for i in bad:
            _check_the_data_is_bad(encoded[i], f"nvImageCodec on {self.device}")
        images = [image for image in decoded if image is not None]
        # The images are ready on the stream they name; ours waits for it (no host wait).
        for other in {image.cuda_stream for image in images} - {0, stream.cuda_stream}:
            stream.wait_stream(torch.cuda.ExternalStream(other, device=self.device))
        self._in_use = [(event, kept) for event, kept in self._in_use if not event.query()]
        return [torch.as_tensor(image, device=self.device).permute(2, 0, 1) for image in images], bad

    def done_with(self, images: list) -> None:
        """Keep `images` until the kernels queued on this stream that read them have run: their
        memory is nvImageCodec's, which torch's allocator does not track (`record_stream`).
        nvImageCodec frees an image in order on the stream it names (ours, as `decode` asks);
        this also holds images that name another stream."""
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._in_use.append((event, images))


DeviceJpegDecoder = TorchvisionJpegDecoder | NvImageCodecJpegDecoder


def device_jpeg_decoder(name: str, device) -> DeviceJpegDecoder:
    """The JPEG decoder of `decode_on="device"` (`DataConfig.device_decoder`): "torchvision"
    (nvJPEG on the SMs) or "nvimgcodec" (the GPU's JPEG engines where it has them).

    Why torchvision by default: on an H200, nvImageCodec's engines decoded 256 JPEGs of 500x375
    as fast as nvJPEG on the SMs (16,600 and 17,100 img/s alone) and released the GIL, yet
    ResNet-50 fed by it (tools/bench_gpu.py) trained no faster, and slower with images stored at
    341 px (0.82 of synthetic against 0.89-0.90)."""
    if name not in DEVICE_DECODERS:
        raise ConfigError(f"device_decoder must be one of {DEVICE_DECODERS}, not {name!r}")
    if name == "torchvision":
        return TorchvisionJpegDecoder(device)
    try:
        return NvImageCodecJpegDecoder(device)
    except (ImportError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"device_decoder='nvimgcodec' cannot decode on {device}: {exc}") from exc


def _check_the_data_is_bad(encoded, decoder: str, error: BaseException | None = None) -> None:
    """Raise unless the JPEG (a uint8 tensor) that `decoder` refused is bad data, which the CPU
    cannot decode either. Why: a decoder that fails whatever it is given (a torchvision built
    without nvJPEG, nvJPEG failing to start, the device out of memory) looked like corrupt
    data, every sample was skipped as such, and a run went through its epochs training on
    nothing. The worker reads only a JPEG's headers (`device_jpeg`), so this is rare, and
    decoding one image on the CPU here costs little."""
    try:
        decode_image(encoded.numpy().tobytes())
    except CorruptSample:
        return
    why = f": {error}" if error is not None else ""
    raise DlstoreError(
        f"{decoder} cannot decode a JPEG that decodes on the CPU{why}; decode on the CPU "
        "(decode_on='worker') if the device decoder does not work here"
    ) from error


def _decode_all(encoded: list, device, first: int = 0) -> tuple[list, list[int]]:
    """The images of `encoded` that decode, and the positions (counted from `first`) of those
    that do not. A batched decode gives nothing when one JPEG fails; halving the batch until
    each failure is alone finds a bad JPEG in about 2 log2(n) decodes rather than n."""
    if not encoded:
        return [], []
    try:
        return _decode_jpegs(encoded, device), []
    except (RuntimeError, ValueError) as exc:
        if len(encoded) == 1:
            _check_the_data_is_bad(encoded[0], f"torchvision's nvJPEG decoder on {device}", exc)
            return [], [first]
    half = len(encoded) // 2
    head, bad_head = _decode_all(encoded[:half], device, first)
    tail, bad_tail = _decode_all(encoded[half:], device, first + half)
    return head + tail, bad_head + bad_tail


# Floats that the resampling weights and the float copies of decoded images may take at
# once (128 MiB): a batch of large images is resampled in parts rather than all at once.
_RESAMPLE_FLOATS = 1 << 25


def _resample_chunks(shapes: list, size: int, budget: int = _RESAMPLE_FLOATS):
    """Ranges `(start, end)` of the images of decoded `shapes` ((height, width) each) whose
    weights (two temporaries of `_triangle_weights` per axis) and float copies fit `budget`."""
    start, tallest, widest, pixels = 0, 0, 0, 0
    for i, (height, width) in enumerate(shapes):
        tallest, widest, pixels = max(tallest, height), max(widest, width), pixels + 3 * height * width
        if i > start and 2 * (i + 1 - start) * size * (tallest + widest) + pixels > budget:
            yield start, i
            start, tallest, widest, pixels = i, height, width, 3 * height * width
    if start < len(shapes):
        yield start, len(shapes)


def _shape_groups(shapes: list) -> dict[tuple, list[int]]:
    """Positions of `shapes` by shape, in first-seen order: the images of one decoded size go
    through one batched product."""
    groups: dict[tuple, list[int]] = {}
    for i, shape in enumerate(shapes):
        groups.setdefault(shape, []).append(i)
    return groups


def _resample_chunk(images: list, table, groups: dict[tuple, list[int]], out) -> None:
    """Crop, resize and flip `images` ((3, h, w) uint8) into `out` (uint8 NHWC) by the rows of
    `table` on the device: `(left, top, right, bottom, flip, height, width, order)`, where
    `order` lists the chunk's positions (from the batch's first) group by group of `groups`.

    Each output is `rows @ image @ columns.T`: `_triangle_weights` matrices that use the box
    exactly (fractional, as Pillow's `resize(box=...)` does) and put a flip in the columns'
    order. Images of one decoded size go through as one batched product; the weights of the
    whole chunk are made on the device in a few operations: a handful of kernels per chunk
    and per size, not a chain per image, no crop or flip rounded to whole pixels, and
    nothing that makes the host wait for the GPU."""
    import torch

    size = out.shape[1]
    tallest, widest = max(shape[0] for shape in groups), max(shape[1] for shape in groups)
    rows = _triangle_weights(table[:, 1], table[:, 3], table[:, 5], tallest, size, None)
    columns = _triangle_weights(table[:, 0], table[:, 2], table[:, 6], widest, size, table[:, 4] > 0)
    resampled = torch.empty((len(images), 3, size, size), dtype=torch.float32, device=out.device)
    order = table[:, 7].long() - table[0, 7].long()  # the chunk's own positions, group after group
    start = 0
    for (height, width), members in groups.items():
        if len(members) == 1:
            i = members[0]
            torch.matmul(rows[i, :, :height] @ images[i].float(), columns[i, :, :width].T, out=resampled[i])
        else:
            index = order[start : start + len(members)]
            stack = torch.stack([images[i] for i in members]).float()
            product = rows[index, None, :, :height] @ stack @ columns[index, None, :, :width].transpose(-1, -2)
            resampled.index_copy_(0, index, product)
        start += len(members)
    # Under TF32 matmuls (the trainer allows them) a pixel may round one level off.
    out.copy_(resampled.round_().clamp_(0, 255).permute(0, 2, 3, 1))


def _triangle_weights(starts, ends, lengths, longest: int, size: int, flips):
    """Resampling weights (n, size, `longest`) along one axis: output pixel i of a box from
    `start` to `end` takes source point `start + (i + 0.5) * scale` (pixel edges at integers;
    `scale` = source pixels per output pixel), through Pillow's bilinear filter, a triangle of
    half-width max(scale, 1): interpolation when enlarging, antialiasing when shrinking. Rows
    are normalised over the image's own `lengths` of pixels (as Pillow does at edges); `flips`
    reverses the rows of flipped boxes. Made where the boxes are, positions in float64."""
    import torch

    device = starts.device
    scale = (ends - starts) / size
    centres = starts[:, None] + (torch.arange(size, dtype=torch.float64, device=device) + 0.5) * scale[:, None]
    if flips is not None:
        centres = torch.where(flips[:, None], centres.flip(1), centres)
    # Pixel centres; past an image's own length, infinitely far: a weight of 0.
    pixels = torch.arange(longest, dtype=torch.float64, device=device) + 0.5
    pixels = torch.where(pixels[None, :] < lengths[:, None], pixels[None, :], math.inf).float()
    weights = (pixels[:, None, :] - centres.float()[:, :, None]).abs_()
    weights = (scale.clamp(min=1).float()[:, None, None] - weights).clamp_(min=0)
    return weights.div_(weights.sum(-1, keepdim=True))


def _decode_jpegs(encoded: list, device) -> list:
    import torch
    import torch.utils.deterministic
    import torchvision.io as tio

    if device.type != "cuda":
        return tio.decode_jpeg(encoded, mode=tio.ImageReadMode.RGB, device=device)
    # torchvision's CUDA decoder allocates its outputs on the current stream but writes them
    # from its own, without waiting: memory this stream freed (the last batch's decoded
    # images, still read by queued resize kernels) could be overwritten. Wait here first. (A
    # stream of the decoder's own would not do: `torch.cuda.Stream` hands out one of a pool of
    # 32 that other users share.) In deterministic mode `torch.empty` also queues a fill of new
    # tensors on the current stream, which could land on top of the decoded pixels: off for
    # this call.
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
    return resize_crop(decode_for_crop(data, cfg, rng), cfg)


@dataclass(frozen=True)
class CropSource:
    """A decoded image (uint8 HWC RGB) with its crop box, in the image's pixel coordinates,
    and its flip: what `decode_for_crop` gives and `resize_crop` takes."""

    pixels: np.ndarray
    box: tuple[float, float, float, float]
    flip: bool


def decode_for_crop(
    data: bytes, cfg: TransformConfig, rng: np.random.Generator | None = None, known_to_decode: bool = False
) -> CropSource:
    """Decode `data` and draw its crop (`crop_plan`, the same draws as `augment_image`): the
    first half of `transform_image`, apart so that a caller can time decode and resize.

    A JPEG whose crop box stays at least `cfg.image_size` on both sides at 1/2, 1/4 or 1/8
    of the stored size is decoded at the smallest such scale (libjpeg-turbo's DCT scaling,
    itself an antialiased shrink): the inverse DCT, upsampling and colour conversion then
    run on a quarter of the pixels or fewer. The box is scaled with the image.

    A box on whole pixels (the train preset's, unless scaled) is decoded alone where
    `dlstore._jpeg_region` is built: the rows and columns outside it are not transformed
    (`_decode_region`), with the same pixels; `CropSource.pixels` is then that region. The
    rows below it are still read, so that bad data anywhere fails the JPEG as a whole decode
    would, unless `known_to_decode` (these bytes decoded without error before: the loader
    remembers that per sample), when they are not read at all.

    >>> resize_crop(decode_for_crop(jpeg_bytes, cfg, rng), cfg).shape   # doctest: +SKIP
    (224, 224, 3)
    """
    if simplejpeg is None or data[:2] != _JPEG_MAGIC:
        image = decode_image(data)
        box, flip = crop_plan(image.width, image.height, cfg, rng)
        return CropSource(np.asarray(image), box, flip)
    height, width = _jpeg_size(data)
    box, flip = crop_plan(width, height, cfg, rng)
    scale = _decode_scale(box, cfg)
    if _jpeg_region is not None and cfg.preset != "none":
        region = _decode_region(data, (height, width), box, scale, check_all=not known_to_decode)
        if region is not None:
            return CropSource(region[0], region[1], flip)
    scaled = (math.ceil(height * scale), math.ceil(width * scale))
    pixels = _decode_jpeg(data, scaled)
    if pixels.shape[:2] != scaled:  # libjpeg-turbo chose another scale (tiny images only)
        pixels, scale = _decode_jpeg(data, (height, width)), 1.0
    return CropSource(pixels, tuple(v * scale for v in box), flip)


def resize_crop(source: CropSource, cfg: TransformConfig, out: np.ndarray | None = None) -> np.ndarray:
    """The crop, resize and flip of `transform_image` (its second half), on `decode_for_crop`'s
    output; the "none" preset keeps the decoded image as it is.

    `out` (uint8, size x size x 3, e.g. a row of a batch buffer) receives the image, and is
    returned: OpenCV resizes (or flips) straight into it, which saves a copy of every image."""
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


def check_kept_size(data: bytes, size: int) -> None:
    """For the "none" preset into batches of `size` x `size`: a JPEG stored at another size is
    a `ConfigError` from its header, before it is decoded (a 600-byte JPEG whose header says
    30000x30000 was decoded first, 3 GB). Other formats are compared once decoded."""
    if data[:2] != _JPEG_MAGIC or simplejpeg is None:
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
    """The crop, resize and flip of `transform_image`, on an image already decoded at its
    stored size (a Pillow image or a uint8 HWC RGB array). `decode_for_crop` + `resize_crop`
    is the cheaper split: it may decode at a reduced scale and never builds a Pillow image.

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
    """The JPEG as uint8 HWC RGB, at the smallest libjpeg-turbo scale that gives at least
    `size` (height, width)."""
    try:
        return simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=size[0], min_width=size[1])
    except Exception as exc:  # decoders raise many types; all mean "bad bytes"
        raise CorruptSample(f"cannot decode image ({len(data)} bytes): {exc}") from None


def _decode_region(data: bytes, shape: tuple[int, int], box, scale: float, check_all: bool = True):
    """The part of the JPEG that the resize of the whole-pixel `box` reads (torch's or
    OpenCV's: the box only), decoded at `scale` (pixels, and the box in their coordinates), or
    None where the crop-only decoder does not serve: a fractional box, or a JPEG it does not
    take (the caller decodes the whole image, which also tells a corrupt one).

    The result is bit for bit the whole-image transform's (tests/test_transforms.py): the
    region reaches one pixel past the box, the column whose upsampling sees the region's
    edge. A fractional box (the eval preset's, one mapped into a scaled decode) goes to
    Pillow, whose output moves by a level when the image around the box is smaller, so it
    keeps the whole image (and it is the cheaper case already: a scaled decode, or the
    centre box's 77% of the image)."""
    left, top, right, bottom = (v * scale for v in box)
    if not all(float(v).is_integer() for v in (left, top, right, bottom)):
        return None
    denom = round(1 / scale)
    height, width = -(-shape[0] // denom), -(-shape[1] // denom)  # libjpeg's scaled size
    x, y = max(0, int(left) - 1), max(0, int(top) - 1)
    x_end, y_end = min(width, int(right) + 1), min(height, int(bottom) + 1)
    try:
        buffer, x0, region_width = _jpeg_region.decode_region(data, x, y, x_end - x, y_end - y, denom, check_all)
    except ValueError:
        return None
    pixels = np.frombuffer(buffer, dtype=np.uint8).reshape(y_end - y, region_width, 3)
    return pixels, (left - x0, top - y, right - x0, bottom - y)


def can_check_decodes() -> bool:
    """Whether `check_decodes` checks JPEGs as the loader's crop-only decode does: not without
    simplejpeg, where Pillow decodes past damaged data."""
    return simplejpeg is not None


def check_decodes(data: bytes) -> None:
    """Raise `CorruptSample` where `decode_for_crop` would for these bytes, whatever the crop:
    the check its first decode of a sample makes (every row read, libjpeg's warnings taken as
    errors, the whole decode as the fallback), here at 1/8 scale, where nearly all the cost is
    the entropy decode that finds bad data (~0.65 ms for a 95 KB JPEG, against ~0.95 ms for a
    whole decode). `dlstore convert` runs it on every JPEG input, so that a dataset's first
    epoch may decode crop-only (`Manifest.decode_checked`). The verdict is this libjpeg-turbo
    build's; one that warns about more (none known) would take a few more samples for corrupt."""
    if simplejpeg is None or data[:2] != _JPEG_MAGIC:
        decode_image(data)
        return
    height, width = _jpeg_size(data)
    if _jpeg_region is not None:
        try:
            _jpeg_region.decode_region(data, 0, 0, -(-width // 8), -(-height // 8), 8, True)
            return
        except ValueError:
            pass  # as in `decode_for_crop`: the whole decode decides
    _decode_jpeg(data, (1, 1))


def _decode_scale(box, cfg: TransformConfig) -> float:
    """The smallest of 1/8, 1/4 and 1/2 at which `box` still covers the output size (so that
    the resize after the decode shrinks, antialiased, and no detail the output could show is
    lost), else 1. Other k/8 scales do not pay: libjpeg-turbo has no SIMD inverse DCT for them."""
    if cfg.preset == "none":
        return 1.0
    short_side = min(box[2] - box[0], box[3] - box[1])
    return next((scale for scale in (0.125, 0.25, 0.5) if short_side * scale >= cfg.image_size), 1.0)


def _resize(image: Image.Image | np.ndarray, box, flip: bool, size: int, out: np.ndarray | None = None) -> np.ndarray:
    """Crop `box`, resize to size x size (antialiased when shrinking), flip if asked.

    A whole-pixel box (the train preset's at the stored scale) goes to torch's antialiased
    bilinear resize of uint8 images where its SIMD kernel runs (x86 with AVX2: the crop is
    then exactly torchvision's `resized_crop(..., antialias=True)`, within a level of Pillow's
    resample of the same box, at 2.2-3.1x the speed of OpenCV's INTER_AREA here, `tools/bench_transform.py
    --resize-only`), else to OpenCV;
    a fractional box (the eval preset's centre box, a box mapped into a scaled decode) goes to
    Pillow, which resamples it exactly: rounded, it would move the crop by up to half an
    output pixel."""
    whole_pixels = all(float(v).is_integer() for v in box)
    if whole_pixels and _torch_resizes_uint8():
        return _resize_with_torch(np.asarray(image), box, flip, size, out)
    if cv2 is None or not whole_pixels:
        return _resize_with_pillow(image, box, flip, size)
    return _resize_with_opencv(np.asarray(image), box, flip, size, out)


@functools.cache
def _torch_resizes_uint8() -> bool:
    """Whether torch has its SIMD antialiased resize of uint8 images (x86 AVX2 and up); the
    generic one elsewhere is slower than OpenCV's, and splits work over torch's threads."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency; the transforms need not be
        return False
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _resize_with_torch(pixels: np.ndarray, box, flip: bool, size: int, out: np.ndarray | None = None) -> np.ndarray:
    """torch's antialiased bilinear resize of the crop (whole-pixel `box`), torchvision's
    RandomResizedCrop(antialias=True) step: a triangle filter as wide as the shrink, plain
    bilinear where it grows. Serial for uint8 (no intra-op threads); written straight into
    `out` (a row of the batch) or a new array, as HWC.

    The HWC arrays are NCHW tensors in channels_last memory, the SIMD kernel's layout; its
    out= form writes that layout where `interpolate` returns contiguous NCHW, whose copy back
    to HWC costs more than the resize (~0.2 ms here)."""
    import torch

    left, top, right, bottom = (int(v) for v in box)
    crop = pixels[top:bottom, left:right]
    if not (crop.flags.c_contiguous and crop.flags.writeable):  # torch takes no read-only arrays
        crop = np.array(crop)
    target = out if out is not None else np.empty((size, size, 3), dtype=np.uint8)
    # NCHW views made by numpy, one torch call each: every torch call lets go of the GIL, and
    # with the decode threads beside this one each let-go can cost a wait to get it back.
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
    """OpenCV's resize of the crop (whole-pixel `box`): INTER_AREA (area averaging,
    antialiased) where it shrinks, INTER_LINEAR where it grows. OpenCV releases the GIL and
    keeps no state between calls. The last step writes into `out` when given (OpenCV makes a
    new array instead if `out` does not fit; `resize_crop` then copies)."""
    left, top, right, bottom = (int(v) for v in box)
    crop = pixels[top:bottom, left:right]
    crop_height, crop_width = crop.shape[:2]
    # One side shrinks and the other grows: INTER_AREA would sample the shrinking side then,
    # not average it, so that side is shrunk alone first.
    if crop_width > size > crop_height:
        crop = cv2.resize(crop, (size, crop_height), interpolation=cv2.INTER_AREA)
    elif crop_height > size > crop_width:
        crop = cv2.resize(crop, (crop_width, size), interpolation=cv2.INTER_AREA)
    shrinks = crop.shape[0] >= size and crop.shape[1] >= size
    interpolation = cv2.INTER_AREA if shrinks else cv2.INTER_LINEAR
    if flip:
        return cv2.flip(cv2.resize(crop, (size, size), interpolation=interpolation), 1, dst=out)
    return cv2.resize(crop, (size, size), dst=out, interpolation=interpolation)
