"""`dlstore` — one command with subcommands.

Each subcommand is an `_add_<name>(subparsers)` function that registers its parser and sets
`func`. The library does the work; this package only owns the terminal.

    dlstore ls swift://imagenet/train --long
    dlstore cp ./shard-000000.tar s3://bucket/train/
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator, Sequence

from dlstore.cli.apps import APP_COMMANDS
from dlstore.cli.data import DATA_COMMANDS
from dlstore.cli.stores import STORE_COMMANDS
from dlstore.errors import DlstoreError, StoppedBySignal
from dlstore.logs import configure_logging
from dlstore.train.signals import EXIT_PREEMPTED

__all__ = ["SUBCOMMANDS", "build_parser", "main"]

SUBCOMMANDS = [*STORE_COMMANDS, *DATA_COMMANDS, *APP_COMMANDS]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlstore", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    _verbose_after_the_subcommand_too(sub)
    return parser


def _verbose_after_the_subcommand_too(sub: argparse._SubParsersAction) -> None:
    """`-v` after a subcommand as well as before it: `dlstore ls -v URL`.

    Absent after it, the count given before stands.
    """
    for command in sub.choices.values():
        command.add_argument(
            "-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more log output (-vv for debug)"
        )
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                _verbose_after_the_subcommand_too(action)


#: Signals that end a command as Ctrl-C does. SIGTERM comes from `timeout`, `kill` or a batch
#: system, SIGUSR1 from Slurm's `--signal` before the time limit. By default both kill.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@contextlib.contextmanager
def _ending_cleanly_on_stop_signals() -> Iterator[None]:
    """A stop signal ends a command as Ctrl-C does: through its `finally` blocks, with a word.

    So convert's workers stop, its temp folder goes, and half-written objects are deleted.
    `train` installs its own handlers over these. The previous handlers are back afterwards.
    """
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
