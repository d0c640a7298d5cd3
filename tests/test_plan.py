"""Property tests of the epoch plan: the six invariants of DESIGN.md, over many worlds.

Every plan here is computed for all ranks of a world (`world_plans`), and the invariants are
checked on what the ranks would deliver: real samples, padding, batches and shards.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dlstore.errors import ConfigError
from dlstore.plan import (
    EpochState,
    PlanConfig,
    RankPlan,
    Segment,
    assign_shards,
    locate,
    rank_plan,
    shard_offsets,
    world_plans,
)
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
)
epochs_st = st.integers(0, 1000)


# ---------------------------------------------------------------------------- helpers


def real_ids(plan: RankPlan, stop_batch: int | None = None) -> np.ndarray:
    end = len(plan.ids) if stop_batch is None else stop_batch * plan.batch_size
    return plan.ids[:end][~plan.is_padding[:end]]


def bound(batch_size: int, sizes: list[int], local_world_size: int) -> int:
    """The documented bound on per-rank padding (and dropping)."""
    return batch_size + -(-max(sizes) // local_world_size)


def check_equal_ranks(plans: tuple[RankPlan, ...], sizes: list[int]) -> None:
    """Invariant 2, the padding layout and the padding bound."""
    num_batches = {p.num_batches for p in plans}
    assert len(num_batches) == 1
    for p in plans:
        assert p.ids.dtype == np.int64 and p.is_padding.dtype == bool
        assert len(p.ids) == len(p.is_padding) == len(p.shards) == p.num_batches * p.batch_size
        # Padding only at the end of a rank's list, and within the bound.
        real = int((~p.is_padding).sum())
        assert not p.is_padding[:real].any()
        assert p.num_padding <= bound(p.batch_size, sizes, p.local_world_size)
        assert p.dropped.size <= bound(p.batch_size, sizes, p.local_world_size)
        np.testing.assert_array_equal(p.shards, locate(p.ids, sizes)[0])


def node_of_rank(plan: RankPlan) -> int:
    return plan.rank // plan.local_world_size


def shards_by_node(plans: tuple[RankPlan, ...], padding: bool = True) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for p in plans:
        keep = np.ones(len(p.ids), bool) if padding else ~p.is_padding
        out.setdefault(node_of_rank(p), set()).update(p.shards[keep].tolist())
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


@PROPERTY
@given(shard_sizes_st, st.integers(1, 16), st.integers(0, 2**32), st.booleans())
def test_assign_shards_is_balanced(sizes, num_nodes, seed, shuffle):
    node_of = assign_shards(sizes, num_nodes, seed=seed, shuffle=shuffle)
    assert node_of.shape == (len(sizes),)
    assert ((node_of >= 0) & (node_of < num_nodes)).all()
    loads = np.bincount(node_of, weights=sizes, minlength=num_nodes)
    assert loads.max() - loads.min() <= max(sizes)
    np.testing.assert_array_equal(node_of, assign_shards(sizes, num_nodes, seed=seed, shuffle=shuffle))


# ---------------------------------------------------------------------------- invariants 1-3


@PROPERTY
@given(shard_sizes_st, configs_st, epochs_st, worlds_st())
def test_coverage_equal_ranks_determinism(sizes, cfg, epoch, world):
    world_size, local = world
    plans = world_plans(sizes, cfg, epoch, world_size, local)
    total = sum(sizes)

    # 2. equal ranks, padding at the end and bounded.
    check_equal_ranks(plans, sizes)

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
    assert plan.is_padding.tolist() == [False] * 12 + [True] * 3


# ---------------------------------------------------------------------------- invariant 5: locality


@PROPERTY
@given(shard_sizes_st, configs_st, epochs_st, worlds_st(), st.sampled_from([1, 2, 4, 8]))
def test_locality(sizes, cfg, epoch, world, other_local):
    world_size, local = world
    cfg = replace(cfg, drop_last=False)
    num_nodes = world_size // local
    nonempty = sum(1 for s in sizes if s > 0)
    plans = world_plans(sizes, cfg, epoch, world_size, local)
    read = shards_by_node(plans)
    # Each shard read by one node at most: padding included, when every node owns a sample.
    if nonempty >= num_nodes:
        seen = Counter(s for shards in read.values() for s in shards)
        assert max(seen.values(), default=1) == 1
    # The node's shards are its assigned shards, the same every epoch and for any ranks per node.
    node_of = assign_shards(sizes, num_nodes, seed=cfg.seed, shuffle=cfg.shuffle)
    next_epoch = shards_by_node(world_plans(sizes, cfg, epoch + 1, world_size, local), padding=False)
    regrouped = shards_by_node(world_plans(sizes, cfg, epoch, num_nodes * other_local, other_local), padding=False)
    for node in range(num_nodes):
        owned = {s for s in range(len(sizes)) if node_of[s] == node and sizes[s] > 0}
        assert shards_by_node(plans, padding=False)[node] == owned
        assert next_epoch[node] == owned
        assert regrouped[node] == owned


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
    loads = np.bincount(assign_shards(sizes, num_nodes, seed=cfg.seed), weights=sizes, minlength=num_nodes)
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


@settings(PROPERTY, max_examples=500)
@given(shard_sizes_st, configs_st, epochs_st, runs_st(), st.data())
def test_exact_resume(sizes, cfg, epoch, runs, data):
    state = EpochState(epoch)
    delivered: list[np.ndarray] = []
    before = None  # the previous segment's plans
    for index, (world_size, local, batch, _workers) in enumerate(runs):
        plans = world_plans(sizes, replace(cfg, batch_size=batch), epoch, world_size, local, state.history)
        check_equal_ranks(plans, sizes)
        assert all(p.first_step == state.steps_done and p.batch_size == batch for p in plans)
        if state.history:  # a resume (while no step has run, each world plans the epoch afresh)
            check_continuation(before, plans, cfg.shuffle_window)
        num_batches = plans[0].num_batches
        # Stop after any step (the last world runs to the end of the epoch).
        if index == len(runs) - 1:
            steps = num_batches
        elif data.draw(st.integers(0, 4), label="stop before the first step?") == 0:
            steps = 0
        else:
            steps = data.draw(st.integers(min(1, num_batches), num_batches), label="steps")
        for p in plans:
            delivered.append(real_ids(p, steps))
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


def check_continuation(before: tuple[RankPlan, ...], plans: tuple[RankPlan, ...], window: int) -> None:
    """Same world as before: the rank carries on with its own list (exactly, if same batch)."""
    p0, q0 = before[0], plans[0]
    if p0.world_size // p0.local_world_size != q0.world_size // q0.local_world_size:
        change = "node count"
    elif p0.local_world_size != q0.local_world_size:
        change = "ranks per node"
    else:
        change = "batch size" if p0.batch_size != q0.batch_size else "nothing"
    event(f"resume after {'some' if q0.first_step > p0.first_step else 'no'} steps, changed: {change}")
    if (p0.world_size, p0.local_world_size) != (q0.world_size, q0.local_world_size):
        check_resize_locality(before, plans, window)
        return
    consumed = (q0.first_step - p0.first_step) * p0.batch_size
    for p, q in zip(before, plans, strict=True):
        if p.batch_size == q.batch_size:
            np.testing.assert_array_equal(q.ids, p.ids[consumed:])
            np.testing.assert_array_equal(q.is_padding, p.is_padding[consumed:])
        else:
            rest = p.ids[consumed:][~p.is_padding[consumed:]]
            np.testing.assert_array_equal(real_ids(q), rest)


def check_resize_locality(before: tuple[RankPlan, ...], plans: tuple[RankPlan, ...], window: int) -> None:
    """After a change of world, a node keeps its own remainder if the node count is unchanged,
    and otherwise at most one window of shards per cut is read by two nodes."""
    old_nodes = before[0].world_size // before[0].local_world_size
    new_nodes = plans[0].world_size // plans[0].local_world_size
    read = shards_by_node(plans, padding=False)
    if old_nodes == new_nodes:
        earlier = shards_by_node(before, padding=False)
        assert all(read[n] <= earlier[n] for n in read)
    else:
        # Equal contiguous pieces: ranks within one sample, so padding stays within a batch.
        assert all(p.num_padding <= p.batch_size for p in plans)
        shared = sum(c - 1 for c in Counter(s for shards in read.values() for s in shards).values())
        assert shared <= (new_nodes - 1) * window


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


def test_docstring_examples():
    import doctest

    import dlstore.plan

    assert doctest.testmod(dlstore.plan, raise_on_error=False).failed == 0
