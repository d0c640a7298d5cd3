"""Dataset converters from ImageNet, ImageFolder, CIFAR-10 and MNIST to tar shards in any store.
Also the two operations on finished datasets: `verify_dataset` and `index_dataset`.

How a conversion runs, one module per step:

1. **List** the source (`sources.py`, with `imagenet.py` and `arrays.py`). It yields every input
   with its label, in a canonical order of sorted source ids, without reading image bytes. Tars are
   indexed in place, never extracted. The item and reader types are in `inputs.py`.
2. **Plan** (`shard_plan.py`): a seeded global shuffle, cut into shards at `shard_size` bytes and/or
   `samples_per_shard`. It is a pure function of the listing and the options.
3. **Build** each shard (`build.py`, encoding with `encode.py`): write the tar, `store.put` it, then
   its sample index. A pool of worker processes does it (`workers.py`). The first failure stops the
   pool before that error is raised.
4. **Resume** (`build.existing_shard`): a shard is kept as it is if its index is in the store with
   the same recipe digest, and its tar has the recorded size.
5. **Manifest last** (`conversion.py`): `index.json` is deleted at the start and written once every
   shard is in place. So a half-finished dataset is never taken for a finished one.

Inputs that cannot be read as images are skipped and listed in the summary. `strict` turns the first
one into a `CorruptSample` error.

>>> summary = convert("imagenet", "/data/ILSVRC2012", "swift://imagenet/train",
...                   ConvertOptions(split="train", workers=8, seed=0))   # doctest: +SKIP
>>> summary.samples, summary.shards                                       # doctest: +SKIP
(1281167, 578)
"""

from __future__ import annotations

from dlstore.convert.conversion import convert
from dlstore.convert.encode import encode_input, jpeg_header
from dlstore.convert.index import index_dataset
from dlstore.convert.inputs import Source, SourceItem
from dlstore.convert.options import ConvertOptions, ConvertProgress, ConvertSummary, SkippedInput
from dlstore.convert.shard_plan import plan_shards, sample_key
from dlstore.convert.sources import FORMATS, list_source
from dlstore.convert.verify import VerifyReport, verify_dataset

__all__ = [
    "FORMATS",
    "ConvertOptions",
    "ConvertProgress",
    "ConvertSummary",
    "SkippedInput",
    "Source",
    "SourceItem",
    "VerifyReport",
    "convert",
    "encode_input",
    "index_dataset",
    "jpeg_header",
    "list_source",
    "plan_shards",
    "sample_key",
    "verify_dataset",
]
