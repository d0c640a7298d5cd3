"""`dlstore bench`: runs on CPU on a tiny dataset and writes its JSON and plot; the advice logic.

No timed assertions: rates depend on the machine; the tests check that every number is
there, positive and consistent, not how big it is.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from dlstore.bench import STAGES, BenchConfig, BenchReport, LoaderResult, LoaderRun, StageSplit, advise, format_report
from dlstore.bench.report import verdict_for
from dlstore.cli import main as cli
from dlstore.config import DataConfig
from dlstore.errors import ConfigError, NotFound
from dlstore.storage import open_store
from tests.support.loader_support import write_dataset

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def dataset_url(tmp_path):
    url = f"file://{tmp_path}/store"
    write_dataset(open_store(url), [24, 30, 18, 28])
    return url


@pytest.mark.parametrize(
    ("flag", "name", "said"),
    [
        ("--json", "no-folder/bench.json", "no folder"),
        ("--json", ".", "it is a folder"),
        ("--plot", "no-folder/bench.png", "no folder"),
        ("--plot", "bench.xyz", "name a file ending in one of"),
    ],
)
def test_bench_refuses_an_output_it_could_not_write_before_it_runs(dataset_url, tmp_path, capsys, flag, name, said):
    """`--json` or `--plot` to a path that cannot be written ended the whole bench, after it
    ran, in a traceback (FileNotFoundError, matplotlib's ValueError): the results were lost.
    Now it is refused at once, saying why, and nothing is measured."""
    argv = ["bench", dataset_url, "--quick", "--image-size", "32", "--cache-dir", str(tmp_path / "c"), "-q"]
    assert cli([*argv, flag, str(tmp_path / name)]) == 2
    captured = capsys.readouterr()
    assert said in captured.err and flag in captured.err
    assert "loader" not in captured.out  # refused before any pass ran


def test_bench_cli_writes_json_and_plot(dataset_url, tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    bench_tmp = tmp_path / "bench-cache"
    bench_tmp.mkdir()
    argv = ["bench", dataset_url, "--quick", "--batch-sizes", "8,16", "--workers", "0,1", "--procs", "1,2"]
    argv += ["--image-size", "32", "--cache-dir", str(bench_tmp), "--json", str(out_json), "--plot", str(out_png), "-q"]
    assert cli(argv) == 0

    printed = capsys.readouterr().out
    for heading in ("loader", "stages", "demand", "scaling", "verdict"):
        assert heading in printed
    report = json.loads(out_json.read_text())
    assert report["dataset"]["samples"] == 100 and report["dataset"]["shards"] == 4
    assert report["environment"]["device"] == "cpu"

    rows = {(r["batch_size"], r["workers"]): r for r in report["loader"]}
    assert set(rows) == {(8, 0), (8, 1), (16, 0), (16, 1)}
    for row in rows.values():
        for cache in ("cold", "warm"):
            run = row[cache]
            assert run["images"] > 0 and run["seconds"] > 0 and run["images_per_s"] > 0 and run["mb_per_s"] > 0
            assert run["first_batch_s"] > 0
        # Each cold pass starts from an empty cache: it fetches, on at least one connection,
        # and no shard is fetched twice over the cold and the warm pass (the cache holds them all).
        cold, warm = row["cold"], row["warm"]
        assert cold["bytes_fetched"] > 0 and cold["fetch_mb_per_s"] > 0 and cold["connections"] >= 1
        assert cold["bytes_fetched"] + warm["bytes_fetched"] <= report["dataset"]["bytes"]
        assert warm["connections"] == 0
        assert cold["engine"] == warm["engine"] == "threads"  # what engine="auto" runs on a CPU
    assert "cold cache" in printed and "first batch s" in printed and "threads" in printed

    stages = {s["cache"]: s for s in report["stages"]}
    assert set(stages) == {"cold", "warm"}
    for split in stages.values():
        assert set(split["seconds"]) == set(STAGES) and split["images"] > 0
        assert split["seconds"]["decode"] > 0 and split["worker_images_per_s"] > 0
    # Cold fetched every shard it read; warm found them all cached.
    assert stages["cold"]["bytes_fetched"] > 0 and stages["warm"]["bytes_fetched"] == 0

    assert [d["for_batch_size"] for d in report["demand"]] == [8, 16]
    assert all(d["images_per_s"] > 0 and d["model"] == "resnet18" for d in report["demand"])

    assert [r["procs"] for r in report["scaling"]] == [1, 2]
    assert report["scaling"][0]["speedup"] == pytest.approx(1.0)
    assert all(r["backend"] == "gloo" and len(r["per_rank_images_per_s"]) == r["procs"] for r in report["scaling"])

    # The verdict is that of the configuration that delivered most, with that row's rate and
    # the demand measured at that row's batch size (the arithmetic is checked in
    # test_verdict_arithmetic_on_known_rates).
    verdict = report["verdict"]
    best = max(report["loader"], key=lambda r: r["warm"]["images_per_s"])
    assert (verdict["batch_size"], verdict["workers"]) == (best["batch_size"], best["workers"])
    assert verdict["delivered_images_per_s"] == best["warm"]["images_per_s"]
    assert verdict["engine"] == best["warm"]["engine"] == "threads"
    demand = {d["for_batch_size"]: d["images_per_s"] for d in report["demand"]}
    assert verdict["demanded_images_per_s"] == demand[best["batch_size"]]
    assert len(report["verdicts"]) == len(report["loader"]) and verdict["advice"]

    assert out_png.read_bytes()[:8] == PNG_MAGIC
    assert list(bench_tmp.iterdir()) == []  # the bench's own cache is gone


def test_bench_with_decode_on_the_device_runs_on_cpu(dataset_url, tmp_path, capsys):
    """The GPU-decode path of the bench, on the CPU (torchvision's decoder stands in for nvJPEG)."""
    out_json = tmp_path / "bench.json"
    argv = ["bench", dataset_url, "--quick", "--no-demand", "--decode-on", "device", "--batch-sizes", "8"]
    argv += ["--workers", "1", "--image-size", "32", "--cache-dir", str(tmp_path), "--json", str(out_json), "-q"]
    assert cli(argv) == 0
    report = json.loads(out_json.read_text())
    assert report["config"]["decode_on"] == "device"
    (row,) = report["loader"]
    assert row["warm"]["images"] > 0 and row["warm"]["images_per_s"] > 0
    # The stage table names where the decode happens: not a free decode and a slow copy.
    shown = capsys.readouterr().out
    assert "device decode" in shown and "decode and augment run on the device" in shown
    assert "host-to-device" not in shown


def test_bench_runs_each_worker_count_on_each_engine_asked_for(dataset_url, tmp_path, capsys):
    """`--engines threads,processes`: a row per worker count and engine, each run on the engine
    it names (not on what auto would pick), in the table, the JSON, the plot and the verdict."""
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["bench", dataset_url, "--quick", "--no-demand", "--batch-sizes", "8", "--workers", "1,2"]
    argv += ["--engines", "threads,processes", "--image-size", "32", "--cache-dir", str(tmp_path)]
    argv += ["--json", str(out_json), "--plot", str(out_png), "-q"]
    assert cli(argv) == 0
    report = json.loads(out_json.read_text())
    assert report["config"]["engines"] == ["threads", "processes"]
    rows = [(r["workers"], r["cold"]["engine"], r["warm"]["engine"]) for r in report["loader"]]
    assert rows == [(1, "threads", "threads"), (1, "processes", "processes")] + [
        (2, "threads", "threads"),
        (2, "processes", "processes"),
    ]
    assert all(r["warm"]["images_per_s"] > 0 and r["cold"]["images"] > 0 for r in report["loader"])
    printed = capsys.readouterr().out
    assert "processes" in printed and "threads" in printed
    assert out_png.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ConfigError, match="engines"):
        BenchConfig("file:///x", engines=("gpu",))
    with pytest.raises(ConfigError, match="engines"):
        BenchConfig("file:///x", engines=())


def test_cold_cache_table_shows_fetches_connections_and_first_batch():
    cold = LoaderRun(4, 100, 1.0, 0.5, 100.0, 1.0, first_batch_s=0.42, bytes_fetched=30_000_000, connections=24)
    cold = dataclasses.replace(cold, fetch_mb_per_s=20.0, engine="processes")
    report = BenchReport(
        config={"batches": 4, "transform": {"preset": "eval"}, "image_size": 32},
        environment={"device": "cpu", "device_name": "cpu", "cores": 2},
        dataset={"url": "file:///x", "samples": 100, "shards": 4, "mean_sample_bytes": 3000.0},
    )
    report.loader = [LoaderResult(batch_size=16, workers=2, cold=cold, warm=_run(100.0))]
    text = format_report(report)
    lines = text[text.index("cold cache") :].splitlines()
    assert lines[1].split() == [
        "batch",
        "workers",
        "engine",
        "fetched",
        "MB",
        "fetch",
        "MB/s",
        "connections",
        "first",
        "batch",
        "s",
    ]
    assert lines[3].split() == ["16", "2", "processes", "30.0", "20.0", "24", "0.42"]


def _split(**ms: float) -> StageSplit:
    per_stage = dict.fromkeys(STAGES, 0.0) | {k: v / 1000 for k, v in ms.items()}
    return StageSplit(cache="warm", batch_size=256, images=1, seconds=per_stage)


def test_advise_says_more_workers_when_cores_are_idle():
    warm = _split(read=0.1, decode=1.2, augment=0.6, collate=0.1)  # 500 img/s per worker
    tips = advise(delivered=900, cold_delivered=900, demanded=3000, workers=2, cores=16, warm=warm)
    assert "0.30" in tips[0] and "70%" in tips[0]
    assert any(tip.startswith("More workers") and "7 workers" in tip for tip in tips)


def test_advise_on_a_cpu_bound_gpu_machine_points_at_gpu_decode_and_smaller_images():
    warm = _split(read=0.1, decode=3.0, augment=0.8, collate=0.1)  # 250 img/s per worker
    tips = advise(
        delivered=1800,
        cold_delivered=1700,
        demanded=3000,
        workers=8,
        cores=8,
        warm=warm,
        cuda=True,
        gpu_decode_images_per_s=9000,
        mean_source_pixels=500 * 375,
        image_size=128,
    )
    text = "\n".join(tips)
    assert "CPU-bound" in text and "GPU decode" in text and "9000 img/s" in text
    assert "--resize-max-side" in text


def test_advise_names_worker_processes_when_many_decode_threads_fall_short():
    split = _split(decode=1.0)
    common = dict(delivered=1500, cold_delivered=1500, demanded=3000, cores=16, warm=split)
    tips = advise(workers=14, engine="threads", **common)
    assert any("engine='processes'" in tip and "--engines threads,processes" in tip for tip in tips)
    for quiet in (dict(workers=14, engine="processes"), dict(workers=4, engine="threads")):
        assert not any("engine='processes'" in tip for tip in advise(**quiet, **common))
    assert not any(
        "engine='processes'" in tip for tip in advise(workers=14, engine="threads", **{**common, "cores": 2})
    )
    # Threads that build rows in C take the GIL once a chunk: nothing to advise.
    assert not any(
        "engine='processes'" in tip for tip in advise(workers=14, engine="threads", native_rows=True, **common)
    )
    # A loader that keeps up needs no advice on its engine.
    kept_up = advise(workers=14, engine="threads", **{**common, "delivered": 4000})
    assert not any("engine='processes'" in tip for tip in kept_up)


def test_advise_when_the_loader_keeps_up_but_cold_reads_are_slow():
    tips = advise(delivered=5000, cold_delivered=400, demanded=3000, workers=8, cores=8, warm=_split(decode=1.0))
    assert "keeps up" in tips[0]
    assert any("cold cache" in tip for tip in tips)
    assert not any("workers" in tip for tip in tips[1:])


def _run(rate: float) -> LoaderRun:
    return LoaderRun(batches=4, images=100, seconds=100 / rate, startup_s=0.1, images_per_s=rate, mb_per_s=1.0)


@pytest.mark.parametrize(
    ("delivered", "cold", "demanded", "ratio", "stall", "shared"),
    [
        (300.0, 150.0, 100.0, 3.0, 0.0, 75.0),  # the loader keeps up; cold reads too
        (50.0, 25.0, 100.0, 0.5, 50.0, 100 / 3),  # it does not: half of each step waits
    ],
)
def test_verdict_arithmetic_on_known_rates(delivered, cold, demanded, ratio, stall, shared):
    report = BenchReport(config={}, environment={}, dataset={})
    row = LoaderResult(batch_size=16, workers=2, cold=_run(cold), warm=_run(delivered))
    report.demand = [{"for_batch_size": 8, "images_per_s": 1.0}, {"for_batch_size": 16, "images_per_s": demanded}]
    verdict = verdict_for(report, row, BenchConfig("file:///x"), "cpu")
    assert verdict.demanded_images_per_s == demanded  # the demand at the row's batch size
    assert verdict.ratio == pytest.approx(ratio) and verdict.stall_pct == pytest.approx(stall)
    assert verdict.cold_ratio == pytest.approx(cold / demanded)
    assert verdict.cold_stall_pct == pytest.approx(max(0.0, 100 * (1 - cold / demanded)))
    # On a CPU, loader and model take turns on the same cores: the combined rate.
    assert verdict.shared_cpu_images_per_s == pytest.approx(shared)
    assert verdict_for(report, row, BenchConfig("file:///x"), "cuda").shared_cpu_images_per_s is None


def test_bench_config_rejects_nonsense():
    with pytest.raises(ConfigError, match="decode_on"):
        BenchConfig(DataConfig("file:///x", decode_on="gpu"))
    with pytest.raises(ConfigError):
        BenchConfig("file:///x", batches=1)
    with pytest.raises(ConfigError):
        BenchConfig("file:///x", procs=())
    with pytest.raises(ConfigError):
        BenchConfig(DataConfig("file:///x", transform="none"))


def test_more_scaling_processes_than_gpus_are_refused_before_any_measurement(dataset_url, monkeypatch):
    """Each process of the scaling rows has a GPU of its own on CUDA: the rest ran on the CPU
    (gloo) under a table naming NCCL, compared with the GPU's rate."""
    import torch

    from dlstore.bench.scaling import check_procs_fit

    cfg = BenchConfig(dataset_url, procs=(1, 2, 4))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="--procs 4 needs 4 GPUs, one per process; this node has 2"):
        check_procs_fit(cfg, torch.device("cuda", 0))
    check_procs_fit(dataclasses.replace(cfg, procs=(1, 2)), torch.device("cuda", 0))
    check_procs_fit(cfg, torch.device("cpu"))  # CPU processes: as many as asked


def test_a_model_name_with_a_typo_is_refused_before_any_measurement(tmp_path):
    from dlstore.bench.run import run_bench

    cfg = BenchConfig(f"file://{tmp_path}/no-such-dataset", model="resnet5o")
    with pytest.raises(ConfigError, match="unknown model 'resnet5o'"):
        run_bench(cfg)
    run_bench_without_demand = dataclasses.replace(cfg, demand=False)
    with pytest.raises(NotFound):  # no model is built then: the name is not checked
        run_bench(run_bench_without_demand)
