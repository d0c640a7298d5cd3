#!/usr/bin/env python3
"""Ways to make one sample's CPU transform (decode + crop + resize + flip) cheaper, measured
against the Pillow transform dlstore had before issue 11, on one core.

Every variant gets the same in-memory JPEGs and the same crop boxes and flips (the box is
drawn by `crop_plan` from `sample_rng(seed, 0, i)` in every variant, so the draws agree).
Variants run in rounds, each for `--seconds` per round, in an order that rotates from round
to round; the machine may be shared, so the trustworthy figure is a ratio taken within one
round: the report gives its median and spread (min..max) over the rounds. Time is the
process's CPU time (what another process on the same core does not inflate), unless
`--clock wall`.

Variants (the first is the reference):

* pillow       simplejpeg decode, Pillow resize with the box (BILINEAR, antialiased), flip
               (dlstore's transform before issue 11)
* cv2          simplejpeg decode, numpy crop (the box rounded to whole pixels), OpenCV
               resize (INTER_AREA when both sides shrink, else INTER_LINEAR; one side
               shrinking and one growing: that side shrunk alone first), cv2.flip
* dct+pillow   the JPEG decoded at 1/2, 1/4 or 1/8 scale (libjpeg-turbo's DCT scaling)
               when the crop box stays at least the output size, the box mapped into the
               scaled image, then as pillow
* dct+cv2      the same scaled decode, then as cv2 (the mapped box rounded)
* dct8+cv2     any k/8 scale (7/8, 3/4, ...; not SIMD in libjpeg-turbo), then as cv2
* dct+torch    the same scaled decode, then torch's antialiased bilinear resize of uint8
               (torchvision's RandomResizedCrop(antialias=True); SIMD on x86 with AVX2) of
               the rounded box, flip: against dct+cv2, what torch's resize saves
* dlstore      `dlstore.transforms.transform_image` as it is now: dct, then torch's resize
               (where it has its SIMD kernel; else cv2) for a whole-pixel box and Pillow for a
               fractional one; a whole-pixel box's rows and columns decoded alone by
               dlstore._jpeg_region where it is built
* dlstore-known  the same for a JPEG known to decode (the loader's from a sample's second
               epoch on): the rows below the box are not read at all
* dlstore-whole  the same with every JPEG decoded whole (dlstore._jpeg_region left out):
               what the crop-only decode saves
* dlstore-split  `resize_crop(decode_for_crop(data))`: the same, as two timed halves
* dlstore-pil  `augment_image(decode_image(data))`: the older split, a Pillow image between

Pixel differences: |variant - pillow| over every pixel of every image, mean and 99th
percentile (and max), in 0..255 units.

    taskset -c 0 python tools/bench_transform.py                      # 300 JPEGs 400x350, train 224
    python tools/bench_transform.py --source-size 800 600 --image-size 160 --rounds 7
    python tools/bench_transform.py --preset eval --json eval.json
    taskset -c 0 python tools/bench_transform.py --variants pillow dlstore dlstore-whole
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import simplejpeg
from PIL import Image, ImageFilter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dlstore import transforms as transforms_module  # noqa: E402
from dlstore.config import TransformConfig  # noqa: E402
from dlstore.demo.datagen import synthetic_image, synthetic_jpeg  # noqa: E402
from dlstore.transforms import (  # noqa: E402
    augment_image,
    crop_plan,
    decode_for_crop,
    decode_image,
    resize_crop,
    sample_rng,
    transform_image,
)

try:
    import cv2
except ImportError:  # the cv2 variants are left out
    cv2 = None

Variant = Callable[[bytes, TransformConfig, np.random.Generator], np.ndarray]


# -- the variants ---------------------------------------------------------------------------
def pillow_transform(data: bytes, cfg: TransformConfig, rng: np.random.Generator) -> np.ndarray:
    """dlstore's transform before issue 11 (simplejpeg decode, one Pillow resample)."""
    pixels = simplejpeg.decode_jpeg(data, colorspace="RGB")
    image = Image.frombuffer("RGB", (pixels.shape[1], pixels.shape[0]), pixels, "raw", "RGB", 0, 1)
    box, flip = crop_plan(image.width, image.height, cfg, rng)
    out = image.resize((cfg.image_size, cfg.image_size), Image.Resampling.BILINEAR, box=box, reducing_gap=None)
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(out)


def _pillow_resize(pixels: np.ndarray, box, size: int, flip: bool) -> np.ndarray:
    image = Image.frombuffer("RGB", (pixels.shape[1], pixels.shape[0]), pixels, "raw", "RGB", 0, 1)
    out = image.resize((size, size), Image.Resampling.BILINEAR, box=box, reducing_gap=None)
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(out)


def _cv2_resize(pixels: np.ndarray, box, size: int, flip: bool) -> np.ndarray:
    left, top, right, bottom = (int(round(v)) for v in box)
    crop = pixels[top:bottom, left:right]
    height, width = crop.shape[:2]
    # One side shrinks, the other grows: INTER_AREA would not average along the shrinking
    # side then, so that side is shrunk alone first.
    if width > size > height:
        crop = cv2.resize(crop, (size, height), interpolation=cv2.INTER_AREA)
    elif height > size > width:
        crop = cv2.resize(crop, (width, size), interpolation=cv2.INTER_AREA)
    shrink = crop.shape[0] >= size and crop.shape[1] >= size
    out = cv2.resize(crop, (size, size), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)
    return cv2.flip(out, 1) if flip else out


def _scaled_decode(data: bytes, cfg: TransformConfig, rng, eighths: tuple[int, ...]):
    """Decode at the smallest k/8 scale that keeps the crop box at least the output size;
    the pixels, the box in their coordinates and the flip."""
    height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    box, flip = crop_plan(width, height, cfg, rng)
    size = cfg.image_size
    short = min(box[2] - box[0], box[3] - box[1])
    factor = next((k / 8 for k in eighths if short * k / 8 >= size), 1.0)
    if factor == 1.0:
        return simplejpeg.decode_jpeg(data, colorspace="RGB"), box, flip
    pixels = simplejpeg.decode_jpeg(
        data, colorspace="RGB", min_width=math.ceil(width * factor), min_height=math.ceil(height * factor)
    )
    return pixels, tuple(v * factor for v in box), flip


def dct_pillow(data, cfg, rng):
    pixels, box, flip = _scaled_decode(data, cfg, rng, (1, 2, 4))
    return _pillow_resize(pixels, box, cfg.image_size, flip)


def plain_cv2(data, cfg, rng):
    pixels = simplejpeg.decode_jpeg(data, colorspace="RGB")
    box, flip = crop_plan(pixels.shape[1], pixels.shape[0], cfg, rng)
    return _cv2_resize(pixels, box, cfg.image_size, flip)


def dct_cv2(data, cfg, rng):
    pixels, box, flip = _scaled_decode(data, cfg, rng, (1, 2, 4))
    return _cv2_resize(pixels, box, cfg.image_size, flip)


def dct8_cv2(data, cfg, rng):
    pixels, box, flip = _scaled_decode(data, cfg, rng, tuple(range(1, 8)))
    return _cv2_resize(pixels, box, cfg.image_size, flip)


def dct_torch(data, cfg, rng):
    pixels, box, flip = _scaled_decode(data, cfg, rng, (1, 2, 4))
    box = tuple(float(round(v)) for v in box)
    return transforms_module._resize_with_torch(pixels, box, flip, cfg.image_size)


def dlstore_split(data, cfg, rng):
    return resize_crop(decode_for_crop(data, cfg, rng), cfg)


def dlstore_pil(data, cfg, rng):
    return augment_image(decode_image(data), cfg, rng)


def dlstore_known(data, cfg, rng):
    """`transform_image` for bytes that decoded before (`known_to_decode`)."""
    return resize_crop(decode_for_crop(data, cfg, rng, known_to_decode=True), cfg)


def dlstore_whole(data, cfg, rng):
    """`transform_image` without the crop-only decoder: every JPEG decoded whole."""
    region, transforms_module._jpeg_region = transforms_module._jpeg_region, None
    try:
        return transform_image(data, cfg, rng)
    finally:
        transforms_module._jpeg_region = region


def variants() -> dict[str, Variant]:
    found: dict[str, Variant] = {"pillow": pillow_transform}
    if cv2 is not None:
        found["cv2"] = plain_cv2
    found["dct+pillow"] = dct_pillow
    if cv2 is not None:
        found["dct+cv2"] = dct_cv2
        found["dct8+cv2"] = dct8_cv2
    found["dct+torch"] = dct_torch
    found["dlstore"] = transform_image
    if transforms_module._jpeg_region is not None:
        found["dlstore-known"] = dlstore_known
        found["dlstore-whole"] = dlstore_whole
    found["dlstore-split"] = dlstore_split
    found["dlstore-pil"] = dlstore_pil
    return found


# -- measuring ------------------------------------------------------------------------------
def make_jpegs(count: int, size: tuple[int, int], quality: int, smooth: bool = False) -> list[bytes]:
    """datagen's ImageNet-like JPEGs; `smooth`: blurred first (datagen's per-pixel grain is
    white noise, the worst case for comparing filters; a photo has less energy up there)."""
    rng = np.random.default_rng(0)
    if not smooth:
        return [synthetic_jpeg(i % 100, rng, size, quality) for i in range(count)]
    jpegs = []
    for i in range(count):
        image = Image.fromarray(synthetic_image(i % 100, rng, size)).filter(ImageFilter.GaussianBlur(1.0))
        out = io.BytesIO()
        image.save(out, "JPEG", quality=quality)
        jpegs.append(out.getvalue())
    return jpegs


def run_once(variant: Variant, jpegs: list[bytes], cfg: TransformConfig, seconds: float, clock) -> float:
    """Images per second of `variant` over `jpegs` (cycled) for about `seconds`."""
    done, start = 0, clock()
    while clock() - start < seconds:
        for i, data in enumerate(jpegs):
            variant(data, cfg, sample_rng(0, 0, i))
        done += len(jpegs)
    return done / (clock() - start)


def pixel_differences(found: dict[str, Variant], jpegs: list[bytes], cfg: TransformConfig) -> dict[str, dict]:
    reference = [pillow_transform(data, cfg, sample_rng(0, 0, i)) for i, data in enumerate(jpegs)]
    out = {}
    for name, variant in found.items():
        diffs = np.concatenate(
            [
                np.abs(variant(data, cfg, sample_rng(0, 0, i)).astype(np.int16) - ref).ravel()
                for i, (data, ref) in enumerate(zip(jpegs, reference))
            ]
        )
        out[name] = {"mean": float(diffs.mean()), "p99": float(np.percentile(diffs, 99)), "max": int(diffs.max())}
    return out


def scaled_share(jpegs: list[bytes], cfg: TransformConfig, eighths: tuple[int, ...]) -> float:
    """The share of samples whose crop allows a scaled decode."""
    scaled = 0
    for i, data in enumerate(jpegs):
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        box, _ = crop_plan(width, height, cfg, sample_rng(0, 0, i))
        short = min(box[2] - box[0], box[3] - box[1])
        scaled += any(short * k / 8 >= cfg.image_size for k in eighths)
    return scaled / len(jpegs)


def measure(found: dict[str, Variant], jpegs, cfg, rounds: int, seconds: float, clock) -> dict[str, dict]:
    names = list(found)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            rates[name].append(run_once(found[name], jpegs, cfg, seconds, clock))
    out = {}
    for name in names:
        ratios = [a / b for a, b in zip(rates[name], rates["pillow"])]
        out[name] = {
            "img_per_s_median": statistics.median(rates[name]),
            "img_per_s_range": [min(rates[name]), max(rates[name])],
            "ratio_median": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)],
        }
    return out


def resize_only(jpegs: list[bytes], cfg: TransformConfig, rounds: int, clock) -> dict:
    """The resize of a whole-pixel train crop alone, torch's SIMD kernel against OpenCV's,
    on the same decoded images and boxes, into the same output: ms per image per round (one
    warm-up pass first: torch's first call sets itself up)."""
    images = [simplejpeg.decode_jpeg(data, colorspace="RGB") for data in jpegs]
    plans = [crop_plan(im.shape[1], im.shape[0], cfg, sample_rng(0, 0, i)) for i, im in enumerate(images)]
    boxes = [tuple(float(round(v)) for v in box) for box, _ in plans]
    out = np.empty((cfg.image_size, cfg.image_size, 3), np.uint8)
    resizers = {"torch": transforms_module._resize_with_torch, "opencv": transforms_module._resize_with_opencv}
    times: dict[str, list[float]] = {name: [] for name in resizers}
    for round_ in range(rounds + 1):
        for name, resize in resizers.items():
            started = clock()
            for image, box in zip(images, boxes):
                resize(image, box, False, cfg.image_size, out)
            if round_:  # round 0 warms up
                times[name].append((clock() - started) / len(images) * 1e3)
    ratios = [o / t for o, t in zip(times["opencv"], times["torch"])]
    return {"ms_per_image": times, "opencv_over_torch": ratios}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--source-size", type=int, nargs=2, default=(400, 350), metavar=("W", "H"))
    parser.add_argument("--quality", type=int, default=90)
    parser.add_argument("--smooth", action="store_true", help="blur the generated images before encoding")
    parser.add_argument("--preset", default="train", choices=("train", "eval"))
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0, help="per variant per round")
    parser.add_argument("--core", type=int, default=0, help="the one core to run on; -1 leaves affinity alone")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--variants", nargs="+", metavar="NAME", help="only these (pillow, the reference, always)")
    parser.add_argument(
        "--resize-only", action="store_true", help="instead: the train crop's resize alone, torch's against OpenCV's"
    )
    args = parser.parse_args(argv)
    if args.core >= 0:
        os.sched_setaffinity(0, {args.core})
    cfg = TransformConfig(args.preset, image_size=args.image_size)
    jpegs = make_jpegs(args.images, tuple(args.source_size), args.quality, args.smooth)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.resize_only:
        if cv2 is None:
            parser.error("--resize-only needs OpenCV")
        result = resize_only(jpegs, cfg, args.rounds, clock)
        for name, values in result["ms_per_image"].items():
            print(
                f"{name:7s} resize ms/img: median {statistics.median(values):.3f} [{min(values):.3f}..{max(values):.3f}]"
            )
        ratios = result["opencv_over_torch"]
        print(
            f"opencv / torch, per round: median {statistics.median(ratios):.2f} [{min(ratios):.2f}..{max(ratios):.2f}]"
        )
        return result
    found = variants()
    if args.variants:
        unknown = set(args.variants) - set(found)
        if unknown:
            parser.error(f"unknown variants {sorted(unknown)}; there are {list(found)}")
        found = {name: v for name, v in found.items() if name == "pillow" or name in args.variants}
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "versions": {
            "simplejpeg": simplejpeg.__version__,
            "pillow": Image.__version__,
            "opencv": cv2.__version__ if cv2 is not None else None,
        },
        "settings": {**vars(args), "json": str(args.json) if args.json else None},
        "scaled_decode_share": {
            "1/2,1/4,1/8": scaled_share(jpegs, cfg, (1, 2, 4)),
            "k/8": scaled_share(jpegs, cfg, tuple(range(1, 8))),
        },
        "pixel_difference": pixel_differences(found, jpegs, cfg),
        "rates": measure(found, jpegs, cfg, args.rounds, args.seconds, clock),
    }
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


def _print(report: dict) -> None:
    s = report["settings"]
    print(
        f"{s['images']} JPEGs {s['source_size'][0]}x{s['source_size'][1]} q{s['quality']}, {s['preset']} "
        f"{s['image_size']}, {s['rounds']} rounds x {s['seconds']} s, {s['clock']} time, core {s['core']}"
    )
    print(
        "crops that allow a scaled decode: "
        + ", ".join(f"{k} {v:.0%}" for k, v in report["scaled_decode_share"].items())
    )
    print(f"{'variant':<14} {'img/s':>7} {'(min..max)':>15} {'ratio':>6} {'(min..max)':>13}   |diff| mean  p99  max")
    for name, rate in report["rates"].items():
        diff = report["pixel_difference"][name]
        low, high = rate["img_per_s_range"]
        rlow, rhigh = rate["ratio_range"]
        print(
            f"{name:<14} {rate['img_per_s_median']:7.0f} {f'({low:.0f}..{high:.0f})':>15} "
            f"{rate['ratio_median']:6.2f} {f'({rlow:.2f}..{rhigh:.2f})':>13}   "
            f"{diff['mean']:10.2f} {diff['p99']:4.0f} {diff['max']:4d}"
        )


if __name__ == "__main__":
    main()
