"""`verify_dataset`: check a finished dataset against its manifest, shard by shard, in threads.

The quick check compares each shard's size, checksum and sample index with the manifest. `deep` also
walks every shard and checks every sample. A sample must decode as the loader's first decode of it
would, have a label in range, and sit where the index says.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from dlstore.config import StoreConfig
from dlstore.errors import CorruptSample, CorruptShard, FormatError, NotFound
from dlstore.format.checksums import checksum_of, new_hasher
from dlstore.format.manifest import MANIFEST_NAME, Manifest, ShardInfo, read_index_bytes
from dlstore.format.sample_index import SampleIndex
from dlstore.format.shards import IMAGE_FIELDS, image_field, parse_label, scan_shard, shown
from dlstore.storage import Store, open_store
from dlstore.transforms import check_decodes

__all__ = ["VerifyReport", "verify_dataset"]

_MAX_BAD_SAMPLES_LISTED = 20


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of `verify_dataset`: `problems` is empty when everything matched."""

    url: str
    shards: int
    samples: int
    bytes: int
    deep: bool
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_dataset(
    dataset: str | Store,
    *,
    deep: bool = False,
    workers: int = 4,
    config: StoreConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Check every shard's size, checksum and sample index against the manifest.

    `deep` also walks every shard. Each sample must decode, carry a label in range and appear where
    its index says, and counts must match. `progress(done, total)` is called after each shard.

    >>> report = verify_dataset("swift://imagenet/train", deep=True)   # doctest: +SKIP
    >>> report.ok, report.problems[:1]                                  # doctest: +SKIP
    (True, ())
    """
    store = dataset if isinstance(dataset, Store) else open_store(dataset, config)
    try:
        manifest = Manifest.load(store)
    except (NotFound, FormatError) as exc:
        return VerifyReport(store.url, 0, 0, 0, deep, (f"{MANIFEST_NAME}: {exc}",))
    problems: list[str] = []
    samples = nbytes = 0
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="dlstore-verify") as pool:
        futures = [pool.submit(_verify_shard, store, manifest, shard, deep) for shard in manifest.shards]
        for done, future in enumerate(futures, 1):
            shard_problems, shard_samples, shard_bytes = future.result()
            problems += shard_problems
            samples += shard_samples
            nbytes += shard_bytes
            if progress is not None:
                progress(done, len(futures))
    if deep and samples != manifest.total_samples and not problems:
        problems.append(f"the shards hold {samples} samples, the manifest says {manifest.total_samples}")
    return VerifyReport(store.url, len(manifest.shards), samples, nbytes, deep, tuple(problems))


def _verify_shard(store: Store, manifest: Manifest, shard: ShardInfo, deep: bool) -> tuple[list[str], int, int]:
    """The problems, samples and bytes of one shard."""
    try:
        actual = store.stat(shard.name).size
    except NotFound:
        return [f"{shard.name}: missing"], 0, 0
    problems: list[str] = []
    if actual != shard.size:
        problems.append(f"{shard.name}: {actual} bytes, the manifest says {shard.size}")
    stored_index = _check_stored_index(store, manifest, shard, problems)
    if not deep:
        algorithm = manifest.checksum_algorithm
        digest = new_hasher(algorithm)
        for chunk in store.get(shard.name):
            digest.update(chunk)
        if f"{algorithm}:{digest.hexdigest()}" != shard.checksum:
            problems.append(f"{shard.name}: checksum differs from the manifest")
        return problems, shard.samples, actual
    samples = _walk_shard(store, manifest, shard, stored_index, problems)
    return problems, samples, actual


def _check_stored_index(store: Store, manifest: Manifest, shard: ShardInfo, problems: list[str]) -> SampleIndex | None:
    """The shard's sample index as stored, checked against the manifest; problems are appended."""
    if not shard.index:
        return None
    try:
        index_bytes = read_index_bytes(store, shard)
        if shard.index_checksum and checksum_of(index_bytes, manifest.checksum_algorithm) != shard.index_checksum:
            problems.append(f"{shard.index}: checksum differs from the manifest")
        stored_index = SampleIndex.from_bytes(index_bytes)
    except NotFound:
        problems.append(f"{shard.index}: missing")
        return None
    except FormatError as exc:
        problems.append(f"{shard.index}: {exc}")
        return None
    if (len(stored_index), stored_index.shard_size) != (shard.samples, shard.size):
        problems.append(
            f"{shard.index}: describes {len(stored_index)} samples / {stored_index.shard_size} bytes, "
            f"the manifest {shard.samples} / {shard.size}"
        )
    return stored_index


def _walk_shard(
    store: Store, manifest: Manifest, shard: ShardInfo, stored_index: SampleIndex | None, problems: list[str]
) -> int:
    """Read the whole shard, checking every sample; append what is wrong, return the samples found."""
    bad: list[str] = []

    def check(sample: dict) -> None:
        problem = _check_sample(sample, manifest)
        if problem:
            bad.append(problem)

    digests = stored_index is not None and stored_index.has_sample_digests
    try:
        index = scan_shard(
            store.get(shard.name),
            on_sample=check,
            sample_digests=digests,
            checksum_algorithm=manifest.checksum_algorithm,
        )
    except CorruptShard as exc:
        problems.append(f"{shard.name}: {exc}")
        return 0
    if index.checksum != shard.checksum:
        problems.append(f"{shard.name}: checksum differs from the manifest")
    if len(index) != shard.samples:
        problems.append(f"{shard.name}: holds {len(index)} samples, the manifest says {shard.samples}")
    if stored_index is not None and not np.array_equal(stored_index.offsets, index.offsets):
        problems.append(f"{shard.index}: sample offsets do not match the shard")
    elif digests and stored_index.sample_digests != index.sample_digests:
        problems.append(f"{shard.index}: sample digests do not match the shard")
    problems += [f"{shard.name}: {b}" for b in bad[:_MAX_BAD_SAMPLES_LISTED]]
    if len(bad) > _MAX_BAD_SAMPLES_LISTED:
        problems.append(f"{shard.name}: … {len(bad) - _MAX_BAD_SAMPLES_LISTED} more bad samples")
    return len(index)


def _check_sample(sample: dict, manifest: Manifest) -> str | None:
    """What is wrong with one sample of a deep check, or None."""
    key = sample["__key__"]
    # The image members the manifest names, as the loader reads them (`SamplePath`). The loader
    # skips an image under another name.
    field = image_field(sample, [f for f in IMAGE_FIELDS if f in manifest.fields])
    if field is None:
        members = ", ".join(k for k in sample if k != "__key__")
        return f"sample {key!r} has no image among the manifest's fields ({members})"
    try:
        check_decodes(sample[field])  # as the loader's first decode would, to find what it would skip
    except Exception as exc:  # any decoder failure means the sample is unusable
        return f"sample {key!r}: {field} does not decode ({type(exc).__name__}: {exc})"
    if manifest.label_field:
        try:
            parse_label(sample, manifest.num_classes, manifest.label_field)
        except CorruptSample:
            raw = sample.get(manifest.label_field)
            allowed = f"an integer in [0, {manifest.num_classes})" if manifest.num_classes else "a non-negative integer"
            return f"sample {key!r}: label {shown(raw)} is not {allowed}"
    if "json" in sample:
        try:
            json.loads(sample["json"])
        except ValueError:
            return f"sample {key!r}: json member is not JSON"
    return None
