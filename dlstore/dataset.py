"""The streaming dataset: manifest + plan + cache + reader + transforms, one batch at a time.

`Dataset` is a map-style torch dataset whose items are whole batches: the loader's sampler
(main process) walks this rank's epoch plan and hands a `BatchRequest` to a worker; the
worker makes sure the batch's shards are in the node cache, reads the samples through the
shard's sample index, decodes and augments them, and collates a uint8 NHWC batch.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from dlstore.cache import CacheConfig, ShardCache
from dlstore.config import StoreConfig, WorldInfo, parse_size
from dlstore.errors import ConfigError, CorruptSample, CorruptShard
from dlstore.manifest import Manifest
from dlstore.plan import PlanConfig, RankPlan, World, locate, rank_plan
from dlstore.shards import read_sample_from_file, read_shard_index
from dlstore.storage import open_store
from dlstore.transforms import TransformConfig, crop_plan, device_jpeg, sample_rng, transform_image

__all__ = ["BatchRequest", "Dataset", "DatasetConfig"]

log = logging.getLogger(__name__)

IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp")


def default_cache_dir(env: dict | None = None) -> str:
    env = os.environ if env is None else env
    return env.get("DLSTORE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "dlstore", "shards")


@dataclass(frozen=True)
class DatasetConfig:
    url: str
    cache_dir: str = ""
    cache_limit: int = 50 * 10**9
    transform: TransformConfig = field(default_factory=TransformConfig)
    batch_size: int = 256
    seed: int = 0
    drop_last: bool = False
    shuffle: bool = True
    shuffle_window: int = 4
    on_corrupt: str = "skip"  # or "raise"
    # "worker": decode and augment in the DataLoader workers; "device": the workers only read
    # JPEG headers and draw the crops, the loader decodes on the device (nvJPEG on a GPU).
    decode_on: str = "worker"
    return_keys: bool = False
    prefetch_shards: int = 4

    def __post_init__(self) -> None:
        if self.on_corrupt not in ("skip", "raise"):
            raise ConfigError("on_corrupt must be 'skip' or 'raise'")
        if self.batch_size < 1:
            raise ConfigError("batch_size must be at least 1")


@dataclass(frozen=True)
class BatchRequest:
    """What a worker needs to build one batch: the sample ids, the epoch (for augmentation
    randomness) and the batch's position (for ordering and errors)."""

    epoch: int
    index: int
    ids: np.ndarray
    is_padding: np.ndarray


class Dataset(torch.utils.data.Dataset):
    """A sharded dataset in any store, read through the node-local cache.

    >>> ds = Dataset("swift://imagenet/train", cache_dir="/mnt/ssd/dlstore", cache_limit="150GB",
    ...              transform="train", image_size=224, batch_size=256, seed=0)   # doctest: +SKIP
    """

    def __init__(
        self,
        url: str,
        *,
        cache_dir: str | None = None,
        cache_limit: str | int = "50GB",
        transform: str | TransformConfig = "train",
        image_size: int = 224,
        batch_size: int = 256,
        seed: int = 0,
        world: WorldInfo | None = None,
        store_config: StoreConfig | None = None,
        **options: Any,
    ) -> None:
        if isinstance(transform, str):
            transform = TransformConfig(preset=transform, image_size=image_size)
        self.cfg = DatasetConfig(
            url=url,
            cache_dir=cache_dir or default_cache_dir(),
            cache_limit=parse_size(cache_limit),
            transform=transform,
            batch_size=batch_size,
            seed=seed,
            **options,
        )
        self.store = open_store(url, store_config)
        self.manifest = Manifest.load(self.store)
        info = world or WorldInfo.from_env()
        self.world = World(rank=info.rank, world_size=info.world_size, local_world_size=info.local_world_size)
        self.shard_sizes = np.array([s.samples for s in self.manifest.shards], dtype=np.int64)
        self.cache = ShardCache(
            CacheConfig(
                cache_dir=self.cfg.cache_dir, limit_bytes=self.cfg.cache_limit, prefetch=self.cfg.prefetch_shards
            ),
            self.store,
        )
        self.cache.check_fits(max((s.size for s in self.manifest.shards), default=0))
        # Datasets converted with --keep-format mix image types; each sample names its own.
        self.image_fields = tuple(f for f in IMAGE_FIELDS if f in self.manifest.fields)
        if not self.image_fields:
            raise ConfigError(f"{url}: the manifest lists no image field (fields: {list(self.manifest.fields)})")
        self._plans: OrderedDict[tuple, RankPlan] = OrderedDict()
        self._indexes: OrderedDict[str, Any] = OrderedDict()
        # Shards whose cached copy this process has checked against the manifest's checksum
        # after a read failed (see `_recheck`): a second failure is the shard's own.
        self._rechecked: set[str] = set()
        self.corrupt_samples = 0

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_plans"], state["_indexes"], state["_rechecked"] = OrderedDict(), OrderedDict(), set()
        return state

    # -- the plan (main process) --------------------------------------------------------
    @property
    def plan_config(self) -> PlanConfig:
        c = self.cfg
        return PlanConfig(
            seed=c.seed,
            batch_size=c.batch_size,
            drop_last=c.drop_last,
            shuffle=c.shuffle,
            shuffle_window=c.shuffle_window,
        )

    def plan(self, epoch: int, history: tuple = ()) -> RankPlan:
        key = (epoch, history, self.cfg.batch_size)
        if key not in self._plans:
            self._plans[key] = rank_plan(self.shard_sizes, self.plan_config, epoch, self.world, history)
            while len(self._plans) > 2:
                self._plans.popitem(last=False)
        return self._plans[key]

    def request(self, plan: RankPlan, epoch: int, index: int) -> BatchRequest:
        ids, is_padding = plan.batch(index)
        return BatchRequest(epoch=epoch, index=index, ids=ids, is_padding=is_padding)

    def prefetch_after(self, plan: RankPlan, index: int) -> None:
        """Ask the cache to fetch the shards of the next batches in the background."""
        if index % 4:  # the list changes slowly; refresh it every few batches
            return
        upcoming: list[int] = []
        for j in range(index + 1, plan.num_batches):
            for shard in plan.batch_shards(j).tolist():
                if shard not in upcoming:
                    upcoming.append(shard)
            if len(upcoming) >= self.cfg.prefetch_shards:
                break
        self.cache.prefetch([self._shard_ref(s) for s in upcoming[: self.cfg.prefetch_shards]])

    def _shard_ref(self, shard: int) -> tuple[str, int, str | None]:
        info = self.manifest.shards[shard]
        return info.name, info.size, info.checksum

    # -- reading (workers) --------------------------------------------------------------
    def _index(self, shard: int, path: str):
        name = self.manifest.shards[shard].name
        if name not in self._indexes:
            self._indexes[name] = read_shard_index(path)
            while len(self._indexes) > 64:
                self._indexes.popitem(last=False)
        return self._indexes[name]

    def _read_raw(self, ids: np.ndarray) -> list[dict]:
        """The raw samples of `ids`, in order; each shard is held once for all its samples."""
        shards, offsets = locate(ids, self.shard_sizes)
        samples: list[dict | None] = [None] * len(ids)
        for shard in np.unique(shards).tolist():
            positions = np.flatnonzero(shards == shard).tolist()
            error = self._read_from_shard(shard, positions, offsets, samples)
            if error is not None and self._recheck(shard):
                error = self._read_from_shard(shard, positions, offsets, samples)
            if error is not None:
                name = self.manifest.shards[shard].name
                raise CorruptShard(f"shard {name!r} of {self.store.url}: {error}") from None
        return samples  # type: ignore[return-value]

    def _read_from_shard(
        self, shard: int, positions: list[int], offsets: np.ndarray, samples: list[dict | None]
    ) -> CorruptShard | None:
        """Read the samples at `positions` from the cached `shard` into `samples`; the tar
        reader's error if the cached file is malformed (errors of the cache itself propagate)."""
        name, size, checksum = self._shard_ref(shard)
        with self.cache.hold(name, size, checksum) as path:
            try:
                index = self._index(shard, path)
                with open(path, "rb") as file:
                    for position in positions:
                        samples[position] = read_sample_from_file(file, index[int(offsets[position])])
            except CorruptShard as exc:
                return exc
        return None

    def _recheck(self, shard: int) -> bool:
        """After a read of `shard` failed: check its cached copy against the manifest's checksum,
        which replaces a damaged copy (a bad disk, a stray write after it was verified) with a
        fresh download. Once per shard and process, outside any hold (a hold of our own would
        keep the cache from replacing the file); False when done already, or impossible.

        The check costs a hash of the shard, so it runs only after a failure, never per read."""
        name, size, checksum = self._shard_ref(shard)
        if checksum is None or name in self._rechecked:
            return False
        self._rechecked.add(name)
        self._indexes.pop(name, None)  # built from the damaged file, maybe
        self.cache.fetch(name, size, checksum, recheck=True)
        return True

    def _decode(self, sample: dict, epoch: int, sample_id: int) -> tuple[np.ndarray, int]:
        data = next((sample[f] for f in self.image_fields if f in sample), None)
        if data is None:
            raise CorruptSample(f"sample {sample.get('__key__')!r} has no image member")
        label = _label(sample, len(self.manifest.classes))
        rng = sample_rng(self.cfg.seed, epoch, sample_id)
        return transform_image(data, self.cfg.transform, rng), label

    def _decode_rechecked(self, sample: dict, epoch: int, sample_id: int) -> tuple[np.ndarray, int]:
        """`_decode`, and when that fails, once more from a rechecked cached copy of the shard."""
        try:
            return self._decode(sample, epoch, sample_id)
        except CorruptSample:
            shard = int(locate([sample_id], self.shard_sizes)[0][0])
            if not self._recheck(shard):
                raise
        return self._decode(self._read_raw(np.array([sample_id]))[0], epoch, sample_id)

    def _plan_on_device(self, sample: dict, epoch: int, sample_id: int) -> tuple[tuple, int]:
        """For `decode_on="device"`: the JPEG bytes and the crop row, without decoding."""
        data = next((sample[f] for f in self.image_fields if f in sample), None)
        if data is None:
            raise CorruptSample(f"sample {sample.get('__key__')!r} has no image member")
        label = _label(sample, len(self.manifest.classes))
        data, width, height = device_jpeg(data)
        box, flip = crop_plan(width, height, self.cfg.transform, sample_rng(self.cfg.seed, epoch, sample_id))
        return (data, (*box, float(flip))), label

    def __getitem__(self, request: BatchRequest) -> dict:
        return self.build_batch(request)

    def build_batch(self, request: BatchRequest, out: torch.Tensor | None = None) -> dict:
        """The batch of `request`: uint8 NHWC images, labels, padding marks, and (with
        `decode_on="device"`) the encoded JPEGs (one byte tensor and each JPEG's length) and crop
        rows instead of images.

        `out`, a uint8 tensor of shape (batch_size, size, size, 3), receives the images, and
        the batch's "images" is a view of its first rows: the loader passes a slot of a
        shared-memory buffer, so a worker's batch reaches the training process uncopied."""
        cfg = self.cfg
        raw = self._read_raw(request.ids)
        on_device = cfg.decode_on == "device"
        images, labels, keys, padding = [], [], [], []
        for sample_id, is_padding, sample in zip(request.ids.tolist(), request.is_padding.tolist(), raw):
            try:
                if on_device:
                    image, label = self._plan_on_device(sample, request.epoch, sample_id)
                else:
                    image, label = self._decode_rechecked(sample, request.epoch, sample_id)
                images.append(image)
            except CorruptSample as exc:
                if cfg.on_corrupt == "raise":
                    raise
                self.corrupt_samples += 1
                log.warning("skipping corrupt sample %s: %s", sample.get("__key__"), exc)
                continue
            labels.append(label)
            keys.append(sample.get("__key__"))
            padding.append(is_padding)
        if on_device:
            # One tensor for the batch: each tensor a worker returns costs a shared-memory file
            # and a file descriptor while in flight (and a pinning copy on GPU nodes).
            lengths = [len(data) for data, _ in images]
            joined = bytearray(b"".join(data for data, _ in images))
            encoded = (
                torch.frombuffer(joined, dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8),
                lengths,
            )
            boxes = torch.tensor([row for _, row in images], dtype=torch.float64).reshape(-1, 5)
            images = []
        if out is not None and images:
            np.stack(images, out=out[: len(images)].numpy())
            stacked = out[: len(images)]
        else:
            stacked = torch.from_numpy(np.stack(images)) if images else _empty(cfg.transform)
        batch = {
            "images": stacked,
            "labels": torch.tensor(labels, dtype=torch.int64),
            "index": request.index,
            "padding": torch.tensor(padding, dtype=torch.bool),
        }
        if on_device:
            batch["encoded"], batch["boxes"] = encoded, boxes
        if cfg.return_keys:
            batch["keys"] = keys
        # Counted in `self.corrupt_samples` too, which is this process's copy: the loader adds
        # this to the main process's when the batch comes from a worker.
        batch["corrupt"] = len(request.ids) - len(keys)
        return batch

    def with_transform(self, transform: TransformConfig) -> Dataset:
        """The same data with another transform (e.g. a progressive-resizing step)."""
        other = self.__new__(type(self))
        other.__dict__.update(self.__getstate__())
        other.cfg = replace(self.cfg, transform=transform)
        return other


def _label(sample: dict, num_classes: int) -> int:
    """The sample's class index; it must name one of the manifest's `num_classes` classes
    (any non-negative index when the manifest lists none)."""
    raw = sample.get("cls")
    if raw is None:
        raise CorruptSample(f"sample {sample.get('__key__')!r} has no .cls member")
    try:
        label = int(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise CorruptSample(f"sample {sample.get('__key__')!r} has a non-integer label") from None
    if label < 0 or (num_classes and label >= num_classes):
        raise CorruptSample(f"sample {sample.get('__key__')!r} has label {label}, not one of {num_classes} classes")
    return label


def _empty(transform: TransformConfig) -> torch.Tensor:
    return torch.empty((0, transform.image_size, transform.image_size, 3), dtype=torch.uint8)
