"""The program each rank of `test_multinode.py` runs under torchrun:

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --node-rank N ... tests/support/multinode_rank.py SPEC.json

It reads `EPOCHS` epochs (the ranks in step, as under DDP) from its node's cache (`SPEC["cache_dirs"][node]`) through
`dlstore.Dataset` and `dlstore.Loader` (CPU, uint8, keys returned) and writes, per epoch,
each batch's (key, padding) pairs to `SPEC["out"]/rank-N.json`.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import dlstore
from dlstore.world import World

EPOCHS = 3


def run_rank(spec_path: str) -> int:
    with open(spec_path) as file:
        spec = json.load(file)
    world = World.from_env()
    dist.init_process_group("gloo")
    try:
        ds = dlstore.Dataset(
            spec["url"],
            cache_dir=spec["cache_dirs"][world.node],
            cache_limit=spec["cache_limit"],
            transform="eval",
            image_size=8,
            batch_size=spec["batch_size"],
            seed=0,
            shuffle_window=spec.get("shuffle_window", 2),
            prefetch_shards=2,
            world=world,
            return_keys=True,
        )
        loader = dlstore.Loader(ds, num_workers=1, device="cpu", dtype="uint8")
        record: dict[str, list] = {}
        for epoch in range(EPOCHS):
            loader.set_epoch(epoch)
            batches = record[str(epoch)] = []
            for images, _, meta in loader:
                if images.dtype != torch.uint8 or images.shape[0] != len(meta["keys"]):
                    raise RuntimeError(f"batch of {images.dtype} {tuple(images.shape)} for {len(meta['keys'])} keys")
                batches.append([[key, bool(pad)] for key, pad in zip(meta["keys"], meta["padding"].tolist())])
                dist.all_reduce(torch.zeros(1))  # the ranks step together, as DDP's gradients make them
            dist.barrier()
        loader.close()
        ds.cache.close()
        with open(os.path.join(spec["out"], f"rank-{world.rank}.json"), "w") as out:
            json.dump(record, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run_rank(sys.argv[1]))
