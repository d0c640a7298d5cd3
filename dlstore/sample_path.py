"""The sample path, defined once: read → decode or plan the crop → augment → collate.

`SamplePath` turns a batch's sample ids into a uint8 NHWC batch. `Dataset` composes it with
the plan. `dlstore bench` times these very stages by passing a `StageClock`. Each stage is a
method with one job:

* `read`     the samples' bytes. The `fetch` stage holds the shard in the node cache, and
             the `read` stage makes one `pread` per sample through its sample index. A cold
             pass's first batch reads its samples straight from the store instead.
* `decode`   the image member and the label, the crop drawn with the sample's own random
             generator, and the pixels, decoded at the smallest scale the crop allows.
* `augment`  the preset's crop, resize and flip.
* `plan_on_device`  the JPEG and its crop row, left undecoded for `decode_on="device"`.
* `collate`  the batch dict the loader hands on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dlstore.cache import SampleRange, ShardCache, ShardSpec
from dlstore.config import DataConfig
from dlstore.errors import CorruptSample, CorruptShard, DlstoreError, TransientError
from dlstore.format.manifest import Manifest, load_sample_index
from dlstore.format.sample_index import SampleIndex
from dlstore.format.shards import IMAGE_FIELDS, image_field, parse_label, read_sample, release_views
from dlstore.plan import by_shard, locate
from dlstore.read import DirectReads, NodeMarks, cached_sample_index, forget_sample_index
from dlstore.transforms import (
    CropSource,
    SampleRngs,
    builds_rows_natively,
    check_kept_size,
    crop_plan,
    crop_rows,
    decode_for_crop,
    device_jpeg,
    is_jpeg,
    resize_crop,
)

__all__ = ["STAGES", "BatchRequest", "RowJobs", "SamplePath", "StageClock", "join_encoded"]

log = logging.getLogger(__name__)

# The stages a batch goes through on the host, in order: the `StageClock` keys.
STAGES = ("fetch", "read", "decode", "augment", "collate")


@dataclass(frozen=True)
class BatchRequest:
    """What a worker needs to build one batch: the sample ids, the epoch for augmentation
    randomness, and the batch's position for ordering and errors. `direct` names the shards
    whose samples may be read straight from the store when not cached yet."""

    epoch: int
    index: int
    ids: np.ndarray
    is_padding: np.ndarray
    direct: tuple[int, ...] = ()


@dataclass
class RowJobs:
    """The `crop_rows` jobs, each one's (position, id, label, known to decode), and the rest."""

    jobs: list[tuple]
    taken: list[tuple]
    left: list[int]


@dataclass
class StageClock:
    """Seconds spent per stage, for `dlstore bench`. The loader passes none, so it reads no clock."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))

    @contextlib.contextmanager
    def time(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] += time.perf_counter() - start


_UNTIMED = contextlib.nullcontext()


def _timed(clock: StageClock | None, stage: str):
    return _UNTIMED if clock is None else clock.time(stage)


class SamplePath:
    """The stages of one dataset's samples under one `DataConfig`.

    For example::

        path = SamplePath(cfg, manifest, cache, "swift://imagenet/train")
        batch = path.build_batch(BatchRequest(0, 0, ids, np.zeros(len(ids), bool)))
    """

    def __init__(self, cfg: DataConfig, manifest: Manifest, cache: ShardCache, store_url: str) -> None:
        self.cfg = cfg
        self.manifest = manifest
        self.cache = cache
        self.store_url = store_url
        self.shard_sizes = np.array([s.samples for s in manifest.shards], dtype=np.int64)
        self._shard_ends = np.cumsum(self.shard_sizes).tolist()  # for `by_shard`
        # Only the fields this dataset has, in the one order of preference.
        self.image_fields = tuple(f for f in IMAGE_FIELDS if f in manifest.fields)
        self._indexes: OrderedDict[str, Any] = OrderedDict()
        # Indexes being read now, one thread per shard, as name to pid and lock. An entry of
        # another pid was copied by a fork from a parent thread reading it: not waited for.
        self._building: dict[str, tuple[int, threading.Lock]] = {}
        # The shards this node reads only part of, as the runs of samples its cache holds.
        # `Dataset` sets it, by shard.
        self.partial: dict[int, SampleRange] = {}
        # Shards whose cached copy `_recheck` checked after a read failed. A second failure
        # is the shard's own.
        self._rechecked: set[str] = set()
        # Reads straight from the store, and the store's sample indexes of the shards read so,
        # by shard. None where a shard has none with digests.
        self._direct = DirectReads(cache)
        self._store_indexes: dict[int, SampleIndex | None] = {}
        # Samples whose image decoded without error, the whole stream checked. A later crop
        # reads only the rows it needs. A sample's bytes never change, so neither does the
        # verdict. Made at the first decode here, or shared with workers by
        # `share_decode_marks`. What it lacks is asked of the node's marks.
        self._decodes_cleanly: np.ndarray | None = None
        self._shared_marks: torch.Tensor | None = None
        self._node_marks = NodeMarks(cache.marks_path(manifest.shard_table_digest.partition(":")[2][:32]))
        # Every sample decodes cleanly where `dlstore convert` checked them all and the cache
        # checks each shard's checksum.
        self._all_decode_cleanly = manifest.decode_checked and cache.config.verify
        # Each sample's generator of `sample_rng`'s draws, one re-keyed per thread.
        self._rngs = SampleRngs()
        # The stages run in the loader's decode threads at once, sharing the caches above.
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_indexes"], state["_rechecked"], state["_building"] = OrderedDict(), set(), {}
        state["_store_indexes"], state["_decodes_cleanly"] = {}, None  # `_shared_marks` goes
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        if self._shared_marks is not None:  # sent to a worker process: the same memory
            self._decodes_cleanly = self._shared_marks.numpy()

    def share_decode_marks(self) -> None:
        """Keep the marks of samples that decode cleanly in shared memory. Worker processes
        started after this share them. The process engine calls it. Otherwise a worker knows
        only the samples it decoded itself. It takes one byte a sample. Without shared memory,
        each process keeps its own marks. The ranks of a node share theirs through the cache
        directory, in `dlstore.read.marks`."""
        if self._shared_marks is not None:
            return
        count = int(self.shard_sizes.sum())
        try:
            marks = torch.zeros(count, dtype=torch.bool).share_memory_()
        except (RuntimeError, OSError) as exc:  # e.g. a full /dev/shm
            log.info("the decode marks stay per process (no shared memory for %d bytes: %s)", count, exc)
            return
        if self._decodes_cleanly is not None:
            marks.numpy()[:] = self._decodes_cleanly
        self._shared_marks, self._decodes_cleanly = marks, marks.numpy()

    def with_config(self, cfg: DataConfig) -> SamplePath:
        """The same data and caches under another config, such as a new transform."""
        other = self.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.cfg = cfg
        return other

    def shard_ref(self, shard: int) -> tuple[str, int, str | None]:
        info = self.manifest.shards[shard]
        return info.name, info.size, info.checksum

    def cache_spec(self, shard: int, samples: np.ndarray | None = None) -> ShardSpec:
        """The cache entry that reads of `samples` of `shard` go to. It is the node's run of
        samples of a boundary shard when it holds them all, else the whole shard. `samples` are
        indexes within the shard. None stands for any of this node's."""
        part = self.partial.get(shard)
        if part is not None and (samples is None or part.contains(samples)):
            return part.spec
        return ShardSpec(*self.shard_ref(shard))

    # -- read ------------------------------------------------------------------------------
    def read(
        self, ids: np.ndarray, clock: StageClock | None = None, direct: tuple[int, ...] = (), views: bool = False
    ) -> list[dict]:
        """The raw samples of `ids`, in order. Each shard is held once for all its samples.
        Samples of the shards in `direct` not cached yet are read straight from the store.
        With `views`, members read from the cache are views of its mapping (see `viewed`)."""
        samples: list[dict | None] = [None] * len(ids)
        try:
            self._read_into(samples, ids, clock, direct, views)
        except BaseException:
            release_views(samples)  # an error's traceback keeps `samples`, not the mappings
            raise
        return samples  # type: ignore[return-value]

    @contextlib.contextmanager
    def viewed(self, ids: np.ndarray, direct: tuple[int, ...] = (), clock: StageClock | None = None):
        """`read` for the `with` block, uncopied where the C row builder reads them. The views
        are released at its end: an evicted entry's disk space returns with its last view."""
        samples = self.read(ids, clock, direct, views=self.cfg.decode_on != "device")
        try:
            yield samples
        finally:
            release_views(samples)

    def _read_into(self, samples: list, ids: np.ndarray, clock, direct: tuple[int, ...], views: bool) -> None:
        grouped = by_shard(ids.tolist(), self._shard_ends)
        read_already = set()
        if direct:
            with _timed(clock, "fetch"):
                read_already = self._read_direct(grouped, samples, direct)
        for shard, (positions, offsets) in grouped.items():
            if shard in read_already:
                continue
            spec = self.cache_spec(shard, offsets)
            error = self._read_from_shard(shard, positions, offsets, samples, clock, spec, views)
            if error is not None and self._recheck(shard, spec):
                error = self._read_from_shard(shard, positions, offsets, samples, clock, spec, views)
            if error is not None:
                name = self.manifest.shards[shard].name
                raise CorruptShard(f"shard {name!r} of {self.store_url}: {error}") from None

    def _index(self, shard: int, path: str):
        """The sample index of `shard`, held at `path`: this process's copy, else the one kept
        in the cache. One thread reads each shard's. The others wait for it rather than walk
        the same file."""
        info = self.manifest.shards[shard]
        while True:
            with self._lock:
                index = self._indexes.get(info.name)
                if index is not None:
                    return index
                entry = self._building.get(info.name)
                mine = entry is None or entry[0] != os.getpid()
                if mine:
                    building = threading.Lock()
                    building.acquire()
                    self._building[info.name] = (os.getpid(), building)
                else:
                    building = entry[1]
            if mine:
                break
            with building:  # another thread reads it: wait, then look again, as it may have failed
                pass
        try:
            index = cached_sample_index(self.cache.index_path(info.name), path, info.checksum)  # file reads
            if len(index) != info.samples:
                # Fewer is an IndexError deep in a read. More is samples dropped without a word.
                raise CorruptShard(
                    f"shard {info.name!r} of {self.store_url} holds {len(index)} samples; its manifest says "
                    f"{info.samples} (a manifest of other shards: convert or index the data again)"
                )
            with self._lock:
                self._indexes[info.name] = index
                while len(self._indexes) > 64:
                    self._indexes.popitem(last=False)
            return index
        finally:
            with self._lock:
                del self._building[info.name]
            building.release()

    def _read_from_shard(
        self,
        shard: int,
        positions: list[int],
        offsets: list[int],
        samples: list,
        clock: StageClock | None,
        spec: ShardSpec,
        views: bool,
    ) -> CorruptShard | None:
        """Read the samples at `positions` from the cache entry `spec` of `shard` into `samples`.
        Return the tar reader's error if the cached file is malformed. The cache's own propagate.
        The entry stays mapped between reads (`ShardCache.mapped`): no system call per sample."""
        with contextlib.ExitStack() as held:
            with _timed(clock, "fetch"):
                memory, path = held.enter_context(self.cache.mapped(*spec))
            try:
                with _timed(clock, "read"):
                    # A run of samples maps each sample to its bytes in the entry's file itself.
                    index = spec.samples if spec.samples is not None else self._index(shard, path)
                    for position, offset in zip(positions, offsets):
                        samples[position] = read_sample(memory, index[offset], views=views)
            except CorruptShard as exc:
                return exc
        return None

    def _read_direct(self, grouped: dict, samples: list, allowed: tuple) -> set[int]:
        """Read the samples whose shard is in `allowed` and not cached yet straight from the store
        into `samples`. `DirectReads.read` checks each by its digest. `grouped` is `by_shard`'s
        of the samples. Return the shards so read. The others are read from the cache as usual. They are cached or boundary shards, those without a
        checked index with digests, and those with a sample that does not match."""
        wanted, where = [], {}
        for shard, (positions, numbers) in grouped.items():
            name = self.manifest.shards[shard].name
            if shard not in allowed or not self.may_read_directly(shard):  # a warm pass: no request
                continue
            index = self._store_index(shard)
            if index is None:
                continue
            wanted.append((name, index, numbers))
            where[name] = (shard, positions, numbers)
        if not wanted:
            return set()
        try:
            got = self._direct.read(wanted)
            read = {name: [read_sample(got[name][n]) for n in where[name][2]] for name in got}
        except DlstoreError as exc:  # the shards' own reads report it, if it is theirs
            log.info("reading samples straight from the store failed (%s): read from the cache", exc)
            return set()
        for name, parsed in read.items():
            for position, sample in zip(where[name][1], parsed):
                samples[position] = sample
        return {where[name][0] for name in read}

    def may_read_directly(self, shard: int) -> bool:
        """Whether `_read_direct` may read samples of `shard` now. It must be a whole shard of
        this node, not cached yet, with a sample index the manifest checks."""
        info = self.manifest.shards[shard]
        if shard in self.partial or info.index is None or info.index_checksum is None:
            return False
        return not self.cache.cached(info.name)

    def _store_index(self, shard: int) -> SampleIndex | None:
        """The store's sample index of `shard` with sample digests, or None where it has none
        or it cannot be had. One small GET per process, with direct reads' short retry. A
        failure that may pass is not remembered: the next read asks again."""
        with self._lock:
            if shard in self._store_indexes:
                return self._store_indexes[shard]
        info = self.manifest.shards[shard]
        index = None
        if info.index is not None and info.index_checksum is not None:  # digests as sure as the manifest
            try:
                index = load_sample_index(self._direct.store, info)
            except TransientError as exc:
                log.info("shard %r is read from the cache this time: %s", info.name, exc)
                return None
            except DlstoreError as exc:
                log.info("shard %r is read from the cache only: %s", info.name, exc)
            if index is not None and not index.has_sample_digests:
                index = None
        with self._lock:
            self._store_indexes[shard] = index
        return index

    def _recheck(self, shard: int, spec: ShardSpec | None = None) -> bool:
        """After a read of `shard` failed, check its cached copy `spec`, by default the whole
        shard. It is checked against the manifest's checksum or its samples' digests. A damaged
        copy is replaced by a fresh download. This runs once per shard and process, outside any
        hold: our own hold would keep the cache from replacing the file. False when done
        already, or impossible. The check costs a hash of the shard, so it runs only after a failure."""
        spec = spec or ShardSpec(*self.shard_ref(shard))
        with self._lock:
            if (spec.checksum is None and spec.samples is None) or spec.name in self._rechecked:
                return False
            self._rechecked.add(spec.name)
            self._indexes.pop(spec.name, None)  # maybe built from the damaged file
        if spec.samples is None:
            forget_sample_index(self.cache.index_path(spec.name))  # the node's copy may be the damaged part
        self.cache.fetch(*spec, recheck=True)
        return True

    # -- decode, augment, plan_on_device ---------------------------------------------------
    def image_bytes(self, sample: dict) -> bytes:
        name = image_field(sample, self.image_fields)
        if name is None:
            raise CorruptSample(f"sample {sample.get('__key__')!r} has no image member")
        return sample[name]

    def label(self, sample: dict) -> int:
        return parse_label(sample, len(self.manifest.classes))

    def decode(
        self, sample: dict, epoch: int, sample_id: int, clock: StageClock | None = None
    ) -> tuple[CropSource, int]:
        """The sample's pixels with its crop drawn by its own random generator, decoded at the
        smallest scale the crop allows, and its label. Raise `CorruptSample` when either is bad."""
        data, label = self.image_bytes(sample), self.label(sample)
        if self.cfg.transform.preset == "none":
            check_kept_size(data, self.cfg.transform.image_size)
        rng = self._rngs(self.cfg.seed, epoch, sample_id)
        marks = self._decode_marks()
        known = self._known_to_decode(sample_id, marks)
        with _timed(clock, "decode"):
            source = decode_for_crop(data, self.cfg.transform, rng, known)
        self._mark_decoded(sample_id, known, marks)
        return source, label

    def _decode_marks(self) -> np.ndarray:
        marks = self._decodes_cleanly
        if marks is None:  # two threads may both make one: a few marks lost, no more
            marks = self._decodes_cleanly = np.zeros(int(self.shard_sizes.sum()), dtype=bool)
        return marks

    def _known_to_decode(self, sample_id: int, marks: np.ndarray) -> bool:
        return self._all_decode_cleanly or bool(marks[sample_id]) or self._node_marks.known(sample_id)

    def _mark_decoded(self, sample_id: int, known: bool, marks: np.ndarray) -> None:
        if not known:
            self._node_marks.mark(sample_id)
        marks[sample_id] = True  # a race of two threads writes the same True

    def augment(self, source: CropSource, clock: StageClock | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """The crop, resize and flip drawn by `decode`, as uint8 HWC at the preset's size. It is
        written into `out` when given, a row of the batch buffer."""
        with _timed(clock, "augment"):
            return resize_crop(source, self.cfg.transform, out)

    def plan_on_device(self, sample: dict, epoch: int, sample_id: int) -> tuple[tuple, int]:
        """For `decode_on="device"`: the JPEG bytes and the crop row, without decoding."""
        data, label = self.image_bytes(sample), self.label(sample)
        data, width, height = device_jpeg(data)
        rng = self._rngs(self.cfg.seed, epoch, sample_id)
        box, flip = crop_plan(width, height, self.cfg.transform, rng)
        return (data, (*box, float(flip))), label

    def image(self, sample: dict, epoch: int, sample_id: int, clock: StageClock | None = None, out=None):
        """One sample through decode and augment, and its label. The image is a uint8 HWC array,
        in `out` when given, or its JPEG and crop row with `decode_on="device"`."""
        on_device = self.cfg.decode_on == "device"

        def first_step(sample: dict):
            if on_device:
                return self.plan_on_device(sample, epoch, sample_id)
            return self.decode(sample, epoch, sample_id, clock)

        try:
            done = first_step(sample)
        except CorruptSample:
            # Once more from a rechecked cached copy of the shard: the damage may be the cache's.
            shard, offset = (int(a[0]) for a in locate([sample_id], self.shard_sizes))
            if not self._recheck(shard, self.cache_spec(shard, np.array([offset]))):
                raise
            done = first_step(self.read(np.array([sample_id]))[0])
        if on_device:
            return done
        source, label = done
        return self.augment(source, clock, out), label

    def images(
        self, samples: list[dict], ids: list[int], epoch: int, rows: np.ndarray | None = None, clock=None
    ) -> list[tuple[Any, int] | None]:
        """Each sample through decode and augment, as `(image, label)`, in order. None stands
        for a corrupt sample that `on_corrupt="skip"` skips; with "raise" it raises.

        With `rows`, uint8 and C-contiguous, image k is written into `rows[k]`. Then the JPEGs go
        through `crop_rows` where it is built: one C call for them all, the GIL released once.
        What it turns down takes the per-image path."""
        native = self.row_jobs(samples, ids, epoch, rows)
        errors = []
        if native is not None and native.jobs:
            with _timed(clock, "decode"):  # the resize too: one call does both
                errors = crop_rows(native.jobs, self.cfg.transform, rows)
        return self.images_done(samples, ids, epoch, rows, native, errors, clock)

    def row_jobs(self, samples: list[dict], ids: list[int], epoch: int, rows: np.ndarray | None) -> RowJobs | None:
        """The first half of `images`: the `crop_rows` jobs of the samples it takes, or None
        where it does not serve. The thread engine hands them to C threads (`RowWorkers`)."""
        if rows is None or self.cfg.decode_on == "device" or not builds_rows_natively(self.cfg.transform):
            return None
        marks, seed = self._decode_marks(), self.cfg.seed
        native = RowJobs([], [], [])
        for k, (sample, sample_id) in enumerate(zip(samples, ids)):
            try:
                data, label = self.image_bytes(sample), self.label(sample)
            except CorruptSample:
                native.left.append(k)  # the per-image path says so
                continue
            if not is_jpeg(data):
                native.left.append(k)
                continue
            known = self._known_to_decode(sample_id, marks)
            native.jobs.append((data, seed, epoch, sample_id, not known, k))  # C draws the crop
            native.taken.append((k, sample_id, label, known))
        return native

    def images_done(self, samples, ids, epoch: int, rows, native: RowJobs | None, errors: list, clock=None) -> list:
        """The second half of `images`, given `crop_rows`' `errors` for `native`'s jobs: marks,
        and the per-image path for what C turned down or did not take."""
        done: list[tuple[Any, int] | None] = [None] * len(samples)
        left = range(len(samples)) if native is None else native.left
        if native is not None:
            marks = self._decode_marks()
            for (k, sample_id, label, known), error in zip(native.taken, errors):
                if error is not None:
                    left.append(k)
                    continue
                self._mark_decoded(sample_id, known, marks)
                done[k] = (rows[k], label)
        for k in sorted(left):
            try:
                done[k] = self.image(samples[k], epoch, ids[k], clock, out=None if rows is None else rows[k])
            except CorruptSample as exc:
                if self.cfg.on_corrupt == "raise":
                    raise
                log.warning("skipping corrupt sample %s: %s", samples[k].get("__key__"), exc)
        return done

    # -- the whole path ----------------------------------------------------------------------
    def build_batch(
        self, request: BatchRequest, out: torch.Tensor | None = None, clock: StageClock | None = None
    ) -> dict:
        """The batch of `request`: uint8 NHWC images, labels and padding marks.
        `batch["corrupt"]` counts the samples skipped as corrupt. With `decode_on="device"` it
        holds the encoded JPEGs and their crop rows instead of images, from `join_encoded`.

        `out` is a uint8 tensor of shape `batch_size, size, size, 3` that receives the images.
        "images" is a view of its first rows. The loader passes a slot of a shared-memory
        buffer, so a worker's batch reaches the training process uncopied."""
        with self.viewed(request.ids, request.direct, clock) as samples:
            return self._build_batch(request, samples, out, clock)

    def _build_batch(self, request: BatchRequest, samples: list[dict], out: torch.Tensor | None, clock) -> dict:
        # Each image is resized straight into its row of `out`: no copy after, unless some are
        # skipped. Without an `out`, one is made: every batch takes the same path, to the pixel.
        rows = None
        if self.cfg.decode_on != "device":
            if out is None:
                size = self.cfg.transform.image_size
                out = torch.empty((len(request.ids), size, size, 3), dtype=torch.uint8)
            rows = out.numpy()
        done = self.images(samples, request.ids.tolist(), request.epoch, rows, clock)
        kept = [k for k, result in enumerate(done) if result is not None]
        if rows is not None and len(kept) < len(done):
            rows[: len(kept)] = rows[kept]  # the good rows move up
        images = [done[k][0] for k in kept]
        labels = [done[k][1] for k in kept]
        keys = [samples[k].get("__key__") for k in kept]
        padding = [bool(request.is_padding[k]) for k in kept]
        with _timed(clock, "collate"):
            batch = self.collate(request.index, images, labels, keys, padding, out)
        batch["corrupt"] = len(request.ids) - len(keys)
        return batch

    def collate(self, index: int, images: list, labels: list, keys: list, padding: list, out=None) -> dict:
        """One batch dict from the samples' images, labels and marks. With `out`, the images
        are its first rows already."""
        if self.cfg.decode_on == "device":
            batch = self.batch_dict(index, self.empty_images(), labels, keys, padding)
            batch["encoded"], batch["boxes"] = join_encoded(images)
            batch["image_size"] = self.cfg.transform.image_size  # what the device decodes to
        elif out is not None and images:  # `build_batch` resized each image into its row of `out`
            batch = self.batch_dict(index, out[: len(images)], labels, keys, padding)
        else:
            stacked = torch.from_numpy(np.stack(images)) if images else self.empty_images()
            batch = self.batch_dict(index, stacked, labels, keys, padding)
        return batch

    def batch_dict(self, index: int, images: torch.Tensor, labels: list, keys: list, padding: list) -> dict:
        """The batch as the loader hands it on: uint8 NHWC images, labels, padding marks, keys."""
        # Made by numpy: `torch.tensor` lets go of the GIL (see `dlstore.loader.threads`).
        batch: dict[str, Any] = {
            "images": images,
            "labels": torch.from_numpy(np.array(labels, dtype=np.int64)),
            "index": index,
            "padding": torch.from_numpy(np.array(padding, dtype=bool)),
        }
        if self.cfg.return_keys:
            batch["keys"] = keys
        return batch

    def empty_images(self) -> torch.Tensor:
        size = self.cfg.transform.image_size
        return torch.empty((0, size, size, 3), dtype=torch.uint8)


def join_encoded(rows: list[tuple[bytes, tuple]]) -> tuple[tuple[torch.Tensor, list[int]], torch.Tensor]:
    """The batch's JPEGs as one byte tensor with each one's length, and their crop rows. One
    tensor: each tensor a worker returns costs a shared-memory file and a descriptor."""
    lengths = [len(data) for data, _ in rows]
    joined = bytearray(b"".join(data for data, _ in rows))
    encoded = torch.frombuffer(joined, dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)
    boxes = torch.tensor([row for _, row in rows], dtype=torch.float64).reshape(-1, 5)
    return (encoded, lengths), boxes
