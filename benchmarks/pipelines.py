"""The loaders the benchmarks compare, and the timing of one loader run.

dlstore's `Loader`, webdataset's usual pipeline and a torchvision `ImageFolder` all do
the same work: decode, RandomResizedCrop, flip, uint8 batches. `time_run` times any of
them the same way: a fresh loader, one warm-up epoch, then the timed epochs.
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import sys
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np
import torch
import torchvision
from torchvision.io import ImageReadMode
from torchvision.transforms import v2

import dlstore
from dlstore.config import StoreConfig
from dlstore.sample_path import SamplePath
from dlstore.world import World

from .data import Data
from .runner import cpu_since, show, spread, tree_usage

#: Each peer's JPEG decoders: Pillow, or torchvision's libjpeg-turbo into a uint8 tensor.
PEER_DECODES = ("pil", "torchvision")
WDS_SHUFFLE = 1000  # the sample shuffle buffer of webdataset's own examples
RGB = ImageReadMode.RGB


class Candidate(NamedTuple):
    batches: Callable[[int], Iterator]  # epoch -> that epoch's batches, (images, labels, ...)
    close: Callable[[], None]


# -- dlstore ---------------------------------------------------------------------------------------
def dlstore_loader(url: str, cache_dir: str, args, dtype: str = "uint8", store_config: StoreConfig | None = None,
                   dataset_options: dict | None = None, **loader_options):  # fmt: skip
    """A CPU loader with `args`' workers, image and batch size, and `batches(epoch)`.

    `dataset_options` go to `dlstore.Dataset`, `loader_options` to `dlstore.Loader`.
    """
    ds = dlstore.Dataset(url, cache_dir=cache_dir, cache_limit="4GB", transform="train", image_size=args.image_size,
                         batch_size=args.batch_size, seed=0, world=World(), store_config=store_config,
                         **(dataset_options or {}))  # fmt: skip
    loader = dlstore.Loader(ds, num_workers=args.workers, device="cpu", dtype=dtype, **loader_options)

    def batches(epoch: int) -> Iterator:
        loader.set_epoch(epoch)
        return iter(loader)

    return loader, batches


def dlstore_candidate(data: Data, args, engine: str, **options) -> Candidate:
    options.setdefault("timeout_s", args.batch_timeout)
    loader, batches = dlstore_loader(data.url, data.cache_dir, args, engine=engine, **options)
    return Candidate(batches, loader.close)


def whole_decode_candidate(data: Data, args) -> Candidate:
    """The thread engine with every JPEG decoded whole: the crop-only decoder taken away.

    The thread engine decodes in this process, so the runs before and after are unaffected.
    """
    held = [(m, k, v) for m in list(sys.modules.values()) if (m.__name__ or "").startswith("dlstore.transforms")
            for k, v in vars(m).items() if hasattr(v, "decode_region")]  # fmt: skip
    for module, name, _ in held:
        setattr(module, name, None)

    def restore() -> None:
        for module, name, value in held:
            setattr(module, name, value)

    try:
        candidate = dlstore_candidate(data, args, "threads")
    except BaseException:
        restore()
        raise

    def close() -> None:
        try:
            candidate.close()
        finally:
            restore()

    return Candidate(candidate.batches, close)


# -- the peers -------------------------------------------------------------------------------------
def decode_rgb(data: bytes) -> torch.Tensor:
    return torchvision.io.decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=RGB)


def read_rgb(path: str) -> torch.Tensor:
    return torchvision.io.decode_image(path, mode=RGB)


def peer_augment(image_size: int, from_pil: bool) -> v2.Compose:
    """torchvision's RandomResizedCrop and flip, uint8 CHW tensors out."""
    steps = [v2.RandomResizedCrop(image_size, antialias=True), v2.RandomHorizontalFlip()]
    return v2.Compose([*steps, v2.PILToTensor()] if from_pil else steps)


def webdataset_pipeline(urls: list[str], decode: str, args):
    """The pipeline of webdataset's examples, collated by torch's `default_collate`.

    In a worker, `default_collate` writes a batch straight into shared memory.
    """
    import webdataset as wds

    decoder = "pil" if decode == "pil" else wds.handle_extension("jpg", decode_rgb)
    dataset = wds.WebDataset(urls, shardshuffle=len(urls), nodesplitter=wds.split_by_node,
                             workersplitter=wds.split_by_worker)  # fmt: skip
    return (
        dataset.shuffle(WDS_SHUFFLE)
        .decode(decoder)
        .to_tuple("jpg", "cls")
        .map_tuple(peer_augment(args.image_size, from_pil=decode == "pil"))
        .batched(args.batch_size, collation_fn=torch.utils.data.default_collate)
    )


def persistent(loader) -> Candidate:
    """A loader with persistent workers; closing drops it and its workers."""
    held = [loader]

    def close() -> None:
        held.clear()
        gc.collect()

    return Candidate(lambda _epoch: iter(held[0]), close)


def webdataset_loader(urls: list[str], decode: str, args, persistent_workers: bool = True):
    import webdataset as wds

    return wds.WebLoader(webdataset_pipeline(urls, decode, args), batch_size=None, num_workers=args.workers,
                         persistent_workers=persistent_workers and args.workers > 0,
                         timeout=args.batch_timeout if args.workers > 0 else 0)  # fmt: skip


def shard_files(data: Data) -> list[str]:
    return sorted(str(p) for p in data.store_dir.glob("*.tar"))


def webdataset_candidate(data: Data, args, decode: str) -> Candidate:
    return persistent(webdataset_loader(shard_files(data), decode, args))


def folder_dataset(data: Data, args, decode: str) -> torchvision.datasets.ImageFolder:
    if decode == "pil":  # ImageFolder's default loader
        return torchvision.datasets.ImageFolder(str(data.folder), transform=peer_augment(args.image_size, True))
    augment = peer_augment(args.image_size, False)
    return torchvision.datasets.ImageFolder(str(data.folder), transform=augment, loader=read_rgb)


def folder_candidate(data: Data, args, decode: str) -> Candidate:
    loader = torch.utils.data.DataLoader(
        folder_dataset(data, args, decode), batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
        persistent_workers=args.workers > 0, timeout=args.batch_timeout if args.workers > 0 else 0,
    )  # fmt: skip
    return persistent(loader)


def fastest_decodes(data: Data, args, tries: int = 2) -> dict[str, tuple[str, dict[str, float]]]:
    """Per peer, its fastest decoder in one process, as in a worker; and each one's img/s.

    Torch runs on one thread, as DataLoader sets it in a worker. Each peer reads as many
    images as the first shard holds, best of `tries`.
    """
    import webdataset as wds

    urls = shard_files(data)[:1]
    first_shard = sum(1 for _ in wds.WebDataset(urls, shardshuffle=False))
    folders = {decode: folder_dataset(data, args, decode) for decode in PEER_DECODES}
    order = np.random.default_rng(0).permutation(len(folders["pil"]))[:first_shard].tolist()
    runs = {
        "webdataset": lambda decode: sum(batch[0].shape[0] for batch in webdataset_pipeline(urls, decode, args)),
        "folder": lambda decode: sum(1 for i in order if folders[decode][i] is not None),
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        picks = {}
        for peer, run in runs.items():
            best = dict.fromkeys(PEER_DECODES, 0.0)
            for decode in itertools.chain.from_iterable(itertools.repeat(PEER_DECODES, tries)):
                started = time.perf_counter()
                best[decode] = max(best[decode], run(decode) / (time.perf_counter() - started))
            picks[peer] = (max(best, key=best.get), best)
        return picks
    finally:
        torch.set_num_threads(threads)


# -- timing one run --------------------------------------------------------------------------------
class EpochMarks(NamedTuple):
    begun: float  # perf_counter when iter() was called
    first: float  # ... when the first batch came
    last: float  # ... when the last batch came
    images: int
    first_images: int  # in the first batch


class RunTimes(NamedTuple):
    images_per_s: float  # over the timed epochs, the pauses between them included
    within_epochs_images_per_s: float  # first batch to last of each timed epoch
    cpu_ms_per_image: float  # CPU time of the process and its workers, per image
    setup_s: float  # building the loader object
    first_batch_s: float  # iter() on the fresh loader to its first batch
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
    """One fresh loader: one warm-up epoch, then `epochs` timed ones."""
    started = time.perf_counter()
    candidate = make()
    setup_s = time.perf_counter() - started
    try:
        marks = [epoch_marks(candidate.batches, 0)]
        before = tree_usage()  # the workers live until close(): their CPU counts
        marks += [epoch_marks(candidate.batches, epoch) for epoch in range(1, 1 + epochs)]
        cpu_s = cpu_since(before)
    finally:
        candidate.close()
    timed = marks[1:]
    images = sum(m.images for m in timed)
    within = sum(m.images - m.first_images for m in timed) / max(sum(m.last - m.first for m in timed), 1e-9)
    pauses = [after.first - before.last for before, after in itertools.pairwise(marks)]
    return RunTimes(images / (marks[-1].last - marks[1].begun), within, 1000.0 * cpu_s / images, setup_s,
                    marks[0].first - marks[0].begun, pauses)  # fmt: skip


#: What a report shows of each run: label, `RunTimes` field, format.
MEASURES = (("img/s", "images_per_s", "{:.0f}"), ("img/s within epochs", "within_epochs_images_per_s", "{:.0f}"),
            ("CPU ms/img", "cpu_ms_per_image", "{:.2f}"), ("first batch s", "first_batch_s", "{:.3f}"),
            ("epoch pause s", "epoch_pause_s", "{:.3f}"), ("setup s", "setup_s", "{:.3f}"))  # fmt: skip


def summarize_runs(rounds: list[dict[str, RunTimes]]) -> dict[str, dict]:
    """Per run, each measure's spread over the rounds; pauses over every epoch change."""
    out = {}
    for name in rounds[0]:
        out[name] = {key: spread([getattr(r[name], key) for r in rounds]) for _, key, _ in MEASURES[:-2]}
        out[name]["epoch_pause_s"] = spread([p for r in rounds for p in r[name].pauses_s] or [0.0])
        out[name]["setup_s"] = spread([r[name].setup_s for r in rounds])
    return out


def print_runs(loaders: dict[str, dict], rounds: int, what: str = "loader") -> None:
    print(f"\nper {what}, median [min .. max] over {rounds} rounds")
    for name, measures in loaders.items():
        for label, key, fmt in MEASURES:
            if key in measures:
                print(show(f"{name} {label}", measures[key]["runs"], fmt=fmt))


def print_rates(number: int, got: dict[str, RunTimes]) -> None:
    print(f"round {number + 1}: img/s " + ", ".join(f"{k} {v.images_per_s:.0f}" for k, v in got.items()), flush=True)


# -- the references: dlstore's own per-sample work, no loader --------------------------------------
SAMPLES: tuple = ()  # (sample path, samples) the forked reference processes decode


def read_all_samples(url: str, cache_dir: str, image_size: int, limit: int | None = None):
    """The train sample path at `image_size`, and (id, raw sample) of the first `limit` samples."""
    ds = dlstore.Dataset(url, cache_dir=cache_dir, cache_limit="4GB", transform="train", image_size=image_size,
                         world=World())  # fmt: skip
    ids = np.arange(int(ds.shard_sizes.sum()))[:limit]
    return ds.samples, list(zip(ids.tolist(), ds.samples.read(ids)))


def decode_and_augment(path: SamplePath, samples: list[tuple[int, dict]]) -> int:
    for sample_id, sample in samples:
        path.augment(path.decode(sample, 0, sample_id)[0])
    return len(samples)


def single_core_rate(path: SamplePath, samples: list[tuple[int, dict]]) -> RunTimes:
    """img/s of the loader's decode and augment stages in this process, after one pass.

    The untimed pass is the loaders' warm-up epoch: each sample is then known to decode.
    """
    decode_and_augment(path, samples)
    started, before = time.perf_counter(), tree_usage()
    decode_and_augment(path, samples)
    rate = len(samples) / (time.perf_counter() - started)
    return RunTimes(rate, rate, 1000.0 * cpu_since(before) / len(samples), 0.0, 0.0, [])


def part_of_samples(bounds: tuple[int, int]) -> int:
    path, samples = SAMPLES
    return decode_and_augment(path, samples[bounds[0] : bounds[1]])


def ceiling_rate(path: SamplePath, samples: list[tuple[int, dict]], procs: int) -> RunTimes:
    """img/s of the same stages in `procs` forked processes at once: the box's ceiling."""
    global SAMPLES
    SAMPLES, n = (path, samples), len(samples)
    parts = [(i * n // procs, (i + 1) * n // procs) for i in range(procs)]
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        pool.map(part_of_samples, [(0, procs)] * procs)  # start-up and imports, untimed
        before, started = tree_usage(), time.perf_counter()
        done = sum(pool.map(part_of_samples, parts))
        rate = done / (time.perf_counter() - started)
        return RunTimes(rate, rate, 1000.0 * cpu_since(before) / done, 0.0, 0.0, [])


def warm_caches(path: SamplePath, data: Data) -> None:
    """Every shard in dlstore's cache and every file in the page cache, before round 1."""
    for shard in range(len(path.manifest.shards)):
        path.cache.fetch(*path.shard_ref(shard))
    for file in [*data.store_dir.glob("*.tar"), *data.folder.rglob("*.*")]:
        with open(file, "rb") as stream:
            while stream.read(1 << 22):
                pass
