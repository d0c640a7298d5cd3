"""Pre-emption: SIGTERM and SIGUSR1 ask the run to checkpoint and stop.

Slurm and Kubernetes send SIGTERM, Slurm's `--signal` SIGUSR1. The exit code tells the job
script to run it again. Before training there is nothing to save: start-up ends where it stands."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from dlstore.errors import StoppedBySignal

__all__ = ["EXIT_PREEMPTED", "STOP_SIGNALS", "StopSignals"]

log = logging.getLogger(__name__)

# sysexits' EX_TEMPFAIL: "try again later". A job script or Slurm's --requeue reruns the
# same command with `--resume auto` when it sees this code.
EXIT_PREEMPTED = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
#: How long a stop during start-up may wait for the main thread to take it.
START_UP_STOP_GRACE_S = 10.0


class StopSignals:
    """Notes a stop signal; the loop acts on it at the next step boundary, with the other ranks.

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
        # Until `note_only`, a signal raises `StoppedBySignal` where the run stands.
        self._raising = raise_until_training
        self._wakeup: tuple[int, int] | None = None  # (read, write) of the start-up watch's pipe
        self._previous_wakeup = -1

    def __enter__(self) -> StopSignals:
        if self._depth == 0:
            self.install()
        self._depth += 1
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.restore()

    def note_only(self) -> None:
        """From here on a signal only notes itself; the training loop calls this as it begins.
        The loop checkpoints at its next step, and clean-up is never cut short by a signal."""
        self._raising = False
        self._stop_watching_start_up()

    @property
    def name(self) -> str:
        """The received signal's name for the log, or another rank's when this one got none."""
        return signal.Signals(self.received).name if self.received else "a signal on another rank"

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("not in the main thread: SIGTERM/SIGUSR1 will not trigger a checkpoint")
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        if self._raising:
            self._watch_start_up()

    def restore(self) -> None:
        self._stop_watching_start_up()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _watch_start_up(self) -> None:
        """End a start-up held in C++ that does not take a stop within `START_UP_STOP_GRACE_S`.

        A handler runs only once the main thread is back in Python. So a thread hears the
        signal through Python's wakeup pipe, and ends the process with `EXIT_PREEMPTED`."""
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            self._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:  # not the main thread: handlers are not ours either
            os.close(read)
            os.close(write)
            return
        self._wakeup = (read, write)
        threading.Thread(
            target=self._await_start_up_stop, args=(read,), name="dlstore-start-up-stop", daemon=True
        ).start()

    def _stop_watching_start_up(self) -> None:
        if self._wakeup is None:
            return
        read, write = self._wakeup
        self._wakeup = None
        signal.set_wakeup_fd(self._previous_wakeup)
        os.close(write)  # the thread reads the end of the pipe and ends; it closes `read`

    def _await_start_up_stop(self, read: int) -> None:
        try:
            while True:
                data = os.read(read, 64)
                if not data:
                    return  # start-up is over
                stops = [number for number in data if number in self.signals]
                if not stops:
                    continue  # another signal, a worker's SIGCHLD say
                deadline = time.monotonic() + START_UP_STOP_GRACE_S
                while self._raising and time.monotonic() < deadline:
                    time.sleep(0.05)
                if self._raising:  # still held in a call no signal handler can interrupt
                    name = signal.Signals(stops[0]).name
                    os.write(
                        2,
                        f"dlstore train: stopped by {name} during start-up, in a call that cannot be interrupted "
                        f"(the rendezvous, a collective): nothing to save; run it again (exit {EXIT_PREEMPTED})\n".encode(),
                    )
                    os._exit(EXIT_PREEMPTED)
        except OSError:
            return
        finally:
            os.close(read)

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only set a flag: the loop checkpoints at the next step boundary, together with
        # the other ranks. Nothing else is safe to do inside a signal handler.
        self.received = signum
        if self._raising:
            self._raising = False  # a second signal, while start-up unwinds, only notes itself
            raise StoppedBySignal(signum)
