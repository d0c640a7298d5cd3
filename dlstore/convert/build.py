"""Step 3 of a conversion: **build** one shard with `ShardBuilder`. It runs in a worker process of
`workers.py`, or in this one for a single worker. It reads and checks each input, and may resize
or re-encode it. It writes the tar, streamed into a local store or through a temporary file for a
remote one. Then it puts the shard, and then its sample index. Local temp space is at most one
shard per worker.

Resume rests on that order. A shard whose sample index is in the store, whose recipe digest matches,
and whose tar has the recorded size is complete. `existing_shard` keeps it as it is.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from dlstore.convert.encode import encode_input
from dlstore.convert.inputs import Source
from dlstore.convert.options import ConvertOptions, SkippedInput
from dlstore.convert.shard_plan import ShardTask, sample_key, sample_metadata
from dlstore.errors import CorruptSample, CorruptShard, DlstoreError, FormatError, NotFound
from dlstore.format.checksums import DEFAULT_ALGORITHM, PassingHashes, checksum_of, new_hasher
from dlstore.format.manifest import ShardInfo
from dlstore.format.sample_index import SampleIndex, index_name, sample_digest
from dlstore.format.shard_writer import TarShardWriter
from dlstore.format.shards import scan_shard
from dlstore.storage import Store

__all__ = ["BuildContext", "BuildStopped", "Built", "Counters", "ShardBuilder", "existing_shard", "shard_info"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildContext:
    """What every worker needs to build any shard: sent to each worker once, not per shard."""

    store: Store
    source: Source
    options: ConvertOptions
    tmp_dir: str


@dataclass(frozen=True)
class Built:
    """A shard in the store, built now or `reused` from an earlier run, and the inputs it dropped."""

    number: int
    info: ShardInfo
    skipped: tuple[SkippedInput, ...]
    reused: bool = False


class Counters:
    """Samples and bytes done, shared across worker processes, or local ones in-process."""

    def __init__(self, shared: tuple | None = None) -> None:
        self.shared = shared
        self.samples = self.bytes = 0
        self.on_add: Callable[[], None] | None = None  # in-process: report progress
        self._last = 0.0

    def add(self, samples: int, nbytes: int) -> None:
        if self.shared is None:
            self.samples += samples
            self.bytes += nbytes
            if self.on_add is not None and time.monotonic() - self._last > 0.5:
                self._last = time.monotonic()
                self.on_add()
            return
        for value, n in zip(self.shared, (samples, nbytes), strict=True):
            with value.get_lock():
                value.value += n

    def read(self) -> tuple[int, int]:
        if self.shared is None:
            return self.samples, self.bytes
        return self.shared[0].value, self.shared[1].value


class BuildStopped(DlstoreError):
    """A shard's build stopped because the conversion failed elsewhere: another shard, the progress
    callback, Ctrl-C. The caller sees that first error, never this one."""


class ShardBuilder:
    """Builds shards in one process. It checks `stop` before every sample; pool workers get a
    `multiprocessing.Event`. So a failure elsewhere ends this build within one sample, through
    the exception path that removes a half-written object."""

    def __init__(self, context: BuildContext, counters: Counters, stop: Any | None = None) -> None:
        self.context, self.counters, self.stop = context, counters, stop

    def build(self, task: ShardTask) -> Built:
        """Build one shard and put it, then its index, into the store."""
        context = self.context
        out: dict[str, Any] = {}
        chunks = self._chunks(task, out)
        if context.store.scheme == "file":
            # A local store writes beside the target and renames: streaming into it is one write
            # of the data and no temp space.
            context.store.put(task.name, chunks)
        else:
            # Remote stores get a seekable file, so a failed upload is retried from its start.
            with tempfile.NamedTemporaryFile(dir=context.tmp_dir, prefix="shard-", suffix=".tar") as tmp:
                for chunk in chunks:
                    tmp.write(chunk)
                tmp.flush()
                context.store.put(task.name, tmp.name)
        index: SampleIndex = out["index"]
        index_bytes = index.to_bytes()
        # The tar first, then its index: an index in the store means its tar is complete.
        context.store.put(index_name(task.name), index_bytes)
        return Built(task.number, shard_info(task.name, index, index_bytes), out["skipped"])

    def _check_stop(self, task: ShardTask) -> None:
        if self.stop is not None and self.stop.is_set():
            raise BuildStopped(f"{task.name}: stopped, the conversion failed elsewhere")

    def _chunks(self, task: ShardTask, out: dict) -> Iterator[bytes]:
        """The shard's bytes, one sample at a time. `out` receives the skipped inputs and the index.
        A version 2 index holds the digest of exactly the bytes the writer emitted per sample."""
        source, options, counters = self.context.source, self.context.options, self.counters
        parts: list[bytes] = []  # emitted since the last yield, not copied

        class Sink:
            write = parts.append

        writer = TarShardWriter(Sink, options.checksum_algorithm or DEFAULT_ALGORITHM)  # type: ignore[arg-type]
        skipped: list[SkippedInput] = []
        digests: list[bytes] = []
        for position in task.positions:
            self._check_stop(task)
            item = source.items[position]
            try:
                ext, data = encode_input(source.reader.read(item), options)
            except (CorruptSample, OSError) as exc:
                if options.strict:
                    raise CorruptSample(f"{item.id}: {exc}") from None
                skipped.append(SkippedInput(item.id, str(exc)))
                counters.add(1, 0)
                continue
            sample = {ext: data, "cls": str(item.label).encode()}
            if options.metadata:
                sample["json"] = sample_metadata(item, source.classes)
            span = writer.write(sample_key(position), sample)
            counters.add(1, span.size)
            digests.append(sample_digest(b"".join(parts)))
            yield from parts
            parts.clear()
        self._check_stop(task)
        out["index"] = writer.close(recipe=task.recipe).with_sample_digests(digests)
        out["skipped"] = tuple(skipped)
        yield from parts


def shard_info(name: str, index: SampleIndex, index_bytes: bytes) -> ShardInfo:
    """The manifest's entry for a shard whose sample index is `index`, serialised as `index_bytes`.
    The index's checksum is in the algorithm of the shard's."""
    return ShardInfo(
        name,
        index.shard_size,
        len(index),
        index.checksum,
        index_name(name),
        len(index_bytes),
        checksum_of(index_bytes, index.checksum_algorithm),
    )


def _rescanned(store: Store, task: ShardTask, old: SampleIndex, algorithm: str) -> SampleIndex | None:
    """`task`'s sample index walked again from the stored tar, with sample digests and a checksum in
    `algorithm`. The tar must be the one `old` describes: same offsets and size, every byte
    matching `old`'s checksum and sample digests. Both are checked in the same read. Else None,
    and the shard is rebuilt."""
    why = "has no sample digests" if not old.has_sample_digests else f"is not checked with {algorithm}"
    log.info("%s: its sample index %s; rewriting it from the stored tar", task.name, why)
    before = PassingHashes([old.checksum_algorithm])
    try:
        index = scan_shard(before.through(store.get(task.name)), sample_digests=True, checksum_algorithm=algorithm)
    except (FormatError, CorruptShard):  # a damaged tar: rebuilt
        index = None
    if index is None or not (
        np.array_equal(index.offsets, old.offsets)
        and index.shard_size == old.shard_size
        and before.matches(old.checksum)
        and (not old.has_sample_digests or old.sample_digests == index.sample_digests)
    ):
        log.warning("%s: the tar differs from its sample index; rebuilding it", task.name)
        return None
    return SampleIndex(index.offsets, index.shard_size, index.shard_digest, old.recipe, index.sample_digests)


def existing_shard(store: Store, task: ShardTask, sizes: dict[str, int], rehash: bool, algorithm: str) -> Built | None:
    """The shard as an earlier run left it, if it is complete and was built from the same recipe. An
    index without sample digests, or not in the conversion's `algorithm`, is rewritten from the
    stored tar. That is one read and no re-encode, so the tar's bytes stay. An index of an older
    file version is written again in the current one."""
    if task.name not in sizes or index_name(task.name) not in sizes:
        return None
    try:
        index_bytes = store.get_bytes(index_name(task.name))
        index = SampleIndex.from_bytes(index_bytes)
    except (NotFound, FormatError):
        return None
    if index.recipe != task.recipe or index.shard_size != sizes[task.name]:
        return None
    rewritten: SampleIndex | None = index
    if not index.has_sample_digests or index.checksum_algorithm != algorithm:
        rewritten = _rescanned(store, task, index, algorithm)
    if rewritten is None:
        return None
    if rewritten is not index or rewritten.to_bytes() != index_bytes:  # (a version 2 file of an XXH3 shard)
        index_bytes = rewritten.to_bytes()
        store.put(index_name(task.name), index_bytes)
        return Built(task.number, shard_info(task.name, rewritten, index_bytes), (), reused=True)
    if rehash:
        digest = new_hasher(algorithm)
        for chunk in store.get(task.name):
            digest.update(chunk)
        if f"{algorithm}:{digest.hexdigest()}" != index.checksum:
            log.warning("%s: checksum differs from its index; rebuilding it", task.name)
            return None
    return Built(task.number, shard_info(task.name, index, index_bytes), (), reused=True)
