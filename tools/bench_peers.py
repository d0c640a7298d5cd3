#!/usr/bin/env python3
"""dlstore against its peers on the same JPEGs, the same box and the same settings (issue 11, "Goals").

Each round runs, one after the other (A B C D, A B C D, ...; the machine may be shared, so
a ratio taken within one round is the trustworthy figure, the spread over rounds is shown):

* single-core: dlstore's own per-sample work (`SamplePath.decode` + `.augment`, the stages
  the loader runs) in this one process; x cores it is the ceiling of the goal.
* parallel_processes: the same work in one forked process per core at once, no loader at
  all: what this box gives for perfectly parallel work (shared caches, memory bandwidth,
  a VM's cores), i.e. the ceiling any loader can reach here.
* dlstore_threads / dlstore_processes: `dlstore.Loader(..., device="cpu", dtype="uint8")`
  with the thread engine (decode threads in the training process) and the process engine
  (DataLoader worker processes). A dlstore without `engine=` runs the process engine only.
* webdataset: the `webdataset` package's usual pipeline on the very shard files:
  ``WebDataset(urls, shardshuffle=n, nodesplitter=split_by_node, workersplitter=split_by_worker)
  .shuffle(1000).decode(D).to_tuple("jpg", "cls").map_tuple(augment).batched(B,
  collation_fn=default_collate)`` in a `WebLoader(batch_size=None)` with persistent workers.
* folder: `torchvision.datasets.ImageFolder(loader=L)` over the JPEGs the shards were made
  from, in a `DataLoader(shuffle=True)` with persistent workers.
* D and L, each peer's decoder, is whichever runs it faster here (measured before the rounds,
  in one process with torch on one thread, as in a worker): Pillow (webdataset's "pil",
  ImageFolder's default loader; the crop and resize then run in Pillow) or torchvision's
  libjpeg-turbo decode into a uint8 tensor (`torchvision.io.decode_jpeg`, `decode_image`;
  the crop and resize then run in torch's SIMD kernel, as dlstore's do).
* The shards are a multiple of the workers: WebDataset deals whole shards to its workers.
* dlstore_threads_whole_decode (`--whole-decode-too`): the thread engine with every JPEG
  decoded whole, what dlstore did before its crop-only decode (`dlstore/_jpeg_region.c`).

Both peers augment with torchvision transforms v2 (RandomResizedCrop(size, antialias=True),
RandomHorizontalFlip, uint8 tensors out), with the same workers and batch size as dlstore.
Every loader run: a fresh loader, 1 warm-up epoch, then the timed epochs; the caches (dlstore's
shard cache and the page cache) are warm before the first round; the loaders' order rotates
from round to round. Per loader: img/s over the timed epochs (the pauses between them
included, and within epochs: first batch to last, which a long epoch approaches), CPU ms
per image (the process and its workers), time to the first batch (from `iter()` on the
fresh loader), and the pause between epochs (the last batch of epoch k to the
first of epoch k+1). Last, in a fresh process each (so that nothing of this script is counted),
dlstore's peak RSS during an epoch, summed over the process and its children (psutil), with
`--rss-workers` threads and worker processes, and their PSS (shared pages counted once).

Example (the issue's setup; reuses the data under --workdir when present)::

    python tools/bench_peers.py --workdir /tmp/peers --json peers.json
    python tools/bench_peers.py --quick          # a smoke run, about a minute
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import gc
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import bench_loader
import numpy as np
import psutil
import torch
import torchvision
import webdataset as wds
from torchvision.io import ImageReadMode
from torchvision.transforms import v2

from dlstore.convert.encode import jpeg_header
from dlstore.loader import LoaderConfig

ENGINES = ("threads", "processes")
# Each peer's JPEG decoders to uint8 RGB; the faster one here runs: Pillow (then the crop and
# resize in Pillow), or torchvision's libjpeg-turbo decode (then torch's SIMD resize of uint8).
PEER_DECODES = ("pil", "torchvision")
WDS_SHUFFLE = 1000  # the sample shuffle buffer of webdataset's own examples
RGB = ImageReadMode.RGB
QUICK = {"images": 200, "rounds": 2, "epochs": 1, "batch_size": 32, "rss_workers": 2, "single_core_samples": 100,
         "time_limit": 900}  # fmt: skip


# -- data --------------------------------------------------------------------------------------------
class Data(NamedTuple):
    url: str  # the shards, as dlstore reads them
    store_dir: Path  # the same shard files, as webdataset reads them
    folder: Path  # the JPEGs they were made from, an ImageFolder
    cache_dir: str  # dlstore's shard cache, shared by every dlstore run


def prepare_data(workdir: Path, images: int, shards: int) -> Data:
    """~`images` generated ImageNet-like JPEGs (400x350, ~100 KB) in 10 classes and the same
    JPEGs converted into `shards` shards; made once per size under `workdir`."""
    classes = min(10, images)
    per_class = max(1, images // classes)
    root = workdir / f"imagenet-{classes}x{per_class}-{shards}-shards"
    store_dir = root / "store" / "train"
    if not (store_dir / "index.json").exists():
        shutil.rmtree(root, ignore_errors=True)  # what an interrupted earlier run left
        bench_loader.make_shards(
            root, classes, per_class, -(-classes * per_class // shards), len(os.sched_getaffinity(0))
        )
    return Data(f"file://{store_dir}", store_dir, root / "source" / "train", str(root / "cache"))


def warm_caches(path, data: Data) -> None:
    """Every shard in dlstore's cache, and every file the runs read in the page cache, so that
    round 1 starts as warm as the others."""
    for shard in range(len(path.manifest.shards)):
        path.cache.fetch(*path.shard_ref(shard))
    for file in [*data.store_dir.glob("*.tar"), *data.folder.rglob("*.*")]:
        with open(file, "rb") as stream:
            while stream.read(1 << 22):
                pass


def describe_data(path, samples: list[tuple[int, dict]]) -> dict:
    encoded = [path.image_bytes(sample) for _, sample in samples]
    sizes = [jpeg_header(data)[:2] for data in encoded]
    return {
        "samples": int(path.shard_sizes.sum()),
        "shards": len(path.manifest.shards),
        "mean_jpeg_bytes": float(np.mean([len(data) for data in encoded])),
        "mean_width": float(np.mean([w for w, _ in sizes])),
        "mean_height": float(np.mean([h for _, h in sizes])),
    }


# -- the loaders -----------------------------------------------------------------------------------
class Candidate(NamedTuple):
    batches: Callable[[int], Iterator]  # epoch -> that epoch's batches, (images, labels, ...)
    close: Callable[[], None]


def loader_options() -> set[str]:
    """The options this dlstore's `Loader` takes (its `LoaderConfig`'s fields)."""
    return {field.name for field in dataclasses.fields(LoaderConfig)}


def has_engine_option() -> bool:
    """Whether this dlstore's Loader takes `engine=` (the thread engine)."""
    return "engine" in loader_options()


def dlstore_candidate(data: Data, args, engine: str) -> Candidate:
    """dlstore's uint8 batches on the CPU from `engine`; without `engine=` in this dlstore,
    only "processes" (its worker processes) exists."""
    fields = loader_options()
    options = {"timeout_s": args.batch_timeout} if "timeout_s" in fields else {}
    if "engine" in fields:
        options["engine"] = engine
    elif engine != "processes":
        raise SystemExit(f"this dlstore has no engine= option, so no {engine!r} engine")
    loader, batches = bench_loader.dlstore_loader(data.url, data.cache_dir, args, "uint8", **options)
    return Candidate(batches, loader.close)


def dlstore_whole_decode_candidate(data: Data, args) -> Candidate:
    """The thread engine with every JPEG decoded whole (`dlstore._jpeg_region` left out for
    this run: the loaders run one at a time, and the thread engine decodes in this process)."""
    import dlstore.transforms

    region, dlstore.transforms._jpeg_region = dlstore.transforms._jpeg_region, None
    try:
        candidate = dlstore_candidate(data, args, "threads")
    except BaseException:
        dlstore.transforms._jpeg_region = region
        raise

    def close() -> None:
        try:
            candidate.close()
        finally:
            dlstore.transforms._jpeg_region = region

    return Candidate(candidate.batches, close)


def decode_rgb(data: bytes) -> torch.Tensor:
    """torchvision's JPEG decode of `data` into a uint8 RGB CHW tensor."""
    return torchvision.io.decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=RGB)


def read_rgb(path: str) -> torch.Tensor:
    """An ImageFolder loader: the file decoded by torchvision into a uint8 RGB CHW tensor."""
    return torchvision.io.decode_image(path, mode=RGB)


def peer_augment(image_size: int, from_pil: bool) -> v2.Compose:
    """torchvision's RandomResizedCrop + flip, uint8 CHW tensors out (on a PIL image the crop
    and resize run in Pillow, then it becomes a tensor)."""
    steps = [v2.RandomResizedCrop(image_size, antialias=True), v2.RandomHorizontalFlip()]
    return v2.Compose([*steps, v2.PILToTensor()] if from_pil else steps)


def webdataset_pipeline(urls: list[str], decode: str, args) -> wds.WebDataset:
    """The pipeline of webdataset's examples; batches collated by torch's `default_collate`,
    which in a worker writes them straight into shared memory (its own collation makes a batch
    that is copied there when sent)."""
    decoder = "pil" if decode == "pil" else wds.handle_extension("jpg", decode_rgb)
    return (
        wds.WebDataset(
            urls,
            shardshuffle=len(urls),
            nodesplitter=wds.split_by_node,
            workersplitter=wds.split_by_worker,
        )
        .shuffle(WDS_SHUFFLE)
        .decode(decoder)
        .to_tuple("jpg", "cls")
        .map_tuple(peer_augment(args.image_size, from_pil=decode == "pil"))
        .batched(args.batch_size, collation_fn=torch.utils.data.default_collate)
    )


def _persistent(loader: torch.utils.data.DataLoader) -> Candidate:
    """A DataLoader with persistent workers as a Candidate; closing drops it (and its workers)."""
    held = [loader]

    def close() -> None:
        held.clear()
        gc.collect()

    return Candidate(lambda _epoch: iter(held[0]), close)


def webdataset_candidate(data: Data, args, decode: str) -> Candidate:
    urls = sorted(str(p) for p in data.store_dir.glob("*.tar"))
    loader = wds.WebLoader(
        webdataset_pipeline(urls, decode, args),
        batch_size=None,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        timeout=args.batch_timeout if args.workers > 0 else 0,
    )
    return _persistent(loader)


def folder_dataset(data: Data, args, decode: str) -> torchvision.datasets.ImageFolder:
    if decode == "pil":  # ImageFolder's default loader
        return torchvision.datasets.ImageFolder(str(data.folder), transform=peer_augment(args.image_size, True))
    return torchvision.datasets.ImageFolder(
        str(data.folder), transform=peer_augment(args.image_size, False), loader=read_rgb
    )


def folder_candidate(data: Data, args, decode: str) -> Candidate:
    dataset = folder_dataset(data, args, decode)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        timeout=args.batch_timeout if args.workers > 0 else 0,
    )
    return _persistent(loader)


def fastest_decodes(data: Data, args, tries: int = 2) -> dict[str, tuple[str, dict[str, float]]]:
    """Per peer, the decoder of `PEER_DECODES` with which it runs fastest in one process, as
    in one of its workers (torch on one thread, as DataLoader sets it there): webdataset's
    pipeline over the first shard, the folder dataset over as many of its images (best of
    `tries`, alternating); and each decoder's img/s."""
    urls = sorted(str(p) for p in data.store_dir.glob("*.tar"))[:1]
    first_shard = sum(1 for _ in wds.WebDataset(urls, shardshuffle=False))
    folders = {decode: folder_dataset(data, args, decode) for decode in PEER_DECODES}
    order = np.random.default_rng(0).permutation(len(folders["pil"]))[:first_shard].tolist()

    def webdataset_images(decode: str) -> int:
        return sum(batch[0].shape[0] for batch in webdataset_pipeline(urls, decode, args))

    def folder_images(decode: str) -> int:
        return sum(1 for i in order if folders[decode][i] is not None)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        picks = {}
        for peer, run in (("webdataset", webdataset_images), ("folder", folder_images)):
            best = dict.fromkeys(PEER_DECODES, 0.0)
            for decode in itertools.chain.from_iterable(itertools.repeat(PEER_DECODES, tries)):
                started = time.perf_counter()
                images = run(decode)
                best[decode] = max(best[decode], images / (time.perf_counter() - started))
            picks[peer] = (max(best, key=best.get), best)
        return picks
    finally:
        torch.set_num_threads(threads)


# -- timing ----------------------------------------------------------------------------------------
class EpochMarks(NamedTuple):
    begun: float  # perf_counter when iter() was called
    first: float  # ... when the first batch came
    last: float  # ... when the last batch came
    images: int
    first_images: int  # in the first batch


class RunTimes(NamedTuple):
    images_per_s: float  # over the timed epochs, the pauses between them included
    within_epochs_images_per_s: float  # first batch to last of each timed epoch: the pauses left out
    cpu_ms_per_image: float  # CPU time of the process and its workers, per image
    setup_s: float  # building the loader object
    first_batch_s: float  # iter() on the fresh loader to its first batch (warm caches)
    pauses_s: list[float]  # last batch of epoch k to the first of k+1, warm-up included


def epoch_marks(batches: Callable[[int], Iterator], epoch: int) -> EpochMarks:
    begun = time.perf_counter()
    first = last = 0.0
    images = first_images = 0
    for batch in batches(epoch):
        last = time.perf_counter()
        first = first or last
        images += batch[0].shape[0]
        first_images = first_images or images
    if not images:
        raise SystemExit(f"epoch {epoch} delivered no images")
    return EpochMarks(begun, first, last, images, first_images)


def time_run(make: Callable[[], Candidate], epochs: int) -> RunTimes:
    """One fresh loader: 1 warm-up epoch, then `epochs` timed ones."""
    started = time.perf_counter()
    candidate = make()
    setup_s = time.perf_counter() - started
    try:
        marks = [epoch_marks(candidate.batches, 0)]
        before = bench_loader.tree_usage()  # the workers live until close(): their CPU counts
        marks += [epoch_marks(candidate.batches, epoch) for epoch in range(1, 1 + epochs)]
        cpu_s = bench_loader.cpu_since(before)
    finally:
        candidate.close()
    images = sum(m.images for m in marks[1:])
    within = sum(m.images - m.first_images for m in marks[1:]) / max(sum(m.last - m.first for m in marks[1:]), 1e-9)
    return RunTimes(
        images_per_s=images / (marks[-1].last - marks[1].begun),
        within_epochs_images_per_s=within,
        cpu_ms_per_image=1000.0 * cpu_s / images,
        setup_s=setup_s,
        first_batch_s=marks[0].first - marks[0].begun,
        pauses_s=[after.first - before.last for before, after in itertools.pairwise(marks)],
    )


def loader_makers(data: Data, args, engines: list[str], decodes: dict[str, str]) -> dict[str, Callable[[], Candidate]]:
    """The runs of a round (`measure_round` rotates their order from round to round)."""
    makers: dict[str, Callable[[], Candidate]] = {
        f"dlstore_{engine}": (lambda engine=engine: dlstore_candidate(data, args, engine)) for engine in engines
    }
    if args.whole_decode_too and "threads" in engines:
        makers["dlstore_threads_whole_decode"] = lambda: dlstore_whole_decode_candidate(data, args)
    makers["webdataset"] = lambda: webdataset_candidate(data, args, decodes["webdataset"])
    makers["folder"] = lambda: folder_candidate(data, args, decodes["folder"])
    return makers


def measure_round(
    makers: dict[str, Callable[[], Candidate]], path, samples, args, number: int = 0
) -> dict[str, RunTimes]:
    """The two references, then the loaders, their order rotated by `number` (a drift of the
    box during a round then falls on a different loader each round)."""
    single = bench_loader.single_core_rate(path, samples)
    rate = single.images_per_s
    measured = {"single_core": RunTimes(rate, rate, single.cpu_ms_per_image, 0.0, 0.0, [])}
    parallel = bench_loader.ceiling_rate(path, samples, len(os.sched_getaffinity(0)))
    rate = parallel.images_per_s
    measured["parallel_processes"] = RunTimes(rate, rate, parallel.cpu_ms_per_image, 0.0, 0.0, [])
    names = list(makers)
    names = names[number % len(names) :] + names[: number % len(names)]
    timed = {name: time_run(makers[name], args.epochs) for name in names}
    return {**measured, **{name: timed[name] for name in makers}}


# -- resident memory -------------------------------------------------------------------------------
class PeakRss:
    """The peak RSS of this process and its descendants, polled in a thread while in use."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="peak-rss", daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, bench_loader.tree_rss())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, bench_loader.tree_rss())


def tree_pss() -> int:
    """Proportional set size summed over this process and its descendants: shared pages
    (torch's libraries in every worker) counted once in all."""
    me = psutil.Process()
    total = 0
    for proc in [me, *me.children(recursive=True)]:
        try:
            total += proc.memory_full_info().pss
        except psutil.Error:
            pass
    return total


def rss_of_engine(data: Data, args) -> dict:
    """In this (fresh) process: the peak RSS during one epoch after a warm-up epoch, with
    `args.rss_workers` threads or worker processes of engine `args.rss_child`."""
    before = bench_loader.tree_rss()
    candidate = dlstore_candidate(
        data, argparse.Namespace(**{**vars(args), "workers": args.rss_workers}), args.rss_child
    )
    try:
        epoch_marks(candidate.batches, 0)
        with PeakRss() as peak:
            epoch_marks(candidate.batches, 1)
        pss = tree_pss()
    finally:
        candidate.close()
    mb = 1e-6
    return {"engine": args.rss_child, "workers": args.rss_workers, "before_loader_mb": before * mb,
            "peak_rss_mb": peak.peak * mb, "pss_after_epoch_mb": pss * mb}  # fmt: skip


def rss_in_fresh_process(args, workdir: Path, engine: str, seconds: float) -> dict:
    """`rss_of_engine` in a new Python process (so nothing this script holds is counted)."""
    command = [sys.executable, __file__, "--rss-child", engine, "--workdir", str(workdir)]
    for name in ("images", "shards", "batch_size", "image_size", "rss_workers", "batch_timeout"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    command += ["--time-limit", str(max(30, int(seconds)))]
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 30)
    if done.returncode != 0:
        raise SystemExit(f"the RSS run of the {engine} engine failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the report ------------------------------------------------------------------------------------
def summarize(rounds: list[dict[str, RunTimes]], cores: int) -> tuple[dict, dict]:
    """Per run: each measure's spread over rounds (pauses: over every epoch change of every
    round); ratios taken within each round, for each dlstore engine."""
    spread = bench_loader.spread
    loaders = {
        name: {
            "images_per_s": spread([r[name].images_per_s for r in rounds]),
            "within_epochs_images_per_s": spread([r[name].within_epochs_images_per_s for r in rounds]),
            "cpu_ms_per_image": spread([r[name].cpu_ms_per_image for r in rounds]),
            "setup_s": spread([r[name].setup_s for r in rounds]),
            "first_batch_s": spread([r[name].first_batch_s for r in rounds]),
            "epoch_pause_s": spread([p for r in rounds for p in r[name].pauses_s] or [0.0]),
        }
        for name in rounds[0]
    }
    for name in ("single_core", "parallel_processes"):
        loaders[name] = {key: loaders[name][key] for key in ("images_per_s", "cpu_ms_per_image")}
    ratios = {}
    for name in (n for n in rounds[0] if n.startswith("dlstore_")):
        for peer, scale in (("webdataset", 1), ("folder", 1), ("single_core", cores), ("parallel_processes", 1)):
            values = [r[name].images_per_s / (r[peer].images_per_s * scale) for r in rounds]
            ratios[f"{name} / {'cores x single_core' if scale != 1 else peer}"] = spread(values)
        for peer in ("webdataset", "folder"):
            values = [r[name].within_epochs_images_per_s / r[peer].within_epochs_images_per_s for r in rounds]
            ratios[f"{name} / {peer}, within epochs"] = spread(values)
    ratios["parallel_processes / cores x single_core"] = spread(
        [r["parallel_processes"].images_per_s / (r["single_core"].images_per_s * cores) for r in rounds]
    )
    return loaders, ratios


def print_report(results: dict, cores: int) -> None:
    show, spreads = bench_loader.show, results["loaders"]
    rows = [("img/s", "images_per_s", "{:.0f}"), ("img/s within epochs", "within_epochs_images_per_s", "{:.0f}"),
            ("CPU ms/img", "cpu_ms_per_image", "{:.2f}"),
            ("first batch s", "first_batch_s", "{:.2f}"), ("epoch pause s", "epoch_pause_s", "{:.3f}"),
            ("setup s", "setup_s", "{:.3f}")]  # fmt: skip
    print(f"\nper loader, median [min .. max] over {results['settings']['rounds']} rounds")
    for name, measures in spreads.items():
        for label, key, fmt in rows:
            if key in measures:
                print(show(f"{name} {label}", measures[key]["runs"], fmt=fmt))
    ceiling = [cores * v for v in spreads["single_core"]["images_per_s"]["runs"]]
    print(show(f"ceiling: {cores} cores x single_core img/s", ceiling, fmt="{:.0f}"))
    print("\nratios, each taken within one round")
    for label, values in results["ratios"].items():
        print(show(label, values["runs"]))
    if not results["thread_engine"]:
        print("(this dlstore has no engine= option: the process engine only)")
    print("\ndlstore's resident memory during one epoch, summed over the process and its children")
    for rss in results["rss"].values():
        print(f"  {rss['engine']:<9} x{rss['workers']}: peak RSS {rss['peak_rss_mb']:7.0f} MB "
              f"(before the loader {rss['before_loader_mb']:.0f} MB); PSS after the epoch "
              f"{rss['pss_after_epoch_mb']:.0f} MB")  # fmt: skip


# -- main ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=5000, help="JPEGs generated (10 classes)")
    parser.add_argument(
        "--shards",
        type=int,
        help="a multiple of --workers (WebDataset deals whole shards to its workers); default: the first from 8",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of interleaved runs")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per run, after 1 warm-up epoch")
    parser.add_argument("--workers", type=int, default=2, help="decode threads / worker processes of every loader")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--rss-workers", type=int, default=8, help="threads / worker processes of the RSS runs")
    parser.add_argument("--single-core-samples", type=int, default=1000, help="samples the single-core rate decodes")
    parser.add_argument("--batch-timeout", type=float, default=300.0, help="seconds a loader may take for a batch")
    parser.add_argument("--time-limit", type=float, default=3600.0, help="the whole run ends (tracebacks) after this")
    parser.add_argument("--workdir", help="keep the data here and reuse it (default: a temp dir, removed afterwards)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run: " + str(QUICK))
    parser.add_argument(
        "--whole-decode-too",
        action="store_true",
        help="also the thread engine decoding whole JPEGs (dlstore._jpeg_region left out): what the crop-only decode gives",
    )
    parser.add_argument("--rss-child", choices=ENGINES, help=argparse.SUPPRESS)
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**QUICK)  # what the command line gives explicitly still wins
    args = parser.parse_args(argv)
    if args.shards is None:
        args.shards = -(-max(8, args.rss_workers) // args.workers) * args.workers
    if min(args.rounds, args.epochs, args.workers, args.batch_size, args.shards, args.rss_workers) < 1:
        parser.error("--rounds, --epochs, --workers, --batch-size, --shards and --rss-workers must be at least 1")
    if args.shards % args.workers:
        parser.error(
            f"--shards {args.shards}: not a multiple of --workers {args.workers}, so some WebDataset workers "
            "would get a shard more than others and the epoch would wait for them"
        )
    if args.images < 10 * args.shards:
        parser.error("--images: at least 10 per shard")
    return args


def run_benchmark(args, workdir: Path, deadline: float) -> dict:
    cores = len(os.sched_getaffinity(0))
    engines = list(ENGINES) if has_engine_option() else ["processes"]
    started = time.perf_counter()
    data = prepare_data(workdir, args.images, args.shards)
    path, samples = bench_loader.read_all_samples(data.url, data.cache_dir, args.image_size, args.single_core_samples)
    warm_caches(path, data)
    described = describe_data(path, samples)
    picks = fastest_decodes(data, args)
    decodes = {peer: pick[0] for peer, pick in picks.items()}
    tried = "; ".join(
        f"{peer} decodes with {pick[0]!r} ({', '.join(f'{k} {v:.0f} img/s' for k, v in pick[1].items())} in one process)"
        for peer, pick in picks.items()
    )
    print(f"{described['samples']:,} samples in {described['shards']} shards, mean JPEG "
          f"{described['mean_jpeg_bytes'] / 1e3:.0f} KB at {described['mean_width']:.0f}x{described['mean_height']:.0f}, "
          f"ready in {time.perf_counter() - started:.0f} s; batch {args.batch_size}, {args.workers} workers, "
          f"{cores} cores; {tried}", flush=True)  # fmt: skip
    makers = loader_makers(data, args, engines, decodes)
    rounds = []
    for number in range(args.rounds):
        rounds.append(measure_round(makers, path, samples, args, number))
        rates = ", ".join(f"{k} {v.images_per_s:.0f}" for k, v in rounds[-1].items())
        print(f"round {number + 1}: img/s {rates}", flush=True)
    del path, samples
    rss = {engine: rss_in_fresh_process(args, workdir, engine, deadline - time.monotonic()) for engine in engines}
    loaders, ratios = summarize(rounds, cores)
    return {
        "machine": {
            "cores": cores,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
            "webdataset": wds.__version__,
        },  # fmt: skip
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "workdir", "rss_child")},
        "data": described,
        "thread_engine": "threads" in engines,
        "peer_decodes": {
            peer: {"chosen": pick[0], "one_process_images_per_s": pick[1]} for peer, pick in picks.items()
        },
        "rounds": [{name: run._asdict() for name, run in r.items()} for r in rounds],
        "loaders": loaders,
        "ratios": ratios,
        "rss": rss,
        "seconds": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = time.monotonic() + args.time_limit
    # Bounded in time whatever hangs: past the limit, every thread's stack and exit.
    faulthandler.dump_traceback_later(args.time_limit, exit=True)
    own = not args.workdir
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dlstore-bench-peers-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        if args.rss_child:
            print(json.dumps(rss_of_engine(prepare_data(workdir, args.images, args.shards), args)))
            return 0
        results = run_benchmark(args, workdir, deadline)
    finally:
        faulthandler.cancel_dump_traceback_later()
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    print_report(results, results["machine"]["cores"])
    print(f"\ntook {results['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
