"""Decode and augmentation presets."""

from __future__ import annotations

import importlib.util
import io
import pickle
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image

from dlstore.config import DataConfig
from dlstore.errors import ConfigError, CorruptSample
from dlstore.transforms import (
    SampleRngs,
    TransformConfig,
    augment_image,
    check_decodes,
    crop_plan,
    decode_for_crop,
    decode_image,
    decode_on_device,
    device_jpeg,
    device_jpeg_decoder,
    resize_crop,
    sample_rng,
    transform_image,
)
from dlstore.transforms import cpu_decode as transforms_module

# The on-device decode runs on the CPU everywhere (torchvision's CPU decoder stands in for
# nvJPEG) and on CUDA where there is one (tools/gpu_check.sh runs this file on a GPU node), by
# torchvision's nvJPEG and by nvImageCodec ("cuda/nvimgcodec") where that is installed.
_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
_NO_NVIMGCODEC = pytest.mark.skipif(
    importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.nvimgcodec") is None,
    reason="needs nvImageCodec (nvidia-nvimgcodec-cu13)",
)
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, _NO_CUDA]),
    pytest.param("cuda/nvimgcodec", marks=[pytest.mark.gpu, _NO_CUDA, _NO_NVIMGCODEC]),
]
# Quadrant colours: top-left, top-right, bottom-left, bottom-right.
QUADRANTS = np.array([[[220, 30, 30], [30, 220, 30]], [[30, 30, 220], [220, 220, 220]]], dtype=np.uint8)


@pytest.fixture(params=DEVICES)
def device(request):
    """Each of `DEVICES`; on CUDA with TF32 matrix products, as the trainer runs them.

    Set and restored by hand: pytest's monkeypatch cannot undo it on torch 2.11 (it deletes the
    attribute at teardown, an AttributeError on the H100 node's image).
    """
    if not request.param.startswith("cuda"):
        yield request.param
        return
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    matmul.allow_tf32 = True
    try:
        yield request.param
    finally:
        matmul.allow_tf32 = before


def _decode_on(device: str, encoded, rows, size: int):
    """`decode_on_device` on `device` ("cuda/nvimgcodec": CUDA, decoded by nvImageCodec)."""
    name, _, decoder = device.partition("/")
    return decode_on_device(encoded, rows, size, name, device_jpeg_decoder(decoder, name) if decoder else None)


def _jpeg(width: int = 120, height: int = 90, fmt: str = "JPEG") -> bytes:
    rng = np.random.default_rng(0)
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[:, : width // 2] = (200, 30, 30)
    pixels[:, width // 2 :] = (30, 30, 200)
    pixels += rng.integers(0, 20, pixels.shape, dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_decode_gives_rgb_of_the_stored_size(fmt):
    image = decode_image(_jpeg(fmt=fmt))
    assert image.mode == "RGB" and image.size == (120, 90)


def test_decode_grayscale_png_becomes_rgb():
    out = io.BytesIO()
    Image.fromarray(np.full((8, 10), 77, dtype=np.uint8)).save(out, "PNG")
    array = np.asarray(decode_image(out.getvalue()))
    assert array.shape == (8, 10, 3) and (array == 77).all()


@pytest.mark.parametrize("data", [b"", b"\xff\xd8\xff\xe0garbage", b"not an image at all", _jpeg()[:200]])
def test_corrupt_bytes_raise_corrupt_sample(data):
    with pytest.raises(CorruptSample):
        decode_image(data)


@pytest.mark.parametrize("preset", ["train", "eval"])
def test_presets_give_uint8_square_images(preset):
    out = transform_image(_jpeg(), TransformConfig(preset, image_size=32), sample_rng(0, 0, 1))
    assert out.shape == (32, 32, 3) and out.dtype == np.uint8


def test_eval_keeps_left_right_layout():
    out = transform_image(_jpeg(), TransformConfig("eval", image_size=32))
    assert out[:, :8, 0].mean() > 150 and out[:, -8:, 2].mean() > 150


def test_train_augmentation_is_a_function_of_seed_epoch_and_sample():
    cfg = TransformConfig("train", image_size=24)
    data = _jpeg()
    a = transform_image(data, cfg, sample_rng(3, 1, 42))
    b = transform_image(data, cfg, sample_rng(3, 1, 42))
    assert np.array_equal(a, b)
    others = [transform_image(data, cfg, sample_rng(3, epoch, 42)) for epoch in range(2, 8)]
    assert any(not np.array_equal(a, o) for o in others)


def _draws(rng) -> list:
    """What the train preset draws from a generator, and some more of each kind."""
    return [*rng.uniform(0.08, 1.0, 3), *rng.integers(0, 317, 3), rng.integers(0, 2**40), *rng.random(2)]


def test_the_re_keyed_generators_draw_what_fresh_ones_draw_in_every_thread():
    rngs = SampleRngs()
    keys = [
        (seed, epoch, sample_id) for seed in (0, 7, 2**63 + 5) for epoch in (0, 1, 9) for sample_id in (0, 1, 10**9)
    ]
    expected = [_draws(sample_rng(*key)) for key in keys]
    assert len({str(d) for d in expected}) == len(keys)  # the keys give different draws

    def run(order: list[int]) -> dict[int, list]:
        got = {}
        for i in order:
            rng = rngs(*keys[i])
            got[i] = _draws(rng)
            rng.integers(0, 3, 5)  # a half-used 32-bit word and buffer: the next re-key starts afresh
        return got

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, [list(range(len(keys)))[::step] for step in (1, -1, 2, -3)] * 2))
    for got in results:
        assert all(got[i] == expected[i] for i in got)
    assert pickle.loads(pickle.dumps(rngs))(*keys[4]).random() == sample_rng(*keys[4]).random()


def test_every_seed_draws_its_own_augmentations():
    """Negative seeds, and seeds past 2**63 next to each other, used to draw the very same
    crops (their key went through float64); seeds below 2**63 keep the draws they had."""
    seeds = [-1, -2, -3, -(2**62), 2**63, 2**63 + 1, 2**64 - 1, 0, 1]
    draws = [tuple(_draws(sample_rng(seed, 0, 7))) for seed in seeds]
    assert len(set(draws)) == len(seeds) - 1  # -1 and 2**64 - 1 are one 64-bit key
    assert draws[0] == draws[seeds.index(2**64 - 1)]
    before = np.random.Generator(np.random.Philox(key=[12345, (3 << 40) ^ 99]))  # the list form of old
    assert _draws(sample_rng(12345, 3, 99)) == _draws(before)
    assert SampleRngs()(-2, 0, 7).random() == sample_rng(-2, 0, 7).random()


def test_bad_transform_config_is_a_config_error():
    with pytest.raises(ConfigError):
        TransformConfig("random")
    with pytest.raises(ConfigError):
        TransformConfig("eval", crop_ratio=0)


def test_device_jpeg_passes_rgb_jpegs_and_reencodes_what_nvjpeg_cannot_read():
    rgb = _jpeg()
    assert device_jpeg(rgb) == (rgb, 120, 90)
    cmyk = io.BytesIO()
    Image.open(io.BytesIO(rgb)).convert("CMYK").save(cmyk, "JPEG", quality=95)
    for other in (cmyk.getvalue(), _jpeg(fmt="PNG")):
        data, width, height = device_jpeg(other)
        assert (width, height) == (120, 90) and data[:2] == b"\xff\xd8"
        with Image.open(io.BytesIO(data)) as image:
            assert image.mode == "RGB"
        # The same picture: left half red, right half blue.
        pixels = decode_image(data)
        assert pixels.getpixel((10, 45))[0] > 150 and pixels.getpixel((110, 45))[2] > 150
    with pytest.raises(CorruptSample):
        device_jpeg(b"\xff\xd8 not a jpeg")


def test_device_jpeg_refuses_a_jpeg_cut_short_even_with_a_whole_thumbnail():
    """The worker reads only a JPEG's headers for the device; a file cut short must not reach
    nvJPEG's hardware decoder, which may decode what is there without an error. An EXIF
    thumbnail (a whole JPEG of its own, before the image's scans) must not hide the cut."""
    whole = _jpeg()
    thumbnail = _jpeg(16, 12)
    exif = Image.Exif()
    exif[0x010E] = "picture"  # ImageDescription
    with_thumbnail = io.BytesIO()
    Image.open(io.BytesIO(whole)).save(with_thumbnail, "JPEG", exif=exif.tobytes())
    data = with_thumbnail.getvalue()
    app1 = data.index(b"\xff\xe1")
    length = int.from_bytes(data[app1 + 2 : app1 + 4], "big")
    body = data[app1 + 4 : app1 + 2 + length] + thumbnail  # the thumbnail inside APP1
    data = data[:app1] + b"\xff\xe1" + (len(body) + 2).to_bytes(2, "big") + body + data[app1 + 2 + length :]
    assert data.count(b"\xff\xd9") == 2 and decode_image(data).size == (120, 90)
    for jpeg in (whole, data):
        assert device_jpeg(jpeg) == (jpeg, 120, 90)
        cut = jpeg[: jpeg.rindex(b"\xff\xda") + 200]
        with pytest.raises(CorruptSample, match="truncated JPEG"):
            device_jpeg(cut)
    assert device_jpeg(whole + b"\x00" * 10)[1:] == (120, 90)  # padding after the end is no cut


def test_decode_on_device_leaves_out_jpegs_that_do_not_decode():
    import torch

    good = [_jpeg(), _jpeg(64, 48)]
    encoded = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in (good[0], good[0][:-40], good[1])]
    boxes = torch.tensor([[0, 0, 120, 90, 0], [0, 0, 120, 90, 0], [0, 0, 64, 48, 1]], dtype=torch.float64)
    images, bad = decode_on_device(encoded, boxes, 16, "cpu")
    assert bad == [1] and images.shape == (2, 16, 16, 3)
    alone, none_bad = decode_on_device([encoded[2]], boxes[2:], 16, "cpu")
    assert none_bad == [] and torch.equal(images[1], alone[0])
    empty, no_bad = decode_on_device([], boxes[:0], 16, "cpu")
    assert empty.shape == (0, 16, 16, 3) and no_bad == []


def test_device_jpeg_decoder_names_its_choices_and_says_why_nvimgcodec_cannot_decode(monkeypatch):
    """nvImageCodec decodes on CUDA only, and only where it is installed: asked for where it
    cannot decode, or a decoder there is none of, is an error that says so."""
    assert device_jpeg_decoder("torchvision", "cpu").name == "torchvision"
    assert DataConfig("file:///data/train").device_decoder == "torchvision"
    with pytest.raises(ConfigError, match="'nvimgcodec' cannot decode on cpu: .*CUDA device"):
        device_jpeg_decoder("nvimgcodec", "cpu")
    with pytest.raises(ConfigError, match="one of"):
        device_jpeg_decoder("dali", "cpu")
    with pytest.raises(ConfigError, match="device_decoder must be one of"):
        DataConfig("file:///data/train", device_decoder="dali")
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)  # its import fails
    with pytest.raises(ConfigError, match="'nvimgcodec' cannot decode on cuda: .*nvidia.nvimgcodec"):
        device_jpeg_decoder("nvimgcodec", "cuda")


def _quadrant_jpeg(width: int = 96, height: int = 64) -> bytes:
    """A JPEG whose four quadrants have the `QUADRANTS` colours (4:4:4, so edges stay sharp)."""
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    for row in range(2):
        for col in range(2):
            pixels[row * height // 2 : (row + 1) * height // 2, col * width // 2 : (col + 1) * width // 2] = QUADRANTS[
                row, col
            ]
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=95, subsampling=0)
    return out.getvalue()


def _expected_quadrants(box, flip: bool, size: int, width: int, height: int, margin: float = 2.5):
    """The quadrant colour each output pixel of crop `box` (resized to `size`, then flipped)
    shows, and where that is defined: pixels whose source point lies `margin` source pixels
    (plus the resampling filter's reach) or more from a quadrant edge."""
    left, top, right, bottom = box
    scale_x, scale_y = (right - left) / size, (bottom - top) / size
    centres = np.arange(size) + 0.5
    xs, ys = left + centres * scale_x, top + centres * scale_y
    if flip:
        xs = xs[::-1]
    far_x = np.abs(xs - width / 2) >= margin + max(scale_x, 1.0)
    far_y = np.abs(ys - height / 2) >= margin + max(scale_y, 1.0)
    colours = QUADRANTS[(ys >= height / 2).astype(int)[:, None], (xs >= width / 2).astype(int)[None, :]]
    return colours, far_y[:, None] & far_x[None, :]


def _assert_quadrants(image: np.ndarray, box, flip: bool, width: int, height: int) -> None:
    expected, defined = _expected_quadrants(box, flip, image.shape[0], width, height)
    assert defined.sum() >= image.shape[0] ** 2 // 4, "too few pixels to check"
    error = np.abs(image.astype(int) - expected.astype(int)).max(axis=-1)
    assert error[defined].max() <= 25, (box, flip, np.argwhere(defined & (error > 25))[:5])


# Boxes (left, top, right, bottom) of the 96x64 quadrant image: the whole image, one quadrant,
# the right half, and boxes whose quadrant edges land off the centre of the output.
QUADRANT_BOXES = [(0, 0, 96, 64), (0, 0, 48, 32), (48, 0, 96, 64), (0, 0, 72, 64), (30, 10, 90, 60), (40, 20, 56, 36)]


def test_device_decode_crops_and_flips_where_the_boxes_say(device):
    """Each crop box and flip lands the quadrant colours at the output positions the box
    defines: a decoder that ignored a box or a flip would show other colours there."""
    data = _quadrant_jpeg()
    rows = [(*box, flip) for box in QUADRANT_BOXES for flip in (0, 1)]
    encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for _ in rows]
    images, bad = _decode_on(device, encoded, torch.tensor(rows, dtype=torch.float64), 32)
    assert bad == [] and images.shape == (len(rows), 32, 32, 3) and images.device.type == device.partition("/")[0]
    for image, row in zip(images.cpu().numpy(), rows, strict=True):
        _assert_quadrants(image, row[:4], bool(row[4]), 96, 64)


def _pillow_crop(data: bytes, box, flip: bool, size: int) -> np.ndarray:
    """What the device path computes: Pillow's bilinear resize of the exact box (antialiased
    when it shrinks), then the flip."""
    out = decode_image(data).resize((size, size), Image.Resampling.BILINEAR, box=box, reducing_gap=None)
    return np.asarray(out.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else out)


def test_device_decode_of_random_crops_matches_the_cpu_path(device):
    """The train preset's random boxes and flips, decoded on the device and by `augment_image`:
    the same quadrants in the same places, pixels as Pillow's resize of the same box, and
    within the two paths' rounding and resize filters of the CPU path's."""
    data = _quadrant_jpeg()
    cfg = TransformConfig("train", image_size=24, scale=(0.1, 1.0))
    plans = [crop_plan(96, 64, cfg, sample_rng(5, 0, sample_id)) for sample_id in range(16)]
    assert {flip for _, flip in plans} == {False, True}
    encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for _ in plans]
    rows = torch.tensor([(*box, flip) for box, flip in plans], dtype=torch.float64)
    images, bad = _decode_on(device, encoded, rows, 24)
    cpu = [augment_image(decode_image(data), cfg, sample_rng(5, 0, sample_id)) for sample_id in range(16)]
    assert bad == [] and len(images) == len(cpu) == len(plans)
    for image, expected, (box, flip) in zip(images.cpu().numpy(), cpu, plans, strict=True):
        _assert_quadrants(image, box, flip, 96, 64)
        _assert_quadrants(expected, box, flip, 96, 64)
        assert np.abs(image.astype(int) - _pillow_crop(data, box, flip, 24).astype(int)).mean() < 1
        # The CPU path may resize with another filter (OpenCV's area average): edges differ.
        assert np.abs(image.astype(int) - expected.astype(int)).mean() < 3


def _gradient_jpeg(size: int = 64) -> bytes:
    """Red rising 4 levels a pixel to the right, green 4 a pixel down: the pixel whose centre is
    at (x, y) (pixel edges at integers) holds (4x, 4y, 128), and so, between pixel centres,
    does any bilinear resampling."""
    ramp = (4 * np.arange(size) + 2).astype(np.uint8)
    pixels = np.stack(np.broadcast_arrays(ramp[None, :], ramp[:, None], np.uint8(128)), axis=-1)
    out = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels)).save(out, "JPEG", quality=100, subsampling=0)
    return out.getvalue()


def _assert_gradient(image: np.ndarray, box, flip: bool, image_px: int) -> None:
    """Red and green of each output pixel equal 4x and 4y of its source point, wherever the
    resampling filter stays inside the image; a box end off by half a pixel is off by 2 levels."""
    left, top, right, bottom = box
    size = image.shape[0]
    scale_x, scale_y = (right - left) / size, (bottom - top) / size
    xs = left + (np.arange(size) + 0.5) * scale_x
    ys = top + (np.arange(size) + 0.5) * scale_y
    if flip:
        xs = xs[::-1]
    inside_x = (xs - max(scale_x, 1.0) >= 0.5) & (xs + max(scale_x, 1.0) <= image_px - 0.5)
    inside_y = (ys - max(scale_y, 1.0) >= 0.5) & (ys + max(scale_y, 1.0) <= image_px - 0.5)
    red = image[:, :, 0].astype(float) - 4 * xs[None, :]
    green = image[:, :, 1].astype(float) - 4 * ys[:, None]
    assert inside_x.sum() >= size // 4 and inside_y.sum() >= size // 4, "too few pixels to check"
    red, green = red[:, inside_x], green[inside_y, :]
    assert np.abs(red).mean() < 1 and np.abs(green).mean() < 1, (box, flip, np.abs(red).mean(), np.abs(green).mean())
    assert np.abs(red).max() <= 4 and np.abs(green).max() <= 4, (box, flip)
    # Each column's (row's) mean error: a box end off by half a pixel shows as a bias of 2 at
    # the columns there, which rounding (±0.5), the JPEG, another decoder and TF32 do not reach.
    biases = np.abs(red.mean(axis=0)).max(), np.abs(green.mean(axis=1)).max()
    assert max(biases) < 1.5, (box, flip, biases)


# Whole-pixel boxes, and fractional ones, which the device path uses exactly as Pillow does
# (rounded to whole pixels, the first is off by 2 levels).
GRADIENT_BOXES = [(0, 0, 64, 64), (8, 4, 40, 60), (20, 30, 36, 46), (3, 17, 61, 29)]
GRADIENT_BOXES += [(8.5, 4.5, 40.5, 60.5), (10.25, 3.7, 50.6, 40.1), (20.5, 30.5, 36.25, 45.75)]


def test_device_decode_samples_the_source_points_the_box_defines(device):
    data = _gradient_jpeg()
    rows = [(*box, flip) for box in GRADIENT_BOXES for flip in (0, 1)]
    encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for _ in rows]
    images, bad = _decode_on(device, encoded, torch.tensor(rows, dtype=torch.float64), 24)
    assert bad == [] and len(images) == len(rows)
    for image, row in zip(images.cpu().numpy(), rows, strict=True):
        _assert_gradient(image, row[:4], bool(row[4]), 64)


def test_device_decode_uses_the_eval_box_exactly(device):
    """The eval preset's centre box is fractional (a 49 px square from (3.5, 3.5) here): on the
    device it is used as it is, as by Pillow on the CPU, not rounded to whole pixels."""
    data = _gradient_jpeg(56)
    box, flip = crop_plan(56, 56, TransformConfig("eval", image_size=24))
    assert box != tuple(round(v) for v in box) and not flip
    images, bad = _decode_on(
        device, [torch.frombuffer(bytearray(data), dtype=torch.uint8)], torch.tensor([(*box, 0)]), 24
    )
    assert bad == [] and len(images) == 1
    _assert_gradient(images[0].cpu().numpy(), box, False, 56)
    assert np.abs(images[0].cpu().numpy().astype(int) - _pillow_crop(data, box, False, 24).astype(int)).mean() < 1


def test_decode_on_device_batches_images_of_one_size_as_it_does_each_alone(device):
    """Same-sized images go through one batched product (several sizes: several groups of a
    chunk, by their positions); the result is each image's alone."""
    jpegs = [_quadrant_jpeg(), _gradient_jpeg(), _quadrant_jpeg(), _jpeg(), _gradient_jpeg(), _quadrant_jpeg()]
    rows = [(0, 0, 96, 64, 0), (8.5, 4.5, 40.5, 60.5, 1), (30, 10, 90, 60, 1), (3, 2, 100, 80, 0), (0, 0, 64, 64, 0)]
    rows.append((40.25, 20.5, 56, 36.75, 0))
    encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in jpegs]
    boxes = torch.tensor(rows, dtype=torch.float64)
    together, bad = _decode_on(device, encoded, boxes, 20)
    alone = [_decode_on(device, [data], boxes[i : i + 1], 20)[0][0] for i, data in enumerate(encoded)]
    assert bad == [] and len(together) == len(alone) == len(jpegs)
    for batched, single in zip(together, alone, strict=True):
        assert (batched.int() - single.int()).abs().max() <= 1  # float sums in another order


def test_decode_on_device_resamples_a_batch_of_large_images_in_parts(device):
    """Twelve 1024x768 images take more than the resampler's memory budget at once: done in
    parts, with each image as it comes alone."""
    large = _quadrant_jpeg(1024, 768)
    encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in [large] * 12 + [_jpeg()]]
    boxes = torch.tensor([(i * 10, i * 5, 1024 - i * 20, 768, i % 2) for i in range(12)] + [(0, 0, 120, 90, 1)])
    together, bad = _decode_on(device, encoded, boxes, 16)
    assert bad == [] and together.shape == (13, 16, 16, 3)
    for i, image in enumerate(together.cpu().numpy()):
        single = _decode_on(device, [encoded[i]], boxes[i : i + 1], 16)[0][0].cpu()
        assert np.abs(image.astype(int) - single.numpy().astype(int)).max() <= 1
        if i < 12:
            _assert_quadrants(image, tuple(boxes[i, :4].tolist()), bool(i % 2), 1024, 768)


def test_decode_on_device_finds_a_bad_jpeg_by_halving_the_batch(monkeypatch):
    """One JPEG that does not decode in 32 costs 1 + 2 log2(32) = 11 decode calls, not 33."""
    import torchvision.io

    decode = torchvision.io.decode_jpeg
    calls = []

    def counting_decode(encoded, *args, **kwargs):
        calls.append(len(encoded))
        return decode(encoded, *args, **kwargs)

    monkeypatch.setattr(torchvision.io, "decode_jpeg", counting_decode)
    good = _jpeg(32, 24)
    jpegs = [good] * 32
    jpegs[21] = good[:-40]
    encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in jpegs]
    boxes = torch.tensor([(0, 0, 32, 24, i % 2) for i in range(32)], dtype=torch.float64)
    images, bad = decode_on_device(encoded, boxes, 8, "cpu")
    assert bad == [21] and len(images) == 31 and len(calls) == 11
    alone = decode_on_device([encoded[22]], boxes[22:23], 8, "cpu")[0]
    # The 23rd JPEG is the 22nd output, with its own box (the 22nd box flips: mirrored, far off).
    assert (images[21].int() - alone[0].int()).abs().max() <= 1


# -- the CPU path: decode (maybe at a reduced scale), crop, resize, flip ----------------------
def _pillow_reference(data: bytes, box, flip: bool, size: int) -> np.ndarray:
    """The crop as dlstore made it before issue 11: Pillow's antialiased bilinear resize of the
    exact box from the full-size decode, then the flip."""
    out = decode_image(data).resize((size, size), Image.Resampling.BILINEAR, box=box, reducing_gap=None)
    return np.asarray(out.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else out)


def _decode_scales(plans, size: int) -> set[float]:
    """The scales `decode_for_crop` may decode `plans` at: the smallest of 1/8, 1/4, 1/2 at
    which the box still covers the output size, else 1."""
    shorts = [min(box[2] - box[0], box[3] - box[1]) for box, _ in plans]
    return {next((s for s in (0.125, 0.25, 0.5) if short * s >= size), 1.0) for short in shorts}


def test_cpu_transform_crops_and_flips_where_the_boxes_say():
    """The train preset's boxes (every decode scale among them) and flips: each output shows
    the quadrant colours its box puts there, by `transform_image` and by both splits, and
    stays near Pillow's resize of the same box from the full-size image."""
    data, size = _quadrant_jpeg(200, 150), 16
    cfg = TransformConfig("train", image_size=size, scale=(0.03, 1.0))
    plans = [crop_plan(200, 150, cfg, sample_rng(7, 0, sample_id)) for sample_id in range(48)]
    assert _decode_scales(plans, size) == {0.125, 0.25, 0.5, 1.0} and {flip for _, flip in plans} == {False, True}
    for sample_id, (box, flip) in enumerate(plans):
        out = transform_image(data, cfg, sample_rng(7, 0, sample_id))
        assert out.shape == (size, size, 3) and out.dtype == np.uint8
        _assert_quadrants(out, box, flip, 200, 150)
        assert np.abs(out.astype(int) - _pillow_reference(data, box, flip, size)).mean() < 4
        split = resize_crop(decode_for_crop(data, cfg, sample_rng(7, 0, sample_id)), cfg)
        assert np.array_equal(out, split)
        _assert_quadrants(augment_image(decode_image(data), cfg, sample_rng(7, 0, sample_id)), box, flip, 200, 150)


@pytest.mark.parametrize("size", [8, 24])
def test_cpu_transform_samples_the_source_points_the_box_defines(size):
    """On a gradient a box off by one source pixel is off by 4 levels: every crop (reduced-scale
    decodes among them) stays within a level of Pillow's resize of its exact box."""
    data = _gradient_jpeg(64)
    cfg = TransformConfig("train", image_size=size, scale=(0.05, 1.0))
    plans = [crop_plan(64, 64, cfg, sample_rng(3, 1, sample_id)) for sample_id in range(32)]
    assert len(_decode_scales(plans, size)) >= 2
    for sample_id, (box, flip) in enumerate(plans):
        out = transform_image(data, cfg, sample_rng(3, 1, sample_id))
        assert np.abs(out.astype(int) - _pillow_reference(data, box, flip, size)).mean() < 1, (box, flip)


def test_cpu_eval_uses_its_fractional_centre_box_exactly():
    """The eval preset's centre box (49 px from (3.5, 3.5)) is resampled as it is, not rounded:
    the same pixels as before issue 11 where no reduced-scale decode applies."""
    data = _gradient_jpeg(56)
    cfg = TransformConfig("eval", image_size=32)
    box, flip = crop_plan(56, 56, cfg)
    assert box != tuple(round(v) for v in box) and not flip and _decode_scales([(box, flip)], 32) == {1.0}
    out = transform_image(data, cfg)
    _assert_gradient(out, box, False, 56)
    assert np.array_equal(out, _pillow_reference(data, box, False, 32))
    assert np.array_equal(augment_image(decode_image(data), cfg), out)


def test_cpu_none_preset_keeps_the_decoded_image():
    data = _jpeg(120, 90)
    out = transform_image(data, TransformConfig("none"))
    assert np.array_equal(out, np.asarray(decode_image(data)))


def _grey_jpeg(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((height, width), 90, dtype=np.uint8)).save(out, "JPEG")
    return out.getvalue()


@pytest.mark.parametrize("preset", ["train", "eval"])
@pytest.mark.parametrize("size", [1, 7, 37, 224])
def test_cpu_output_is_exactly_the_image_size(preset, size):
    """Any stored size, aspect and format: tiny, long and thin, crops that shrink on one side
    and grow on the other, grey JPEGs, PNGs."""
    cfg = TransformConfig(preset, image_size=size)
    images = [_jpeg(w, h) for w, h in [(1, 1), (3, 2), (17, 300), (500, 40), (64, 48), (400, 350)]]
    images += [_grey_jpeg(90, 60), _jpeg(50, 70, fmt="PNG")]
    for data in images:
        for sample_id in range(6):
            out = transform_image(data, cfg, sample_rng(1, 2, sample_id))
            assert out.shape == (size, size, 3) and out.dtype == np.uint8 and out.flags.c_contiguous


def test_cpu_transform_is_a_function_of_seed_epoch_and_sample():
    data, cfg = _quadrant_jpeg(200, 150), TransformConfig("train", image_size=16, scale=(0.03, 1.0))
    first = [transform_image(data, cfg, sample_rng(9, 2, sample_id)) for sample_id in range(12)]
    again = [transform_image(data, cfg, sample_rng(9, 2, sample_id)) for sample_id in range(12)]
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    others = [transform_image(data, cfg, sample_rng(seed, epoch, 0)) for seed, epoch in [(8, 2), (9, 3), (10, 0)]]
    assert any(not np.array_equal(first[0], other) for other in others)
    assert any(not np.array_equal(first[0], other) for other in first[1:])


def test_cpu_transform_gives_the_same_outputs_from_4_threads():
    """What the loader's decode threads do: transforms of different images and sizes at once."""
    jpegs = [_quadrant_jpeg(200, 150), _gradient_jpeg(64), _jpeg(400, 350), _jpeg(50, 70, fmt="PNG")]
    cfg = TransformConfig("train", image_size=24, scale=(0.03, 1.0))
    tasks = [(jpegs[i % len(jpegs)], i) for i in range(96)]

    def run(task):
        data, sample_id = task
        return transform_image(data, cfg, sample_rng(4, 0, sample_id))

    alone = [run(task) for task in tasks]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(run, tasks))
    assert all(np.array_equal(a, b) for a, b in zip(alone, together, strict=True))


# -- the frames the device decoder takes -------------------------------------------------------
def _jpeg_with(**options) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.asarray(decode_image(_quadrant_jpeg()))).save(out, "JPEG", **options)
    return out.getvalue()


def _frame_edited(data: bytes, marker: int | None = None, precision: int | None = None, luma=None) -> bytes:
    """Baseline JPEG `data` with its frame header changed: the SOF marker, the sample precision
    or the luma sampling factors. The scan stays as it was, so the result may not decode."""
    edited = bytearray(data)
    at = edited.index(b"\xff\xc0")
    if marker is not None:
        edited[at + 1] = marker
    if precision is not None:
        edited[at + 4] = precision
    if luma is not None:
        edited[at + 11] = luma[0] << 4 | luma[1]
    return bytes(edited)


@pytest.mark.parametrize(
    "options",
    [{}, {"subsampling": 0}, {"subsampling": 1}, {"progressive": True}, {"optimize": True}, {"comment": b"c" * 300}],
)
def test_device_jpeg_passes_the_jpegs_nvjpeg_decodes_as_they_are(options):
    """Baseline and progressive, 4:2:0, 4:4:4 and 4:2:2, with segments before the frame."""
    data = _jpeg_with(quality=90, **options)
    assert device_jpeg(data) == (data, 96, 64)
    grey = io.BytesIO()
    Image.new("L", (30, 20), 99).save(grey, "JPEG", **options)
    assert device_jpeg(grey.getvalue()) == (grey.getvalue(), 30, 20)


@pytest.mark.parametrize(
    "frame",
    [
        {"marker": 0xC1},  # extended sequential
        {"marker": 0xC3},  # lossless
        {"marker": 0xC5},  # hierarchical
        {"marker": 0xC9},  # arithmetic coding
        {"marker": 0xCA},  # arithmetic coding, progressive
        {"marker": 0xCB},  # arithmetic coding, lossless
        {"precision": 12},
        {"luma": (1, 2)},  # 4:4:0
        {"luma": (4, 1)},  # 4:1:1
        {"luma": (3, 1)},
    ],
)
def test_device_jpeg_reencodes_the_frames_nvjpeg_does_not_take(frame):
    """Never handed to the device as it is: re-encoded (as a baseline 8-bit JPEG) when the CPU
    path reads it, a `CorruptSample` as on the CPU path when it does not."""
    edited = _frame_edited(_jpeg_with(quality=95, subsampling=0), **frame)
    try:
        cpu = decode_image(edited)
    except CorruptSample:
        with pytest.raises(CorruptSample):
            device_jpeg(edited)
        return
    data, width, height = device_jpeg(edited)
    assert data != edited and (width, height) == cpu.size == (96, 64)
    assert device_jpeg(data) == (data, 96, 64)  # a frame the device takes
    assert np.abs(np.asarray(decode_image(data)).astype(int) - np.asarray(cpu)).mean() < 3


def test_device_jpeg_reencodes_an_extended_sequential_jpeg_to_the_same_picture():
    """0xC1 differs from baseline only in what it allows: the CPU decodes it as the original."""
    original = _jpeg_with(quality=95, subsampling=0)
    data, width, height = device_jpeg(_frame_edited(original, marker=0xC1))
    assert data[:2] == b"\xff\xd8" and (width, height) == (96, 64) and device_jpeg(data)[0] == data
    assert np.abs(np.asarray(decode_image(data)).astype(int) - np.asarray(decode_image(original))).mean() < 2


@pytest.mark.parametrize("preset", ["train", "eval", "none"])
def test_resize_crop_into_a_row_of_a_batch_gives_the_same_pixels(preset):
    """`out=` (what the thread engine passes: a row of the batch buffer) receives exactly the
    image `resize_crop` returns without it, flipped or not, by OpenCV or by Pillow (the eval
    preset's fractional box), and is returned itself."""
    data, size = _quadrant_jpeg(200, 150), 24
    cfg = TransformConfig(preset, image_size=size, scale=(0.03, 1.0))
    shape = (150, 200, 3) if preset == "none" else (size, size, 3)
    batch = np.zeros((12, *shape), dtype=np.uint8)
    flips = set()
    for sample_id in range(12):
        source = decode_for_crop(data, cfg, sample_rng(5, 0, sample_id))
        flips.add(source.flip)
        row = batch[sample_id]
        assert resize_crop(source, cfg, out=row) is row
        assert np.array_equal(row, resize_crop(source, cfg))
    assert flips == ({False, True} if preset == "train" else {False})


# -- the crop-only decode (dlstore/transforms/jpeg_region.c) -------------------------------------------
_NO_REGION = pytest.mark.skipif(
    transforms_module.jpeg_region is None,
    reason="dlstore.transforms.jpeg_region was not built (no libjpeg-turbo headers)",
)


def _photo_jpeg(width: int, height: int, seed: int = 0, **save) -> bytes:
    """Texture in every 8x8 block (so every block's DCT and upsampling matter), not a flat
    field. `save`: Pillow's JPEG options, or `opencv_sampling` (411, 440: samplings Pillow does
    not write) or `grey=True`."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([(x * 3 + y) % 256, (y * 5) % 256, (x * y // 7) % 256], axis=-1).astype(np.int16)
    pixels = np.clip(pixels + rng.integers(-25, 25, pixels.shape, dtype=np.int16), 0, 255).astype(np.uint8)
    if "opencv_sampling" in save:
        cv2 = pytest.importorskip("cv2")
        sampling = getattr(cv2, f"IMWRITE_JPEG_SAMPLING_FACTOR_{save['opencv_sampling']}")
        ok, encoded = cv2.imencode(".jpg", pixels[..., ::-1], [cv2.IMWRITE_JPEG_SAMPLING_FACTOR, sampling])
        assert ok
        return encoded.tobytes()
    image = Image.fromarray(pixels)
    if save.pop("grey", False):
        image = image.convert("L")
    out = io.BytesIO()
    image.save(out, "JPEG", **save)
    return out.getvalue()


def _whole_image_transform(monkeypatch, data: bytes, cfg: TransformConfig, rng) -> np.ndarray:
    with monkeypatch.context() as patch:
        patch.setattr(transforms_module, "jpeg_region", None)
        return transform_image(data, cfg, rng)


class _CountingRegionDecoder:
    def __init__(self, real) -> None:
        self.real, self.calls, self.failures = real, 0, 0

    def decode_region(self, *args):
        self.calls += 1
        try:
            return self.real.decode_region(*args)
        except ValueError:
            self.failures += 1
            raise


@_NO_REGION
@pytest.mark.parametrize(
    "encoding",
    [
        {"subsampling": 2, "quality": 90},  # 4:2:0: 16x16 iMCUs, upsampled both ways
        {"subsampling": 1, "quality": 90},  # 4:2:2
        {"subsampling": 0, "quality": 95},  # 4:4:4: 8x8 iMCUs
        {"subsampling": 2, "quality": 85, "progressive": True},
        {"subsampling": 2, "quality": 90, "restart_marker_blocks": 3},
        {"opencv_sampling": 440},
        {"opencv_sampling": 411},
        {"grey": True},
    ],
    ids=["420", "422", "444", "progressive", "restarts", "440", "411", "grey"],
)
@pytest.mark.parametrize("preset", ["train", "eval"])
def test_the_crop_only_decode_gives_the_pixels_of_the_whole_image_decode(monkeypatch, encoding, preset):
    """Every crop comes out identical to the transform that decodes the whole image: boxes at
    every edge and every decode scale; the whole-pixel ones (the train preset's at the stored
    scale, and a scaled one that lands on whole pixels) made by the crop-only decoder, the
    fractional ones (the eval preset's centre box, most scaled ones) by the whole decode."""
    counting = _CountingRegionDecoder(transforms_module.jpeg_region)
    monkeypatch.setattr(transforms_module, "jpeg_region", counting)
    cfg = TransformConfig(preset, image_size=24, scale=(0.004, 1.0))
    whole_pixel_boxes = 0
    for width, height in [(333, 250), (250, 333), (97, 61), (64, 64)]:
        data = _photo_jpeg(width, height, **dict(encoding))
        plans = [crop_plan(width, height, cfg, sample_rng(5, 0, i)) for i in range(40)]
        scales = [next(iter(_decode_scales([plan], 24))) for plan in plans]
        if preset == "train" and width > 97:
            assert set(scales) == {0.125, 0.25, 0.5, 1.0}
        for i, ((box, _), scale) in enumerate(zip(plans, scales)):
            whole_pixel_boxes += all(float(v * scale).is_integer() for v in box)
            region = transform_image(data, cfg, sample_rng(5, 0, i))
            whole = _whole_image_transform(monkeypatch, data, cfg, sample_rng(5, 0, i))
            assert np.array_equal(region, whole), (width, height, box)
    assert counting.calls == whole_pixel_boxes and counting.failures == 0
    assert whole_pixel_boxes >= (40 if preset == "train" else 1)


@_NO_REGION
@pytest.mark.parametrize("damage", ["cut", "flipped"])
def test_a_jpeg_damaged_outside_the_box_is_refused_as_the_whole_decode_refuses_it(damage):
    """The rows outside the region are not transformed but still read: a JPEG cut off, or with
    bytes changed, below the box is a corrupt sample whatever the box, exactly as before (the
    loader counts and skips the same samples); the box's pixels alone would have decoded."""
    data = _photo_jpeg(320, 240, subsampling=2, quality=90)
    middle = len(data) // 2
    if damage == "cut":
        bad = data[:middle]
    else:
        bad = data[:middle] + bytes(b ^ 0x5A for b in data[middle : middle + 64]) + data[middle + 64 :]
    with pytest.raises(CorruptSample):
        decode_image(bad)
    with pytest.raises(ValueError):
        transforms_module.jpeg_region.decode_region(bad, 40, 16, 100, 30, 1)
    cfg = TransformConfig("train", image_size=32, scale=(0.01, 0.02))  # small boxes, many above the damage
    plans = [crop_plan(320, 240, cfg, sample_rng(0, 0, i)) for i in range(16)]
    assert any(box[3] < 100 for box, _ in plans)
    for i in range(16):
        with pytest.raises(CorruptSample):
            transform_image(bad, cfg, sample_rng(0, 0, i))


@pytest.mark.parametrize("crop_only_decoder", [True, False], ids=["crop-only", "whole-decode"])
def test_check_decodes_refuses_exactly_what_a_first_crop_decode_refuses(monkeypatch, crop_only_decoder):
    """What `dlstore convert` checks once (`check_decodes`) is what the loader's first decode
    of a sample refuses, with the crop-only decoder or without it: JPEGs damaged below any
    box, in every encoding; never an intact one; PNGs and other bytes as `decode_image`."""
    if crop_only_decoder and transforms_module.jpeg_region is None:
        pytest.skip("dlstore.transforms.jpeg_region is not built here")
    if not crop_only_decoder:
        monkeypatch.setattr(transforms_module, "jpeg_region", None)
    cfg = TransformConfig("train", image_size=32, scale=(0.01, 0.02))
    for encoding in ({"subsampling": 2}, {"subsampling": 0}, {"progressive": True}, {"grey": True}):
        data = _photo_jpeg(320, 240, quality=90, **encoding)
        middle = len(data) // 2
        flipped = data[:middle] + bytes(b ^ 0x5A for b in data[middle : middle + 64]) + data[middle + 64 :]
        check_decodes(data)
        for bad in (data[:middle], flipped):
            with pytest.raises(CorruptSample):
                check_decodes(bad)
            for i in range(4):
                with pytest.raises(CorruptSample):
                    decode_for_crop(bad, cfg, sample_rng(0, 0, i))
    png = io.BytesIO()
    Image.new("RGB", (9, 7)).save(png, "PNG")
    check_decodes(png.getvalue())
    for junk in (b"not an image", png.getvalue()[:40]):
        with pytest.raises(CorruptSample):
            check_decodes(junk)


@_NO_REGION
def test_a_jpeg_known_to_decode_is_not_read_below_the_box():
    """`known_to_decode` (the loader knows these bytes decoded before): the rows below the
    box are never read, which is where the rest of the time goes. Seen on a JPEG cut off
    below the box: the box's pixels are those of the intact JPEG."""
    data = _photo_jpeg(320, 240, subsampling=2, quality=90)
    cut = data[: len(data) // 2]
    buffer, x0, width = transforms_module.jpeg_region.decode_region(cut, 40, 16, 100, 60, 1, False)
    intact, _, _ = transforms_module.jpeg_region.decode_region(data, 40, 16, 100, 60, 1, False)
    assert bytes(buffer) == bytes(intact) and bytes(intact) == bytes(
        transforms_module.jpeg_region.decode_region(data, 40, 16, 100, 60, 1)[0]
    )
    cfg = TransformConfig("train", image_size=64, scale=(0.01, 0.03))
    plans = [crop_plan(320, 240, cfg, sample_rng(0, 0, i)) for i in range(32)]
    above = [i for i, (box, _) in enumerate(plans) if box[3] < 80]
    assert above
    for i in above:
        out = resize_crop(decode_for_crop(cut, cfg, sample_rng(0, 0, i), known_to_decode=True), cfg)
        assert np.array_equal(out, transform_image(data, cfg, sample_rng(0, 0, i)))
        with pytest.raises(CorruptSample):
            decode_for_crop(cut, cfg, sample_rng(0, 0, i))


@_NO_REGION
@pytest.mark.parametrize("sampling", [{"subsampling": 2}, {"subsampling": 1}, {"opencv_sampling": 411}])
def test_narrow_regions_are_decoded_as_whole_rows(sampling):
    """A region under two chroma samples wide would be upsampled the simple way: such regions
    (any under 32 px) are decoded across the whole width; the boxes at the edges of tiny
    images keep the whole decode's pixels."""
    data = _photo_jpeg(40, 24, **sampling)
    whole = np.asarray(decode_image(data))
    for left, width in [(0, 1), (0, 2), (1, 2), (38, 2), (39, 1), (16, 4), (3, 31), (0, 40)]:
        buffer, x0, region_width = transforms_module.jpeg_region.decode_region(data, left, 0, width, 24, 1)
        pixels = np.frombuffer(buffer, np.uint8).reshape(24, region_width, 3)
        inner = slice(max(left, 1) if left else 0, left + width - (1 if left + width < 40 else 0))
        assert np.array_equal(pixels[:, inner.start - x0 : inner.stop - x0], whole[:, inner]), (left, width)


@_NO_REGION
def test_what_the_crop_only_decode_does_not_take_is_decoded_whole(monkeypatch):
    """A CMYK JPEG (libjpeg has no CMYK-to-RGB conversion) and a region outside the image are
    ValueErrors of the module; the transform then decodes the whole image as it did before,
    and corrupt bytes stay a CorruptSample."""
    counting = _CountingRegionDecoder(transforms_module.jpeg_region)
    monkeypatch.setattr(transforms_module, "jpeg_region", counting)
    cmyk = io.BytesIO()
    Image.new("CMYK", (120, 90), (10, 200, 30, 0)).save(cmyk, "JPEG")
    cfg = TransformConfig("train", image_size=96)  # every box grows: decoded at the stored scale
    out = transform_image(cmyk.getvalue(), cfg, sample_rng(0, 0, 1))
    assert counting.failures == 1
    assert np.array_equal(out, _whole_image_transform(monkeypatch, cmyk.getvalue(), cfg, sample_rng(0, 0, 1)))
    data = _photo_jpeg(64, 48)
    for args in [(60, 0, 8, 8, 1), (0, 0, 33, 8, 2), (-1, 0, 8, 8, 1), (0, 0, 8, 8, 3)]:
        with pytest.raises(ValueError):
            transforms_module.jpeg_region.decode_region(data, *args)
    with pytest.raises(CorruptSample):
        transform_image(data[:200] + bytes(300), cfg, sample_rng(0, 0, 0))


# -- the resize of a whole-pixel box: torch's SIMD kernel, else OpenCV --------------------------
_NO_TORCH_RESIZE = pytest.mark.skipif(
    not transforms_module.torch_resizes_uint8(), reason="torch has no SIMD uint8 resize on this CPU (AVX2)"
)


@_NO_TORCH_RESIZE
@pytest.mark.parametrize("size", [24, 64])
def test_a_train_crop_is_torchvisions_resized_crop_of_the_same_box(size):
    """Where torch's SIMD resize runs, a train crop decoded at the stored scale (shrinking,
    growing, one side each, flips) is exactly torchvision's `resized_crop(..., antialias=True)`
    of the decoded image: the augmentation torchvision's RandomResizedCrop makes for that box.
    (A box of twice the output size or more is decoded at a reduced scale first.)"""
    tv = pytest.importorskip("torchvision.transforms.v2.functional")
    data = _photo_jpeg(150, 100, subsampling=2, quality=90)
    whole = torch.from_numpy(np.asarray(decode_image(data)).copy()).permute(2, 0, 1)
    cfg = TransformConfig("train", image_size=size, scale=(0.02, 1.0), ratio=(0.2, 5.0))
    plans = [crop_plan(150, 100, cfg, sample_rng(2, 0, i)) for i in range(64)]
    unscaled = [i for i, plan in enumerate(plans) if _decode_scales([plan], size) == {1.0}]
    sides = {(plans[i][0][2] - plans[i][0][0] > size, plans[i][0][3] - plans[i][0][1] > size) for i in unscaled}
    assert len(sides) >= 3 and {plans[i][1] for i in unscaled} == {False, True}
    for i in unscaled:
        box, flip = plans[i]
        left, top, right, bottom = box
        want = tv.resized_crop(whole, top, left, bottom - top, right - left, [size, size], antialias=True)
        want = (want.flip(-1) if flip else want).permute(1, 2, 0).numpy()
        assert np.array_equal(transform_image(data, cfg, sample_rng(2, 0, i)), want), (box, flip)


def test_without_torchs_resize_opencv_resizes_near_pillow(monkeypatch):
    """Elsewhere (no AVX2: aarch64) OpenCV resizes: the same boxes and flips, within a few
    levels of Pillow's antialiased resample, and torch's path within one level of it."""
    data, size = _photo_jpeg(200, 150, subsampling=2, quality=90), 80  # no box of 160 px: none decoded scaled
    cfg = TransformConfig("train", image_size=size, scale=(0.05, 1.0))
    plans = [crop_plan(200, 150, cfg, sample_rng(4, 0, i)) for i in range(24)]
    assert _decode_scales(plans, size) == {1.0}
    references = [_pillow_reference(data, box, flip, size).astype(int) for box, flip in plans]
    default = [transform_image(data, cfg, sample_rng(4, 0, i)) for i in range(len(plans))]
    torch_resizes = transforms_module.torch_resizes_uint8()
    monkeypatch.setattr(transforms_module, "torch_resizes_uint8", lambda: False)
    opencv = [transform_image(data, cfg, sample_rng(4, 0, i)) for i in range(len(plans))]
    assert np.mean([np.abs(o - r).mean() for o, r in zip(opencv, references)]) < 4
    if torch_resizes:
        assert not all(np.array_equal(a, b) for a, b in zip(default, opencv))  # another resizer ran
        assert np.mean([np.abs(d - r).mean() for d, r in zip(default, references)]) < 1


def test_transform_none_refuses_a_jpeg_of_another_size_from_its_header_before_decoding():
    """A 600-byte JPEG whose header says 30000x30000 was decoded (3 GB, twice) before the size
    was compared; the header tells it."""
    import dlstore.transforms as transforms

    data = bytearray(_jpeg(16, 16))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = (30000).to_bytes(2, "big") * 2  # height, width
    with pytest.raises(ConfigError, match="30000x30000 where the batch holds 16x16"):
        transforms.check_kept_size(bytes(data), 16)
    transforms.check_kept_size(_jpeg(16, 16), 16)
