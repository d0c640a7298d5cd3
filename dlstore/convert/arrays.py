"""The CIFAR-10 and MNIST listers. Their inputs are rows of arrays: pickled CIFAR batches, MNIST idx
files. So `ArrayReader` loads an array once per process and hands out rows. The images are
encoded as PNG or JPEG when a shard is built.
"""

from __future__ import annotations

import gzip
import io
import logging
import pickle
import struct
from pathlib import Path
from typing import Any

import numpy as np

from dlstore.convert.inputs import Source, SourceItem, describe_found
from dlstore.convert.options import ConvertOptions
from dlstore.errors import ConfigError, CorruptShard, FormatError
from dlstore.format.shards import iter_members

__all__ = ["ArrayReader", "cifar10_source", "mnist_source"]

log = logging.getLogger(__name__)


class ArrayReader:
    """Inputs are rows of arrays, CIFAR-10 batches or MNIST idx files, loaded lazily per process.

    `parts` maps a part name, an id's first part such as `train`, to a loader spec.
    """

    def __init__(self, kind: str, parts: dict[str, tuple]) -> None:
        self.kind, self.parts = kind, parts
        self._arrays: dict[str, np.ndarray] = {}

    def __getstate__(self) -> dict:
        return {"kind": self.kind, "parts": self.parts, "_arrays": {}}

    def read(self, item: SourceItem) -> np.ndarray:
        part = item.id.split("/", 1)[0]
        if part not in self._arrays:
            self._arrays[part] = _load_array(self.kind, self.parts[part])[0]
        return self._arrays[part][item.offset]


# CIFAR-10 ----------------------------------------------------------------------------------------
_CIFAR_EXPECTED = "cifar-10-batches-py/ (data_batch_1..5, test_batch, batches.meta) or cifar-10-python.tar.gz"


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """The CIFAR batches are pickles, and unpickling untrusted data can run code. So only the names
    a pickled numpy array needs are allowed."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise FormatError(f"the pickle refers to {module}.{name}; a CIFAR batch holds only arrays and lists")
        return super().find_class(module, name)


def _unpickle(data: bytes, what: str) -> dict:
    """A CIFAR batch or batches.meta as a dict with str keys; `FormatError` for anything else."""
    try:
        value = _NumpyOnlyUnpickler(io.BytesIO(data), encoding="bytes").load()
    except FormatError:
        raise
    except Exception as exc:  # a malformed pickle can fail in many ways; all mean "not a CIFAR batch"
        raise FormatError(f"{what}: not a CIFAR-10 python batch ({type(exc).__name__}: {exc})") from None
    if not isinstance(value, dict):
        raise FormatError(f"{what}: expected a pickled dict, found {type(value).__name__}")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in value.items()}


def _cifar_files(src: Path) -> dict[str, tuple]:
    """Where each CIFAR file is: ("file", path) or ("tar.gz", archive, member)."""
    for folder in (src / "cifar-10-batches-py", src):
        if (folder / "batches.meta").is_file():
            return {p.name: ("file", str(p)) for p in folder.iterdir() if p.is_file()}
    archive = src if src.is_file() else src / "cifar-10-python.tar.gz"
    if archive.is_file():
        try:
            with gzip.open(archive, "rb") as stream:
                names = [m.name for m in iter_members(stream, data=False)]
        except (OSError, EOFError, CorruptShard) as exc:
            raise FormatError(f"{archive}: expected {_CIFAR_EXPECTED}; not a readable .tar.gz ({exc})") from None
        return {name.rsplit("/", 1)[-1]: ("tar.gz", str(archive), name) for name in names}
    raise FormatError(f"{src}: expected {_CIFAR_EXPECTED}; found {describe_found(src if src.is_dir() else src.parent)}")


def _read_spec(spec: tuple) -> bytes:
    """The bytes of a file that `_cifar_files` located."""
    if spec[0] == "file":
        return Path(spec[1]).read_bytes()
    with gzip.open(spec[1], "rb") as stream:
        for member in iter_members(stream):
            if member.name == spec[2]:
                return member.data  # type: ignore[return-value]
    raise FormatError(f"{spec[1]}: {spec[2]} vanished")


def _load_array(kind: str, spec: tuple) -> tuple[np.ndarray, list[int]]:
    """Images as N×H×W or N×H×W×3 uint8, and labels, of one CIFAR batch or one MNIST split."""
    if kind == "cifar10":
        batch = _unpickle(_read_spec(spec), spec[-1])
        data, labels = batch.get("data"), batch.get("labels")
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
            raise FormatError(f"{spec[-1]}: expected 'data' as a uint8 N×3072 array")
        if (
            not isinstance(labels, list)
            or len(labels) != len(data)
            or not all(type(x) is int and 0 <= x < 10 for x in labels)
        ):
            raise FormatError(f"{spec[-1]}: expected 'labels' as {len(data)} integers in 0..9")
        return np.ascontiguousarray(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)), labels
    images, labels = _read_idx(spec[0], 2051, 3), _read_idx(spec[1], 2049, 1)
    if len(images) != len(labels):
        raise FormatError(f"{spec[0]} holds {len(images)} images but {spec[1]} {len(labels)} labels")
    return images, [int(x) for x in labels]


def cifar10_source(src: Path, options: ConvertOptions) -> Source:
    """The python version of CIFAR-10: `cifar-10-batches-py/` or the `.tar.gz` it comes in."""
    split = {"val": "test"}.get(options.split or "train", options.split or "train")
    if split not in ("train", "test"):
        raise ConfigError(f"cifar10 splits are 'train' and 'test', not {options.split!r}")
    files = _cifar_files(src)
    wanted = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    missing = [name for name in wanted + ["batches.meta"] if name not in files]
    if missing:
        raise FormatError(f"{src}: expected {_CIFAR_EXPECTED}; missing {', '.join(missing)}")
    meta = _unpickle(_read_spec(files["batches.meta"]), "batches.meta")
    names = meta.get("label_names")
    if not isinstance(names, list) or len(names) != 10:
        raise FormatError("batches.meta: expected 'label_names' with 10 class names")
    classes = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
    items = []
    for batch in wanted:
        _, labels = _load_array("cifar10", files[batch])
        items += [SourceItem(f"{batch}/{i}", label, 0, i) for i, label in enumerate(labels)]
    reader = ArrayReader("cifar10", {batch: files[batch] for batch in wanted})
    return Source("cifar10", src.name, split, classes, items, reader, True)


# MNIST -------------------------------------------------------------------------------------------
# A bound well above EMNIST, the largest MNIST-like set.
_IDX_MAX_BYTES = 4 * 2**30


def _read_idx(path: str, magic: int, ndim: int) -> np.ndarray:
    """An idx array, MNIST's format, checked against its magic number and declared shape."""
    opener = gzip.open if path.endswith(".gz") else open
    header = 4 + 4 * ndim
    try:
        with opener(path, "rb") as file:  # type: ignore[operator]
            head = file.read(header)
            if len(head) < header or struct.unpack(">I", head[:4])[0] != magic:
                what = "images" if ndim == 3 else "labels"
                raise FormatError(f"{path}: not an idx file with magic {magic} (MNIST {what})")
            shape = struct.unpack(f">{ndim}I", head[4:])
            expected = int(np.prod(shape, dtype=np.int64))
            if expected > _IDX_MAX_BYTES:
                raise FormatError(f"{path}: header says {shape}, {expected} bytes: more than any MNIST-like set")
            # No more than the header announces, and one byte to see there is more. So a gzip
            # bomb is not inflated into memory before it is found out.
            data = file.read(expected + 1)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise FormatError(f"{path}: cannot read ({exc})") from None
    if len(data) != expected:
        held = f"{len(data)} bytes of data" if len(data) < expected else "more data than that"
        raise FormatError(f"{path}: header says {shape}, but the file holds {held}")
    return np.frombuffer(data, dtype=np.uint8).reshape(shape)


def _mnist_files(src: Path, prefix: str) -> tuple[str, str]:
    """The images and labels idx files of one split in `src`, `raw/` or `MNIST/raw/`, maybe gzipped."""
    found: dict[str, str] = {}
    for folder in (src, src / "raw", src / "MNIST" / "raw"):
        for kind in ("images-idx3", "labels-idx1"):
            for name in (f"{prefix}-{kind}-ubyte", f"{prefix}-{kind.replace('-', '.')}-ubyte"):
                for candidate in (folder / name, folder / (name + ".gz")):
                    if kind not in found and candidate.is_file():
                        found[kind] = str(candidate)
        if len(found) == 2:
            break
    if len(found) != 2:
        raise FormatError(
            f"{src}: expected MNIST idx files {prefix}-images-idx3-ubyte[.gz] and {prefix}-labels-idx1-ubyte[.gz]; "
            f"found {describe_found(src)}"
        )
    return found["images-idx3"], found["labels-idx1"]


def mnist_source(src: Path, options: ConvertOptions) -> Source:
    """MNIST's idx files, `train-*` or `t10k-*`, as torchvision or the original site lay them out."""
    split = {"val": "test"}.get(options.split or "train", options.split or "train")
    if split not in ("train", "test"):
        raise ConfigError(f"mnist splits are 'train' and 'test', not {options.split!r}")
    spec = _mnist_files(src, "train" if split == "train" else "t10k")
    images, labels = _load_array("mnist", spec)
    if images.shape[1:] != (28, 28):
        log.info("MNIST-format images of %s pixels", images.shape[1:])
    if any(not 0 <= x < 10 for x in labels):
        raise FormatError(f"{spec[1]}: labels outside 0..9")
    items = [SourceItem(f"{split}/{i}", label, 0, i) for i, label in enumerate(labels)]
    return Source(
        "mnist", src.name, split, [str(d) for d in range(10)], items, ArrayReader("mnist", {split: spec}), True
    )
