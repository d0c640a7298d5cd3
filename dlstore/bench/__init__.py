"""Can the data path feed the accelerator? The loader's rate against the model's demand.

`run_bench` measures, on this machine:

* the **loader side**: img/s and MB/s of `dlstore.Loader` from a cold and a warm cache, for
  each batch size and worker count. One instrumented pass splits the time stage by stage.
* the **demand side**: the model's training-step rate on synthetic data already on the
  device, at the same batch size and precision.
* the **verdict**: delivered over demanded, the data stall to expect, and what would help.
* optionally a **scaling table** over process counts, each process a rank with its own loader.

The bench uses its own temporary cache under `cache_dir`, removed at the end. So "cold" is
really cold, and the training cache is left alone. With a `file://` store, "cold" reads the
store's files, often from the page cache, and copies them into the cache.

`config` says what to measure. `measure` times the loader, the stages and the demand, and
`scaling` several ranks. `report` holds the records, verdict and tables, and `plot` the PNG.
`run` has `run_bench`, the order of it all::

    report = run_bench(BenchConfig("swift://imagenet/train", batch_sizes=(128, 256)))
    print(format_report(report))
"""

from __future__ import annotations

from dlstore.bench.config import QUICK_DATA, BenchConfig, parse_int_list, size_or_auto
from dlstore.bench.plot import check_plot_path, plot_report
from dlstore.bench.report import (
    STAGES,
    BenchReport,
    LoaderResult,
    LoaderRun,
    ScalingRow,
    StageSplit,
    Verdict,
    advise,
    format_report,
)
from dlstore.bench.run import run_bench

__all__ = [
    "QUICK_DATA",
    "STAGES",
    "BenchConfig",
    "BenchReport",
    "LoaderResult",
    "LoaderRun",
    "ScalingRow",
    "StageSplit",
    "Verdict",
    "advise",
    "format_report",
    "parse_int_list",
    "check_plot_path",
    "plot_report",
    "run_bench",
    "size_or_auto",
]
