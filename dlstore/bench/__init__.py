"""Can the data path feed the accelerator? The loader's rate against the model's demand.

`run_bench` measures, on this machine:

* the **loader side**: img/s and MB/s of `dlstore.Loader` from a cold cache (every shard
  fetched from the store) and from a warm one (every shard already cached), for each batch
  size and worker count asked for; plus where the time goes, stage by stage (fetch, read,
  decode, augment, collate, host-to-device), from one instrumented single-process pass;
* the **demand side**: the training-step rate of the model on synthetic data already on the
  device (`dlstore.train.demand.measure_training_rate`), at the same batch size and precision;
* the **verdict**: delivered ÷ demanded, the data stall to expect, and what would help
  (more workers, GPU decode, smaller stored images), read off the stage split;
* optionally a **scaling table** over process counts (gloo on CPU, NCCL on GPUs), each
  process a data-parallel rank running its own loader.

The bench uses its own temporary cache directory (under `cache_dir`, removed at the end), so
"cold" really is cold and the training cache is left alone. With a `file://` store "cold"
reads the store's files (often from the page cache) and copies them into the cache.

Where each part lives: `config` (what to measure), `measure` (the loader, the stage split,
the demand), `scaling` (several ranks), `report` (the records, the verdict and the terminal
tables), `plot` (the PNG) and `run` (`run_bench`, the order of it all)::

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
