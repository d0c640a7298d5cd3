"""The checksums a dataset's manifest and sample indexes hold, written `"<algorithm>:<hex>"`.

Each dataset uses one of two algorithms, named by the manifest's `checksum_algorithm`:

* `xxh3_128`: XXH3's 128-bit hash, the default of `dlstore convert` and `dlstore index` from
  manifest format 2 on. It is much cheaper than SHA-256. A cold cache hashes every byte it fetches
  before it serves a shard, and those cores are taken from decoding. It catches damage as surely as
  SHA-256: a flipped bit, a cut or a spliced object. But it is not cryptographic: bytes can be
  crafted to match a given XXH3.
* `sha256`: for datasets whose manifest is pinned by digest to vouch for every byte, and for
  manifests of format 1.

Sample digests in version 2 indexes (`sample_index.sample_digest`) stay SHA-256 either way.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator
from typing import Protocol

import xxhash

from dlstore.errors import ConfigError

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "Hasher",
    "PassingHashes",
    "checksum_of",
    "is_checksum",
    "new_hasher",
    "parse_checksum",
]

#: The digest size in bytes of each algorithm a checksum may use.
ALGORITHMS = {"xxh3_128": 16, "sha256": 32}
DEFAULT_ALGORITHM = "xxh3_128"


class Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def digest(self) -> bytes: ...

    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str) -> Hasher:
    """A fresh hasher of `algorithm`, or a `ConfigError` for one neither we nor hashlib know. Any of
    hashlib's algorithms is allowed for a checksum given to `ShardCache.fetch` by hand."""
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128()
    try:
        return hashlib.new(algorithm)
    except (ValueError, TypeError):
        raise ConfigError(f"unknown hash algorithm {str(algorithm)[:40]!r}") from None


class PassingHashes:
    """Chunks on their way to a reader, hashed in `algorithms` as they pass. A scan that computes
    one checksum can check the same bytes against older checksums in other algorithms, in the
    same read. Call `matches` once the chunks are through."""

    def __init__(self, algorithms: Iterable[str]) -> None:
        self.hashers = {algorithm: new_hasher(algorithm) for algorithm in algorithms}

    def through(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        for chunk in chunks:
            for hasher in self.hashers.values():
                hasher.update(chunk)
            yield chunk

    def matches(self, checksum: str | None) -> bool:
        """Whether `checksum` is in one of the algorithms and is that of the chunks passed."""
        algorithm = (checksum or "").partition(":")[0]
        hasher = self.hashers.get(algorithm)
        return hasher is not None and f"{algorithm}:{hasher.hexdigest()}" == checksum


def checksum_of(data: bytes | bytearray | memoryview, algorithm: str) -> str:
    """`"<algorithm>:<hex>"` of `data`.

    >>> checksum_of(b"", "sha256")[:15], checksum_of(b"", "xxh3_128")
    ('sha256:e3b0c442', 'xxh3_128:99aa06d3014798d86001c324468d497f')
    """
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return f"{algorithm}:{hasher.hexdigest()}"


_CHECKSUM_RE = {name: re.compile(rf"{name}:[0-9a-f]{{{2 * size}}}\Z") for name, size in ALGORITHMS.items()}


def is_checksum(text: str, algorithm: str) -> bool:
    """Whether `text` is a whole checksum of `algorithm`: `"<algorithm>:"`, then lowercase hex."""
    return bool(_CHECKSUM_RE[algorithm].match(text))


def parse_checksum(checksum: str) -> tuple[str, str]:
    """The algorithm and hex digest of a checksum. A `ConfigError` unless it is one of ours, whole.

    >>> parse_checksum("xxh3_128:" + "0" * 32)[0]
    'xxh3_128'
    """
    algorithm = checksum.partition(":")[0] if isinstance(checksum, str) else ""
    if algorithm not in _CHECKSUM_RE:
        raise ConfigError(
            f"checksum {str(checksum)[:80]!r} is not '<algorithm>:<hex>' with an algorithm of {sorted(ALGORITHMS)}"
        )
    if not is_checksum(checksum, algorithm):
        raise ConfigError(
            f"checksum {checksum[:80]!r}: expected '{algorithm}:' and {2 * ALGORITHMS[algorithm]} lowercase hex digits"
        )
    return algorithm, checksum.partition(":")[2]
