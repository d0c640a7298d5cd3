"""What a rank's batches hold and how they are read: `DataConfig`, `TransformConfig`, `DATA_FLAGS`."""

from __future__ import annotations

import argparse
import dataclasses
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dlstore.config.store import StoreConfig
from dlstore.config.values import default_cache_dir, format_size, parse_size
from dlstore.errors import ConfigError
from dlstore.logs import redact_url

__all__ = ["DATA_FLAGS", "DEVICE_DECODERS", "DataConfig", "TransformConfig", "repr_hiding_credentials"]


def repr_hiding_credentials(config: Any, url_fields: tuple[str, ...]) -> str:
    """A dataclass's repr with its URL fields passed through `redact_url`.

    A URL may carry a password or a presigned query, and configs are logged and printed.

    >>> DataConfig("http://alice:hunter2@host/data", transform="eval", image_size=8)  # doctest: +ELLIPSIS
    DataConfig(url='http://alice:***@host/data', ...)
    """
    shown = []
    for f in dataclasses.fields(config):
        if f.repr:
            value = getattr(config, f.name)
            if f.name in url_fields and isinstance(value, str):
                value = redact_url(value)
            shown.append(f"{f.name}={value!r}")
    return f"{type(config).__name__}({', '.join(shown)})"


@dataclass(frozen=True)
class TransformConfig:
    """How samples are cropped and resized. `preset` is one of:

    - "train": a random resized crop and a horizontal flip;
    - "eval": the short side resized to `image_size / crop_ratio`, then a centre crop;
    - "none": decode only, so the images must share a size.
    """

    preset: str = "train"
    image_size: int = 224
    crop_ratio: float = 0.875
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: bool = True

    def __post_init__(self) -> None:
        if self.preset not in ("train", "eval", "none"):
            raise ConfigError(f"transform preset must be 'train', 'eval' or 'none', not {self.preset!r}")
        _check_image_size(self.image_size)
        if not 0 < self.crop_ratio <= 1:
            raise ConfigError(f"crop_ratio must be in (0, 1], not {self.crop_ratio!r}")


def _check_image_size(size: object) -> None:
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
        raise ConfigError(f"image_size must be a positive whole number of pixels, not {size!r}")


_DECODE_ON = ("worker", "device")
DEVICE_DECODERS = ("torchvision", "nvimgcodec")  # `dlstore.transforms.device_jpeg_decoder`
_ON_CORRUPT = ("skip", "raise")


@dataclass(frozen=True)
class DataConfig:
    """Everything that decides what a rank's batches hold and how they are read.

    `Dataset` and `Loader` take it whole; the trainer's, bench's and demo's configs embed it.
    `transform` is a preset name or a `TransformConfig`, and a `TransformConfig` after
    construction. `workers=None` is one per core this rank may use. `store=None` reads the
    store's settings from the environment when the dataset opens.

    >>> DataConfig("swift://imagenet/train", image_size=160).transform.image_size
    160
    """

    url: str
    cache_dir: str = ""
    cache_limit: int | str = 50 * 10**9
    transform: str | TransformConfig = "train"
    image_size: int | None = None
    decode_on: str = "worker"
    device_decoder: str = "torchvision"
    batch_size: int = 256
    seed: int = 0
    drop_last: bool = False
    shuffle: bool = True
    shuffle_window: int = 4
    window_ramp: bool = True
    workers: int | None = None
    on_corrupt: str = "skip"
    return_keys: bool = False
    prefetch_shards: int = 4
    # How the cache downloads, as `dlstore.cache.CacheConfig`; None keeps the cache's default.
    fetch_parts: int | None = None
    fetch_shards: int | None = None
    fetch_part_size: int | str | None = None
    fetch_node_connections: int | None = None
    # A pass's first batch reads samples of shards not cached yet straight from the store.
    first_batch_direct: bool = True
    # Credentials and retries: not part of what the data is, of equality or of `to_dict`.
    store: StoreConfig | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        transform = self.transform
        if self.image_size is not None:
            _check_image_size(self.image_size)
        if isinstance(transform, str):
            transform = TransformConfig(preset=transform, image_size=self.image_size or 224)
        elif not isinstance(transform, TransformConfig):
            raise ConfigError(f"transform must be a preset name or a TransformConfig, not {transform!r}")
        if self.image_size is not None and self.image_size != transform.image_size:
            raise ConfigError(
                f"image_size={self.image_size} disagrees with the transform's image_size={transform.image_size}"
            )
        object.__setattr__(self, "transform", transform)
        object.__setattr__(self, "image_size", transform.image_size)
        object.__setattr__(self, "cache_limit", parse_size(self.cache_limit))
        if self.decode_on not in _DECODE_ON:
            raise ConfigError(f"decode_on must be one of {_DECODE_ON}, not {self.decode_on!r}")
        if self.device_decoder not in DEVICE_DECODERS:
            raise ConfigError(f"device_decoder must be one of {DEVICE_DECODERS}, not {self.device_decoder!r}")
        if self.on_corrupt not in _ON_CORRUPT:
            raise ConfigError("on_corrupt must be 'skip' or 'raise'")
        for name in ("batch_size", "shuffle_window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
        if (self.workers is not None and self.workers < 0) or self.prefetch_shards < 0:
            raise ConfigError("workers and prefetch_shards must not be negative")
        if self.fetch_part_size is not None:
            object.__setattr__(self, "fetch_part_size", parse_size(self.fetch_part_size))
        for name in ("fetch_parts", "fetch_shards", "fetch_part_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")
        if self.fetch_node_connections is not None and self.fetch_node_connections < 0:
            raise ConfigError("fetch_node_connections must be 0 (no cap) or more")

    @classmethod
    def from_env(cls, url: str, env: Mapping[str, str] | None = None, **settings: Any) -> DataConfig:
        """`DataConfig(url, **settings)`, the cache directory and store settings read from `env`."""
        return cls(url, **settings).resolved(env)

    def resolved(self, env: Mapping[str, str] | None = None) -> DataConfig:
        """This config with the cache directory and store settings filled in from `env`."""
        if self.cache_dir and self.store is not None:
            return self
        env = os.environ if env is None else env
        return dataclasses.replace(
            self,
            cache_dir=self.cache_dir or default_cache_dir(env),
            store=self.store if self.store is not None else StoreConfig.from_env(env),
        )

    def replace(self, **changes: Any) -> DataConfig:
        """A copy with `changes`; a new `image_size` alone re-sizes the transform."""
        if "image_size" in changes and "transform" not in changes:
            changes["transform"] = dataclasses.replace(self.transform, image_size=changes["image_size"])
        elif "transform" in changes and "image_size" not in changes:
            changes["image_size"] = None  # follows the new transform
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        return repr_hiding_credentials(self, ("url",))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able settings without the store's, and the URL's credentials hidden.

        Credentials stay out of saved configs.
        """
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "store"}
        out["url"] = redact_url(self.url)
        transform = dataclasses.asdict(out.pop("transform"))
        out["transform"] = transform
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], **changes: Any) -> DataConfig:
        values = {**data, **changes}
        if isinstance(values.get("transform"), Mapping):
            fields = {k: tuple(v) if isinstance(v, list) else v for k, v in values["transform"].items()}
            values["transform"] = TransformConfig(**fields)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - names
        if unknown:
            raise ConfigError(f"unknown DataConfig fields: {sorted(unknown)}")
        return cls(**values)

    # -- the command line: one flag per setting, shared by `dlstore train` and `dlstore bench` --
    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
        """Add a flag for each setting in `DATA_FLAGS`, but those in `exclude`.

        A flag not given leaves no attribute, so `from_args` can tell it from a default.
        """
        defaults = {f.name: f.default for f in dataclasses.fields(DataConfig)}
        group = parser.add_argument_group("data")
        for name, (kind, text) in DATA_FLAGS.items():
            if name in exclude:
                continue
            flag = "--" + name.replace("_", "-")
            default = defaults[name]
            if name == "cache_limit":  # a size: 50.0 GB, not 50000000000
                default = format_size(default)
            shown = "" if default in (None, "") else f" (default: {default})"
            if kind is bool:
                action = argparse.BooleanOptionalAction
                group.add_argument(flag, action=action, default=argparse.SUPPRESS, help=text + shown)
            else:
                group.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=text + shown)

    @classmethod
    def from_args(
        cls,
        url: str,
        args: argparse.Namespace,
        env: Mapping[str, str] | None = None,
        exclude: tuple[str, ...] = (),
        **base: Any,
    ) -> DataConfig:
        """The parsed flags over `base`; the rest from the environment, as `from_env` does.

        `exclude` must be the one given to `add_arguments`.
        """
        return cls.from_flags(url, args, exclude, **base).resolved(env)

    @classmethod
    def from_flags(cls, url: str, args: argparse.Namespace, exclude: tuple[str, ...] = (), **base: Any) -> DataConfig:
        """`from_args` without the environment: `dlstore doctor` checks that itself."""
        names = [name for name in DATA_FLAGS if name not in exclude and hasattr(args, name)]
        given = {name: getattr(args, name) for name in names}
        given = {k: v for k, v in given.items() if v is not None}
        return cls(url, **{**base, **given})


# DataConfig field -> (type, help) of its command-line flag. A new data setting is a field above
# plus a line here; `dlstore train` and `dlstore bench` both take it.
DATA_FLAGS: dict[str, tuple[Any, str]] = {
    "batch_size": (int, "images per rank per step; the global batch is this times the world size"),
    "workers": (int, "data-loading workers per rank (default: the node's cores divided among its ranks)"),
    "cache_dir": (
        str,
        "node-local shard cache directory, shared by the ranks of a node (default: $DLSTORE_CACHE_DIR, else"
        " ~/.cache/dlstore/shards)",
    ),
    "cache_limit": (str, "shard cache size limit, e.g. 150GB"),
    "transform": (str, "augmentation preset: train (random resized crop + flip), eval (centre crop) or none"),
    "image_size": (
        int,
        "image resolution, the final one under progressive resizing (default 224, ImageNet's; CIFAR's and MNIST's"
        " own are 32 and 28)",
    ),
    "decode_on": (str, "where JPEGs are decoded: worker (CPU) or device (nvJPEG on the GPU)"),
    "device_decoder": (
        str,
        "with --decode-on device: torchvision (nvJPEG) or nvimgcodec (nvImageCodec, the GPU's hardware JPEG"
        " engines where it has them; pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg)",
    ),
    "seed": (int, "seed for data order and augmentation (and the trainer's weights)"),
    "shuffle_window": (int, "shards whose samples are mixed together; more mixes more and caches more"),
    "window_ramp": (
        bool,
        "split each epoch's first shuffle window into windows of 2, 4, ... shards: a cold cache's first step waits"
        " for the fewest shards that hold it, not for a whole window",
    ),
    "fetch_parts": (
        int,
        "ranged GETs of one shard in flight at once, one connection each; twice that for the shards"
        " a cold start waits for (default: the cache's)",
    ),
    "fetch_shards": (int, "shards the cache's prefetch downloads at once (default: the cache's)"),
    "fetch_part_size": (str, "smallest ranged GET of a large shard, e.g. 16MiB (default: the cache's)"),
    "fetch_node_connections": (
        int,
        "connections to the store of all the node's ranks together, 0: no cap (default: the cache's)",
    ),
    "first_batch_direct": (
        bool,
        "from a cold cache, read the first batch's samples straight from the store (each checked against its"
        " digest) while its shards download, rather than wait for the shards",
    ),
}
