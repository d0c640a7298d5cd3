"""URL scheme → backend class, resolved lazily so an unused backend's client library
need not be installed."""

from __future__ import annotations

import difflib
import importlib
from urllib.parse import urlsplit

from dlstore.config import StoreConfig
from dlstore.errors import ConfigError
from dlstore.storage.base import Store

__all__ = ["known_backends", "open_object", "open_store", "split_object_url"]

# scheme → ("module:Class", what to install when the import fails)
known_backends: dict[str, tuple[str, str]] = {
    "file": ("dlstore.storage.local:LocalStore", ""),
    "s3": ("dlstore.storage.s3:S3Store", "pip install boto3"),
    "swift": ("dlstore.storage.swift:SwiftStore", "pip install python-swiftclient keystoneauth1"),
}
_FSSPEC = ("dlstore.storage.fsspec_store:FsspecStore", "pip install fsspec (and the package for this scheme)")


def _backend_class(scheme: str) -> type[Store]:
    target, hint = known_backends.get(scheme, _FSSPEC)
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"the {scheme}:// backend needs a package that is missing ({exc.name}); {hint}") from exc
    return getattr(module, class_name)


def open_store(url: str, config: StoreConfig | None = None) -> Store:
    """The store rooted at `url`: `file:///data`, a plain path, `s3://bucket/prefix`,
    `swift://container/prefix`, or any fsspec URL such as `memory://x`.

    >>> open_store("/tmp/shards").url
    'file:///tmp/shards'
    """
    if "://" not in url:
        url = _plain_path_or_file_url(url)
    scheme = urlsplit(url).scheme
    if not scheme:
        raise ConfigError(f"cannot tell the storage scheme of {url!r}")
    if scheme not in known_backends:
        _refuse_an_unknown_scheme(url, scheme)
    return _backend_class(scheme)(url, config or StoreConfig.from_env())


# Schemes a path with no "://" must not start with: `swift:/data/train` is a slash short of a
# store, not a folder named "swift:" in the working directory.
_SCHEMES_NOT_PATHS = ("file", "s3", "swift", "gs", "gcs", "az", "abfs", "http", "https", "memory")


def _plain_path_or_file_url(url: str) -> str:
    """The `file://` URL of a path, or of a file URI's short form `file:/abs`.
    A store URL a slash short, `swift:/data`, is refused, naming the URL meant."""
    import os

    scheme, colon, rest = url.partition(":")
    if colon and scheme.lower() == "file" and rest.startswith("/"):
        return "file://" + os.path.abspath(rest)
    if colon and scheme.lower() in _SCHEMES_NOT_PATHS:
        raise ConfigError(f"{url!r} is not a storage URL (did you mean {scheme.lower()}://{rest.lstrip('/')}?)")
    return "file://" + os.path.abspath(url)


def _refuse_an_unknown_scheme(url: str, scheme: str) -> None:
    """A scheme that is neither ours nor one fsspec knows, with the nearest of ours: `swfit://`."""
    try:
        from fsspec.registry import known_implementations, registry
    except ImportError:
        return  # the fsspec backend says what to install
    if scheme in known_implementations or scheme in registry:
        return
    near = difflib.get_close_matches(scheme, known_backends, n=1, cutoff=0.6)
    hint = (
        f" (did you mean {near[0]}://?)"
        if near
        else f"; dlstore's own are {', '.join(f'{k}://' for k in known_backends)}"
    )
    raise ConfigError(f"unknown storage scheme {scheme}:// in {url!r}{hint}")


def split_object_url(url: str) -> tuple[str, str]:
    """`("s3://bucket/a", "b.tar")` from `"s3://bucket/a/b.tar"`: the parent URL and the key."""
    if "://" not in url:
        url = _plain_path_or_file_url(url)
    scheme, rest = url.split("://", 1)
    rest = rest.rstrip("/")
    if scheme == "file":
        parent, _, name = rest.rpartition("/")
        return f"file://{parent or '/'}", name
    if "/" not in rest:
        raise ConfigError(f"{url!r} names a container/bucket, not an object")
    parent, _, name = rest.rpartition("/")
    return f"{scheme}://{parent}", name


def open_object(url: str, config: StoreConfig | None = None) -> tuple[Store, str]:
    """The store holding the object at `url`, and the object's key in it."""
    parent, key = split_object_url(url)
    return open_store(parent, config), key
