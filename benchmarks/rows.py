"""The C row builder against the per-image path, on one core: ms per image, and the resize alone.

Each round times, over the same JPEGs, boxes and flips:

* rows: `crop_rows`, one C call for all: crop-only decode, resize, flip, written into the batch;
* per image: `decode_for_crop` then `resize_crop` into the batch row, as without the C part;
* region decode: `jpeg_region.decode_region` of the same regions, so rows minus this is the resize;
* torch resize: torch's antialiased SIMD kernel on the decoded crops, one call each.

It also prints the mean pixel difference between rows and the per-image path.

Example::

    python -m benchmarks.rows --images 300 --rounds 7
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from benchmarks.data import prepare_data
from benchmarks.runner import interleave, show, workdir
from dlstore.config import TransformConfig
from dlstore.format.shards import iter_samples
from dlstore.transforms import cpu_decode, crop_plan, crop_rows, decode_for_crop, jpeg_size, resize_crop, sample_rng


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=None, help="where the data is made once (default: a temp folder)")
    p.add_argument("--images", type=int, default=300)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--image-size", type=int, default=224)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = TransformConfig("train", args.image_size)
    with workdir(args.workdir, "dlstore-rows-") as root:
        data = prepare_data(root, args.images, 1)
        shard = next(data.store_dir.glob("*.tar"))
        datas = [sample["jpg"] for sample in iter_samples(shard.read_bytes())][: args.images]
    jobs, regions, crops, size = [], [], [], args.image_size
    for row, jpeg in enumerate(datas):
        height, width = jpeg_size(jpeg)
        box, flip = crop_plan(width, height, cfg, sample_rng(0, 0, row))
        jobs.append((jpeg, box, flip, row, True))
        short_side = min(box[2] - box[0], box[3] - box[1])  # decode_for_crop's scale, as a divisor
        denom = next((d for d in (8, 4, 2) if short_side / d >= size), 1)
        left, top, right, bottom = (v / denom for v in box)
        x, y = max(0, math.floor(left) - 1), max(0, math.floor(top) - 1)
        x_end = min(-(-width // denom), math.ceil(right) + 1)
        y_end = min(-(-height // denom), math.ceil(bottom) + 1)
        buffer, x0, region_width = cpu_decode.jpeg_region.decode_region(jpeg, x, y, x_end - x, y_end - y, denom)
        regions.append((jpeg, x, y, x_end - x, y_end - y, denom))
        pixels = np.frombuffer(buffer, np.uint8).reshape(y_end - y, region_width, 3)
        crop = pixels[math.floor(top) - y : math.ceil(bottom) - y, math.floor(left) - x0 : math.ceil(right) - x0]
        crops.append(torch.from_numpy(np.ascontiguousarray(crop).transpose(2, 0, 1)[np.newaxis]))
    rows = np.zeros((len(datas), size, size, 3), np.uint8)
    per_image = np.zeros_like(rows)
    target = torch.from_numpy(np.zeros((size, size, 3), np.uint8).transpose(2, 0, 1)[np.newaxis])

    def timed(work) -> float:
        start = time.perf_counter()
        work()
        return (time.perf_counter() - start) / len(datas) * 1e3

    def each_image() -> None:
        for row, jpeg in enumerate(datas):
            resize_crop(decode_for_crop(jpeg, cfg, sample_rng(0, 0, row)), cfg, per_image[row])

    def region_decodes() -> None:
        for region in regions:
            cpu_decode.jpeg_region.decode_region(*region)

    def torch_resizes() -> None:
        for crop in crops:
            torch.ops.aten._upsample_bilinear2d_aa.out(crop, [size, size], False, None, None, out=target)

    runs = {
        "rows": lambda: timed(lambda: crop_rows(jobs, cfg, rows)),
        "per image": lambda: timed(each_image),
        "region decode": lambda: timed(region_decodes),
        "torch resize": lambda: timed(torch_resizes),
    }
    rounds = interleave(args.rounds, runs)
    print(f"{len(datas)} JPEGs, train crops at {size} px, one core: ms per image, {len(rounds)} rounds")
    for name in runs:
        print(show(name, [r[name] for r in rounds]))
    print(show("rows' resize (rows - region decode)", [r["rows"] - r["region decode"] for r in rounds]))
    print(show("rows' resize / torch resize", [(r["rows"] - r["region decode"]) / r["torch resize"] for r in rounds]))
    print(show("rows / per image, CPU per image", [r["rows"] / r["per image"] for r in rounds]))
    diff = np.abs(rows.astype(int) - per_image.astype(int))
    print(f"  pixels against the per-image path: mean difference {diff.mean():.4f} levels (of 255), max {diff.max()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
