"""What the storage backends need: credentials, endpoints and the retry policy.

Every `from_env(env)` takes the mapping explicitly, default `os.environ`. Nothing is read
at import time, and tests can pass a plain dict.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from dlstore.config.values import parse_size
from dlstore.errors import ConfigError

__all__ = ["RetryConfig", "S3Config", "Secret", "StoreConfig", "SwiftConfig"]


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
    value = _first(env, *names)
    return Secret(value) if value else None


def _first(env: Mapping[str, str], *names: str) -> str | None:
    return next((env[name] for name in names if env.get(name)), None)


def _secrets_wrapped(config: object, *names: str) -> None:
    """Wrap each named field given as a plain `str` in a `Secret`.

    A plain string would show itself in the config's repr.
    """
    for name in names:
        value = getattr(config, name)
        if isinstance(value, str):
            object.__setattr__(config, name, Secret(value))


@dataclass(frozen=True)
class RetryConfig:
    """Retry policy for transient storage failures: jittered exponential backoff with a deadline.

    The deadline ends retrying: a server restart or a network blip shorter than `deadline_s`
    is ridden out. `max_attempts` only caps a loop of fast failures. Its default is high
    enough that the deadline comes first with the default backoff.

    `read_timeout_s` bounds one wait for the server. `stall_timeout_s` bounds one chunk of a
    streamed read, and a whole answer the client library awaits: a HEAD, a listing page, a
    login, a GET's response head. A server that sends a byte a second never trips the first.
    A connection cut for a stall is asked again, and a read resumes from its next byte.
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


@dataclass(frozen=True)
class S3Config:
    """Where and how to reach an S3 endpoint.

    Fields left None fall back to boto3's own chain: profiles, `~/.aws/config`, instance metadata.
    """

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    access_key_id: str | None = None
    secret_access_key: Secret | None = None
    session_token: Secret | None = None
    addressing_style: str = "path"
    # Older Swift s3api rejects boto3's default CRC32 headers; `when_required` works everywhere.
    checksum_when_required: bool = True
    ca_bundle: str | None = None
    multipart_chunk_size: int = 64 * 2**20
    multipart_threshold: int = 64 * 2**20
    # Keys per list request. Swift's s3api asks the cluster for one more than this, so a
    # cluster whose `container_listing_limit` is lowered to L needs at most L - 1 here.
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
    """Swift credentials: v1 tempauth's `ST_*`, or Keystone's from an openrc's `OS_*`.

    Keystone takes a password or an application credential.
    """

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
    # Pre-authenticated: a storage URL and token, e.g. from `swift auth`.
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
        """The v1 `ST_*` win when `ST_AUTH` is set; otherwise an openrc's v3 `OS_*`."""
        env = os.environ if env is None else env
        common = dict(
            cacert=_first(env, "OS_CACERT", "SWIFTCLIENT_CACERT"),
            insecure=env.get("SWIFTCLIENT_INSECURE", "").lower() in ("1", "true", "yes"),
            segment_size=parse_size(env.get("DLSTORE_SEGMENT_SIZE", 64 * 2**20)),
            storage_url=_first(env, "OS_STORAGE_URL"),
            auth_token=_secret(env, "OS_AUTH_TOKEN"),
        )
        if env.get("ST_AUTH"):
            user, key = _first(env, "ST_USER"), _secret(env, "ST_KEY")
            return cls(auth_url=env["ST_AUTH"], auth_version="1.0", user=user, key=key, **common)
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
        return cls(retry=RetryConfig.from_env(env), s3=S3Config.from_env(env), swift=SwiftConfig.from_env(env))
