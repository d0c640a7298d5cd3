"""`dlstore convert` on generated ImageNet-like JPEGs, on one machine and one disk.

1. Conversion without resize against ``tar cf`` of the same files to the same disk.
   The goal is a ratio of at least 0.8. It runs with each JPEG decoded once, the
   default, and with ``--no-check-decode``.
2. Conversion with ``--resize-max-side``: images per second, per worker, and how the
   rate scales from 1 to N workers against what the machine offers right now.

Both sides read the source from the page cache and fsync what they wrote. Runs
alternate, and the best of ``--repeat`` is kept: the least disturbed one.
``--copies`` repeats each image under other names, so fixed costs do not dominate.

    python -m benchmarks.convert                       # 400 distinct JPEGs x 5 copies, workers 1,2
    python -m benchmarks.convert --images 300 --copies 1 --workers 1,2,4 --json bench.json
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from dlstore.config import parse_size
from dlstore.convert import ConvertOptions, convert

from .data import make_images
from .runner import interleave, own_cpu_s, write_json


def fsync_tree(root: Path) -> None:
    """Flush what a run wrote, and only that: `os.sync()` would flush other jobs' writes too."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def timed(run: Callable[[], object], out: Path) -> tuple[float, float]:
    """(seconds, CPU seconds) of `run` into an empty `out`, finished children included."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    started, cpu = time.perf_counter(), own_cpu_s(children=True)
    run()
    fsync_tree(out)
    return time.perf_counter() - started, own_cpu_s(children=True) - cpu


def spin(seconds: float) -> float:
    """Pure-Python work for about `seconds`; the loop count per second."""
    n, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(10_000):
            n += 1
    return n / (time.perf_counter() - started)


def parallel_capacity(workers: int) -> float:
    """How much faster `workers` processes compute than one, right now: 2.0 on two idle cores."""
    one = spin(0.5)
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        return sum(pool.map(spin, [0.5] * workers)) / one


def best(rounds: list[dict], key) -> tuple[float, float]:
    """The fastest run of `key` over the rounds, and the least CPU any of them took."""
    return min(r[key][0] for r in rounds), min(r[key][1] for r in rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--images", type=int, default=400, help="distinct train images to generate (default 400)")
    add("--copies", type=int, default=5, help="files per generated image (default 5)")
    add("--classes", type=int, default=10)
    add("--size", default="400x350", help="image size WIDTHxHEIGHT (default 400x350: ~100 KB JPEGs)")
    add("--workers", default="1,2", help="worker counts to try (default 1,2)")
    add("--resize-max-side", type=int, default=256, help="resize target for part 2 (default 256)")
    add("--quality", type=int, default=90)
    add("--shard-size", default="8MB", help="shard size (default 8MB, so that several workers have shards)")
    add("--repeat", type=int, default=3, help="runs per measurement; the best is kept (default 3)")
    add("--workdir", help="where to put source and output (default: a temp dir); one disk for both")
    add("--json", help="also write the results here")
    args = parser.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    width, _, height = args.size.partition("x")
    base = Path(tempfile.mkdtemp(prefix="dlstore-bench-", dir=args.workdir))
    try:
        src, out, started = base / "src", base / "out", time.perf_counter()
        make_images(src / "train", args.images, args.classes, (int(width), int(height)), 1)
        files = sorted(p for p in (src / "train").rglob("*") if p.is_file())
        for path in files:
            for k in range(1, args.copies):
                shutil.copyfile(path, path.with_name(f"{path.stem}{k}{path.suffix}"))
        count = len(files) * args.copies
        source_bytes = sum(len(p.read_bytes()) for p in (src / "train").rglob("*") if p.is_file())  # warms the cache
        print(f"generated {count} JPEGs, {source_bytes / 1e6:.1f} MB ({source_bytes / count / 1e3:.0f} KB each) "
              f"in {time.perf_counter() - started:.1f} s under {base}")  # fmt: skip
        results: dict = {"machine": {"cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
                                     "python": sys.version.split()[0]},
                         "images": count, "source_bytes": source_bytes, "shard_size": parse_size(args.shard_size)}  # fmt: skip
        common = dict(split="train", shard_size=parse_size(args.shard_size), quality=args.quality, tmp_dir=str(base))

        def converter(**options) -> Callable[[], float]:
            return lambda: timed(
                lambda: convert("imagenet", src, f"file://{out}/ds", ConvertOptions(**common, **options)), out
            )

        tar = ["tar", "cf", str(out / "all.tar"), "-C", str(src), "train"]
        plain = {"tar": lambda: timed(lambda: subprocess.run(tar, check=True), out)}
        plain |= {(check, n): converter(workers=n, check_decode=check) for check in (True, False) for n in workers}
        rounds = interleave(args.repeat, plain, rotate=False)
        tar_s, tar_cpu = best(rounds, "tar")
        results["tar_cf"] = {"seconds": tar_s, "images_per_s": count / tar_s, "mb_per_s": source_bytes / tar_s / 1e6,
                             "cpu_us_per_image": tar_cpu / count * 1e6}  # fmt: skip
        print(f"tar cf:                              {count / tar_s:6.0f} img/s  {source_bytes / tar_s / 1e6:6.1f} MB/s"
              f"  {tar_cpu / count * 1e6:5.0f} us CPU/img")  # fmt: skip
        results["convert"] = []
        for check, n in (key for key in plain if key != "tar"):
            seconds, cpu = best(rounds, (check, n))
            results["convert"].append({"workers": n, "resize": None, "check_decode": check, "seconds": seconds,
                                       "images_per_s": count / seconds, "vs_tar_cf": tar_s / seconds,
                                       "cpu_us_per_image": cpu / count * 1e6})  # fmt: skip
            what = f"{'' if check else 'unchecked, '}{n} worker(s):"
            print(f"convert, no resize, {what:<22} {count / seconds:6.0f} img/s  {source_bytes / seconds / 1e6:6.1f} "
                  f"MB/s  {cpu / count * 1e6:5.0f} us CPU/img  = {tar_s / seconds:.2f} x tar cf")  # fmt: skip

        # Each capacity is measured next to the run it judges; the best seen is kept.
        resized = {n: converter(workers=n, resize_max_side=args.resize_max_side) for n in workers}
        capacity = {n: (lambda n=n: parallel_capacity(n) if n > 1 else 1.0) for n in workers}
        runs = {(kind, n): table[n] for n in workers for kind, table in (("capacity", capacity), ("resize", resized))}
        rounds = interleave(max(1, args.repeat - 1), runs, rotate=False)
        single = count / best(rounds, ("resize", workers[0]))[0] / workers[0]  # img/s of one worker
        for n in workers:
            seconds, cpu = best(rounds, ("resize", n))
            rate, offered = count / seconds, max(r["capacity", n] for r in rounds)
            row = {"workers": n, "resize": args.resize_max_side, "seconds": seconds, "images_per_s": rate,
                   "per_worker": rate / n, "speedup": rate / single, "machine_capacity": offered,
                   "scaling_efficiency": rate / single / offered, "cpu_us_per_image": cpu / count * 1e6}  # fmt: skip
            results["convert"].append(row)
            print(f"convert, resize {args.resize_max_side}, {n} worker(s):  {rate:6.0f} img/s  {rate / n:5.0f} per "
                  f"worker  speed-up {rate / single:.2f} (the machine offers {offered:.2f} now: efficiency "
                  f"{row['scaling_efficiency']:.2f})")  # fmt: skip
        results["load_average"] = os.getloadavg()
        print(f"load average during the run: {' '.join(f'{x:.1f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
        write_json(args.json, results)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
