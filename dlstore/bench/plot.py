"""`plot_report`: the bench's numbers as a PNG, with matplotlib from the "train" extra."""

from __future__ import annotations

import os

from dlstore.bench.report import BenchReport
from dlstore.config import writable_file
from dlstore.errors import ConfigError

__all__ = ["check_plot_path", "plot_report"]

_COLOURS = [f"C{i}" for i in range(10)]  # matplotlib's default cycle, by name


def check_plot_path(path: str, flag: str = "--plot") -> None:
    """A ConfigError now, before the bench runs, for a plot that could not be written after it.
    A late failure would lose the results. Causes: no matplotlib, an unknown format, a folder
    that is missing or not writable."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError(f"{flag} needs matplotlib: pip install matplotlib (or 'dlstore[train]')") from None
    formats = Figure().canvas.get_supported_filetypes()
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if suffix not in formats:
        raise ConfigError(f"cannot plot to {path} ({flag}): name a file ending in one of {', '.join(sorted(formats))}")
    writable_file(path, flag)


def plot_report(report: BenchReport, path: str) -> None:
    """Loader img/s against workers, or batch size when only that varies: warm solid, cold dashed.
    The model's demand shows as dotted lines, and the scaling table beside, if measured.

    >>> plot_report(run_bench(BenchConfig.quick("file:///tmp/demo/train")), "bench.png")   # doctest: +SKIP
    """
    # matplotlib is optional and slow to import: only a plot needs it. No pyplot, so no global
    # state and no display.
    from matplotlib.figure import Figure

    panels = 2 if report.scaling else 1
    fig = Figure(figsize=(6.5 * panels, 4.5), layout="constrained")
    _plot_loader(fig.add_subplot(1, panels, 1), report)
    if report.scaling:
        _plot_scaling(fig.add_subplot(1, 2, 2), report)
    fig.savefig(path, dpi=110)


def _plot_loader(ax, report: BenchReport) -> None:
    batch_sizes = sorted({r.batch_size for r in report.loader})
    worker_counts = sorted({r.workers for r in report.loader})
    demand = {d["for_batch_size"]: d["images_per_s"] for d in report.demand if "images_per_s" in d}
    if len(worker_counts) == 1 and len(batch_sizes) > 1:
        values = _plot_by_batch_size(ax, report, worker_counts, batch_sizes, demand)
    else:
        values = _plot_by_workers(ax, report, worker_counts, batch_sizes, demand)
    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) > 30:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_ylabel("images/s")
    ax.set_title(f"loader vs demand ({report.environment['device_name']})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


def _engines(report: BenchReport) -> list[str]:
    """The engines the rows ran on, each named in the legend only when there are several."""
    return sorted({r.warm.engine for r in report.loader})


def _plot_by_batch_size(ax, report: BenchReport, worker_counts, batch_sizes, demand: dict) -> list[float]:
    values: list[float] = []
    engines = _engines(report)
    lines = [(w, e) for w in worker_counts for e in engines]
    for colour, (workers, engine) in zip(_COLOURS, lines):
        rows = sorted(
            (r for r in report.loader if r.workers == workers and r.warm.engine == engine), key=lambda r: r.batch_size
        )
        xs = [r.batch_size for r in rows]
        name = f"{workers} workers" + (f", {engine}" if len(engines) > 1 else "")
        ax.plot(xs, [r.warm.images_per_s for r in rows], "o-", color=colour, label=f"{name}, warm")
        ax.plot(xs, [r.cold.images_per_s for r in rows], "s--", color=colour, label=f"{name}, cold")
        values += [r.warm.images_per_s for r in rows] + [r.cold.images_per_s for r in rows]
    if demand:
        xs = sorted(demand)
        ax.plot(xs, [demand[x] for x in xs], "k:", linewidth=2, label="GPU demand")
        values += list(demand.values())
    ax.set_xlabel("batch size")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    return values


def _plot_by_workers(ax, report: BenchReport, worker_counts, batch_sizes, demand: dict) -> list[float]:
    values: list[float] = []
    engines = _engines(report)
    lines = [(b, e) for b in batch_sizes for e in engines]
    for colour, (batch_size, engine) in zip(_COLOURS, lines):
        rows = sorted(
            (r for r in report.loader if r.batch_size == batch_size and r.warm.engine == engine),
            key=lambda r: r.workers,
        )
        xs = [r.workers for r in rows]
        name = f"batch {batch_size}" + (f", {engine}" if len(engines) > 1 else "")
        ax.plot(xs, [r.warm.images_per_s for r in rows], "o-", color=colour, label=f"{name}, warm")
        ax.plot(xs, [r.cold.images_per_s for r in rows], "s--", color=colour, label=f"{name}, cold")
        values += [r.warm.images_per_s for r in rows] + [r.cold.images_per_s for r in rows]
        if batch_size in demand and engine == engines[0]:
            ax.axhline(
                demand[batch_size], color=colour, linestyle=":", linewidth=2, label=f"demand, batch {batch_size}"
            )
            values.append(demand[batch_size])
    ax.set_xlabel("workers")
    ax.set_xticks(worker_counts)
    return values


def _plot_scaling(ax, report: BenchReport) -> None:
    procs = [r.procs for r in report.scaling]
    rates = [r.images_per_s for r in report.scaling]
    per_proc = rates[0] / procs[0]
    ax.plot(procs, rates, "o-", label="measured")
    ax.plot(procs, [per_proc * p for p in procs], "k--", alpha=0.5, label="linear")
    for r in report.scaling:
        ax.annotate(f"{r.efficiency:.0%}", (r.procs, r.images_per_s), textcoords="offset points", xytext=(4, -12))
    ax.set_xlabel(f"processes ({report.scaling[0].backend})")
    ax.set_ylabel("images/s (all processes)")
    ax.set_xticks(procs)
    ax.set_ylim(bottom=0)
    ax.set_title("scaling over processes")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
