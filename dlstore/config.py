"""Configuration as frozen dataclasses; the one place the environment is read.

Every `*.from_env(env)` takes the mapping explicitly (default `os.environ`), so
nothing is read at import time and tests can pass a plain dict.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from dlstore.errors import ConfigError

__all__ = [
    "RetryConfig",
    "S3Config",
    "Secret",
    "StoreConfig",
    "WorldInfo",
    "SwiftConfig",
    "parse_size",
]


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


@dataclass(frozen=True)
class RetryConfig:
    """Retry policy for transient storage failures: jittered exponential backoff with a deadline.

    The deadline is what ends retrying: a server restart or a network blip shorter than
    `deadline_s` is ridden out. `max_attempts` only caps a loop of fast failures; its default
    is high enough that, with the default backoff (on average half of `max_backoff_s` per
    wait once it has grown), the deadline comes first. (With 8 attempts the waits added up
    to about 16 s, so a 20 s outage failed a run long before its 120 s deadline.)
    """

    max_attempts: int = 100
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 10.0
    deadline_s: float = 120.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0

    def __post_init__(self) -> None:
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
        ):
            if env.get(name):
                try:
                    kwargs[key] = kind(env[name])
                except ValueError:
                    raise ConfigError(f"{name}={env[name]!r} is not a number") from None
        return cls(**kwargs)


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
class WorldInfo:
    """Who this process is in a data-parallel job: global rank, world size, ranks per node."""

    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside a world of {self.world_size}")
        if self.local_world_size < 1 or self.world_size % self.local_world_size:
            raise ConfigError(
                f"world size {self.world_size} is not a multiple of the ranks per node ({self.local_world_size})"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorldInfo:
        """From torch.distributed when it is initialised, else torchrun's variables
        (`RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`), else Slurm's (`SLURM_PROCID`,
        `SLURM_NTASKS`, `SLURM_NTASKS_PER_NODE`), else a single process."""
        env = os.environ if env is None else env
        try:
            if "WORLD_SIZE" in env and "RANK" in env:
                rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
                local = int(env.get("LOCAL_WORLD_SIZE", size))
                return cls(rank, size, local)
            if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
                rank, size = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
                per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0] or str(size)
                return cls(rank, size, int(per_node))
        except ValueError as exc:
            raise ConfigError(f"cannot read the distributed world from the environment: {exc}") from None
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            size = dist.get_world_size()
            return cls(dist.get_rank(), size, int(env.get("LOCAL_WORLD_SIZE", size)))
        return cls()
