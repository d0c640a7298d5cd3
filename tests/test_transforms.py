"""Decode and augmentation presets."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from dlstore.errors import ConfigError, CorruptSample
from dlstore.transforms import TransformConfig, decode_image, decode_on_device, device_jpeg, sample_rng, transform_image


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
