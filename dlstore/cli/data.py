"""`dlstore convert`, `verify` and `index`: making and checking datasets."""

from __future__ import annotations

import argparse
import os
import sys
import time

from dlstore.cli.stores import progress_bar
from dlstore.config import format_size, parse_size
from dlstore.convert import ConvertOptions, ConvertProgress, convert, index_dataset, verify_dataset
from dlstore.errors import ConfigError
from dlstore.format.checksums import ALGORITHMS, DEFAULT_ALGORITHM
from dlstore.logs import printable

__all__ = ["DATA_COMMANDS"]


def _cmd_convert(args: argparse.Namespace) -> int:
    options = ConvertOptions(
        split=args.split,
        shard_size=parse_size(args.shard_size),
        samples_per_shard=args.samples_per_shard,
        resize_max_side=args.resize_max_side,
        quality=args.quality,
        image_format=_array_image_format(args),
        keep_format=args.keep_format,
        val_labels=args.val_labels,
        metadata=not args.no_json,
        seed=args.seed,
        shuffle=not args.no_shuffle,
        strict=args.strict,
        workers=args.workers,
        prefix=args.prefix,
        tmp_dir=args.tmp_dir,
        overwrite=args.overwrite,
        rehash_existing=args.rehash_existing,
        checksum_algorithm=args.checksum,
        check_decode=not args.no_check_decode,
    )
    started = time.monotonic()
    with progress_bar(desc="convert", unit=" img", disable=args.quiet, dynamic_ncols=True) as bar:

        def on_progress(p: ConvertProgress) -> None:
            bar.total = p.samples_total
            bar.update(p.samples_done - bar.n)
            rate = p.bytes_done / max(time.monotonic() - started, 1e-6) / 1e6
            bar.set_postfix_str(f"{p.shards_done}/{p.shards_total} shards, {rate:.1f} MB/s", refresh=False)

        summary = convert(args.source_format, args.src, args.dest, options, progress=on_progress)
    print(summary.describe())
    return 0


def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert ImageNet, ImageFolder, CIFAR-10 or MNIST into tar shards in a store",
        epilog="DEST's Swift container or S3 bucket is created when it does not exist (as `swift upload` and "
        "rclone do); if the credentials may not create it, the error says how to: `swift post CONTAINER` or "
        "`aws s3 mb s3://BUCKET --endpoint-url URL`.",
    )
    p.add_argument(
        "source_format",
        metavar="FORMAT",
        choices=["imagenet", "imagefolder", "cifar10", "mnist"],
        help="imagenet, imagefolder, cifar10 or mnist",
    )
    p.add_argument("src", help="the source: a folder, or an ILSVRC2012 tar / cifar-10-python.tar.gz")
    p.add_argument(
        "dest", help="dataset URL to write, e.g. swift://imagenet/train, s3://bucket/cifar/train, file:///data/x"
    )
    p.add_argument(
        "--split",
        help="imagenet: train (default) or val; cifar10/mnist: train (default) or test; imagefolder: a sub-folder",
    )
    p.add_argument("--shard-size", default="256MB", help="target shard size (default 256MB)")
    p.add_argument("--samples-per-shard", type=int, help="also cut shards at this many samples")
    p.add_argument("--resize-max-side", type=int, metavar="N", help="store JPEGs whose longer side is at most N pixels")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality for re-encoded images (default 90)")
    p.add_argument(
        "--format",
        dest="image_format",
        choices=["png", "jpeg"],
        default=None,
        help="cifar10/mnist: how to store images (default png)",
    )
    p.add_argument(
        "--keep-format",
        action="store_true",
        help="imagefolder: store PNG/WebP/... as they are instead of re-encoding as JPEG",
    )
    p.add_argument(
        "--val-labels",
        metavar="FILE",
        help="imagenet: ground truth for flat val images (LOC_val_solution.csv or '<file> <wnid>' lines)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="processes encoding and writing shards (default: all CPUs)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the global shuffle before sharding (default 0)")
    p.add_argument("--no-shuffle", action="store_true", help="keep the sorted input order")
    p.add_argument("--no-json", action="store_true", help="no per-sample .json (source path and class name)")
    p.add_argument("--strict", action="store_true", help="fail on the first unreadable image instead of skipping it")
    p.add_argument(
        "--no-check-decode",
        action="store_true",
        help="store JPEGs without decoding them (faster; the loader then checks each sample's rows once per node)",
    )
    p.add_argument("--prefix", default="shard", help="shard name prefix: PREFIX-000000.tar (default shard)")
    p.add_argument(
        "--tmp-dir", help="where workers stage shards (at most one shard per worker; default: the system temp dir)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a dataset made with other options at DEST")
    p.add_argument(
        "--rehash-existing", action="store_true", help="when resuming, re-read kept shards and check their checksums"
    )
    _add_checksum_option(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_convert)


def _cmd_verify(args: argparse.Namespace) -> int:
    with progress_bar(desc="verify", unit=" shards", disable=args.quiet, dynamic_ncols=True) as bar:

        def on_progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        report = verify_dataset(args.url, deep=args.deep, workers=args.workers, progress=on_progress)
    for problem in report.problems:
        print(printable(problem))  # names from the manifest and the tars: one line each, no escapes
    what = "every sample decoded, labels and counts checked" if report.deep else "sizes and checksums"
    if report.ok:
        print(f"OK: {report.shards} shards, {report.samples:,} samples, {format_size(report.bytes)} ({what})")
        return 0
    print(f"{report.url}: {len(report.problems)} problem(s)", file=sys.stderr)
    return 1


def _add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check a dataset's shards against its manifest (exit 1 on any mismatch)")
    p.add_argument("url", help="dataset URL (where index.json is)")
    p.add_argument("--deep", action="store_true", help="also decode every sample and check labels, counts and indexes")
    p.add_argument("--workers", type=int, default=4, help="shards checked at once (default 4)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_verify)


def _cmd_index(args: argparse.Namespace) -> int:
    with progress_bar(desc="index", unit=" shards", disable=args.quiet, dynamic_ncols=True) as bar:

        def on_progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        manifest = index_dataset(
            args.url,
            label_field=args.label_field,
            workers=args.workers,
            progress=on_progress,
            checksum_algorithm=args.checksum,
            overwrite=args.overwrite,
        )
    print(
        f"indexed {len(manifest.shards)} shards, {manifest.total_samples:,} samples, "
        f"{manifest.num_classes} classes, fields {', '.join(manifest.fields)}; wrote index.json"
    )
    return 0


def _add_index(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("index", help="write sample indexes and index.json for WebDataset shards made by other tools")
    p.add_argument("url", help="URL of the folder/prefix holding the .tar shards")
    p.add_argument("--label-field", help="member holding the integer label (default cls)")
    p.add_argument("--workers", type=int, default=4, help="shards indexed at once (default 4)")
    _add_checksum_option(p)
    p.add_argument(
        "--overwrite", action="store_true", help="replace .idx files beside the shards that are not dlstore's"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_index)


def _array_image_format(args: argparse.Namespace) -> str:
    """`--format`, which only arrays of pixels take: cifar10 and mnist."""
    if args.image_format is not None and args.source_format not in ("cifar10", "mnist"):
        raise ConfigError(
            f"--format is for cifar10 and mnist (their images are encoded here); {args.source_format} keeps "
            "its files' formats, re-encoding only what is not JPEG (--keep-format keeps them all)"
        )
    return args.image_format or "png"


def _add_checksum_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checksum",
        choices=sorted(ALGORITHMS),
        default=None,
        help=f"the shards' checksums: {DEFAULT_ALGORITHM} (fast) or sha256 (where a pinned manifest must vouch "
        f"for every byte); default: those of the dataset already there, else {DEFAULT_ALGORITHM}",
    )


DATA_COMMANDS = [_add_convert, _add_verify, _add_index]
