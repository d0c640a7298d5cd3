"""What a cache is configured with: `CacheConfig`."""

from __future__ import annotations

import os
from dataclasses import dataclass

from dlstore.config import parse_size
from dlstore.errors import ConfigError

#: The stats file is rewritten in place at this fixed size. It counts against the limit, so
#: the whole directory stays within `limit_bytes`, not only the shards.
STATS_FILE_BYTES = 1024


@dataclass(frozen=True)
class CacheConfig:
    """Where the node-local cache lives and how it behaves.

    >>> CacheConfig("/mnt/ssd/dlstore", "150GB").limit_bytes
    150000000000

    * `limit_bytes` bounds everything in the directory: shards, downloads in flight, the stats file.
    * `prefetch`: shards the background threads fetch ahead of the reader; 0 turns it off.
    * `verify` checks each download against the manifest's checksum; sizes are always checked.
    * `fsync` makes a published shard survive a power loss, not only a process crash.
    * `preallocate` reserves a download's blocks up front, so a full disk shows at once.
    * `wait_timeout_s` bounds every wait: for another process's download, and for room.

    Downloads, in `dlstore.cache.engine`, are ranged GETs, up to `parts_in_flight` of a shard
    at once. A small shard is cut into `parts_in_flight` parts of 1 MiB at least. A larger one
    is cut into parts of at least `part_size`, more when the round trip calls for it. The
    prefetch keeps up to `shards_in_flight` shards in flight. It opens as few connections as
    bring its window in at twice the rate the readers reach it: see `dlstore.cache.pace`. A
    shard a reader waits for gets `parts_in_flight`, twice that before the link is measured.
    One process opens at most `connections` at once.

    `node_connections` caps the connections of all the processes sharing the directory; 0 means
    no cap. The default, 64, is 8 ranks' own shards at full width. Each connection costs the
    store a socket, and more connections mostly share the same link. A waiting reader gets the
    next free slot before any prefetch. The processes of a node should agree on this value.
    """

    cache_dir: str
    limit_bytes: int
    prefetch: int = 2
    verify: bool = True
    fsync: bool = True
    preallocate: bool = True
    wait_timeout_s: float = 600.0
    part_size: int = 16 * 2**20
    parts_in_flight: int = 8
    shards_in_flight: int = 4
    node_connections: int = 64

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_dir", os.path.abspath(os.fspath(self.cache_dir)))
        object.__setattr__(self, "limit_bytes", parse_size(self.limit_bytes))
        object.__setattr__(self, "part_size", parse_size(self.part_size))
        if self.limit_bytes <= STATS_FILE_BYTES:
            raise ConfigError(f"cache limit {self.limit_bytes} bytes is too small to hold any shard")
        if self.prefetch < 0:
            raise ConfigError(f"CacheConfig.prefetch must be 0 or more, not {self.prefetch}")
        if self.wait_timeout_s <= 0:
            raise ConfigError(f"CacheConfig.wait_timeout_s must be positive, not {self.wait_timeout_s}")
        for name in ("part_size", "parts_in_flight", "shards_in_flight"):
            if getattr(self, name) < 1:
                raise ConfigError(f"CacheConfig.{name} must be at least 1, not {getattr(self, name)}")
        if self.node_connections < 0:
            raise ConfigError(f"CacheConfig.node_connections must be 0 (no cap) or more, not {self.node_connections}")

    @property
    def connections(self) -> int:
        """The most connections one process opens at once: the prefetch's shards and the
        reader's own, each `parts_in_flight` wide."""
        return self.parts_in_flight * (self.shards_in_flight + 1)
