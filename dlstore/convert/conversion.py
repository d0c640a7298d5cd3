"""`convert`: list → plan → keep what an earlier run finished → build the rest → manifest.

The manifest comes last. `index.json` is deleted at the start and written once every shard is
in place. So a half-finished dataset is never taken for a finished one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable

from dlstore import __version__
from dlstore.config import StoreConfig
from dlstore.convert.arrays import ArrayReader
from dlstore.convert.build import Built, Counters, existing_shard
from dlstore.convert.encode import stored_fields
from dlstore.convert.inputs import Source
from dlstore.convert.options import ConvertOptions, ConvertProgress, ConvertSummary
from dlstore.convert.shard_plan import ShardTask, plan_tasks
from dlstore.convert.sources import list_source
from dlstore.convert.workers import build_shards
from dlstore.errors import ConfigError, DlstoreError, FormatError, NotFound
from dlstore.format.checksums import DEFAULT_ALGORITHM
from dlstore.format.manifest import MANIFEST_NAME, CreationInfo, Manifest
from dlstore.format.sample_index import SampleIndex, index_name
from dlstore.format.shard_writer import is_dlstore_header
from dlstore.format.shards import IMAGE_FIELDS
from dlstore.storage import Store, open_store
from dlstore.transforms import can_check_decodes

__all__ = ["convert"]

log = logging.getLogger(__name__)


def convert(
    fmt: str,
    src: str | os.PathLike[str],
    dest: str | Store,
    options: ConvertOptions = ConvertOptions(),
    *,
    config: StoreConfig | None = None,
    progress: Callable[[ConvertProgress], None] | None = None,
) -> ConvertSummary:
    """Convert the dataset at `src` into shards at `dest`; `fmt` is one of `FORMATS`.

    `dest` is a store URL (`swift://container/imagenet/train`, `s3://bucket/x`, `file:///d`) or a
    `Store`. It becomes the dataset root: `shard-000000.tar`, `shard-000000.idx`, …, `index.json`.
    Its container or bucket is made when missing. `progress` is called with a `ConvertProgress`
    after every shard and a few times a second. An exception it raises stops the conversion, which
    can then be resumed.

    >>> convert("mnist", "./mnist", "file:///data/mnist-train",
    ...         ConvertOptions(split="train", samples_per_shard=10000))     # doctest: +SKIP
    """
    started = time.monotonic()
    options = _with_decode_check(options)
    store = dest if isinstance(dest, Store) else open_store(dest, config)
    store.ensure_container()  # as `swift upload` does; refused rights fail here, before any work
    source = list_source(fmt, src, options)
    previous = _dataset_there(store)
    options = _split_as_recorded(previous, source, options)
    tasks = plan_tasks(source, options)
    creation = _creation_info(source, options)
    same, before, replaced = _check_destination(store, previous, creation, options)

    listed = {info.key: info.size for info in store.list(options.prefix)}
    if same:  # another dataset overwritten passes on nothing
        options = _with_checksum_algorithm(options, store, tasks, listed, before)
    elif options.checksum_algorithm is None:
        options = dataclasses.replace(options, checksum_algorithm=DEFAULT_ALGORITHM)
    built = _kept_shards(store, tasks, listed, options)
    todo = [task for task in tasks if task.number not in built]
    if not options.overwrite:
        _refuse_to_overwrite_foreign_objects(store, todo, listed, replaced)
    report = _ProgressReport(progress, len(source.items), tasks, built)
    build_shards(store, source, options, todo, built, report)

    results = [built[task.number] for task in tasks]
    _check_shards_are_there(store, options.prefix, results)
    manifest = _save_manifest(store, source, options, creation, results)
    _remove_stale_shards(store, listed, tasks, replaced)
    skipped = [s for b in results for s in b.skipped] + source.skipped
    skipped_earlier = sum(len(tasks[b.number].positions) - b.info.samples for b in results if b.reused)
    return ConvertSummary(
        url=store.url,
        samples=manifest.total_samples,
        shards=len(results),
        bytes=manifest.total_size,
        shards_written=sum(not b.reused for b in results),
        shards_reused=sum(b.reused for b in results),
        skipped=tuple(skipped),
        skipped_earlier=skipped_earlier,
        seconds=time.monotonic() - started,
        manifest=manifest,
    )


@dataclasses.dataclass(frozen=True)
class _DatasetThere:
    """What the destination held before this conversion. `present` is False without a manifest;
    `manifest` is None where one does not read. Read once, for both of its uses."""

    present: bool
    manifest: Manifest | None


def _dataset_there(store: Store) -> _DatasetThere:
    try:
        return _DatasetThere(True, Manifest.load(store))
    except NotFound:
        return _DatasetThere(False, None)
    except FormatError:
        return _DatasetThere(True, None)


def _split_as_recorded(previous: _DatasetThere, source: Source, options: ConvertOptions) -> ConvertOptions:
    """Naming the source's default split (`--split train`) or leaving it out is the same conversion.
    But the options record it as given, and with them every shard's recipe. Where the destination
    holds this source's same split, its form is taken. So a rerun in the other form is not
    refused as "other options"."""
    if options.split not in (None, source.split) or previous.manifest is None:
        return options
    created = previous.manifest.created
    recorded = created.options.get("split")
    same_split = created.source_format == source.format and created.split == source.split
    if same_split and recorded in (None, source.split) and recorded != options.split:
        return dataclasses.replace(options, split=recorded)
    return options


def _creation_info(source: Source, options: ConvertOptions) -> CreationInfo:
    return CreationInfo(
        tool="dlstore convert",
        tool_version=__version__,
        source_format=source.format,
        source=source.name,
        split=source.split,
        seed=options.seed if options.shuffle else None,
        options=options.shaping(),
    )


def _with_decode_check(options: ConvertOptions) -> ConvertOptions:
    """`options` without `check_decode` where this Python cannot check JPEGs as the loader's first
    decode would. That is so without simplejpeg, since Pillow decodes past damaged data. So the
    manifest never says JPEGs were checked when they were not."""
    if options.check_decode and not can_check_decodes():
        log.warning(
            "the JPEGs are stored unchecked: the decode check needs simplejpeg (pip install 'dlstore[fast]'); "
            "the loader then reads each sample's rows below its crop once per node"
        )
        return dataclasses.replace(options, check_decode=False)
    return options


def _refusal(url: str, previous: CreationInfo | None, creation: CreationInfo) -> str:
    """Why this conversion does not overwrite the dataset at `url`: it is another one, or this one
    but for the decode check. `previous` says how it was made; None means it is unreadable."""

    def without_check(info: CreationInfo) -> tuple:
        return info.source_format, {k: v for k, v in info.options.items() if k != "check_decode"}

    if previous is not None and without_check(previous) == without_check(creation):
        if creation.options.get("check_decode"):
            return (
                f"{url} already holds this dataset converted without the decode check, which would rebuild every "
                "shard (and change the dataset's checksums where a JPEG fails it): pass --no-check-decode "
                "(check_decode=False) to keep its shards, or overwrite (--overwrite) to rebuild them checked"
            )
        return f"{url} already holds this dataset with its JPEGs checked: leave out --no-check-decode to keep it"
    return (
        f"{url} already holds a dataset made from another source or with other options"
        f"{_differences(previous, creation)}; choose another URL or pass overwrite (--overwrite)"
    )


def _differences(previous: CreationInfo | None, creation: CreationInfo) -> str:
    """` (samples_per_shard: 64 there, 128 here; ...)`: what the refusal is about."""
    if previous is None:
        return " (its manifest cannot be read)"
    there = {"source format": previous.source_format, **previous.options}
    here = {"source format": creation.source_format, **creation.options}
    changed = [f"{k}: {there.get(k)!r} there, {here.get(k)!r} here" for k in sorted(there.keys() | here.keys())
               if there.get(k) != here.get(k)]  # fmt: skip
    return f" ({'; '.join(changed)})" if changed else ""


def _check_destination(
    store: Store, previous: _DatasetThere, creation: CreationInfo, options: ConvertOptions
) -> tuple[bool, str | None, frozenset[str]]:
    """Refuse to overwrite another dataset; remove the manifest before touching any shard. Return
    whether the destination holds this conversion or nothing yet. Also return the checksum
    algorithm of the dataset there, when it is this conversion's. Last come the shards and
    indexes its manifest named: the dataset this one replaces."""
    if not previous.present:
        return True, None, frozenset()
    manifest = previous.manifest
    if manifest is not None:
        same = (manifest.created.source_format, manifest.created.options) == (creation.source_format, creation.options)
        algorithm = manifest.checksum_algorithm
        objects = frozenset(name for shard in manifest.shards for name in (shard.name, shard.index))
    else:
        same, algorithm, objects = False, None, frozenset()
    if not same and not options.overwrite:
        raise ConfigError(_refusal(store.url, manifest.created if manifest is not None else None, creation))
    store.delete(MANIFEST_NAME)
    return same, algorithm if same else None, objects


def _with_checksum_algorithm(
    options: ConvertOptions, store: Store, tasks: list[ShardTask], listed: dict[str, int], before: str | None
) -> ConvertOptions:
    """`options` with the conversion's checksum algorithm: the one asked for, else the one the
    destination uses, else the default. The destination's is its manifest's `before`, or a kept
    sample index's. So a conversion run again or resumed keeps its checksums and its manifest's
    digest, which checkpoints name."""
    asked = options.checksum_algorithm
    if asked is not None:
        if before is not None and before != asked:
            log.warning(
                "%s: rewriting the dataset's checksums from %s to %s (its sample indexes, not its shards): "
                "checkpoints saved on it resume only with --resume-any-data (strict=False)",
                store.url,
                before,
                asked,
            )
        return options
    found = before
    if found is None:  # a conversion cut before its manifest: its first kept index that reads
        for task in tasks:
            if index_name(task.name) not in listed:
                continue
            try:
                found = SampleIndex.from_bytes(store.get_bytes(index_name(task.name))).checksum_algorithm
                break
            except (NotFound, FormatError):
                continue
    if found is not None:
        log.info("%s: checksums in %s, as the dataset's already there", store.url, found)
    return dataclasses.replace(options, checksum_algorithm=found or DEFAULT_ALGORITHM)


def _kept_shards(
    store: Store, tasks: list[ShardTask], listed: dict[str, int], options: ConvertOptions
) -> dict[int, Built]:
    """{shard number: Built} for the shards an earlier run of the same conversion completed."""
    built: dict[int, Built] = {}
    for task in tasks:
        existing = existing_shard(store, task, listed, options.rehash_existing, options.checksum_algorithm)
        if existing is not None:
            built[task.number] = existing
    if built:
        todo = len(tasks) - len(built)
        log.info("%d of %d shards are already in %s; building %d", len(built), len(tasks), store.url, todo)
    return built


class _ProgressReport:
    """Turns the builders' counters into `ConvertProgress` for the caller's callback. The shards
    kept from an earlier run count as done."""

    def __init__(
        self,
        progress: Callable[[ConvertProgress], None] | None,
        total: int,
        tasks: list[ShardTask],
        built: dict[int, Built],
    ) -> None:
        self.progress, self.total, self.tasks, self.built = progress, total, tasks, built
        self.reused_samples = sum(len(tasks[n].positions) for n in built)
        self.reused_bytes = sum(b.info.size for b in built.values())

    def __call__(self, counters: Counters) -> None:
        if self.progress is None:
            return
        samples, nbytes = counters.read()
        self.progress(
            ConvertProgress(
                self.reused_samples + samples,
                self.total,
                self.reused_bytes + nbytes,
                len(self.built),
                len(self.tasks),
                sum(b.reused for b in self.built.values()),
            )
        )


def _check_shards_are_there(store: Store, prefix: str, results: list[Built]) -> None:
    """Every shard and index the manifest will name is in the store at its size, or no manifest is
    written. An object deleted or replaced while the conversion ran would make a dataset that
    fails only later, at `verify` or in training. One listing is made, and what it lacks is asked
    for with HEAD. A Swift container listing may lag behind the objects just written."""
    listed = {info.key: info.size for info in store.list(prefix)}
    expected = {b.info.name: b.info.size for b in results}
    expected |= {b.info.index: b.info.index_size for b in results if b.info.index and b.info.index_size is not None}
    wrong = []
    for key, size in sorted(expected.items()):
        if listed.get(key) == size:
            continue
        try:
            found = store.stat(key).size
        except NotFound:
            wrong.append(f"{key} is gone")
            continue
        if found != size:
            wrong.append(f"{key} has {found} bytes, not the {size} written")
    if wrong:
        raise DlstoreError(
            f"{store.url}: {len(wrong)} object(s) written by this conversion changed before it ended "
            f"({'; '.join(wrong[:3])}{'; ...' if len(wrong) > 3 else ''}); no manifest was written: "
            "run the same conversion again to write them"
        )


def _save_manifest(
    store: Store, source: Source, options: ConvertOptions, creation: CreationInfo, results: list[Built]
) -> Manifest:
    # The fields are predicted rather than collected. A resumed run does not read its kept shards
    # again, and must write the same manifest as an uninterrupted one.
    manifest = Manifest(
        shards=tuple(b.info for b in results),
        classes=tuple(source.classes),
        fields=tuple(sorted(_expected_fields(source, options))),
        label_field="cls",
        created=creation,
    )
    manifest.save(store)
    return manifest


def _expected_fields(source: Source, options: ConvertOptions) -> set[str]:
    """The members a conversion may write: the image, `cls`, and `json` with metadata. The image is
    `jpg`, or `png` for arrays stored as PNG. With `keep_format` it is any format kept, whether
    or not an input is in it."""
    fields = {"cls", "json"} if options.metadata else {"cls"}
    if isinstance(source.reader, ArrayReader):
        return fields | {"png" if options.image_format == "png" else "jpg"}
    if options.keep_format and not options.resize_max_side:
        # Every member a kept format can be stored as (`encode.stored_fields`), not the inputs'
        # extensions. A `.pgm` is stored as Pillow's `ppm`, and a PNG named `.jpg` as `png`. The
        # loader reads only the image members the manifest names.
        fields |= stored_fields() & set(IMAGE_FIELDS)
    return fields | {"jpg"}


def _refuse_to_overwrite_foreign_objects(
    store: Store, todo: list[ShardTask], listed: dict[str, int], replaced: frozenset[str]
) -> None:
    """`ConfigError` before anything is written when a shard would replace an object nothing
    accounts for. Neither the dataset there, through its manifest, nor an earlier conversion,
    through a dlstore sample index beside it, may claim it. Such objects are another tool's
    shards, like WebDataset tars waiting for `dlstore index`."""
    foreign = [task.name for task in todo if task.name in listed and task.name not in replaced]
    foreign = [name for name in foreign if not _written_by_dlstore(store, name, listed)]
    if foreign:
        raise ConfigError(
            f"{store.url} holds {foreign[0]}"
            + (f" and {len(foreign) - 1} more shard name(s)" if len(foreign) > 1 else "")
            + " that no dlstore dataset there accounts for (another tool's shards? `dlstore index` makes a dataset of "
            "them): convert into another URL, or give --overwrite to replace them"
        )


def _written_by_dlstore(store: Store, name: str, listed: dict[str, int]) -> bool:
    """Whether shard `name` is an earlier conversion's. A dlstore sample index is beside it, or its
    first tar header is as `shard_writer` writes them: mtime 0, no user or group names. The
    header check covers a run cut between the two, and a damaged index."""
    if index_name(name) in listed:
        with contextlib.suppress(NotFound, FormatError):
            SampleIndex.from_bytes(store.get_bytes(index_name(name)))
            return True
    try:
        first = store.get_range(name, 0, 512)
    except NotFound:
        return False
    return len(first) == 512 and is_dlstore_header(first)


def _remove_stale_shards(
    store: Store, listed: dict[str, int], tasks: list[ShardTask], replaced: frozenset[str]
) -> None:
    """Delete the objects the old manifest named (`replaced`) that this dataset does not reuse. An
    example is shards 2-5 after a 6-shard dataset was converted again into 2. Left behind, they
    hold space, and `dlstore index` would take them in. Anything else under the shard prefix is
    only named in a warning. The manifest is already new."""
    names = {task.name for task in tasks}
    stale = sorted(set(listed) - names - {index_name(n) for n in names} - {MANIFEST_NAME})
    old = [key for key in stale if key in replaced]
    for key in old:
        with contextlib.suppress(NotFound):
            store.delete(key)
    if old:
        log.info("%s: removed %d object(s) of the dataset it held before, e.g. %s", store.url, len(old), old[0])
    others = [key for key in stale if key not in replaced]
    if others:
        log.warning(
            "%s holds %d object(s) under the shard prefix that this dataset does not use, e.g. %s",
            store.url,
            len(others),
            others[0],
        )
