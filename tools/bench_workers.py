#!/usr/bin/env python3
"""Decode threads against worker processes at each worker count, on this box: where
`engine="auto"` should stop taking threads for a CPU loader.

Threads share one GIL. Each image takes it a few times (the read, the decode call, the resize
call, the flip) for a few microseconds of Python, and a thread coming back from C waits for
whoever holds it. Few threads hardly meet; many do. This sweep gives the crossover.

Same shards (`bench_peers.prepare_data`: generated 400x350 JPEGs), same loader as
`bench_peers`' dlstore runs (uint8 batches on the CPU, train transform), a fresh loader per
run (1 warm-up epoch, then `--epochs` timed, `bench_peers.time_run`); each round runs every
(workers, engine) pair, the engines alternating. Reported: img/s and processes / threads per
worker count, median [min .. max] over rounds.

`--step-ms` makes the loop a GPU's: it waits that long after each batch, using no CPU, as a
training step on a GPU would. The loop is then the bottleneck when the workers keep ahead, and
what an engine loses at epoch starts shows: the report adds the pause from an epoch's last batch
to the next one's first, which is one step when nothing waits.

Examples (a 16-core node; this 2-core box)::

    python tools/bench_workers.py --workers 2,4,8,14 --images 4000 --rounds 1
    python tools/bench_workers.py --workers 4 --batch-size 128 --step-ms 120 --epochs 4 --images 5000 --shards 8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_peers  # noqa: E402
from bench_peers import Candidate  # noqa: E402

ENGINES = ("threads", "processes")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2,4,8", help="worker counts, comma-separated")
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1, help="timed epochs per run, after 1 warm-up epoch")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=0.0, help="the loop waits this long after each batch")
    parser.add_argument("--workdir", help="keep the data here and reuse it (default: a temp dir)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.workers.split(",")]
    own = not args.workdir
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dlstore-bench-workers-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rates: dict[tuple[int, str], list[float]] = {(n, e): [] for n in counts for e in ENGINES}
    pauses: dict[tuple[int, str], list[float]] = {(n, e): [] for n in counts for e in ENGINES}
    try:
        data = bench_peers.prepare_data(workdir, args.images, args.shards)
        print(f"data: {args.images} JPEGs in {args.shards} shards, ready in {time.perf_counter() - started:.0f} s")
        for number in range(args.rounds):
            for n in counts:
                engines = ENGINES if (number + n) % 2 == 0 else ENGINES[::-1]
                for engine in engines:
                    run_args = bench_peers.parse_args(
                        ["--workers", str(n), "--batch-size", str(args.batch_size), "--images", str(args.images)]
                    )
                    times = bench_peers.time_run(
                        lambda run_args=run_args, engine=engine: _stepped(
                            bench_peers.dlstore_candidate(data, run_args, engine), args.step_ms / 1000
                        ),
                        args.epochs,
                    )
                    rates[n, engine].append(times.images_per_s)
                    pauses[n, engine].append(statistics.median(times.pauses_s[1:] or times.pauses_s))
                    print(
                        f"round {number + 1}: {n} workers, {engine}: {times.images_per_s:,.0f} img/s, "
                        f"epoch-start pauses {[round(p, 3) for p in times.pauses_s]} s",
                        flush=True,
                    )
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)

    cores = len(os.sched_getaffinity(0))
    step = f", a {args.step_ms:g} ms step per batch" if args.step_ms else ""
    print(f"\n{cores} cores, batch {args.batch_size}{step}, median [min .. max] over {args.rounds} rounds")
    print(f"  {'workers':>7}  {'threads img/s':>22}  {'processes img/s':>22}  {'processes / threads':>22}")
    summary = []
    for n in counts:
        ratios = [p / t for t, p in zip(rates[n, "threads"], rates[n, "processes"])]
        row = {"workers": n, **{e: rates[n, e] for e in ENGINES}, "processes_over_threads": ratios}
        summary.append(row)
        print(f"  {n:>7}  " + "  ".join(_spread(v) for v in (rates[n, "threads"], rates[n, "processes"], ratios)))
    each = f"; one step is {args.step_ms / 1000:g} s" if args.step_ms else ""
    print(f"\n  epoch-start pause, s (median per run, the warm-up's left out{each}): threads, processes")
    for n in counts:
        row = next(r for r in summary if r["workers"] == n)
        row["pauses_s"] = {e: pauses[n, e] for e in ENGINES}
        print(f"  {n:>7}  " + "  ".join(_spread(pauses[n, e], "{:.3f}") for e in ENGINES))
    print(f"took {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"cores": cores, "settings": vars(args), "runs": summary}, indent=2))
    return 0


def _stepped(candidate: Candidate, step_s: float) -> Candidate:
    """The candidate's batches with a loop that waits `step_s` after each (no CPU: a GPU's step)."""
    if not step_s:
        return candidate

    def batches(epoch: int):
        for batch in candidate.batches(epoch):
            yield batch
            time.sleep(step_s)

    return Candidate(batches, candidate.close)


def _spread(values: list[float], fmt: str | None = None) -> str:
    fmt = fmt or ("{:,.0f}" if max(values) > 10 else "{:.2f}")
    text = f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))} .. {fmt.format(max(values))}]"
    return f"{text:>22}"


if __name__ == "__main__":
    sys.exit(main())
