"""The C walk of one sample's tar headers answers as the Python reader does, or leaves it to Python."""

from __future__ import annotations

import io
import tarfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlstore.errors import CorruptShard
from dlstore.format import shards
from dlstore.format.sample_index import SampleSpan
from dlstore.format.shard_writer import TarShardWriter
from tests.format.test_shards import MALICIOUS, write_shard_raw

tar_headers = pytest.importorskip("dlstore.format.tar_headers", reason="the C part is not built")


def python_read(buffer: bytes, span: SampleSpan) -> dict | None:
    """The Python reader's sample, or None where it raises `CorruptShard`."""
    kept, shards.tar_headers = shards.tar_headers, None
    try:
        return shards.read_sample(buffer, span)
    except CorruptShard:
        return None
    finally:
        shards.tar_headers = kept


def c_read(buffer: bytes, offset: int, size: int) -> dict | None:
    """The C walk's sample, or None where it leaves the span to Python."""
    plain = tar_headers.sample_members(buffer, offset, size)
    if plain is None:
        return None
    return {"__key__": plain[0], **{ext: buffer[start:stop] for ext, start, stop in plain[1]}}


def check(buffer: bytes, offset: int, size: int) -> dict | None:
    """Where C answers, Python reads the same sample; C's answer."""
    ours = c_read(buffer, offset, size)
    if ours is not None:
        assert ours == python_read(buffer, SampleSpan(offset, size)), (offset, size)
    return ours


def written(samples: list[tuple[str, dict]]) -> tuple[bytes, list[SampleSpan]]:
    buffer = io.BytesIO()
    writer = TarShardWriter(buffer)
    for key, fields in samples:
        writer.write(key, fields)
    index = writer.close()
    return buffer.getvalue(), [index[i] for i in range(len(index))]


PLAIN = [
    ("00000042", {"jpg": b"\xff\xd8" + b"x" * 5000, "cls": b"7", "json": b"{}"}),
    ("dir/sub/k", {"seg.png": b"p" * 511, "cls": b"1"}),
    ("n01440764_10026", {"jpg": b"j" * 512, "cls": b""}),
    ("d.x/f", {"cls": b"3"}),
]


def test_plain_samples_are_read_in_c_as_in_python():
    data, spans = written(PLAIN)
    for span, (key, fields) in zip(spans, PLAIN):
        assert check(data, span.offset, span.size) == {"__key__": key, **fields}
        assert shards.read_sample(data, span) == {"__key__": key, **fields}  # the reader takes the C walk
        viewed = shards.read_sample(data, span, views=True)
        assert all(isinstance(viewed[ext], memoryview) for ext in fields)
        assert {ext: bytes(viewed[ext]) for ext in fields} == fields


def test_an_upper_case_extension_is_lowered_as_in_python():
    data = write_shard_raw([("k.JPG", b"1"), ("k.Cls", b"2")])
    assert check(data, 0, 2048) == {"__key__": "k", "jpg": b"1", "cls": b"2"}


def gnu_or_pax(name: str, fmt: int) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as tar:
        info = tarfile.TarInfo(name)
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    return buffer.getvalue()


LEFT_TO_PYTHON = {
    "a leading ./": lambda: write_shard_raw([("./k.jpg", b"1")]),
    "a meta member": lambda: write_shard_raw([("__meta__", b"m"), ("k.jpg", b"1")]),
    "no extension": lambda: write_shard_raw([("README", b"r"), ("k.jpg", b"1")]),
    "a dot file": lambda: write_shard_raw([("d/.hidden", b"h")]),
    "a directory": lambda: directory_then_member(),
    "two keys": lambda: write_shard_raw([("a.jpg", b"1"), ("b.jpg", b"2")]),
    "a field twice": lambda: write_shard_raw([("k.jpg", b"1"), ("k.JPG", b"2")]),
    "a GNU long name": lambda: gnu_or_pax("d/" + "n" * 120 + ".jpg", tarfile.GNU_FORMAT),
    "a pax header": lambda: gnu_or_pax("\u00e9t\u00e9.jpg", tarfile.PAX_FORMAT),
    "a ustar prefix": lambda: gnu_or_pax("p" * 90 + "/" + "q" * 60 + ".jpg", tarfile.USTAR_FORMAT),
    "a signed checksum": lambda: signed_checksum(),
}


def directory_then_member() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        folder = tarfile.TarInfo("d")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        member = tarfile.TarInfo("d/k.jpg")
        member.size = 1
        tar.addfile(member, io.BytesIO(b"1"))
    return buffer.getvalue()


def signed_checksum() -> bytes:
    """A header with a byte over 127 (in its user name) and the checksum old tars summed as signed bytes."""
    header = bytearray(write_shard_raw([("k.jpg", b"1")])[:512])
    header[265] = 0xE9
    header[148:156] = b"        "
    signed = sum(b - 256 if b > 127 else b for b in header)
    header[148:156] = b"%06o\0 " % signed
    return bytes(header) + write_shard_raw([("k.jpg", b"1")])[512:]


def members_end(data: bytes) -> int:
    """Where a tar's members end: its first all-zero block, else its end."""
    blocks = range(0, len(data) - 511, 512)
    return next((at for at in blocks if not any(data[at : at + 512])), len(data))


@pytest.mark.parametrize("case", sorted(LEFT_TO_PYTHON))
def test_headers_it_does_not_take_are_left_to_python(case):
    data = LEFT_TO_PYTHON[case]()
    assert c_read(data, 0, members_end(data)) is None
    for size in range(512, len(data) + 1, 512):  # a shorter span may hold a plain sample
        check(data, 0, size)
    if case == "a signed checksum":  # Python reads it: the reader still gives the sample
        assert shards.read_sample(data, SampleSpan(0, 1024)) == {"__key__": "k", "jpg": b"1"}


@pytest.mark.parametrize("case", sorted(MALICIOUS))
def test_it_never_takes_a_malicious_tar(case):
    data = MALICIOUS[case]()
    assert c_read(data, 0, min(members_end(data), len(data))) is None
    for size in range(512, len(data) + 1, 512):
        check(data, 0, size)


def test_spans_outside_the_buffer_are_left_to_python():
    data, spans = written(PLAIN[:1])
    for offset, size in ((-512, 1024), (0, 0), (0, len(data) + 512), (len(data), 512), (512, spans[0].size)):
        assert c_read(data, offset, size) is None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_damaged_or_misplaced_span_is_read_as_python_reads_it_or_left(data):
    shard, spans = written(PLAIN)
    span = spans[data.draw(st.integers(0, len(spans) - 1), label="sample")]
    mutated = bytearray(shard)
    for _ in range(data.draw(st.integers(0, 4), label="changes")):
        # Mostly the header blocks, where a change matters to the walk.
        block = span.offset + 512 * data.draw(st.integers(0, span.size // 512 - 1))
        position = block + data.draw(st.sampled_from([0, 1, 2, 8, 99, 100, 124, 130, 135, 148, 155, 156, 257, 345]))
        position = min(position + data.draw(st.integers(0, 3)), len(mutated) - 1)
        mutated[position] = data.draw(st.sampled_from([0, 0x20, ord("."), ord("/"), ord("0"), ord("7"), 0x80, 0xFF]))
    offset = span.offset + 512 * data.draw(st.integers(-1, 1), label="shift")
    size = span.size + 512 * data.draw(st.integers(-2, 2), label="grow")
    if offset >= 0 and size > 0:
        check(bytes(mutated), offset, size)
