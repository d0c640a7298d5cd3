"""How much the background prefetch downloads at once (`PrefetchPace`): shards in flight, and
connections (parts) per prefetched shard."""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import NamedTuple

#: The prefetch aims to bring shards in at this many times the rate the readers reach them.
HEADROOM = 2.0
#: Steps of the readers that the consumption rate is measured over.
_STEPS = 8
#: Shard names remembered as reached, so that a shard reached again (a new list that starts
#: with the shards in use) is not counted twice.
_REMEMBERED = 64


class Concurrency(NamedTuple):
    """Shards downloading at once, and parts (connections) at once in each."""

    shards: int
    parts: int


class PrefetchPace:
    """How much the prefetch downloads at once: enough connections to bring its window in at
    `HEADROOM` times the rate the readers reach its shards (bytes per second over their last
    few steps), and no more.

    Given the rate one connection gets (`DownloadEngine.connection_rate`, its wait for the
    first byte included), the prefetch needs N = ceil(HEADROOM * consumed / connection_rate)
    connections, spread over as few shards as hold them: ceil(N / parts cap) shards, each
    ceil(N / shards) parts wide, within the caps (`CacheConfig.shards_in_flight`,
    `parts_in_flight`). Fewer, full-width shards rather than many narrow ones: the shard
    needed soonest comes in first, and fewer shards hold a reservation in the cache. Until
    both rates are known (a cold start, where the readers wait for the first shuffle window)
    it is the caps; with no connection measured yet, the shards are paced by the rate a whole
    shard's download gets (`shards_at_once`), each at full width.

    Why: every connection is a socket of a store that every rank of every node reaches, and
    (with `CacheConfig.node_connections`) a slot the node's readers may need; a fast link
    keeps up with slow readers on a connection or two. It corrects itself: readers that
    wait on downloads reach shards as fast as they come in, so the aim (twice that) widens
    the prefetch until the readers stop waiting or the caps are reached. It settles rather
    than swings: both rates are smoothed, and on a link that the connections share, fewer of
    them each get more, so the connections needed stay the same. Only the prefetch narrows:
    a reader's shard is fetched at full width, and a prefetched shard a reader reaches while
    it is in flight is widened to full width (`DownloadEngine.hurry`).

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
        """The readers reached shard `name` of the list (`nbytes` long) at time `now`."""
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
        connection gets (and, until that is known, the rate one shard's download gets)."""
        consumed = self.consumed_rate()
        if consumed is None or not connection_rate:
            return Concurrency(self.shards_at_once(caps.shards, shard_rate), caps.parts)
        needed = math.ceil(HEADROOM * consumed / connection_rate)
        shards = max(1, min(caps.shards, math.ceil(needed / caps.parts)))
        return Concurrency(shards, max(1, min(caps.parts, math.ceil(needed / shards))))
