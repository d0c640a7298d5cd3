"""The download engine of one process: worker threads that fetch shards as ranged GETs.
It runs several parts of a shard and several shards at once. Each part is written into the
shard's temp file at its own offset.

    engine = DownloadEngine(connections=16)
    job = engine.start(store, "train/shard-000003.tar", fd, size, priority=0, parts_in_flight=8, part_size=16 * 2**20)
    # or bytes [offset, offset + size) of the object, written at 0: engine.start(..., object_offset=offset)
    job.wait(on_prefix=hash_bytes)     # start, end of each new stretch of the written prefix; raises a part's error

How it works, and why:

* **Parts are cut when a worker takes one**, in offset order. The written prefix then grows
  steadily behind the parts in flight, so the caller hashes it as it grows. A part's size
  can use what the parts before it measured.
* **Part size**: a shard that parts of `part_size` would spread over fewer than
  `parts_in_flight` connections is cut into `parts_in_flight` equal parts of 1 MiB at least.
  It then arrives as fast as its connections allow, and a reader waits for the whole shard.
  A larger shard's parts are at least `part_size`. `pace.LinkEstimate` also makes them large
  enough that the wait for a first byte costs at most 1/32 of the transfer. They are no larger
  than the shard's share of its connections. With `parts_in_flight=1` a shard is one GET.
* **Scheduling**: downloads go by priority, then arrival. An idle worker takes the next part
  of the first download with bytes left and fewer parts running than its `_width`. A reader's
  shard, at priority 0, runs `parts_in_flight` wide, twice that before a rate is measured. A
  prefetch runs at most `background_parts` wide, which `pace.PrefetchPace` sets. `hurry`
  makes a prefetch a reader's download. Parts are cut for `parts_in_flight` either way, so a
  narrowed download can widen again.
* **Retries** are per part. A part is one `Store.get(name, start, end)`, which resumes from
  the next byte after a cut: see `storage.retry.ProgressRetry`.
* **The last part asks for one byte more** than the manifest's size. So an object longer than
  its manifest raises `CorruptShard` without a stat, and a short part shows a shorter one.
  Nothing is written past `size`: the reservation holds. A download of a byte range, with
  `object_offset` for runs of samples, asks for exactly its bytes.
* **Errors**: the first part that fails for good fails the download. No new part starts, and
  running parts stop at their next chunk. `Download.wait` raises the error, naming the shard
  and the part's bytes. It raises only once no part can write to the file, so the caller may
  close and unlink it.
* **Rates** for the prefetch's pace, both smoothed: `connection_rate` is the bytes per second
  one connection moves, its wait for the first byte included. `shard_rate` is a whole shard's.
* **Workers** are made on demand, at most `connections`, and end after `idle_s` without work.
  So a backend's per-thread connection stays open across parts.
* **Node slots**, from `slots.NodeSlots`: a part starts only once it holds one of the node's
  connection slots, given back when its GET ends. A worker takes the slot with the part, under
  the engine's lock. So a part is cut only once it can run, and downloads keep their order.
  While the first download with work waits for a slot, one worker polls the node's slots
  every `_SLOT_POLL_S`, and the others wait. A reader's download waiting for a slot makes
  every prefetch on the node yield to it. `node_slot` holds a slot the same way for GETs
  made outside the engine.

No state survives a fork: the engine lives in the cache's per-process runtime.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dlstore.cache.pace import MIN_SAMPLE_BYTES, LinkEstimate
from dlstore.cache.slots import NodeSlots
from dlstore.errors import CorruptShard, DlstoreError, TransientError, raise_if_exiting
from dlstore.storage.base import Store

log = logging.getLogger(__name__)

#: A shard spread over its connections is cut no finer than this: a round trip would outweigh it.
_MIN_SPREAD_PART = 1 << 20
#: How often a worker looks for a node slot freed by another process; one worker per process polls.
_SLOT_POLL_S = 0.01
#: The other workers waiting for a slot look again at least this often. They are also woken
#: whenever a part ends in this process, or the poller gets a slot.
_SLOT_RECHECK_S = 1.0
#: How often a download's waiting thread looks whether a reader of another process waits for it.
_POLL_S = 0.1

#: At a cold start, a download that readers wait for runs this many times its `parts_in_flight`.
_COLD_START_WIDTH = 2
#: Objects `hurry` remembers, for downloads of them that begin after it was called.
_HURRIED_KEPT = 64


@dataclass
class _Part:
    index: int
    start: int
    end: int  # exclusive; the manifest's size bounds it
    written: int  # bytes [start, written) are in the file
    slot: int | None = None  # the node slot its GET holds, if the node has a cap


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        offset += (n := os.pwrite(fd, view, offset))
        view = view[n:]


class Download:
    """One shard in flight: its parts, who runs them, and the first error. Made by
    `DownloadEngine.start`. The caller then calls `wait` exactly once."""

    def __init__(
        self,
        lock: threading.Lock,
        on_done: Callable[[Download], None],
        store: Store,
        name: str,
        fd: int,
        size: int,
        *,
        priority: int,
        parts_in_flight: int,
        part_size: int,
        object_offset: int | None = None,
    ) -> None:
        self.store, self.name, self.fd, self.size = store, name, fd, size
        self.object_offset = object_offset  # None: the whole object, else where the file's byte 0 is in it
        self.order = (priority, 0)  # (priority, arrival), set by the engine
        self.parts_in_flight = parts_in_flight
        share = -(-size // parts_in_flight)  # the shard spread over all its connections
        if parts_in_flight == 1:
            self.part_floor = size
        elif -(-size // part_size) < parts_in_flight:  # parts of part_size would leave connections idle
            self.part_floor = min(part_size, max(share, _MIN_SPREAD_PART))
        else:
            self.part_floor = part_size
        self.part_ceiling = max(self.part_floor, share)
        self.parts: list[_Part] = []
        self.running = 0
        self.most_running = 0
        self.error: BaseException | None = None
        self.cancelled = False
        self.started = self.last_write = time.monotonic()
        self.first_part_at: float | None = None  # when its first GET began, queueing excluded
        self._lock = lock  # the engine's: parts are claimed and counted under it
        self._on_done = on_done
        self._progress = threading.Condition(lock)

    # -- under the engine's lock --------------------------------------------------------------------
    def _next_offset(self) -> int:
        return self.parts[-1].end if self.parts else 0

    def _has_work(self) -> bool:
        if self.error is not None or self.cancelled:
            return False
        # An empty shard is one part too: [0, 1) asked for, to see that nothing is there.
        return not self.parts or self._next_offset() < self.size

    def _claim(self, length: int) -> _Part:
        if self.first_part_at is None:
            self.first_part_at = time.monotonic()
        start = self._next_offset()
        part = _Part(len(self.parts), start, min(self.size, start + max(length, 1)), start)
        self.parts.append(part)
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        return part

    def _prefix(self) -> int:
        """End of the bytes written from offset 0 without a gap."""
        end = 0
        for part in self.parts:
            end = part.written
            if part.written < part.end:
                break
        return end

    def _finished(self) -> bool:
        """No part runs, and none will start."""
        return self.running == 0 and not self._has_work()

    # -- the caller's side ---------------------------------------------------------------------------
    def wait(
        self, on_prefix: Callable[[int, int], None] | None = None, on_poll: Callable[[], None] | None = None
    ) -> None:
        """Block until every part has ended. In this thread, call `on_prefix(start, end)` for
        each new stretch of the written prefix, and `on_poll()` about every `_POLL_S`. Raise
        the first part's error, or a callback's, once no part writes to the file any more."""
        done = 0
        polled = time.monotonic()
        try:
            while True:
                with self._lock:
                    while not self._finished() and self.error is None:
                        if on_prefix is not None and self._prefix() > done:
                            break
                        if on_poll is not None and time.monotonic() - polled >= _POLL_S:
                            break
                        self._progress.wait(timeout=_POLL_S)
                        raise_if_exiting("a wait for a download")  # which is cancelled
                    prefix, finished, failed = self._prefix(), self._finished(), self.error is not None
                if failed:
                    break
                if on_poll is not None and time.monotonic() - polled >= _POLL_S:
                    polled = time.monotonic()
                    on_poll()
                if on_prefix is not None and prefix > done:
                    on_prefix(done, prefix)
                    done = prefix
                elif finished:
                    break
        except BaseException:
            self._stop()
            raise
        finally:
            self._drain()
        if self.error is not None:
            raise self.error

    def _stop(self) -> None:
        with self._lock:
            self.cancelled = True

    def _drain(self) -> None:
        """Wait until no part runs. A running part stops at its next chunk once failed or cancelled."""
        with self._lock:
            while self.running:
                self._progress.wait(timeout=1.0)
            self._on_done(self)

    @property
    def stopped(self) -> bool:
        return self.error is not None or self.cancelled


class DownloadEngine:
    """Worker threads fetching the parts of the downloads started on it. See the module
    docstring. Thread-safe, and one per process, since it does not survive a fork."""

    def __init__(self, connections: int, idle_s: float = 30.0, slots: NodeSlots | None = None) -> None:
        self.connections = connections
        self.idle_s = idle_s
        self.slots = slots  # the node's cap on connections; None: this process's `connections` only
        self._slot_wanted = False  # the first download with work waits for a node slot
        self._slot_poller = False  # a worker polls for one
        self.link = LinkEstimate()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._downloads: list[Download] = []
        self._arrivals = itertools.count()
        self._workers = 0
        self._idle = 0
        self._closing = False
        self.most_running = 0  # the most parts, or connections, running at once, for the cache's stats
        self._waiting_failed = False  # the node slots' waiting file could not be used; logged once
        self.shard_rate: float | None = None  # bytes/s a whole shard's download has been getting, smoothed
        #: The most parts a prefetch, above priority 0, runs at once. None: its `parts_in_flight`.
        #: Set by the prefetch's pace. A reader's download, at priority 0, is never narrowed.
        self.background_parts: int | None = None
        self._hurried: OrderedDict[tuple[str, int | None], None] = OrderedDict()  # name and offset, for `hurry`
        self._outside_slots = 0  # node slots held by GETs outside the engine, in `node_slot`
        self._slot_freed = threading.Condition(self._lock)  # for `node_slot`'s waiters only
        self._slots_looked = 0.0  # when `node_slot`'s waiters last had the node's slots scanned

    @property
    def connection_rate(self) -> float | None:
        """Bytes per second one connection has been moving, its wait for the first byte included."""
        return self.link.connection_rate

    def start(
        self,
        store: Store,
        name: str,
        fd: int,
        size: int,
        *,
        priority: int,
        parts_in_flight: int,
        part_size: int,
        object_offset: int | None = None,
    ) -> Download:
        """Begin fetching object `name` of `store`, `size` bytes, into `fd`. With `object_offset`,
        fetch its bytes from there. Lower `priority` goes first. Call `wait` on the result."""
        download = Download(
            self._lock,
            self._forget,
            store,
            name,
            fd,
            size,
            priority=priority,
            parts_in_flight=parts_in_flight,
            part_size=part_size,
            object_offset=object_offset,
        )
        with self._lock:
            self._closing = False
            if priority > 0 and (name, object_offset) in self._hurried:
                priority = 0  # a reader reached it before its download began
            download.order = (priority, next(self._arrivals))
            self._downloads.append(download)
            self._downloads.sort(key=lambda d: d.order)
            self._spawn(self._width(download))
            self._work.notify_all()
        return download

    def set_background_parts(self, parts: int) -> None:
        """The most parts a prefetch runs at once, set by its pace. When it widens, the parts it
        now allows start at once: idle workers are woken, and made again where they ended."""
        with self._lock:
            widened = self.background_parts is not None and parts > self.background_parts
            self.background_parts = parts
            if widened:
                runnable = sum(max(0, self._width(d) - d.running) for d in self._downloads if d._has_work())
                if runnable:
                    self._spawn(runnable)
                    self._work.notify_all()

    def forget_hurry(self, name: str, object_offset: int | None = None) -> None:
        """The prefetch that `hurry` named is over. Later downloads of it begin as the pace says."""
        with self._lock:
            self._hurried.pop((name, object_offset), None)

    def hurry(self, name: str, object_offset: int | None = None) -> None:
        """A reader now waits for the prefetch of object `name` from `object_offset`. Make it a
        reader's download, first and at full width. A download of it not begun yet, or a
        second attempt after a failed checksum, begins as one. The last few are remembered."""
        with self._lock:
            self._hurried[name, object_offset] = None
            while len(self._hurried) > _HURRIED_KEPT:
                self._hurried.popitem(last=False)
            hurried = [
                d for d in self._downloads if d.name == name and d.object_offset == object_offset and d.order[0] > 0
            ]
            for download in hurried:
                download.order = (0, download.order[1])
            if hurried:
                self._downloads.sort(key=lambda d: d.order)
                self._spawn(max(self._width(d) for d in hurried))
                self._work.notify_all()

    @contextlib.contextmanager
    def node_slot(self, timeout_s: float) -> Iterator[None]:
        """Hold one of the node's connection slots around a GET made outside the engine, as a
        reader's part would. So a direct read of samples counts against
        `CacheConfig.node_connections` too. Wait at most `timeout_s` for a free slot, then
        raise `TransientError`. Without a node cap, there is no wait. The waiters have the
        node's slots scanned at most every `_SLOT_POLL_S` between them."""
        if self.slots is None:
            yield
            return
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while (slot := self._try_slot()) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransientError(f"no free connection slot on this node within {timeout_s:g} s")
                self._slot_freed.wait(timeout=min(_SLOT_POLL_S, left))
                if time.monotonic() - self._slots_looked >= _SLOT_POLL_S:
                    self._slots_looked = time.monotonic()
                    self.slots.look_again()  # slots other processes freed
            self._outside_slots += 1
        try:
            yield
        finally:
            with self._lock:
                self.slots.give_back(slot)
                self._outside_slots -= 1
                self._slot_freed.notify()
                self._work.notify_all()  # a part waiting for a slot may take this one

    def _try_slot(self) -> int | None:
        try:
            return self.slots.try_take(urgent=True)
        except OSError as exc:  # the slot files cannot be opened: the caller falls back, saying why
            raise TransientError(f"cannot take a node connection slot: {exc}") from exc

    def close(self) -> None:
        """Let idle workers end now. Running parts finish. A later `start` makes new workers."""
        with self._lock:
            self._closing = True
            if self.slots is not None and not self._outside_slots and not any(d.running for d in self._downloads):
                self.slots.close()  # its files, reopened if the engine starts again
            self._work.notify_all()

    # -- under the lock --------------------------------------------------------------------------------
    def _spawn(self, wanted: int) -> None:
        missing = min(wanted - self._idle, self.connections - self._workers)
        for _ in range(max(missing, 0)):
            self._workers += 1
            threading.Thread(target=self._work_loop, name="dlstore-cache-download", daemon=True).start()

    def _forget(self, download: Download) -> None:
        if download in self._downloads:
            self._downloads.remove(download)
            # From its first GET: time queued behind other downloads or node slots is not the link's.
            seconds = time.monotonic() - (download.first_part_at or download.started)
            if not download.stopped and download.size >= MIN_SAMPLE_BYTES and seconds > 0.005:
                rate = download.size / seconds
                self.shard_rate = rate if self.shard_rate is None else 0.7 * self.shard_rate + 0.3 * rate
        self._work.notify_all()

    def _take(self) -> tuple[Download, _Part] | None:
        """The next part to run, holding its node slot. None when there is none, or when the
        first download with work gets no slot. The later ones would not get one either."""
        self._slot_wanted = False
        for download in self._downloads:
            if download._has_work() and download.running < self._width(download):
                break
        else:
            self._set_reader_waiting(False)
            return None
        urgent = download.order[0] == 0
        slot = None
        if self.slots is not None:
            slot = self._slot_for(self.slots, download)
            if slot is None:
                self._set_reader_waiting(urgent and self._slot_wanted)
                return None
        part = download._claim(self.link.part_size(download.part_floor, download.part_ceiling))
        part.slot = slot
        self.most_running = max(self.most_running, sum(d.running for d in self._downloads))
        # A reader's shard with parts still to start keeps the prefetches back between them.
        self._set_reader_waiting(urgent and download._has_work() and download.running < download.parts_in_flight)
        return download, part

    def _width(self, download: Download) -> int:
        """Parts of `download` that may run at once. A prefetch runs as wide as its pace allows.
        One that readers wait for runs `parts_in_flight` wide, twice that before a rate is
        measured. So the shards in use have all their parts in flight at a cold start. Later,
        the connections' CPU would cost the readers more than the width gains them."""
        if download.order[0] == 0:
            cold = self.link.rate is None
            return download.parts_in_flight * (_COLD_START_WIDTH if cold else 1)
        if self.background_parts is None:
            return download.parts_in_flight
        return max(1, min(download.parts_in_flight, self.background_parts))

    def _slot_for(self, slots: NodeSlots, download: Download) -> int | None:
        """A node slot for a part of `download`, or None when none is free now. If the slot
        files cannot be opened, the download fails with that error."""
        try:
            slot = slots.try_take(urgent=download.order[0] == 0)
        except OSError as exc:
            download.error = exc
            download._progress.notify_all()
            return None
        self._slot_wanted = slot is None
        return slot

    def _set_reader_waiting(self, waiting: bool) -> None:
        if self.slots is None:
            return
        try:
            self.slots.set_waiting(waiting)
        except OSError as exc:  # e.g. no descriptors left: readers lose their precedence, nothing hangs
            if not self._waiting_failed:
                log.warning("cache: cannot mark a reader waiting for a node slot (%s); prefetches may go first", exc)
            self._waiting_failed = True

    # -- the workers ------------------------------------------------------------------------------------
    def _work_loop(self) -> None:
        while True:
            with self._lock:
                try:
                    job = self._next_job()
                except BaseException:
                    self._workers -= 1  # so that `_spawn` replaces this worker
                    raise
            if job is None:
                return
            download, part = job
            try:
                self._fetch(download, part)
            except BaseException as exc:  # kept for the caller, who raises it in `wait`
                with self._lock:
                    if download.error is None and not download.cancelled:
                        download.error = _naming_the_part(exc, download, part)
            finally:
                with self._lock:
                    if part.slot is not None and self.slots is not None:
                        self.slots.give_back(part.slot)
                        self._slot_freed.notify()  # a direct read waiting for one in `node_slot`
                    download.running -= 1
                    download._progress.notify_all()
                    self._work.notify_all()

    def _next_job(self) -> tuple[Download, _Part] | None:
        """Under the lock: wait for a part to run and its node slot. Return None when this worker
        ends, idle for `idle_s` or the engine closing. A worker never ends while a part waits
        for a slot: no other event would start it."""
        idle_until = time.monotonic() + self.idle_s
        while (job := self._take()) is None:
            if self._slot_wanted:
                polling = not self._slot_poller  # one poller per process; the rest are woken
                self._slot_poller = self._slot_poller or polling
                self._idle += 1
                self._work.wait(timeout=_SLOT_POLL_S if polling else _SLOT_RECHECK_S)
                self._idle -= 1
                if polling:
                    self._slot_poller = False
                    if self.slots is not None:
                        self.slots.look_again()
                idle_until = time.monotonic() + self.idle_s
                continue
            left = idle_until - time.monotonic()
            if self._closing or left <= 0:
                self._workers -= 1
                return None
            self._idle += 1
            self._work.wait(timeout=left)
            self._idle -= 1
        if self._slot_poller is False and self.slots is not None:
            self._work.notify()  # another waiter looks again, and polls if parts still wait for slots
        return job

    def _fetch(self, download: Download, part: _Part) -> None:
        """One part: a ranged GET written at its offset. The last part of a whole object asks for
        one byte more."""
        base = download.object_offset
        if base is None:
            start, end = part.start, part.end + 1 if part.end == download.size else part.end
        else:
            start, end = base + part.start, base + part.end
        with contextlib.closing(download.store.get(download.name, start, end)) as chunks:
            self._write_part(download, part, chunks)

    def _write_part(self, download: Download, part: _Part, chunks: Iterator[bytes]) -> None:
        size, position = download.size, part.start
        asked = time.monotonic()
        first_byte = None
        for chunk in chunks:
            if download.stopped:
                return
            if first_byte is None:
                first_byte = time.monotonic()
            if position + len(chunk) > part.end:  # only the last part can get here
                raise CorruptShard(
                    f"shard {download.name!r} in {download.store.url} is larger than the {size} bytes its manifest says"
                )
            _pwrite_all(download.fd, chunk, position)
            position += len(chunk)
            with self._lock:
                part.written = position
                download.last_write = time.monotonic()
                download._progress.notify_all()
        if position < part.end:
            known = "" if position > part.start or part.start == 0 else "at most "
            raise CorruptShard(
                f"shard {download.name!r} in {download.store.url} has {known}{position} bytes; its manifest says {size}"
            )
        if first_byte is not None:
            with self._lock:
                self.link.add(first_byte - asked, position - part.start, time.monotonic() - first_byte)


def _naming_the_part(exc: BaseException, download: Download, part: _Part) -> BaseException:
    """A store error re-raised, same type, with the shard and the part's bytes in its message."""
    if not isinstance(exc, DlstoreError) or isinstance(exc, CorruptShard):
        return exc  # CorruptShard names the shard already; the cache maps an OSError, such as a full disk
    try:
        named = type(exc)(f"shard {download.name!r}, part {part.index} (bytes {part.start}-{part.end - 1}): {exc}")
    except TypeError:
        return exc
    named.__cause__ = exc
    return named
