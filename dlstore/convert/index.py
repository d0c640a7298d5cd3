"""`index_dataset`: make shards of other tools, such as `webdataset.ShardWriter` or GNU tar,
readable by dlstore in place. It writes a sample index beside each `.tar`, and an `index.json`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from dlstore import __version__
from dlstore.config import StoreConfig
from dlstore.convert.build import shard_info
from dlstore.errors import ConfigError, CorruptSample, CorruptShard, FormatError, NotFound
from dlstore.format.checksums import DEFAULT_ALGORITHM, PassingHashes
from dlstore.format.manifest import CreationInfo, Manifest, ShardInfo, is_field_name
from dlstore.format.sample_index import SampleIndex, index_name
from dlstore.format.shards import parse_label, scan_shard
from dlstore.storage import Store, open_store

__all__ = ["index_dataset"]

log = logging.getLogger(__name__)


def index_dataset(
    dataset: str | Store,
    *,
    label_field: str | None = None,
    workers: int = 4,
    config: StoreConfig | None = None,
    checksum_algorithm: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    overwrite: bool = False,
) -> Manifest:
    """Build sample indexes and `index.json` for the `.tar` shards under `dataset`, in place. Any
    tool may have written them, such as `webdataset.ShardWriter`.

    Labels are the integer `label_field` members, `cls` by default. A name that no sample has is
    likely mistyped: it is a ConfigError before any manifest is written. The class count is the
    largest label + 1, and class names are `"0"`, `"1"`, …. A manifest there before that describes
    the same shards byte for byte keeps its class names and `created`. Shards without labels give an
    unlabelled manifest. Checksums are in `checksum_algorithm` (`dlstore.format.checksums`). None
    keeps the algorithm of the manifest already there, since a checkpoint names its checksums. Else
    it is XXH3-128.

    >>> index_dataset("s3://bucket/laion-subset").total_samples       # doctest: +SKIP
    """
    named_label, label_field = label_field is not None, label_field or "cls"
    store = dataset if isinstance(dataset, Store) else open_store(dataset, config)
    listed = {info.key for info in store.list("")}
    names = sorted(key for key in listed if key.endswith(".tar"))
    if not names:
        raise FormatError(f"{store.url}: expected WebDataset .tar shards, found none")
    if not overwrite:
        _refuse_to_overwrite_other_indexes(store, [index_name(n) for n in names if index_name(n) in listed])
    try:
        previous: Manifest | None = Manifest.load(store)
    except (NotFound, FormatError):
        previous = None
    if checksum_algorithm is None:
        checksum_algorithm = previous.checksum_algorithm if previous is not None else DEFAULT_ALGORITHM
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="dlstore-index") as pool:
        before = {s.name: s.checksum for s in previous.shards} if previous is not None else {}
        futures = [
            pool.submit(_index_shard, store, name, label_field, checksum_algorithm, before.get(name)) for name in names
        ]
        results = []
        for done, future in enumerate(futures, 1):
            results.append(future.result())
            if progress is not None:
                progress(done, len(futures))
    top = max(r.top_label for r in results)
    labelled = top >= 0 and not any(r.unlabelled for r in results)
    fields = set().union(*(r.fields for r in results))
    if top < 0 and any(r.info is not None and r.info.samples for r in results):
        found = ", ".join(sorted(fields)) or "none"
        if named_label:  # a typo made an unlabelled dataset, silently
            raise ConfigError(
                f"{store.url}: no sample has a {label_field!r} member (the members are {found}); "
                "name the member that holds the label (--label-field)"
            )
        log.warning("%s: no sample has a %r member (the members are %s): the manifest is unlabelled", store.url,
                    label_field, found)  # fmt: skip
    elif top >= 0 and not labelled:
        log.warning("%s: some samples have no %r member; the manifest is unlabelled", store.url, label_field)
    unnamed = sorted(f for f in fields if not is_field_name(f))
    if unnamed:
        # A manifest that named them would not load. The loader reads only its image and label
        # members, so the others are left out, with a warning.
        log.warning(
            "%s: member extensions %s are left out of the manifest's fields (letters, digits, '_', '.', '-' only)",
            store.url,
            ", ".join(repr(f[:40]) for f in unnamed[:5]),
        )
    manifest = Manifest(
        shards=tuple(r.info for r in results),
        classes=tuple(str(i) for i in range(top + 1)) if labelled else (),
        fields=tuple(sorted(fields - set(unnamed))),
        label_field=label_field if labelled else None,
        created=CreationInfo(tool="dlstore index", tool_version=__version__, source_format="webdataset"),
    )
    if previous is not None and all(r.unchanged for r in results) and len(previous.shards) == len(results):
        manifest = _keeping_what_the_shards_had(manifest, previous)
    manifest.save(store)
    return manifest


def _refuse_to_overwrite_other_indexes(store: Store, kept: list[str]) -> None:
    """`ConfigError` before anything is written when a `.idx` beside a shard is not one of ours,
    such as a DALI `wds2idx` text index. Otherwise it would be replaced without a word."""
    ours = (SampleIndex.MAGIC, SampleIndex.MAGIC_V2, SampleIndex.MAGIC_V1)
    other = [name for name in kept if store.get_range(name, 0, 8) not in ours]
    if other:
        raise ConfigError(
            f"{store.url} holds {other[0]}"
            + (f" and {len(other) - 1} more" if len(other) > 1 else "")
            + ", not a dlstore sample index (another tool's?), where `index` writes its own: "
            "move them, or give --overwrite to replace them"
        )


def _keeping_what_the_shards_had(manifest: Manifest, previous: Manifest) -> Manifest:
    """`manifest`, with what the manifest there before (`previous`) said of the same shards, byte
    for byte. Same bytes means the same checksums, in its algorithm. It keeps the class names,
    such as a converted ImageNet's wnids, and `created` and `extra` with
    `Manifest.decode_checked`. Why: `index` is how a dataset converted by an older dlstore gets
    sample digests in place."""
    if [(s.name, s.samples) for s in previous.shards] != [(s.name, s.samples) for s in manifest.shards]:
        return manifest
    if manifest.label_field != previous.label_field or len(previous.classes) < len(manifest.classes):
        return manifest
    return dataclasses.replace(manifest, classes=previous.classes, created=previous.created, extra=previous.extra)


@dataclass
class _IndexedShard:
    """What indexing one shard found: its manifest entry, the members its samples have, the largest
    label or -1, and whether some sample had no label."""

    info: ShardInfo | None = None
    fields: set[str] = field(default_factory=set)
    top_label: int = -1
    unlabelled: bool = False
    unchanged: bool = False  # the bytes the manifest there before gave this shard a checksum of

    def add(self, shard: str, sample: dict, label_field: str) -> None:
        self.fields.update(k for k in sample if not k.startswith("__"))
        if sample.get(label_field) is None:
            self.unlabelled = True
            return
        try:
            label = parse_label(sample, 0, label_field)
        except CorruptSample as exc:
            raise FormatError(f"{shard}: {exc}") from None
        self.top_label = max(self.top_label, label)


def _index_shard(
    store: Store, name: str, label_field: str, checksum_algorithm: str, checksum_before: str | None
) -> _IndexedShard:
    """Scan one shard, put its sample index with sample digests beside it, and say what it holds.
    Also say whether it is the shard that `checksum_before`, from the manifest there before,
    names. An index there before of the same bytes gives the new one its recipe digest. By that
    digest a conversion run again recognises the shard as its own (`build.existing_shard`)."""
    found = _IndexedShard()
    try:
        old: SampleIndex | None = SampleIndex.from_bytes(store.get_bytes(index_name(name)))
    except (NotFound, FormatError):
        old = None
    # The shard's bytes in the older checksums' other algorithms, in the same read.
    before = PassingHashes(
        {c.partition(":")[0] for c in (checksum_before, old and old.checksum) if c} - {checksum_algorithm}
    )
    try:
        index = scan_shard(  # hashes in `checksum_algorithm`
            before.through(store.get(name)),
            on_sample=lambda sample: found.add(name, sample, label_field),
            sample_digests=True,
            checksum_algorithm=checksum_algorithm,
        )
    except CorruptShard as exc:  # among many shards: which one
        raise CorruptShard(f"shard {name!r} in {store.url}: {exc}") from None

    def is_checksum(checksum: str | None) -> bool:
        if (checksum or "").partition(":")[0] == checksum_algorithm:
            return checksum == index.checksum
        return before.matches(checksum)

    if old is not None and is_checksum(old.checksum) and np.array_equal(old.offsets, index.offsets):
        index = SampleIndex(index.offsets, index.shard_size, index.shard_digest, old.recipe, index.sample_digests)
    index_bytes = index.to_bytes()
    store.put(index_name(name), index_bytes)
    found.info = shard_info(name, index, index_bytes)
    found.unchanged = is_checksum(checksum_before)
    return found
