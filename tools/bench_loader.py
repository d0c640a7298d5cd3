#!/usr/bin/env python3
"""The streaming loader's numbers, on generated ImageNet-like shards (~100 KB JPEGs, ~400x350).

Three ratios, each measured in rounds that alternate the runs being compared (the machine
may be shared, so a ratio taken within one round is the trustworthy figure; the spread over
rounds is reported with the median):

(a) dlstore warm-cache img/s / (cores x the single-core rate of the same decode + augment
    function, `transform_image`, over the same samples held in memory). Goal >= 0.95.
    Measured for the loader's uint8 output (what the host does when a GPU normalises) and
    for its CPU-device default (float32, normalised on the CPU). A control, "ceiling", runs
    the bare function in `cores` processes at once: what the machine gives right now. The
    float32 run is also made with `shared_slots=False` (batches handed over as fresh shared
    tensors, torch's default) to show what the loader's batch slots save.
(b) cold (every shard streamed from a local Swift server into an empty cache) / warm,
    over whole epochs of the same loader. Goal >= 0.9.
(c) against WebDataset and a folder DataLoader: `tools/bench_peers.py` (each peer's fastest
    decoder, uint8 out, the same shards).
(d) RSS growth over 5 epochs, summed over the main process and its workers. Goal < 5%.

Example::

    python tools/bench_loader.py --per-class 200 --rounds 3 --json loader.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import dlstore  # noqa: E402
from dlstore.config import StoreConfig  # noqa: E402
from dlstore.format.checksums import DEFAULT_ALGORITHM  # noqa: E402
from dlstore.sample_path import SamplePath  # noqa: E402
from dlstore.world import World  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GOALS = {"a": 0.95, "b": 0.9, "d": 0.05}
_SAMPLES: tuple = ()  # (sample path, samples) the "ceiling" processes decode (inherited by fork)


# -- data ----------------------------------------------------------------------------------------
def make_shards(workdir: Path, classes: int, per_class: int, samples_per_shard: int, procs: int = 1) -> str:
    """`classes` x `per_class` generated ImageNet-like JPEGs (400x350) in `workdir/source/train`
    (an ImageFolder), converted into shards at `file://workdir/store/train`."""
    from dlstore.convert import ConvertOptions, convert

    train = workdir / "source" / "train"
    make_images(train, classes * per_class, classes, (400, 350), procs)
    url = f"file://{workdir}/store/train"
    convert("imagefolder", train, url, ConvertOptions(samples_per_shard=samples_per_shard, workers=procs))
    return url


def _make_part(args: tuple[str, int, int, tuple[int, int], int]) -> None:
    from dlstore.demo.datagen import make_imagenet

    root, classes, per_class, size, seed = args
    make_imagenet(root, num_classes=classes, train_per_class=per_class, val_per_class=1, image_size=size, seed=seed)


def make_images(train: Path, images: int, classes: int, size: tuple[int, int], procs: int) -> None:
    """An ImageFolder tree of `images` generated JPEGs of `size` in `classes` classes (rounded
    down to a multiple of `classes`) under `train`, made in `procs` processes (one seed each;
    generating is ~10 ms per image)."""
    workdir = train.parent.parent
    per_class = max(1, images // classes)
    procs = max(1, min(procs, per_class))
    # Parts of whole classes' worth each, all `images // classes` per class in all.
    counts = [per_class // procs + (i < per_class % procs) for i in range(procs)]
    parts = [(str(workdir / f"part{i}"), classes, n, size, i) for i, n in enumerate(counts)]
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        pool.map(_make_part, parts)
    for number, (root, *_rest) in enumerate(parts):
        for class_dir in sorted((Path(root) / "train").iterdir()):
            target = train / class_dir.name
            target.mkdir(parents=True, exist_ok=True)
            for image in class_dir.iterdir():
                image.rename(target / f"p{number}_{image.name}")
        shutil.rmtree(root)


def read_all_samples(
    url: str, cache_dir: str, image_size: int, limit: int | None = None
) -> tuple[SamplePath, list[tuple[int, dict]]]:
    """The dataset's sample path (train preset at `image_size`) and (global sample id, raw
    sample) of every sample (or the first `limit`), in manifest order, read through that very path."""
    ds = dlstore.Dataset(url, cache_dir=cache_dir, cache_limit="4GB", transform="train", image_size=image_size,
                         world=World())  # fmt: skip
    ids = np.arange(int(ds.shard_sizes.sum()))[:limit]
    return ds.samples, list(zip(ids.tolist(), ds.samples.read(ids)))


# -- the runs --------------------------------------------------------------------------------------
def _decode_and_augment(path: SamplePath, samples: list[tuple[int, dict]]) -> int:
    """dlstore's own per-sample work (the loader's `decode` and `augment` stages), no loader."""
    for sample_id, sample in samples:
        path.augment(path.decode(sample, 0, sample_id)[0])
    return len(samples)


def single_core_rate(path: SamplePath, samples: list[tuple[int, dict]]) -> Rate:
    """img/s of decode + RandomResizedCrop + flip in this one process, after one untimed pass:
    the loaders are timed after a warm-up epoch, in which each sample decodes once and is then
    known to decode (`SamplePath`: its later crops leave the rows below unread), so this is the
    same steady state (and `ceiling_rate`'s processes, forked after it, inherit it)."""
    _decode_and_augment(path, samples)
    started, cpu = time.perf_counter(), time.process_time()
    _decode_and_augment(path, samples)
    return Rate(len(samples) / (time.perf_counter() - started), 1000.0 * (time.process_time() - cpu) / len(samples))


def _ceiling_part(bounds: tuple[int, int]) -> int:
    path, samples = _SAMPLES
    return _decode_and_augment(path, samples[bounds[0] : bounds[1]])


def ceiling_rate(path: SamplePath, samples: list[tuple[int, dict]], procs: int) -> Rate:
    """img/s of the same stages in `procs` forked processes at once (no loader at all)."""
    global _SAMPLES
    _SAMPLES = (path, samples)
    n = len(samples)
    parts = [(i * n // procs, (i + 1) * n // procs) for i in range(procs)]
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        pool.map(_ceiling_part, [(0, procs)] * procs)  # start-up and imports, untimed
        before = tree_usage()
        started = time.perf_counter()
        done = sum(pool.map(_ceiling_part, parts))
        return Rate(done / (time.perf_counter() - started), 1000.0 * cpu_since(before) / done)


class Rate(NamedTuple):
    images_per_s: float
    cpu_ms_per_image: float  # CPU time of every process involved (main + workers), per image


def epochs_rate(batches: Callable[[int], Iterator], epochs: range) -> Rate:
    """img/s over whole epochs, and the CPU the loader's processes spent per image."""
    before = tree_usage()
    started, images = time.perf_counter(), 0
    for epoch in epochs:
        for batch in batches(epoch):
            images += batch[0].shape[0]
    seconds = time.perf_counter() - started
    return Rate(images / seconds, 1000.0 * cpu_since(before) / images)


def dlstore_loader(
    url: str,
    cache_dir: str,
    args,
    dtype: str,
    store_config: StoreConfig | None = None,
    shared_slots: bool = True,
    dataset_options: dict | None = None,
    **loader_options,
):
    """A loader of `args`' workers, image size and batch size on the CPU, and `batches(epoch)`;
    `dataset_options` go to `dlstore.Dataset` (e.g. fetch settings) and `loader_options` to
    `dlstore.Loader` (e.g. `engine=`), as they are."""
    ds = dlstore.Dataset(
        url,
        cache_dir=cache_dir,
        cache_limit="4GB",
        transform="train",
        image_size=args.image_size,
        batch_size=args.batch_size,
        seed=0,
        world=World(),
        store_config=store_config,
        **(dataset_options or {}),
    )
    loader = dlstore.Loader(
        ds, num_workers=args.workers, device="cpu", dtype=dtype, shared_slots=shared_slots, **loader_options
    )

    def batches(epoch: int) -> Iterator:
        loader.set_epoch(epoch)
        return iter(loader)

    return loader, batches


def dlstore_warm_rate(url: str, cache_dir: str, args, dtype: str, shared_slots: bool = True) -> Rate:
    _, batches = dlstore_loader(url, cache_dir, args, dtype, shared_slots=shared_slots)
    epochs_rate(batches, range(0, 1))  # warm-up: workers started, cache filled, indexes read
    return epochs_rate(batches, range(1, 1 + args.epochs))


def swift_cold_warm(url: str, cache_root: Path, args, store_config: StoreConfig) -> tuple[Rate, Rate]:
    """One loader: epoch 0 from an empty cache (every shard fetched from Swift), then warm epochs."""
    cache_dir = tempfile.mkdtemp(prefix="swift-cache-", dir=cache_root)
    _, batches = dlstore_loader(url, cache_dir, args, "float32", store_config)
    try:
        cold = epochs_rate(batches, range(0, 1))
        return cold, epochs_rate(batches, range(1, 1 + args.epochs))
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


def rss_growth(url: str, cache_dir: str, args, epochs: int = 5) -> dict:
    """RSS (main + workers) after the first batch and after each epoch, as the loop sees it."""
    _, batches = dlstore_loader(url, cache_dir, args, "float32")
    after_epoch: list[int] = []
    first_batch = 0
    for epoch in range(epochs):
        for step, batch in enumerate(batches(epoch)):
            if epoch == 0 and step == 0:
                first_batch = tree_rss()
            del batch
        gc.collect()
        after_epoch.append(tree_rss())
    return {
        "after_first_batch_mb": first_batch / 1e6,
        "after_epoch_mb": [x / 1e6 for x in after_epoch],
        "growth_epoch1_to_last": after_epoch[-1] / after_epoch[0] - 1,
        "growth_first_batch_to_last": after_epoch[-1] / first_batch - 1,
    }


def tree_usage() -> dict[int, tuple[float, int]]:
    """{pid: (CPU seconds, resident bytes)} of this process and all its descendants (the
    loader's workers); psutil when installed, else /proc."""
    try:
        import psutil
    except ImportError:
        return _proc_tree_usage(os.getpid())
    me = psutil.Process()
    out = {}
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            cpu = proc.cpu_times()
            out[proc.pid] = (cpu.user + cpu.system, proc.memory_info().rss)
    return out


def _proc_tree_usage(pid: int) -> dict[int, tuple[float, int]]:
    page, ticks = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_CLK_TCK")
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as file:
                stats[int(entry)] = file.read().rsplit(")", 1)[1].split()
    out, todo = {}, [pid]
    while todo:
        current = todo.pop()
        fields = stats.get(current)
        if fields is None:
            continue
        # After the ")": state ppid ... utime (index 11) stime (12) ... rss pages (21).
        out[current] = ((int(fields[11]) + int(fields[12])) / ticks, int(fields[21]) * page)
        todo += [child for child, f in stats.items() if int(f[1]) == current]
    return out


def tree_rss() -> int:
    return sum(rss for _, rss in tree_usage().values())


def cpu_since(before: dict[int, tuple[float, int]]) -> float:
    """CPU seconds the process tree has used since `before` (all of it, for processes started
    since; processes that have ended since are not counted, so measure while workers live)."""
    now = tree_usage()
    return sum(cpu - (before[pid][0] if pid in before else 0.0) for pid, (cpu, _) in now.items())


# -- Swift -----------------------------------------------------------------------------------------
@contextlib.contextmanager
def swift_server(data_dir: Path) -> Iterator[dict[str, str]]:
    script = [sys.executable, str(ROOT / "tools" / "swift_server.py")]
    started = subprocess.run(
        [*script, "start", "--data-dir", str(data_dir), "--stop-with-pid", str(os.getpid())],
        capture_output=True,
        text=True,
    )
    if started.returncode != 0:
        raise SystemExit(f"swift_server.py start failed:\n{started.stderr[-3000:]}")
    try:
        yield parse_exports(started.stdout)
    finally:
        subprocess.run([*script, "stop", "--data-dir", str(data_dir)], capture_output=True)


def parse_exports(text: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0] == "export":
            for word in words[1:]:
                name, sep, value = word.partition("=")
                if sep:
                    env[name] = value
    return env


def upload_to_swift(
    workdir: Path,
    env: dict[str, str],
    samples_per_shard: int,
    checksum_algorithm: str = DEFAULT_ALGORITHM,
    check_decode: bool = True,
) -> tuple[str, StoreConfig]:
    """The same shards (the conversion is deterministic) written straight into Swift, at
    swift://bench/train-<samples per shard> (and -<algorithm> for checksums other than the
    default, -unchecked without `ConvertOptions.check_decode`): a run of another size,
    algorithm or check leaves the others' data in place."""
    import swiftclient

    from dlstore.convert import ConvertOptions, convert

    config = StoreConfig.from_env(env)
    swift = config.swift
    swiftclient.Connection(swift.auth_url, swift.user, swift.key.reveal() if swift.key else None).put_container("bench")
    url = f"swift://bench/train-{samples_per_shard}"
    url += "" if checksum_algorithm == DEFAULT_ALGORITHM else f"-{checksum_algorithm}"
    url += "" if check_decode else "-unchecked"
    options = ConvertOptions(
        split="train",
        samples_per_shard=samples_per_shard,
        workers=1,
        checksum_algorithm=checksum_algorithm,
        check_decode=check_decode,
        overwrite=True,  # the bench's own data: one made by an older dlstore is rebuilt, not refused
    )
    convert("imagenet", workdir / "source", url, options, config=config)
    return url, config


# -- the report ------------------------------------------------------------------------------------
def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def show(label: str, values: list[float], goal: str = "", fmt: str = "{:.3f}") -> str:
    s = spread(values)
    runs = ", ".join(fmt.format(v) for v in values)
    middle = f"{fmt.format(s['median']):>7}  [{fmt.format(s['min'])} .. {fmt.format(s['max'])}]"
    return f"  {label:<50} {middle:<22} {goal:<13} runs: {runs}"


def measure_round(path, samples, url: str, store_dir: Path, cache_dir: str, args, cores: int, swift) -> dict[str, Rate]:
    """One round; the runs alternate with those of the other rounds. Each run's loader (and
    its persistent workers) goes when its function returns."""
    measured = {
        "single_core": single_core_rate(path, samples),
        "ceiling": ceiling_rate(path, samples, cores),
        "dlstore_uint8": dlstore_warm_rate(url, cache_dir, args, "uint8"),
        "dlstore_float32_no_slots": dlstore_warm_rate(url, cache_dir, args, "float32", shared_slots=False),
        "dlstore_float32": dlstore_warm_rate(url, cache_dir, args, "float32"),
    }
    if swift:
        measured["swift_cold"], measured["swift_warm"] = swift_cold_warm(swift[0], store_dir.parents[1], args, swift[1])
    return measured


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--per-class", type=int, default=200, help="images per class (default 200: 2,000 images)")
    parser.add_argument("--samples-per-shard", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="default: one per core")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per run, after one warm-up epoch")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of alternating runs")
    parser.add_argument("--rss-epochs", type=int, default=5)
    parser.add_argument("--no-swift", action="store_true", help="leave out (b)")
    parser.add_argument("--workdir", help="keep the data here (default: a temp dir, removed afterwards)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)

    cores = len(os.sched_getaffinity(0))
    own = not args.workdir
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dlstore-bench-loader-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "machine": {"cores": cores, "python": platform.python_version(), "torch": torch.__version__},
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "workdir")},
    }
    rounds: list[dict[str, Rate]] = []
    try:
        started = time.perf_counter()
        store_dir = workdir / "store" / "train"
        if (store_dir / "index.json").exists():
            url = f"file://{store_dir}"
        else:
            url = make_shards(workdir, args.classes, args.per_class, args.samples_per_shard)
        path, samples = read_all_samples(url, str(workdir / "sample-cache"), args.image_size)
        sizes = [len(path.image_bytes(sample)) for _, sample in samples]
        results["data"] = {"samples": len(samples), "mean_jpeg_bytes": float(np.mean(sizes))}
        print(
            f"{len(samples):,} samples, {np.mean(sizes) / 1e3:.0f} KB JPEGs, in {time.perf_counter() - started:.0f} s; "
            f"batch {args.batch_size}, {args.workers} workers, {cores} cores, {args.rounds} rounds",
            flush=True,
        )
        cache_dir = str(workdir / "cache")
        swift_ctx = contextlib.nullcontext(None) if args.no_swift else swift_server(workdir / "swift")
        with swift_ctx as swift_env:
            swift = upload_to_swift(workdir, swift_env, args.samples_per_shard) if swift_env else None
            for number in range(args.rounds):
                measured = measure_round(path, samples, url, store_dir, cache_dir, args, cores, swift)
                rounds.append(measured)
                print(
                    f"round {number + 1}: " + ", ".join(f"{k} {v.images_per_s:.0f}" for k, v in measured.items()),
                    flush=True,
                )
        rss = rss_growth(url, cache_dir, args, args.rss_epochs)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    report(results, rounds, rss, cores, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def report(results: dict, rounds: list[dict[str, Rate]], rss: dict, cores: int, args) -> None:
    rate = {k: [r[k].images_per_s for r in rounds] for k in rounds[0]}
    cpu = {k: [r[k].cpu_ms_per_image for r in rounds] for k in rounds[0]}

    def ratio(num: str, den: str, scale: float = 1.0) -> list[float]:
        return [n / (d * scale) for n, d in zip(rate[num], rate[den])]

    def cpu_ratio(loader: str, reference: str) -> list[float]:
        """CPU per image of `reference` / that of `loader` (1.0: the loader adds no CPU work)."""
        return [r / n for n, r in zip(cpu[loader], cpu[reference])]

    ratios = {
        "a_uint8": ratio("dlstore_uint8", "single_core", cores),
        "a_float32": ratio("dlstore_float32", "single_core", cores),
        "a_uint8_cpu": cpu_ratio("dlstore_uint8", "single_core"),
        "a_float32_cpu": cpu_ratio("dlstore_float32", "single_core"),
        "slots": ratio("dlstore_float32", "dlstore_float32_no_slots"),
        "slots_cpu": cpu_ratio("dlstore_float32", "dlstore_float32_no_slots"),
        "a_control": ratio("ceiling", "single_core", cores),
        "a_uint8_vs_control": ratio("dlstore_uint8", "ceiling"),
        "a_uint8_vs_control_cpu": cpu_ratio("dlstore_uint8", "ceiling"),
    }
    if "swift_cold" in rate:
        ratios["b"] = ratio("swift_cold", "swift_warm")
    results.update(
        rates={k: spread(v) for k, v in rate.items()},
        cpu_ms_per_image={k: spread(v) for k, v in cpu.items()},
        ratios={k: spread(v) for k, v in ratios.items()},
        rss=rss,
        goals=GOALS,
    )
    print(f"\nimg/s and CPU ms per image (all processes), median [min .. max] over {len(rounds)} rounds")
    for key in rate:
        print(show(f"{key} img/s", rate[key], fmt="{:.0f}"))
        if key in cpu:
            print(show(f"{key} CPU ms/img", cpu[key], fmt="{:.2f}"))
    print("\nratios (each taken within one round)")
    lines = [
        ("(a) warm uint8 / (cores x single-core)", "a_uint8", "goal >= 0.95"),
        ("    the same in CPU time per image", "a_uint8_cpu", ""),
        ("(a) warm float32 (CPU-device default) / (cores x 1)", "a_float32", "goal >= 0.95"),
        ("    the same in CPU time per image", "a_float32_cpu", ""),
        ("    float32 with shared batch slots / without", "slots", ""),
        ("    without slots, CPU per image / with", "slots_cpu", ""),
        ("    control: bare function in `cores` procs / (cores x 1)", "a_control", ""),
        ("    warm uint8 / that control", "a_uint8_vs_control", ""),
        ("    the same in CPU time per image", "a_uint8_vs_control_cpu", ""),
        ("(b) cold from Swift / warm", "b", "goal >= 0.9"),
    ]
    for label, key, goal in lines:
        if key in ratios:
            print(show(label, ratios[key], goal))
    mb = ", ".join(f"{x:.0f}" for x in rss["after_epoch_mb"])
    print(
        f"(d) RSS, main + workers, after each of {args.rss_epochs} epochs: {mb} MB; growth epoch 1 -> "
        f"{args.rss_epochs}: {rss['growth_epoch1_to_last']:+.1%} (goal < 5%); from the first batch: "
        f"{rss['growth_first_batch_to_last']:+.1%}"
    )


if __name__ == "__main__":
    sys.exit(main())
