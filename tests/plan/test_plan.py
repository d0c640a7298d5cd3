"""Property tests of the epoch plan: the six invariants of DESIGN.md, over many worlds.

Every plan here is computed for all ranks of a world (`world_plans`), and the invariants are
checked on what the ranks would deliver: real samples, padding, batches and shards.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import dlstore
from dlstore.cache import cache_report
from dlstore.config import StoreConfig
from dlstore.convert import ConvertOptions, convert
from dlstore.demo.datagen import make_imagefolder
from dlstore.errors import ConfigError
from dlstore.format.checksums import checksum_of
from dlstore.format.manifest import load_sample_index
from dlstore.format.sample_index import SampleIndex
from dlstore.plan import (
    EpochState,
    PlanConfig,
    RankPlan,
    Segment,
    assign_ranges,
    locate,
    node_ranges,
    rank_plan,
    shard_offsets,
    shard_order,
    world_plans,
)
from dlstore.storage import open_store
from dlstore.world import World

# Deterministic (derandomize) and small enough that the file runs in seconds on 2 cores.
PROPERTY = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ---------------------------------------------------------------------------- strategies

# Uneven shards, with tiny (size 0 and 1) ones mixed in; few shards so that some draws have
# fewer shards than nodes and fewer samples than ranks x batch.
shard_sizes_st = st.lists(st.one_of(st.integers(0, 2), st.integers(1, 60)), min_size=1, max_size=24)


@st.composite
def worlds_st(draw) -> tuple[int, int]:
    local = draw(st.sampled_from([1, 2, 4, 8]))
    nodes = draw(st.sampled_from(range(1, 16 // local + 1)))
    return nodes * local, local


configs_st = st.builds(
    PlanConfig,
    seed=st.integers(-(2**40), 2**40),
    batch_size=st.integers(1, 8) | st.integers(1, 64),
    drop_last=st.booleans(),
    shuffle=st.booleans() | st.just(True),
    shuffle_window=st.integers(1, 6),
    window_ramp=st.booleans() | st.just(True),
)
epochs_st = st.integers(0, 1000)


# ---------------------------------------------------------------------------- helpers


def real_ids(plan: RankPlan, stop_batch: int | None = None) -> np.ndarray:
    end = len(plan.ids) if stop_batch is None else stop_batch * plan.batch_size
    return plan.ids[:end][~plan.is_padding[:end]]


def check_equal_ranks(
    plans: tuple[RankPlan, ...], sizes: list[int], max_padding: int = 1, dropped_batch: int | None = None
) -> None:
    """Invariant 2, the batch layout, the padding layout and the bounds: padding one sample per
    rank in a fresh plan (`max_padding` after a re-deal), dropping less than a batch of the
    plan that dropped (`dropped_batch`, the first segment's batch size after a resume)."""
    num_batches = {p.num_batches for p in plans}
    assert len(num_batches) == 1
    # Every rank as long as the others: the same number of batches, the last as short on all.
    assert len({len(p.ids) for p in plans}) == 1
    for p in plans:
        assert p.ids.dtype == np.int64 and p.is_padding.dtype == bool
        assert len(p.ids) == len(p.is_padding) == len(p.shards)
        assert (p.num_batches - 1) * p.batch_size < len(p.ids) <= p.num_batches * p.batch_size or not len(p.ids)
        assert sum(len(p.batch(j)[0]) for j in range(p.num_batches)) == len(p.ids)
        # Padding only at the end of a rank's list, and within the bound.
        real = int((~p.is_padding).sum())
        assert not p.is_padding[:real].any()
        assert p.num_padding <= max_padding
        assert p.dropped.size <= (dropped_batch or p.batch_size)
        np.testing.assert_array_equal(p.shards, locate(p.ids, sizes)[0])


def node_of_rank(plan: RankPlan) -> int:
    return plan.rank // plan.local_world_size


def shards_by_node(plans: tuple[RankPlan, ...], padding: bool = True) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for p in plans:
        keep = np.ones(len(p.ids), bool) if padding else ~p.is_padding
        out.setdefault(node_of_rank(p), set()).update(p.shards[keep].tolist())
    return out


def samples_by_node(plans: tuple[RankPlan, ...], padding: bool = True) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for p in plans:
        keep = np.ones(len(p.ids), bool) if padding else ~p.is_padding
        out.setdefault(node_of_rank(p), set()).update(p.ids[keep].tolist())
    return out


# ---------------------------------------------------------------------------- basics


def test_world_properties_and_validation():
    w = World(rank=13, world_size=16, local_world_size=4)
    assert (w.node, w.local_rank, w.num_nodes) == (3, 1, 4)
    with pytest.raises(ConfigError):
        World(rank=0, world_size=6, local_world_size=4)
    with pytest.raises(ConfigError):
        World(rank=8, world_size=8, local_world_size=4)
    with pytest.raises(ConfigError):
        World(rank=-1, world_size=8, local_world_size=4)


@pytest.mark.parametrize(
    "kwargs",
    [{"batch_size": 0}, {"shuffle_window": 0}, {"batch_size": 2.0}, {"seed": "1"}, {"drop_last": 1}],
)
def test_plan_config_validation(kwargs):
    with pytest.raises(ConfigError):
        PlanConfig(**{"seed": 0, "batch_size": 4, **kwargs})


def test_numpy_integers_are_accepted():
    cfg = PlanConfig(seed=np.int64(2**40), batch_size=np.int32(4))
    a = rank_plan(np.array([5, 9], np.int32), cfg, np.int64(3), World(np.int64(1), 2, 1))
    b = rank_plan([5, 9], PlanConfig(seed=2**40, batch_size=4), 3, World(1, 2, 1))
    np.testing.assert_array_equal(a.ids, b.ids)
    state = EpochState(np.int64(1)).advance(World(np.int64(0), np.int64(2), np.int64(1)), np.int64(4), np.int64(3))
    assert json.loads(json.dumps(state.to_dict())) == state.to_dict()


@pytest.mark.parametrize("sizes", [[3, -1], [[1, 2], [3, 4]], [1.5, 2.0]])
def test_bad_shard_sizes(sizes):
    with pytest.raises(ConfigError):
        rank_plan(sizes, PlanConfig(seed=0, batch_size=2), 0, World(0, 1, 1))


@PROPERTY
@given(shard_sizes_st)
def test_locate_inverts_offsets(sizes):
    ids = np.arange(sum(sizes))
    shard, index = locate(ids, sizes)
    sizes_arr = np.asarray(sizes)
    np.testing.assert_array_equal(shard_offsets(sizes)[shard] + index, ids)
    assert ((index >= 0) & (index < sizes_arr[shard])).all()
    assert np.all(np.diff(shard) >= 0)


def test_locate_rejects_out_of_range():
    with pytest.raises(ConfigError):
        locate([5], [2, 3])


def range_ids(ranges, sizes) -> np.ndarray:
    """The global sample ids of ranges' rows, row after row."""
    first = shard_offsets(sizes)[ranges.shard] + ranges.start
    return np.concatenate([np.arange(f, f + c) for f, c in zip(first, ranges.count)] + [np.zeros(0, np.int64)])


@PROPERTY
@given(shard_sizes_st, st.integers(1, 16), st.integers(0, 2**32), st.booleans())
def test_assign_ranges_is_balanced_and_contiguous(sizes, num_nodes, seed, shuffle):
    ranges = assign_ranges(sizes, num_nodes, seed=seed, shuffle=shuffle)
    total, sizes_arr = sum(sizes), np.asarray(sizes)
    order = shard_order(sizes, seed=seed, shuffle=shuffle)
    assert sorted(order.tolist()) == list(range(len(sizes)))
    # The rows, in order, are the samples of the shards in `shard_order`, each exactly once:
    # nodes own contiguous ranges of one fixed order.
    np.testing.assert_array_equal(
        range_ids(ranges, sizes), range_ids(assign_ranges(sizes, 1, seed=seed, shuffle=shuffle), sizes)
    )
    whole = np.concatenate([shard_offsets(sizes)[s] + np.arange(sizes[s]) for s in order] + [np.zeros(0, np.int64)])
    np.testing.assert_array_equal(range_ids(ranges, sizes), whole)
    assert (ranges.count > 0).all() and (ranges.start >= 0).all()
    assert (ranges.start + ranges.count <= sizes_arr[ranges.shard]).all()
    assert (np.diff(ranges.node) >= 0).all() and ((ranges.node >= 0) & (ranges.node < num_nodes)).all()
    # Balanced to one sample, the longer ranges first.
    loads = ranges.samples_per_node()
    expected = [total // num_nodes + (n < total % num_nodes) for n in range(num_nodes)]
    assert loads.tolist() == expected
    # A node holds a shard once, and only its first and last rows can be parts of shards.
    for node in range(num_nodes):
        own = ranges.of_node(node)
        assert len(set(own.shard.tolist())) == own.shard.size
        partial = own.count < sizes_arr[own.shard]
        assert not partial[1:-1].any()
    # Each cut between two nodes splits at most one shard.
    readers = Counter(ranges.shard.tolist())
    assert sum(c - 1 for c in readers.values()) <= num_nodes - 1
    again = assign_ranges(sizes, num_nodes, seed=seed, shuffle=shuffle)
    for name in ("node", "shard", "start", "count"):
        np.testing.assert_array_equal(getattr(again, name), getattr(ranges, name))


@PROPERTY
@given(shard_sizes_st, configs_st, worlds_st())
def test_node_ranges_name_the_boundary_shards_and_cover_what_the_node_reads(sizes, cfg, world):
    """What a node's cache fetches for a fresh epoch (whole shards, and its run of each boundary
    shard in `partial_shards`) is exactly the samples the node owns: nothing twice across nodes."""
    world_size, local = world
    plans = world_plans(sizes, cfg, 0, world_size, local)
    owner = np.full(sum(sizes), -1)
    offsets = shard_offsets(sizes)
    for node in range(world_size // local):
        ranges = node_ranges(sizes, cfg, World(node * local, world_size, local))
        partial = ranges.partial_shards(sizes)
        assert set(partial) <= set(ranges.shard.tolist()) and len(partial) <= 2
        for shard in ranges.shard.tolist():
            first, stop = partial.get(shard, (0, sizes[shard]))
            assert (owner[offsets[shard] + first : offsets[shard] + stop] == -1).all()
            owner[offsets[shard] + first : offsets[shard] + stop] = node
        # Every sample the node's ranks read (padding included) lies in what its cache holds;
        # a node that owns no sample (fewer samples than nodes) pads from the whole epoch.
        read = np.concatenate([p.ids for p in plans[node * local : (node + 1) * local]] + [np.zeros(0, np.int64)])
        assert (owner[read] == node).all() or ranges.shard.size == 0
    assert (owner >= 0).all()


def test_partial_shards_at_the_edges():
    """Only a part of a shard is a partial entry: a shard with one sample, an empty one and a
    whole one never are; a shard bigger than a node's share is cut into runs, a middle node's
    starting and ending inside it; a node that owns nothing has none."""
    sizes = [1, 0, 12, 1, 2]
    ranges = assign_ranges(sizes, 4, seed=0, shuffle=False)
    assert [ranges.of_node(n).partial_shards(sizes) for n in range(4)] == [
        {2: (0, 3)},
        {2: (3, 7)},
        {2: (7, 11)},
        {2: (11, 12)},
    ]
    tiny = assign_ranges([3], 5, seed=0, shuffle=False)
    assert [tiny.of_node(n).partial_shards([3]) for n in range(5)] == [{0: (0, 1)}, {0: (1, 2)}, {0: (2, 3)}, {}, {}]
    assert assign_ranges([4, 4], 1, seed=0).of_node(0).partial_shards([4, 4]) == {}
    with pytest.raises(ConfigError, match="one node"):
        ranges.partial_shards(sizes)  # every node's rows: shard 2 has four runs


@PROPERTY
@given(shard_sizes_st, configs_st, epochs_st, worlds_st(), st.sampled_from([1, 2, 4, 8]), st.integers(0, 2**20))
# Node 1's only unread entry is padding: its remainder is empty when 2 ranks per node resume it.
@example([5, 4], PlanConfig(seed=0, batch_size=4, shuffle=False), 0, (2, 1), 2, 0)
def test_a_resume_on_the_same_node_count_reads_only_the_nodes_ranges(sizes, cfg, epoch, world, other_local, step):
    """Resumed mid-epoch with the nodes unchanged (only their ranks), every node reads, padding
    included, only samples it owns: so its cache's entries (whole shards and its runs of its
    boundary shards, `node_ranges`) serve every read and no boundary shard is fetched whole.
    A node whose remainder is empty pads with samples it read already, not another node's."""
    world_size, local = world
    num_nodes = world_size // local
    first = world_plans(sizes, cfg, epoch, world_size, local)
    if not first[0].num_batches:
        return
    steps = 1 + step % first[0].num_batches
    history = (Segment(world_size, local, cfg.batch_size, steps),)
    plans = world_plans(sizes, cfg, epoch, num_nodes * other_local, other_local, history)
    if sum(sizes) < num_nodes:
        return  # a node that owns nothing pads from the whole epoch
    ranges = assign_ranges(sizes, num_nodes, seed=cfg.seed, shuffle=cfg.shuffle)
    for node, read in samples_by_node(plans).items():
        assert read <= set(range_ids(ranges.of_node(node), sizes).tolist())


# ---------------------------------------------------------------------------- invariants 1-3


@PROPERTY
@given(shard_sizes_st, configs_st, epochs_st, worlds_st())
def test_coverage_equal_ranks_determinism(sizes, cfg, epoch, world):
    world_size, local = world
    plans = world_plans(sizes, cfg, epoch, world_size, local)
    total = sum(sizes)

    # 2. equal ranks, padding at the end and bounded; short last batches only without drop_last.
    check_equal_ranks(plans, sizes)
    length = len(plans[0].ids)
    if cfg.drop_last:
        assert length % cfg.batch_size == 0
    else:
        # Each rank as long as the longest share, so the padding is exactly what makes the
        # world size divide the sample count: none on a single rank (issue 11).
        assert length == -(-total // world_size)
        assert sum(p.num_padding for p in plans) == world_size * length - total

    # 1. coverage: every sample exactly once, as a real sample or (drop_last) as dropped.
    real = np.concatenate([real_ids(p) for p in plans])
    dropped = np.concatenate([p.dropped for p in plans])
    assert len(np.unique(real)) == len(real)
    if cfg.drop_last:
        np.testing.assert_array_equal(np.sort(np.concatenate([real, dropped])), np.arange(total))
        assert not any(p.num_padding for p in plans)
    else:
        np.testing.assert_array_equal(np.sort(real), np.arange(total))
        assert dropped.size == 0

    # Padding repeats the rank's own samples, else its node's; only a node without samples borrows.
    for p in plans:
        pad = p.ids[p.is_padding]
        node_real = np.concatenate([real_ids(q) for q in plans if node_of_rank(q) == node_of_rank(p)])
        own = real_ids(p)
        source = own if own.size else node_real if node_real.size else real
        assert np.isin(pad, source).all()

    # 3. determinism, and rank_plan agrees with world_plans.
    again = world_plans(sizes, cfg, epoch, world_size, local)
    for p, q in zip(plans, again, strict=True):
        np.testing.assert_array_equal(p.ids, q.ids)
        np.testing.assert_array_equal(p.is_padding, q.is_padding)
    last = rank_plan(sizes, cfg, epoch, World(world_size - 1, world_size, local))
    np.testing.assert_array_equal(last.ids, plans[-1].ids)
    np.testing.assert_array_equal(last.is_padding, plans[-1].is_padding)


def test_tiny_dataset_on_a_big_world():
    # One sample, 16 ranks on 2 nodes, batch 64: every rank one batch, one real sample in all.
    plans = world_plans([1], PlanConfig(seed=3, batch_size=64), 0, world_size=16, local_world_size=8)
    assert [p.num_batches for p in plans] == [1] * 16
    assert sum(int((~p.is_padding).sum()) for p in plans) == 1
    assert all((p.ids == 0).all() for p in plans)
    # drop_last on the same: nothing delivered, the sample reported dropped.
    plans = world_plans([1], PlanConfig(seed=3, batch_size=64, drop_last=True), 0, 16, 8)
    assert [p.num_batches for p in plans] == [0] * 16
    assert np.concatenate([p.dropped for p in plans]).tolist() == [0]


def test_empty_dataset():
    plans = world_plans([0, 0], PlanConfig(seed=0, batch_size=4), 0, 4, 2)
    assert all(p.num_batches == 0 and p.shards_needed().size == 0 for p in plans)


def test_no_shuffle_is_sequential():
    plan = rank_plan([3, 5, 0, 4], PlanConfig(seed=9, batch_size=5, shuffle=False), 0, World(0, 1, 1))
    assert real_ids(plan).tolist() == list(range(12))
    # One rank: each sample once, and a short last batch instead of padding (issue 11).
    assert plan.is_padding.tolist() == [False] * 12
    assert [plan.batch(j)[0].tolist() for j in range(plan.num_batches)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]


def test_one_rank_delivers_each_sample_once_with_a_short_last_batch():
    # Issue 11: 5,000 samples in batches of 256 arrived as 5,120.
    sizes = [1000] * 5
    for drop_last, batches, last in ((False, 20, 136), (True, 19, 256)):
        plan = rank_plan(sizes, PlanConfig(seed=4, batch_size=256, drop_last=drop_last), 0, World(0, 1, 1))
        assert plan.num_batches == batches and len(plan.batch(batches - 1)[0]) == last
        assert plan.num_padding == 0 and plan.dropped.size == 5000 - len(plan.ids)
        assert np.unique(np.concatenate([plan.ids, plan.dropped])).size == 5000


@pytest.mark.parametrize("nodes", [8, 32, 64, 128])
@pytest.mark.parametrize("batch_size", [32, 256])
def test_imagenet_padding_and_fetch_at_scale(nodes, batch_size):
    """Issue 12's goal: ImageNet in 1000 shards, 8 GPUs per node: padding at most one sample
    per rank (under 0.1% of the epoch), each sample read by one node, a node reading about
    dataset / nodes, and boundary shards (read in part by two nodes) at most nodes - 1."""
    sizes = np.array([len(a) for a in np.array_split(np.arange(1_281_167), 1000)])
    plans = world_plans(sizes, PlanConfig(seed=0, batch_size=batch_size), 0, nodes * 8, 8)
    padding = sum(p.num_padding for p in plans)
    assert padding <= nodes * 8 - 1 and padding / sizes.sum() <= 0.001
    share = sizes.sum() / nodes
    readers: Counter = Counter()
    for node in range(nodes):
        ranks = plans[node * 8 : (node + 1) * 8]
        samples = np.unique(np.concatenate([p.ids for p in ranks]))
        assert samples.size <= np.ceil(share)  # padding repeats the node's own samples
        shards = np.unique(np.concatenate([p.shards for p in ranks]))
        readers.update(shards.tolist())
        assert sizes[shards].sum() <= share + 2 * sizes.max()  # whole shards: at most two partly read
    assert sum(c - 1 for c in readers.values()) <= nodes - 1


# ---------------------------------------------------------------------------- invariant 5: locality


@PROPERTY
@given(shard_sizes_st, configs_st, epochs_st, worlds_st(), st.sampled_from([1, 2, 4, 8]))
def test_locality(sizes, cfg, epoch, world, other_local):
    world_size, local = world
    cfg = replace(cfg, drop_last=False)
    num_nodes = world_size // local
    plans = world_plans(sizes, cfg, epoch, world_size, local)
    read = shards_by_node(plans)
    ranges = assign_ranges(sizes, num_nodes, seed=cfg.seed, shuffle=cfg.shuffle)
    # Each sample read by one node: padding included, when every node owns a sample.
    samples = samples_by_node(plans)
    if sum(sizes) >= num_nodes:
        seen = Counter(s for ids in samples.values() for s in ids)
        assert max(seen.values(), default=1) == 1
        # Only boundary shards are read by two nodes: at most one per cut between nodes.
        shared = Counter(s for shards in read.values() for s in shards)
        assert sum(c - 1 for c in shared.values()) <= num_nodes - 1
    # The node's samples are its assigned range, the same every epoch and for any ranks per node.
    next_epoch = samples_by_node(world_plans(sizes, cfg, epoch + 1, world_size, local), padding=False)
    regrouped = samples_by_node(world_plans(sizes, cfg, epoch, num_nodes * other_local, other_local), padding=False)
    for node in range(num_nodes):
        owned = set(range_ids(ranges.of_node(node), sizes).tolist())
        assert samples_by_node(plans, padding=False)[node] == owned
        assert next_epoch[node] == owned
        assert regrouped[node] == owned
        assert shards_by_node(plans, padding=False)[node] == set(ranges.shards_of(node).tolist())


# ---------------------------------------------------------------------------- invariant 6: mixing


@PROPERTY
@given(shard_sizes_st, configs_st, epochs_st, worlds_st())
def test_orders_differ_between_epochs(sizes, cfg, epoch, world):
    world_size, local = world
    cfg = replace(cfg, shuffle=True, drop_last=False)
    now = world_plans(sizes, cfg, epoch, world_size, local)
    later = world_plans(sizes, cfg, epoch + 1, world_size, local)
    # Degenerate case excluded: a node with a handful of samples can repeat its order by chance.
    num_nodes = world_size // local
    loads = assign_ranges(sizes, num_nodes, seed=cfg.seed).samples_per_node()
    if loads.max() >= 8:
        assert any(not np.array_equal(a.ids, b.ids) for a, b in zip(now, later, strict=True))
    # Same samples, different order.
    np.testing.assert_array_equal(
        np.sort(np.concatenate([real_ids(p) for p in now])), np.sort(np.concatenate([real_ids(p) for p in later]))
    )


@PROPERTY
@given(st.lists(st.integers(1, 30), min_size=6, max_size=20), st.integers(0, 2**32), epochs_st)
def test_shard_order_differs_between_epochs(sizes, seed, epoch):
    # With one shard per window, the order shards are first needed in is the shard order.
    cfg = PlanConfig(seed=seed, batch_size=4, shuffle_window=1)
    now, later = (rank_plan(sizes, cfg, e, World(0, 1, 1)).shards_needed() for e in (epoch, epoch + 1))
    assert sorted(now.tolist()) == sorted(later.tolist()) == list(range(len(sizes)))
    assert now.tolist() != later.tolist()


@pytest.mark.parametrize("world", [(1, 1), (4, 4), (8, 2), (16, 8)])
@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_a_batch_draws_from_several_shards(world, seed):
    cfg = PlanConfig(seed=seed, batch_size=16, shuffle_window=4)
    for p in world_plans([100] * 64, cfg, epoch=2, world_size=world[0], local_world_size=world[1]):
        assert all(len(p.batch_shards(j)) > 1 for j in range(p.num_batches))


@pytest.mark.parametrize("seed", [0, 7])
@pytest.mark.parametrize(
    ("shards", "window", "batch", "local", "ramped", "plain"),
    [
        (10, 4, 16, 1, [2, 2, 4, 2], [4, 4, 2]),  # a step in one piece: the ramp starts on two
        (10, 4, 25, 4, [2, 2, 4, 2], [4, 4, 2]),  # a node's step of 100 samples: two pieces
        (10, 4, 50, 4, [4, 4, 2], [4, 4, 2]),  # a step of 200 needs four: no ramp
        (20, 8, 16, 1, [2, 6, 8, 4], [8, 8, 4]),  # the ramp stays inside the first window
    ],
)
def test_the_window_ramp_starts_each_epoch_on_the_fewest_shards_of_a_step(
    seed, shards, window, batch, local, ramped, plain
):
    """With the ramp, the first `shuffle_window` pieces are split into windows that double,
    from the fewest pieces (two at least) that hold the node's first step: a cold cache waits
    for those before the first step, not for a whole window; without it, windows of
    `shuffle_window` as before the ramp. Either way every window's samples are mixed."""
    sizes = [64] * shards
    for ramp, windows in ((True, ramped), (False, plain)):
        cfg = PlanConfig(seed=seed, batch_size=batch, shuffle_window=window, window_ramp=ramp)
        for epoch in (0, 1):
            plans = world_plans(sizes, cfg, epoch, local, local)
            stream = np.stack([p.shards for p in plans], axis=1).reshape(-1)  # the node's stream, dealt back
            starts = np.cumsum([0] + windows) * 64
            groups = [set(stream[a:b].tolist()) for a, b in zip(starts, starts[1:])]
            assert [len(g) for g in groups] == windows
            assert set().union(*groups) == set(range(shards))
            first_step = set(np.concatenate([p.batch_shards(0) for p in plans]).tolist())
            assert first_step <= groups[0] and len(first_step) > 1


def test_the_ramps_first_window_holds_two_whole_shards_of_the_node():
    """A node's sliver of a boundary shard (a third of a shard here) rides with a whole
    piece: the ramp's first window of two is two whole shards (and maybe the sliver), so the
    epoch's first batch draws from both, never from one shard and a sliver."""
    sizes = [100] * 10
    for seed in range(12):
        cfg = PlanConfig(seed=seed, batch_size=16, shuffle_window=4)
        for node in range(3):
            world = World(node, 3, 1)
            ranges = node_ranges(sizes, cfg, world)
            whole = set(ranges.shard[2 * ranges.count >= 100].tolist())
            assert len(whole) < len(ranges.shard) or node == 1  # nodes 0 and 2 hold a sliver
            for epoch in (0, 1):
                first = rank_plan(sizes, cfg, epoch, world).batch_shards(0).tolist()
                assert len(whole & set(first)) >= 2, (seed, node, epoch, first)


@pytest.mark.parametrize("seed", range(5))
def test_with_the_ramp_the_last_window_is_never_one_shard(seed):
    """Five pieces in windows of four left the last piece alone: the epoch's last batches each
    came from one shard (invariant 6). With the ramp (the order since it came) that piece
    joins the window before it; without it, the order of dlstore before the ramp, as it was."""
    for ramp in (True, False):
        cfg = PlanConfig(seed=seed, batch_size=16, shuffle_window=4, window_ramp=ramp)
        plan = rank_plan([64] * 5, cfg, 0, World(0, 1, 1))
        single = [j for j in range(plan.num_batches) if len(plan.batch_shards(j)) == 1]
        assert (single == []) if ramp else (len(single) == 4)


def test_shuffle_window_one_keeps_batches_within_shards():
    # The contrast: without mixing, nearly every batch comes from one shard.
    cfg = PlanConfig(seed=0, batch_size=16, shuffle_window=1)
    p = rank_plan([96] * 8, cfg, 0, World(0, 1, 1))
    assert all(len(p.batch_shards(j)) == 1 for j in range(p.num_batches))


# ---------------------------------------------------------------------------- invariant 4: exact resume


batch_sizes_st = st.integers(1, 8) | st.integers(1, 64)


@st.composite
def runs_st(draw) -> list[tuple[int, int, int, int]]:
    """Worlds that run one epoch in turn: (world_size, local, batch_size, DataLoader workers)."""
    runs = []
    for _ in range(draw(st.integers(1, 4))):
        changes = ["world", "nothing", "batch size", "ranks per node", "node count"]
        change = draw(st.sampled_from(changes)) if runs else "world"
        if change == "world":
            world_size, local = draw(worlds_st())
            batch = draw(batch_sizes_st)
        else:  # a restart that changes one thing
            world_size, local, batch = runs[-1][:3]
            nodes = world_size // local
            if change == "batch size":
                batch = draw(batch_sizes_st.filter(lambda b, old=batch: b != old))
            elif change == "ranks per node":
                local = draw(st.sampled_from([n for n in (1, 2, 4, 8) if n * nodes <= 16 and n != local] or [local]))
            elif change == "node count":
                nodes = draw(st.sampled_from([n for n in range(1, 16 // local + 1) if n != nodes] or [nodes]))
            world_size = nodes * local
        runs.append((world_size, local, batch, draw(st.integers(0, 4))))
    return runs


@pytest.mark.slow
@settings(PROPERTY, max_examples=500)
@given(shard_sizes_st, configs_st, epochs_st, runs_st(), st.data())
def test_exact_resume(sizes, cfg, epoch, runs, data):
    state = EpochState(epoch)
    delivered: list[np.ndarray] = []
    before = None  # the plans of the last world that ran a step
    resized = False  # whether the node count changed earlier in the epoch
    for index, (world_size, local, batch, _workers) in enumerate(runs):
        plans = world_plans(sizes, replace(cfg, batch_size=batch), epoch, world_size, local, state.history)
        assert all(p.first_step == state.steps_done and p.batch_size == batch for p in plans)
        if state.history:  # a resume (while no step has run, each world plans the epoch afresh)
            max_padding = check_continuation(before, plans, sizes, cfg.shuffle_window, resized)
            resized |= before[0].world_size // before[0].local_world_size != world_size // local
        else:
            max_padding = 1
        check_equal_ranks(plans, sizes, max_padding, state.history[0].batch_size if state.history else None)
        num_batches = plans[0].num_batches
        # Stop after any step, the short last one included (the last world runs to the end of the epoch).
        if index == len(runs) - 1:
            steps = num_batches
        elif data.draw(st.integers(0, 4), label="stop before the first step?") == 0:
            steps = 0
        else:
            steps = data.draw(st.integers(min(1, num_batches), num_batches), label="steps")
        for p in plans:
            delivered.append(real_ids(p, steps))
        if steps or before is None:
            before = plans
        state = state.advance(World(0, world_size, local), batch, steps)
        state = EpochState.from_dict(json.loads(json.dumps(state.to_dict())))

    # The epoch as it would have run without interruption, on the first world that ran a step.
    first = state.history[0] if state.history else Segment(*runs[-1][:3], steps=0)
    whole = world_plans(
        sizes, replace(cfg, batch_size=first.batch_size), epoch, first.world_size, first.local_world_size
    )
    expected = np.sort(np.concatenate([real_ids(p) for p in whole]))
    # Exactly the uninterrupted epoch's real samples: none repeated, none skipped.
    np.testing.assert_array_equal(np.sort(np.concatenate([np.zeros(0, np.int64), *delivered])), expected)


def check_continuation(
    before: tuple[RankPlan, ...], plans: tuple[RankPlan, ...], sizes: list[int], window: int, resized: bool
) -> int:
    """Same world as before: the rank carries on exactly with its own list, cut into the new
    batch size. Returns the bound on the new plan's padding per rank."""
    p0, q0 = before[0], plans[0]
    if p0.world_size // p0.local_world_size != q0.world_size // q0.local_world_size:
        change = "node count"
    elif p0.local_world_size != q0.local_world_size:
        change = "ranks per node"
    else:
        change = "batch size" if p0.batch_size != q0.batch_size else "nothing"
    event(f"resume after {'some' if q0.first_step > p0.first_step else 'no'} steps, changed: {change}")
    consumed = (q0.first_step - p0.first_step) * p0.batch_size
    if (p0.world_size, p0.local_world_size) != (q0.world_size, q0.local_world_size):
        return check_resize_locality(before, plans, sizes, consumed, window, resized)
    for p, q in zip(before, plans, strict=True):
        np.testing.assert_array_equal(q.ids, p.ids[consumed:])
        np.testing.assert_array_equal(q.is_padding, p.is_padding[consumed:])
    return max(p.num_padding for p in before)


def check_resize_locality(
    before: tuple[RankPlan, ...],
    plans: tuple[RankPlan, ...],
    sizes: list[int],
    consumed: int,
    window: int,
    resized: bool,
) -> int:
    """After a change of world, a node keeps its own remainder if the node count is unchanged,
    and otherwise at most one window of shards per cut (plus the shards the old nodes shared)
    is read by two nodes. Returns the bound on the new plan's padding per rank."""
    old_nodes = before[0].world_size // before[0].local_world_size
    new_nodes = plans[0].world_size // plans[0].local_world_size
    read = shards_by_node(plans, padding=False)
    rest = [p.ids[consumed:][~p.is_padding[consumed:]] for p in before]
    old_local = before[0].local_world_size
    old_read = [np.concatenate(rest[n * old_local : (n + 1) * old_local]) for n in range(old_nodes)]
    old_shards = [set(locate(ids, sizes)[0].tolist()) for ids in old_read]
    if old_nodes == new_nodes:
        assert all(read[n] <= old_shards[n] for n in read)
        # Nodes keep remainders as unequal as they were: the padding grows by their spread.
        totals = [ids.size for ids in old_read]
        return 1 + -(-(max(totals) - min(totals)) // plans[0].local_world_size)
    # Equal contiguous pieces: ranks within one sample, so at most one sample of padding.
    assert all(p.num_padding <= 1 for p in plans)
    if not resized:
        old_shared = sum(c - 1 for c in Counter(s for shards in old_shards for s in shards).values())
        shared = sum(c - 1 for c in Counter(s for shards in read.values() for s in shards).values())
        assert shared <= old_shared + (new_nodes - 1) * window
    return 1


def test_resume_after_every_step_matches_uninterrupted_order():
    # Stop and resume after each step on the same world: the same sequence, padding included.
    sizes, cfg, world = [7, 30, 1, 12, 25], PlanConfig(seed=5, batch_size=3), (4, 2)
    whole = world_plans(sizes, cfg, 1, *world)
    state = EpochState(1)
    for step in range(whole[0].num_batches):
        now = world_plans(sizes, cfg, 1, *world, state.history)
        for p, q in zip(whole, now, strict=True):
            np.testing.assert_array_equal(q.batch(0)[0], p.batch(step)[0])
            np.testing.assert_array_equal(q.batch(0)[1], p.batch(step)[1])
        state = state.advance(World(0, *world), cfg.batch_size, 1)
    assert all(p.num_batches == 0 for p in world_plans(sizes, cfg, 1, *world, state.history))


def test_resume_rejects_a_history_longer_than_the_epoch():
    cfg = PlanConfig(seed=0, batch_size=4)
    with pytest.raises(ConfigError):
        rank_plan([10], cfg, 0, World(0, 1, 1), history=(Segment(1, 1, 4, steps=4),))


def test_zero_step_segments_change_nothing():
    sizes, cfg = [40, 13, 22], PlanConfig(seed=1, batch_size=4)
    plain = rank_plan(sizes, cfg, 0, World(1, 2, 1), (Segment(2, 1, 4, 3),))
    noisy = rank_plan(sizes, cfg, 0, World(1, 2, 1), (Segment(8, 4, 2, 0), Segment(2, 1, 4, 3), Segment(4, 2, 4, 0)))
    np.testing.assert_array_equal(plain.ids, noisy.ids)


# ---------------------------------------------------------------------------- RankPlan and EpochState


def test_rank_plan_accessors():
    sizes = [4, 4, 4]
    p = rank_plan(sizes, PlanConfig(seed=0, batch_size=4, shuffle=False), 0, World(0, 1, 1))
    assert p.batch(1)[0].tolist() == [4, 5, 6, 7]
    assert p.batch_shards(1).tolist() == [1]
    assert p.shards_needed().tolist() == [0, 1, 2]
    assert p.shards_needed(start_batch=2).tolist() == [2]
    with pytest.raises(IndexError):
        p.batch(3)
    with pytest.raises(ValueError):
        p.ids[0] = 1  # read-only: a plan cannot be changed under the loader


def test_epoch_state_round_trip_and_advance():
    a, b = World(0, 8, 4), World(0, 4, 4)
    s = EpochState(2).advance(a, 32, 10).advance(a, 32, 5).advance(a, 32, 0)
    assert s.history == (Segment(8, 4, 32, 15),)
    s = s.advance(b, 32, 3).advance(b, 16, 2)
    assert s.history == (Segment(8, 4, 32, 15), Segment(4, 4, 32, 3), Segment(4, 4, 16, 2))
    assert s.steps_done == 20
    assert EpochState.from_dict(json.loads(json.dumps(s.to_dict()))) == s


@pytest.mark.parametrize(
    "data",
    [
        {"epoch": 0},
        {"epoch": -1, "history": []},
        {"epoch": 0, "history": [{"world_size": 3, "local_world_size": 2, "batch_size": 1, "steps": 0}]},
        {"epoch": 0, "history": [{"world_size": 2}]},
        {"epoch": 0, "history": None},
    ],
)
def test_epoch_state_rejects_malformed(data):
    with pytest.raises(ConfigError):
        EpochState.from_dict(data)


@pytest.mark.parametrize("module", ["dlstore.plan.state", "dlstore.plan.ranges", "dlstore.plan.epoch"])
def test_docstring_examples(module):
    import doctest

    results = doctest.testmod(importlib.import_module(module), raise_on_error=False)
    assert results.failed == 0 and results.attempted > 0


# ---------------------------------------------------------------------------- node reads over Swift


def _run_node_epoch(url: str, config: StoreConfig, tmp_path, node: int, nodes: int, local: int) -> list:
    """Every batch of epoch 0 of the `local` ranks of `node`, read through one node cache (with
    the prefetch the loader asks for); returns the datasets (closed) and the keys read."""
    datasets, keys = [], []
    for rank in range(node * local, (node + 1) * local):
        ds = dlstore.Dataset(
            url,
            store_config=config,
            world=World(rank, nodes * local, local),
            cache_dir=str(tmp_path / f"node{node}"),
            cache_limit="100MB",
            transform="eval",
            image_size=8,
            batch_size=3,
            seed=5,
            return_keys=True,
        )
        plan = ds.plan(0)
        for j in range(plan.num_batches):
            ds.prefetch_after(plan, j)
            batch = ds.build_batch(ds.request(plan, 0, j))
            keys += [k for k, pad in zip(batch["keys"], batch["padding"].tolist(), strict=True) if not pad]
        ds.cache.close()
        datasets.append(ds)
    return [datasets, keys]


def _node_share_bytes(ds: dlstore.Dataset, store) -> int:
    """The bytes of the samples a node owns: its whole shards, and its runs of its boundary shards."""
    ranges = node_ranges(ds.shard_sizes, ds.plan_config, ds.world)
    partial = ranges.partial_shards(ds.shard_sizes)
    total = 0
    for shard in ranges.shard.tolist():
        info = ds.manifest.shards[shard]
        if shard in partial:
            total += load_sample_index(store, info).run(*partial[shard]).size
        else:
            total += info.size
    return total


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("index_version", [2, 1])
def test_nodes_fetch_their_share_over_swift(swift_server, swift_container, tmp_path, caplog, index_version):
    """3 nodes x 2 ranks over the local Swift: every sample once, and each node's cache fetches
    exactly the bytes of the samples it owns (boundary shards as verified ranges). With version 1
    indexes (no sample digests) a node fetches its boundary shards whole, and says why."""
    config = StoreConfig.from_env(swift_server.swift_env())
    url = f"swift://{swift_container}/data"
    made = make_imagefolder(tmp_path / "src", num_classes=3, per_class=14, image_size=(24, 20), formats=("jpg",))
    options = ConvertOptions(samples_per_shard=5, workers=1)
    manifest = convert("imagefolder", made.root, url, options, config=config).manifest
    store = open_store(url, config)
    if index_version == 1:
        shards = []
        for info in manifest.shards:
            old = load_sample_index(store, info)
            data = SampleIndex(old.offsets, old.shard_size, old.shard_digest, old.recipe).to_bytes()
            store.put(info.index, data)
            shards.append(
                replace(info, index_size=len(data), index_checksum=checksum_of(data, manifest.checksum_algorithm))
            )
        manifest = manifest.with_shards(shards)
        manifest.save(store)
    caplog.set_level(logging.INFO, logger="dlstore.dataset")
    nodes, local, delivered, boundary = 3, 2, [], 0
    for node in range(nodes):
        datasets, keys = _run_node_epoch(url, config, tmp_path, node, nodes, local)
        delivered += keys
        ds = datasets[0]
        partial = node_ranges(ds.shard_sizes, ds.plan_config, ds.world).partial_shards(ds.shard_sizes)
        boundary += len(partial)
        fetched = cache_report(str(tmp_path / f"node{node}")).totals.bytes_fetched
        if index_version == 2:
            assert fetched == _node_share_bytes(ds, store)
            assert set(ds.samples.partial) == set(partial)
            # A read outside the node's run (as after a re-deal to another node count) goes to the whole shard.
            shard, (start, stop) = next(iter(partial.items()))
            outside = start - 1 if start > 0 else stop
            assert ds.samples.cache_spec(shard, np.array([outside])).name == manifest.shards[shard].name
            ds.samples.read(shard_offsets(ds.shard_sizes)[shard] + np.array([outside]))
            ds.cache.flush_stats()
            grown = cache_report(str(tmp_path / f"node{node}")).totals.bytes_fetched - fetched
            assert grown == manifest.shards[shard].size
        else:
            owned = node_ranges(ds.shard_sizes, ds.plan_config, ds.world).shard.tolist()
            assert fetched == sum(manifest.shards[s].size for s in owned) and ds.samples.partial == {}
    assert boundary >= 2  # the test is about something: 42 samples in 9 shards cut 3 ways
    assert len(delivered) == len(set(delivered)) == manifest.total_samples
    whole = "no per-sample digests" in caplog.text
    assert whole == (index_version == 1)


def _file_dataset(tmp_path, lose_index: bool = False, unreadable_index: bool = False):
    """The middle node of 3 (one rank each) over a file:// dataset of 30 samples in shards of 4:
    one or two boundary shards. With `lose_index`, the first one's sample index is deleted from
    the store before the dataset opens; with `unreadable_index`, the store fails to read it (a
    directory in its place: an error other than not-found). Returns the dataset and the
    boundary shards."""
    url = f"file://{tmp_path}/data"
    made = make_imagefolder(tmp_path / "src", num_classes=3, per_class=10, image_size=(24, 20), formats=("jpg",))
    manifest = convert("imagefolder", made.root, url, ConvertOptions(samples_per_shard=4, workers=1)).manifest
    world = World(1, 3, 1)
    sizes = [s.samples for s in manifest.shards]
    partial = node_ranges(sizes, PlanConfig(seed=5, batch_size=3), world).partial_shards(sizes)
    assert partial  # 10 samples a node, cut from shards of 4
    if lose_index or unreadable_index:
        open_store(url).delete(manifest.shards[min(partial)].index)
    if unreadable_index:
        (tmp_path / "data" / manifest.shards[min(partial)].index).mkdir()
    ds = dlstore.Dataset(
        url,
        world=world,
        cache_dir=str(tmp_path / "cache"),
        cache_limit="100MB",
        transform="eval",
        image_size=8,
        batch_size=3,
        seed=5,
    )
    return ds, partial


@pytest.mark.parametrize("damage", ["lose_index", "unreadable_index"])
def test_a_missing_sample_index_keeps_its_boundary_shard_whole(tmp_path, caplog, damage):
    """A boundary shard whose sample index is gone from the store (the manifest still names it),
    or that the store fails to read, is fetched whole, with a warning, as one whose index fails
    its checksum: the dataset still opens and reads every sample of the node (before, `Dataset`
    raised `NotFound`, or the store's error)."""
    caplog.set_level(logging.WARNING, logger="dlstore.dataset")
    ds, partial = _file_dataset(tmp_path, **{damage: True})
    lost, kept = min(partial), set(partial) - {min(partial)}
    assert set(ds.samples.partial) == kept
    assert ds.manifest.shards[lost].name in caplog.text
    plan = ds.plan(0)
    for j in range(plan.num_batches):
        ds.build_batch(ds.request(plan, 0, j))
    ds.cache.close()
    owned = node_ranges(ds.shard_sizes, ds.plan_config, ds.world).shard.tolist()
    fetched = cache_report(str(tmp_path / "cache")).totals.bytes_fetched
    share = sum(ds.manifest.shards[s].size for s in owned if s not in kept)
    assert fetched == share + sum(ds.samples.partial[s].size for s in kept)


def test_a_boundary_shards_run_counts_under_the_epoch_that_named_it(tmp_path):
    """The loader builds the next epoch's first batches while this one's last are read, so a
    read counts under the epoch whose batch named its cache entry (`ShardCache.set_epoch`). A
    boundary shard's entry is its run of samples: `Dataset.request` must name that key too,
    or the run's download counts under whatever epoch another thread set last."""
    ds, partial = _file_dataset(tmp_path)
    plan = ds.plan(1)
    first = next(j for j in range(plan.num_batches) if set(plan.batch_shards(j).tolist()) & set(partial))
    request = ds.request(plan, 1, first)
    ds.cache.set_epoch(0)  # another thread builds epoch 0's last batch meanwhile
    ds.samples.build_batch(request)
    ds.cache.close()
    epochs = cache_report(str(tmp_path / "cache")).epochs
    assert set(epochs) == {1} and epochs[1].misses == len(plan.batch_shards(first))
