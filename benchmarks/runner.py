"""The shared runner: interleaved rounds, the spread of a measure, CPU and memory.

The machine may be shared, so every benchmark runs its contenders in rounds that
interleave them. A ratio taken within one round is the figure to trust; the spread
over rounds is shown beside the median. CPU and memory come from psutil alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import psutil

T = TypeVar("T")

#: The loader's threads by the prefix of their name. Others count as "other".
THREAD_KINDS = {"dlstore-decode": "decode", "dlstore-cache-download": "download", "dlstore-cache-prefetch": "prefetch"}


@dataclass(frozen=True)
class Spread:
    """One measure over rounds: its runs, their median and range.

    >>> Spread.of([3.0, 1.0, 2.0]).text("{:.1f}")
    '2.0 [1.0 .. 3.0]'
    """

    runs: tuple[float, ...]

    @classmethod
    def of(cls, values) -> Spread:
        return cls(tuple(float(v) for v in values))

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    def text(self, fmt: str = "{:.3f}") -> str:
        """The "median [min .. max]" of the reports."""
        return f"{fmt.format(self.median)} [{fmt.format(min(self.runs))} .. {fmt.format(max(self.runs))}]"

    def as_dict(self) -> dict:
        return {"median": self.median, "min": min(self.runs), "max": max(self.runs), "runs": list(self.runs)}


def spread(values) -> dict:
    """The JSON form of `Spread.of(values)`."""
    return Spread.of(values).as_dict()


def show(label: str, values, fmt: str = "{:.3f}", goal: str = "") -> str:
    """One report line: the label, the median and range, the goal, every run."""
    runs = ", ".join(fmt.format(v) for v in values)
    return f"  {label:<50} {Spread.of(values).text(fmt):<22} {goal:<13} runs: {runs}"


def interleave(
    count: int,
    runs: Mapping[str, Callable[[], T]],
    rotate: bool = True,
    done: Callable[[int, dict], None] | None = None,
) -> list[dict[str, T]]:
    """`count` rounds, each running every one of `runs` once.

    With `rotate`, round k starts k places further in, so a drift of the machine falls
    on a different run each round. Each round's results keep the order of `runs`.
    `done(k, results)` is called after round k.

    >>> interleave(2, {"a": lambda: 1, "b": lambda: 2})
    [{'a': 1, 'b': 2}, {'a': 1, 'b': 2}]
    """
    names, rounds = list(runs), []
    for number in range(count):
        shift = number % len(names) if rotate and names else 0
        got = {name: runs[name]() for name in names[shift:] + names[:shift]}
        rounds.append({name: got[name] for name in names})
        if done is not None:
            done(number, rounds[-1])
    return rounds


# -- CPU and memory --------------------------------------------------------------------------------
def process_tree() -> list[psutil.Process]:
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def tree_usage() -> dict[int, tuple[float, int]]:
    """{pid: (CPU seconds, resident bytes)} of this process and its descendants."""
    out = {}
    for proc in process_tree():
        with contextlib.suppress(psutil.Error):
            cpu = proc.cpu_times()
            out[proc.pid] = (cpu.user + cpu.system, proc.memory_info().rss)
    return out


def cpu_since(before: dict[int, tuple[float, int]], leave_out: set[int] = frozenset()) -> float:
    """CPU seconds the process tree used since `before`.

    Processes that ended since are not counted, so measure while the workers live.
    """
    now = tree_usage()
    return sum(cpu - before.get(pid, (0.0, 0))[0] for pid, (cpu, _) in now.items() if pid not in leave_out)


def tree_rss() -> int:
    return sum(rss for _, rss in tree_usage().values())


def tree_pss() -> tuple[int, int]:
    """Proportional set size of the tree, pages shared by workers counted once in all: the
    whole, and its anonymous and shared memory alone, without file pages (libraries, and the
    mapped shards: clean page cache the kernel may drop). The second is 0 where Linux's
    smaps_rollup is missing."""
    total = private = 0
    for proc in process_tree():
        with contextlib.suppress(psutil.Error, OSError):
            total += proc.memory_full_info().pss
            with open(f"/proc/{proc.pid}/smaps_rollup") as rollup:
                fields = dict(line.split()[:2] for line in rollup if line.startswith("Pss_"))
            private += (int(fields.get("Pss_Anon:", 0)) + int(fields.get("Pss_Shmem:", 0))) * 1024
    return total, private


def own_cpu_s(children: bool = False) -> float:
    """This process's CPU seconds, and with `children` those of its finished children."""
    cpu = psutil.Process().cpu_times()
    return cpu.user + cpu.system + (cpu.children_user + cpu.children_system if children else 0.0)


def cpu_of(processes: list[psutil.Process]) -> float:
    total = 0.0
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def threads_cpu() -> dict[int, tuple[str, float]]:
    """{thread id: (its kind, CPU seconds)} of this process's live threads."""
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    out = {}
    for thread in psutil.Process().threads():
        name = names.get(thread.id, "")
        kind = next((k for prefix, k in THREAD_KINDS.items() if name.startswith(prefix)), "other")
        out[thread.id] = (kind, thread.user_time + thread.system_time)
    return out


def cpu_by_kind(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per thread kind between two `threads_cpu`; ended threads are not counted."""
    out: dict[str, float] = {}
    for tid, (kind, cpu) in after.items():
        out[kind] = out.get(kind, 0.0) + cpu - before.get(tid, (kind, 0.0))[1]
    return out


class PeakRss:
    """The peak RSS of the process tree, polled in a thread while the block runs."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s, self.peak = interval_s, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.poll, name="peak-rss", daemon=True)

    def poll(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, tree_rss())
            self.stop.wait(self.interval_s)

    def __enter__(self) -> PeakRss:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, tree_rss())


# -- the run's surroundings ------------------------------------------------------------------------
@contextlib.contextmanager
def workdir(path: str | None, prefix: str) -> Iterator[Path]:
    """`path`, made if missing and kept; without one, a temp dir removed afterwards."""
    own = not path
    root = Path(path or tempfile.mkdtemp(prefix=prefix)).resolve()
    root.mkdir(parents=True, exist_ok=True)
    try:
        yield root
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)


def machine(**versions: str) -> dict:
    """The cores this process may use, Python's version, and the `versions` given."""
    return {"cores": len(os.sched_getaffinity(0)), "python": platform.python_version(), **versions}


def write_json(path: str | None, results: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {path}")
