"""Device decode: JPEGs decoded, cropped, resized and flipped on the GPU, in batches.

Decode is most of a sample's CPU cost. On a node with few cores per GPU, the device must do it.
The worker only reads each JPEG's header in `device_jpeg`. The crops are `crop_plan`'s.
"""

from __future__ import annotations

import importlib
import io
import math
import threading

from dlstore.config import DEVICE_DECODERS
from dlstore.errors import ConfigError, CorruptSample, DlstoreError
from dlstore.transforms.cpu_decode import JPEG_MAGIC, decode_image


def device_jpeg(data: bytes) -> tuple[bytes, int, int]:
    """`data` as a JPEG the device decoder takes, with its width and height from the frame header.
    nvJPEG reads 8-bit baseline and progressive JPEGs, greyscale or YCbCr. Any other image, such
    as a CMYK JPEG or a PNG, is re-encoded here on the worker's CPU, as the CPU path reads it.
    Raises `CorruptSample` for bytes that are no image, or a JPEG cut short. A memoryview, as of
    a mapped shard, is copied: the batch holds the JPEGs."""
    if isinstance(data, memoryview):
        data = data.tobytes()
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
    """Whether an end-of-image marker follows the JPEG's last start-of-scan; a cut file has none.
    Scan data never holds FF D9, and an EXIF thumbnail's scan and end come before the image's."""
    last_scan = data.rfind(b"\xff\xda")
    return last_scan >= 0 and data.find(b"\xff\xd9", last_scan + 2) >= 0


# Start-of-frame markers. 0xC4, 0xC8 and 0xCC, in their range, are other segments.
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# What nvJPEG decodes, its hardware decoder included: Huffman-coded baseline and progressive
# frames of 8-bit samples, greyscale or YCbCr 4:4:4, 4:2:2 or 4:2:0. Nothing else, nor CMYK.
_DEVICE_FRAMES = frozenset({0xC0, 0xC2})
_DEVICE_LUMA_SAMPLING = frozenset({(1, 1), (2, 1), (2, 2)})


def jpeg_frame(data: bytes) -> tuple[int, int, int, int, tuple] | None:
    """The frame header of JPEG `data`, found by walking the marker segments before it.
    It gives the SOF marker, sample precision, width, height and each component's sampling
    factors. It is None when `data` does not start as a well-formed JPEG. Nothing is decoded."""
    if data[:2] != JPEG_MAGIC:
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
    """Whether nvJPEG decodes a JPEG of this `jpeg_frame` header; see `_DEVICE_FRAMES`."""
    if marker not in _DEVICE_FRAMES or precision != 8 or not (width and height):
        return False
    if len(sampling) == 1:
        return True
    luma, *chroma = sampling
    return len(chroma) == 2 and luma in _DEVICE_LUMA_SAMPLING and chroma == [(1, 1), (1, 1)]


def decode_on_device(encoded, boxes, image_size: int, device, decoder: DeviceJpegDecoder | None = None):
    """Decode JPEGs on `device` in a batch, then crop, resize and flip them by `boxes`.
    `boxes` rows are `(left, top, right, bottom, flip)`. `decoder` is torchvision's nvJPEG
    unless given. It returns uint8 NHWC, as the CPU path does. It also returns the positions
    of JPEGs that did not decode, which are left out of the output."""
    import torch  # loaded on first use, as torchvision: the CPU decode does not need them

    device = torch.device(device)
    decoder = decoder if decoder is not None else TorchvisionJpegDecoder(device)
    images, bad = decoder.decode(list(encoded))
    if bad:
        boxes = boxes[[i for i in range(len(encoded)) if i not in bad]]
    out = torch.empty((len(images), image_size, image_size, 3), dtype=torch.uint8, device=device)
    shapes = [tuple(image.shape[1:]) for image in images]
    chunks = list(_resample_chunks(shapes, image_size))
    groups = [_shape_groups(shapes[start:end]) for start, end in chunks]
    # All that the weights are made of, in one copy to the device. A copy from pageable memory
    # waits for the work queued on the stream. One per chunk would wait behind the model's
    # kernels several times a batch.
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
    """nvJPEG through torchvision, batched; on a CPU device, torchvision's CPU decoder.
    The tests use the CPU decoder as a stand-in. Each decode first waits for the work
    queued on the caller's stream; `_decode_jpegs` says why."""

    name = "torchvision"

    def __init__(self, device) -> None:
        import torch

        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # torchvision keeps one nvJPEG decoder per device spelling, and leaks the last.
            # "cuda" and "cuda:0" are two.
            self.device = torch.device("cuda", torch.cuda.current_device())

    def decode(self, encoded: list) -> tuple[list, list[int]]:
        """The uint8 CHW images of the JPEGs that decode, and the positions of the rest."""
        return _decode_all(encoded, self.device)

    def done_with(self, images: list) -> None:
        """Nothing to keep: the next decode waits for the stream that reads them."""


class NvImageCodecJpegDecoder:
    """nvImageCodec, batched: `pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg`.
    On GPUs with JPEG engines it decodes there, not on the SMs the model trains on. It also
    releases the GIL. JPEGs the engines do not take go to its hybrid CPU and GPU decoder.
    Make one per loader: making one starts its threads and streams."""

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
        # The images are ready on the stream they name. Ours waits for it, and the host does not.
        for other in {image.cuda_stream for image in images} - {0, stream.cuda_stream}:
            stream.wait_stream(torch.cuda.ExternalStream(other, device=self.device))
        self._in_use = [(event, kept) for event, kept in self._in_use if not event.query()]
        return [torch.as_tensor(image, device=self.device).permute(2, 0, 1) for image in images], bad

    def done_with(self, images: list) -> None:
        """Keep `images` until the kernels queued on this stream that read them have run.
        Their memory is nvImageCodec's, which torch's allocator does not track. nvImageCodec frees
        an image in order on the stream it names. This also holds images that name another."""
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._in_use.append((event, images))


DeviceJpegDecoder = TorchvisionJpegDecoder | NvImageCodecJpegDecoder


def device_jpeg_decoder(name: str, device) -> DeviceJpegDecoder:
    """The JPEG decoder of `decode_on="device"`, named by `DataConfig.device_decoder`.
    "torchvision" decodes with nvJPEG on the SMs. "nvimgcodec" uses the GPU's JPEG engines
    where it has them. torchvision is the default: nvImageCodec did not train faster."""
    if name not in DEVICE_DECODERS:
        raise ConfigError(f"device_decoder must be one of {DEVICE_DECODERS}, not {name!r}")
    if name == "torchvision":
        return TorchvisionJpegDecoder(device)
    try:
        return NvImageCodecJpegDecoder(device)
    except (ImportError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"device_decoder='nvimgcodec' cannot decode on {device}: {exc}") from exc


def _check_the_data_is_bad(encoded, decoder: str, error: BaseException | None = None) -> None:
    """Raise unless the JPEG tensor that `decoder` refused is bad data for the CPU too.
    A decoder that fails whatever it is given must not pass for corrupt data. Every sample
    would be skipped, and a run would train on nothing. Refusals are rare, so one CPU decode
    here costs little."""
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
    """The images of `encoded` that decode, and the positions of the rest, counted from `first`.
    A batched decode gives nothing when one JPEG fails. Halving the batch until each failure
    is alone finds a bad JPEG in about 2 log2(n) decodes rather than n."""
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


# Floats that the resampling weights and float copies of decoded images may take at once.
# A batch of large images is resampled in parts rather than all at once.
_RESAMPLE_FLOATS = 1 << 25


def _resample_chunks(shapes: list, size: int, budget: int = _RESAMPLE_FLOATS):
    """Ranges `(start, end)` of decoded `shapes` whose weights and float copies fit `budget`."""
    start, tallest, widest, pixels = 0, 0, 0, 0
    for i, (height, width) in enumerate(shapes):
        tallest, widest, pixels = max(tallest, height), max(widest, width), pixels + 3 * height * width
        if i > start and 2 * (i + 1 - start) * size * (tallest + widest) + pixels > budget:
            yield start, i
            start, tallest, widest, pixels = i, height, width, 3 * height * width
    if start < len(shapes):
        yield start, len(shapes)


def _shape_groups(shapes: list) -> dict[tuple, list[int]]:
    """Positions of `shapes` by shape, in first-seen order: one batched product per decoded size."""
    groups: dict[tuple, list[int]] = {}
    for i, shape in enumerate(shapes):
        groups.setdefault(shape, []).append(i)
    return groups


def _resample_chunk(images: list, table, groups: dict[tuple, list[int]], out) -> None:
    """Crop, resize and flip uint8 CHW `images` into uint8 NHWC `out` by the rows of `table`.
    Rows are `(left, top, right, bottom, flip, height, width, order)`, on the device. `order`
    lists the chunk's positions group by group of `groups`. Each output is
    `rows @ image @ columns.T`. The `_triangle_weights` use the box exactly and put a flip in
    the columns' order. Images of one size go through one batched product. The weights are
    made on the device, so nothing makes the host wait for the GPU."""
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
    # Under TF32 matmuls, which the trainer allows, a pixel may round one level off.
    out.copy_(resampled.round_().clamp_(0, 255).permute(0, 2, 3, 1))


def _triangle_weights(starts, ends, lengths, longest: int, size: int, flips):
    """Resampling weights of shape `n, size, longest` along one axis, as Pillow's bilinear filter.
    Output pixel i of a box from `start` to `end` takes source point `start + (i + 0.5) * scale`.
    `scale` is source pixels per output pixel. The filter is a triangle of half-width
    `max(scale, 1)`: interpolation when enlarging, antialiasing when shrinking. Rows are
    normalised over the image's own `lengths`, as Pillow does at edges. `flips` reverses the
    rows of flipped boxes."""
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
    # torchvision's CUDA decoder allocates outputs on the current stream but writes them from its
    # own, without waiting. Memory this stream freed, still read by queued kernels, could be
    # overwritten, so wait first. A decoder stream would not do: `torch.cuda.Stream` shares a pool.
    # In deterministic mode `torch.empty` also queues a fill that could land on the pixels: off here.
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
