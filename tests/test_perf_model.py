"""The loader's timing model: learning, routing with probes and slack, and the keep-up prediction."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data.access_plan import AccessPlan
from data.cache_plan import DISK, PEER, RAM, SOURCE
from data.iterator import batch_from_windows
from data.loader import ClairvoyantLoader
from data.perf_model import PRIOR_S, TierModel
from data.sources import TokenWindowSource


def test_first_observation_replaces_the_prior_then_it_averages():
    model = TierModel(smoothing=0.5)
    assert model.estimate(SOURCE) == PRIOR_S[SOURCE]
    model.observe(SOURCE, 0.004)
    assert model.estimate(SOURCE) == pytest.approx(0.004)
    model.observe(SOURCE, 0.008)
    assert model.estimate(SOURCE) == pytest.approx(0.006)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.sampled_from([SOURCE, RAM, DISK, PEER]), min_size=1, max_size=300),
    st.integers(1, 10),
    st.booleans(),
    st.booleans(),
)
def test_route_moves_only_slow_tiers_to_the_source_and_keeps_probing_them(plan, probe_every, disk_slow, peer_slow):
    fetch_from = np.array(plan, np.int8)
    model = TierModel(probe_every=probe_every, slack=4.0)
    model.observe(SOURCE, 0.01)
    model.observe(DISK, 0.05 if disk_slow else 0.039)  # 5x slower than the source, or within the slack
    model.observe(PEER, 0.05 if peer_slow else 0.001)
    routed = model.route(fetch_from)
    for tier, slow in ((DISK, disk_slow), (PEER, peer_slow)):
        planned = fetch_from == tier
        kept = routed[planned] == tier
        if slow:  # every probe_every-th read still goes there, the rest to the source
            assert np.array_equal(kept, np.arange(planned.sum()) % probe_every == 0)
            assert np.all(routed[planned][~kept] == SOURCE)
        else:
            assert kept.all()
    untouched = (fetch_from == SOURCE) | (fetch_from == RAM)
    assert np.array_equal(routed[untouched], fetch_from[untouched])


def test_prediction_is_the_slower_of_the_serial_local_path_and_the_parallel_remote_path():
    model = TierModel(prior_s={RAM: 1e-6, DISK: 1e-4, PEER: 1e-3, SOURCE: 1e-2})
    mix = {RAM: 30, DISK: 10, PEER: 4, SOURCE: 20}
    remote = (4 * 1e-3 + 20 * 1e-2) / 8
    assert model.predict_batch_s(mix, workers=8) == pytest.approx(remote)
    assert model.predict_batch_s({RAM: 30, DISK: 10}, workers=8) == pytest.approx(30e-6 + 10e-4)
    model.observe_assembler(1e-3)  # per sample, whatever the tier: 64 ms for this batch
    assert model.predict_batch_s(mix, workers=8) == pytest.approx(64e-3)


def test_keeps_up_compares_the_prediction_with_the_consumers_step():
    model = TierModel()
    assert model.keeps_up(0.01) is None and "data_model_keeps_up" not in model.metrics({}, 4)
    model.observe_step(0.02)
    assert model.keeps_up(0.01) is True and model.keeps_up(0.03) is False
    m = model.metrics({SOURCE: 16}, workers=4)
    assert m["data_model_batch_s"] == pytest.approx(16 * PRIOR_S[SOURCE] / 4)
    assert m["data_model_keeps_up"] == 0.0 and m["data_model_step_s"] == pytest.approx(0.02)


@pytest.mark.parametrize(
    "kwargs, message", [({"smoothing": 0}, "smoothing"), ({"probe_every": 0}, "probe_every"), ({"slack": 0.5}, "slack")]
)
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TierModel(**kwargs)


def test_a_loader_reads_a_slow_disk_tier_from_the_source_and_stays_exact():
    tokens = np.random.default_rng(0).integers(0, 500, 300 * 16 + 1).astype(np.uint16)
    source = TokenWindowSource(tokens, seq_len=16)
    slow_disk = TierModel(prior_s={**PRIOR_S, DISK: 1.0}, probe_every=10)  # believed 100x slower than the source
    plan = AccessPlan(source.num_samples, 10, 3)
    steps = 3 * plan.steps_per_epoch
    loader = ClairvoyantLoader(
        source,
        batch_size=10,
        seed=3,
        ram_bytes=0,
        disk_bytes=150 * source.sample_nbytes,
        workers=3,
        plan_chunk_steps=steps,
        model=slow_disk,
    )  # one chunk: routed on the prior
    for step in range(steps):
        want = batch_from_windows(source.read(plan.samples(step, step + 1)[0]), None)
        got = next(loader)
        assert all(np.array_equal(got[k], want[k]) for k in want), step
    m = loader.metrics()
    loader.close()
    planned_disk = m["data_samples_disk"] + m["data_samples_rerouted"]
    assert m["data_samples_rerouted"] > 0 and m["data_samples_disk"] == -(-planned_disk // 10)  # the probes
    assert m["data_samples_fallback"] == 0
