"""Running the shard builders. One worker builds in this process; more run in a pool of spawned
worker processes. The first failure stops them all.

How a failing conversion ends. The first error wins, and reaches the caller promptly:

1. The error arrives in this process. It is a worker's, re-raised from its future, or one the
   progress callback raises. Or it is a stop: Ctrl-C, SIGTERM or SIGUSR1. Workers ignore those; this
   process decides.
2. Shards not yet started are cancelled, and the shared `stop` event is set. A running build checks
   it before every sample. It ends through its normal exception path, which removes its half-written
   object. That is the local store's temp file, the temp tar, or an S3 multipart upload.
3. Workers still busy after `_STOP_GRACE_S`, stuck in an upload say, are killed. Then the pool is
   joined, so no worker outlives `convert`, and a resume never races an old worker.

Workers install no Python signal handlers. A handler runs only when the main thread runs Python
code. A worker blocked in a lock would never run one, and the join would hang.

A worker that dies before it starts ends the conversion with an error that says so. The usual cause
is a script calling `convert` without an `if __name__ == "__main__":` guard. A spawned worker
imports the main module, and its own `convert` stops it. The listing reaches the workers through a
file, not their start-up message. A message larger than the pipe's buffer would block this process
for ever, writing to a worker that had died.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.resource_tracker
import os
import pickle
import secrets
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from dlstore.config import writable_dir
from dlstore.convert.build import BuildContext, Built, Counters, ShardBuilder
from dlstore.convert.inputs import Source
from dlstore.convert.options import ConvertOptions
from dlstore.convert.shard_plan import ShardTask
from dlstore.errors import DlstoreError
from dlstore.storage import Store

__all__ = ["build_shards"]

log = logging.getLogger(__name__)

# How long running builds get to notice `stop` before their workers are killed. Between samples
# they notice within one sample. Only a store call, such as an upload riding out retries, is slower.
_STOP_GRACE_S = 10.0
#: What a worker ignores, from its first instruction. A stop reaches the whole process group:
#: Ctrl-C, Slurm's SIGTERM and `--signal` SIGUSR1, `docker stop`. This process decides.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
_PROGRESS_INTERVAL_S = 0.25
_STOP_POLL_S = 0.1

# The builder of this worker process, made by `_start_worker`. The pool sends the context, with
# the whole listing, once per worker. Each task carries only its shard's plan.
_process_builder: ShardBuilder | None = None


def build_shards(
    store: Store,
    source: Source,
    options: ConvertOptions,
    todo: list[ShardTask],
    built: dict[int, Built],
    report: Callable[[Counters], None],
) -> None:
    """Build every shard in `todo` into `built`, calling `report(counters)` after each shard and a
    few times a second. The first error stops the build: a worker's, or one `report` raises. It
    is raised here once every worker has ended."""
    base = options.tmp_dir or tempfile.gettempdir()
    made: list[str] = []  # the folders of --tmp-dir that this run made, in order: removed with it
    # Named before it is made, and made inside the `try`. So a SIGTERM or Ctrl-C landing between
    # the two still finds the `finally` that removes it. The CLI turns SIGTERM into StoppedBySignal.
    tmp_dir: str | None = os.path.join(base, f"dlstore-convert-{secrets.token_hex(6)}")
    try:
        for attempt in (1, 2):
            if options.tmp_dir:
                _make_folders(options.tmp_dir, made)
                writable_dir(options.tmp_dir, "--tmp-dir")  # what could not be made or written, said
            try:
                os.mkdir(tmp_dir, 0o700)
                break
            except FileExistsError:  # another's, 48 random bits alike: not ours to remove
                tmp_dir = None
                raise
            except FileNotFoundError:  # --tmp-dir, made by another convert, removed by it meanwhile
                if attempt == 2 or not options.tmp_dir:
                    raise
        context = BuildContext(store, source, options, tmp_dir)
        if options.workers == 1 or len(todo) <= 1:
            _build_in_process(context, todo, built, report)
        else:
            _build_in_pool(context, todo, built, report)
    finally:
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        for folder in reversed(made):  # deepest first, and only while empty: another convert's may be in it
            with contextlib.suppress(OSError):
                os.rmdir(folder)


def _make_folders(path: str, made: list[str]) -> None:
    """Make the missing folders of `path`, one by one as written; a `..` goes where the file system
    takes it. Each folder this call made is added to `made`. It stops at the first it cannot
    make; `writable_dir` then says why."""
    parts = path.split(os.sep)
    for end in range(1, len(parts) + 1):
        folder = os.sep.join(parts[:end])
        if not folder or not parts[end - 1]:
            continue  # the root, or a doubled separator
        try:
            os.mkdir(folder)
        except FileExistsError:
            continue
        except OSError:
            return
        made.append(folder)


def _build_in_process(
    context: BuildContext, todo: list[ShardTask], built: dict[int, Built], report: Callable[[Counters], None]
) -> None:
    counters = Counters()
    counters.on_add = lambda: report(counters)
    builder = ShardBuilder(context, counters)
    for task in todo:
        built[task.number] = builder.build(task)
        report(counters)


def _start_worker(context: BuildContext, source_path: str, shared: tuple, stop: Any, pids: Any) -> None:
    """Pool initializer: make this worker's builder and send its pid to the parent. The builder's
    source, with the listing, is read from `source_path`. The parent kills a worker only if it is
    stuck. A stop signal reaches the whole process group, but only the parent acts on it, through
    `stop`. So a worker ignores the signals with SIG_IGN, not a Python handler. It is born with
    them blocked (`_stop_signals_blocked_while_workers_start`)."""
    global _process_builder
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked in the parent while it was made
    pids.put(os.getpid())
    with open(source_path, "rb") as file:
        context = dataclasses.replace(context, source=pickle.load(file))
    _process_builder = ShardBuilder(context, Counters(shared), stop)


def _without_listing(context: BuildContext) -> tuple[BuildContext, str]:
    """The context without its listing, and the file in its temp dir that holds the source with its
    listing. The inputs and skipped files grow with the dataset."""
    source_path = os.path.join(context.tmp_dir, "source.pickle")
    with open(source_path, "wb") as file:
        pickle.dump(context.source, file, protocol=pickle.HIGHEST_PROTOCOL)
    light = dataclasses.replace(context.source, items=[], skipped=[])
    return dataclasses.replace(context, source=light), source_path


def _build_in_worker(task: ShardTask) -> Built:
    if _process_builder is None:
        raise DlstoreError("a convert worker ran a shard before its initializer")
    return _process_builder.build(task)


def _build_in_pool(
    context: BuildContext, todo: list[ShardTask], built: dict[int, Built], report: Callable[[Counters], None]
) -> None:
    # spawn, not fork: a fork would copy the parent's threads mid-state, such as progress bar and store clients.
    ctx = multiprocessing.get_context("spawn")
    pending: set[Future] = set()
    pool: ProcessPoolExecutor | None = None
    try:
        # Stops are only noted from here on. One raised while a semaphore is made could land between
        # its registration with the resource tracker and the finalizer that unregisters it. That
        # leaks the semaphore. The pool's queues, `shared` and `stop` all make semaphores.
        with _StopsAtSafePoints() as stops:
            _start_resource_tracker()
            shared = (ctx.Value("q", 0), ctx.Value("q", 0))
            counters = Counters(shared)
            stop, pids = ctx.Event(), ctx.SimpleQueue()
            workers = min(context.options.workers, len(todo))
            light, source_path = _without_listing(context)
            pool = ProcessPoolExecutor(
                workers, ctx, initializer=_start_worker, initargs=(light, source_path, shared, stop, pids)
            )
            try:
                stops.act()  # a stop while the pool was made: no worker is started
                with _stop_signals_blocked_while_workers_start():
                    pending = {pool.submit(_build_in_worker, task) for task in todo}  # the workers start here
                while pending:
                    stops.act()
                    done, pending = wait(pending, timeout=_PROGRESS_INTERVAL_S, return_when=FIRST_COMPLETED)
                    for future in done:
                        finished = future.result()  # re-raises a worker's error here
                        built[finished.number] = finished
                        report(counters)
                    report(counters)
                stops.act()  # one noted during the last wait: the manifest is not written
            except BaseException as exc:
                stop.set()
                _stop_pool(pool, pending, pids, hurry=lambda: bool(stops.received))
                if isinstance(exc, BrokenProcessPool):
                    raise DlstoreError(
                        f"a convert worker process died ({exc}). If it could not start: a script that calls "
                        'convert with workers > 1 needs `if __name__ == "__main__":`, since each worker is a new '
                        "Python that imports the script; otherwise it was killed (out of memory?) or its start-up "
                        "failed (above)"
                    ) from exc
                raise
    finally:
        # Outside the block, a stop while the idle workers are joined interrupts the join. Else a
        # worker stuck in its exit would hold convert until a SIGKILL. A no-op after `_stop_pool`.
        if pool is not None:
            pool.shutdown(wait=True)


class _StopsAtSafePoints:
    """The stop signals, noted while the pool runs and acted on between two waits for it. Acting
    does what the handlers before would have done: Ctrl-C's KeyboardInterrupt, the CLI's
    `StoppedBySignal`. A stop raised inside `concurrent.futures.wait` could land between a lock's
    acquire and its release. A double Ctrl-C would then end in "RuntimeError: release unlocked
    lock". A stop noted after the first asks the clean-up to hurry (`_stop_pool`)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopsAtSafePoints:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._note) for sig in _STOP_SIGNALS}
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        self._restore()
        if exc_type is None:  # a stop noted since the last safe point is taken, not dropped
            self.act()

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _note(self, signum: int, frame: Any) -> None:
        self.received.append(signum)

    def act(self) -> None:
        """Do what the handler before this one did for the first stop noted. A default action is
        taken with that default back in place."""
        if not self.received:
            return
        signum = self.received.pop(0)
        previous = self._previous[signum]
        if callable(previous):
            previous(signum, None)
        elif previous == signal.SIG_DFL:
            self._restore()
            signal.raise_signal(signum)


@contextlib.contextmanager
def _stop_signals_blocked_while_workers_start() -> Iterator[None]:
    """Workers started in this block are deaf to the stop signals from their first instruction.
    Otherwise a stop to the process group while a worker still imports prints a KeyboardInterrupt
    traceback per worker, or kills it. The clean-up of the broken pool then races convert's
    cancelling of its shards. This thread blocks the signals while it starts the workers, and
    they inherit that mask across exec. A signal sent meanwhile waits in a worker until
    `_start_worker` ignores it. This process still takes them, in its other threads or once the
    block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker before anything uses it, with SIGUSR1 blocked. The
    tracker unlinks the pool's semaphores, and keeps that mask. Otherwise Slurm's `--signal`
    SIGUSR1 to the process group would end it, with a traceback per semaphore. It ignores SIGINT
    and SIGTERM itself."""
    if threading.current_thread() is not threading.main_thread():
        multiprocessing.resource_tracker.ensure_running()
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        multiprocessing.resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _stop_pool(
    pool: ProcessPoolExecutor, pending: set[Future], pids: Any, hurry: Callable[[], bool] = lambda: False
) -> None:
    """After a failure: cancel the shards not started, and give the running ones `_STOP_GRACE_S` to
    stop. They see `stop`. Kill the workers still running, at once when `hurry()` says a second
    stop came. Then join the pool."""
    # Cancel here rather than with shutdown(wait=False, cancel_futures=True): `wait` never counts
    # a future the executor cancelled as done, and after that shutdown a second one joins nothing.
    late = {future for future in pending if not future.cancel()}
    deadline = time.monotonic() + _STOP_GRACE_S
    try:
        while late and not hurry() and time.monotonic() < deadline:
            late = wait(late, timeout=_STOP_POLL_S).not_done
    finally:  # also on a Ctrl-C while waiting where no handler of ours notes it
        if late:
            why = "a second stop came" if hurry() else f"they did not stop within {_STOP_GRACE_S:.0f} s"
            log.warning("%d shard build(s) still running: %s; killing the workers", len(late), why)
            _kill_workers(pids)
        pool.shutdown(wait=True)


def _kill_workers(pids: Any) -> None:
    """SIGKILL the pool's live workers. Only children of this process not yet reaped are killed, so
    their pids cannot have been reused. A killed build leaves what it wrote as `kill -9` leaves
    it, such as a hidden temp file in a local store. The next run rebuilds that shard."""
    ours = set()
    while not pids.empty():
        ours.add(pids.get())
    for process in multiprocessing.active_children():
        if process.pid in ours:
            process.kill()
