"""The C row builder, `crop_rows`: the same pixels as the per-image path, errors per row, and
the GIL released for the whole call."""

from __future__ import annotations

import io
import platform
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from dlstore.config import TransformConfig
from dlstore.transforms import (
    builds_rows_natively,
    cpu_decode,
    crop_params,
    crop_plan,
    crop_rows,
    sample_rng,
    transform_image,
)

pytestmark = pytest.mark.skipif(
    not builds_rows_natively(TransformConfig("train", 32)),
    reason="dlstore.transforms.jpeg_region was not built (no libjpeg-turbo headers)",
)


def _photo(width: int, height: int, seed: int, subsampling: int = 2) -> bytes:
    """A JPEG with detail at every scale, so a shifted or unfiltered resize shows."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255 // width), (y * 255 // height), ((x + y) * 3) % 256], axis=-1)
    pixels = np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90, subsampling=subsampling)
    return out.getvalue()


def _jobs(datas: list[bytes], epoch: int = 0) -> list[tuple]:
    """Jobs whose crops C draws, seed 7, one sample id per row."""
    return [(data, 7, epoch, row, True, row) for row, data in enumerate(datas)]


@pytest.mark.parametrize("preset", ["train", "eval"])
@pytest.mark.parametrize("subsampling", [0, 2])  # 4:4:4 and 4:2:0
def test_rows_match_the_per_image_transform_within_rounding(preset, subsampling):
    """Random crops and flips over sizes that take every decode scale, 1 to 1/8."""
    cfg = TransformConfig(preset, 48)
    sizes = [(64, 50), (200, 150), (400, 330), (900, 700), (37, 120)]
    datas = [_photo(w, h, seed, subsampling) for seed, (w, h) in enumerate(sizes * 3)]
    out = np.zeros((len(datas), 48, 48, 3), np.uint8)
    assert crop_rows(_jobs(datas), cfg, out) == [None] * len(datas)
    expected = np.stack([transform_image(d, cfg, sample_rng(7, 0, row)) for row, d in enumerate(datas)])
    # Within rounding: a crop shifted by a pixel, or a resize without its filter, is off by
    # several levels on these noisy images; the bound is 1/255 on the mean.
    per_image = np.abs(out.astype(int) - expected.astype(int)).reshape(len(datas), -1).mean(axis=1)
    assert per_image.mean() <= 0.1 and per_image.max() <= 0.5, per_image
    # A transform the test can see: another epoch's crops give other rows.
    other = np.zeros_like(out)
    crop_rows(_jobs(datas, epoch=1), cfg, other)
    if preset == "train":
        assert np.abs(other.astype(int) - out.astype(int)).mean() > 5


def test_a_flip_mirrors_the_row_exactly():
    cfg = TransformConfig("train", 40)
    data = _photo(300, 200, 3)
    out = np.zeros((2, 40, 40, 3), np.uint8)
    box = (10, 20, 250, 190)
    assert crop_rows([(data, *box, False, True, 0), (data, *box, True, True, 1)], cfg, out) == [None, None]
    assert np.array_equal(out[1], out[0][:, ::-1])


def test_a_bad_jpeg_fails_its_row_alone():
    cfg = TransformConfig("train", 32)
    good = _photo(120, 90, 1)
    cut = good[: len(good) // 2]
    out = np.full((3, 32, 32, 3), 7, np.uint8)
    results = crop_rows([(good, 0, 0, 120, 90, False, True, 0), (cut, 7, 0, 1, True, 1),
                         (good, 5, 5, 100, 80, False, True, 2)], cfg, out)  # fmt: skip
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], str) and results[1]
    assert (out[0] != 7).any() and (out[2] != 7).any()
    with pytest.raises(ValueError, match="outside"):
        crop_rows([(good, 0, 0, 120, 90, False, True, 3)], cfg, out)  # no row 3
    with pytest.raises(TypeError, match="a job is"):
        crop_rows([(good, 0, 0, True, 0)], cfg, out)


def test_the_call_lets_other_python_threads_run():
    """The GIL is released for the whole call: a Python thread counts on meanwhile."""
    cfg = TransformConfig("train", 224)
    datas = [_photo(800, 600, seed) for seed in range(4)]
    jobs = _jobs(datas * 16)
    out = np.zeros((len(jobs), 224, 224, 3), np.uint8)
    counts, started, stop = [0], threading.Event(), threading.Event()

    def count() -> None:
        started.set()
        while not stop.is_set():
            counts[0] += 1

    thread = threading.Thread(target=count)
    thread.start()
    started.wait()
    before = counts[0]
    crop_rows(jobs, cfg, out)
    during = counts[0] - before
    stop.set()
    thread.join()
    assert during > 1000, during


@pytest.mark.parametrize(
    "cfg",
    [
        TransformConfig("train", 224),
        TransformConfig("train", 32, scale=(0.5, 0.9), ratio=(0.2, 5.0), hflip=False),
        TransformConfig("train", 64, scale=(0.9, 1.0), ratio=(1.9, 2.0)),  # often none of the 10 tries fits
        TransformConfig("eval", 48, crop_ratio=0.5),
    ],
)
def test_c_draws_the_crops_of_crop_plan_bit_for_bit(cfg):
    """The C draw against `crop_plan` with `sample_rng`: numpy's Philox, `uniform`, `integers`
    (with Lemire's rejections) and `random`, and the fallback. Tiny and vast images, and seeds
    and ids that `sample_rng` takes modulo 2 ** 64."""
    rng = np.random.default_rng(5)
    params = crop_params(cfg)
    for _ in range(1500):
        # Sides near 2 ** 31 make Lemire's rejections common.
        sides = [1, 2, 3, rng.integers(1, 6000), rng.integers(100, 600), rng.integers(2**30, 2**31 - 1)]
        width, height = (int(rng.choice(sides)) for _ in "wh")
        seed = int(rng.choice([0, 7, -1, 2**64 + 5, int(rng.integers(0, 2**62)) * 8 - 2**64]))
        epoch, sample_id = (
            int(rng.choice([0, 1, rng.integers(0, 2**30)])),
            int(rng.choice([0, -3, rng.integers(0, 10**7)])),
        )
        box, flip = crop_plan(width, height, cfg, sample_rng(seed, epoch, sample_id))
        drawn = cpu_decode.jpeg_region.draw_crop(params, width, height, seed, epoch, sample_id)
        assert drawn == (tuple(float(v) for v in box), flip), (width, height, seed, epoch, sample_id)


def _resize_paths() -> list[str]:
    """The resize's SIMD paths this build and CPU have; the choice is put back."""
    region = cpu_decode.jpeg_region
    best, found = region.resize_path(), []
    for name in ("avx2", "sse2", "c"):
        try:
            found.append(region.resize_path(name))
        except ValueError:
            pass
    region.resize_path(best)
    return found


@pytest.fixture
def resize_path():
    """Chooses a resize path for a test and puts the best back after it."""
    best = cpu_decode.jpeg_region.resize_path()
    yield cpu_decode.jpeg_region.resize_path
    cpu_decode.jpeg_region.resize_path(best)


def test_every_resize_path_writes_the_same_bytes(resize_path):
    """AVX2, SSE2 and plain C, over boxes from 1 px to 900 and outputs from 1 px to 224: each path
    is only a faster way to the same integer sums."""
    paths = _resize_paths()
    assert "c" in paths and ("sse2" in paths) == (platform.machine() in ("x86_64", "AMD64"))
    sizes = [(64, 50), (900, 700), (37, 120), (1, 1), (3, 200), (500, 2)]
    datas = [_photo(w, h, seed) for seed, (w, h) in enumerate(sizes * 2)]
    for size in (1, 5, 48, 224):
        cfg = TransformConfig("train", size)
        jobs = _jobs(datas)
        outs = []
        for name in paths:
            resize_path(name)
            out = np.zeros((len(datas), size, size, 3), np.uint8)
            assert crop_rows(jobs, cfg, out) == [None] * len(datas)
            outs.append(out)
        for name, out in zip(paths[1:], outs[1:]):
            assert np.array_equal(out, outs[0]), (size, name)
    with pytest.raises(ValueError, match="no resize path"):
        resize_path("neon" if "sse2" in paths else "avx2")


@pytest.mark.parametrize("shape", [(300, 400), (90, 61), (224, 224), (40, 30)])
def test_the_resize_matches_torchs_antialiased_kernel(shape):
    """`resize` of a whole image against torch's uint8 antialiased bilinear, the per-image path's
    resize: shrinks, enlargements and the identity, within rounding."""
    height, width = shape
    pixels = np.random.default_rng(height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    src = np.zeros(pixels.size + cpu_decode.jpeg_region.SOURCE_SLACK, np.uint8)
    src[: pixels.size] = pixels.reshape(-1)
    for size, flip in [(224, False), (224, True), (17, False)]:
        out = np.zeros((size, size, 3), np.uint8)
        cpu_decode.jpeg_region.resize(src, height, width, 0, 0, width, height, size, flip, out)
        image = torch.from_numpy(pixels).permute(2, 0, 1)[None]
        expected = torch.nn.functional.interpolate(image, (size, size), mode="bilinear", antialias=True)
        expected = expected[0].permute(1, 2, 0).numpy()
        expected = expected[:, ::-1] if flip else expected
        diff = np.abs(out.astype(float) - expected)
        # On noise, a resize off by a pixel or without its filter is off by tens of levels.
        assert diff.mean() <= 0.05 and diff.max() <= 1, (shape, size, diff.mean(), diff.max())
    if (height, width) == (224, 224):
        same = np.zeros((224, 224, 3), np.uint8)
        cpu_decode.jpeg_region.resize(src, height, width, 0, 0, width, height, 224, False, same)
        assert np.array_equal(same, pixels)


def test_the_resize_refuses_a_box_outside_the_image_or_a_short_buffer():
    region = cpu_decode.jpeg_region
    src, out = np.zeros(10 * 10 * 3 + region.SOURCE_SLACK, np.uint8), np.zeros((4, 4, 3), np.uint8)
    with pytest.raises(ValueError, match="box"):
        region.resize(src, 10, 10, 0, 0, 11, 10, 4, False, out)
    with pytest.raises(ValueError, match="SOURCE_SLACK"):
        region.resize(src[:-1], 10, 10, 0, 0, 10, 10, 4, False, out)
    with pytest.raises(ValueError, match="SOURCE_SLACK"):
        region.resize(src, 10, 10, 0, 0, 10, 10, 5, False, out)
