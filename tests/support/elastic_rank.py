"""One rank of the lost-node tests: `dlstore train ARGS`, writing down what each step trains on.

Run by torchrun as `elastic_rank.py TRACE_DIR ARGS...`. The training loader returns keys, which
the trainer drops. Each batch it hands the trainer adds one JSON line to
`TRACE_DIR/rank{RANK}-attempt{TORCHELASTIC_RESTART_COUNT}.jsonl`: the world size, the epoch,
the batches left in it after this one, the keys of the samples that are not padding, and the
time.
Each attempt starts its trace with what the node's cache held and had fetched then
(`--cache-dir`), before this rank reads anything. Nothing else changes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time


def main() -> int:
    trace_dir, args = sys.argv[1], sys.argv[2:]
    import dlstore.cli
    import dlstore.loader.loader as loader_module
    import dlstore.train.loop as loop

    rank, attempt = os.environ["RANK"], os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    world = os.environ["WORLD_SIZE"]
    path = os.path.join(trace_dir, f"rank{rank}-attempt{attempt}.jsonl")
    iterate, train = loader_module.Loader.__iter__, loop.main
    with open(path, "a") as trace:
        trace.write(json.dumps(_cache_now(args[args.index("--cache-dir") + 1])) + "\n")

    def traced(self):
        epoch = self.state.epoch
        with open(path, "a") as trace:
            for batch in iterate(self):
                _, _, meta = batch
                keys = [k for k, pad in zip(meta["keys"], meta["padding"].tolist()) if not pad]
                record = {"world": int(world), "epoch": epoch, "left": len(self), "keys": keys, "t": time.time()}
                trace.write(json.dumps(record) + "\n")
                trace.flush()
                yield batch

    def keyed(config):
        return train(dataclasses.replace(config, data=config.data.replace(return_keys=True)))

    loader_module.Loader.__iter__, loop.main = traced, keyed
    return dlstore.cli.main(["train", *args])


def _cache_now(cache_dir: str) -> dict:
    """The entries in `cache_dir` with their sizes, and the bytes its processes have fetched."""
    from dlstore.cache import cache_report

    shards = os.path.join(cache_dir, "shards")
    held = (
        {name: os.path.getsize(os.path.join(shards, name)) for name in os.listdir(shards)}
        if os.path.isdir(shards)
        else {}
    )
    fetched = cache_report(cache_dir).totals.bytes_fetched if held else 0
    return {"cache": held, "bytes_fetched": fetched}


if __name__ == "__main__":
    sys.exit(main())
