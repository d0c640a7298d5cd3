"""The streaming dataset: manifest, plan, cache and the sample path, one batch at a time.

`Dataset` is a map-style torch dataset whose items are whole batches. The loader's sampler, in
the main process, walks this rank's epoch plan and hands a `BatchRequest` to a worker. The
worker builds the batch through the `SamplePath`: read, decode, augment, collate.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from dlstore.cache import CacheConfig, SampleRange, ShardCache
from dlstore.config import DataConfig, StoreConfig, TransformConfig, format_size
from dlstore.errors import ConfigError, DlstoreError
from dlstore.format.manifest import Manifest, load_sample_index
from dlstore.plan import PlanConfig, RankPlan, by_shard, node_ranges, rank_plan
from dlstore.sample_path import BatchRequest, SamplePath, StageClock
from dlstore.storage import open_store
from dlstore.world import World

__all__ = ["BatchRequest", "Dataset"]

log = logging.getLogger(__name__)

#: How many batches before the one just requested the loader may still be building. It is the
#: thread engine's default lookahead. Their shards stay in front of the cache's order. More
#: costs cache room at each change of shuffle window, and fewer risks a refetch.
_BATCHES_IN_FLIGHT = 2


def _data_config(data: str | DataConfig, store_config: StoreConfig | None, settings: dict[str, Any]) -> DataConfig:
    """The `DataConfig` of `Dataset`'s arguments. What it leaves to the environment is read
    once, here, at the entry point of the Python API."""
    if store_config is not None:
        settings["store"] = store_config
    if isinstance(data, DataConfig):
        return (data.replace(**settings) if settings else data).resolved()
    return DataConfig.from_env(data, **settings)


def _last_batches(plan: RankPlan) -> np.ndarray:
    """For each shard `plan` reads, the last batch that reads it; sorted."""
    _, first_from_end = np.unique(plan.shards[::-1], return_index=True)
    return np.sort((plan.shards.size - 1 - first_from_end) // plan.batch_size)


def fetch_settings(cfg: DataConfig) -> dict[str, int]:
    """The `CacheConfig` download settings a `DataConfig` sets. Those left at None keep the
    cache's defaults."""
    given = {
        "parts_in_flight": cfg.fetch_parts,
        "shards_in_flight": cfg.fetch_shards,
        "part_size": cfg.fetch_part_size,
        "node_connections": cfg.fetch_node_connections,
    }
    return {name: value for name, value in given.items() if value is not None}


# The most of a shard's samples a first batch reads straight from the store rather than wait
# for the shard. Waiting costs the whole shard's fetch. Reading directly costs the batch's part
# of it, plus GETs, digests and parsing. Past this share the shard itself comes sooner.
DIRECT_SHARE = 0.125


def direct_shards(ids: np.ndarray, shard_sizes: np.ndarray) -> tuple[int, ...]:
    """The shards of which the batch of `ids` reads at most `DIRECT_SHARE` of the samples.
    They are decided for the whole batch before it is split among workers.

    >>> direct_shards(np.array([0, 1, 2, 3, 4, 5, 40, 41]), np.array([40, 40]))  # 6 and 2 of 40
    (1,)
    """
    grouped = by_shard(np.asarray(ids).tolist(), np.cumsum(shard_sizes).tolist())
    return tuple(s for s, (positions, _) in grouped.items() if len(positions) <= DIRECT_SHARE * shard_sizes[s])


class Dataset(torch.utils.data.Dataset):
    """A sharded dataset in any store, read through the node-local cache.

    Takes a whole `DataConfig`, or a URL and its fields as keywords:

    >>> ds = Dataset("swift://imagenet/train", cache_dir="/mnt/ssd/dlstore", cache_limit="150GB",
    ...              transform="train", image_size=224, batch_size=256, seed=0)   # doctest: +SKIP
    >>> ds = Dataset(DataConfig.from_env("swift://imagenet/train"), world=World.from_env())  # doctest: +SKIP
    """

    def __init__(
        self,
        data: str | DataConfig,
        *,
        world: World | None = None,
        store_config: StoreConfig | None = None,
        **settings: Any,
    ) -> None:
        self.cfg = _data_config(data, store_config, settings)
        self.world = world or World.from_env()
        self.store = open_store(self.cfg.url, self.cfg.store)
        self.manifest = Manifest.load(self.store)
        cache_cfg = CacheConfig(
            cache_dir=self.cfg.cache_dir,
            limit_bytes=self.cfg.cache_limit,
            prefetch=self.prefetch_ahead,
            **fetch_settings(self.cfg),
        )
        self.cache = ShardCache(cache_cfg, self.store)
        self.cache.check_fits(max((s.size for s in self.manifest.shards), default=0))
        if self.world.local_rank == 0:
            self.cache.check_disk_room(self.manifest.total_size)
        self._warn_of_refetches()
        self.samples = SamplePath(self.cfg, self.manifest, self.cache, self.store.url)
        if not self.samples.image_fields:
            fields = list(self.manifest.fields)
            raise ConfigError(f"{self.cfg.url}: the manifest lists no image field (fields: {fields})")
        self.samples.partial = self._boundary_ranges()
        self._plans: OrderedDict[tuple, RankPlan] = OrderedDict()
        self.corrupt_samples = 0
        # The prefetch held back while a pass's first batch is read straight from the store,
        # and the list `first_batch_delivered` starts after it.
        self._prefetch_on_hold = False
        self._held_prefetch: tuple | None = None

    @functools.cached_property
    def prefetch_ahead(self) -> int:
        """How many shards the prefetch fetches beyond those in use once the cache is full.
        It is `prefetch_shards`, fewer when this node's share outgrows its cache. The window in
        use and the shards ahead then take at most a third of it, and one at least.

        Why: such a cache streams part of the data every epoch. `hint_cache` has it keep what
        the plan needs soonest. Every shard fetched ahead takes the place of one kept, which is
        fetched again later. The cost: on a link slower than the readers, less of the next
        window comes in ahead of them."""
        ahead, sizes = self.cfg.prefetch_shards, [s.size for s in self.manifest.shards]
        if not ahead or not sizes or sum(sizes) / self.world.num_nodes <= self.cfg.cache_limit:
            return ahead
        held = self.cfg.cache_limit // max(sizes)
        return max(1, min(ahead, held // 3 - self.cfg.shuffle_window))

    @property
    def shard_sizes(self) -> np.ndarray:
        return self.samples.shard_sizes

    @functools.cached_property
    def manifest_digest(self) -> str:
        """A checksum of the shard table, which gives the plan's sample ids their meaning. A
        dataset converted again gets another one."""
        return self.manifest.shard_table_digest

    @property
    def image_fields(self) -> tuple[str, ...]:
        return self.samples.image_fields

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_plans"] = OrderedDict()
        state.pop("_hinted", None)  # holds a plan: the main process's, for its hint writes
        return state

    def _boundary_ranges(self) -> dict[int, SampleRange]:
        """This node's boundary shards, those it reads only part of, as the runs of samples its
        cache fetches instead. It costs one small GET of each one's sample index. A shard whose
        index has no sample digests, fails its checksum or is missing is left out and fetched
        whole. A part of it could not be verified, and a damaged index must not stop the opening."""
        parts = node_ranges(self.shard_sizes, self.plan_config, self.world).partial_shards(self.shard_sizes)
        ranges = {}
        for shard, (start, stop) in parts.items():
            info = self.manifest.shards[shard]
            try:
                index = load_sample_index(self.store, info) if info.index is not None else None
            except DlstoreError as exc:  # damaged, missing, or the store failed for good: fetched whole
                log.warning("shard %r is fetched whole on this node: %s", info.name, exc)
                continue
            if index is None or not index.has_sample_digests:
                log.warning(  # a whole extra shard per epoch on this node: worth a line by default
                    "shard %r is fetched whole on this node, which reads only samples %d-%d of it: %s "
                    "(`dlstore index` writes indexes with them in place, or `dlstore convert --no-check-decode` run again)",
                    info.name,
                    start,
                    stop - 1,
                    "the manifest gives it no sample index"
                    if index is None
                    else "its sample index (version 1) has no per-sample digests to verify a part with",
                )
                continue
            ranges[shard] = SampleRange.of_index(info.name, index, start, stop)
        return ranges

    # -- the plan, in the main process -------------------------------------------------
    @property
    def plan_config(self) -> PlanConfig:
        c = self.cfg
        return PlanConfig(
            seed=c.seed,
            batch_size=c.batch_size,
            drop_last=c.drop_last,
            shuffle=c.shuffle,
            shuffle_window=c.shuffle_window,
            window_ramp=c.window_ramp,
        )

    def plan(self, epoch: int, history: tuple = ()) -> RankPlan:
        key = (epoch, history, self.plan_config)
        if key not in self._plans:
            self._plans[key] = rank_plan(self.shard_sizes, self.plan_config, epoch, self.world, history)
            while len(self._plans) > 2:
                self._plans.popitem(last=False)
        return self._plans[key]

    def request(self, plan: RankPlan, epoch: int, index: int, fresh_pass: bool = False) -> BatchRequest:
        """What batch `index` of `plan` reads, for a loader to build. `fresh_pass` means the
        loader starts a pass here, not ahead for the pass after. Its prefetch then waits for its
        first batch when that batch reads uncached shards straight from the store."""
        # The cache counts this batch's entries under its epoch. A boundary shard's reads go to
        # the node's run of its samples, or after a re-deal to the whole shard: both are named.
        shards = plan.batch_shards(index).tolist()
        names = [self.manifest.shards[s].name for s in shards]
        names += [self.samples.partial[s].key for s in shards if s in self.samples.partial]
        self.cache.set_epoch(epoch, names)
        ids, is_padding = plan.batch(index)
        # A pass's first batch may read uncached shards' samples straight from the store, rather
        # than wait for whole shards: see `dlstore.read.direct`.
        direct = direct_shards(ids, self.shard_sizes) if index == 0 and self.cfg.first_batch_direct else ()
        if index == 0 and fresh_pass:
            self._prefetch_on_hold = any(self.samples.may_read_directly(shard) for shard in direct)
            self._held_prefetch = None
            if self._prefetch_on_hold:
                self.cache.prefetch([])  # a list left by an earlier pass does not go on beside it
        return BatchRequest(epoch=epoch, index=index, ids=ids, is_padding=is_padding, direct=direct)

    def first_batch_delivered(self) -> None:
        """The loader handed on a pass's first batch: start the prefetch it held back.

        Why held back: a cold pass's first batch reads a few samples straight from the store,
        then decodes them. The prefetch's downloads of whole shards would take the link, the
        store and the loader's CPU from it. The cost: the shards start a little later, once per
        cold pass.

        Only a fresh pass holds its prefetch back, not passes requested ahead. A read that
        needs the cache fetches its shard at once as a reader's download."""
        held, self._held_prefetch = self._held_prefetch, None
        self._prefetch_on_hold = False
        if held is not None:
            self.cache.prefetch(*held)

    def prefetch_after(self, plan: RankPlan, index: int) -> None:
        """Ask the cache to prefetch the shards of batch `index`, just requested. Then come the
        next `prefetch_ahead` shards the plan reads, by first need.

        Why the shards in use lead the list: from a cold cache, batch 0 needs every shard of the
        first shuffle window. The prefetch fetches them while the readers wait. They are
        the list's `lead`, fetched before any shard after them, which would share their link.
        The next window's shards then come in while this one is read.

        The cache keeps the whole list cached as its `depth`, not its own `prefetch_shards`
        from the readers' place. With worker processes, reads never move this process's window
        on. This holds only in a cache with room for two shuffle windows and the prefetch. In a
        smaller one the deeper window evicts shards that queued batches still need."""
        self.hint_cache(plan, index)  # first: the prefetch's evictions go by the fresh order
        if index % 4:  # the list changes slowly; refresh it every few batches
            return
        reading = plan.batch_shards(index).tolist()
        wanted = len(reading) + self._ahead()
        upcoming = dict.fromkeys(reading)
        for j in range(index + 1, plan.num_batches):
            if len(upcoming) >= wanted:
                break
            upcoming.update(dict.fromkeys(plan.batch_shards(j).tolist()))
        specs = [self.samples.cache_spec(s) for s in list(upcoming)[:wanted]]
        depth = wanted if self._holds_two_windows() else None
        if self._prefetch_on_hold:  # a cold first batch is being read directly: after it
            self._held_prefetch = (specs, depth, len(reading))
            return
        self.cache.prefetch(specs, depth=depth, lead=len(reading))

    def hint_cache(self, plan: RankPlan, index: int) -> None:
        """Tell the node cache the order this rank needs shards in from batch `index` on. That
        is the rest of this epoch, then the whole next one, known now since the plan is pure.
        Its evictions then drop the shard needed furthest ahead, not the least recently used.
        Against a shuffled sweep, LRU is nearly the worst choice.

        It is called for every batch, but writes the order again only once it is stale. That is
        when a shard it names for this epoch is done with, or the plan is new. Until then the
        shards still needed keep their order, which is all eviction looks at. A stale order would keep
        finished shards in front of those in use, for other ranks to evict.

        A cache with no room for two shuffle windows and the prefetch gets no hints. Refetches
        are unavoidable there, and LRU, which evicts the finished window first, does no worse.

        >>> ds.hint_cache(ds.plan(epoch), 0)  # doctest: +SKIP
        """
        if not self._hint_is_stale(plan, max(index - _BATCHES_IN_FLIGHT, 0)):
            return
        if not self._holds_two_windows():
            return
        order = self._order_from(plan, index)
        # The plan's epoch is the key it is cached under. A plan no longer cached gets no look
        # beyond its own epoch.
        epoch = next((key[0] for key, cached in self._plans.items() if cached is plan), None)
        if epoch is not None:
            # The next epoch's order, a pure function of its epoch, computed once per epoch.
            memo = self.__dict__.get("_following_order")
            if memo is None or memo[0] != (epoch + 1, self.plan_config):
                following = self.plan(epoch + 1).shards_needed(0).tolist()
                memo = self.__dict__["_following_order"] = ((epoch + 1, self.plan_config), following)
            order += memo[1]
        self.cache.hint(self.samples.cache_spec(shard).name for shard in dict.fromkeys(order))

    def _ahead(self) -> int:
        """Shards the prefetch fetches ahead: `prefetch_shards` until this process's cache has
        evicted a shard, since a cache still filling keeps everything. `prefetch_ahead` after."""
        return self.prefetch_ahead if self.cache.stats.evictions else self.cfg.prefetch_shards

    def _warn_of_refetches(self) -> None:
        """Say at the start when this node's share of the data outgrows a cache without room for
        two shuffle windows and the prefetch. The batches being built then need more shards at
        once than it holds, and shards are fetched several times an epoch."""
        sizes = [s.size for s in self.manifest.shards]
        if not sizes or sum(sizes) / self.world.num_nodes <= self.cfg.cache_limit or self._holds_two_windows():
            return
        largest = max(sizes)
        held = self.cfg.cache_limit // largest
        window = max(1, (held - self.prefetch_ahead) // 2)
        need = (2 * self.cfg.shuffle_window + self.prefetch_ahead) * largest
        log.warning(
            "cache_limit %s holds %d of this dataset's shards (up to %s each), fewer than two shuffle windows of %d "
            "and the %d fetched ahead: shards will be fetched several times an epoch. Give cache_limit "
            "(--cache-limit) at least %s, or shuffle_window=%d (--shuffle-window)",
            format_size(self.cfg.cache_limit),
            held,
            format_size(largest),
            self.cfg.shuffle_window,
            self.prefetch_ahead,
            format_size(need),
            window,
        )

    def _holds_two_windows(self) -> bool:
        """Whether the cache has room for two shuffle windows and the prefetch, at the largest
        shard's size. The two windows are the one read and the next."""
        working_set = 2 * self.cfg.shuffle_window + self.prefetch_ahead
        return self.cfg.cache_limit >= working_set * max((s.size for s in self.manifest.shards), default=0)

    def _hint_is_stale(self, plan: RankPlan, first_batch: int) -> bool:
        """Whether the order last written is stale once the batches before `first_batch` are
        built. It is stale if it is another plan's, or names a shard no batch from then on reads."""
        memo = self.__dict__.get("_hinted")
        if memo is None or memo[0] is not plan:
            memo = self.__dict__["_hinted"] = [plan, _last_batches(plan), None]
        left = len(memo[1]) - int(np.searchsorted(memo[1], first_batch))
        stale, memo[2] = memo[2] != left, left
        return stale

    @staticmethod
    def _order_from(plan: RankPlan, index: int) -> list[int]:
        """This epoch's part of the hinted order, from batch `index`, just requested, on."""
        ahead = plan.shards_needed(index).tolist()
        # The batches before `index` may still be being built. Shards they read last go after
        # the ones in use and before any not yet started: no prefetch evicts one under a builder.
        lo, hi = max(index - _BATCHES_IN_FLIGHT, 0) * plan.batch_size, (index + 1) * plan.batch_size
        recent = dict.fromkeys(plan.shards[lo:hi].tolist())
        needed = set(ahead)
        order = [s for s in ahead if s in recent] + [s for s in recent if s not in needed]
        return order + [s for s in ahead if s not in recent]

    # -- the batches, in the workers ----------------------------------------------------
    def __getitem__(self, request: BatchRequest) -> dict:
        return self.build_batch(request)

    def build_batch(
        self, request: BatchRequest, out: torch.Tensor | None = None, clock: StageClock | None = None
    ) -> dict:
        """`SamplePath.build_batch` for this dataset's cache epoch. `batch["corrupt"]` says how
        many samples were skipped. A `Loader` adds them to `corrupt_samples`."""
        self.cache.set_epoch(request.epoch)  # a worker process knows its epoch from the request
        return self.samples.build_batch(request, out, clock)

    def with_transform(self, transform: TransformConfig) -> Dataset:
        """The same data with another transform, such as a progressive-resizing step."""
        return self.with_settings(transform=transform)

    def with_settings(self, **changes: Any) -> Dataset:
        """The same store, manifest and cache under a config with `changes`. They may be a
        transform, or the plan's `window_ramp` for a loader resuming a state saved in the other order."""
        other = self.__new__(type(self))
        other.__dict__.update(self.__getstate__())
        other.cfg = self.cfg.replace(**changes)
        other.samples = self.samples.with_config(other.cfg)
        return other
