"""`dlstore ls`, `cp` and `cache`, and the progress bar every command shows."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Iterator

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from dlstore.cache import cache_report, clear_cache
from dlstore.config import format_size
from dlstore.errors import DlstoreError
from dlstore.format.manifest import MANIFEST_NAME, describe_dataset
from dlstore.logs import printable
from dlstore.storage import open_object, open_store
from dlstore.storage.transfer import copy_object

__all__ = ["STORE_COMMANDS", "progress_bar"]


@contextlib.contextmanager
def progress_bar(**options) -> Iterator[tqdm]:
    """A tqdm bar with log lines written above it, each on its own line.

    There is no bar on a stderr that is no terminal, nor with `disable=True`.
    """
    options["disable"] = True if options.get("disable") else None
    with logging_redirect_tqdm(), tqdm(**options) as bar:
        yield bar


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
        # `ls` of an object shows it, as `ls` of a file does.
        count, total = 1, info.size
        print(f"{info.size:>14}  {printable(info.key)}" if args.long else printable(info.key))
    if args.long:
        print(f"{count} object{'' if count == 1 else 's'}, {format_size(total)}", file=sys.stderr)
    elif not count:  # an empty listing looks like a hang or a typo otherwise
        under = f"{store.url} (keys starting {args.prefix!r})" if args.prefix else store.url
        print(f"no objects under {under}", file=sys.stderr)
    return 0


def _the_object_at(url: str):
    """The object the URL names, or None."""
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


def _cmd_cp(args: argparse.Namespace) -> int:
    src_store, src_key = open_object(args.src)
    info = src_store.stat(src_key)
    with progress_bar(total=info.size, unit="B", unit_scale=True, desc=src_key, disable=args.quiet) as bar:
        copy_object(src_store, src_key, args.dst, progress=bar.update)
    return 0


def _add_cp(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cp", help="copy one object between any two URLs (streaming)")
    p.add_argument("src", help="source object URL or local path")
    p.add_argument("dst", help="destination object URL, or a URL ending in / to keep the name")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_cp)


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


STORE_COMMANDS = [_add_ls, _add_cp, _add_cache]
