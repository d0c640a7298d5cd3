"""Small synthetic datasets in the real on-disk formats, for tests, benchmarks and the demo.

Each generator writes a dataset exactly as its official distribution lays it out. It returns
a `GeneratedDataset` that lists every input with its expected label. The source ids are those
`dlstore convert` records in each sample's `.json`:

* `make_imagenet`: ILSVRC2012 folders or the official tars; `val/` in any of its layouts.
* `make_imagefolder`: class sub-folders of JPEG, PNG and other files.
* `make_cifar10`: `cifar-10-batches-py/` pickles, optionally packed as `cifar-10-python.tar.gz`.
* `make_mnist`: idx files, gzipped or not.

Stripes, blotches and grain make a JPEG cost about what an ImageNet photo does. Hue, stripe
angle and frequency depend on the class, so a small model can learn them. Everything is
deterministic in `seed`.

    python -m dlstore.demo.datagen imagenet ./imagenet-mini --classes 10 --train-per-class 30
"""

from __future__ import annotations

import argparse
import colorsys
import gzip
import io
import os
import pickle
import struct
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = [
    "CIFAR10_CLASSES",
    "GeneratedDataset",
    "make_cifar10",
    "make_imagefolder",
    "make_imagenet",
    "make_mnist",
    "synthetic_image",
    "synthetic_jpeg",
    "wnids",
]

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


@dataclass
class GeneratedDataset:
    """What a generator wrote: `samples[split]` is a list of `(source_id, label)`.
    `corrupt[split]` lists inputs written broken on purpose, which `samples` leaves out."""

    root: Path
    classes: list[str]
    samples: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    corrupt: dict[str, list[str]] = field(default_factory=dict)
    bytes: int = 0


def wnids(n: int) -> list[str]:
    """`n` distinct, sorted, ImageNet-like WordNet ids such as `n01440764`.

    >>> wnids(2)
    ['n01440764', 'n01447331']
    """
    return [f"n{1440764 + 6567 * i:08d}" for i in range(n)]


def synthetic_image(
    label: int, rng: np.random.Generator, size: tuple[int, int] = (400, 350), gray: bool = False
) -> np.ndarray:
    """A textured uint8 image, HxWx3 or gray HxW, whose hue and stripes depend on `label`."""
    w, h = size
    hue = (label * 0.618034) % 1.0
    base = np.array(colorsys.hsv_to_rgb(hue, 0.65, 0.8), dtype=np.float32) * 255
    angle = np.pi * ((label * 0.381966) % 1.0)
    freq = 2 * np.pi * (3 + (label % 5) * 2) / max(w, h)
    y = np.arange(h, dtype=np.float32)[:, None]
    x = np.arange(w, dtype=np.float32)[None, :]
    wave = np.sin((x * np.cos(angle) + y * np.sin(angle)) * freq + rng.uniform(0, 2 * np.pi))
    image = base * (0.7 + 0.3 * wave[..., None])
    # Blotches at two scales and per-pixel grain give the JPEG a photo's size.
    coarse = rng.integers(-40, 41, size=(h // 16 + 1, w // 16 + 1, 1), dtype=np.int16)
    image += coarse.repeat(16, 0).repeat(16, 1)[:h, :w]
    mid = rng.integers(-32, 33, size=(h // 3 + 1, w // 3 + 1, 3), dtype=np.int16)
    image += mid.repeat(3, 0).repeat(3, 1)[:h, :w]
    image += rng.integers(-50, 51, size=(h, w, 1), dtype=np.int16)
    pixels = np.clip(image, 0, 255).astype(np.uint8)
    if gray:
        return pixels.mean(axis=2).astype(np.uint8)
    return pixels


def synthetic_jpeg(
    label: int, rng: np.random.Generator, size: tuple[int, int] = (400, 350), quality: int = 90
) -> bytes:
    """`synthetic_image` as JPEG bytes."""
    return _encode(synthetic_image(label, rng, size), "JPEG", quality)


def _encode(pixels: np.ndarray, fmt: str, quality: int = 90) -> bytes:
    out = io.BytesIO()
    image = Image.fromarray(pixels)
    if fmt == "JPEG":
        image.save(out, "JPEG", quality=quality)
    else:
        image.save(out, fmt)
    return out.getvalue()


def _corrupt(data: bytes, kind: int) -> bytes:
    """A truncated image, as an interrupted download leaves, or bytes that are no image."""
    return data[: len(data) * 2 // 5] if kind % 2 == 0 else b"this is not an image\n" * 40


def _write(path: Path, data: bytes) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return len(data)


def _tar_bytes(members: Sequence[tuple[str, bytes]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 1_340_000_000, 0o644
            info.uname = info.gname = "imagenet"
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


# -- ImageNet ------------------------------------------------------------------------------
def make_imagenet(
    root: str | os.PathLike[str],
    *,
    num_classes: int = 4,
    train_per_class: int = 5,
    val_per_class: int = 2,
    image_size: tuple[int, int] = (400, 350),
    layout: str = "folders",
    val_layout: str = "csv",
    corrupt: int = 0,
    seed: int = 0,
) -> GeneratedDataset:
    """ILSVRC2012-style data under `root`.

    `layout` is "folders", for `train/` and `val/`, or "tars", the official tar files.
    `val_layout` is "folders" for `val/<wnid>/`, or a flat `val/` with its labels beside. Those
    are "csv" for `LOC_val_solution.csv`, "txt" for `val_labels.txt` and "devkit" for the
    devkit's ground truth and `meta.mat`; "devkit" needs scipy. `corrupt` broken JPEGs are added
    to train. Source ids: train `<wnid>/<file>`, val `<file>` when flat, else `<wnid>/<file>`.
    """
    if layout not in ("folders", "tars") or val_layout not in ("folders", "csv", "txt", "devkit"):
        raise ValueError("layout is 'folders' or 'tars'; val_layout 'folders', 'csv', 'txt' or 'devkit'")
    root = Path(root)
    rng = np.random.default_rng(seed)
    classes = wnids(num_classes)
    result = GeneratedDataset(root, classes)
    train: dict[str, list[tuple[str, bytes]]] = {w: [] for w in classes}
    result.samples["train"], result.corrupt["train"] = [], []
    for label, wnid in enumerate(classes):
        for i in range(train_per_class):
            name = f"{wnid}_{37 * i + 11}.JPEG"
            train[wnid].append((name, synthetic_jpeg(label, rng, image_size)))
            result.samples["train"].append((f"{wnid}/{name}", label))
    for k in range(corrupt):
        wnid = classes[k % num_classes]
        name = f"{wnid}_9{k:04d}.JPEG"
        train[wnid].append((name, _corrupt(synthetic_jpeg(0, rng, image_size), k)))
        result.corrupt["train"].append(f"{wnid}/{name}")
    # Validation images are numbered across classes in a shuffled order, as in ILSVRC2012.
    val_labels = [label for label in range(num_classes) for _ in range(val_per_class)]
    rng.shuffle(val_labels)
    val = [
        (f"ILSVRC2012_val_{i + 1:08d}.JPEG", label, synthetic_jpeg(label, rng, image_size))
        for i, label in enumerate(val_labels)
    ]
    flat = layout == "tars" or val_layout != "folders"
    result.samples["val"] = [(name if flat else f"{classes[label]}/{name}", label) for name, label, _ in val]
    result.bytes = sum(len(d) for files in train.values() for _, d in files) + sum(len(d) for _, _, d in val)

    _write_imagenet_images(root, layout, flat, classes, train, val)
    if flat:
        _write_val_labels(root, val_layout, classes, [(name, label) for name, label, _ in val], rng)
    return result


def _write_imagenet_images(
    root: Path,
    layout: str,
    flat: bool,
    classes: list[str],
    train: dict[str, list[tuple[str, bytes]]],
    val: list[tuple[str, int, bytes]],
) -> None:
    """The images as folders, `train/<wnid>/` and `val/`, or as the official tars."""
    if layout == "folders":
        for wnid, files in train.items():
            for name, data in files:
                _write(root / "train" / wnid / name, data)
        for name, label, data in val:
            _write(root / "val" / (name if flat else f"{classes[label]}/{name}"), data)
    else:
        outer = [(f"{wnid}.tar", _tar_bytes(files)) for wnid, files in train.items()]
        _write(root / "ILSVRC2012_img_train.tar", _tar_bytes(outer))
        _write(root / "ILSVRC2012_img_val.tar", _tar_bytes([(name, data) for name, _, data in val]))


def _write_val_labels(
    root: Path, val_layout: str, classes: list[str], val: list[tuple[str, int]], rng: np.random.Generator
) -> None:
    """The labels of a flat val split, in one of the three forms found in the wild."""
    if val_layout == "devkit":
        _write_devkit(root / "ILSVRC2012_devkit_t12" / "data", classes, [label for _, label in val], rng)
    elif val_layout == "txt":
        lines = [f"{name} {classes[label]}\n" for name, label in val]
        _write(root / "val_labels.txt", "".join(lines).encode())
    else:
        lines = ["ImageId,PredictionString\n"]
        lines += [f"{name[:-5]},{classes[label]} 10 12 200 180 {classes[label]} 5 5 90 90\n" for name, label in val]
        _write(root / "LOC_val_solution.csv", "".join(lines).encode())


def _write_devkit(folder: Path, classes: list[str], labels: list[int], rng: np.random.Generator) -> None:
    """The devkit's ground truth: ILSVRC2012_IDs in an order unrelated to the sorted wnids.
    The real meta.mat does that too. A non-leaf synset is added, which a reader must ignore."""
    # scipy is not a dependency of dlstore: only this devkit layout needs it.
    from scipy.io import savemat

    ids = rng.permutation(len(classes)) + 1  # ILSVRC2012_ID of classes[i]
    fields = [
        "ILSVRC2012_ID",
        "WNID",
        "words",
        "gloss",
        "num_children",
        "children",
        "wordnet_height",
        "num_train_images",
    ]
    synsets = np.zeros((len(classes) + 1,), dtype=[(f, "O") for f in fields])
    for i, wnid in enumerate(classes):
        synsets[i] = (int(ids[i]), wnid, f"thing {i}", "a synthetic class", 0, np.zeros(0), 0, 1300)
    synsets[-1] = (len(classes) + 1, "n00001740", "entity", "the root", 2, np.array([1, 2]), 19, 0)
    folder.mkdir(parents=True, exist_ok=True)
    savemat(str(folder / "meta.mat"), {"synsets": synsets})
    _write(folder / "ILSVRC2012_validation_ground_truth.txt", "".join(f"{ids[label]}\n" for label in labels).encode())


# -- ImageFolder ---------------------------------------------------------------------------
def make_imagefolder(
    root: str | os.PathLike[str],
    *,
    num_classes: int = 3,
    per_class: int = 4,
    image_size: tuple[int, int] = (96, 80),
    formats: Sequence[str] = ("jpg", "png"),
    corrupt: int = 0,
    seed: int = 0,
) -> GeneratedDataset:
    """`root/<class>/<n>.<ext>`, cycling through `formats`, plus a `README.txt` that is no image.
    Formats are jpg, jpeg, png, webp, bmp and gif. Source ids: `<class>/<file>`."""
    root = Path(root)
    rng = np.random.default_rng(seed)
    classes = [f"class_{c:02d}" for c in range(num_classes)]
    result = GeneratedDataset(root, classes, {"": []}, {"": []})
    pil_format = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "webp": "WEBP", "bmp": "BMP", "gif": "GIF"}
    n = 0
    for label, name in enumerate(classes):
        for i in range(per_class):
            ext = formats[n % len(formats)]
            n += 1
            data = _encode(synthetic_image(label, rng, image_size), pil_format[ext.lower()])
            result.bytes += _write(root / name / f"{i:04d}.{ext}", data)
            result.samples[""].append((f"{name}/{i:04d}.{ext}", label))
    for k in range(corrupt):
        name = f"{classes[k % num_classes]}/broken_{k}.jpg"
        _write(root / name, _corrupt(_encode(synthetic_image(0, rng, image_size), "JPEG"), k))
        result.corrupt[""].append(name)
    _write(root / classes[0] / "README.txt", b"not an image\n")
    return result


# -- CIFAR-10 ------------------------------------------------------------------------------
def make_cifar10(
    root: str | os.PathLike[str], *, per_batch: int = 20, test: int = 20, archive: bool = False, seed: int = 0
) -> GeneratedDataset:
    """`root/cifar-10-batches-py/` as the official Python pickles, data_batch_1..5 and the rest.
    Each holds bytes keys and a uint8 N×3072 array in R, G, B planes. With `archive`, the same
    goes inside `root/cifar-10-python.tar.gz`. Source ids: `<batch>/<i>`."""
    root = Path(root)
    rng = np.random.default_rng(seed)
    result = GeneratedDataset(root, list(CIFAR10_CLASSES), {"train": [], "test": []})
    files: list[tuple[str, bytes]] = []
    meta = {b"num_cases_per_batch": per_batch, b"label_names": [c.encode() for c in CIFAR10_CLASSES], b"num_vis": 3072}
    files.append(("batches.meta", pickle.dumps(meta, protocol=2)))
    for batch, count, split in [(f"data_batch_{i}", per_batch, "train") for i in range(1, 6)] + [
        ("test_batch", test, "test")
    ]:
        labels = [int(x) for x in rng.integers(0, 10, size=count)]
        images = (
            np.stack([synthetic_image(label, rng, (32, 32)) for label in labels])
            if count
            else np.zeros((0, 32, 32, 3), np.uint8)
        )
        data = np.ascontiguousarray(images.transpose(0, 3, 1, 2).reshape(count, 3072))
        record = {
            b"batch_label": f"{batch.replace('_', ' ')} of 6".encode(),
            b"labels": labels,
            b"data": data,
            b"filenames": [f"synthetic_{batch}_{i}.png".encode() for i in range(count)],
        }
        files.append((batch, pickle.dumps(record, protocol=2)))
        result.samples[split] += [(f"{batch}/{i}", label) for i, label in enumerate(labels)]
    result.bytes = sum(len(d) for _, d in files)
    if archive:
        raw = _tar_bytes([(f"cifar-10-batches-py/{name}", data) for name, data in files])
        _write(root / "cifar-10-python.tar.gz", gzip.compress(raw, mtime=0))
    else:
        for name, data in files:
            _write(root / "cifar-10-batches-py" / name, data)
    return result


# -- MNIST ---------------------------------------------------------------------------------
def make_mnist(
    root: str | os.PathLike[str], *, train: int = 60, test: int = 20, gz: bool = True, seed: int = 0
) -> GeneratedDataset:
    """The idx files `train-images-idx3-ubyte`, `train-labels-idx1-ubyte` and `t10k-...` in `root`.
    Source ids: `<split>/<i>` with split `train` or `test`."""
    root = Path(root)
    rng = np.random.default_rng(seed)
    result = GeneratedDataset(root, [str(d) for d in range(10)], {"train": [], "test": []})
    for split, prefix, count in (("train", "train", train), ("test", "t10k", test)):
        labels = rng.integers(0, 10, size=count).astype(np.uint8)
        images = (
            np.stack([synthetic_image(int(d), rng, (28, 28), gray=True) for d in labels])
            if count
            else np.zeros((0, 28, 28), np.uint8)
        )
        image_file = struct.pack(">IIII", 2051, count, 28, 28) + images.tobytes()
        label_file = struct.pack(">II", 2049, count) + labels.tobytes()
        suffix = ".gz" if gz else ""
        for name, data in ((f"{prefix}-images-idx3-ubyte", image_file), (f"{prefix}-labels-idx1-ubyte", label_file)):
            result.bytes += _write(root / (name + suffix), gzip.compress(data, mtime=0) if gz else data)
        result.samples[split] = [(f"{split}/{i}", int(d)) for i, d in enumerate(labels)]
    return result


# -- command line --------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """`python -m dlstore.demo.datagen FORMAT DIR [options]`: write a synthetic dataset."""
    parser = argparse.ArgumentParser(prog="python -m dlstore.demo.datagen", description=__doc__.split("\n\n")[0])
    parser.add_argument("format", choices=["imagenet", "imagefolder", "cifar10", "mnist"])
    parser.add_argument("root", help="directory to write into")
    parser.add_argument("--classes", type=int, default=10, help="imagenet, imagefolder: number of classes")
    parser.add_argument("--train-per-class", type=int, default=30, help="imagenet: train images per class")
    parser.add_argument("--val-per-class", type=int, default=5, help="imagenet: val images per class")
    parser.add_argument("--per-class", type=int, default=20, help="imagefolder: images per class")
    parser.add_argument("--size", default="400x350", help="imagenet, imagefolder: WIDTHxHEIGHT")
    parser.add_argument("--layout", choices=["folders", "tars"], default="folders", help="imagenet")
    parser.add_argument("--val-layout", choices=["folders", "csv", "txt", "devkit"], default="csv", help="imagenet")
    parser.add_argument("--samples", type=int, default=1000, help="cifar10: images per batch; mnist: train images")
    parser.add_argument("--archive", action="store_true", help="cifar10: write cifar-10-python.tar.gz; mnist: gzip")
    parser.add_argument("--corrupt", type=int, default=0, help="broken images to add")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    width, _, height = args.size.partition("x")
    size = (int(width), int(height))
    if args.format == "imagenet":
        made = make_imagenet(
            args.root,
            num_classes=args.classes,
            train_per_class=args.train_per_class,
            val_per_class=args.val_per_class,
            image_size=size,
            layout=args.layout,
            val_layout=args.val_layout,
            corrupt=args.corrupt,
            seed=args.seed,
        )
    elif args.format == "imagefolder":
        made = make_imagefolder(
            args.root,
            num_classes=args.classes,
            per_class=args.per_class,
            image_size=size,
            corrupt=args.corrupt,
            seed=args.seed,
        )
    elif args.format == "cifar10":
        made = make_cifar10(args.root, per_batch=args.samples, test=args.samples, archive=args.archive, seed=args.seed)
    else:
        made = make_mnist(
            args.root, train=args.samples, test=max(1, args.samples // 6), gz=args.archive, seed=args.seed
        )
    counts = ", ".join(f"{split or 'all'}: {len(items)}" for split, items in made.samples.items())
    print(f"wrote {args.format} to {made.root} ({counts}; {made.bytes / 1e6:.1f} MB of images)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
