"""Converters end to end: real on-disk formats (made by dlstore.demo.datagen) into file://, Swift and S3
stores; every input exactly once with its label, reproducible bytes, resume, verify, index."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dlstore.cli import main as cli
from dlstore.config import StoreConfig
from dlstore.convert import (
    ConvertOptions,
    SourceItem,
    convert,
    index_dataset,
    list_source,
    verify_dataset,
)
from dlstore.convert.arrays import ArrayReader
from dlstore.convert.build import BuildContext, BuildStopped, Counters, ShardBuilder
from dlstore.convert.shard_plan import plan_tasks
from dlstore.demo.datagen import make_cifar10, make_imagefolder, make_imagenet, make_mnist
from dlstore.errors import ConfigError, CorruptSample, CorruptShard, DlstoreError, FormatError
from dlstore.format.checksums import checksum_of
from dlstore.format.manifest import MANIFEST_NAME, Manifest, load_sample_index
from dlstore.format.sample_index import SampleIndex, sample_digest
from dlstore.format.shards import IMAGE_FIELDS, image_field, iter_samples, read_sample
from dlstore.storage import open_store
from tests.support import convert_faults
from tests.support.convert_faults import FAULTS
from tests.support.loader_support import folder_with_a_jpeg_damaged_below

pytestmark = pytest.mark.compat  # run again against Debian's Swift 2.30 (tools/run_tests.sh)
SMALL = (48, 40)
try:
    import scipy.io  # noqa: F401  (the ImageNet devkit's meta.mat is a MATLAB file)

    HAVE_SCIPY = True
except ImportError:
    HAVE_SCIPY = False


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Small datasets in every real layout, made once for the module."""
    root = tmp_path_factory.mktemp("sources")
    made = {
        "imagenet": make_imagenet(
            root / "imagenet", num_classes=4, train_per_class=6, val_per_class=3, image_size=SMALL, corrupt=2
        ),
        "imagenet_tars": make_imagenet(
            root / "imagenet_tars",
            num_classes=4,
            train_per_class=6,
            val_per_class=3,
            image_size=SMALL,
            corrupt=2,
            layout="tars",
        ),
        "imagenet_txt": make_imagenet(
            root / "imagenet_txt", num_classes=3, train_per_class=1, val_per_class=3, image_size=SMALL, val_layout="txt"
        ),
        "imagenet_valdirs": make_imagenet(
            root / "imagenet_valdirs",
            num_classes=3,
            train_per_class=1,
            val_per_class=3,
            image_size=SMALL,
            val_layout="folders",
        ),
        "imagenet_devkit": make_imagenet(
            root / "imagenet_devkit",
            num_classes=3,
            train_per_class=1,
            val_per_class=3,
            image_size=SMALL,
            val_layout="devkit",
            layout="tars",
        )
        if HAVE_SCIPY
        else None,
        "imagefolder": make_imagefolder(root / "imagefolder", formats=("jpg", "png", "webp", "bmp", "JPEG"), corrupt=2),
        "cifar10": make_cifar10(root / "cifar10", per_batch=8, test=10),
        "cifar10_tgz": make_cifar10(root / "cifar10_tgz", per_batch=8, test=10, archive=True),
        "mnist": make_mnist(root / "mnist", train=30, test=12),
        "mnist_raw": make_mnist(root / "mnist_raw", train=30, test=12, gz=False),
    }
    return made


def read_dataset(url: str, config: StoreConfig | None = None) -> tuple[Manifest, list[dict]]:
    """The manifest and every sample of a dataset, read shard by shard through the streaming reader."""
    store = open_store(url, config)
    manifest = Manifest.load(store)
    samples = []
    for shard in manifest.shards:
        got = list(iter_samples(store.get(shard.name)))
        assert len(got) == shard.samples
        for sample in got:
            sample["__shard__"] = shard.name
        samples += got
    return manifest, samples


def check_exactly_once(url: str, expected: list[tuple[str, int]], config: StoreConfig | None = None) -> list[dict]:
    manifest, samples = read_dataset(url, config)
    seen = [(json.loads(s["json"])["source"], int(s["cls"])) for s in samples]
    assert Counter(source for source, _ in seen).most_common(1)[0][1] == 1, "an input appears twice"
    assert sorted(seen) == sorted(expected)
    for sample in samples:
        meta = json.loads(sample["json"])
        assert manifest.classes[int(sample["cls"])] == meta["class"]
    assert manifest.total_samples == len(expected)
    return samples


def files_of(path: Path) -> dict[str, bytes]:
    """Every object of a file:// dataset, as the store lists them (a `kill -9` can leave the local
    store's hidden `.dlstore-tmp-*` files behind; they are no part of the dataset)."""
    store = open_store(f"file://{path}")
    return {info.key: store.get_bytes(info.key) for info in store.list("")}


OPTS = ConvertOptions(samples_per_shard=7, workers=1)


# -- every format, every layout -----------------------------------------------------------------
def test_imagenet_folders_train(data, tmp_path):
    made = data["imagenet"]
    summary = convert("imagenet", made.root, f"file://{tmp_path}/train", OPTS)
    assert sorted(s.id for s in summary.skipped) == sorted(made.corrupt["train"])
    samples = check_exactly_once(f"file://{tmp_path}/train", made.samples["train"])
    manifest = summary.manifest
    assert list(manifest.classes) == made.classes and manifest.fields == ("cls", "jpg", "json")
    assert manifest.label_field == "cls" and manifest.created.source_format == "imagenet"
    # 26 inputs cut into shards of 7, 7, 7, 5 before the 2 corrupt ones were skipped.
    assert summary.shards == 4 and sum(s.samples for s in manifest.shards) == 24
    # The global shuffle mixes classes: no shard holds a single class.
    by_shard: dict[str, set[int]] = {}
    for s in samples:
        by_shard.setdefault(s["__shard__"], set()).add(int(s["cls"]))
    assert all(len(classes) > 1 for classes in by_shard.values())
    # JPEGs are stored as they were.
    first = next(s for s in samples if json.loads(s["json"])["source"] == made.samples["train"][0][0])
    assert first["jpg"] == (made.root / "train" / made.samples["train"][0][0]).read_bytes()
    assert verify_dataset(f"file://{tmp_path}/train", deep=True).ok


def test_listing_the_imagenet_train_tar_reads_headers_not_images(data, monkeypatch):
    """The per-class tars inside the train tar are listed from their headers. The window the
    listing reads them through had no `tell`, so it was read as a stream: every image's bytes,
    the whole 147 GB tar before the first shard (and at every resume)."""
    from dlstore.convert.imagenet import _FileWindow

    read, real = [0], _FileWindow.read

    def counting(self, n=-1):
        data = real(self, n)
        read[0] += len(data)
        return data

    monkeypatch.setattr(_FileWindow, "read", counting)
    source = list_source("imagenet", data["imagenet_tars"].root / "ILSVRC2012_img_train.tar")
    images = sum(item.size for item in source.items)
    assert source.items and read[0] <= 1024 * len(source.items) < images, (read[0], images)  # headers only


def test_a_window_seeks_as_a_file_does(tmp_path):
    from dlstore.convert.imagenet import _FileWindow

    path = tmp_path / "f"
    path.write_bytes(bytes(range(100)))
    with open(path, "rb") as file:
        window = _FileWindow(file.fileno(), 10, 50)
        assert window.seek(0, os.SEEK_END) == 50 and window.tell() == 50 and window.read(5) == b""
        assert window.seek(-5, os.SEEK_END) == 45 and window.read() == bytes(range(55, 60))
        assert window.seek(3) == 3 and window.seek(2, os.SEEK_CUR) == 5 and window.read(2) == bytes([15, 16])


def test_imagenet_tars_give_the_same_shards_as_folders(data, tmp_path):
    for split in ("train", "val"):
        options = dataclasses.replace(OPTS, split=split)
        convert("imagenet", data["imagenet"].root, f"file://{tmp_path}/folders-{split}", options)
        summary = convert("imagenet", data["imagenet_tars"].root, f"file://{tmp_path}/tars-{split}", options)
        check_exactly_once(f"file://{tmp_path}/tars-{split}", data["imagenet_tars"].samples[split])
        folders, tars = files_of(tmp_path / f"folders-{split}"), files_of(tmp_path / f"tars-{split}")
        assert {k: v for k, v in folders.items() if k.endswith((".tar", ".idx"))} == {
            k: v for k, v in tars.items() if k.endswith((".tar", ".idx"))
        }
        assert summary.manifest.created.source == f"ILSVRC2012_img_{split}.tar"
    # The tar itself can be the source, too.
    convert("imagenet", data["imagenet_tars"].root / "ILSVRC2012_img_train.tar", f"file://{tmp_path}/direct", OPTS)
    assert files_of(tmp_path / "direct").keys() == files_of(tmp_path / "tars-train").keys()


@pytest.mark.parametrize("layout", ["imagenet", "imagenet_txt", "imagenet_valdirs", "imagenet_devkit"])
def test_imagenet_val_layouts(data, tmp_path, layout):
    if data[layout] is None:
        pytest.skip("reading the ImageNet devkit needs scipy")
    made = data[layout]
    convert("imagenet", made.root, f"file://{tmp_path}/val", dataclasses.replace(OPTS, split="val"))
    check_exactly_once(f"file://{tmp_path}/val", made.samples["val"])


def test_imagenet_val_labels_option_and_missing_ground_truth(data, tmp_path):
    made = data["imagenet_txt"]
    flat = tmp_path / "flat"
    shutil.copytree(made.root / "val", flat)
    with pytest.raises(FormatError, match="need their ground truth"):
        list_source("imagenet", flat, ConvertOptions(split="val"))
    options = dataclasses.replace(OPTS, split="val", val_labels=str(made.root / "val_labels.txt"))
    convert("imagenet", flat, f"file://{tmp_path}/out", options)
    check_exactly_once(f"file://{tmp_path}/out", made.samples["val"])


def test_imagefolder_reencodes_or_keeps_formats_and_skips_bad_files(data, tmp_path):
    made = data["imagefolder"]
    summary = convert("imagefolder", made.root, f"file://{tmp_path}/a", OPTS)
    skipped = {s.id: s.reason for s in summary.skipped}
    assert set(skipped) == set(made.corrupt[""]) | {"class_00/README.txt"}
    samples = check_exactly_once(f"file://{tmp_path}/a", made.samples[""])
    assert all(Image.open(io.BytesIO(s["jpg"])).format == "JPEG" for s in samples)

    summary = convert("imagefolder", made.root, f"file://{tmp_path}/b", dataclasses.replace(OPTS, keep_format=True))
    samples = check_exactly_once(f"file://{tmp_path}/b", made.samples[""])
    for s in samples:
        source = json.loads(s["json"])["source"]
        (field,) = [k for k in s if k in ("jpg", "png", "webp", "bmp")]
        assert s[field] == (made.root / source).read_bytes()
    assert {"png", "webp", "bmp", "jpg"} <= set(summary.manifest.fields)

    with pytest.raises(CorruptSample, match="broken_"):
        convert("imagefolder", made.root, f"file://{tmp_path}/c", dataclasses.replace(OPTS, strict=True))
    assert not (tmp_path / "c" / MANIFEST_NAME).exists()


@pytest.mark.parametrize("layout", ["cifar10", "cifar10_tgz"])
@pytest.mark.parametrize("fmt", ["png", "jpeg"])
def test_cifar10(data, tmp_path, layout, fmt):
    made = data[layout]
    options = dataclasses.replace(OPTS, image_format=fmt, samples_per_shard=None, shard_size=40_000)
    summary = convert("cifar10", made.root, f"file://{tmp_path}/train", options)
    assert summary.shards > 1 and all(s.size <= 40_000 + 10240 for s in summary.manifest.shards)
    samples = check_exactly_once(f"file://{tmp_path}/train", made.samples["train"])
    assert summary.manifest.classes[:2] == ("airplane", "automobile")
    if fmt == "png":  # lossless: the pixels are the source's
        source = list_source("cifar10", made.root)
        reader: ArrayReader = source.reader
        for s in samples[:5]:
            batch, i = json.loads(s["json"])["source"].split("/")
            pixels = np.asarray(Image.open(io.BytesIO(s["png"])))
            assert np.array_equal(pixels, reader.read(SourceItem(f"{batch}/{i}", 0, 0, int(i))))
    convert("cifar10", made.root, f"file://{tmp_path}/test", dataclasses.replace(options, split="test"))
    check_exactly_once(f"file://{tmp_path}/test", made.samples["test"])


@pytest.mark.parametrize("layout", ["mnist", "mnist_raw"])
def test_mnist(data, tmp_path, layout):
    made = data[layout]
    for split in ("train", "test"):
        convert("mnist", made.root, f"file://{tmp_path}/{split}", dataclasses.replace(OPTS, split=split))
        samples = check_exactly_once(f"file://{tmp_path}/{split}", made.samples[split])
        image = Image.open(io.BytesIO(samples[0]["png"]))
        assert image.mode == "L" and image.size == (28, 28)


def test_resize_max_side(data, tmp_path):
    made = data["imagenet"]
    options = dataclasses.replace(OPTS, resize_max_side=24, quality=80)
    summary = convert("imagenet", made.root, f"file://{tmp_path}/small", options)
    samples = check_exactly_once(f"file://{tmp_path}/small", made.samples["train"])
    sizes = {Image.open(io.BytesIO(s["jpg"])).size for s in samples}
    assert sizes == {(24, 20)}  # 48x40 scaled so the longer side is 24
    assert summary.manifest.created.options["resize_max_side"] == 24


# -- bad sources ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fmt, source, message",
    [
        ("imagenet", "cifar10", "expected an ImageNet"),
        ("imagenet", "imagefolder", "expected an ImageNet.*use the imagefolder format"),
        ("cifar10", "imagenet", "expected cifar-10-batches-py"),
        ("mnist", "cifar10", "expected MNIST idx files"),
        ("imagefolder", "mnist", "expected class sub-folders"),
    ],
)
def test_a_source_of_another_format_says_what_was_expected_and_found(data, fmt, source, message):
    with pytest.raises(FormatError, match=message) as info:
        list_source(fmt, data[source].root)
    assert "found" in str(info.value)


def test_corrupt_source_files_are_format_errors(tmp_path):
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03" + b"\x00" * 20)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(b"junk")
    with pytest.raises(FormatError):
        list_source("mnist", tmp_path)
    batches = tmp_path / "cifar" / "cifar-10-batches-py"
    batches.mkdir(parents=True)
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (batches / "batches.meta").write_bytes(pickle.dumps({"label_names": Evil()}))
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (batches / name).write_bytes(b"not a pickle")
    with pytest.raises(FormatError, match="posix.system|os.system|refers to"):
        list_source("cifar10", tmp_path / "cifar")
    (tmp_path / "ILSVRC2012_img_train.tar").write_bytes(b"not a tar at all" * 64)
    with pytest.raises(FormatError, match="not a readable tar"):
        list_source("imagenet", tmp_path / "ILSVRC2012_img_train.tar")


# -- reproducibility, workers, resume ------------------------------------------------------------
def test_same_seed_same_bytes_other_seed_other_order_and_workers_do_not_matter(data, tmp_path):
    made = data["imagenet"]
    convert("imagenet", made.root, f"file://{tmp_path}/a", OPTS)
    convert("imagenet", made.root, f"file://{tmp_path}/b", dataclasses.replace(OPTS, workers=2))
    assert files_of(tmp_path / "a") == files_of(tmp_path / "b")
    convert("imagenet", made.root, f"file://{tmp_path}/c", dataclasses.replace(OPTS, seed=1))
    assert files_of(tmp_path / "a")["shard-000000.tar"] != files_of(tmp_path / "c")["shard-000000.tar"]
    check_exactly_once(f"file://{tmp_path}/c", made.samples["train"])


def test_an_unguarded_script_with_workers_fails_with_a_clear_error_and_does_not_hang(tmp_path):
    """A script that calls convert with workers > 1 and no `if __name__ == "__main__":`: each
    spawned worker imports the script, and its own convert stops it before it starts. The
    conversion ends with an error that names the guard. Before, with a listing past the start-up
    pipe's 64 KB (1,500 inputs and 1,500 skipped files here), this process blocked forever
    writing it to a dead worker."""
    source = tmp_path / "folder"
    jpeg = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(jpeg, "JPEG")
    for label in range(3):
        (source / f"class{label}").mkdir(parents=True)
        for n in range(500):
            (source / f"class{label}" / f"{n:04d}-with-a-longer-file-name.jpg").write_bytes(jpeg.getvalue())
            (source / f"class{label}" / f"{n:04d}-annotation.txt").write_text("not an image: skipped")
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import sys\n"
        "from dlstore.convert import ConvertOptions, convert\n"
        "convert('imagefolder', sys.argv[1], sys.argv[2], ConvertOptions(samples_per_shard=300, workers=2))\n"
    )
    store = tmp_path / "store"
    result = subprocess.run(
        [sys.executable, str(script), str(source), f"file://{store}"], capture_output=True, text=True, timeout=180
    )
    assert result.returncode != 0
    assert "a convert worker process died" in result.stderr and "__main__" in result.stderr
    assert not (store / MANIFEST_NAME).exists()


class Stop(Exception):
    pass


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_resume_after_a_failure_midway_gives_the_same_dataset(data, tmp_path, workers):
    made = data["imagenet"]
    options = dataclasses.replace(OPTS, samples_per_shard=3, workers=workers)
    convert("imagenet", made.root, f"file://{tmp_path}/ref", options)

    def fail_after_two_shards(progress):
        if progress.shards_done >= 2:
            raise Stop

    with pytest.raises(Stop):
        convert("imagenet", made.root, f"file://{tmp_path}/out", options, progress=fail_after_two_shards)
    partial = files_of(tmp_path / "out")
    assert MANIFEST_NAME not in partial and sum(k.endswith(".idx") for k in partial) >= 2
    if workers == 1:  # in a pool, the tiny shards may all be done before the callback runs
        assert sum(k.endswith(".idx") for k in partial) == 2
    summary = convert("imagenet", made.root, f"file://{tmp_path}/out", options)
    assert summary.shards_reused >= 2 and summary.shards_written == summary.shards - summary.shards_reused
    assert files_of(tmp_path / "out") == files_of(tmp_path / "ref")
    again = convert("imagenet", made.root, f"file://{tmp_path}/out", dataclasses.replace(options, rehash_existing=True))
    assert again.shards_written == 0 and files_of(tmp_path / "out") == files_of(tmp_path / "ref")


@pytest.mark.parametrize("damage", ["deleted", "replaced"])
def test_a_shard_deleted_or_replaced_during_the_conversion_is_found_before_the_manifest(data, tmp_path, damage):
    """An object the conversion wrote that is gone (or another size) when it ends: no manifest,
    an error naming it; the same conversion again mends it. It once reported success, and the
    dataset failed only at `verify` or in training."""
    made = data["imagenet"]
    options = dataclasses.replace(OPTS, samples_per_shard=3, workers=1)
    convert("imagenet", made.root, f"file://{tmp_path}/ref", options)
    out = tmp_path / "out"

    def damage_the_first_shard(progress):
        first = out / "shard-000000.tar"
        if progress.shards_done >= 2 and first.exists() and first.stat().st_size % 512 == 0:
            if damage == "deleted":
                first.unlink()
            else:
                first.write_bytes(first.read_bytes() + b"x")  # another version, another size

    with pytest.raises(DlstoreError, match=r"shard-000000\.tar (is gone|has \d+ bytes, not the \d+ written)"):
        convert("imagenet", made.root, f"file://{out}", options, progress=damage_the_first_shard)
    assert MANIFEST_NAME not in files_of(out)
    summary = convert("imagenet", made.root, f"file://{out}", options)
    assert summary.shards_written >= 1
    assert files_of(out) == files_of(tmp_path / "ref")


@pytest.mark.slow
def test_a_failing_convert_ends_promptly_and_a_resume_gives_the_same_dataset(data, tmp_path):
    """Failures at many points (the put of a shard or of its index, a corrupt input under strict,
    the progress callback), with 1 and 2 workers, twice over: every run raises its typed error
    within seconds, leaves no worker running, no half-written object and no manifest, and a
    resume gives the reference dataset. In a subprocess, so that a hang fails this test instead
    of hanging the suite (a pool once waited forever for a worker to take its SIGTERM)."""
    repeats = 2
    command = [sys.executable, convert_faults.__file__]
    command += [str(data["imagenet"].root), str(tmp_path), str(repeats)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as exc:
        done = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout
        pytest.fail(f"a failing conversion hung; the cases before it:\n{done}")
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(reports) == repeats * 2 * len(FAULTS)
    expected = {"tar": "DlstoreError", "idx": "DlstoreError", "strict": "CorruptSample", "progress": "ProgressStop"}
    for report in reports:
        assert report["error"] == expected[report["kind"]], report
        assert report["blocked"] is None or report["blocked"] in report["message"], report
        assert report["seconds"] < 20, report
        assert report["live_workers"] == 0 and report["temp_files"] == [], report
        assert not report["manifest_written"] and report["resumed_same"], report


def test_a_build_told_to_stop_ends_at_the_next_sample_and_leaves_no_half_written_shard(data, tmp_path):
    source = list_source("imagenet", data["imagenet"].root)
    task = plan_tasks(source, OPTS)[0]
    stop = threading.Event()

    class StopAfterFirstSample(Counters):
        def add(self, samples: int, nbytes: int) -> None:
            super().add(samples, nbytes)
            stop.set()  # as the pool does when another shard fails

    counters = StopAfterFirstSample()
    context = BuildContext(open_store(f"file://{tmp_path}/out"), source, OPTS, str(tmp_path))
    with pytest.raises(BuildStopped):
        ShardBuilder(context, counters, stop).build(task)
    assert counters.read()[0] == 1 and len(task.positions) > 1
    assert [p.name for p in (tmp_path / "out").rglob("*")] == []  # the local store's temp file is gone


def test_resume_after_the_process_is_killed(data, tmp_path):
    made = data["imagenet_tars"]
    out = tmp_path / "out"
    command = [sys.executable, "-m", "dlstore", "convert", "imagenet", str(made.root), f"file://{out}"]
    # Its own temp dir: a SIGKILL leaves the conversion's temp folder behind, as it must.
    command += ["--samples-per-shard", "1", "--workers", "1", "-q", "--tmp-dir", str(tmp_path / "scratch")]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        if out.is_dir() and any(p.suffix == ".idx" for p in out.iterdir()):
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.002)
    process.wait(timeout=60)
    if process.returncode == -signal.SIGKILL:
        assert not (out / MANIFEST_NAME).exists()
    assert (
        cli(
            ["convert", "imagenet", str(made.root), f"file://{out}", "--samples-per-shard", "1", "--workers", "1", "-q"]
        )
        == 0
    )
    convert("imagenet", made.root, f"file://{tmp_path}/ref", ConvertOptions(samples_per_shard=1))
    assert files_of(out) == files_of(tmp_path / "ref")


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_tmp_dir_that_convert_made_goes_with_it_and_one_there_before_stays(data, tmp_path, workers):
    """--tmp-dir names a folder that is missing: convert makes it (and its missing parents) and
    removes them when done, as it removes its own temp folder; a README walk found them left
    behind. A folder that was there before is left, as it was."""
    made = data["imagenet_tars"]
    args = ["convert", "imagenet", str(made.root), "--samples-per-shard", "1", "--workers", str(workers), "-q"]
    assert cli([*args, f"file://{tmp_path}/out", "--tmp-dir", str(tmp_path / "new" / "scratch")]) == 0
    assert not (tmp_path / "new").exists() and (tmp_path / "out" / MANIFEST_NAME).exists()
    # `..` goes where the file system takes it: `new` is made, then `other` beside it; both go.
    assert cli([*args, f"file://{tmp_path}/out1", "--tmp-dir", f"{tmp_path}/new/../other/scratch"]) == 0
    assert not (tmp_path / "new").exists() and not (tmp_path / "other").exists()
    (tmp_path / "there").mkdir()
    assert cli([*args, f"file://{tmp_path}/out2", "--tmp-dir", str(tmp_path / "there")]) == 0
    assert (tmp_path / "there").is_dir() and list((tmp_path / "there").iterdir()) == []


@pytest.mark.slow
def test_sigterm_ends_a_convert_cleanly_and_a_resume_finishes_it(data, tmp_path):
    """`timeout`, `kill` or a batch system's SIGTERM ends convert as Ctrl-C does: its workers
    stopped, its temp folder (a partial shard, the source listing) removed, no semaphore left
    for the resource tracker to warn about; exit status 128 + 15. It used to die where it stood."""
    made = data["imagenet_tars"]
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    scratch.mkdir()
    args = ["convert", "imagenet", str(made.root), f"file://{out}", "--samples-per-shard", "1", "--workers", "2", "-q"]
    process = subprocess.Popen(
        [sys.executable, "-m", "dlstore", *args, "--tmp-dir", str(scratch)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None and not list(scratch.glob("dlstore-convert-*")):
        time.sleep(0.002)
    assert process.poll() is None, "the conversion ended before the signal: nothing was tested"
    process.send_signal(signal.SIGTERM)  # the workers are starting or building
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, stderr.decode()[-2000:]
    assert list(scratch.iterdir()) == [] and not (out / MANIFEST_NAME).exists()
    assert b"leaked semaphore" not in stderr and b"Traceback" not in stderr, stderr.decode()[-2000:]
    assert cli([*args, "--tmp-dir", str(scratch)]) == 0
    convert("imagenet", made.root, f"file://{tmp_path}/ref", ConvertOptions(samples_per_shard=1))
    assert files_of(out) == files_of(tmp_path / "ref")


def _convert_in_a_session_of_its_own(tmp_path: Path, image_px: int) -> tuple[subprocess.Popen, Path]:
    """`dlstore convert` of 240 generated JPEGs, a shard each, with 2 workers, as a process
    group of its own (as a terminal's job or a batch step is), and its --tmp-dir."""
    made = make_imagefolder(
        tmp_path / "src", num_classes=4, per_class=60, image_size=(image_px, image_px), formats=("jpg",)
    )
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    command = [sys.executable, "-m", "dlstore", "convert", "imagefolder", str(made.root), f"file://{tmp_path}/out"]
    command += ["--samples-per-shard", "1", "--workers", "2", "-q", "--tmp-dir", str(scratch)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    return process, scratch


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_to_the_process_group_while_the_workers_start_ends_convert_quietly(data, tmp_path, sig):
    """Ctrl-C, Slurm's SIGTERM and its `--signal` SIGUSR1 reach the whole process group.
    Workers still importing (they ignored SIGINT only once they ran) printed a page of
    KeyboardInterrupt traceback each; SIGTERM killed them, and the pool's clean-up of the
    broken pool raced convert's cancelling of its shards into an InvalidStateError traceback.
    They are now born ignoring all three, and only convert itself stops, with its status
    (130 for Ctrl-C, 128 + the signal) and its temp folder gone."""
    process, scratch = _convert_in_a_session_of_its_own(tmp_path, 16)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None and not list(scratch.glob("dlstore-convert-*")):
        time.sleep(0.002)
    time.sleep(0.3)  # the workers are importing (240 shards: they are far from done)
    assert process.poll() is None, "the conversion ended before the signal: nothing was tested"
    os.killpg(process.pid, sig)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == (130 if sig == signal.SIGINT else 128 + sig), stderr.decode()[-2000:]
    assert b"KeyboardInterrupt" not in stderr and b"Traceback" not in stderr, stderr.decode()[-3000:]
    assert list(scratch.iterdir()) == []


def test_a_stop_signal_while_workers_are_started_still_reaches_convert():
    """The workers are born deaf to the stop signals (`_stop_signals_blocked_while_workers_start`
    blocks them in the thread that starts them): one sent to convert meanwhile is not lost,
    and convert's own handler has it at the latest once the workers are started."""
    from dlstore.convert.workers import _stop_signals_blocked_while_workers_start

    got = []
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        with _stop_signals_blocked_while_workers_start():
            os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):  # the handler runs at the next bytecode boundaries
            if got:
                break
            time.sleep(0.01)
        assert got == [signal.SIGTERM]
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
    finally:
        signal.signal(signal.SIGTERM, previous)


class _StoppedByTheCli(Exception):
    """What the CLI's SIGTERM handler raises (`StoppedBySignal`), in the tests of noted stops."""


@pytest.fixture
def cli_sigterm_handler():
    """A SIGTERM handler that raises, as the CLI's does, in place for the test."""

    def handler(signum, frame):
        raise _StoppedByTheCli(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    yield handler
    signal.signal(signal.SIGTERM, previous)


def test_stop_signals_while_the_pool_runs_are_acted_on_between_waits(cli_sigterm_handler):
    """A Ctrl-C raised inside `concurrent.futures.wait` could land between a lock's acquire and
    release: a double Ctrl-C ended convert in "RuntimeError: release unlocked lock". The pool's
    loop now notes stops and acts on them between waits, as the handler before would have."""
    from dlstore.convert.workers import _StopsAtSafePoints

    with _StopsAtSafePoints() as stops:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):  # Python code runs on: nothing raised where it stands
            if len(stops.received) == 2:
                break
            time.sleep(0.01)
        assert sorted(stops.received) == [signal.SIGINT, signal.SIGTERM]
        with pytest.raises((KeyboardInterrupt, _StoppedByTheCli)):
            stops.act()
        with pytest.raises((KeyboardInterrupt, _StoppedByTheCli)):
            stops.act()
        stops.act()  # nothing left
    assert (
        signal.getsignal(signal.SIGTERM) is cli_sigterm_handler
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )


def test_a_stop_noted_after_the_last_safe_point_is_taken_when_the_pool_is_left(cli_sigterm_handler):
    """A stop that comes after the pool's last wait (between its last safe point and the old
    handlers' return) was noted and dropped: convert went on to write its manifest. Leaving
    the block without an error now takes it, with the handler before in place again."""
    from dlstore.convert.workers import _StopsAtSafePoints

    with pytest.raises(_StoppedByTheCli), _StopsAtSafePoints() as stops:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):
            if stops.received:
                break
            time.sleep(0.01)
    assert signal.getsignal(signal.SIGTERM) is cli_sigterm_handler


def test_a_stop_while_the_pool_is_made_leaks_no_semaphore_and_starts_no_worker(data, tmp_path, monkeypatch):
    """CI: a SIGTERM just as convert made its pool left "1 leaked semaphore objects" for the
    resource tracker to warn about. Raised between a semaphore's registration with the tracker
    and its finalizer, the stop kept it from ever being unregistered. Here the stop comes at that
    very point; it must end the build before any worker starts, and every semaphore registered
    must be unregistered again once the pool's objects are gone."""
    import gc
    import multiprocessing.resource_tracker as tracker

    from dlstore.convert.workers import _build_in_pool

    registered, unregistered = [], []
    register, unregister = tracker.register, tracker.unregister

    def register_then_stop(name, rtype):
        register(name, rtype)
        registered.append(name)
        if len(registered) == 1:
            signal.raise_signal(signal.SIGINT)  # Python runs the handler at the next bytecode

    def note_unregister(name, rtype):
        unregister(name, rtype)
        unregistered.append(name)

    monkeypatch.setattr(tracker, "register", register_then_stop)
    monkeypatch.setattr(tracker, "unregister", note_unregister)
    source = list_source("imagenet", data["imagenet"].root)
    options = dataclasses.replace(OPTS, workers=2)
    context = BuildContext(open_store(f"file://{tmp_path}/out"), source, options, str(tmp_path))
    built: dict = {}
    stopped = False
    try:
        _build_in_pool(context, plan_tasks(source, options), built, lambda counters: None)
    except KeyboardInterrupt:
        stopped = True
    gc.collect()  # the pool's queues, `shared` and `stop` are unreachable now: their finalizers run
    assert stopped and built == {} and multiprocessing.active_children() == []
    assert registered and sorted(unregistered) == sorted(registered)


@pytest.mark.slow
def test_a_double_ctrl_c_while_convert_builds_ends_it_quietly(tmp_path):
    """Ctrl-C twice in a row to convert itself (as `timeout` passes it on): status 130, no
    traceback, its temp folder gone, whatever the second one interrupted."""
    process, scratch = _convert_in_a_session_of_its_own(tmp_path, 64)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None and len(list((tmp_path / "out").glob("*.tar"))) < 4:
        time.sleep(0.01)
    assert process.poll() is None, "the conversion ended before the signal: nothing was tested"
    for _ in range(2):
        process.send_signal(signal.SIGINT)
        time.sleep(0.005)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr.decode()[-2000:]
    assert b"Traceback" not in stderr, stderr.decode()[-3000:]
    assert b"dlstore convert: interrupted (Ctrl-C)" in stderr  # it said nothing
    assert list(scratch.iterdir()) == []


def _run_on_a_terminal(command: list[str], timeout_s: float) -> tuple[int, str]:
    """Exit status and stderr of `command` run with a pseudo-terminal as its stderr (a bar is
    drawn only on a terminal)."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # 0 columns: an empty bar
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 1.0)[0]:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the process closed its end
                break
            if not data:
                break
            out += data
        return process.wait(timeout=max(1.0, deadline - time.monotonic())), out.decode(errors="replace")
    finally:
        os.close(master)
        if process.poll() is None:
            process.kill()


@pytest.mark.slow
def test_a_warning_during_convert_is_a_line_of_its_own_not_glued_to_the_progress_bar(tmp_path):
    """A warning logged while the bar was drawn came out at the end of the bar's line
    ("...2.0 MB/s]2026-... WARNING ..."), easy to miss; it now has a line of its own."""
    made = make_imagefolder(tmp_path / "src", num_classes=2, per_class=4, image_size=(16, 16), formats=("jpg",))
    out = tmp_path / "out"
    out.mkdir()
    (out / "shard-000042.tar").write_bytes(b"another tool's")
    command = [sys.executable, "-m", "dlstore", "convert", "imagefolder", str(made.root), f"file://{out}"]
    status, stderr = _run_on_a_terminal([*command, "--samples-per-shard", "4", "--overwrite"], timeout_s=120)
    assert status == 0, stderr[-2000:]
    lines = re.split(r"[\r\n]", stderr)
    warnings = [line for line in lines if "WARNING" in line]
    assert any("under the shard prefix" in line for line in warnings), stderr
    assert all(re.match(r"\d{4}-\d\d-\d\d ", line) for line in warnings), warnings
    assert any(line.startswith("convert:") for line in lines)  # the bar was drawn


def test_an_mnist_file_holding_more_than_its_header_says_is_refused_without_inflating_it(tmp_path):
    """A gzip bomb (a header for 10 images, then 256 MB of zeros: 256 KB on disk) is found out
    after the bytes the header announces, not after all of it is inflated into memory."""
    import gzip
    import struct
    import tracemalloc

    from dlstore.convert.arrays import _read_idx

    bomb = tmp_path / "train-images-idx3-ubyte.gz"
    with gzip.open(bomb, "wb", compresslevel=1) as file:
        file.write(struct.pack(">4I", 2051, 10, 28, 28) + bytes(10 * 28 * 28))
        for _ in range(256):
            file.write(bytes(2**20))
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match=r"header says \(10, 28, 28\), but the file holds more data"):
            _read_idx(str(bomb), 2051, 3)
        assert tracemalloc.get_traced_memory()[1] < 16 * 2**20
    finally:
        tracemalloc.stop()
    short = tmp_path / "short.gz"
    with gzip.open(short, "wb") as file:
        file.write(struct.pack(">4I", 2051, 10, 28, 28) + bytes(100))
    with pytest.raises(FormatError, match="holds 100 bytes of data"):
        _read_idx(str(short), 2051, 3)


def test_a_link_back_up_an_imagefolder_tree_is_walked_once(tmp_path):
    """Links are followed (a class folder on another disk), but two links back up a class's
    tree made the listing grow exponentially: it ran until killed. Each real folder is walked
    once; the repeat is reported as skipped."""
    made = make_imagefolder(tmp_path / "src", num_classes=2, per_class=3)
    class_dir = made.root / sorted(p.name for p in made.root.iterdir())[0]
    (class_dir / "sub").mkdir()
    (class_dir / "sub" / "up").symlink_to("..")
    (class_dir / "loop").symlink_to(".")
    source = list_source("imagefolder", made.root)
    assert len(source.items) == 6 and len({item.id for item in source.items}) == 6
    assert sorted(s.reason for s in source.skipped).count("a link to a folder already walked") == 2


def test_convert_does_not_overwrite_another_tools_shards_without_overwrite(tmp_path):
    """WebDataset tars waiting for `dlstore index` (no index.json yet) under the shard names a
    conversion writes: they were replaced without a word. Refused before anything is written;
    --overwrite replaces them; an interrupted conversion's own shards are still reused."""
    made = make_imagefolder(tmp_path / "src", num_classes=2, per_class=3)
    dest = tmp_path / "out"
    dest.mkdir()
    with tarfile.open(dest / "shard-000000.tar", "w") as tar:  # as WebDataset's TarWriter makes them
        member = tarfile.TarInfo("s000000.jpg")
        member.size, member.mode, member.mtime, member.uname = 8, 0o444, 1_700_000_000, "bigdata"
        tar.addfile(member, io.BytesIO(b"not ours"))
    foreign = (dest / "shard-000000.tar").read_bytes()
    url = f"file://{dest}"
    with pytest.raises(ConfigError, match=r"holds shard-000000\.tar that no dlstore dataset.*--overwrite"):
        convert("imagefolder", made.root, url, OPTS)
    assert (dest / "shard-000000.tar").read_bytes() == foreign and not (dest / "index.json").exists()
    summary = convert("imagefolder", made.root, url, dataclasses.replace(OPTS, overwrite=True))
    assert summary.shards_written == 1 and (dest / "shard-000000.tar").read_bytes() != foreign
    (dest / "index.json").unlink()  # as a conversion cut short before its manifest leaves it
    assert convert("imagefolder", made.root, url, OPTS).shards_reused == 1


def test_imagefolder_skips_what_is_no_regular_image_file_or_leaves_its_class(tmp_path):
    """A pipe named .jpg blocked the listing for ever, a link to /dev/zero read until memory ran
    out, a link to nothing and a name that is not UTF-8 ended the run with a traceback, and a
    link up the tree took every other class's images in again under this class's label. Each
    is skipped, with its reason; the real images are all there, each once, rightly labelled."""
    made = make_imagefolder(tmp_path / "src", num_classes=3, per_class=2)
    already = [s.reason for s in list_source("imagefolder", made.root).skipped]  # what it holds itself
    first = made.root / sorted(p.name for p in made.root.iterdir())[0]
    os.mkfifo(first / "pipe.jpg")
    (first / "zero.jpg").symlink_to("/dev/zero")
    (first / "gone.jpg").symlink_to(first / "nowhere.jpg")
    (first / "up").symlink_to("..")
    os.symlink(first / "0.jpg", os.path.join(os.fsencode(first), b"caf\xe9.jpg"))
    source = list_source("imagefolder", made.root)
    assert len(source.items) == 6 and [item.label for item in source.items] == [0, 0, 1, 1, 2, 2]
    reasons = sorted(s.reason for s in source.skipped)
    assert reasons == sorted([
        "not a regular file (a pipe, a device)", "not a regular file (a pipe, a device)", "a link to nothing",
        "a link out of its class folder", "a name that is not UTF-8", *already,
    ]), reasons  # fmt: skip
    (made.root / os.fsdecode(b"caf\xe9")).mkdir()
    with pytest.raises(FormatError, match="not named in UTF-8"):
        list_source("imagefolder", made.root)


def test_an_imagefolder_root_of_splits_without_split_is_refused(tmp_path):
    """`train/<class>` and `val/<class>` under the root, no --split: converted, the splits became
    the dataset's two classes, every image labelled "train" or "val", silently. A class that
    is only named like a split (images right in it) is still a class."""
    root = tmp_path / "src"
    for split in ("train", "val"):
        make_imagefolder(root / split, num_classes=2, per_class=2)
    with pytest.raises(ConfigError, match=r"split folders \(train, val\).*--split train"):
        list_source("imagefolder", root)
    assert len(list_source("imagefolder", root, ConvertOptions(split="val")).items) == 4
    plain = tmp_path / "plain"
    for name in ("test", "cat"):
        (plain / name).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(plain / name / "0.jpg")
    assert list_source("imagefolder", plain).classes == ["cat", "test"]


def test_kept_formats_are_all_named_in_the_manifest_whatever_the_files_are_called(tmp_path):
    """With --keep-format, a `.pgm` is stored as `ppm` (Pillow's name) and a PNG named `.jpg` as
    `png`: the manifest named the inputs' extensions instead, and the loader, which reads the
    image members the manifest names, skipped those samples as having no image."""
    root = tmp_path / "src"
    (root / "a").mkdir(parents=True)
    Image.new("L", (16, 12), 90).save(root / "a" / "gray.pgm")
    Image.new("RGB", (16, 12), (1, 2, 3)).save(root / "a" / "really-a-png.jpg", "PNG")
    Image.new("RGB", (16, 12), (4, 5, 6)).save(root / "a" / "plain.bmp")
    url = f"file://{tmp_path}/out"
    summary = convert("imagefolder", root, url, dataclasses.replace(OPTS, keep_format=True))
    store = open_store(url)
    stored = [read_sample(store.get_range(s.name, span.offset, span.size)) for s in summary.manifest.shards
              for span in (load_sample_index(store, s)[i] for i in range(s.samples))]  # fmt: skip
    assert len(stored) == 3
    named = [f for f in IMAGE_FIELDS if f in summary.manifest.fields]  # what the loader looks for (`SamplePath`)
    assert all(image_field(sample, named) is not None for sample in stored), summary.manifest.fields
    assert {"ppm", "png", "bmp"} <= {image_field(sample) for sample in stored}
    assert verify_dataset(store, deep=True).ok
    # A manifest that leaves one out (as the inputs' extensions did): the deep check says so.
    dataclasses.replace(summary.manifest, fields=tuple(f for f in summary.manifest.fields if f != "ppm")).save(store)
    report = verify_dataset(store, deep=True)
    assert not report.ok and "no image among the manifest's fields" in " ".join(report.problems)


def test_refuses_to_overwrite_another_dataset(data, tmp_path):
    made = data["mnist"]
    convert("mnist", made.root, f"file://{tmp_path}/d", OPTS)
    with pytest.raises(ConfigError, match=r"already holds a dataset .*\(seed: 0 there, 5 here\)"):
        convert("mnist", made.root, f"file://{tmp_path}/d", dataclasses.replace(OPTS, seed=5))
    assert Manifest.load(open_store(f"file://{tmp_path}/d")).created.seed == 0  # untouched
    summary = convert("mnist", made.root, f"file://{tmp_path}/d", dataclasses.replace(OPTS, seed=5, overwrite=True))
    assert summary.manifest.created.seed == 5


def test_a_dataset_converted_again_into_fewer_shards_leaves_none_of_the_old_ones(data, tmp_path, caplog):
    """The shards (and indexes) the new dataset does not reuse are deleted: left behind,
    `dlstore index` took them into its manifest (stale duplicates, other classes). Other
    objects under the prefix are only named."""
    made = data["mnist"]
    url = f"file://{tmp_path}/d"
    many = convert("mnist", made.root, url, dataclasses.replace(OPTS, samples_per_shard=4))
    (tmp_path / "d" / "shard-notes.txt").write_text("mine")
    few = convert("mnist", made.root, url, dataclasses.replace(OPTS, samples_per_shard=64, overwrite=True))
    assert len(few.manifest.shards) < len(many.manifest.shards)
    kept = {p.name for p in (tmp_path / "d").iterdir()}
    expected = {s.name for s in few.manifest.shards} | {s.index for s in few.manifest.shards}
    assert kept == expected | {MANIFEST_NAME, "shard-notes.txt"}
    assert "shard-notes.txt" in caplog.text  # not ours to delete: named
    assert index_dataset(url).total_samples == few.samples
    # Shards no manifest there named (foreign ones, waiting for `dlstore index`) are only named.
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "shard-000050.tar").write_bytes(b"foreign")
    convert("mnist", made.root, f"file://{tmp_path}/e", dataclasses.replace(OPTS, samples_per_shard=64))
    assert (tmp_path / "e" / "shard-000050.tar").read_bytes() == b"foreign" and "shard-000050.tar" in caplog.text


# -- verify ---------------------------------------------------------------------------------------
def test_verify_catches_a_flipped_byte_and_a_missing_shard(data, tmp_path, capsys):
    made = data["cifar10"]
    url = f"file://{tmp_path}/d"
    convert("cifar10", made.root, url, OPTS)
    assert cli(["verify", url, "-q"]) == 0 and cli(["verify", url, "--deep", "-q"]) == 0
    assert "OK: 6 shards, 40 samples" in capsys.readouterr().out

    shard = tmp_path / "d" / "shard-000001.tar"
    original = shard.read_bytes()
    flipped = bytearray(original)
    flipped[1500] ^= 0x01
    shard.write_bytes(bytes(flipped))
    report = verify_dataset(url)
    assert not report.ok and report.problems == ("shard-000001.tar: checksum differs from the manifest",)
    assert not verify_dataset(url, deep=True).ok
    assert cli(["verify", url, "-q"]) == 1
    assert "shard-000001.tar: checksum differs" in capsys.readouterr().out

    shard.write_bytes(original)
    (tmp_path / "d" / "shard-000003.tar").unlink()
    report = verify_dataset(url, deep=True)
    assert report.problems == ("shard-000003.tar: missing",)
    assert cli(["verify", url, "-q"]) == 1

    (tmp_path / "d" / MANIFEST_NAME).write_text("{}")
    assert cli(["verify", url, "-q"]) == 1


def test_deep_verify_catches_labels_out_of_range_and_undecodable_images(tmp_path):
    from dlstore.format.checksums import checksum_of
    from dlstore.format.manifest import CreationInfo, ShardInfo
    from dlstore.format.sample_index import index_name
    from dlstore.format.shard_writer import TarShardWriter

    store = open_store(f"file://{tmp_path}")
    buffer = io.BytesIO()
    writer = TarShardWriter(buffer)
    good = io.BytesIO()
    Image.new("RGB", (8, 8)).save(good, "PNG")
    writer.write("a", {"png": good.getvalue(), "cls": b"0"})
    writer.write("b", {"png": b"not a png", "cls": b"1"})
    writer.write("c", {"png": good.getvalue(), "cls": b"9"})
    index = writer.close()
    store.put("s-000000.tar", buffer.getvalue())
    store.put(index_name("s-000000.tar"), index.to_bytes())
    shard = ShardInfo(
        "s-000000.tar",
        index.shard_size,
        3,
        index.checksum,
        "s-000000.idx",
        112,
        checksum_of(index.to_bytes(), "xxh3_128"),
    )
    Manifest((shard,), ("x", "y"), ("cls", "png"), "cls", CreationInfo()).save(store)
    assert verify_dataset(store).ok
    problems = verify_dataset(store, deep=True).problems
    assert len(problems) == 2 and "'b': png does not decode" in problems[0] and "'c': label b'9'" in problems[1]


# -- the decode check ------------------------------------------------------------------------------
def test_convert_decodes_every_jpeg_it_stores_and_leaves_out_those_the_loader_would_skip(tmp_path, capsys):
    source = folder_with_a_jpeg_damaged_below(tmp_path / "src")
    damaged = (source / "class_a" / "damaged.jpg").read_bytes()
    with Image.open(io.BytesIO(damaged)) as image:
        assert image.format == "JPEG" and image.mode == "RGB"  # what convert looked at before

    summary = convert("imagefolder", source, f"file://{tmp_path}/checked", OPTS)
    assert [s.id for s in summary.skipped] == ["class_a/damaged.jpg"]
    assert "cannot decode image" in summary.skipped[0].reason
    assert summary.manifest.decode_checked and summary.manifest.created.options["check_decode"] is True
    assert summary.manifest.total_samples == 6
    assert verify_dataset(f"file://{tmp_path}/checked", deep=True).ok

    unchecked = convert(
        "imagefolder", source, f"file://{tmp_path}/unchecked", dataclasses.replace(OPTS, check_decode=False)
    )
    assert not unchecked.skipped and unchecked.manifest.total_samples == 7
    assert not unchecked.manifest.decode_checked
    problems = verify_dataset(f"file://{tmp_path}/unchecked", deep=True).problems
    assert len(problems) == 1 and "jpg does not decode" in problems[0]  # the loader skips it every epoch

    with pytest.raises(CorruptSample, match="damaged.jpg"):
        convert("imagefolder", source, f"file://{tmp_path}/strict", dataclasses.replace(OPTS, strict=True))
    # Shrunk (the damaged JPEG is 320 px wide), it would be a clean JPEG of damaged pixels.
    shrunk = convert("imagefolder", source, f"file://{tmp_path}/shrunk", dataclasses.replace(OPTS, resize_max_side=100))
    assert [s.id for s in shrunk.skipped] == ["class_a/damaged.jpg"] and shrunk.manifest.total_samples == 6

    url = f"file://{tmp_path}/cli"
    assert cli(["convert", "imagefolder", str(source), url, "--workers", "1", "--no-check-decode", "-q"]) == 0
    manifest = Manifest.load(open_store(url))
    assert manifest.total_samples == 7 and not manifest.decode_checked


@pytest.mark.parametrize("fmt", ["imagenet", "mnist"])
@pytest.mark.parametrize(("first_split", "then"), [("train", None), (None, "train")])
def test_a_rerun_naming_the_default_split_or_leaving_it_out_keeps_the_dataset(data, tmp_path, fmt, first_split, then):
    """`--split train` is the default: converted with it and run again without it (or the
    other way round), the rerun was refused as "other options (split: 'train' there, None
    here)". Now it keeps every shard and the manifest; another split is still refused."""
    made = data[fmt]
    url = f"file://{tmp_path}/d"
    first = convert(fmt, made.root, url, dataclasses.replace(OPTS, split=first_split))
    assert first.manifest.created.split == "train"
    again = convert(fmt, made.root, url, dataclasses.replace(OPTS, split=then))
    assert again.shards_written == 0 and again.shards_reused == first.shards and again.manifest == first.manifest
    other = "val" if fmt == "imagenet" else "test"
    with pytest.raises(ConfigError, match="other options"):
        convert(fmt, made.root, url, dataclasses.replace(OPTS, split=other))


def test_a_dataset_converted_unchecked_is_not_rebuilt_checked_without_overwrite(tmp_path):
    """A dataset converted without the decode check (as every dataset before it: the same
    options, the same shard recipes) is converted again with `--no-check-decode` keeping every
    shard; the default would rebuild them all, so it is refused, saying how to go on."""
    source = folder_with_a_jpeg_damaged_below(tmp_path / "src")
    url = f"file://{tmp_path}/d"
    unchecked = dataclasses.replace(OPTS, check_decode=False)
    first = convert("imagefolder", source, url, unchecked)
    assert "check_decode" not in first.manifest.created.options  # as a dataset made before the check
    with pytest.raises(ConfigError, match="without the decode check.*--no-check-decode"):
        convert("imagefolder", source, url, OPTS)
    assert Manifest.load(open_store(url)) == first.manifest  # untouched
    again = convert("imagefolder", source, url, unchecked)
    assert again.shards_written == 0 and again.shards_reused == first.shards and again.manifest == first.manifest

    checked = convert("imagefolder", source, url, dataclasses.replace(OPTS, overwrite=True))
    assert checked.shards_written == checked.shards and checked.manifest.decode_checked
    assert checked.manifest.total_samples == first.manifest.total_samples - 1  # the damaged JPEG
    with pytest.raises(ConfigError, match="leave out --no-check-decode"):
        convert("imagefolder", source, url, unchecked)
    with pytest.raises(ConfigError, match="another source or with other options"):
        convert("imagefolder", source, url, dataclasses.replace(OPTS, seed=9))


def test_cmyk_jpegs_are_checked_before_they_are_re_encoded(tmp_path):
    """A CMYK JPEG is re-encoded as RGB (by Pillow, which decodes past damaged data): checked
    first, an intact one is kept and a damaged one left out, not stored as a clean JPEG of
    damaged pixels."""
    y, x = np.mgrid[0:240, 0:320]
    pixels = np.stack([(x * 3 + y) % 256, (y * 5) % 256, (x * y // 7) % 256, (x + 2 * y) % 256], axis=-1)
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8), "CMYK").save(out, "JPEG", quality=90)
    intact = out.getvalue()
    cut = int(len(intact) * 0.8)
    damaged = intact[:cut] + bytes(b ^ 0x5A for b in intact[cut : cut + 200]) + intact[cut + 200 :]
    with Image.open(io.BytesIO(damaged)) as image:
        image.load()  # Pillow takes it
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "intact.jpg").write_bytes(intact)
    (tmp_path / "src" / "a" / "damaged.jpg").write_bytes(damaged)
    summary = convert("imagefolder", tmp_path / "src", f"file://{tmp_path}/d", OPTS)
    assert [s.id for s in summary.skipped] == ["a/damaged.jpg"] and summary.manifest.total_samples == 1
    unchecked = convert(
        "imagefolder", tmp_path / "src", f"file://{tmp_path}/u", dataclasses.replace(OPTS, check_decode=False)
    )
    assert not unchecked.skipped and unchecked.manifest.total_samples == 2


def test_without_simplejpeg_convert_stores_jpegs_unchecked_and_says_so(tmp_path, monkeypatch, caplog):
    """Pillow decodes past damaged data, so without simplejpeg there is no check like the
    loader's: the manifest must not claim one."""
    import dlstore.transforms

    monkeypatch.setattr(dlstore.transforms.cpu_decode, "simplejpeg", None)
    source = folder_with_a_jpeg_damaged_below(tmp_path / "src")
    with caplog.at_level(logging.WARNING, logger="dlstore.convert"):
        summary = convert("imagefolder", source, f"file://{tmp_path}/d", OPTS)
    assert not summary.manifest.decode_checked and "check_decode" not in summary.manifest.created.options
    assert summary.manifest.total_samples == 7 and "needs simplejpeg" in caplog.text


# -- compatibility with webdataset ----------------------------------------------------------------
def test_webdataset_and_gnu_tar_read_converted_shards(data, tmp_path):
    import webdataset as wds

    made = data["imagenet"]
    convert("imagenet", made.root, f"file://{tmp_path}", OPTS)
    manifest = Manifest.load(open_store(f"file://{tmp_path}"))
    urls = [str(tmp_path / s.name) for s in manifest.shards]
    samples = list(wds.WebDataset(urls, shardshuffle=False).decode("pil").to_tuple("jpg", "cls", "json"))
    assert len(samples) == manifest.total_samples
    expected = dict(made.samples["train"])
    assert all(expected[meta["source"]] == label and image.size == SMALL for image, label, meta in samples)
    if shutil.which("tar"):
        names = subprocess.run(["tar", "-tf", urls[0]], capture_output=True, text=True, check=True).stdout.split()
        assert len(names) == 3 * manifest.shards[0].samples and names[0].endswith(".jpg")


def test_index_shards_written_by_webdataset(tmp_path):
    import webdataset as wds

    rng = np.random.default_rng(0)
    written = []
    with wds.ShardWriter(str(tmp_path / "part-%04d.tar"), maxcount=7) as sink:
        for i in range(20):
            image = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (10, 12, 3), dtype=np.uint8)).save(image, "JPEG")
            sample = {"__key__": f"img{i:04d}", "jpg": image.getvalue(), "cls": i % 5}
            sink.write(sample)
            written.append(sample)
    assert cli(["index", f"file://{tmp_path}", "-q"]) == 0
    store = open_store(f"file://{tmp_path}")
    manifest = Manifest.load(store)
    assert [s.name for s in manifest.shards] == ["part-0000.tar", "part-0001.tar", "part-0002.tar"]
    assert manifest.total_samples == 20 and manifest.classes == ("0", "1", "2", "3", "4")
    assert manifest.label_field == "cls" and manifest.created.tool == "dlstore index"
    got = []
    for shard in manifest.shards:
        index = load_sample_index(store, shard)
        for i in range(len(index)):
            span = index[i]
            got.append(read_sample(store.get_range(shard.name, span.offset, span.size)))
    assert [g["__key__"] for g in got] == [w["__key__"] for w in written]
    assert all(g["jpg"] == w["jpg"] and int(g["cls"]) == w["cls"] for g, w in zip(got, written, strict=True))
    assert verify_dataset(store, deep=True).ok
    tars = [store.get_bytes(s.name) for s in manifest.shards]
    assert [s.checksum for s in manifest.shards] == [checksum_of(tar, "xxh3_128") for tar in tars]
    # Asked for SHA-256 (a manifest pinned to vouch for every byte): format 1, as before XXH3.
    assert cli(["index", f"file://{tmp_path}", "--checksum", "sha256", "-q"]) == 0
    manifest = Manifest.load(store)
    assert [s.checksum for s in manifest.shards] == [checksum_of(tar, "sha256") for tar in tars]
    assert manifest.format_version == 1 and verify_dataset(store, deep=True).ok
    store.put(manifest.shards[0].name, tars[0][:-1] + bytes([tars[0][-1] ^ 1]))  # in the record padding
    assert not verify_dataset(store).ok


def test_index_with_a_label_field_no_sample_has_is_refused_and_keeps_the_manifest(tmp_path, capsys, caplog):
    """`dlstore index URL --label-field clss` (a typo) rewrote the manifest as unlabelled, with
    no word. Now a named member that no sample has is refused, naming the members there, and
    the manifest before is kept; the default `cls` missing says the dataset is unlabelled."""
    import webdataset as wds

    with wds.ShardWriter(str(tmp_path / "part-%04d.tar"), maxcount=4) as sink:
        for i in range(6):
            sink.write({"__key__": f"img{i:04d}", "jpg": b"\xff\xd8" + bytes(8), "label": str(i % 3)})
    url = f"file://{tmp_path}"
    assert cli(["index", url, "--label-field", "label", "-q"]) == 0
    before = Manifest.load(open_store(url))
    assert before.label_field == "label" and len(before.classes) == 3
    assert cli(["index", url, "--label-field", "lable", "-q"]) == 2
    assert "no sample has a 'lable' member (the members are jpg, label)" in capsys.readouterr().err
    assert Manifest.load(open_store(url)) == before
    caplog.clear()
    assert index_dataset(url).label_field is None
    assert "no sample has a 'cls' member (the members are jpg, label): the manifest is unlabelled" in caplog.text


def test_index_leaves_out_member_extensions_a_manifest_cannot_name_and_names_a_bad_shard(tmp_path, caplog):
    """Foreign shards with members like `000.café` or `000.meta data`: index said it wrote the
    manifest, which then failed to load everywhere ('is not a member extension'). Such members
    are left out of its fields, with a warning; a shard dlstore refuses is named in the error."""
    import webdataset as wds

    with wds.ShardWriter(str(tmp_path / "part-%04d.tar"), maxcount=10) as sink:
        for i in range(3):
            image = io.BytesIO()
            Image.new("RGB", (8, 8), (i, 0, 0)).save(image, "JPEG")
            sink.write({"__key__": f"s{i}", "jpg": image.getvalue(), "cls": i, "café": b"x", "meta data": b"y"})
    assert cli(["index", f"file://{tmp_path}", "-q"]) == 0
    manifest = Manifest.load(open_store(f"file://{tmp_path}"))
    assert manifest.fields == ("cls", "jpg") and manifest.total_samples == 3
    assert "'café'" in caplog.text and "'meta data'" in caplog.text
    with open(tmp_path / "part-0001.tar", "wb") as bad:
        bad.write(write_shard_raw_with_name("../evil.jpg"))
    with pytest.raises(CorruptShard, match=r"shard 'part-0001.tar' in file://.*unsafe name"):
        index_dataset(f"file://{tmp_path}")


def write_shard_raw_with_name(name: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    return buffer.getvalue()


def test_index_does_not_replace_another_tools_idx_files_without_overwrite(tmp_path):
    """A DALI `wds2idx` text index beside a tar was replaced by dlstore's binary one without a
    word. Refused before anything is written; --overwrite replaces it; indexing again over
    dlstore's own indexes goes on as before."""
    import webdataset as wds

    with wds.ShardWriter(str(tmp_path / "part-%04d.tar"), maxcount=10) as sink:
        for i in range(3):
            image = io.BytesIO()
            Image.new("RGB", (8, 8), (i, 0, 0)).save(image, "JPEG")
            sink.write({"__key__": f"img{i:04d}", "jpg": image.getvalue(), "cls": i})
    dali = b"v1.2 3\n.jpg 512 1024 ...\n"
    (tmp_path / "part-0000.idx").write_bytes(dali)
    url = f"file://{tmp_path}"
    with pytest.raises(ConfigError, match=r"holds part-0000\.idx, not a dlstore sample index.*--overwrite"):
        index_dataset(url)
    assert (tmp_path / "part-0000.idx").read_bytes() == dali and not (tmp_path / "index.json").exists()
    assert cli(["index", url, "-q", "--overwrite"]) == 0
    assert (tmp_path / "part-0000.idx").read_bytes()[:6] == b"DLSIDX"
    assert index_dataset(url).total_samples == 3


def test_index_refuses_a_place_without_shards(tmp_path):
    with pytest.raises(FormatError, match="found none"):
        index_dataset(f"file://{tmp_path}")


# -- the real Swift server, over the Swift and S3 APIs --------------------------------------------
def _swift_config(server, which: str) -> StoreConfig:
    env = server.swift_env() if which == "swift" else server.s3_env()
    config = StoreConfig.from_env(env)
    return dataclasses.replace(config, swift=dataclasses.replace(config.swift, segment_size=64 * 1024))


@pytest.mark.parametrize("api", ["swift", "s3"])
def test_convert_into_swift_over_both_apis(data, tmp_path, request, api, swift_server):
    name = request.getfixturevalue("swift_container" if api == "swift" else "s3_bucket")
    config = _swift_config(swift_server, api)
    url = f"{api}://{name}/train"
    made = data["imagenet"]
    options = dataclasses.replace(OPTS, samples_per_shard=None, shard_size=100_000)
    summary = convert("imagenet", made.root, url, options, config=config)
    assert summary.shards >= 2
    check_exactly_once(url, made.samples["train"], config)
    report = verify_dataset(url, deep=True, config=config)
    assert report.ok, report.problems
    # One ranged GET per sample through the sample index.
    store = open_store(url, config)
    shard = summary.manifest.shards[1]
    index = load_sample_index(store, shard)
    span = index[len(index) - 1]
    assert read_sample(store.get_range(shard.name, span.offset, span.size))["cls"].isdigit()
    # Same bytes as a local conversion; a re-run keeps every shard.
    convert("imagenet", made.root, f"file://{tmp_path}/ref", options)
    for info in summary.manifest.shards:
        assert store.get_bytes(info.name) == (tmp_path / "ref" / info.name).read_bytes()
    assert convert("imagenet", made.root, url, options, config=config).shards_reused == summary.shards


# -- sample index version 2 (per-sample digests) ---------------------------------------------------
def _check_sample_digests(store, manifest: Manifest) -> None:
    for shard in manifest.shards:
        index = load_sample_index(store, shard)
        # Version 3 for XXH3 (which a dlstore that knows only SHA-256 refuses), 2 for SHA-256.
        version = 3 if manifest.checksum_algorithm == "xxh3_128" else 2
        assert index.version == version and store.get_bytes(shard.index)[:8] == b"DLSIDX0%d" % version
        assert index.has_sample_digests
        data = store.get_bytes(shard.name)
        for i in range(len(index)):
            assert index.digest(i) == sample_digest(data[index.offsets[i] : index.offsets[i + 1]])


def test_convert_and_index_write_sample_digests(data, tmp_path):
    made = data["imagenet"]
    summary = convert("imagenet", made.root, f"file://{tmp_path}/conv", dataclasses.replace(OPTS, samples_per_shard=5))
    store = open_store(f"file://{tmp_path}/conv")
    _check_sample_digests(store, summary.manifest)
    assert verify_dataset(store, deep=True).ok
    # The same shards indexed in place (as foreign shards): the same indexes.
    shutil.copytree(tmp_path / "conv", tmp_path / "foreign", ignore=shutil.ignore_patterns("*.idx", MANIFEST_NAME))
    indexed = index_dataset(f"file://{tmp_path}/foreign")
    _check_sample_digests(open_store(f"file://{tmp_path}/foreign"), indexed)
    for shard in summary.manifest.shards:
        assert (tmp_path / "foreign" / shard.index).read_bytes()[88:] == (tmp_path / "conv" / shard.index).read_bytes()[
            88:
        ]


def test_index_in_place_of_a_converted_dataset_keeps_its_class_names_and_how_it_was_made(data, tmp_path):
    """`dlstore index` over a dataset `convert` made (how one made by an older dlstore gets
    sample digests in place) keeps the manifest's wnids and `created` (with it, the decode
    check's claim) where its shards are the same bytes, also in another checksum algorithm,
    and the recipes of its sample indexes, so that `convert` run again keeps every shard; a
    shard relabelled in place (the same size), and neither is kept."""
    import tarfile

    made = data["imagenet"]
    url = f"file://{tmp_path}/d"
    options = dataclasses.replace(OPTS, samples_per_shard=5)
    before = convert("imagenet", made.root, url, options).manifest
    assert before.classes[0].startswith("n") and before.decode_checked
    again = index_dataset(url)
    assert (again.classes, again.created, again.extra) == (before.classes, before.created, before.extra)
    assert [s.checksum for s in again.shards] == [s.checksum for s in before.shards] and again.decode_checked
    assert Manifest.load(open_store(url)) == again
    rerun = convert("imagenet", made.root, url, options)
    assert rerun.shards_written == 0 and rerun.shards_reused == len(before.shards)
    sha = index_dataset(url, checksum_algorithm="sha256")
    assert (sha.classes, sha.created) == (before.classes, before.created) and sha.checksum_algorithm == "sha256"

    shard = tmp_path / "d" / before.shards[0].name
    with tarfile.open(shard) as tar:
        label = next(m for m in tar.getmembers() if m.name.endswith(".cls"))
    data_bytes = bytearray(shard.read_bytes())
    data_bytes[label.offset_data] = ord("1") if data_bytes[label.offset_data] == ord("0") else ord("0")
    shard.write_bytes(bytes(data_bytes))  # another label, the same size
    relabelled = index_dataset(url)
    assert relabelled.classes == tuple(str(i) for i in range(len(relabelled.classes)))
    assert relabelled.created.tool == "dlstore index" and not relabelled.decode_checked


def test_deep_verify_catches_a_wrong_sample_digest(data, tmp_path):
    made = data["imagenet"]
    url = f"file://{tmp_path}/conv"
    summary = convert("imagenet", made.root, url, dataclasses.replace(OPTS, samples_per_shard=5))
    shard = summary.manifest.shards[0]
    store = open_store(url)
    damaged = bytearray(store.get_bytes(shard.index))
    damaged[-1] ^= 1
    store.put(shard.index, bytes(damaged))
    new_info = dataclasses.replace(shard, index_checksum=checksum_of(bytes(damaged), "xxh3_128"))
    summary.manifest.with_shards([new_info, *summary.manifest.shards[1:]]).save(store)
    report = verify_dataset(store, deep=True)
    assert not report.ok and any("sample digests do not match" in p for p in report.problems)


@pytest.mark.parametrize(
    "index_version, first_algorithm, rerun_algorithm",
    [(1, "xxh3_128", None), (1, "sha256", None), (2, "sha256", "xxh3_128"), (1, "sha256", "xxh3_128")],
)
def test_a_rerun_rewrites_old_indexes_without_rebuilding_the_tars(
    data, tmp_path, index_version, first_algorithm, rerun_algorithm
):
    """Indexes without sample digests (version 1), or checked with another algorithm than the
    one asked for (a SHA-256 conversion run again with --checksum xxh3_128), are rewritten from
    the stored tars; a tar that is not the one its index describes, by a byte anywhere (a
    sample, a header, the end-of-archive blocks), is rebuilt. Without --checksum the rerun
    keeps the dataset's algorithm."""
    made = data["imagenet"]
    url = f"file://{tmp_path}/conv"
    options = dataclasses.replace(OPTS, samples_per_shard=5)
    first = convert("imagenet", made.root, url, dataclasses.replace(options, checksum_algorithm=first_algorithm))
    assert first.manifest.checksum_algorithm == first_algorithm and first.shards > 3
    store = open_store(url)
    tars = {s.name: store.get_bytes(s.name) for s in first.manifest.shards}
    for shard in first.manifest.shards if index_version == 1 else ():  # as a dlstore before sample digests
        index = load_sample_index(store, shard)
        store.put(
            shard.index, SampleIndex(index.offsets, index.shard_size, index.shard_digest, index.recipe).to_bytes()
        )
    # Tars that are not the ones their indexes describe: a byte of a sample, of a header, of the end blocks.
    names = [s.name for s in first.manifest.shards]
    for shard, at in ((names[0], 600), (names[1], 10), (names[2], len(tars[names[2]]) - 1)):
        store.put(shard, tars[shard][:at] + bytes([tars[shard][at] ^ 1]) + tars[shard][at + 1 :])
    again = convert("imagenet", made.root, url, dataclasses.replace(options, checksum_algorithm=rerun_algorithm))
    assert again.shards_reused == first.shards - 3 and again.shards_written == 3  # only the damaged ones
    _check_sample_digests(store, again.manifest)
    assert {s.name: store.get_bytes(s.name) for s in again.manifest.shards} == tars
    algorithm = rerun_algorithm or first_algorithm
    assert again.manifest.checksum_algorithm == algorithm
    assert [(s.name, s.size, s.checksum) for s in again.manifest.shards] == [
        (name, len(tar), checksum_of(tar, algorithm)) for name, tar in tars.items()
    ]
    if rerun_algorithm is None:  # the same checksums: a checkpoint saved on the first run still resumes
        assert [s.checksum for s in again.manifest.shards] == [s.checksum for s in first.manifest.shards]
        assert again.manifest.shard_table_digest == first.manifest.shard_table_digest
    assert verify_dataset(store).ok


def test_a_conversion_resumed_or_indexed_again_keeps_its_checksum_algorithm(data, tmp_path, caplog):
    """Without --checksum, a conversion resumed after it was cut (no manifest yet: its kept
    indexes tell) and `index` run again keep the dataset's algorithm; asked for another, the
    conversion rewrites the checksums and says that checkpoints saved on it will not resume."""
    made = data["imagenet"]
    url = f"file://{tmp_path}/conv"
    options = dataclasses.replace(OPTS, samples_per_shard=5)
    first = convert("imagenet", made.root, url, dataclasses.replace(options, checksum_algorithm="sha256"))
    store = open_store(url)
    store.delete(MANIFEST_NAME)  # as a conversion cut before its end leaves it
    store.delete(first.manifest.shards[-1].name)
    resumed = convert("imagenet", made.root, url, options)
    assert resumed.shards_reused == first.shards - 1 and resumed.manifest.checksum_algorithm == "sha256"
    assert resumed.manifest.shard_table_digest == first.manifest.shard_table_digest
    with caplog.at_level(logging.WARNING, logger="dlstore.convert"):
        switched = convert("imagenet", made.root, url, dataclasses.replace(options, checksum_algorithm="xxh3_128"))
    assert switched.shards_written == 0 and switched.manifest.checksum_algorithm == "xxh3_128"
    assert any("--resume-any-data" in r.getMessage() for r in caplog.records)
    assert index_dataset(url).checksum_algorithm == "xxh3_128"  # indexed again in place
    assert index_dataset(url, checksum_algorithm="sha256").checksum_algorithm == "sha256"
    assert index_dataset(url).checksum_algorithm == "sha256"


def test_an_unreadable_kept_index_or_another_dataset_overwritten_passes_on_no_algorithm(data, tmp_path):
    """A conversion cut before its manifest takes the algorithm of the first kept index that
    reads (a damaged one is rebuilt); another conversion over it (--overwrite) takes the default."""
    made = data["imagenet"]
    url = f"file://{tmp_path}/conv"
    options = dataclasses.replace(OPTS, samples_per_shard=5)
    first = convert("imagenet", made.root, url, dataclasses.replace(options, checksum_algorithm="sha256"))
    store = open_store(url)
    store.delete(MANIFEST_NAME)
    store.put(first.manifest.shards[0].index, b"not an index")
    resumed = convert("imagenet", made.root, url, options)
    assert resumed.manifest.checksum_algorithm == "sha256" and resumed.shards_written == 1
    other = convert("imagenet", made.root, url, dataclasses.replace(options, samples_per_shard=4, overwrite=True))
    assert other.manifest.checksum_algorithm == "xxh3_128"
