"""What a busy Python thread costs the loader: one decode worker beside a thread that only runs Python.

The busy thread stands in for a training loop's dispatch, optimiser and hooks. It runs on
its own core; the loader's threads get the others, so the two share the GIL, not a core. Each round times, for every engine, the loader
alone, the busy thread alone, and the two together. The ratios within a round are the figures:
what the loader keeps of its rate alone, and what the busy thread keeps of its own.

Example::

    python -m benchmarks.gil --images 2000 --rounds 3 --seconds 8
"""

from __future__ import annotations

import argparse
import os
import threading
import time

from benchmarks.data import prepare_data
from benchmarks.pipelines import dlstore_loader
from benchmarks.runner import interleave, show, workdir


def busy_python(stop: threading.Event, counts: list[int], core: int) -> None:
    """Pure-Python work on `core` until `stop`; `counts` gets the loops done."""
    os.sched_setaffinity(threading.get_native_id(), {core})
    done = 0
    while not stop.is_set():
        for _ in range(1000):
            done += 1
    counts.append(done)


def timed(seconds: float, loader_args=None, data=None, busy: bool = False, engine: str = "threads") -> tuple:
    """(images a second, busy loops a second) over `seconds`; either may be None."""
    stop, counts = threading.Event(), []
    cores = os.sched_getaffinity(0)
    thread = threading.Thread(target=busy_python, args=(stop, counts, max(cores)), daemon=True) if busy else None
    images, loader = 0, None
    if len(cores) > 1:  # the loader's threads, made from this one, keep off the busy thread's core
        os.sched_setaffinity(0, cores - {max(cores)})
    if loader_args is not None:
        loader, batches = dlstore_loader(data.url, data.cache_dir, loader_args, engine=engine)
        next(iter(batches(0)))  # the engine is up and the cache warm before the clock starts
    if thread is not None:
        thread.start()
    start = time.monotonic()
    try:
        epoch = 1
        while time.monotonic() - start < seconds:
            if loader is None:
                time.sleep(0.05)
                continue
            for batch in batches(epoch):
                images += batch[0].shape[0]
                if time.monotonic() - start >= seconds:
                    break
            epoch += 1
    finally:
        elapsed = time.monotonic() - start
        stop.set()
        if thread is not None:
            thread.join()
        if loader is not None:
            loader.close()
        os.sched_setaffinity(0, cores)
    return (images / elapsed if loader is not None else None), (counts[0] / elapsed if counts else None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=None, help="where the data is made once (default: a temp folder)")
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--seconds", type=float, default=8.0, help="each timed run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--engines", default="threads,processes")
    args = p.parse_args(argv)
    args.workers, args.batch_timeout = 1, 600.0
    with workdir(args.workdir, "dlstore-gil-") as root:
        data = prepare_data(root, args.images, args.shards)
        runs = {"busy alone": lambda: timed(args.seconds, busy=True)}
        for engine in args.engines.split(","):
            runs[f"{engine} alone"] = lambda e=engine: timed(args.seconds, args, data, engine=e)
            runs[f"{engine} beside"] = lambda e=engine: timed(args.seconds, args, data, busy=True, engine=e)
        rounds = interleave(args.rounds, runs)
    print(f"one decode worker beside a Python-busy thread: {len(rounds)} rounds, {args.seconds:.0f} s each")
    for engine in args.engines.split(","):
        alone = [r[f"{engine} alone"][0] for r in rounds]
        beside = [r[f"{engine} beside"][0] for r in rounds]
        print(show(f"{engine}: img/s alone", alone, "{:.0f}"))
        print(show(f"{engine}: img/s beside the busy thread", beside, "{:.0f}"))
        print(show(f"{engine}: kept of its rate alone", [b / a for a, b in zip(alone, beside)], goal=">= 0.9"))
        kept = [r[f"{engine} beside"][1] / r["busy alone"][1] for r in rounds]
        print(show(f"{engine}: the busy thread keeps of its own", kept, goal=">= 0.9"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
