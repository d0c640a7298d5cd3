"""Decode and augmentation presets."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from dlstore.errors import ConfigError, CorruptSample
from dlstore.transforms import (
    TransformConfig,
    augment_image,
    crop_plan,
    decode_image,
    decode_on_device,
    device_jpeg,
    sample_rng,
    transform_image,
)

# The on-device decode runs on the CPU everywhere (torchvision's CPU decoder stands in for
# nvJPEG) and on CUDA where there is one (tools/gpu_check.sh runs this file on a GPU node).
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]
# Quadrant colours: top-left, top-right, bottom-left, bottom-right.
QUADRANTS = np.array([[[220, 30, 30], [30, 220, 30]], [[30, 30, 220], [220, 220, 220]]], dtype=np.uint8)


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


@pytest.mark.parametrize("device", DEVICES)
def test_device_decode_crops_and_flips_where_the_boxes_say(device):
    """Each crop box and flip lands the quadrant colours at the output positions the box
    defines: a decoder that ignored a box or a flip would show other colours there."""
    data = _quadrant_jpeg()
    rows = [(*box, flip) for box in QUADRANT_BOXES for flip in (0, 1)]
    encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for _ in rows]
    images, bad = decode_on_device(encoded, torch.tensor(rows, dtype=torch.float64), 32, device)
    assert bad == [] and images.shape == (len(rows), 32, 32, 3) and images.device.type == device
    for image, row in zip(images.cpu().numpy(), rows, strict=True):
        _assert_quadrants(image, row[:4], bool(row[4]), 96, 64)


@pytest.mark.parametrize("device", DEVICES)
def test_device_decode_of_random_crops_matches_the_cpu_path(device):
    """The train preset's random boxes and flips, decoded on the device and by `augment_image`:
    the same quadrants in the same places, and pixels within the two decoders' rounding."""
    data = _quadrant_jpeg()
    cfg = TransformConfig("train", image_size=24, scale=(0.1, 1.0))
    plans = [crop_plan(96, 64, cfg, sample_rng(5, 0, sample_id)) for sample_id in range(16)]
    assert {flip for _, flip in plans} == {False, True}
    encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for _ in plans]
    rows = torch.tensor([(*box, flip) for box, flip in plans], dtype=torch.float64)
    images, bad = decode_on_device(encoded, rows, 24, device)
    cpu = [augment_image(decode_image(data), cfg, sample_rng(5, 0, sample_id)) for sample_id in range(16)]
    assert bad == [] and len(images) == len(cpu) == len(plans)
    for image, expected, (box, flip) in zip(images.cpu().numpy(), cpu, plans, strict=True):
        _assert_quadrants(image, box, flip, 96, 64)
        _assert_quadrants(expected, box, flip, 96, 64)
        assert np.abs(image.astype(int) - expected.astype(int)).mean() < 2


def _gradient_jpeg(size: int = 64) -> bytes:
    """Red rising 4 levels a pixel to the right, green 4 a pixel down: the pixel whose centre is
    at (x, y) (pixel edges at integers) holds (4x, 4y, 128), and so, between pixel centres,
    does any bilinear resampling."""
    ramp = (4 * np.arange(size) + 2).astype(np.uint8)
    pixels = np.stack(np.broadcast_arrays(ramp[None, :], ramp[:, None], np.uint8(128)), axis=-1)
    out = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels)).save(out, "JPEG", quality=95, subsampling=0)
    return out.getvalue()


def _assert_gradient(image: np.ndarray, box, flip: bool, image_px: int) -> None:
    """Red and green of each output pixel equal 4x and 4y of its source point, wherever the
    resampling filter stays inside the image; a box off by half a pixel is off by 2 levels."""
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


GRADIENT_BOXES = [(0, 0, 64, 64), (8, 4, 40, 60), (20, 30, 36, 46), (3, 17, 61, 29)]


@pytest.mark.parametrize("device", DEVICES)
def test_device_decode_samples_the_source_points_the_box_defines(device):
    data = _gradient_jpeg()
    rows = [(*box, flip) for box in GRADIENT_BOXES for flip in (0, 1)]
    encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for _ in rows]
    images, bad = decode_on_device(encoded, torch.tensor(rows, dtype=torch.float64), 24, device)
    assert bad == [] and len(images) == len(rows)
    for image, row in zip(images.cpu().numpy(), rows, strict=True):
        _assert_gradient(image, row[:4], bool(row[4]), 64)
