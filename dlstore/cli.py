"""`dlstore` — one command with subcommands.

Each subcommand is a `_add_<name>(subparsers)` function that registers its parser and
sets `func`; the library does the work, this module only owns the terminal.

    dlstore ls swift://imagenet/train --long
    dlstore cp ./shard-000000.tar s3://bucket/train/
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from dlstore.errors import DlstoreError

__all__ = ["main"]


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


# -- ls ------------------------------------------------------------------------------------
def _cmd_ls(args: argparse.Namespace) -> int:
    from dlstore.storage import open_store

    store = open_store(args.url)
    if not args.objects and not args.prefix:
        from dlstore.manifest import MANIFEST_NAME, describe_dataset

        if store.exists(MANIFEST_NAME):
            print(describe_dataset(store))
            return 0
    count = total = 0
    for info in store.list(args.prefix or ""):
        count += 1
        total += info.size
        print(f"{info.size:>14}  {info.key}" if args.long else info.key, flush=count % 1000 == 0)
    if args.long:
        print(f"{count} objects, {_human(total)}", file=sys.stderr)
    return 0


def _add_ls(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ls", help="list objects under a URL, or summarise a dataset's manifest")
    p.add_argument("url", help="store URL, e.g. swift://container/prefix, s3://bucket/prefix, file:///path")
    p.add_argument("prefix", nargs="?", help="only keys starting with this")
    p.add_argument("-l", "--long", action="store_true", help="sizes and a total")
    p.add_argument("--objects", action="store_true", help="list objects even when the URL holds a dataset manifest")
    p.set_defaults(func=_cmd_ls)


# -- cp ------------------------------------------------------------------------------------
def _cmd_cp(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from dlstore.storage import open_object, open_store

    src_store, src_key = open_object(args.src)
    info = src_store.stat(src_key)
    if args.dst.endswith("/") or args.dst.endswith("://"):
        dst_store, dst_key = open_store(args.dst.rstrip("/")), src_key.rsplit("/", 1)[-1]
    else:
        dst_store, dst_key = open_object(args.dst)
    with tqdm(total=info.size, unit="B", unit_scale=True, desc=src_key, disable=args.quiet) as bar:

        def chunks():
            for chunk in src_store.get(src_key):
                bar.update(len(chunk))
                yield chunk

        dst_store.put(dst_key, chunks())
    return 0


def _add_cp(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cp", help="copy one object between any two URLs (streaming)")
    p.add_argument("src", help="source object URL or local path")
    p.add_argument("dst", help="destination object URL, or a URL ending in / to keep the name")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_cp)


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_ls, _add_cp]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlstore", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except DlstoreError as exc:
        print(f"dlstore {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `dlstore ls ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
