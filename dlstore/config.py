"""Configuration as frozen dataclasses; the one place the environment is read.

Every `*.from_env(env)` takes the mapping explicitly (default `os.environ`), so
nothing is read at import time and tests can pass a plain dict.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dlstore.errors import ConfigError, NoSpace
from dlstore.logs import redact_url

__all__ = [
    "DataConfig",
    "RetryConfig",
    "S3Config",
    "Secret",
    "StoreConfig",
    "SwiftConfig",
    "TransformConfig",
    "format_size",
    "parse_size",
    "repr_hiding_credentials",
    "writable_dir",
]


def repr_hiding_credentials(config: Any, url_fields: tuple[str, ...]) -> str:
    """A dataclass's repr with its URL fields as `redact_url` gives them: a URL may carry a
    password or a presigned query, and configs are logged, printed and put in errors.

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


class Secret:
    """A credential that never shows itself in a repr, str, f-string or log line.

    >>> s = Secret("hunter2"); f"{s}"
    '***'
    >>> s.reveal()
    'hunter2'
    """

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    def __str__(self) -> str:
        return "***"

    def __format__(self, spec: str) -> str:
        return "***"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)

    def __bool__(self) -> bool:
        return bool(self._value)

    def __reduce__(self):
        # Picklable into DataLoader workers; pickles are never logged.
        return (Secret, (self._value,))


def _secret(env: Mapping[str, str], *names: str) -> Secret | None:
    for name in names:
        if env.get(name):
            return Secret(env[name])
    return None


def _first(env: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        if env.get(name):
            return env[name]
    return None


_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
    "T": 2**40,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str | int) -> int:
    """Bytes from `"150GB"`, `"64MiB"`, `"5M"` or a plain integer.

    >>> parse_size("1.5KB")
    1500
    """
    if isinstance(text, int):
        return text
    raw = text.strip().upper().replace(" ", "")
    number = raw.rstrip("KMGTIB")
    unit = raw[len(number) :]
    if unit not in _SIZE_UNITS or not number:
        raise ConfigError(f"cannot read {text!r} as a size; use e.g. 500MB, 64MiB or 1048576")
    try:
        return int(float(number) * _SIZE_UNITS[unit])
    except ValueError:
        raise ConfigError(f"cannot read {text!r} as a size; use e.g. 500MB, 64MiB or 1048576") from None


def format_size(n: float) -> str:
    """`"1.5 GB"`: decimal units, as `parse_size` reads `"1.5GB"` and `df -H` prints them.

    >>> format_size(1500), format_size(50 * 10**9)
    ('1.5 KB', '50.0 GB')
    """
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


@dataclass(frozen=True)
class RetryConfig:
    """Retry policy for transient storage failures: jittered exponential backoff with a deadline.

    The deadline is what ends retrying: a server restart or a network blip shorter than
    `deadline_s` is ridden out. `max_attempts` only caps a loop of fast failures; its default
    is high enough that, with the default backoff (on average half of `max_backoff_s` per
    wait once it has grown), the deadline comes first. (With 8 attempts the waits added up
    to about 16 s, so a 20 s outage failed a run long before its 120 s deadline.)

    `read_timeout_s` bounds one wait for the server; `stall_timeout_s` bounds one chunk of a
    streamed read (`StoreConfig.chunk_size`) and a whole answer that the client library awaits
    (a HEAD, a listing page, a login, a GET's response head): a server that sends a byte a
    second never trips the first, and held `ls`, `cp`, `verify` and the cache's downloads
    forever. The default cuts a connection slower than about 17 KB/s (1 MiB a minute) and
    asks again (a read resumes from its next byte).
    """

    max_attempts: int = 100
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 10.0
    deadline_s: float = 120.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    stall_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.stall_timeout_s <= 0:
            raise ConfigError("RetryConfig.stall_timeout_s must be positive")
        if self.max_attempts < 1:
            raise ConfigError("RetryConfig.max_attempts must be at least 1")
        if self.deadline_s <= 0 or self.initial_backoff_s < 0:
            raise ConfigError("RetryConfig deadline must be positive and backoff non-negative")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RetryConfig:
        env = os.environ if env is None else env
        kwargs = {}
        for name, key, kind in (
            ("DLSTORE_RETRY_ATTEMPTS", "max_attempts", int),
            ("DLSTORE_RETRY_DEADLINE", "deadline_s", float),
            ("DLSTORE_RETRY_BACKOFF", "initial_backoff_s", float),
            ("DLSTORE_READ_TIMEOUT", "read_timeout_s", float),
            ("DLSTORE_STALL_TIMEOUT", "stall_timeout_s", float),
        ):
            if env.get(name):
                try:
                    kwargs[key] = kind(env[name])
                except ValueError:
                    raise ConfigError(f"{name}={env[name]!r} is not a number") from None
        return cls(**kwargs)


def _secrets_wrapped(config: object, *names: str) -> None:
    """Wrap each named field given as a plain `str` in a `Secret`: a plain string showed itself
    in the config's repr, and failed at the first request with an AttributeError."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, str):
            object.__setattr__(config, name, Secret(value))


@dataclass(frozen=True)
class S3Config:
    """Where and how to reach an S3 endpoint. Fields left None fall back to boto3's own chain
    (profiles, `~/.aws/config`, instance metadata)."""

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    access_key_id: str | None = None
    secret_access_key: Secret | None = None
    session_token: Secret | None = None
    addressing_style: str = "path"
    # Older Swift s3api (2.30) rejects boto3 >= 1.36's default CRC32 headers; `when_required`
    # works everywhere, so it is our default.
    checksum_when_required: bool = True
    ca_bundle: str | None = None
    multipart_chunk_size: int = 64 * 2**20
    multipart_threshold: int = 64 * 2**20
    # Keys per list request. Swift's s3api asks the cluster for one more than this, so a
    # cluster with a lowered `container_listing_limit` (L) needs at most L - 1 here.
    list_page_size: int = 1000

    def __post_init__(self) -> None:
        _secrets_wrapped(self, "secret_access_key", "session_token")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> S3Config:
        env = os.environ if env is None else env
        try:
            list_page_size = int(env.get("DLSTORE_S3_LIST_PAGE_SIZE") or 1000)
        except ValueError:
            raise ConfigError(
                f"DLSTORE_S3_LIST_PAGE_SIZE={env['DLSTORE_S3_LIST_PAGE_SIZE']!r} is not a number"
            ) from None
        return cls(
            endpoint_url=_first(env, "DLSTORE_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
            region=_first(env, "AWS_REGION", "AWS_DEFAULT_REGION"),
            profile=_first(env, "AWS_PROFILE"),
            access_key_id=_first(env, "AWS_ACCESS_KEY_ID"),
            secret_access_key=_secret(env, "AWS_SECRET_ACCESS_KEY"),
            session_token=_secret(env, "AWS_SESSION_TOKEN"),
            addressing_style=env.get("DLSTORE_S3_ADDRESSING_STYLE", "path"),
            ca_bundle=_first(env, "AWS_CA_BUNDLE"),
            multipart_chunk_size=parse_size(env.get("DLSTORE_SEGMENT_SIZE", 64 * 2**20)),
            multipart_threshold=parse_size(env.get("DLSTORE_SEGMENT_SIZE", 64 * 2**20)),
            list_page_size=list_page_size,
        )


@dataclass(frozen=True)
class SwiftConfig:
    """Swift credentials: v1 (tempauth, `ST_*`) or Keystone v3 (an openrc's `OS_*`,
    password or application credential)."""

    auth_url: str | None = None
    auth_version: str = "1.0"
    user: str | None = None
    key: Secret | None = None
    # Keystone v3
    project_name: str | None = None
    project_id: str | None = None
    user_domain_name: str | None = None
    project_domain_name: str | None = None
    region_name: str | None = None
    interface: str | None = None
    application_credential_id: str | None = None
    application_credential_secret: Secret | None = None
    # Pre-authenticated: a storage URL and token (e.g. from `swift auth`).
    storage_url: str | None = None
    auth_token: Secret | None = None
    cacert: str | None = None
    insecure: bool = False
    segment_size: int = 64 * 2**20
    segment_container_suffix: str = "_segments"

    def __post_init__(self) -> None:
        _secrets_wrapped(self, "key", "application_credential_secret", "auth_token")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SwiftConfig:
        """`ST_*` (v1) win when `ST_AUTH` is set; otherwise an openrc's `OS_*` (v3)."""
        env = os.environ if env is None else env
        common = dict(
            cacert=_first(env, "OS_CACERT", "SWIFTCLIENT_CACERT"),
            insecure=env.get("SWIFTCLIENT_INSECURE", "").lower() in ("1", "true", "yes"),
            segment_size=parse_size(env.get("DLSTORE_SEGMENT_SIZE", 64 * 2**20)),
            storage_url=_first(env, "OS_STORAGE_URL"),
            auth_token=_secret(env, "OS_AUTH_TOKEN"),
        )
        if env.get("ST_AUTH"):
            return cls(
                auth_url=env["ST_AUTH"],
                auth_version="1.0",
                user=_first(env, "ST_USER"),
                key=_secret(env, "ST_KEY"),
                **common,
            )
        app_id = _first(env, "OS_APPLICATION_CREDENTIAL_ID")
        version = env.get("OS_IDENTITY_API_VERSION", "3" if env.get("OS_AUTH_URL") else "1.0")
        return cls(
            auth_url=_first(env, "OS_AUTH_URL"),
            auth_version=version,
            user=_first(env, "OS_USERNAME"),
            key=_secret(env, "OS_PASSWORD"),
            project_name=_first(env, "OS_PROJECT_NAME", "OS_TENANT_NAME"),
            project_id=_first(env, "OS_PROJECT_ID", "OS_TENANT_ID"),
            user_domain_name=_first(env, "OS_USER_DOMAIN_NAME") or ("Default" if not app_id else None),
            project_domain_name=_first(env, "OS_PROJECT_DOMAIN_NAME") or ("Default" if not app_id else None),
            region_name=_first(env, "OS_REGION_NAME"),
            interface=_first(env, "OS_INTERFACE", "OS_ENDPOINT_TYPE"),
            application_credential_id=app_id,
            application_credential_secret=_secret(env, "OS_APPLICATION_CREDENTIAL_SECRET"),
            **common,
        )


@dataclass(frozen=True)
class StoreConfig:
    """Everything a store backend may need; each backend reads its own part."""

    retry: RetryConfig = field(default_factory=RetryConfig)
    s3: S3Config = field(default_factory=S3Config)
    swift: SwiftConfig = field(default_factory=SwiftConfig)
    chunk_size: int = 1 * 2**20

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StoreConfig:
        env = os.environ if env is None else env
        return cls(
            retry=RetryConfig.from_env(env),
            s3=S3Config.from_env(env),
            swift=SwiftConfig.from_env(env),
        )


@dataclass(frozen=True)
class TransformConfig:
    """`preset`: "train" (RandomResizedCrop + horizontal flip), "eval" (resize the short side
    to image_size / crop_ratio, centre crop) or "none" (decode only; images must share a size)."""

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


def writable_dir(path: str, flag: str) -> str:
    """`path`, made if missing; a folder that cannot be made or written to is a ConfigError
    naming it and `flag` (the option that chose it), before a run spends time on anything."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NoSpace(f"cannot make {path} ({flag}): {exc.strerror}") from None
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.ENOENT, errno.EEXIST):
            raise ConfigError(f"cannot use {path} ({flag}): {exc.strerror}") from None
        raise  # EIO, ESTALE, a timeout: the file system's trouble, not the setting's
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot use {path} ({flag}): not writable")
    return path


def writable_file(path: str, flag: str) -> str:
    """`path`, checked before a run spends time on what it will hold: its folder is there and
    writable, and it is not a folder itself; else a ConfigError naming it and `flag`."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"cannot write {path} ({flag}): it is a folder; name a file")
    if not os.path.isdir(folder):
        raise ConfigError(f"cannot write {path} ({flag}): no folder {folder}")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ConfigError(f"cannot write {path} ({flag}): not writable")
    return path


def default_cache_dir(env: Mapping[str, str] | None = None) -> str:
    """`DLSTORE_CACHE_DIR`, else `~/.cache/dlstore/shards`."""
    env = os.environ if env is None else env
    return env.get("DLSTORE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "dlstore", "shards")


_DECODE_ON = ("worker", "device")
DEVICE_DECODERS = ("torchvision", "nvimgcodec")  # `dlstore.transforms.device_jpeg_decoder`
_ON_CORRUPT = ("skip", "raise")


@dataclass(frozen=True)
class DataConfig:
    """Everything that decides what a rank's batches hold and how they are read: the one data
    setting object that `Dataset` and `Loader` take whole and that the trainer's, the bench's
    and the demo's configs embed. The world (which rank this is) is a `dlstore.world.World`.

    `transform` is a preset name ("train", "eval", "none") or a whole `TransformConfig`;
    either way it is a `TransformConfig` after construction, and `image_size` agrees with it.
    `workers=None` means one per CPU core this rank may use (the node's cores shared by its
    ranks). `store=None` means the store's settings are read from the environment when the
    dataset is opened; `from_env` reads them (and the cache directory) at the entry point.

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
    # How the cache downloads (`dlstore.cache.CacheConfig`); None: the cache's own default.
    fetch_parts: int | None = None
    fetch_shards: int | None = None
    fetch_part_size: int | str | None = None
    fetch_node_connections: int | None = None
    # A pass's first batch reads samples of shards not cached yet straight from the store.
    first_batch_direct: bool = True
    # Credentials and retries: not part of what the data is (nor of equality, nor of `to_dict`).
    store: StoreConfig | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        transform = self.transform
        if self.image_size is not None:  # 0 was taken as "not given", then said to disagree with 224
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
        """`DataConfig(url, **settings)` with the cache directory and the store's settings
        (credentials, retries) read from `env` (default `os.environ`) where not given."""
        return cls(url, **settings).resolved(env)

    def resolved(self, env: Mapping[str, str] | None = None) -> DataConfig:
        """This config with what it leaves to the environment (cache directory, store
        settings) read from `env`; itself when nothing is missing."""
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
        """JSON-able settings, without the store's and with the URL's credentials hidden
        (`redact_url`): credentials stay out of saved configs."""
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
        """Add a flag for each data setting in `DATA_FLAGS` (but those in `exclude`); flags not
        given leave no attribute, so `from_args` can tell them from defaults."""
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
        """The settings of parsed flags (those `add_arguments` added: the same `exclude`) over
        `base`, the rest from the environment (`from_env`)."""
        return cls.from_flags(url, args, exclude, **base).resolved(env)

    @classmethod
    def from_flags(cls, url: str, args: argparse.Namespace, exclude: tuple[str, ...] = (), **base: Any) -> DataConfig:
        """`from_args` without reading the environment (for `dlstore doctor`, which checks it)."""
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
