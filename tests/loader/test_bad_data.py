"""Reliability against bad bytes (issue 6, cases 3 to 6): corrupt shards in the store and in
the cache, a full cache disk, malicious or broken tars and bad samples, and fuzzed inputs,
each through the real path (store, node cache, dataset, loader) where there is one.

Case 4 mounts a 1 MiB tmpfs (we run as root in CI); where mounting is refused, it falls back
to a file-size rlimit, which fails writes the way a full disk does (EFBIG instead of ENOSPC).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dlstore
from dlstore.cache import CacheConfig, ShardCache, cache_report
from dlstore.errors import CorruptSample, CorruptShard, DlstoreError, NoSpace
from dlstore.format.checksums import checksum_of
from dlstore.format.manifest import Manifest, ShardInfo
from dlstore.format.sample_index import SampleIndex, index_name
from dlstore.format.shard_writer import TarShardWriter
from dlstore.format.shards import read_sample_from_file, read_shard_index, scan_shard, shard_name
from dlstore.storage import open_store
from dlstore.world import World
from tests.format.test_shards import MALICIOUS
from tests.support.loader_support import (
    NUM_CLASSES,
    damaged_below_jpeg,
    folder_with_a_jpeg_damaged_below,
    tiny_jpeg,
    write_dataset,
)


def report(case: str, **fields: object) -> None:
    print(f"\nRELIABILITY {case}: " + ", ".join(f"{k}={v}" for k, v in fields.items()))


def write_samples(store, shards: list[list[tuple[str, dict]]], fields=("cls", "jpg")) -> list[str]:
    """Shards of the given (key, fields) samples, their indexes and the manifest; returns the keys."""
    infos, keys = [], []
    for number, samples in enumerate(shards):
        buffer = io.BytesIO()
        writer = TarShardWriter(buffer)
        for key, sample in samples:
            writer.write(key, sample)
            keys.append(key)
        index = writer.close()
        name = shard_name("shard", number)
        store.put(name, buffer.getvalue())
        store.put(index_name(name), index.to_bytes())
        infos.append(ShardInfo(name=name, size=index.shard_size, samples=len(samples), checksum=index.checksum))
    classes = tuple(f"class{i}" for i in range(NUM_CLASSES))
    Manifest(shards=tuple(infos), classes=classes, fields=fields, label_field="cls").save(store)
    return keys


def put_raw_shard(store, data: bytes, samples: int = 1) -> None:
    """One shard of arbitrary bytes, with a manifest that vouches for exactly these bytes."""
    info = ShardInfo(name="shard-000000.tar", size=len(data), samples=samples, checksum=checksum_of(data, "xxh3_128"))
    store.put(info.name, data)
    Manifest(shards=(info,), classes=("a", "b"), fields=("cls", "jpg"), label_field="cls").save(store)


def dataset(url: str, cache_dir: Path, **options) -> dlstore.Dataset:
    settings_ = dict(
        cache_dir=str(cache_dir),
        cache_limit="50MB",
        transform="eval",
        image_size=8,
        batch_size=4,
        seed=3,
        world=World(0, 1, 1),
        return_keys=True,
    )
    settings_.update(options)
    return dlstore.Dataset(url, **settings_)


def delivered(loader) -> list[str]:
    return [k for _, _, meta in loader for k, p in zip(meta["keys"], meta["padding"].tolist()) if not p]


def loader_error(loader, kind: type[BaseException]) -> BaseException:
    """The error a pass over `loader` ends with, which must be a `kind`.

    A DataLoader iterator freed by the garbage collector (not by its reference count) waits
    5 s per worker to shut down, so the error comes back without its traceback, which would
    tie the loader into reference cycles (as `pytest.raises` would, through the test's frame)."""
    try:
        delivered(loader)
    except Exception as exc:
        assert isinstance(exc, kind), f"expected {kind.__name__}, got {exc!r}"
        return exc.with_traceback(None)
    raise AssertionError(f"the loader finished without raising {kind.__name__}")


def cached_files(cache_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (cache_dir / "shards").iterdir()}


def assert_cache_clean(cache_dir: Path, store) -> None:
    """Nothing half-done is left: no temp file, and every published shard is a store's shard, whole."""
    assert list((cache_dir / "tmp").iterdir()) == []
    whole = {hashlib.sha256(store.get_bytes(i.key)).hexdigest() for i in store.list() if i.key.endswith(".tar")}
    for name, data in cached_files(cache_dir).items():
        assert hashlib.sha256(data).hexdigest() in whole, f"{name} in the cache is not a whole shard"


# -- case 3: corrupt shards ------------------------------------------------------------------------
def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]


@pytest.mark.parametrize("workers, algorithm", [(0, "xxh3_128"), (1, "xxh3_128"), (1, "sha256")])
def test_a_corrupt_shard_in_the_store_is_a_clear_corrupt_shard(tmp_path, workers, algorithm):
    """Either algorithm of the manifest's checksums (format 2's XXH3, format 1's SHA-256)."""
    url = f"file://{tmp_path}/data"
    store = open_store(url)
    write_dataset(store, [4, 4, 4], checksum_algorithm=algorithm)
    assert Manifest.load(store).checksum_algorithm == algorithm
    good = store.get_bytes("shard-000001.tar")
    store.put("shard-000001.tar", flip(good, len(good) // 3))  # same size, other bytes
    ds = dataset(url, tmp_path / "cache")
    error = loader_error(dlstore.Loader(ds, num_workers=workers, device="cpu"), CorruptShard)
    assert "shard-000001.tar" in str(error) and "checksum" in str(error)
    ds.cache.close()  # the prefetch thread may still be in a download (its temp file is legitimate)
    assert_cache_clean(tmp_path / "cache", store)  # the bad copy was never published


@pytest.mark.parametrize(
    ("where", "decode_on"), [("tar header", "worker"), ("jpeg bytes", "worker"), ("jpeg bytes", "device")]
)
def test_a_corrupt_shard_in_the_cache_is_found_and_replaced(tmp_path, where, decode_on):
    """(With `decode_on="device"` the worker reads only the JPEG's headers: a damaged one there
    skipped the sample in every epoch, and the cached copy was never checked.)"""
    url = f"file://{tmp_path}/data"
    store = open_store(url)
    keys = write_dataset(store, [5, 5, 5])
    cache_dir = tmp_path / "cache"
    ds = dataset(url, cache_dir, shuffle=False)
    # Both closed before the damage: the loader's lookahead runs on into the next epoch, and the
    # cache's prefetch fetches that epoch's shards; either would find the damage itself, at any moment.
    with dlstore.Loader(ds, num_workers=0, device="cpu") as loader:
        assert sorted(delivered(loader)) == sorted(keys)
    ds.cache.close()

    # Damage one cached shard in place (same size: only a checksum tells).
    shard = "shard-000001.tar"
    index = read_shard_index(tmp_path / "data" / shard)
    (path,) = [p for p in (cache_dir / "shards").iterdir() if p.name.endswith(shard)]
    original, before = path.read_bytes(), path.stat()
    span = index[2]
    if where == "tar header":
        path.write_bytes(flip(original, span.offset + 100))  # the mode field of sample 2's first header
    else:
        # Sample 2 is .cls (header, one data block) then .jpg (header, data): wreck the JPEG's markers.
        at = span.offset + 3 * 512 + 2
        path.write_bytes(original[:at] + b"\0" * 64 + original[at + 64 :])
    if decode_on == "device":  # damaged where nothing but the decode notices (not the file's times)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))

    ds = dataset(url, cache_dir, shuffle=False, decode_on=decode_on)
    again = delivered(dlstore.Loader(ds, num_workers=1, device="cpu"))
    assert sorted(again) == sorted(keys), "a sample was lost to the damaged cache copy"
    assert path.read_bytes() == original  # replaced by a good copy from the store
    assert cache_report(cache_dir).totals.corrupt_replaced == 1
    assert ds.corrupt_samples == 0
    report(f"case 3 (cache, {where}, decoded on the {decode_on})", lost=0, repeated=0, replaced=1)


# -- case 4: the cache disk full -------------------------------------------------------------------
@contextlib.contextmanager
def small_disk(directory: Path, size: int):
    """A `size`-byte file system at `directory` (a tmpfs), or where mounting is refused, a
    file-size rlimit of `size` bytes: then no file may grow past it, as on a disk that is full."""
    directory.mkdir(parents=True, exist_ok=True)
    command = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)]
    mounted = subprocess.run(command if can_mount() else ["false"], capture_output=True, text=True)
    if mounted.returncode == 0:
        try:
            yield "tmpfs"
        finally:
            subprocess.run(["umount", "-l", str(directory)], check=False)
        return
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, old_limit[1]))
    try:
        yield f"rlimit (mount refused: {mounted.stderr.strip()})"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def can_mount() -> bool:
    return os.geteuid() == 0 and os.environ.get("DLSTORE_TEST_NO_MOUNT") != "1"


def bulky_shards(n_shards: int, per_shard: int, pad: int) -> list[list[tuple[str, dict]]]:
    rng = random.Random(4)
    serial = 0
    shards = []
    for _ in range(n_shards):
        samples = []
        for _ in range(per_shard):
            label = serial % NUM_CLASSES
            fields = {"cls": str(label).encode(), "jpg": tiny_jpeg(label, serial), "bin": rng.randbytes(pad)}
            samples.append((f"s{serial:06d}", fields))
            serial += 1
        shards.append(samples)
    return shards


def test_a_full_cache_disk_is_a_clear_error_and_leaves_nothing_partial(tmp_path):
    url = f"file://{tmp_path}/data"
    store = open_store(url)
    keys = write_samples(store, bulky_shards(6, 4, 60_000), fields=("bin", "cls", "jpg"))  # ~240 KB a shard
    disk = tmp_path / "small"
    with small_disk(disk, 1 << 20 if can_mount() else 64 << 10) as how:
        # The limit says 10 MB, the disk holds 1 MiB: the disk fills before the limit is reached.
        ds = dataset(url, disk / "cache", cache_limit="10MB")
        error = loader_error(dlstore.Loader(ds, num_workers=1, device="cpu"), NoSpace)
        assert "no space" in str(error).lower() or "full" in str(error).lower()
        assert "shard-0000" in str(error)
        ds.cache.close()  # the prefetch thread may still be in a download (its temp file is legitimate)
        assert_cache_clean(disk / "cache", store)
        report("case 4 (disk full)", disk=how, error=type(error).__name__)
        if how != "tmpfs":
            return  # under an rlimit no shard fits anywhere: nothing to evict towards

        # With a limit that fits the disk, eviction keeps the run going.
        shutil.rmtree(disk / "cache")
        loader = dlstore.Loader(dataset(url, disk / "cache2", cache_limit="900KB"), num_workers=1, device="cpu")
        for epoch in range(2):
            loader.set_epoch(epoch)
            assert sorted(delivered(loader)) == sorted(keys)
        # The loader builds the next epoch's first batches ahead and the prefetch runs on: stop
        # both, as for the first cache above (their temp files are downloads in flight).
        loader.close()
        loader.dataset.cache.close()
        assert_cache_clean(disk / "cache2", store)
        assert cache_report(disk / "cache2").totals.evictions > 0


def test_a_cache_set_up_on_a_full_disk_is_a_clear_error(tmp_path):
    """The first use of a new cache directory writes its layout and counters: on a disk that is
    already full that is `NoSpace` naming the directory, as a download that fills it is."""
    if not can_mount():
        pytest.skip("needs root to mount a small tmpfs (a file-size rlimit leaves room for small files)")
    store = open_store(f"file://{tmp_path}/data")
    store.put("shard-000000.tar", bytes(10_000))
    disk = tmp_path / "small"
    with small_disk(disk, 1 << 20):
        with contextlib.suppress(OSError), open(disk / "filler", "wb", buffering=0) as filler:
            while True:
                filler.write(bytes(4096))
        cache = ShardCache(CacheConfig(str(disk / "cache"), "10MB", prefetch=0), store)
        with pytest.raises(NoSpace, match=f"no space in cache {disk / 'cache'}"):
            cache.fetch("shard-000000.tar", 10_000)
        cache.close()


# -- case 5: malicious or broken tars, bad samples --------------------------------------------------
def snapshot(root: Path, skip: Path) -> set[str]:
    return {str(p) for p in root.rglob("*") if skip not in p.parents and p != skip}


@pytest.mark.parametrize("case", sorted(MALICIOUS))
def test_a_malicious_tar_is_a_typed_error_and_nothing_is_written(tmp_path, case):
    url = f"file://{tmp_path}/data"
    store = open_store(url)
    data = MALICIOUS[case]()
    put_raw_shard(store, data + bytes(-len(data) % 512))
    cache_dir = tmp_path / "cache"
    before = snapshot(tmp_path, cache_dir)
    cwd = os.getcwd()
    os.chdir(tmp_path)  # a reader that extracted relative names would write here
    try:
        error = loader_error(dlstore.Loader(dataset(url, cache_dir), num_workers=0, device="cpu"), CorruptShard)
        assert "shard-000000.tar" in str(error)  # named, whatever the reader found wrong
    finally:
        os.chdir(cwd)
    assert snapshot(tmp_path, cache_dir) == before
    assert not (Path("/etc") / "passwd.jpg").exists()


def test_links_and_escapes_through_workers_write_nothing_outside(tmp_path):
    """The same through a DataLoader worker: the typed error crosses the process boundary."""
    outside = tmp_path / f"outside-{uuid.uuid4().hex[:8]}"
    url = f"file://{tmp_path}/data"
    store = open_store(url)
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        link = tarfile.TarInfo("0001.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, str(outside)
        tar.addfile(link)
        escape = tarfile.TarInfo(f"../../{outside.name}/0002.jpg")
        escape.size = 3
        tar.addfile(escape, io.BytesIO(b"abc"))
    put_raw_shard(store, buffer.getvalue(), samples=2)
    error = loader_error(dlstore.Loader(dataset(url, tmp_path / "cache"), num_workers=1, device="cpu"), CorruptShard)
    assert "symbolic link" in str(error) and "shard-000000.tar" in str(error)
    assert not outside.exists()


BAD_LABELS = {"s000002": b"cat", "s000004": b"7", "s000006": b"-1", "s000008": b"", "s000010": b"\xff\xfe"}
BAD_JPEGS = {"s000003": b"\xff\xd8\xff\xe0 truncated", "s000009": b"GIF89a not an image at all"}


def bad_sample_shards() -> list[list[tuple[str, dict]]]:
    shards, serial = [], 0
    for _ in range(3):
        samples = []
        for _ in range(4):
            key = f"s{serial:06d}"
            label = serial % NUM_CLASSES
            fields = {
                "cls": BAD_LABELS.get(key, str(label).encode()),
                "jpg": BAD_JPEGS.get(key) or tiny_jpeg(label, serial),
            }
            samples.append((key, fields))
            serial += 1
        shards.append(samples)
    no_label = ("s000012", {"jpg": tiny_jpeg(1, 12)})
    shards[-1].append(no_label)
    return shards


@pytest.mark.parametrize("workers", [0, 1])
def test_corrupt_jpegs_and_wrong_labels_are_counted_and_skipped_or_raised(tmp_path, workers):
    url = f"file://{tmp_path}/data"
    keys = write_samples(open_store(url), bad_sample_shards())
    bad = set(BAD_LABELS) | set(BAD_JPEGS) | {"s000012"}
    ds = dataset(url, tmp_path / "cache", batch_size=1)  # no padding: each sample comes once
    got = delivered(dlstore.Loader(ds, num_workers=workers, device="cpu"))
    assert sorted(got) == sorted(set(keys) - bad)
    assert ds.corrupt_samples == len(bad)
    strict = dataset(url, tmp_path / "cache", on_corrupt="raise")
    error = loader_error(dlstore.Loader(strict, num_workers=1, device="cpu"), CorruptSample)
    assert any(key in str(error) for key in bad)
    report(f"case 5 (bad samples, {workers} workers)", skipped=len(bad), counted=ds.corrupt_samples)


@pytest.mark.parametrize("engine", ["threads", "processes"])
def test_a_jpeg_garbled_below_its_crops_is_skipped_and_counted_in_every_epoch(tmp_path, engine):
    """The crop-only decode reads the rows below a box too until a sample has decoded once:
    a JPEG garbled in its lower part is a corrupt sample in every epoch, as with a whole-image
    decode, though some epochs' crops lie wholly above the damage; the good samples keep being
    decoded (from their second epoch on, without the rows below their boxes)."""
    from dlstore.transforms import TransformConfig, crop_plan, decode_image, sample_rng

    damaged, first_bad_row = damaged_below_jpeg()
    with pytest.raises(CorruptSample):
        decode_image(damaged)
    url = f"file://{tmp_path}/data"
    shards = [[(f"s{i:06d}", {"cls": b"1", "jpg": damaged if i == 2 else tiny_jpeg(1, i)}) for i in range(4)]]
    keys = write_samples(open_store(url), shards)
    transform = TransformConfig("train", image_size=48, scale=(0.01, 0.03))  # boxes under 2 x 48: not scaled
    epochs = 4
    boxes = [crop_plan(320, 240, transform, sample_rng(3, epoch, 2))[0] for epoch in range(epochs)]
    assert any(box[3] < first_bad_row for box in boxes)  # an epoch whose crop misses the damage
    ds = dataset(url, tmp_path / "cache", transform=transform, image_size=None, batch_size=1)
    loader = dlstore.Loader(ds, num_workers=1, device="cpu", engine=engine)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        assert sorted(delivered(loader)) == sorted(set(keys) - {"s000002"})
    assert ds.corrupt_samples == epochs


class _RegionDecodes:
    """`dlstore.transforms.jpeg_region` that records, per JPEG, whether its first crop-only decode read
    the rows below the crop too (`check_all`)."""

    def __init__(self, real) -> None:
        self.real, self.first_checked = real, {}

    def decode_region(self, data, left, top, width, height, denom, check_all=True):
        self.first_checked.setdefault(bytes(data), bool(check_all))
        return self.real.decode_region(data, left, top, width, height, denom, check_all)


def test_a_dataset_whose_jpegs_convert_decoded_reads_only_the_crops_rows_from_the_first_epoch(tmp_path, monkeypatch):
    """`dlstore convert` decodes every JPEG once (`check_decode`), so the loader need not read
    the rows below each crop in a sample's first epoch: the same batches, and no row read
    below a crop. Without that check, the first epoch reads them (`Manifest.decode_checked`)."""
    import dlstore.transforms
    from dlstore.convert import ConvertOptions, convert

    if dlstore.transforms.cpu_decode.jpeg_region is None:
        pytest.skip("dlstore.transforms.jpeg_region (the crop-only decode) is not built here")
    source = folder_with_a_jpeg_damaged_below(tmp_path / "src", damaged=False)
    epochs = {}
    for name, check in (("checked", True), ("unchecked", False)):
        options = ConvertOptions(samples_per_shard=4, workers=1, check_decode=check)
        manifest = convert("imagefolder", source, f"file://{tmp_path}/{name}", options).manifest
        assert manifest.decode_checked is check
        regions = _RegionDecodes(dlstore.transforms.cpu_decode.jpeg_region)
        monkeypatch.setattr(dlstore.transforms.cpu_decode, "jpeg_region", regions)
        # 64 px crops of 128 x 96 images: never decoded at a reduced scale, so each crop
        # on whole pixels is decoded alone.
        ds = dataset(f"file://{tmp_path}/{name}", tmp_path / f"cache-{name}", transform="train", image_size=64)
        loader = dlstore.Loader(ds, num_workers=2, device="cpu", dtype="uint8", engine="threads")
        epochs[name] = [(images.clone(), labels.clone()) for images, labels, _ in loader]
        loader.close()
        monkeypatch.setattr(dlstore.transforms.cpu_decode, "jpeg_region", regions.real)
        # (The lookahead may have begun the next epoch: only each JPEG's first decode counts.)
        assert len(regions.first_checked) == 6 and set(regions.first_checked.values()) == {not check}
        assert ds.corrupt_samples == 0
    assert len(epochs["checked"]) == len(epochs["unchecked"]) == 2
    for (a, la), (b, lb) in zip(epochs["checked"], epochs["unchecked"], strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)
    assert epochs["checked"][0][0].float().std() > 10  # pixels that show where a crop was taken


@pytest.mark.parametrize("engine", ["threads", "processes"])
def test_no_sample_of_a_dataset_convert_decoded_is_decoded_checked_in_any_process(tmp_path, engine):
    """The worker processes take every sample as known to decode too: the node's marks (which
    a first, checked decode of a sample writes, in whichever process) stay empty for a dataset
    `convert` decoded, and hold every sample for one it did not; the batches are the same."""
    from dlstore.convert import ConvertOptions, convert

    source = folder_with_a_jpeg_damaged_below(tmp_path / "src", damaged=False)
    epochs, marked = {}, {}
    for name, check in (("checked", True), ("unchecked", False)):
        options = ConvertOptions(samples_per_shard=4, workers=1, check_decode=check)
        convert("imagefolder", source, f"file://{tmp_path}/{name}", options)
        cache = tmp_path / f"cache-{name}"
        ds = dataset(f"file://{tmp_path}/{name}", cache, transform="train", image_size=64)
        with dlstore.Loader(ds, num_workers=2, device="cpu", dtype="uint8", engine=engine) as loader:
            epochs[name] = [(images.clone(), labels.clone()) for images, labels, _ in loader]
        marked[name] = sum(path.read_bytes().count(1) for path in (cache / "marks").glob("*.bin"))
    assert marked == {"checked": 0, "unchecked": 6}
    for (a, la), (b, lb) in zip(epochs["checked"], epochs["unchecked"], strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)


# -- case 6: fuzzing the reader, the sample index and the manifest, on the paths the dataset uses ----
def _good_shard() -> tuple[bytes, SampleIndex]:
    buffer = io.BytesIO()
    writer = TarShardWriter(buffer)
    rng = random.Random(0)
    for i in range(5):
        writer.write(f"{i:04d}", {"cls": b"1", "jpg": rng.randbytes(rng.choice([0, 10, 600, 1500])), "json": b"{}"})
    return buffer.getvalue(), writer.close()


GOOD_SHARD, GOOD_INDEX = _good_shard()
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


def _mutate(data: bytes, draw) -> bytes:
    mutated = bytearray(data[: draw(st.integers(0, len(data)), label="cut")])
    for _ in range(draw(st.integers(0, 8), label="edits")):
        if not mutated:
            break
        at = draw(st.integers(0, len(mutated) - 1))
        mutated[at : at + 1] = draw(st.binary(min_size=0, max_size=3))
    return bytes(mutated)


@FUZZ
@given(st.data())
def test_fuzzed_shard_files_as_the_dataset_reads_them(tmp_path_factory, data):
    """`read_shard_index` (seeking over data in a file) and `read_sample_from_file`, and
    `scan_shard` over a stream cut into random chunks: only `CorruptShard` comes out."""
    shard = _mutate(GOOD_SHARD, data.draw)
    path = tmp_path_factory.mktemp("fuzz") / "shard-000000.tar"
    path.write_bytes(shard)
    try:
        index = read_shard_index(path)
        with open(path, "rb") as file:
            for i in range(len(index)):
                read_sample_from_file(file, index[i])
    except CorruptShard:
        pass
    cuts = sorted(data.draw(st.lists(st.integers(0, len(shard)), max_size=6), label="chunks"))
    chunks = [shard[a:b] for a, b in zip([0, *cuts], [*cuts, len(shard)])]
    try:
        scan_shard(iter(chunks))
    except CorruptShard:
        pass


@FUZZ
@given(st.data())
def test_fuzzed_sample_indexes_against_a_real_shard(data):
    """A mutated index file is a `FormatError`; an index that parses but lies about the
    offsets makes reading a `CorruptShard`, never anything else."""
    raw = _mutate(GOOD_INDEX.to_bytes(), data.draw)
    try:
        SampleIndex.from_bytes(raw)
    except DlstoreError:
        pass
    n = data.draw(st.integers(1, 6))
    offsets = sorted(set(data.draw(st.lists(st.integers(0, len(GOOD_SHARD) // 512), min_size=n + 1, max_size=n + 1))))
    try:
        index = SampleIndex([512 * o for o in offsets], len(GOOD_SHARD))
    except DlstoreError:
        return
    file = io.BytesIO(GOOD_SHARD)
    for i in range(len(index)):
        try:
            sample = read_sample_from_file(file, index[i])
        except CorruptShard:
            continue
        assert isinstance(sample["__key__"], str)


def _json_values():
    leaves = (
        st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=12)
    )
    return st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
        max_leaves=8,
    )


def _valid_manifest_dict() -> dict:
    return json.loads(
        Manifest(
            shards=(ShardInfo("shard-000000.tar", len(GOOD_SHARD), len(GOOD_INDEX), GOOD_INDEX.checksum),),
            classes=("a", "b"),
            fields=("cls", "jpg", "json"),
            label_field="cls",
        ).to_json()
    )


@pytest.mark.slow
@FUZZ
@given(st.data())
def test_fuzzed_manifests_through_the_dataset(tmp_path_factory, data):
    """A manifest with any field replaced by any JSON value, read by `Dataset` itself (store,
    manifest, plan, cache limits): a working dataset or a typed error, nothing else."""
    manifest = _valid_manifest_dict()
    target = manifest
    path = data.draw(
        st.lists(st.sampled_from(["shards", 0, "size", "samples", "name", "classes", "fields"]), max_size=3)
    )
    for step in path[:-1]:
        if isinstance(target, dict) and isinstance(step, str) and isinstance(target.get(step), (dict, list)):
            target = target[step]
        elif isinstance(target, list) and isinstance(step, int) and target:
            target = target[0]
    key = path[-1] if path else data.draw(st.sampled_from(sorted(manifest)))
    value = data.draw(_json_values())
    if isinstance(target, dict) and isinstance(key, str):
        target[key] = value
    elif isinstance(target, list) and target:
        target[0] = value
    root = tmp_path_factory.mktemp("fuzzds")
    store = open_store(f"file://{root}")
    store.put("shard-000000.tar", GOOD_SHARD)
    store.put("index.json", json.dumps(manifest).encode())
    try:
        ds = dataset(f"file://{root}", root / "cache", cache_limit="1MB")
        plan = ds.plan(0)
        for b in range(plan.num_batches):
            ds[ds.request(plan, 0, b)]
    except DlstoreError:
        pass


def test_random_bytes_as_a_manifest_through_the_dataset(tmp_path):
    store = open_store(f"file://{tmp_path}/ds")
    rng = np.random.default_rng(0)
    for size in (0, 1, 17, 300):
        store.put("index.json", rng.bytes(size))
        with pytest.raises(DlstoreError):
            dataset(f"file://{tmp_path}/ds", tmp_path / "cache")
