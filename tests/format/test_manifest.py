"""The manifest (`index.json`) and the per-shard sample index: round trips and strict validation."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlstore.errors import ConfigError, FormatError, NotFound
from dlstore.format.checksums import PassingHashes, checksum_of
from dlstore.format.manifest import (
    MANIFEST_NAME,
    CreationInfo,
    Manifest,
    ShardInfo,
    describe_dataset,
    load_sample_index,
)
from dlstore.format.sample_index import SampleIndex, digest_field, index_name, sample_digest
from dlstore.storage import open_store


def example_manifest(shards: int = 3, algorithm: str = "sha256") -> Manifest:
    return Manifest(
        shards=tuple(
            ShardInfo(
                f"shard-{i:06d}.tar",
                10240 * (i + 1),
                5 + i,
                checksum_of(b"%d" % i, algorithm),
                f"shard-{i:06d}.idx",
                136,
                checksum_of(b"i", algorithm),
            )
            for i in range(shards)
        ),
        classes=("n01440764", "n01443537"),
        fields=("jpg", "cls", "json"),
        label_field="cls",
        created=CreationInfo("dlstore convert", "0.1.0", "imagenet", "train", "train", 7, {"shard_size": 1000}),
    )


def test_round_trip_and_store(tmp_path):
    manifest = example_manifest()
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert manifest.total_samples == 5 + 6 + 7 and manifest.total_size == 10240 * 6
    assert manifest.fields == ("cls", "jpg", "json")
    raw = json.loads(manifest.to_json())
    assert raw["total_samples"] == 18 and raw["checksum_algorithm"] == "sha256" and raw["format_version"] == 1
    store = open_store(f"file://{tmp_path}")
    manifest.save(store)
    assert (tmp_path / MANIFEST_NAME).exists()
    assert Manifest.load(store) == manifest
    assert manifest.to_json() == Manifest.load(store).to_json()  # stable bytes


def test_xxh3_checksums_are_format_2_and_round_trip(tmp_path):
    """A dataset checked with XXH3 is format 2 (a dlstore that knows only SHA-256 says
    "upgrade"); one checked with SHA-256 stays format 1, which every dlstore reads."""
    manifest = example_manifest(algorithm="xxh3_128")
    raw = json.loads(manifest.to_json())
    assert (raw["format_version"], raw["checksum_algorithm"]) == (2, "xxh3_128")
    assert raw["shards"][0]["checksum"] == checksum_of(b"0", "xxh3_128") and len(raw["shards"][0]["checksum"]) == 41
    assert Manifest.from_json(manifest.to_json()) == manifest
    store = open_store(f"file://{tmp_path}")
    manifest.save(store)
    assert "format 2, xxh3_128 checksums" in describe_dataset(store)
    # A format 2 manifest may still say sha256 (read as it is; written back as format 1).
    raw = json.loads(example_manifest().to_json())
    raw["format_version"] = 2
    assert Manifest.from_json(json.dumps(raw)).format_version == 1


def test_a_manifest_mixing_checksum_algorithms_is_refused():
    manifest = example_manifest(algorithm="xxh3_128")
    mixed = dataclasses.replace(manifest.shards[1], checksum=checksum_of(b"1", "sha256"))
    with pytest.raises(ConfigError, match="one algorithm"):
        manifest.with_shards((manifest.shards[0], mixed))


def test_describe_dataset(tmp_path):
    store = open_store(f"file://{tmp_path}")
    example_manifest().save(store)
    text = describe_dataset(store)
    assert "18 in 3 shards" in text and "classes  2: n01440764, n01443537" in text
    assert "shard-000000.tar … shard-000002.tar" in text and "seed 7" in text


@pytest.mark.parametrize("source_format", ["imagefolder", "imagenet", "cifar10"])
def test_describe_dataset_shows_the_image_format_only_of_sources_it_shaped(tmp_path, source_format):
    """`convert` records `image_format=png` (its default) for every source, but it encodes only
    CIFAR/MNIST rows: `ls` said `image_format=png` of an ImageFolder dataset of JPEGs."""
    store = open_store(f"file://{tmp_path}")
    options = {"image_format": "png", "quality": 90, "shard_size": 1000}
    created = CreationInfo("dlstore convert", "0.1.0", source_format, "/src", "", 0, options)
    dataclasses.replace(example_manifest(), created=created).save(store)
    (line,) = [line for line in describe_dataset(store).splitlines() if line.startswith("  options")]
    assert "quality=90, shard_size=1000" in line
    assert ("image_format=png" in line) == (source_format == "cifar10")


def test_describe_dataset_tells_version_1_sample_indexes_from_the_manifest(tmp_path):
    """`dlstore ls` says which sample indexes have no sample digests (a node then fetches its
    boundary shards whole), from the manifest's index sizes: no index is fetched."""
    store = open_store(f"file://{tmp_path}")
    manifest = example_manifest()
    sizes = [SampleIndex.file_size(s.samples, 1 if i == 1 else 2) for i, s in enumerate(manifest.shards)]
    manifest.with_shards(dataclasses.replace(s, index_size=n) for s, n in zip(manifest.shards, sizes)).save(store)
    assert "indexes  1 of 3 are version 1" in describe_dataset(store)
    index = SampleIndex([0, 512, 1024], 2048)
    assert SampleIndex.file_size(2, 1) == len(index.to_bytes())
    assert SampleIndex.file_size(2, 2) == len(index.with_sample_digests([bytes(16)] * 2).to_bytes())


def valid_dict() -> dict:
    return json.loads(example_manifest().to_json())


def mutate(path: str, value=..., delete: bool = False):
    def apply(raw: dict) -> dict:
        target = raw
        parts = path.split(".")
        for part in parts[:-1]:
            target = target[int(part)] if isinstance(target, list) else target[part]
        last = parts[-1]
        if delete:
            del target[last]
        elif isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value
        return raw

    return apply


BAD = {
    "not an object": (lambda raw: [raw], "expected a JSON object"),
    "missing shards": (mutate("shards", delete=True), "missing shards"),
    "unknown field": (mutate("shardz", []), "unknown field"),
    "wrong format": (mutate("format", "webdataset"), "expected 'dlstore-dataset'"),
    "newer version": (mutate("format_version", 3), "newer dlstore"),
    "zero version": (mutate("format_version", 0), "not supported"),
    "xxh3 in format 1": (mutate("checksum_algorithm", "xxh3_128"), "not supported in format 1"),
    "bool version": (mutate("format_version", True), "expected an integer"),
    "md5": (mutate("checksum_algorithm", "md5"), "not supported"),
    "shards not a list": (mutate("shards", {}), "expected a list"),
    "size a string": (mutate("shards.0.size", "10"), "shards[0].size: expected an integer"),
    "negative samples": (mutate("shards.1.samples", -1), "shards[1].samples"),
    "float size": (mutate("shards.0.size", 1.5), "expected an integer"),
    "huge size": (mutate("shards.0.size", 2**70), "out of range"),
    "bad checksum": (mutate("shards.0.checksum", "sha256:xyz"), "64 lowercase hex"),
    "upper checksum": (mutate("shards.0.checksum", "sha256:" + "A" * 64), "64 lowercase hex"),
    "escaping name": (mutate("shards.0.name", "../other/shard.tar"), "not a relative object key"),
    "absolute name": (mutate("shards.0.name", "/etc/passwd"), "not a relative object key"),
    "duplicate names": (mutate("shards.1.name", "shard-000000.tar"), "share a name"),
    "shard unknown field": (mutate("shards.0.extra", 1), "unknown field"),
    "classes with a number": (mutate("classes.0", 3), "classes[0]: expected a string"),
    "duplicate classes": (mutate("classes", ["a", "a"]), "duplicates"),
    "bad field name": (mutate("fields", ["cls", "../jpg"]), "not a member extension"),
    "label field missing": (mutate("label_field", "label"), "not one of the fields"),
    "total mismatch": (mutate("total_samples", 3), "add up to 18"),
    "created seed string": (mutate("created.seed", "7"), "created.seed"),
    "created options list": (mutate("created.options", []), "created.options"),
    "extra not object": (mutate("extra", 3), "extra: expected an object"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_invalid_manifests_give_clear_format_errors(case):
    change, message = BAD[case]
    raw = change(valid_dict())
    with pytest.raises(FormatError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        Manifest.from_json(json.dumps(raw))


def test_an_xxh3_manifest_takes_xxh3_checksums_only():
    raw = json.loads(example_manifest(algorithm="xxh3_128").to_json())
    for path, value, message in [
        ("shards.0.checksum", checksum_of(b"0", "sha256"), "shards[0].checksum: expected 'xxh3_128:' and 32"),
        ("shards.2.index_checksum", "xxh3_128:" + "0" * 31, "shards[2].index_checksum: expected 'xxh3_128:'"),
        ("checksum_algorithm", "blake3", "not supported in format 2"),
    ]:
        with pytest.raises(FormatError, match=re.escape(message)):
            Manifest.from_json(json.dumps(mutate(path, value)(json.loads(json.dumps(raw)))))


@pytest.mark.parametrize("text", [b"", b"{", b"\xff\xfe", b"[" * 100000 + b"]" * 100000, b'{"a": NaN}', b"null"])
def test_garbage_is_a_format_error(text):
    with pytest.raises(FormatError):
        Manifest.from_json(text)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=120, deadline=None)
@given(json_values)
def test_any_json_gives_a_manifest_or_a_format_error(value):
    try:
        Manifest.from_json(json.dumps(value))
    except FormatError:
        pass


def _leaves(value, path=()):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, path + (i,))
    yield path


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_mutated_manifests_give_a_manifest_or_a_format_error(data):
    raw = valid_dict()
    paths = [p for p in _leaves(raw) if p]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        target = raw
        try:
            for part in path[:-1]:
                target = target[part]
            target[path[-1]] = data.draw(json_values)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation replaced a parent
    try:
        manifest = Manifest.from_json(json.dumps(raw))
    except FormatError:
        return
    assert Manifest.from_json(manifest.to_json()) == manifest


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_manifest_from_random_bytes(blob):
    try:
        Manifest.from_json(blob)
    except FormatError:
        pass


# -- sample index ----------------------------------------------------------------------------
def test_sample_index_round_trip_and_spans():
    index = SampleIndex([0, 1536, 4096, 5120], shard_size=15360, shard_digest=b"s" * 32, recipe=b"r" * 32)
    again = SampleIndex.from_bytes(index.to_bytes())
    assert again == index and len(again) == 3 and len(index.to_bytes()) == 88 + 8 * 4
    assert (again[1].offset, again[1].size) == (1536, 2560)
    assert (again.run(1, 3).offset, again.run(1, 3).end) == (1536, 5120)
    assert again.checksum == "sha256:" + (b"s" * 32).hex()
    assert not again.offsets.flags.writeable
    empty = SampleIndex([0], shard_size=10240)
    assert len(SampleIndex.from_bytes(empty.to_bytes())) == 0
    assert index_name("a/shard-000001.tar") == "a/shard-000001.idx"


@pytest.mark.parametrize(
    "offsets, size",
    [([0, 100], 1024), ([512, 512], 1024), ([1024, 512], 2048), ([0, 4096], 1024), ([], 0)],
)
def test_sample_index_validation(offsets, size):
    with pytest.raises(FormatError):
        SampleIndex(offsets, size)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 200))
def test_sample_index_from_garbage(blob, keep):
    good = SampleIndex(np.arange(0, 5120, 512), 10240).to_bytes()
    for data in (blob, good[:keep] + blob, SampleIndex.MAGIC + blob):
        try:
            SampleIndex.from_bytes(data)
        except FormatError:
            pass


def test_load_sample_index_checks_it_matches_the_manifest(tmp_path):
    store = open_store(f"file://{tmp_path}")
    index = SampleIndex([0, 1024, 2048], 10240, shard_digest=b"\x01" * 32)
    store.put("shard-000000.idx", index.to_bytes())
    shard = ShardInfo("shard-000000.tar", 10240, 2, index.checksum, "shard-000000.idx")
    assert load_sample_index(store, shard) == index
    with pytest.raises(FormatError, match="describes a shard"):
        load_sample_index(store, dataclasses.replace(shard, samples=3))


def test_sample_index_names_the_algorithm_of_its_shard_checksum():
    """An index holds its shard's XXH3 digest with a tag after it: it never passes for a
    SHA-256 one (nor the reverse), and the loader's check against the manifest tells them apart."""
    xxh3, sha = checksum_of(b"tar", "xxh3_128"), checksum_of(b"tar", "sha256")
    index = SampleIndex([0, 1024, 2048], 10240).with_checksum(xxh3)
    again = SampleIndex.from_bytes(index.to_bytes())
    assert again.checksum == xxh3 and again.shard_digest == digest_field(xxh3)
    assert SampleIndex([0, 1024, 2048], 10240).with_checksum(sha).checksum == sha
    # The SHA-256 digest that begins with the same 16 bytes is another checksum.
    lookalike = "sha256:" + xxh3.partition(":")[2] + "00" * 16
    assert SampleIndex([0, 1024, 2048], 10240).with_checksum(lookalike).checksum == lookalike != xxh3
    with pytest.raises(FormatError, match="xxh3_128"):
        index.with_checksum("xxh3_128:123")


def test_load_sample_index_checks_an_xxh3_index_against_the_manifest(tmp_path):
    store = open_store(f"file://{tmp_path}")
    shard_checksum = checksum_of(b"tar", "xxh3_128")
    index = SampleIndex([0, 1024, 2048], 10240).with_checksum(shard_checksum).with_sample_digests([bytes(16)] * 2)
    data = index.to_bytes()
    store.put("shard-000000.idx", data)
    shard = ShardInfo(
        "shard-000000.tar", 10240, 2, shard_checksum, "shard-000000.idx", len(data), checksum_of(data, "xxh3_128")
    )
    assert load_sample_index(store, shard) == index
    with pytest.raises(FormatError, match="describes a shard"):  # another shard's checksum
        load_sample_index(store, dataclasses.replace(shard, checksum=checksum_of(b"other", "xxh3_128")))
    store.put("shard-000000.idx", data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(FormatError, match="fails its checksum"):
        load_sample_index(store, shard)


# -- sample index version 2: per-sample digests ----------------------------------------------------
def test_sample_index_version_2_round_trip_with_sample_digests():
    digests = [sample_digest(bytes([i]) * 7) for i in range(3)]
    index = SampleIndex([0, 1536, 4096, 5120], 15360, shard_digest=b"s" * 32).with_sample_digests(digests)
    data = index.to_bytes()
    assert data[:8] == b"DLSIDX02" and len(data) == 88 + 8 * 4 + 16 * 3
    again = SampleIndex.from_bytes(data)
    assert again == index and again.version == 2 and [again.digest(i) for i in range(3)] == digests
    assert again.digest(-1) == digests[2]
    # Digests are part of what an index is: the same offsets without them are another index.
    assert again != SampleIndex(index.offsets, index.shard_size, index.shard_digest)
    with pytest.raises(FormatError, match="holds"):
        SampleIndex.from_bytes(data[:-1])
    with pytest.raises(FormatError, match="sample digests"):
        SampleIndex([0, 512], 1024, sample_digests=bytes(15))


def test_sample_index_version_1_is_still_read_and_has_no_digests():
    index = SampleIndex([0, 1024, 2048], 10240, shard_digest=b"\x01" * 32)
    data = index.to_bytes()
    assert data[:8] == b"DLSIDX01" and len(data) == 88 + 8 * 3
    again = SampleIndex.from_bytes(data)
    assert again == index and again.version == 1 and again.sample_digests is None
    with pytest.raises(FormatError, match="version 1"):
        again.digest(0)
    with pytest.raises(FormatError, match="not a dlstore sample index"):
        SampleIndex.from_bytes(b"DLSIDX04" + data[8:])
    with pytest.raises(FormatError, match="newer dlstore"):
        SampleIndex.from_bytes(b"DLSIDX04" + data[8:])


def test_sample_index_version_3_holds_a_digest_of_another_algorithm_than_sha256():
    """An XXH3 shard digest is written as version 3, so that a reader of versions 1 and 2 (which
    knows only SHA-256, and would take its 16 bytes and tag for a SHA-256 digest) refuses it;
    version 2 files of XXH3 shards (written before version 3) still read; a node cache keeps
    version 3 indexes without sample digests."""
    checksum = checksum_of(b"shard", "xxh3_128")
    digests = [bytes([i]) * 16 for i in range(3)]
    index = SampleIndex([0, 1024, 2048, 4096], 10240).with_checksum(checksum).with_sample_digests(digests)
    data = index.to_bytes()
    assert data[:8] == b"DLSIDX03" and len(data) == 88 + 8 * 4 + 16 * 3
    again = SampleIndex.from_bytes(data)
    assert again == index and again.version == 3 and again.checksum == checksum and again.has_sample_digests
    old = SampleIndex.from_bytes(b"DLSIDX02" + data[8:])  # as the dlstore before version 3 wrote it
    assert old == index and old.to_bytes() == data
    bare = SampleIndex(index.offsets, index.shard_size, index.shard_digest)  # a cache's copy
    assert bare.to_bytes()[:8] == b"DLSIDX03" and len(bare.to_bytes()) == 88 + 8 * 4
    again = SampleIndex.from_bytes(bare.to_bytes())
    assert again == bare and not again.has_sample_digests and again.checksum == checksum
    with pytest.raises(FormatError, match="sample digests"):
        again.digest(0)
    cached = SampleIndex.from_bytes(b"DLSIDX01" + bare.to_bytes()[8:])  # a node cache's copy before version 3
    assert cached == bare and cached.checksum == checksum and cached.to_bytes()[:8] == b"DLSIDX03"
    sha = SampleIndex([0, 1024], 2048).with_checksum(checksum_of(b"shard", "sha256")).with_sample_digests([bytes(16)])
    assert sha.to_bytes()[:8] == b"DLSIDX02" and sha.version == 2
    with pytest.raises(FormatError, match="version 3 .* SHA-256"):
        SampleIndex.from_bytes(b"DLSIDX03" + sha.to_bytes()[8:])


@pytest.mark.parametrize("algorithm", ["sha256", "xxh3_128"])
@pytest.mark.parametrize("digests", [None, b""], ids=["without-digests", "with-digests"])
def test_a_sample_index_of_no_samples_reads_back_as_it_was_written(algorithm, digests):
    """A shard with no samples (every input of it unreadable) has an index of no samples: its
    file reads back as the same index, with or without sample digests (a version 3 file of no
    samples cannot tell: it has the digests of all of none)."""
    index = SampleIndex([0], 1024, sample_digests=digests).with_checksum(checksum_of(b"", algorithm))
    again = SampleIndex.from_bytes(index.to_bytes())
    assert again == index and again.to_bytes() == index.to_bytes() and len(again) == 0
    assert again.has_sample_digests == (digests is not None or algorithm != "sha256")


def test_load_sample_index_checks_the_index_checksum_in_the_manifest(tmp_path):
    store = open_store(f"file://{tmp_path}")
    index = SampleIndex([0, 1024, 2048], 10240, shard_digest=b"\x01" * 32).with_sample_digests([bytes(16), bytes(16)])
    store.put("shard-000000.idx", index.to_bytes())
    shard = ShardInfo(
        "shard-000000.tar", 10240, 2, index.checksum, "shard-000000.idx", len(index.to_bytes()),
        checksum_of(index.to_bytes(), "sha256"),
    )  # fmt: skip
    assert load_sample_index(store, shard) == index
    damaged = bytearray(index.to_bytes())
    damaged[-1] ^= 1  # a sample digest: the index still parses, only its checksum tells
    store.put("shard-000000.idx", bytes(damaged))
    with pytest.raises(FormatError, match="fails its checksum"):
        load_sample_index(store, shard)


def test_passing_hashes_hand_the_chunks_on_and_match_checksums_of_exactly_those_bytes():
    """What `index` and a conversion's rescan check old checksums with while they scan."""
    chunks = [b"abc", b"", b"defgh" * 1000]
    data = b"".join(chunks)
    hashes = PassingHashes(["sha256", "xxh3_128"])
    assert list(hashes.through(iter(chunks))) == chunks
    for algorithm in ("sha256", "xxh3_128"):
        assert hashes.matches(checksum_of(data, algorithm))
        assert not hashes.matches(checksum_of(data[:-1], algorithm))
    assert not hashes.matches(None) and not hashes.matches("") and not hashes.matches("md5:" + "0" * 32)
    assert not PassingHashes(["sha256"]).matches(checksum_of(b"", "xxh3_128"))


def test_no_dataset_at_a_url_says_so_and_what_to_do(tmp_path):
    """A URL with no dataset (a typo, or data not converted yet): the store's bare 404 for
    index.json was all `dlstore train` said."""
    with pytest.raises(NotFound, match=r"no dlstore dataset at file://.*/nope: .*index\.json.*dlstore convert"):
        Manifest.load(open_store(f"file://{tmp_path}/nope"))


def test_a_manifest_its_reader_would_refuse_is_not_written(tmp_path):
    """CIFAR meta with ten classes named alike converted, and its manifest was written: every
    later `ls`, `verify` and conversion then failed on it."""
    store = open_store(f"file://{tmp_path}/d")
    shard = ShardInfo(name="shard-000000.tar", size=1024, samples=1, checksum=checksum_of(b"x", "xxh3_128"))
    bad = Manifest(shards=(shard,), classes=("cat", "cat"), fields=("cls", "jpg"), label_field="cls")
    with pytest.raises(FormatError, match="duplicates"):
        bad.save(store)
    assert not store.exists(MANIFEST_NAME)


def test_a_shard_said_to_hold_more_samples_than_its_bytes_can_is_refused():
    """A count of 10**9 samples for a small shard went on to a 7 GiB plan; 2**61 to numpy's
    "array is too big". Every sample takes a 512-byte tar header at least."""
    shard = ShardInfo(name="shard-000000.tar", size=10240, samples=20, checksum=checksum_of(b"x", "xxh3_128"))
    text = Manifest(shards=(shard,), classes=("a",), fields=("cls", "jpg"), label_field="cls").to_json().decode()
    Manifest.from_json(text)
    for count in (21, 10**9, 2**61):
        with pytest.raises(FormatError, match=r"shards\[0\]\.samples: .* do not fit in a shard of 10240 bytes"):
            Manifest.from_json(
                text.replace('"samples": 20', f'"samples": {count}').replace(
                    '"total_samples": 20', f'"total_samples": {count}'
                )
            )


def test_a_sample_index_object_longer_than_its_samples_allow_is_not_read_whole(tmp_path, monkeypatch):
    """A manifest naming a 1.5 GB object as a shard's index had it read into memory whole."""
    from dlstore.format.manifest import read_index_bytes

    store = open_store(f"file://{tmp_path}/d")
    store.put("shard-000000.idx", b"")
    shard = ShardInfo("shard-000000.tar", 10240, 3, checksum_of(b"x", "xxh3_128"), "shard-000000.idx")
    with open(tmp_path / "d" / "shard-000000.idx", "wb") as big:
        big.truncate(2**30)  # sparse: no disk taken
    read: list[int] = []
    real_get = type(store).get

    def counting(self, key, start=0, end=None):
        for chunk in real_get(self, key, start, end):
            read.append(len(chunk))
            yield chunk

    monkeypatch.setattr(type(store), "get", counting)
    with pytest.raises(FormatError, match="longer than an index of 3 samples"):
        read_index_bytes(store, shard)
    assert 0 < sum(read) <= SampleIndex.file_size(3, 3) + 1
