"""How many shards the background prefetch downloads at once (`PrefetchPace`)."""

from __future__ import annotations

import math
from collections import OrderedDict, deque

#: The prefetch aims to bring shards in at this many times the rate the readers reach them.
HEADROOM = 2.0
#: Steps of the readers that the consumption rate is measured over.
_STEPS = 8
#: Shard names remembered as reached, so that a shard reached again (a new list that starts
#: with the shards in use) is not counted twice.
_REMEMBERED = 64


class PrefetchPace:
    """Shards in flight: enough to bring the prefetch's window in at `HEADROOM` times the rate
    the readers reach its shards (bytes per second over their last few steps), given the rate
    one shard's download has been getting (`DownloadEngine.shard_rate`); at least 1, at most
    the cap (`CacheConfig.shards_in_flight`). Until both rates are known (a cold start, where
    the readers wait for the first shuffle window) it is the cap.

    Why: a slow link needs several shards in flight to keep up with the readers, a fast one
    only one, and each shard in flight holds `parts_in_flight` connections (to a store that
    every rank of every node reaches) and its reservation in the cache. It corrects itself:
    readers that wait on downloads reach shards as fast as they come in, so the aim (twice
    that) grows the shards in flight until the readers stop waiting or the cap is reached.

    >>> pace = PrefetchPace()
    >>> for second, name in enumerate("abcd"):
    ...     pace.reached(name, 100_000_000, float(second))   # readers take 100 MB/s
    >>> pace.shards_at_once(cap=4, shard_rate=320e6), pace.shards_at_once(cap=4, shard_rate=80e6)
    (1, 3)
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
        consumed = self.consumed_rate()
        if consumed is None or not shard_rate:
            return cap
        return max(1, min(cap, math.ceil(HEADROOM * consumed / shard_rate)))
