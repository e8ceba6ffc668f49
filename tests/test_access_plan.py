"""The seed-driven access plan and the placement planned from it."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data.access_plan import AccessPlan, FeistelPermutation, process_rows, worker_positions
from data.cache_plan import DISK, PEER, RAM, SOURCE, PlacementPlanner, next_uses, planned_hit_rates
from data.cache_policies import belady_hits, lru_hits


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), key=st.integers(0, 2**64 - 1))
def test_feistel_is_a_bijection(n, key):
    values = FeistelPermutation(n, key)(np.arange(n))
    assert np.array_equal(np.sort(values), np.arange(n))


def test_feistel_pointwise_equals_vectorized_and_depends_on_key():
    perm = FeistelPermutation(1000, 5)
    full = perm(np.arange(1000))
    assert [int(perm([i])[0]) for i in (0, 17, 999)] == [full[0], full[17], full[999]]
    assert not np.array_equal(full, FeistelPermutation(1000, 6)(np.arange(1000)))
    assert not np.array_equal(full, np.arange(1000))
    with pytest.raises(IndexError, match="position 1000"):
        perm([1000])


@settings(max_examples=25, deadline=None)
@given(n=st.integers(8, 400), batch=st.integers(1, 8), seed=st.integers(0, 1000), epochs=st.integers(1, 3))
def test_every_epoch_visits_each_sample_at_most_once_and_steps_match_sample_at(n, batch, seed, epochs):
    plan = AccessPlan(n, batch, seed)
    spe = plan.steps_per_epoch
    stream = plan.samples(0, spe * (epochs + 1))
    for e in range(epochs):
        epoch = stream[e * spe : (e + 1) * spe].ravel()
        assert len(np.unique(epoch)) == len(epoch) == spe * batch
    step, row = spe * epochs - 1, batch - 1
    assert plan.sample_at(step, row) == stream[step, row]
    assert np.array_equal(plan.samples(spe - 1, spe + 1), stream[spe - 1 : spe + 1])  # across an epoch boundary


def test_epochs_reshuffle_and_the_seed_decides():
    a, b = AccessPlan(500, 10, seed=1), AccessPlan(500, 10, seed=2)
    assert not np.array_equal(a.samples(0, 50), a.samples(50, 100))
    assert not np.array_equal(a.samples(0, 50), b.samples(0, 50))
    assert np.array_equal(a.samples(0, 50), AccessPlan(500, 10, seed=1).samples(0, 50))


@settings(max_examples=30, deadline=None)
@given(procs=st.sampled_from([1, 2, 4]), workers=st.integers(1, 7), seed=st.integers(0, 99))
def test_processes_and_workers_partition_the_global_stream(procs, workers, seed):
    plan = AccessPlan(300, 8, seed)
    whole = plan.samples(3, 40)
    parts = [plan.samples(3, 40, process_rows(8, p, procs)) for p in range(procs)]
    assert np.array_equal(np.concatenate(parts, axis=1), whole)
    local = parts[0].ravel()
    covered = np.concatenate([worker_positions(len(local), w, workers) for w in range(workers)])
    assert np.array_equal(np.sort(covered), np.arange(len(local)))


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        AccessPlan(5, 8, 0)
    with pytest.raises(ValueError, match="seed"):
        AccessPlan(50, 8, -1)
    with pytest.raises(ValueError, match="not divisible"):
        process_rows(10, 0, 3)


def test_next_uses():
    assert next_uses(np.array([3, 1, 3, 3, 1, 2]), 99).tolist() == [2, 4, 3, 99, 99, 99]


@settings(max_examples=20, deadline=None)
@given(n=st.integers(20, 300), cap_fraction=st.floats(0.0, 1.2), seed=st.integers(0, 50), ram_share=st.floats(0, 1))
def test_one_process_placement_matches_the_offline_optimum(n, cap_fraction, seed, ram_share):
    plan = AccessPlan(n, 4, seed)
    spe, epochs = plan.steps_per_epoch, 4
    capacity = int(cap_fraction * n)
    ram = int(capacity * ram_share)
    planner = PlacementPlanner(plan, [(0, 4)], [(ram, capacity - ram)], lookahead_steps=spe * epochs)
    # one chunk sees the whole future, as the offline optimum does
    fetched = planner.plan_chunk(0, spe * epochs)[0].fetch_from
    optimum = belady_hits(plan.samples(0, spe * epochs).ravel(), capacity)
    assert np.sum(fetched != SOURCE) == np.sum(optimum)


def test_chunked_planning_keeps_the_hit_rate_and_beats_lru():
    plan = AccessPlan(2000, 20, 0)
    spe, epochs, capacity = plan.steps_per_epoch, 5, 500
    planner = PlacementPlanner(plan, [(0, 20)], [(capacity, 0)])
    fetched = np.concatenate([planner.plan_chunk(e * spe, (e + 1) * spe)[0].fetch_from for e in range(epochs)])
    stream = plan.samples(0, spe * epochs).ravel()
    hits = np.mean(fetched != SOURCE)
    assert hits >= 0.99 * belady_hits(stream, capacity).mean()
    assert hits >= 5 * lru_hits(stream, capacity).mean()


def _replay(plans_per_chunk, capacities):
    """Applies every process's plan in stream order and checks each hit finds the sample where planned."""
    where = {}
    for plans in plans_per_chunk:
        for step in range(plans[0].step_stop - plans[0].step_start):
            for p, plan in enumerate(plans):
                b = plan.rows[1] - plan.rows[0]
                for i in range(step * b, (step + 1) * b):
                    s, how = int(plan.samples[i]), int(plan.fetch_from[i])
                    if how == SOURCE:
                        assert s not in where
                    elif how == PEER:
                        assert where[s][0] == plan.peer[i] != p
                    else:
                        assert where[s] == (p, how)
                    for op, v, tier in plan.ops.get(i, ()):
                        assert where[v] == (p, tier)
                        if op == "drop":
                            del where[v]
                        else:
                            where[v] = (p, DISK)
                    if plan.store[i]:
                        where[s] = (p, int(plan.store[i]))
                    for q in range(len(plans)):
                        for t, cap in zip((RAM, DISK), capacities[q]):
                            assert sum(1 for x in where.values() if x == (q, t)) <= cap
    return where


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_four_processes_share_one_deduplicated_cache(fraction):
    n, procs, epochs = 1200, 4, 6
    plan = AccessPlan(n, 24, 1)
    spe = plan.steps_per_epoch
    per_process = int(fraction * n / procs)
    capacities = [(per_process // 2, per_process - per_process // 2)] * procs
    planner = PlacementPlanner(plan, [process_rows(24, p, procs) for p in range(procs)], capacities)
    chunks = [planner.plan_chunk(e * spe, (e + 1) * spe) for e in range(epochs)]
    where = _replay(chunks, capacities)
    later = planned_hit_rates([p for plans in chunks[1:] for p in plans])
    assert 1 - later["source"] >= 0.95 * min(1.0, fraction)
    assert later["peer"] > 0
    if fraction == 1.0:
        assert len(where) >= 0.95 * n  # every sample cached somewhere, exactly once (a dict cannot hold two)


def test_placement_refuses_bad_capacities():
    with pytest.raises(ValueError, match="capacities must be >= 0"):
        PlacementPlanner(AccessPlan(100, 4, 0), [(0, 4)], [(-1, 0)])
    with pytest.raises(ValueError, match="in order"):
        planner = PlacementPlanner(AccessPlan(100, 4, 0), [(0, 4)], [(10, 0)])
        planner.plan_chunk(0, 5)
        planner.plan_chunk(6, 8)
