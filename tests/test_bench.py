"""`dlstore bench`: runs on CPU on a tiny dataset and writes its JSON and plot; the advice logic.

No timed assertions: rates depend on the machine; the tests check that every number is
there, positive and consistent, not how big it is.
"""

from __future__ import annotations

import json

import pytest
from loader_support import write_dataset

from dlstore.bench import STAGES, BenchConfig, StageSplit, advise
from dlstore.cli import main as cli
from dlstore.errors import ConfigError
from dlstore.storage import open_store

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def dataset_url(tmp_path):
    url = f"file://{tmp_path}/store"
    write_dataset(open_store(url), [24, 30, 18, 28])
    return url


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

    verdict = report["verdict"]
    assert verdict["ratio"] == pytest.approx(verdict["delivered_images_per_s"] / verdict["demanded_images_per_s"])
    assert 0 <= verdict["stall_pct"] <= 100 and verdict["advice"]
    assert verdict["shared_cpu_images_per_s"] < min(verdict["delivered_images_per_s"], verdict["demanded_images_per_s"])

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


def test_advise_when_the_loader_keeps_up_but_cold_reads_are_slow():
    tips = advise(delivered=5000, cold_delivered=400, demanded=3000, workers=8, cores=8, warm=_split(decode=1.0))
    assert "keeps up" in tips[0]
    assert any("cold cache" in tip for tip in tips)
    assert not any("workers" in tip for tip in tips[1:])


def test_bench_config_rejects_nonsense():
    with pytest.raises(ConfigError, match="decode_on"):
        BenchConfig("file:///x", decode_on="gpu")
    with pytest.raises(ConfigError):
        BenchConfig("file:///x", batches=1)
    with pytest.raises(ConfigError):
        BenchConfig("file:///x", procs=())
    with pytest.raises(ConfigError):
        BenchConfig("file:///x", transform="none")
