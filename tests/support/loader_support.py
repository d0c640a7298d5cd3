"""Small datasets with uneven shards, and a per-rank program that records what each rank delivers."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
from PIL import Image

import dlstore
from dlstore.config import StoreConfig
from dlstore.format.manifest import Manifest, ShardInfo
from dlstore.format.sample_index import index_name
from dlstore.format.shard_writer import TarShardWriter
from dlstore.format.shards import shard_name
from dlstore.storage import Store
from dlstore.world import World

NUM_CLASSES = 5


def tiny_jpeg(label: int, seed: int, px: int = 16) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = np.full((px, px, 3), label * 50, dtype=np.uint8) + rng.integers(0, 10, (px, px, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=80)
    return out.getvalue()


def damaged_below_jpeg(width: int = 320, height: int = 240) -> tuple[bytes, int]:
    """A JPEG whose entropy data is garbled from its lower part on (the end-of-image marker
    kept), which a whole-image decode refuses; and the first row the damage can reach. Its
    pixels depend on position, so a crop of it shows where it was taken."""
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([(x * 3 + y) % 256, (y * 5) % 256, (x * y // 7) % 256], axis=-1).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90)
    data = out.getvalue()
    start = int(len(data) * 0.8)
    return data[:start] + bytes(b ^ 0x5A for b in data[start : start + 200]) + data[start + 200 :], height // 2


def folder_with_a_jpeg_damaged_below(root: Path, damaged: bool = True) -> Path:
    """An image folder of 2 classes x 3 JPEGs stored as they are (pixels that depend on
    position), and one JPEG garbled below its upper half (`class_a/damaged.jpg`) that Pillow
    opens and that ends with its end-of-image marker: only a decode of every row tells."""
    for c, name in enumerate(("class_a", "class_b")):
        (root / name).mkdir(parents=True)
        for i in range(3):
            y, x = np.mgrid[0:96, 0:128]
            pixels = np.stack([(x * 2 + 40 * i) % 256, (y * 2 + 90 * c) % 256, (x + y) % 256], axis=-1)
            Image.fromarray(pixels.astype(np.uint8)).save(root / name / f"{i}.jpg", "JPEG", quality=90)
    if damaged:
        (root / "class_a" / "damaged.jpg").write_bytes(damaged_below_jpeg()[0])
    return root


def write_dataset(
    store: Store,
    sizes: list[int],
    corrupt_keys: frozenset[str] = frozenset(),
    truncated_keys: frozenset[str] = frozenset(),
    checksum_algorithm: str = "xxh3_128",
    damaged_keys: frozenset[str] = frozenset(),
) -> list[str]:
    """Shards of the given sample counts; returns every key. Keys are unique across shards.
    `corrupt_keys` get bytes that are no JPEG; `truncated_keys` a JPEG whose header is whole
    but whose last bytes are cut off; `damaged_keys` a whole JPEG, frame header and end marker
    in place, whose Huffman table is bogus (only a decode finds it). The manifest's checksums
    are in `checksum_algorithm`."""
    shards, keys, serial = [], [], 0
    for number, count in enumerate(sizes):
        buffer = io.BytesIO()
        writer = TarShardWriter(buffer, checksum_algorithm)
        for _ in range(count):
            key = f"s{serial:06d}"
            label = serial % NUM_CLASSES
            jpeg = b"\xff\xd8 not a jpeg" if key in corrupt_keys else tiny_jpeg(label, serial)
            if key in truncated_keys:
                jpeg = jpeg[: jpeg.index(b"\xff\xda") + 20]  # a few bytes into the scan
            if key in damaged_keys:
                table = jpeg.index(b"\xff\xc4")
                jpeg = jpeg[: table + 5] + b"\xff" * 16 + jpeg[table + 21 :]  # the table's code counts
            writer.write(key, {"cls": str(label).encode(), "jpg": jpeg})
            keys.append(key)
            serial += 1
        index = writer.close()
        name = shard_name("shard", number)
        store.put(name, buffer.getvalue())
        index_bytes = index.to_bytes()
        store.put(index_name(name), index_bytes)
        shards.append(ShardInfo(name=name, size=index.shard_size, samples=count, checksum=index.checksum))
    classes = tuple(f"class{i}" for i in range(NUM_CLASSES))
    Manifest(shards=tuple(shards), classes=classes, fields=("cls", "jpg"), label_field="cls").save(store)
    return keys


def spec_dataset(url: str, spec: dict, cache_dir: str, world: World, store_config: StoreConfig | None):
    """The dataset every rank of these runs reads: 8 px eval images, keys returned."""
    return dlstore.Dataset(
        url,
        cache_dir=cache_dir,
        cache_limit=spec["cache_limit"],
        transform="eval",
        image_size=8,
        batch_size=spec["batch_size"],
        seed=spec["seed"],
        world=world,
        store_config=store_config,
        return_keys=True,
    )


def fault_free_run(url: str, spec: dict, cache_dir: str, store_config: StoreConfig) -> list[dict]:
    """What each rank of `spec`'s world delivers without faults, each epoch's (key, padding)
    per batch, read in this process straight from the server: the reference of a fault run."""
    records = []
    for rank in range(spec["world_size"]):
        world = World(rank, spec["world_size"], spec["local_world_size"])
        loader = dlstore.Loader(spec_dataset(url, spec, cache_dir, world, store_config), num_workers=0, device="cpu")
        epochs = {}
        for epoch in range(spec["epochs"]):
            loader.set_epoch(epoch)
            epochs[str(epoch)] = [
                [[k, bool(p)] for k, p in zip(meta["keys"], meta["padding"].tolist())] for _, _, meta in loader
            ]
        records.append(epochs)
    return records


def run_rank(rank: int, spec: dict) -> None:
    """One DDP rank: read `spec["epochs"]` epochs (or stop after `stop_after` batches of the
    first), and write what it delivered to `spec["out"]/rank-N.json`."""
    import torch.distributed as dist  # only the spawned rank joins a process group

    os.environ.update(spec.get("env", {}))
    world = World(rank, spec["world_size"], spec["local_world_size"])
    dist.init_process_group("gloo", init_method=spec["init"], rank=rank, world_size=world.world_size)
    try:
        config = StoreConfig.from_env(spec.get("env") or None)
        ds = spec_dataset(spec["url"], spec, spec["cache_dir"], world, config)
        loader = dlstore.Loader(ds, num_workers=spec["workers"], device="cpu")
        if spec.get("state"):
            loader.load_state_dict(spec["state"])
        record = {"epochs": {}, "state": None, "lengths": {}}
        start_epoch = loader.state_dict()["epoch"]
        for epoch in range(start_epoch, start_epoch + spec["epochs"]):
            loader.set_epoch(epoch)
            record["lengths"][epoch] = len(loader)
            delivered = record["epochs"].setdefault(epoch, [])
            for step, (images, labels, meta) in enumerate(loader):
                assert images.shape[0] == labels.shape[0] == len(meta["keys"])
                delivered.append([[k, bool(p)] for k, p in zip(meta["keys"], meta["padding"].tolist())])
                # Every rank stops at the same step, as DDP would after an all-reduced signal.
                if spec.get("stop_after") is not None and step + 1 == spec["stop_after"]:
                    record["state"] = loader.state_dict()
                    break
            if record["state"] is not None:
                break
        with open(os.path.join(spec["out"], f"rank-{rank}.json"), "w") as out:
            json.dump(record, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
