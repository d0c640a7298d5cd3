"""The tar shard writer and the safe reader: determinism, compatibility with GNU tar, tarfile
and webdataset, random access through the sample index, and refusal of malicious tars."""

from __future__ import annotations

import io
import os
import random
import shutil
import subprocess
import tarfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlstore.errors import CorruptShard
from dlstore.format.sample_index import SampleIndex
from dlstore.format.shard_writer import TarShardWriter, _header, _pax_record
from dlstore.format.shards import (
    iter_members,
    iter_samples,
    parse_samples,
    read_sample,
    read_sample_from_file,
    read_shard_index,
    scan_shard,
    shard_name,
    split_member_name,
)


def make_samples(n: int = 20, seed: int = 0) -> list[dict]:
    rnd = random.Random(seed)
    sizes = [0, 1, 511, 512, 513, 1024, 5000]
    samples = []
    for i in range(n):
        size = sizes[i] if i < len(sizes) else rnd.randint(0, 20000)
        samples.append({"__key__": f"{i:08d}", "jpg": rnd.randbytes(size), "cls": str(i % 7).encode(), "json": b"{}"})
    return samples


def write_shard(samples: list[dict]) -> tuple[bytes, SampleIndex]:
    buffer = io.BytesIO()
    writer = TarShardWriter(buffer)
    for sample in samples:
        writer.write(sample["__key__"], sample)
    index = writer.close(recipe=b"r" * 32)
    return buffer.getvalue(), index


def test_writer_is_deterministic_and_indexes_what_it_wrote():
    samples = make_samples()
    data, index = write_shard(samples)
    again, index2 = write_shard(samples)
    assert data == again and index == index2
    assert len(data) % 10240 == 0 and index.shard_size == len(data)
    assert len(index) == len(samples) and index.recipe == b"r" * 32
    assert scan_shard(data) == SampleIndex(index.offsets, index.shard_size, index.shard_digest)
    assert list(iter_samples(data)) == samples


def test_shards_read_with_gnu_tar_tarfile_and_webdataset(tmp_path):
    samples = make_samples()
    samples.append({"__key__": "k" * 150, "jpg": b"a long name goes in a pax header"})
    data, _ = write_shard(samples)
    path = tmp_path / shard_name("shard", 0)
    path.write_bytes(data)
    names = [f"{s['__key__']}.{ext}" for s in samples for ext in s if ext != "__key__"]
    with tarfile.open(path) as tar:
        assert tar.getnames() == names
        member = tar.getmember(names[-1])
        assert (member.mtime, member.uid, member.gid, member.mode) == (0, 0, 0, 0o444)
        assert tar.extractfile(names[-1]).read() == samples[-1]["jpg"]
    if shutil.which("tar"):
        listed = subprocess.run(["tar", "-tf", str(path)], capture_output=True, text=True, check=True)
        assert listed.stdout.split() == names and not listed.stderr
    import webdataset as wds

    read = list(wds.WebDataset(str(path), shardshuffle=False))
    assert [s["__key__"] for s in read] == [s["__key__"] for s in samples]
    assert all(r["jpg"] == s["jpg"] for r, s in zip(read, samples, strict=True))


class ShortReads(io.RawIOBase):
    """A stream that returns at most 700 bytes per read, like a socket."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), 700, len(self.data) - self.pos)
        b[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


def test_iter_samples_reads_buffers_files_chunk_iterators_and_short_reads(tmp_path):
    samples = make_samples()
    data, _ = write_shard(samples)
    path = tmp_path / "s.tar"
    path.write_bytes(data)
    chunks = [data[i : i + 777] for i in range(0, len(data), 777)]
    with open(path, "rb") as file:
        assert list(iter_samples(file)) == samples
    assert list(iter_samples(iter(chunks))) == samples
    assert list(iter_samples(ShortReads(data))) == samples
    assert list(iter_samples(memoryview(data))) == samples


def test_random_access_through_the_index(tmp_path):
    samples = make_samples(30)
    data, index = write_shard(samples)
    path = tmp_path / "shard-000000.tar"
    path.write_bytes(data)
    for i in (0, 7, 29, -1):
        span = index[i]
        assert read_sample(data[span.offset : span.end]) == samples[i]
        assert read_sample(data, span) == samples[i]
    run = index.run(3, 11)
    assert parse_samples(data[run.offset : run.end]) == samples[3:11]
    with open(path, "rb") as file:
        assert [read_sample_from_file(file, index[i]) for i in range(len(index))] == samples
    # Without the .idx file beside it, the index comes from walking the headers.
    assert read_shard_index(path) == SampleIndex(index.offsets, index.shard_size)
    (tmp_path / "shard-000000.idx").write_bytes(index.to_bytes())
    assert read_shard_index(path) == index
    with pytest.raises(CorruptShard):
        read_sample(data, index.run(0, 2))  # two samples where one was expected
    with pytest.raises(IndexError):
        index[30]


def test_reads_webdataset_shardwriter_and_gnu_pax_tars(tmp_path):
    import webdataset as wds

    samples = [
        {"__key__": f"dir/sub.d/s{i:03d}", "jpg": os.urandom(100 + i), "cls": b"%d" % (i % 3)} for i in range(12)
    ]
    with wds.ShardWriter(str(tmp_path / "wds-%06d.tar"), maxcount=5) as sink:
        for s in samples:
            sink.write(s)
    read = []
    for path in sorted(tmp_path.glob("wds-*.tar")):
        got = list(iter_samples(path.read_bytes()))
        index = read_shard_index(path)
        assert len(index) == len(got)
        with open(path, "rb") as file:
            assert [read_sample_from_file(file, index[i]) for i in range(len(index))] == got
        read += got
    assert [s["__key__"] for s in read] == [s["__key__"] for s in samples]
    assert all(r["jpg"] == s["jpg"] and r["cls"] == s["cls"] for r, s in zip(read, samples, strict=True))

    long_key = "x/" * 80 + "sample"  # 166 characters: GNU 'L' records or pax 'path'
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=fmt) as tar:
            directory = tarfile.TarInfo("./x")
            directory.type = tarfile.DIRTYPE
            tar.addfile(directory)
            for name, payload in ((f"./{long_key}.jpg", b"J" * 700), (f"{long_key}.cls", b"1"), ("ümlaut.txt", b"t")):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
        got = list(iter_samples(buffer.getvalue()))
        assert got == [{"__key__": long_key, "jpg": b"J" * 700, "cls": b"1"}, {"__key__": "ümlaut", "txt": b"t"}]


def test_split_member_name_matches_webdataset():
    from webdataset.tariterators import base_plus_ext

    for name in ("a.jpg", "a.seg.png", "d/e/f.JPG", "d.x/f.cls", "noext", "d/.hidden"):
        ours = split_member_name(name)
        theirs = base_plus_ext(name)
        assert ours == (None if theirs[0] is None else (theirs[0], theirs[1].lower())), name


# -- malicious and malformed tars --------------------------------------------------------------
def tar_with(name: str = "a.jpg", data: bytes = b"x" * 10, **fields) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        for key, value in fields.items():
            setattr(info, key, value)
        tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buffer.getvalue()


def patch_header(data: bytes, offset: int, value: bytes, fix_checksum: bool = True) -> bytes:
    header = bytearray(data[:512])
    header[offset : offset + len(value)] = value
    if fix_checksum:
        header[148:156] = b"        "
        header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header) + data[512:]


MALICIOUS = {
    "parent dir": lambda: tar_with("../../etc/passwd.jpg"),
    "nested parent dir": lambda: tar_with("a/../../b.jpg"),
    "absolute": lambda: tar_with("/etc/passwd.jpg"),
    "symlink": lambda: tar_with("a.jpg", type=tarfile.SYMTYPE, linkname="/etc/passwd"),
    "hardlink": lambda: tar_with("a.jpg", type=tarfile.LNKTYPE, linkname="b.jpg"),
    "char device": lambda: tar_with("a.jpg", type=tarfile.CHRTYPE),
    "block device": lambda: tar_with("a.jpg", type=tarfile.BLKTYPE),
    "fifo": lambda: tar_with("a.jpg", type=tarfile.FIFOTYPE),
    "negative size": lambda: patch_header(tar_with(), 124, b"\xff" * 12),
    "huge size": lambda: patch_header(tar_with(), 124, b"\x80" + b"\x00" * 6 + b"\x01" + b"\x00" * 4),
    "non-octal size": lambda: patch_header(tar_with(), 124, b"12x4\0"),
    "minus in size": lambda: patch_header(tar_with(), 124, b"-0000000012\0"),
    "bad checksum": lambda: patch_header(tar_with(), 0, b"b", fix_checksum=False),
    "truncated header": lambda: tar_with()[:300],
    "truncated data": lambda: patch_header(tar_with(), 124, b"%011o\0" % 100000)[:2048],
    "sparse": lambda: patch_header(tar_with(), 156, b"S"),
    "unknown type": lambda: patch_header(tar_with(), 156, b"Z"),
    "non-utf8 name": lambda: patch_header(tar_with(), 0, b"\xff\xfe.jpg\0"),
    "duplicate field": lambda: write_shard_raw([("a.jpg", b"1"), ("a.jpg", b"2")]),
    "bad pax record": lambda: pax_tar(b"99999 path=x\n"),
    "pax size not a number": lambda: pax_tar(_pax_record("size", "1x2")),
    "pax size of 5,000 digits": lambda: pax_tar(_pax_record("size", "9" * 5000)),  # a ValueError past 4,300
    "pax unsafe path": lambda: pax_tar(_pax_record("path", "../up.jpg")),
    "header cut after a pax header": lambda: pax_tar(_pax_record("path", "a.jpg"))[:1024],
}


def write_shard_raw(members: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return buffer.getvalue()


def pax_tar(record: bytes) -> bytes:
    pad = -len(record) % 512
    return _header(b"pax", len(record), b"x") + record + bytes(pad) + _header(b"a.jpg", 0, b"0") + bytes(1024)


@pytest.mark.parametrize("case", sorted(MALICIOUS))
def test_reader_refuses_malicious_tars(case, tmp_path, monkeypatch):
    data = MALICIOUS[case]()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CorruptShard):
        list(iter_samples(data, max_member_size=1 << 20))
    with pytest.raises(CorruptShard):
        list(iter_samples(io.BytesIO(data), max_member_size=1 << 20))
    assert os.listdir(tmp_path) == []  # nothing was written anywhere


def test_directories_and_meta_files_are_skipped_not_refused():
    data = write_shard_raw([("__meta__", b"m"), ("README", b"no extension"), ("k.jpg", b"1"), ("k.cls", b"2")])
    assert list(iter_samples(data)) == [{"__key__": "k", "jpg": b"1", "cls": b"2"}]
    assert [m.name for m in iter_members(data)] == ["__meta__", "README", "k.jpg", "k.cls"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_shards_raise_only_corrupt_shard(data):
    shard, _ = write_shard(make_samples(4, seed=1))
    mutated = bytearray(shard[: data.draw(st.integers(0, len(shard)), label="cut")])
    for _ in range(data.draw(st.integers(0, 6), label="flips")):
        if mutated:
            position = data.draw(st.integers(0, len(mutated) - 1))
            mutated[position] = data.draw(st.integers(0, 255))
    try:
        for sample in iter_samples(bytes(mutated), max_member_size=1 << 20):
            assert isinstance(sample["__key__"], str)
    except CorruptShard:
        pass


@pytest.mark.parametrize("case", sorted(MALICIOUS))
def test_one_sample_reads_refuse_malicious_tars(case):
    """`read_sample` (the loader's per-sample read of a sample's bytes) refuses what `iter_samples` refuses."""
    with pytest.raises(CorruptShard):
        read_sample(MALICIOUS[case]())


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=3000))
def test_random_bytes_raise_only_corrupt_shard(blob):
    try:
        list(iter_samples(blob))
    except CorruptShard:
        pass


def test_writer_refuses_keys_that_would_not_read_back():
    writer = TarShardWriter(io.BytesIO())
    for key in ("a.b", "", "/abs", "x/../y"):
        with pytest.raises(ValueError):
            writer.write(key, {"jpg": b""})
    with pytest.raises(ValueError):
        writer.write("ok", {})


def test_header_checksums_are_summed_exactly():
    """A header whose bytes sum past 65,521 (the modulus of the Adler-32 sums the check adds
    up: fields the reader ignores full of 0xff, a UTF-8 name) reads; a stored checksum off by
    that modulus, or by one, is refused."""
    header = bytearray(_header(("é" * 45 + ".jpg").encode(), 3, b"0"))
    for start, end in ((157, 257), (265, 345), (500, 512)):  # link name, user, group, devices, padding
        header[start:end] = b"\xff" * (end - start)
    header[148:156] = b" " * 8
    total = sum(header)
    assert total > 65521
    header[148:156] = b"%06o\0 " % total
    data = bytes(header) + b"abc" + bytes(509) + bytes(1024)
    assert [m.data for m in iter_members(data)] == [b"abc"]
    for wrong in (total - 65521, total - 1, total + 1):
        bad = data[:148] + b"%06o\0 " % wrong + data[156:]
        with pytest.raises(CorruptShard, match="bad checksum"):
            list(iter_members(bad))


def test_a_huge_label_is_quoted_cut_short_in_its_error():
    """A 20 MB .cls member was quoted whole in the error (and in every epoch's skip warning)."""
    from dlstore.errors import CorruptSample
    from dlstore.format.shards import parse_label

    for raw in (b"x" * 20_000_000, b"7" * 20_000_000):
        with pytest.raises(CorruptSample) as caught:
            parse_label({"__key__": "s1", "cls": raw}, 10)
        assert len(str(caught.value)) < 200 and "20,000,000" in str(caught.value)
