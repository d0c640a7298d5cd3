"""Pre-emption: SIGTERM (Slurm, Kubernetes) and SIGUSR1 (Slurm's `--signal`) ask the run to
checkpoint and stop; the exit code tells the job script to run it again. Before training has
begun there is nothing to save, and start-up (opening the data, building the model, loading
a checkpoint) ends where it stands."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from dlstore.errors import StoppedBySignal

__all__ = ["EXIT_PREEMPTED", "STOP_SIGNALS", "StopSignals"]

log = logging.getLogger(__name__)

# sysexits' EX_TEMPFAIL: "try again later". A job script (or Slurm's --requeue) reruns the
# same command with `--resume auto` when it sees this code.
EXIT_PREEMPTED = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """Notes a stop signal for the training loop, which acts on it at the next step boundary,
    together with the other ranks.

    >>> signals = StopSignals()
    >>> with signals:           # handlers installed, the previous ones restored on exit
    ...     signals.received is None
    True
    """

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS, *, raise_until_training: bool = False) -> None:
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._depth = 0  # nested `with`s: installed by the outermost
        # Until `training_begins`, a signal raises `StoppedBySignal` where the run stands.
        self._raising = raise_until_training

    def __enter__(self) -> StopSignals:
        if self._depth == 0:
            self.install()
        self._depth += 1
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.restore()

    def training_begins(self) -> None:
        """From here on a signal only notes itself: the loop checkpoints at its next step."""
        self._raising = False

    @property
    def name(self) -> str:
        """The received signal's name, for the log (another rank's when this one got none)."""
        return signal.Signals(self.received).name if self.received else "a signal on another rank"

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("not in the main thread: SIGTERM/SIGUSR1 will not trigger a checkpoint")
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only set a flag: the loop checkpoints at the next step boundary, together with
        # the other ranks. Nothing else is safe to do inside a signal handler.
        self.received = signum
        if self._raising:
            self._raising = False  # a second signal, while start-up unwinds, only notes itself
            raise StoppedBySignal(signum)
