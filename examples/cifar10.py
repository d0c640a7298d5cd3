"""CIFAR-10 end to end: convert to shards in a store, then train a ResNet-18 from the store.

    python examples/cifar10.py --store file:///tmp/cifar10                 # local store, CPU or GPU
    python examples/cifar10.py --store swift://datasets/cifar10            # Swift (OS_* / ST_* set)

    # several GPUs: convert once, then train with torchrun
    python examples/cifar10.py --store s3://bucket/cifar10 --convert-only
    torchrun --nproc-per-node 4 examples/cifar10.py --store s3://bucket/cifar10 --skip-convert

`--source` is a folder holding `cifar-10-batches-py/` or `cifar-10-python.tar.gz` (the
official Python version of the dataset). Without it, torchvision downloads the archive; with
`--synthetic`, a small generated stand-in is used instead (no network needed).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile

from dlstore.logs import configure_logging


def prepare_source(args: argparse.Namespace) -> str:
    if args.source:
        return args.source
    folder = os.path.join(tempfile.gettempdir(), "cifar10-source")
    if args.synthetic:
        from dlstore.demo.datagen import make_cifar10

        make_cifar10(folder, per_batch=1000, test=1000)
    else:
        import torchvision

        torchvision.datasets.CIFAR10(folder, train=True, download=True)  # the official archive, unpacked
    return folder


def convert_splits(source: str, store: str) -> None:
    from dlstore.convert import ConvertOptions, convert

    for split, name in (("train", "train"), ("test", "val")):
        summary = convert("cifar10", source, f"{store}/{name}", ConvertOptions(split=split, shard_size=64 * 10**6))
        print(summary.describe())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="dataset root URL; train/ and val/ go under it")
    parser.add_argument("--source", help="folder with cifar-10-batches-py/ or cifar-10-python.tar.gz")
    parser.add_argument("--synthetic", action="store_true", help="use a small generated stand-in")
    parser.add_argument("--skip-convert", action="store_true", help="the shards are already in --store")
    parser.add_argument("--convert-only", action="store_true", help="convert, do not train")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--checkpoint-url", help="e.g. file:///tmp/cifar10-ckpt or swift://ckpt/cifar10")
    args = parser.parse_args(argv)
    configure_logging(level=logging.INFO)  # dlstore at INFO, the storage SDKs at WARNING

    if not args.skip_convert:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            parser.error("under torchrun, convert first (--convert-only, one process), then train with --skip-convert")
        convert_splits(prepare_source(args), args.store.rstrip("/"))
    if args.convert_only:
        return 0

    from dlstore.config import DataConfig
    from dlstore.train import TrainConfig
    from dlstore.train import main as train

    # CIFAR's native 32 px (the ImageNet stem is kept, as torchvision defines it); the worker
    # count is left to the node's cores per rank.
    data = DataConfig.from_env(f"{args.store.rstrip('/')}/train", image_size=32, batch_size=128)
    config = TrainConfig(
        data,
        val_url=f"{args.store.rstrip('/')}/val",
        model="resnet18",
        epochs=args.epochs,
        base_lr=0.4,
        warmup_epochs=2,
        weight_decay=5e-4,
        checkpoint_url=args.checkpoint_url,
        checkpoint_every_minutes=10,
        resume="auto" if args.checkpoint_url else "none",
        output_dir="runs/cifar10",
    )
    return train(config)


if __name__ == "__main__":
    sys.exit(main())
