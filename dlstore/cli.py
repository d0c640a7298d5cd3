"""`dlstore` — one command with subcommands.

Each subcommand is a `_add_<name>(subparsers)` function that registers its parser and
sets `func`; the library does the work, this module only owns the terminal.

    dlstore ls swift://imagenet/train --long
    dlstore cp ./shard-000000.tar s3://bucket/train/
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from dlstore.cache import cache_report, clear_cache
from dlstore.config import DataConfig, format_size, parse_size, writable_file
from dlstore.convert import ConvertOptions, ConvertProgress, convert, index_dataset, verify_dataset
from dlstore.doctor import add_doctor_arguments, exit_code, format_check, options_from_args, run_doctor
from dlstore.errors import ConfigError, DlstoreError, StoppedBySignal
from dlstore.format.checksums import ALGORITHMS, DEFAULT_ALGORITHM
from dlstore.format.manifest import MANIFEST_NAME, describe_dataset
from dlstore.logs import configure_logging, printable
from dlstore.storage import open_object, open_store
from dlstore.storage.transfer import copy_object
from dlstore.train.config import add_train_arguments, config_from_args
from dlstore.train.signals import EXIT_PREEMPTED

__all__ = ["main"]


@contextlib.contextmanager
def _progress_bar(**options) -> Iterator[tqdm]:
    """A tqdm bar with log lines written above it, each on its own line (a warning was glued
    onto the end of the bar's line). None on a stderr that is no terminal (a log file got a
    carriage-return update for every step), unless turned off anyway (`disable=True`)."""
    options["disable"] = True if options.get("disable") else None
    with logging_redirect_tqdm(), tqdm(**options) as bar:
        yield bar


# -- ls ------------------------------------------------------------------------------------
def _cmd_ls(args: argparse.Namespace) -> int:
    store = open_store(args.url)
    if not args.objects and not args.prefix and store.exists(MANIFEST_NAME):
        print(describe_dataset(store))
        return 0
    count = total = 0
    for info in store.list(args.prefix or ""):
        count += 1
        total += info.size
        key = printable(info.key)
        print(f"{info.size:>14}  {key}" if args.long else key, flush=count % 1000 == 0)
    if not count and not args.prefix and (info := _the_object_at(args.url)) is not None:
        # `ls` of an object shows it, as `ls` of a file does; its store (the URL's parent) lists
        # nothing under the URL itself.
        count, total = 1, info.size
        print(f"{info.size:>14}  {printable(info.key)}" if args.long else printable(info.key))
    if args.long:
        print(f"{count} object{'' if count == 1 else 's'}, {format_size(total)}", file=sys.stderr)
    elif not count:  # an empty listing looks like a hang or a typo otherwise
        under = f"{store.url} (keys starting {args.prefix!r})" if args.prefix else store.url
        print(f"no objects under {under}", file=sys.stderr)
    return 0


def _the_object_at(url: str):
    """The object the URL names, or None (no such object, or a URL that names none)."""
    try:
        store, key = open_object(url)
        return store.stat(key) if key else None
    except DlstoreError:
        return None


def _add_ls(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ls", help="list objects under a URL, or summarise a dataset's manifest")
    p.add_argument("url", help="store URL, e.g. swift://container/prefix, s3://bucket/prefix, file:///path")
    p.add_argument("prefix", nargs="?", help="only keys starting with this")
    p.add_argument("-l", "--long", action="store_true", help="sizes and a total")
    p.add_argument("--objects", action="store_true", help="list objects even when the URL holds a dataset manifest")
    p.set_defaults(func=_cmd_ls)


# -- cp ------------------------------------------------------------------------------------
def _cmd_cp(args: argparse.Namespace) -> int:
    src_store, src_key = open_object(args.src)
    info = src_store.stat(src_key)
    with _progress_bar(total=info.size, unit="B", unit_scale=True, desc=src_key, disable=args.quiet) as bar:
        copy_object(src_store, src_key, args.dst, progress=bar.update)
    return 0


def _add_cp(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cp", help="copy one object between any two URLs (streaming)")
    p.add_argument("src", help="source object URL or local path")
    p.add_argument("dst", help="destination object URL, or a URL ending in / to keep the name")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_cp)


# -- cache ---------------------------------------------------------------------------------
def _cmd_cache_stats(args: argparse.Namespace) -> int:
    report = cache_report(args.dir)
    if args.json:
        print(json.dumps(dataclasses.asdict(report), indent=2))
        return 0
    totals = report.totals
    lookups = totals.hits + totals.misses
    rows = [
        ("cache", report.cache_dir),
        ("shards", f"{report.files}"),
        ("bytes", format_size(report.bytes)),
        ("limit", format_size(report.limit_bytes) if report.limit_bytes else "unknown"),
        ("in flight", f"{report.in_flight} downloads ({format_size(report.in_flight_bytes)} reserved)"),
        ("hits", f"{totals.hits}" + (f" ({totals.hits / lookups:.1%})" if lookups else "")),
        ("misses", f"{totals.misses}"),
        ("fetched", format_size(totals.bytes_fetched)),
        ("read directly", f"{format_size(totals.bytes_direct)} (cold first batches' samples, not cached)"),
        ("evictions", f"{totals.evictions}"),
        ("corrupt replaced", f"{totals.corrupt_replaced}"),
        ("wait", f"{totals.wait_time_s:.1f} s"),
        ("connections", f"{totals.max_connections} at most at once in one process"),
    ]
    for label, value in rows:
        print(f"{label:<18}{value}")
    if report.epochs:
        print("\nper epoch (as the readers said which epoch they read)")
        print(f"{'epoch':>7}  {'fetched':>10}  {'shards':>7}  {'hits':>9}")
        for epoch, stats in report.epochs.items():
            print(f"{epoch:>7}  {format_size(stats.bytes_fetched):>10}  {stats.misses:>7}  {stats.hits:>9}")
    return 0


def _cmd_cache_clear(args: argparse.Namespace) -> int:
    result = clear_cache(args.dir, reset_stats=args.reset_stats)
    print(f"removed {result.removed} shards ({format_size(result.removed_bytes)}) from {args.dir}")
    if result.skipped_held:
        print(
            f"kept {result.skipped_held} shards ({format_size(result.skipped_bytes)}) that readers hold; "
            "run again once they finish",
            file=sys.stderr,
        )
    return 0


def _add_cache(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cache", help="inspect or empty a node-local shard cache")
    actions = p.add_subparsers(dest="cache_action", required=True, metavar="ACTION")
    stats = actions.add_parser(
        "stats", help="files, bytes, limit and counters summed over all processes, in all and per epoch"
    )
    stats.add_argument("dir", help="the cache directory (the dataset's cache_dir)")
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    stats.set_defaults(func=_cmd_cache_stats)
    clear = actions.add_parser("clear", help="remove every shard no reader holds (safe while in use)")
    clear.add_argument("dir", help="the cache directory (the dataset's cache_dir)")
    clear.add_argument("--reset-stats", action="store_true", help="also zero the counters")
    clear.set_defaults(func=_cmd_cache_clear)


# -- convert, verify, index ----------------------------------------------------------------
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
    with _progress_bar(desc="convert", unit=" img", disable=args.quiet, dynamic_ncols=True) as bar:

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
    with _progress_bar(desc="verify", unit=" shards", disable=args.quiet, dynamic_ncols=True) as bar:

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
    with _progress_bar(desc="index", unit=" shards", disable=args.quiet, dynamic_ncols=True) as bar:

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
    """`--format`, which only arrays of pixels (cifar10, mnist) take: given for image files it
    was accepted and ignored (the manifest then said `image_format=png` of a dataset of JPEGs)."""
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


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_ls, _add_cp]
SUBCOMMANDS.append(_add_cache)
SUBCOMMANDS += [_add_convert, _add_verify, _add_index]


# -- train ---------------------------------------------------------------------------------
def _cmd_train(args: argparse.Namespace) -> int:
    # The trainer pulls in torch (and torchvision): loaded only for this command.
    from dlstore.train import main as train

    if args.verbose == 0:
        logging.getLogger("dlstore.train").setLevel(logging.INFO)  # checkpoints and eval results
    return train(config_from_args(args))


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a torchvision model from a dataset URL (DDP under torchrun or srun), checkpointing to a store URL",
        description="Exit codes: 0 done, 75 stopped by SIGTERM/SIGUSR1 after a checkpoint (rerun with --resume auto).",
    )
    add_train_arguments(p)
    p.set_defaults(func=_cmd_train)


SUBCOMMANDS.append(_add_train)


# -- demo ----------------------------------------------------------------------------------
def _cmd_demo(args: argparse.Namespace) -> int:
    # The demo trains a model, so it pulls in torch: loaded only for this command.
    from dlstore.demo import DemoConfig, run_demo

    run_demo(
        DemoConfig(workdir=args.workdir or "", store_url=args.store or "", epochs=args.epochs, train=not args.no_train)
    )
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the main job on generated data in a local store: convert, verify, load, train")
    p.add_argument("--workdir", help="keep everything here (default: a temporary folder, removed afterwards)")
    p.add_argument("--store", help="store URL for the shards (default: file://WORKDIR/store)")
    p.add_argument("--epochs", type=int, default=2, help="epochs of the demo's training run (default 2)")
    p.add_argument(
        "--no-train",
        action="store_true",
        help="no training run: convert, verify and load, then the loader-vs-demand verdict (which still times"
        " the model's own speed on synthetic data)",
    )
    p.set_defaults(func=_cmd_demo)


SUBCOMMANDS.append(_add_demo)


# -- bench ---------------------------------------------------------------------------------
# Data settings the bench sweeps (batch sizes, workers) or keeps apart (its own temporary cache).
_BENCH_OWN = ("batch_size", "workers", "cache_dir", "cache_limit")


def _cmd_bench(args: argparse.Namespace) -> int:
    # dlstore.bench pulls in torch: loaded only for this command, so the others start quickly.
    from dlstore.bench import (
        QUICK_DATA,
        BenchConfig,
        check_plot_path,
        format_report,
        parse_int_list,
        plot_report,
        run_bench,
        size_or_auto,
    )

    # The data settings, from their flags and the environment (read here, once).
    data = DataConfig.from_args(args.url, args, exclude=_BENCH_OWN, **(QUICK_DATA if args.quick else {}))
    changes: dict = {}
    for name, parse in (("batch_sizes", parse_int_list), ("workers", parse_int_list), ("procs", parse_int_list)):
        if getattr(args, name) is not None:
            changes[name] = parse(getattr(args, name))
    if args.engines is not None:
        changes["engines"] = tuple(part.strip() for part in args.engines.split(",") if part.strip())
    for name in ("batches", "stage_batches", "model", "device", "amp", "demand_steps"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.cache_limit is not None:
        changes["cache_limit"] = size_or_auto(args.cache_limit)
    changes.update(
        channels_last=not args.no_channels_last,
        compile=args.compile,
        demand=not args.no_demand,
        cache_dir=args.cache_dir or "",
    )
    config = BenchConfig.quick(data, **changes) if args.quick else BenchConfig(data, **changes)
    if args.json:  # before the run: a path that cannot be written lost its results to a traceback
        writable_file(args.json, "--json")
    if args.plot:
        check_plot_path(args.plot)
    if not args.quiet:
        logging.getLogger("dlstore.bench").setLevel(logging.INFO)  # what is being measured, as it goes
    report = run_bench(config)
    print(format_report(report))
    if args.json:
        report.write_json(args.json)
        print(f"wrote {args.json}")
    if args.plot:
        plot_report(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="can the data path feed the GPU? loader img/s (cold/warm, by stage) vs the model's training rate",
        description="Loader img/s and MB/s from a cold and a warm cache with the time split by stage, the "
        "model's training-step rate on synthetic data, and the verdict: delivered / demanded, the data stall "
        "to expect, and what would help. Example: dlstore bench swift://imagenet/train --batch-sizes 128,256 "
        "--workers 4,8 --json bench.json --plot bench.png",
    )
    p.add_argument("url", help="dataset URL (where index.json is)")
    p.add_argument("--quick", action="store_true", help="a few seconds: batch 32, 64 px, resnet18, 6 batches per pass")
    p.add_argument("--batch-sizes", metavar="N,N", help="batch sizes to sweep (default 256; --quick 32)")
    p.add_argument("--workers", metavar="N,N", help="worker counts to sweep (default: one per core)")
    p.add_argument("--procs", metavar="N,N", help="process counts for a scaling table, e.g. 1,2,4 (default: none)")
    p.add_argument(
        "--engines",
        metavar="E,E",
        help="loader engines each worker count runs on: auto (default: what the trainer gets), or threads,processes "
        "to see which is faster here",
    )
    p.add_argument("--batches", type=int, help="batches per timed loader pass (default 20; --quick 6)")
    p.add_argument("--stage-batches", type=int, help="batches of the per-stage timing pass (default 2)")
    p.add_argument("--model", help="torchvision model for the demand side (default resnet50; --quick resnet18)")
    p.add_argument("--device", help="auto (default), cuda, cuda:N or cpu")
    p.add_argument("--amp", choices=["auto", "bf16", "fp16", "none"], help="precision (default auto: bf16 on GPUs)")
    p.add_argument("--no-channels-last", action="store_true", help="NCHW-contiguous model and images")
    p.add_argument("--compile", action="store_true", help="torch.compile the model for the demand side")
    p.add_argument("--demand-steps", type=int, help="timed training steps (default 20 on a GPU, 3 on a CPU)")
    p.add_argument("--no-demand", action="store_true", help="measure the loader only")
    p.add_argument("--cache-dir", help="where the bench's temporary cache goes (default: the system temp dir)")
    p.add_argument("--cache-limit", help="its size limit (default: enough for the dataset)")
    p.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot img/s vs workers/batch size with the demand line")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    # The data settings (--image-size, --transform, --decode-on, --seed, ...), as `dlstore train`
    # takes them; batch sizes, workers and the cache are the bench's own sweeps and cache above.
    DataConfig.add_arguments(p, exclude=_BENCH_OWN)
    p.set_defaults(func=_cmd_bench)


SUBCOMMANDS.append(_add_bench)


# -- doctor --------------------------------------------------------------------------------
def _cmd_doctor(args: argparse.Namespace) -> int:
    checks = run_doctor(options_from_args(args), dict(os.environ), report=lambda c: print(format_check(c), flush=True))
    return exit_code(checks)


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this node's set-up for a run (credentials, store, cache, /dev/shm, torch, CUDA, launcher)",
        description="One line per check (ok / warn / FAIL) with the fix below; exit code 1 when anything FAILs.",
    )
    add_doctor_arguments(p)
    p.set_defaults(func=_cmd_doctor)


SUBCOMMANDS.append(_add_doctor)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlstore", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    _verbose_after_the_subcommand_too(sub)
    return parser


def _verbose_after_the_subcommand_too(sub: argparse._SubParsersAction) -> None:
    """`dlstore ls -v URL` as well as `dlstore -v ls URL`: `-v` after a subcommand was an
    "unrecognized arguments" error. (Absent there, it leaves the count given before.)"""
    for command in sub.choices.values():
        command.add_argument(
            "-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more log output (-vv for debug)"
        )
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                _verbose_after_the_subcommand_too(action)


#: Signals that end a command as Ctrl-C does: SIGTERM (`timeout`, `kill`, a batch system) and
#: SIGUSR1 (Slurm's `--signal` warning before the time limit), whose default actions kill.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@contextlib.contextmanager
def _ending_cleanly_on_stop_signals() -> Iterator[None]:
    """A stop signal ends a command as Ctrl-C does, through its `finally` blocks, with a word:
    convert's workers stopped and its temp folder removed, half-written objects deleted. By
    default it killed the process where it stood, silently. `train` installs its own handlers
    over these (a checkpoint first). The previous handlers are back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ours = [sig for sig in _STOP_SIGNALS if signal.getsignal(sig) == signal.SIG_DFL]
    for sig in ours:
        signal.signal(sig, _stop)
    try:
        yield
    finally:
        for sig in ours:
            signal.signal(sig, signal.SIG_DFL)


def _stop(signum: int, frame: object) -> None:
    raise StoppedBySignal(signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    with _ending_cleanly_on_stop_signals():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args) or 0)
    except DlstoreError as exc:
        print(f"dlstore {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dlstore {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except StoppedBySignal as stop:
        print(f"dlstore {args.command}: stopped by {stop}", file=sys.stderr)
        return EXIT_PREEMPTED if args.command == "train" else 128 + stop.signum
    except BrokenPipeError:  # `dlstore ls ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
