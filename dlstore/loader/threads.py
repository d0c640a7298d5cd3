"""The thread engine: decode threads in the training process build batches in plan order.

Why threads: JPEG decode and the resize release the GIL. So threads do the work of worker
processes without their costs. Processes need a fork of a threaded process, which can inherit
a held lock. Each also needs a torch import, shared memory and a pickled hand-off per batch.

Where threads lost: beside a GPU training loop, whose Python shares the GIL with them. Each
time a thread takes the GIL back it may wait for the loop's switch interval (5 ms). So on a
warm batch's path nothing lets go of the GIL but the C that builds the rows: no numpy sort, no
torch call, no system call. The modules that avoid one point here. Where C builds the rows
(`builds_rows_natively`), `RowWorkers` threads that never take the GIL do it.

How: each batch is cut into `threads` chunks of consecutive samples. A pool thread reads a
chunk's samples from the node cache (`SamplePath.row_jobs`). The row workers draw each JPEG's
crop, decode, resize and flip it straight into its row of the batch's buffer. A
finishing thread marks them and takes what C turned down (`SamplePath.images_done`). Without
the C part a pool thread does it all (`SamplePath.images`). Every thread builds the first batch
at once; later batches queue behind it. The loop takes batch `j` when its chunks are done; by
then `j+1 .. j+lookahead` are queued.

Why our own pool: SPDL and `torchdata.nodes` cost more CPU per image through per-sample
hand-offs. Neither gives what this engine needs. SPDL drops a sample whose stage raises.
Neither resumes from our plan's epoch and history, and torchdata has no `close()`.
"""

from __future__ import annotations

import concurrent.futures as futures
import logging
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from dlstore.dataset import Dataset
from dlstore.errors import raise_if_exiting
from dlstore.format.shards import release_views
from dlstore.loader.config import LoaderConfig
from dlstore.loader.row_workers import RowWorkers
from dlstore.loader.slots import BatchSlots, HandedBuffers
from dlstore.sample_path import BatchRequest
from dlstore.transforms import builds_rows_natively, crop_params

__all__ = ["ThreadEngine"]

log = logging.getLogger(__name__)

# How long close() waits for chunks already running; a batch's decode takes well under it.
_CLOSE_GRACE_S = 1.0


@dataclass
class _Row:
    """One sample: its image went into its buffer row, or `image` holds its JPEG. None: corrupt."""

    label: int
    key: str | None
    padding: bool
    image: object = None


@dataclass
class _Job:
    request: BatchRequest
    images: torch.Tensor | None  # the buffer rows are written into; None for device decode
    slot: int | None
    chunks: list[futures.Future]


class ThreadEngine:
    """Batches of an epoch from a pool of decode threads, in plan order."""

    def __init__(self, dataset: Dataset, cfg: LoaderConfig, slots: BatchSlots | None) -> None:
        self.dataset = dataset
        self.path = dataset.samples
        self.threads = max(1, cfg.num_workers)
        self.lookahead = max(1, cfg.lookahead)
        self.slots = slots
        self.reads = cfg.reads  # whether the run reads an epoch: none starts ahead past the last
        self.handed = HandedBuffers(keep=self.lookahead + 2)
        # Jobs started for the next epoch: ((epoch, history), jobs, batches submitted).
        self._ahead: tuple[tuple, deque[_Job], int] | None = None
        self._pool: futures.ThreadPoolExecutor | None = None  # made at the first batch, again after close()
        self._row_workers: RowWorkers | None = None  # with the pool, where C builds the rows
        self._closes = 0  # close() calls so far: a pass begun before one does not go on
        # Done at each close(): wakes a pass waiting for a batch in another thread.
        self._closed = futures.Future()
        # Chunks close() stopped waiting for. They write into buffers a new pass must not take yet.
        self._stale: list[futures.Future] = []
        self._live: set[futures.Future] = set()  # chunks submitted and not yet done
        # Guards the fields above against a close() from another thread.
        self._guard = threading.Lock()

    @staticmethod
    def slot_count(cfg: LoaderConfig) -> int:
        # Batches being built, plus one handed to the prefetcher and one spare.
        return max(1, cfg.lookahead) + 2

    def batches(self, epoch: int, history: tuple) -> Iterator[dict]:
        """This epoch's batches after `history`, in plan order.

        Leaving early cancels what is queued and waits only for running chunks. Near an epoch's
        end the lookahead runs on into the next epoch, so epochs follow without a pause. After a
        `close()` from another thread, a pass starts nothing more and raises at its next batch."""
        plan = self.dataset.plan(epoch, history)
        with self._guard:
            closes, closed = self._closes, self._closed
            ahead, self._ahead = self._ahead, None
        pending, submitted = self._started_for(ahead, epoch, history)
        try:
            while pending or submitted < plan.num_batches:
                self._check_open(closes)
                while submitted < plan.num_batches and len(pending) <= self.lookahead:
                    request = self.dataset.request(plan, epoch, submitted, fresh_pass=submitted == 0)
                    pending.append(self._submit(request, closes))
                    self.dataset.prefetch_after(plan, submitted)
                    submitted += 1
                if submitted == plan.num_batches and not history and self.reads(epoch + 1):
                    self._start_next_epoch(epoch + 1, self.lookahead + 1 - len(pending), closes)
                job = pending.popleft()
                try:
                    batch = self._finish(job, closed)
                except BaseException as exc:
                    self._abandon(deque([job]), wait=self._closes == closes)  # its slot is free again
                    if isinstance(exc, futures.CancelledError):
                        self._check_open(closes)  # cancelled by close(): say so
                    raise
                if job.request.index == 0:
                    self.dataset.first_batch_delivered()
                yield batch
        finally:
            self._abandon(pending, wait=self._closes == closes)

    def _check_open(self, closes: int) -> None:
        """Raise if `close()` was called since the pass that saw `closes` began."""
        if self._closes != closes:
            raise RuntimeError("the loader was closed during this pass: iterate it again to go on")

    def _started_for(self, ahead, epoch: int, history: tuple) -> tuple[deque[_Job], int]:
        """The jobs in `ahead` if they were started for this pass; otherwise they are abandoned."""
        if ahead is not None and ahead[0] == (epoch, history):
            return ahead[1], ahead[2]
        if ahead is not None:
            self._abandon(ahead[1])
        if self.slots is not None:
            self.slots.forget_claims()
        return deque(), 0

    def _start_next_epoch(self, epoch: int, room: int, closes: int) -> None:
        """Start up to `room` first batches of the fresh `epoch`, unless the loader was closed.
        Only a fresh epoch starts ahead: a resumed one's history is not known here."""
        if room <= 0:
            return
        with self._guard:
            ahead, self._ahead = self._ahead, None
        key, jobs, submitted = ahead if ahead is not None else ((epoch, ()), deque(), 0)
        plan = self.dataset.plan(epoch)
        try:
            while room > 0 and submitted < plan.num_batches and len(jobs) < room:
                jobs.append(self._submit(self.dataset.request(plan, epoch, submitted), closes))
                submitted += 1
        except BaseException:  # closed meanwhile, or a slot's wait interrupted: none left running
            self._abandon(jobs)
            raise
        with self._guard:
            if self._closes == closes:
                self._ahead, jobs = (key, jobs, submitted), deque()
        self._abandon(jobs)  # closed meanwhile: close() did not see these

    def _submit(self, request: BatchRequest, closes: int) -> _Job:
        """Queue `request`'s chunks on the pool, unless the loader was closed since `closes`.

        The pool is made here the first time, and again after a `close()`."""
        self._check_open(closes)
        with self._guard:
            stale, self._stale = self._stale, []
        while stale:  # chunks a close() left running: done before their buffers are reused
            try:
                self._check_open(closes)  # a close() meanwhile: this pass waits for nothing
            except BaseException:
                with self._guard:
                    self._stale += stale
                raise
            stale = list(futures.wait(stale, timeout=0.1).not_done)
        n = len(request.ids)
        images, slot = None, None
        if self.path.cfg.decode_on != "device":
            if self.slots is not None:
                slot = self.slots.claim_next()
                images = self.slots.view(slot, n)
            else:
                images = self.handed.take(n, self.path.cfg.batch_size, self.path.cfg.transform.image_size)
        bounds = np.linspace(0, n, min(self.threads, max(n, 1)) + 1).astype(int)
        with self._guard:  # close() swaps the pool out under it: never a new pool after a close()
            if self._closes != closes:
                if slot is not None:
                    self.slots.release(slot)
                self._check_open(closes)
            if self._pool is None:
                self._pool = futures.ThreadPoolExecutor(self.threads, thread_name_prefix="dlstore-decode")
                if images is not None and builds_rows_natively(self.path.cfg.transform):
                    self._row_workers = RowWorkers(self.threads)
            pool, rows = self._pool, self._row_workers
            spans = [(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]
            if rows is not None and images is not None:
                chunks = [futures.Future() for _ in spans]
                for chunk, (lo, hi) in zip(chunks, spans):
                    pool.submit(self._start_chunk, chunk, request, lo, hi, images, rows)
            else:
                chunks = [pool.submit(self._chunk, request, lo, hi, images) for lo, hi in spans]
            self._live.update(chunks)
        for chunk in chunks:
            chunk.add_done_callback(self._forget)
        return _Job(request, images, slot, chunks)

    def _forget(self, chunk: futures.Future) -> None:
        with self._guard:
            self._live.discard(chunk)

    def _chunk(self, request: BatchRequest, lo: int, hi: int, images: torch.Tensor | None) -> list[_Row | None]:
        """Samples `lo:hi` of the batch: read, decode, augment, each into its row.

        Raises once the program exits: the exit runs every queued chunk, and nobody reads them."""
        raise_if_exiting("a batch's decoding")
        ids = request.ids[lo:hi]
        with self.path.viewed(ids, request.direct) as samples:
            done = self.path.images(
                samples, ids.tolist(), request.epoch, None if images is None else images.numpy()[lo:hi]
            )
        return _rows(request, lo, samples, done, images is None)

    def _start_chunk(self, chunk: futures.Future, request: BatchRequest, lo: int, hi: int, images, rows) -> None:
        """`_chunk` with its C part handed to `rows`, the `RowWorkers`; `chunk` gets the result.
        This thread reads the samples, the finishing thread marks and takes what C
        turned down. Neither waits for the GIL while the rows are built."""
        if not chunk.set_running_or_notify_cancel():
            return
        try:
            raise_if_exiting("a batch's decoding")
            ids, out = request.ids[lo:hi], images.numpy()[lo:hi]
            samples = self.path.read(ids, direct=request.direct, views=True)
        except BaseException as exc:
            chunk.set_exception(exc)
            return

        path = self.path  # not `self`: the finishing thread must not be the engine's last holder

        def built(errors: list) -> None:
            try:
                done = path.images_done(samples, ids.tolist(), request.epoch, out, native, errors)
                chunk.set_result(_rows(request, lo, samples, done, False))
            except BaseException as exc:
                chunk.set_exception(exc)
            finally:
                release_views(samples)

        try:
            native = self.path.row_jobs(samples, ids.tolist(), request.epoch, out)
            rows.start(native.jobs, out, crop_params(self.path.cfg.transform), built)
        except BaseException as exc:
            release_views(samples)
            chunk.set_exception(exc)

    def _finish(self, job: _Job, closed: futures.Future) -> dict:
        """The batch dict of a job once its chunks are done; a chunk's error is raised here.

        A close() meanwhile, even in another thread, sets `closed` and ends the wait at once."""
        waiting = set(job.chunks)
        while waiting:
            done, waiting = futures.wait(waiting | {closed}, return_when=futures.FIRST_COMPLETED)
            if closed.done():
                raise RuntimeError("the loader was closed during this pass: iterate it again to go on")
            if any(chunk.exception() is not None for chunk in done if not chunk.cancelled()):
                break
            waiting.discard(closed)
        rows = [row for chunk in job.chunks for row in chunk.result()]
        kept = [i for i, row in enumerate(rows) if row is not None]
        real = [rows[i] for i in kept]
        labels, keys, padding = [r.label for r in real], [r.key for r in real], [r.padding for r in real]
        if job.images is None:  # device decode: the JPEGs and crop rows, joined
            batch = self.path.collate(job.request.index, [r.image for r in real], labels, keys, padding)
        elif len(kept) < len(rows):
            # Corrupt samples were skipped: the good rows move up. That copy is rare.
            images = job.images[torch.as_tensor(kept, dtype=torch.long)]
            if job.slot is not None:
                job.images[: len(kept)] = images
                images = job.images[: len(kept)]
            batch = self.path.batch_dict(job.request.index, images, labels, keys, padding)
        else:
            batch = self.path.batch_dict(job.request.index, job.images, labels, keys, padding)
        if job.slot is not None:
            batch["images"], batch["slot"] = None, job.slot  # the prefetcher reads the slot
        batch["corrupt"] = len(rows) - len(kept)
        return batch

    def _abandon(self, pending: deque[_Job], wait: bool = True) -> None:
        """Cancel queued chunks, wait for running ones, and free their slots.

        Running chunks write into slots, hence the wait. Jobs started for the next epoch keep
        their own. Without `wait`, as after a close(), running chunks end on their own and the
        next pass waits for them. Only chunks that could not be cancelled are waited for. After
        `close()` no pool thread takes a cancelled future off the queue, so it never counts done."""
        started = [chunk for job in pending for chunk in job.chunks if not chunk.cancel()]
        _, running = futures.wait(started, timeout=None if wait else 0)
        if running:
            with self._guard:
                self._stale += running
        for job in pending:
            if job.slot is not None:
                self.slots.release(job.slot)

    def close(self) -> None:
        """Stop the decode threads: at once for a pass waiting in another thread.

        Here it waits up to `_CLOSE_GRACE_S`; a chunk waiting for a download is left to end alone."""
        with self._guard:
            self._closes += 1
            closed, self._closed = self._closed, futures.Future()
            ahead, self._ahead = self._ahead, None
            pool, self._pool = self._pool, None
            rows, self._row_workers = self._row_workers, None
        closed.set_result(None)
        if ahead is not None:
            self._abandon(ahead[1], wait=False)
        with self._guard:
            live = list(self._live)
        _, running = futures.wait([c for c in live if not c.cancel()], timeout=_CLOSE_GRACE_S)
        with self._guard:
            self._stale += running
        if pool is not None:
            pool.shutdown(wait=not running, cancel_futures=True)
        if rows is not None:  # its threads end once the rows started are built
            rows.stop()


def _rows(request: BatchRequest, lo: int, samples: list, done: list, on_device: bool) -> list[_Row | None]:
    """The rows of the chunk at `lo` from `images`' results: None for a corrupt sample."""
    rows: list[_Row | None] = []
    for k, (sample, result) in enumerate(zip(samples, done)):
        if result is None:  # corrupt, and skipped
            rows.append(None)
            continue
        row = _Row(result[1], sample.get("__key__"), bool(request.is_padding[lo + k]))
        if on_device:
            row.image = result[0]  # device decode: the JPEG and its crop row
        rows.append(row)
    return rows
