#!/usr/bin/env python3
"""CPU per image, epoch by epoch, of the ranks of one node sharing a cache directory.

Why: the crop-only decode reads the rows below a crop until a sample has once decoded whole
(`dlstore.transforms.decode_for_crop`), and each epoch deals a node's samples to its ranks
afresh. With a rank's own marks of what decoded, a rank meets samples other ranks decoded as
if new; with the node's marks (`dlstore.cache.marks`) it knows them all after the node's first
epoch. This runs `--ranks` rank processes at once (one node: `World(rank, ranks, ranks)`, one
fresh cache directory per run, the thread engine with `--threads` decode threads, uint8 CPU
batches) for `--epochs` epochs and reports each epoch's CPU milliseconds per image (all
ranks' process CPU over all their images) and the share of images decoded checked (the rows
below the crop read: a count, where the CPU times are noisy). `--tree` names checkouts to compare (each run with
that checkout first on PYTHONPATH); rounds interleave them. The marks matter only for a
dataset `dlstore convert` did not decode (`--no-check-decode`, or one made by another tool):
in one it did, no image is decoded checked.

Example (the data of `bench_peers.py`: a dataset both checkouts read)::

    python tools/bench_node_marks.py --url file:///tmp/dlstore-peers/imagenet-10x500-8-shards/store/train \\
        --tree . --tree /tmp/old-checkout --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RANK = r"""
import json, resource, sys, time
import dlstore
import dlstore.sample_path
from dlstore.world import World
args = json.loads(sys.argv[1])
checked = [0]  # decodes that read the rows below the crop: the sample was not known to decode
decode_for_crop = dlstore.sample_path.decode_for_crop
def counted(data, cfg, rng=None, known_to_decode=False):
    checked[0] += not known_to_decode
    return decode_for_crop(data, cfg, rng, known_to_decode)
dlstore.sample_path.decode_for_crop = counted
ds = dlstore.Dataset(
    args["url"], cache_dir=args["cache_dir"], cache_limit="20GB", transform="train",
    image_size=args["image_size"], batch_size=args["batch_size"], seed=0,
    world=World(args["rank"], args["ranks"], args["ranks"]),
)
def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
out = []
with dlstore.Loader(ds, num_workers=args["threads"], device="cpu", dtype="uint8", engine="threads") as loader:
    for epoch in range(args["epochs"]):
        loader.set_epoch(epoch)
        before, started, images, checked[0] = cpu(), time.perf_counter(), 0, 0
        for batch, _ in loader:
            images += batch.shape[0]
        out.append({"cpu_s": cpu() - before, "wall_s": time.perf_counter() - started, "images": images,
                    "checked": checked[0]})
print(json.dumps({"epochs": out, "dlstore": dlstore.__file__}))
"""


def run(tree: str, args: argparse.Namespace) -> list[dict]:
    """One node: every rank at once, a fresh cache; [{cpu_s, wall_s, images}] per epoch, ranks summed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory(prefix="bench-node-marks-") as cache_dir:
        ranks = []
        for rank in range(args.ranks):
            spec = {
                "url": args.url,
                "cache_dir": cache_dir,
                "rank": rank,
                "ranks": args.ranks,
                "epochs": args.epochs,
                "threads": args.threads,
                "batch_size": args.batch_size,
                "image_size": args.image_size,
            }
            ranks.append(
                subprocess.Popen(  # not run in a checkout: `-c` puts the working directory first on sys.path
                    [sys.executable, "-c", RANK, json.dumps(spec)],
                    env=env,
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=cache_dir,
                )
            )
        results = []
        for process in ranks:
            stdout, _ = process.communicate(timeout=3600)
            if process.returncode:
                raise SystemExit(f"a rank failed ({process.returncode}) with {tree} first on PYTHONPATH")
            result = json.loads(stdout.strip().splitlines()[-1])
            if not result["dlstore"].startswith(os.path.join(tree, "")):
                raise SystemExit(f"a rank imported {result['dlstore']}, not the checkout {tree}")
            results.append(result["epochs"])
    return [
        {key: sum(rank[epoch][key] for rank in results) for key in ("cpu_s", "wall_s", "images", "checked")}
        for epoch in range(args.epochs)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the dataset (every checkout compared must read it)")
    parser.add_argument("--tree", action="append", help="a checkout to compare (default: this one); repeat")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="decode threads per rank (default 1)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    trees = [str(Path(t).resolve()) for t in args.tree or [str(Path(__file__).resolve().parents[1])]]
    runs: dict[str, list[list[dict]]] = {tree: [] for tree in trees}
    for number in range(args.rounds):
        for tree in trees:
            epochs = run(tree, args)
            runs[tree].append(epochs)
            per_image = ", ".join(f"{1000 * e['cpu_s'] / e['images']:.3f}" for e in epochs)
            checked = ", ".join(f"{e['checked'] / e['images']:.2f}" for e in epochs)
            print(
                f"round {number + 1} {tree}: CPU ms an image, epoch by epoch: {per_image}; "
                f"share of images decoded checked: {checked}",
                file=sys.stderr,
            )
    print(f"{args.ranks} ranks of one node, {args.threads} decode thread(s) each; CPU ms an image, median [min .. max]")
    report: dict = {"ranks": args.ranks, "threads": args.threads, "epochs": args.epochs, "trees": {}}
    for tree, rounds in runs.items():
        columns = []
        for epoch in range(args.epochs):
            values = [1000 * r[epoch]["cpu_s"] / r[epoch]["images"] for r in rounds]
            columns.append({"median": statistics.median(values), "min": min(values), "max": max(values)})
        shares = [
            statistics.median(r[epoch]["checked"] / r[epoch]["images"] for r in rounds) for epoch in range(args.epochs)
        ]
        report["trees"][tree] = {"cpu_ms_per_image": columns, "checked_share": shares}
        cells = "  ".join(f"{c['median']:.3f} [{c['min']:.3f} .. {c['max']:.3f}]" for c in columns)
        print(f"  {tree}\n    epochs 0..{args.epochs - 1}: {cells}")
        print("    share decoded checked: " + "  ".join(f"{share:.2f}" for share in shares))
    if len(trees) == 2:
        first, second = runs[trees[0]], runs[trees[1]]
        for epoch in range(args.epochs):
            ratios = [
                (a[epoch]["cpu_s"] / a[epoch]["images"]) / (b[epoch]["cpu_s"] / b[epoch]["images"])
                for a, b in zip(first, second)
            ]
            report.setdefault("ratios", []).append(ratios)
            print(f"  epoch {epoch}: first / second, per round: " + ", ".join(f"{r:.3f}" for r in ratios))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
