"""Step 2 of a conversion, **plan**: a seeded global shuffle, cut into shards. The shuffle uses
`numpy.random.RandomState`, whose stream numpy keeps stable across versions. Consecutive runs of
that order become shards, cut at `shard_size` bytes and/or `samples_per_shard`. Sizes are exact
for inputs stored as they are, and a probe-based estimate for re-encoded images. The plan is a
pure function of the listing and the options. So every run of the same conversion makes the same
shards. Each shard's recipe digest lets a resumed run recognise the shards it can keep.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dlstore.convert.encode import encode_input
from dlstore.convert.inputs import Source, SourceItem
from dlstore.convert.options import ConvertOptions
from dlstore.errors import CorruptSample, FormatError
from dlstore.format.shards import shard_name

__all__ = ["ShardTask", "plan_shards", "plan_tasks", "sample_key", "sample_metadata"]


def sample_key(position: int) -> str:
    """The sample key of the input at `position` in the sorted listing: `00000042`."""
    return f"{position:08d}"


def sample_metadata(item: SourceItem, classes: Sequence[str]) -> bytes:
    """The `.json` member of a sample: where it came from and its class."""
    record = {"source": item.id, "label": item.label, "class": classes[item.label]}
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def plan_shards(
    items: Sequence[SourceItem], options: ConvertOptions, sample_bytes: Callable[[int], int]
) -> list[list[int]]:
    """The positions in `items` of each shard's inputs, in write order. A seeded shuffle is cut at
    `shard_size` bytes, as `sample_bytes(position)` counts them, and/or at `samples_per_shard`.

    >>> plan_shards([SourceItem(str(i), 0) for i in range(5)], ConvertOptions(samples_per_shard=2, shuffle=False),
    ...             lambda p: 100)
    [[0, 1], [2, 3], [4]]
    """
    order = np.arange(len(items))
    if options.shuffle:
        order = np.random.RandomState(options.seed).permutation(len(items))
    shards: list[list[int]] = []
    current: list[int] = []
    size = 0
    limit = options.samples_per_shard or len(items) + 1
    for position in order.tolist():
        nbytes = sample_bytes(position)
        if current and (len(current) >= limit or size + nbytes > options.shard_size - 1024):
            shards.append(current)
            current, size = [], 0
        current.append(position)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def _sample_bytes_estimator(source: Source, options: ConvertOptions) -> Callable[[int], int]:
    """Bytes a sample will take in a shard. They are exact for inputs stored as they are. Otherwise
    they are the mean over a deterministic probe of up to 32 inputs encoded here."""

    def member(n: int) -> int:
        return 512 + n + (-n % 512)

    def meta(position: int) -> int:
        return member(len(sample_metadata(source.items[position], source.classes))) if options.metadata else 0

    def cls(position: int) -> int:
        return member(len(str(source.items[position].label)))

    if not source.reencode and not options.resize_max_side:
        return lambda p: member(source.items[p].size) + cls(p) + meta(p)
    step = max(1, len(source.items) // 32)
    probe = []
    for position in range(0, len(source.items), step)[:32]:
        try:
            probe.append(len(encode_input(source.reader.read(source.items[position]), options)[1]))
        except (CorruptSample, FormatError, OSError):
            continue
    mean = int(np.mean(probe)) if probe else 100_000
    return lambda p: member(mean) + cls(p) + meta(p)


def _recipe(source: Source, options: ConvertOptions, name: str, positions: Sequence[int]) -> bytes:
    """What a shard is made from: a changed input, option or class list gives another digest."""
    h = hashlib.sha256()
    h.update(json.dumps([1, source.format, name, options.shaping(), source.classes], sort_keys=True).encode())
    for p in positions:
        item = source.items[p]
        h.update(f"\n{p}\t{item.id}\t{item.label}\t{item.size}".encode())
    return h.digest()


@dataclass(frozen=True)
class ShardTask:
    """One shard to build: its number and name, its inputs' positions in write order, its recipe digest."""

    number: int
    name: str
    positions: tuple[int, ...]
    recipe: bytes


def plan_tasks(source: Source, options: ConvertOptions) -> list[ShardTask]:
    """Every shard of the dataset, planned from the listing and the options alone."""
    plan = plan_shards(source.items, options, _sample_bytes_estimator(source, options))
    names = [shard_name(options.prefix, i) for i in range(len(plan))]
    return [ShardTask(i, names[i], tuple(p), _recipe(source, options, names[i], p)) for i, p in enumerate(plan)]
