"""dlstore's thread engine against the same work built on SPDL and on torchdata.nodes.

Every engine does the same work on the same shards, with the same threads and lookahead.
It takes this rank's batches in plan order, reads each batch's samples from the node cache,
and sends each sample through `SamplePath.image` into its row of a pooled uint8 buffer.
A buffer goes back to the pool once the loop drops its batch.

* dlstore_threads: `dlstore.Loader(ds, engine="threads", device="cpu", dtype="uint8")`.
* spdl: a `spdl.pipeline.PipelineBuilder` as its docs build an image pipeline, one for all
  epochs (``continuous=True``), so it runs on into the next epoch as dlstore's engine does.
* torchdata: `torchdata.nodes` as its migration guide builds a loader: source, a threaded
  `ParallelMapper`, `Batcher`, collate, `Prefetcher`, `Loader`.

Rounds interleave the engines; each run is a fresh engine, one warm-up epoch, then timed
epochs. ``--check`` first compares each engine's first batches with dlstore's, pixel for
pixel. SPDL and torchdata are not dlstore dependencies: a missing one is skipped, said why.

Example (reuses the data of `benchmarks.peers` under --workdir)::

    python -m benchmarks.engines --workdir /tmp/dlstore-peers --rounds 3 --check
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import numpy as np
import torch

import dlstore
from dlstore.errors import CorruptSample
from dlstore.sample_path import BatchRequest
from dlstore.world import World

from . import pipelines
from .data import Data, prepare_data
from .pipelines import Candidate, RunTimes
from .runner import interleave, show, spread, workdir, write_json

LIBRARIES = {"spdl": "spdl.pipeline", "torchdata": "torchdata.nodes"}


# -- the work every engine shares ------------------------------------------------------------------
class BufferPool:
    """uint8 batch arrays; one goes back to the pool once the tensor over it is garbage."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self.free: list[np.ndarray] = []
        self.lock = threading.Lock()

    def take(self) -> np.ndarray:
        with self.lock:
            return self.free.pop() if self.free else np.empty(self.shape, dtype=np.uint8)

    def hand_over(self, array: np.ndarray, rows: int) -> torch.Tensor:
        tensor = torch.from_numpy(array[:rows])
        weakref.finalize(tensor, self._give_back, array)
        return tensor

    def _give_back(self, array: np.ndarray) -> None:
        with self.lock:
            self.free.append(array)


@dataclasses.dataclass
class Row:
    """One sample on its way: where its image goes, and (after `image_into_row`) its label."""

    request: BatchRequest
    out: np.ndarray
    row: int
    sample: dict | None
    label: int | None = None  # None after the stage: a corrupt sample, skipped


class Work:
    """The plan and the sample stages, as each engine built on a library calls them."""

    def __init__(self, ds: dlstore.Dataset) -> None:
        self.ds, self.path = ds, ds.samples
        size = ds.cfg.transform.image_size
        self.pool = BufferPool((ds.cfg.batch_size, size, size, 3))

    def epochs(self, first: int) -> Iterator[Iterator[tuple[BatchRequest, np.ndarray]]]:
        """Epoch `first`, then the next, ...: each the plan's batches with their buffers."""
        epoch = first
        while True:
            yield self._batches(epoch)
            epoch += 1

    def _batches(self, epoch: int) -> Iterator[tuple[BatchRequest, np.ndarray]]:
        plan = self.ds.plan(epoch)
        for index in range(plan.num_batches):
            yield self.ds.request(plan, epoch, index), self.pool.take()

    def read(self, batch: tuple[BatchRequest, np.ndarray]) -> list[Row]:
        request, out = batch
        samples = self.path.read(request.ids)
        return [Row(request, out, row, sample) for row, sample in enumerate(samples)]

    def image_into_row(self, row: Row) -> Row:
        sample_id = int(row.request.ids[row.row])
        try:
            # Straight into its row, as dlstore's engine does.
            row.label = self.path.image(row.sample, row.request.epoch, sample_id, out=row.out[row.row])[1]
        except CorruptSample:
            if self.path.cfg.on_corrupt == "raise":
                raise
            return row
        row.sample = None
        return row

    def collate(self, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        out = rows[0].out
        kept = [r.row for r in rows if r.label is not None]
        if len(kept) < len(rows):
            out[: len(kept)] = out[kept]
        # NHWC -> an NCHW view with channels_last strides, as dlstore's loader hands it over.
        images = self.pool.hand_over(out, len(kept)).permute(0, 3, 1, 2)
        return images, torch.tensor([r.label for r in rows if r.label is not None], dtype=torch.int64)


def make_dataset(data: Data, args) -> dlstore.Dataset:
    """The dataset `pipelines.dlstore_loader` builds for dlstore's own runs."""
    return dlstore.Dataset(data.url, cache_dir=data.cache_dir, cache_limit="4GB", transform="train",
                           image_size=args.image_size, batch_size=args.batch_size, seed=0, world=World())  # fmt: skip


class EpochCounter:
    """Checks that the epochs asked for are the ones the engine runs: 0, 1, 2, ..."""

    def __init__(self) -> None:
        self.next = 0

    def check(self, epoch: int) -> None:
        if epoch != self.next:
            raise SystemExit(f"the engine runs epochs in turn from 0; asked for {epoch}, at {self.next}")
        self.next += 1


# -- dlstore ----------------------------------------------------------------------------------------
def dlstore_candidate(data: Data, args) -> Candidate:
    """dlstore's Loader with its thread engine, uint8 batches on the CPU."""
    options = {"engine": "threads", "prefetch_factor": args.lookahead, "timeout_s": args.batch_timeout}
    loader, batches = pipelines.dlstore_loader(data.url, data.cache_dir, args, "uint8", **options)
    return Candidate(batches, loader.close)


# -- SPDL ------------------------------------------------------------------------------------------
def spdl_candidate(data: Data, args) -> Candidate:
    spdl_pipeline = importlib.import_module("spdl.pipeline")
    spdl_defs = importlib.import_module("spdl.pipeline.defs")
    work = Work(make_dataset(data, args))

    class BatchRows(spdl_defs.Aggregator):
        """A batch's rows together, closed at its last row (a short batch included)."""

        def __init__(self) -> None:
            self.rows: list[Row] = []

        def accumulate(self, item: Row) -> list[Row] | None:
            self.rows.append(item)
            if len(self.rows) < len(item.request.ids):
                return None
            rows, self.rows = self.rows, []
            return rows

        def flush(self) -> list[Row] | None:
            rows, self.rows = self.rows, []
            return rows or None

    class Source:
        """Each iteration one epoch, in turn (the continuous source re-iterates it)."""

        def __init__(self) -> None:
            self.epochs = work.epochs(0)

        def __iter__(self):
            return next(self.epochs)

    pipeline = (
        spdl_pipeline.PipelineBuilder()
        .add_source(Source(), continuous=True)
        .pipe(work.read, concurrency=1, name="read")
        .disaggregate()
        .pipe(work.image_into_row, concurrency=args.workers, output_order="input", name="image")
        .aggregate(BatchRows())
        .pipe(work.collate, name="collate")
        .add_sink(args.lookahead)
        .build(num_threads=args.workers)
    )
    counter = EpochCounter()
    started = False

    def batches(epoch: int) -> Iterator:
        nonlocal started
        counter.check(epoch)
        if not started:
            pipeline.start()
            started = True
        return pipeline.get_iterator(timeout=args.batch_timeout)

    def close() -> None:
        if started:
            pipeline.stop()

    return Candidate(batches, close)


# -- torchdata.nodes -------------------------------------------------------------------------------
def torchdata_candidate(data: Data, args) -> Candidate:
    nodes = importlib.import_module("torchdata.nodes")
    work = Work(make_dataset(data, args))

    class Samples:
        """Each iteration one epoch's rows, in plan order (the loader re-iterates it per epoch)."""

        def __init__(self) -> None:
            self.epochs = work.epochs(0)

        def __iter__(self) -> Iterator[Row]:
            for batch in next(self.epochs):
                yield from work.read(batch)

    node = nodes.IterableWrapper(Samples())
    node = nodes.ParallelMapper(node, work.image_into_row, num_workers=args.workers, in_order=True, method="thread")
    node = nodes.Batcher(node, batch_size=args.batch_size, drop_last=False)
    node = nodes.Mapper(node, work.collate)
    held = [nodes.Loader(nodes.Prefetcher(node, prefetch_factor=args.lookahead))]
    counter = EpochCounter()

    def batches(epoch: int) -> Iterator:
        counter.check(epoch)
        return iter(held[0])

    def close() -> None:
        # torchdata.nodes has no close(): its threads stop when their iterators are collected.
        held.clear()
        gc.collect()

    return Candidate(batches, close)


# -- the runs --------------------------------------------------------------------------------------
def engine_makers(data: Data, args) -> dict[str, Callable[[], Candidate]]:
    """dlstore's engine and each library whose package imports (the others skipped, said why)."""
    makers = {"dlstore_threads": lambda: dlstore_candidate(data, args)}
    builders = {"spdl": spdl_candidate, "torchdata": torchdata_candidate}
    for name, module in LIBRARIES.items():
        try:
            importlib.import_module(module)
        except ImportError as exc:
            print(f"skipping {name}: `import {module}` failed ({exc}); it is not a dlstore dependency "
                  f"(pip install {name}, or put it on PYTHONPATH)", flush=True)  # fmt: skip
            continue
        makers[name] = lambda build=builders[name]: build(data, args)
    return makers


def first_batches(make: Callable[[], Candidate], count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    candidate = make()
    try:
        out = []
        for images, labels in candidate.batches(0):
            out.append((images.clone(), labels.clone()))
            if len(out) == count:
                break
        return out
    finally:
        candidate.close()


def check_same_batches(makers: dict, count: int = 2) -> None:
    """Each engine's first `count` batches of epoch 0 equal dlstore's (the same plan and stages)."""
    reference = first_batches(makers["dlstore_threads"], count)
    for name, make in makers.items():
        if name == "dlstore_threads":
            continue
        got = first_batches(make, count)
        same = len(got) == len(reference) and all(
            torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, reference)
        )
        if not same:
            raise SystemExit(f"{name}: its first {count} batches differ from dlstore's")
        print(f"check: {name}'s first {count} batches equal dlstore's", flush=True)


def summarize(rounds: list[dict[str, RunTimes]]) -> dict:
    ratios = {f"{name} / dlstore_threads img/s": spread([r[name].images_per_s / r["dlstore_threads"].images_per_s
                                                         for r in rounds]) for name in list(rounds[0])[1:]}  # fmt: skip
    return {"loaders": pipelines.summarize_runs(rounds), "ratios": ratios}


def print_report(results: dict) -> None:
    pipelines.print_runs(results["loaders"], results["settings"]["rounds"], "engine")
    print("\nratios, each taken within one round")
    for label, values in results["ratios"].items():
        print(show(label, values["runs"]))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=5000, help="JPEGs generated (10 classes)")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of interleaved runs")
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per run, after 1 warm-up epoch")
    parser.add_argument("--workers", type=int, default=2, help="decode threads of every engine")
    parser.add_argument("--lookahead", type=int, default=2, help="batches built ahead (dlstore's prefetch_factor)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-timeout", type=float, default=300.0, help="seconds an engine may take for a batch")
    parser.add_argument("--check", action="store_true", help="first compare each engine's first batches with dlstore's")
    parser.add_argument("--workdir", help="keep the data here and reuse it (default: a temp dir)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if min(args.rounds, args.epochs, args.workers, args.lookahead, args.batch_size) < 1:
        parser.error("--rounds, --epochs, --workers, --lookahead and --batch-size must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with workdir(args.workdir, "dlstore-bench-engines-") as root:
        data = prepare_data(root, args.images, args.shards)
        path, _ = pipelines.read_all_samples(data.url, data.cache_dir, args.image_size, 1)
        pipelines.warm_caches(path, data)
        makers = engine_makers(data, args)
        print(f"engines: {', '.join(makers)}; batch {args.batch_size}, {args.workers} threads, lookahead "
              f"{args.lookahead}, {len(os.sched_getaffinity(0))} cores", flush=True)  # fmt: skip
        if args.check:
            check_same_batches(makers)
        started = time.perf_counter()

        runs = {name: (lambda make=make: pipelines.time_run(make, args.epochs)) for name, make in makers.items()}
        rounds = interleave(args.rounds, runs, rotate=False, done=pipelines.print_rates)
    results = {"settings": {k: v for k, v in vars(args).items() if k not in ("json", "workdir")},
               **summarize(rounds), "rounds": [{k: v._asdict() for k, v in r.items()} for r in rounds],
               "seconds": time.perf_counter() - started}  # fmt: skip
    print_report(results)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
