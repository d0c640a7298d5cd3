"""`dlstore train`, `demo`, `bench` and `doctor`: the applications on top.

Each loads torch only when it runs, so the other commands start quickly.
"""

from __future__ import annotations

import argparse
import logging
import os

from dlstore.config import DataConfig, writable_file
from dlstore.doctor import add_doctor_arguments, exit_code, format_check, options_from_args, run_doctor
from dlstore.train.config import add_train_arguments, config_from_args

__all__ = ["APP_COMMANDS", "BENCH_OWN_SETTINGS"]


def _cmd_train(args: argparse.Namespace) -> int:
    from dlstore.train import main as train

    if args.verbose == 0:
        logging.getLogger("dlstore.train").setLevel(logging.INFO)  # checkpoints and eval results
    return train(config_from_args(args))


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a torchvision model from a dataset URL (DDP under torchrun or srun), checkpointing to a store URL",
        description="Exit codes: 0 done, 75 stopped by SIGTERM/SIGUSR1 after a checkpoint (rerun with --resume auto).",
    )
    add_train_arguments(p)
    p.set_defaults(func=_cmd_train)


def _cmd_demo(args: argparse.Namespace) -> int:
    from dlstore.demo import DemoConfig, run_demo

    run_demo(
        DemoConfig(workdir=args.workdir or "", store_url=args.store or "", epochs=args.epochs, train=not args.no_train)
    )
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the main job on generated data in a local store: convert, verify, load, train")
    p.add_argument("--workdir", help="keep everything here (default: a temporary folder, removed afterwards)")
    p.add_argument("--store", help="store URL for the shards (default: file://WORKDIR/store)")
    p.add_argument("--epochs", type=int, default=2, help="epochs of the demo's training run (default 2)")
    p.add_argument(
        "--no-train",
        action="store_true",
        help="no training run: convert, verify and load, then the loader-vs-demand verdict (which still times"
        " the model's own speed on synthetic data)",
    )
    p.set_defaults(func=_cmd_demo)


# Data settings the bench sweeps, such as batch sizes and workers, or keeps apart, as its cache.
BENCH_OWN_SETTINGS = ("batch_size", "workers", "cache_dir", "cache_limit")


def _cmd_bench(args: argparse.Namespace) -> int:
    from dlstore.bench import (
        QUICK_DATA,
        BenchConfig,
        check_plot_path,
        format_report,
        parse_int_list,
        plot_report,
        run_bench,
        size_or_auto,
    )

    data = DataConfig.from_args(args.url, args, exclude=BENCH_OWN_SETTINGS, **(QUICK_DATA if args.quick else {}))
    changes: dict = {}
    for name, parse in (("batch_sizes", parse_int_list), ("workers", parse_int_list), ("procs", parse_int_list)):
        if getattr(args, name) is not None:
            changes[name] = parse(getattr(args, name))
    if args.engines is not None:
        changes["engines"] = tuple(part.strip() for part in args.engines.split(",") if part.strip())
    for name in ("batches", "stage_batches", "model", "device", "amp", "demand_steps"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.cache_limit is not None:
        changes["cache_limit"] = size_or_auto(args.cache_limit)
    changes.update(
        channels_last=not args.no_channels_last,
        compile=args.compile,
        demand=not args.no_demand,
        cache_dir=args.cache_dir or "",
    )
    config = BenchConfig.quick(data, **changes) if args.quick else BenchConfig(data, **changes)
    if args.json:  # before the run: a path that cannot be written would lose its results
        writable_file(args.json, "--json")
    if args.plot:
        check_plot_path(args.plot)
    if not args.quiet:
        logging.getLogger("dlstore.bench").setLevel(logging.INFO)  # what is being measured, as it goes
    report = run_bench(config)
    print(format_report(report))
    if args.json:
        report.write_json(args.json)
        print(f"wrote {args.json}")
    if args.plot:
        plot_report(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="can the data path feed the GPU? loader img/s (cold/warm, by stage) vs the model's training rate",
        description="Loader img/s and MB/s from a cold and a warm cache with the time split by stage, the "
        "model's training-step rate on synthetic data, and the verdict: delivered / demanded, the data stall "
        "to expect, and what would help. Example: dlstore bench swift://imagenet/train --batch-sizes 128,256 "
        "--workers 4,8 --json bench.json --plot bench.png",
    )
    p.add_argument("url", help="dataset URL (where index.json is)")
    p.add_argument("--quick", action="store_true", help="a few seconds: batch 32, 64 px, resnet18, 6 batches per pass")
    p.add_argument("--batch-sizes", metavar="N,N", help="batch sizes to sweep (default 256; --quick 32)")
    p.add_argument("--workers", metavar="N,N", help="worker counts to sweep (default: one per core)")
    p.add_argument("--procs", metavar="N,N", help="process counts for a scaling table, e.g. 1,2,4 (default: none)")
    p.add_argument(
        "--engines",
        metavar="E,E",
        help="loader engines each worker count runs on: auto (default: what the trainer gets), or threads,processes "
        "to see which is faster here",
    )
    p.add_argument("--batches", type=int, help="batches per timed loader pass (default 20; --quick 6)")
    p.add_argument("--stage-batches", type=int, help="batches of the per-stage timing pass (default 2)")
    p.add_argument("--model", help="torchvision model for the demand side (default resnet50; --quick resnet18)")
    p.add_argument("--device", help="auto (default), cuda, cuda:N or cpu")
    p.add_argument("--amp", choices=["auto", "bf16", "fp16", "none"], help="precision (default auto: bf16 on GPUs)")
    p.add_argument("--no-channels-last", action="store_true", help="NCHW-contiguous model and images")
    p.add_argument("--compile", action="store_true", help="torch.compile the model for the demand side")
    p.add_argument("--demand-steps", type=int, help="timed training steps (default 20 on a GPU, 3 on a CPU)")
    p.add_argument("--no-demand", action="store_true", help="measure the loader only")
    p.add_argument("--cache-dir", help="where the bench's temporary cache goes (default: the system temp dir)")
    p.add_argument("--cache-limit", help="its size limit (default: enough for the dataset)")
    p.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot img/s vs workers/batch size with the demand line")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    # The data settings as `dlstore train` takes them, but the bench's own sweeps and cache.
    DataConfig.add_arguments(p, exclude=BENCH_OWN_SETTINGS)
    p.set_defaults(func=_cmd_bench)


def _cmd_doctor(args: argparse.Namespace) -> int:
    checks = run_doctor(options_from_args(args), dict(os.environ), report=lambda c: print(format_check(c), flush=True))
    return exit_code(checks)


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this node's set-up for a run (credentials, store, cache, /dev/shm, torch, CUDA, launcher)",
        description="One line per check (ok / warn / FAIL) with the fix below; exit code 1 when anything FAILs.",
    )
    add_doctor_arguments(p)
    p.set_defaults(func=_cmd_doctor)


APP_COMMANDS = [_add_train, _add_demo, _add_bench, _add_doctor]
