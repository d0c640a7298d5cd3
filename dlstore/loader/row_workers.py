"""C threads that build a batch's rows without ever taking the GIL, for the thread engine.

Why: a decode thread that runs `crop_rows` takes the GIL back when the call returns, a wait of
up to 5 ms beside a training loop (`dlstore.loader.threads`). Here `workers` threads serve `jpeg_region`'s row queue and wait only
for work. A chunk's Python, its reads and marks, runs in the engine's pool threads
before, and in one finishing thread after.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from dlstore.transforms import cpu_decode

__all__ = ["RowWorkers"]


class RowWorkers:
    """`workers` C threads and one that hands each finished list of rows to its callback."""

    def __init__(self, workers: int) -> None:
        region = cpu_decode.jpeg_region
        self.queue = region.row_queue()
        threads = [
            threading.Thread(target=region.serve_rows, args=(self.queue,), name="dlstore-rows", daemon=True)
            for _ in range(workers)
        ]
        threads.append(threading.Thread(target=_hand_out, args=(self.queue,), name="dlstore-rows-done", daemon=True))
        for thread in threads:
            thread.start()
        # Garbage collection stops them too: the threads refer to the queue, not to this.
        self._stop = weakref.finalize(self, region.stop_rows, self.queue)

    def start(self, jobs: list[tuple], out, crop: tuple, done: Callable[[list], None]) -> None:
        """Build `jobs` (as `cpu_decode.crop_rows` takes them) into `out`, with `crop` from
        `cpu_decode.crop_params`; `done(errors)` runs once they are built, in the finishing
        thread, with `crop_rows`' results. It must not raise."""
        cpu_decode.jpeg_region.start_rows(self.queue, jobs, out, crop, done)

    def stop(self) -> None:
        """The threads end once the lists started are built and handed out."""
        self._stop()


def _hand_out(queue) -> None:
    while (finished := cpu_decode.jpeg_region.next_done(queue)) is not None:
        done, errors = finished
        done(errors)
        # Let go now, not when the thread ends at the program's exit. A torch tensor freed then
        # lets go of the GIL, cannot take it back, and the exit aborts ("terminate called").
        del finished, done, errors
