"""Rates and pace. `LinkEstimate`, kept by the download engine, is what one connection gets.
`PrefetchPace` is how much the background prefetch downloads at once: shards in flight, and
parts per prefetched shard, one connection each."""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import NamedTuple

#: A part is sized so that waiting for its first byte costs at most 1/_LATENCY_SHARE of it.
_LATENCY_SHARE = 32
_ALIGN = 64 * 1024
#: Transfers smaller than this say little about the link, and are not counted.
MIN_SAMPLE_BYTES = 1 << 20
#: The prefetch aims to bring shards in at this many times the rate the readers reach them.
HEADROOM = 2.0
#: Steps of the readers that the consumption rate is measured over.
_STEPS = 8
#: Shard names remembered as reached, so that a shard reached again is not counted twice.
_REMEMBERED = 64


class LinkEstimate:
    """Time to first byte and bytes per second of one connection, smoothed over recent parts.
    `rate` counts while bytes flow, and sizes parts. `connection_rate` counts the whole GET,
    its wait for the first byte included. That is what a connection is worth to the pace."""

    def __init__(self) -> None:
        self.first_byte_s: float | None = None
        self.rate: float | None = None
        self.connection_rate: float | None = None

    def add(self, first_byte_s: float, nbytes: int, transfer_s: float) -> None:
        if nbytes < MIN_SAMPLE_BYTES or transfer_s <= 0.005:
            return
        rate = nbytes / transfer_s
        connection_rate = nbytes / (max(first_byte_s, 0.0) + transfer_s)
        if self.rate is None or self.first_byte_s is None or self.connection_rate is None:
            self.first_byte_s, self.rate, self.connection_rate = first_byte_s, rate, connection_rate
        else:
            self.first_byte_s = 0.7 * self.first_byte_s + 0.3 * first_byte_s
            self.rate = 0.7 * self.rate + 0.3 * rate
            self.connection_rate = 0.7 * self.connection_rate + 0.3 * connection_rate

    def part_size(self, floor: int, ceiling: int) -> int:
        if self.rate is None or self.first_byte_s is None:
            return floor
        want = _LATENCY_SHARE * self.first_byte_s * self.rate
        want = math.ceil(want / _ALIGN) * _ALIGN
        return max(floor, min(ceiling, want))


class Concurrency(NamedTuple):
    """Shards downloading at once, and parts at once in each, one connection a part."""

    shards: int
    parts: int


class PrefetchPace:
    """How much the prefetch downloads at once. It opens enough connections to bring its window
    in at `HEADROOM` times the rate the readers reach its shards, and no more.

    `DownloadEngine.connection_rate` is the rate one connection gets. The prefetch needs
    N = ceil(HEADROOM * consumed / connection_rate) connections. They go on as few shards as
    hold them, within the caps: ceil(N / parts cap) shards, each ceil(N / shards) parts wide.
    Fewer, full-width shards bring the shard needed soonest in first, and hold fewer
    reservations. Until both rates are known, at a cold start, it is the caps. With no
    connection measured yet, `shards_at_once` paces shards by a whole shard's rate.

    Why: every connection is a socket of a store that every rank of every node reaches. It is
    also a node slot its readers may need. A fast link keeps up with slow readers on a
    connection or two. It corrects itself: readers that wait reach shards as fast as they come
    in, so the aim, twice that, widens the prefetch until they stop waiting. It settles: both
    rates are smoothed, and on a shared link fewer connections each get more. Only the
    prefetch narrows. A reader's shard, or one it reaches in flight, comes at full width.

    >>> pace = PrefetchPace()
    >>> for second, name in enumerate("abcd"):
    ...     pace.reached(name, 100_000_000, float(second))   # readers take 100 MB/s
    >>> pace.shards_at_once(cap=4, shard_rate=320e6), pace.shards_at_once(cap=4, shard_rate=80e6)
    (1, 3)
    >>> caps = Concurrency(shards=4, parts=8)
    >>> pace.concurrency(caps, connection_rate=50e6), pace.concurrency(caps, connection_rate=10e6)
    (Concurrency(shards=1, parts=4), Concurrency(shards=3, parts=7))
    >>> PrefetchPace().concurrency(caps, connection_rate=50e6)   # readers not measured yet
    Concurrency(shards=4, parts=8)
    """

    def __init__(self) -> None:
        self._steps: deque[tuple[float, int]] = deque(maxlen=_STEPS)  # (when, bytes reached)
        self._names: OrderedDict[str, None] = OrderedDict()

    def reached(self, name: str, nbytes: int | None, now: float) -> None:
        """The readers reached shard `name` of the list, `nbytes` long, at time `now`."""
        if name in self._names or nbytes is None:
            return
        self._names[name] = None
        while len(self._names) > _REMEMBERED:
            self._names.popitem(last=False)
        self._steps.append((now, nbytes))

    def consumed_rate(self) -> float | None:
        """Bytes per second the readers have been reaching, or None before three steps."""
        if len(self._steps) < 3:
            return None
        span = self._steps[-1][0] - self._steps[0][0]
        if span <= 0:
            return None
        return sum(nbytes for _, nbytes in list(self._steps)[1:]) / span

    def shards_at_once(self, cap: int, shard_rate: float | None) -> int:
        """Shards at once, each at full width, given the rate one shard's download gets."""
        consumed = self.consumed_rate()
        if consumed is None or not shard_rate:
            return cap
        return max(1, min(cap, math.ceil(HEADROOM * consumed / shard_rate)))

    def concurrency(
        self, caps: Concurrency, connection_rate: float | None, shard_rate: float | None = None
    ) -> Concurrency:
        """Shards at once and parts at once in each, within `caps`, given the rate one
        connection gets. Until that is known, it goes by the rate one shard's download gets."""
        consumed = self.consumed_rate()
        if consumed is None or not connection_rate:
            return Concurrency(self.shards_at_once(caps.shards, shard_rate), caps.parts)
        needed = math.ceil(HEADROOM * consumed / connection_rate)
        shards = max(1, min(caps.shards, math.ceil(needed / caps.parts)))
        return Concurrency(shards, max(1, min(caps.parts, math.ceil(needed / shards))))
