"""What a cache is configured with (`CacheConfig`) and what it is asked for (`ShardSpec`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from dlstore.config import parse_size
from dlstore.errors import ConfigError

if TYPE_CHECKING:  # partial imports this module
    from dlstore.cache.partial import SampleRange

#: The stats file is rewritten in place at this fixed size, and counted against the limit,
#: so the whole directory (not only the shards) stays within `limit_bytes`.
STATS_FILE_BYTES = 1024


@dataclass(frozen=True)
class CacheConfig:
    """Where the node-local cache lives and how it behaves.

    >>> CacheConfig("/mnt/ssd/dlstore", "150GB").limit_bytes
    150000000000

    `limit_bytes` bounds everything in the directory (shards, downloads in flight, the
    1 KiB stats file). `prefetch` is how many shards the background thread fetches ahead of
    the reader (0 turns it off). `verify` checks each download against the manifest's
    checksum ("algo:hexdigest"); sizes are always checked. `fsync` makes a published shard
    survive a power loss, not only a process crash. `preallocate` reserves the blocks of a
    download up front (so a full disk shows at once). `wait_timeout_s` bounds every wait: for
    another process's download of the same shard, and for room under the limit.

    Downloads (`dlstore.cache.engine`): a shard is fetched as ranged GETs, up to
    `parts_in_flight` of them at once, each on its own connection (1: one GET stream per
    shard). A shard that parts of `part_size` would spread over fewer than `parts_in_flight`
    connections is cut into `parts_in_flight` parts (of 1 MiB at least), so that it comes in
    as fast as its connections allow; a larger one into parts of at least `part_size` bytes
    (more when the measured round trip and rate say a part that small would spend too much
    of its time waiting for its first byte). The prefetch keeps up to `shards_in_flight`
    shards of its window downloading at once, each on up to `parts_in_flight` connections:
    all of them until the rates are measured (a cold start), then as few connections as
    bring the window in at twice the rate the readers reach it, given the rate one
    connection gets, on as few shards as hold them (`dlstore.cache.pace`): a fast link and
    slow readers need a connection or two, not 32 sockets on the store. Both are caps, never
    exceeded. A shard the readers wait for (their own, the shards in use, a prefetched one a
    reader reaches while it is in flight) gets `parts_in_flight`, twice that at a cold start
    (before the process has measured its link): a 256 MB shard's 16 parts at once, so that
    the first batch waits for fewer round trips of a part over a connection's share. A
    process opens at most `parts_in_flight * (shards_in_flight + 1)` connections (room for
    the reader's own download beside the prefetch's); the reader's shard goes first.

    `node_connections` caps the connections of all the processes sharing the directory
    together (`dlstore.cache.slots`: each GET holds one of that many slot files; 0: no cap).
    Without it a node of 8 ranks could open 8 times the above, 320, at a cold start. The
    default, 64, is 8 ranks' own shards at once at full width (8 parts each), and at the
    40 MB/s a connection gets across a network about 2.5 GB/s, what 8 GPUs need from a cold
    cache (issue 12); more connections mostly share the same link, and each costs the store
    a socket per node. A reader waiting for a slot gets the next one that frees before any
    prefetch does. The processes of a node should agree on it.
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
        """The most connections one process's downloads open at once: the prefetch's shards
        and the reader's own, each `parts_in_flight` wide."""
        return self.parts_in_flight * (self.shards_in_flight + 1)


class ShardSpec(NamedTuple):
    """A shard as the manifest describes it: its key in the store, byte size and checksum; or,
    with `samples`, a partial entry: `name` is `samples.key`, `size` its bytes, no checksum."""

    name: str
    size: int | None = None
    checksum: str | None = None
    samples: SampleRange | None = None
