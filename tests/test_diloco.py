"""DiLoCo (jaxlm.diloco): the exactness identities, the outer-gradient sign, streaming fragments and their schedule,
compressed outer gradients, replica loss and rejoin, and exact resume in the middle of an inner phase."""

import dataclasses

import jax
import numpy as np
import pytest
from helpers import random_batch, random_token_file, tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st
from test_resume import CrashingIterator

from data import SeededBatchIterator, TokenFile
from data.partitioned import PartitionedBatches
from jaxlm.config import ConfigError, DiLoCoConfig, validate
from jaxlm.diloco.compression import round_trip, wire_bytes
from jaxlm.diloco.program import DiLoCoProgram, Schedule
from jaxlm.metrics import read_metrics
from jaxlm.train import Program
from jaxlm.trainer import Trainer
from sharding import LayoutError, MeshLayout, build_mesh

SGD = dict(optimizer="sgd", grad_clip=0.0, weight_decay=0.0, learning_rate=0.1, warmup_steps=0)
# Tests whose schedule does not matter use lr 1e-2 and steps=10: one inner-step program, compiled once (the
# persistent compilation cache of tests/conftest.py hands it to the others).


def mesh(**axes):
    layout = MeshLayout(**axes)
    n = int(np.prod(list(layout.axis_sizes.values())))
    return build_mesh(layout, devices=jax.devices()[:n])


def with_diloco(cfg, **diloco):
    return validate(dataclasses.replace(cfg, diloco=DiLoCoConfig(**diloco)))


def run(program, steps, batch_rows=8, seed=0):
    """(state, losses) after `steps` steps of `program` on fixed random batches."""
    batches = [random_batch(seed + i, batch=batch_rows) for i in range(steps)]
    state = program.init()
    step_fn = program.compile_step(state, program.device_batch(batches[0]))
    losses = []
    for t, batch in enumerate(batches, 1):
        state, metrics = step_fn(state, program.device_batch(batch), t)
        losses.append(float(metrics["loss"]))
    return state, np.array(losses)


def leaves(params):
    return [np.asarray(x) for x in jax.tree.leaves(params)]


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(leaves(a), leaves(b)))


# ----------------------------------------------------------------------------- exactness


def test_h1_inner_sgd_outer_sgd_lr1_equals_data_parallel_sgd():
    """H=1: each replica takes one SGD step from the global params on its B/M rows; the mean of their deltas is
    lr x the mean gradient, so outer SGD with lr 1 is one data-parallel SGD step on the whole batch. Replicas over
    a 2-way replica axis, each on a data x fsdp slice, against data parallelism over all 8 devices."""
    cfg = tiny_config(optim=SGD, steps=4, data=dict(batch_size=16))
    dp_state, dp_losses = run(Program(cfg, mesh(data=4, fsdp=2)), 4, batch_rows=16)
    dl_cfg = with_diloco(cfg, replicas=4, inner_steps=1, outer_lr=1.0, outer_momentum=0.0)
    dl_state, dl_losses = run(DiLoCoProgram(dl_cfg, mesh(replica=2, data=2, fsdp=2)), 4, batch_rows=16)
    assert max_diff(dl_state.global_params, dp_state.params) <= 1e-6
    np.testing.assert_allclose(dl_losses, dp_losses, rtol=1e-6)
    assert np.ptp(dp_losses) > 1e-3  # the params did move


def test_one_replica_outer_sgd_lr1_equals_plain_training():
    """M=1 with outer SGD lr 1 and no momentum: the global params become the replica's after every sync, with the
    inner AdamW state carried across syncs, so it is plain training."""
    cfg = tiny_config(steps=7, optim=dict(learning_rate=1e-2))
    plain_state, plain_losses = run(Program(cfg, mesh()), 7)
    dl_cfg = with_diloco(cfg, replicas=1, inner_steps=3, outer_lr=1.0, outer_momentum=0.0)
    dl_state, dl_losses = run(DiLoCoProgram(dl_cfg, mesh()), 7)  # 7 steps: syncs at 3, 6 and the final flush
    # float32 rounding only: the replica's step is vmapped, so its weight-gradient dots carry a batch axis and sum
    # in another order than the plain program's (measured 1.15e-6 after 7 steps; a real difference is >= 1e-3)
    assert max_diff(dl_state.global_params, plain_state.params) <= 3e-6
    assert max_diff(dl_state.replicas.params, jax.tree.map(lambda x: x[None], plain_state.params)) <= 3e-6
    np.testing.assert_allclose(dl_losses, plain_losses, rtol=1e-6)


def test_a_warm_start_gives_every_replica_the_plain_run_s_state():
    """`adopt` (diloco_vs_sync --warm-start): the global params and every replica's params, inner optimizer state
    and step are the plain run's; the outer momentum starts at zero."""
    cfg = tiny_config(steps=7, optim=dict(learning_rate=1e-2))  # the plain program of the test above
    plain_state, _ = run(Program(cfg, mesh()), 2)
    program = DiLoCoProgram(with_diloco(cfg, replicas=2, inner_steps=2), mesh())
    state = program.adopt(plain_state)
    assert int(state.step) == 2 and max_diff(state.global_params, plain_state.params) == 0
    for m in range(2):
        replica = jax.tree.map(lambda x: x[m], state.replicas)
        assert max_diff(replica, plain_state) == 0
    assert all(not np.any(x) for x in leaves(state.outer_opt_states))


def test_outer_gradient_is_global_minus_local():
    """With outer SGD lr 0.5 and no momentum, one sync moves the global params half way to the replicas' mean: the
    outer gradient is θ_global − θ_local (the opposite sign would move them away)."""
    cfg = with_diloco(
        tiny_config(optim=dict(learning_rate=1e-2), steps=10),
        replicas=2,
        inner_steps=10,
        outer_lr=0.5,
        outer_momentum=0.0,
    )
    program = DiLoCoProgram(cfg, mesh())
    state, _ = run(program, 3)  # 3 inner steps, no sync yet
    g0 = leaves(state.global_params)
    mean_local = [x.mean(axis=0) for x in leaves(state.replicas.params)]
    state = program.sync[0, False](state, program._alive_array(3))
    for g, m, g1 in zip(g0, mean_local, leaves(state.global_params)):
        np.testing.assert_allclose(g1, (g + m) / 2, rtol=1e-5, atol=1e-7)
    moved = sum(float(np.sum((g1 - g) * (m - g))) for g, m, g1 in zip(g0, mean_local, leaves(state.global_params)))
    assert moved > 0


def test_nesterov_outer_step_matches_a_hand_computed_one():
    """Two syncs of optax SGD with Nesterov momentum: v = Δ + μv, update = −lr (Δ + μ v)."""
    cfg = with_diloco(
        tiny_config(optim=dict(learning_rate=1e-2), steps=10),
        replicas=2,
        inner_steps=2,
        outer_lr=0.7,
        outer_momentum=0.9,
    )
    program = DiLoCoProgram(cfg, mesh())
    batches = [random_batch(i) for i in range(4)]
    state = program.init()
    g, v = leaves(state.global_params), None
    for t, batch in enumerate(batches, 1):
        state, _ = program.inner_step(state, program.device_batch(batch), program._alive_array(t))
        if t % 2 == 0:
            delta = [gi - r.mean(axis=0) for gi, r in zip(g, leaves(state.replicas.params))]
            v = delta if v is None else [d + 0.9 * vi for d, vi in zip(delta, v)]
            g = [gi - 0.7 * (d + 0.9 * vi) for gi, d, vi in zip(g, delta, v)]
            state = program.sync[0, True](state, program._alive_array(t))
            for expected, got in zip(g, leaves(state.global_params)):
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
            for r in leaves(state.replicas.params):  # merged: every replica restarts from the global params
                np.testing.assert_array_equal(r, np.broadcast_to(r[0], r.shape))


# ----------------------------------------------------------------------------- streaming


@settings(max_examples=60, deadline=None)
@given(fragments=st.integers(1, 4), per=st.integers(1, 5), overlap=st.integers(0, 4), steps=st.integers(1, 60))
def test_fragment_schedule(fragments, per, overlap, steps):
    """Each fragment syncs every H steps, in turn, every H/P steps; its merge follows τ steps later; the last step
    syncs and merges everything still outstanding; the sync counts the metrics report are the schedule's."""
    overlap = overlap % per
    cfg = with_diloco(
        tiny_config(model=dict(num_layers=4), steps=steps),
        replicas=2,
        inner_steps=per * fragments,
        fragments=fragments,
        overlap_steps=overlap,
    )
    sched = Schedule(cfg)
    syncs = {t: sched.syncs_at(t) for t in range(1, steps + 1)}
    merges = {t: sched.merges_at(t) for t in range(1, steps + 1)}
    last_sync = {}
    for t in range(1, steps):
        for p, merge_now in syncs[t]:
            assert t % per == 0 and p == (t // per - 1) % fragments
            assert p not in last_sync or t - last_sync[p] == per * fragments
            assert merge_now == (overlap == 0)
            last_sync[p] = t
            if overlap and t + overlap <= steps:  # a merge due at the last step happens there too
                assert p in merges[t + overlap]
    regular_last = sched.fragments == 1 and overlap == 0 and steps % per == 0
    assert [p for p, _ in syncs[steps]] == ([0] if regular_last else list(range(fragments)))
    assert all(merge for _, merge in syncs[steps]) or (overlap and not sched.is_flush(steps))
    assert sum(sched.sync_counts(steps)) == sum(len(s) for s in syncs.values())


def test_fragments_cover_every_value_once_and_sync_only_their_own_rows():
    """Layer l (and row r of the embedding and the final norm) belongs to fragment l mod P: a sync of fragment 1
    changes exactly those rows of the global params and the replicas, and the two fragments are near-equal."""
    cfg = with_diloco(
        tiny_config(model=dict(num_layers=4), optim=dict(learning_rate=1e-2), steps=20),
        replicas=2,
        inner_steps=4,
        fragments=2,
        outer_lr=0.7,
        outer_momentum=0.9,
    )
    program = DiLoCoProgram(cfg, mesh())
    shapes = [x.shape for x in jax.tree.leaves(program.replica_abstract.params)]
    assert sum(sum(program.fragments.sizes(shapes, p)) for p in range(2)) == program.num_params
    state, _ = run(program, 3)  # 3 inner steps; fragment 0 synced at step 2 (overlap 0: merged)
    before = dataclasses.replace(
        state,
        global_params=jax.tree.map(np.asarray, state.global_params),
        replicas=jax.tree.map(np.asarray, state.replicas),
    )
    state = program.sync[1, True](state, program._alive_array(3))
    assert all(program.fragments.split)
    for g0, g1, r0, r1 in zip(
        leaves(before.global_params),
        leaves(state.global_params),
        leaves(before.replicas.params),
        leaves(state.replicas.params),
    ):
        np.testing.assert_array_equal(g1[0::2], g0[0::2])  # fragment 0's rows untouched
        np.testing.assert_array_equal(r1[:, 0::2], r0[:, 0::2])
        assert not np.array_equal(g1[1::2], g0[1::2])
        np.testing.assert_array_equal(r1[:, 1::2], np.broadcast_to(g1[1::2], r1[:, 1::2].shape))
    assert program.sync_bytes[0] + program.sync_bytes[1] == program.num_params * 4
    assert max(program.sync_bytes) / min(program.sync_bytes) < 1.01


# ----------------------------------------------------------------------------- compression and bytes


def test_compressed_outer_gradients_are_what_the_receivers_reconstruct_and_bytes_are_counted():
    """One sync with 4-bit outer gradients: the outer step is the Nesterov step on the mean of the replicas' deltas
    after the int4 round trip (block 64), which differs from the float32 step by at most a few quantization steps;
    the bytes logged are the wire sizes (payload = params x 4 bits / 8, plus one float32 scale per block)."""
    cfg = with_diloco(
        tiny_config(optim=dict(learning_rate=1e-2), steps=10),
        replicas=2,
        inner_steps=2,
        compression="int4",
        compression_block=64,
    )
    program = DiLoCoProgram(cfg, mesh())
    state = program.init()
    for t in (1, 2):
        state, _ = program.inner_step(state, program.device_batch(random_batch(t)), program._alive_array(t))
    g0, r = leaves(state.global_params), leaves(state.replicas.params)
    state = program.sync[0, True](state, program._alive_array(2))
    nesterov_first_step = 0.7 * (1 + 0.9)  # v = Δ, update = lr (Δ + μ v)
    for g, r_R, got in zip(g0, r, leaves(state.global_params)):
        sent = np.stack([np.asarray(round_trip(g - r_m, "int4", 64)) for r_m in r_R])
        np.testing.assert_allclose(got, g - nesterov_first_step * sent.mean(axis=0), rtol=1e-5, atol=1e-7)
        exact = g - nesterov_first_step * (g - r_R).mean(axis=0)
        half_step = np.abs(g - r_R).max() / 7 / 2
        assert np.abs(got - exact).max() <= nesterov_first_step * half_step * (1 + 1e-5)
    shapes = [x.shape for x in jax.tree.leaves(program.replica_abstract.params)]
    expected = sum(sum(wire_bytes(int(np.prod(s)), "int4", 64)) for s in shapes)
    metrics = program.step_metrics(2)
    assert metrics["diloco_syncs"] == 1 and metrics["diloco_bytes"] == expected
    payload = sum(wire_bytes(int(np.prod(s)), "int4", 64)[0] for s in shapes)
    assert payload * 8 == program.num_params * 4


# ----------------------------------------------------------------------------- failures


def test_lost_replica_is_left_out_and_rejoins_from_the_global_params():
    """Replica 1 is down for steps 2..3: it takes no inner steps, the sync at step 2 averages replica 0 alone (outer
    SGD lr 1: global = replica 0), and at step 4 it restarts from the global params with replica 0's optimizer."""
    cfg = with_diloco(
        tiny_config(optim=dict(learning_rate=1e-2), steps=10),
        replicas=2,
        inner_steps=2,
        outer_lr=1.0,
        outer_momentum=0.0,
        drop="1@2-3",
    )
    program = DiLoCoProgram(cfg, mesh())
    batches = [program.device_batch(random_batch(i)) for i in range(4)]
    state = program.init()
    step_fn = program.compile_step(state, batches[0])
    state, _ = step_fn(state, batches[0], 1)
    after1 = jax.tree.map(np.asarray, state.replicas)
    state, _ = program.inner_step(state, batches[1], program._alive_array(2))
    r0 = [x[0] for x in leaves(state.replicas.params)]
    state = program.sync[0, True](state, program._alive_array(2))
    for g, expected in zip(leaves(state.global_params), r0):
        np.testing.assert_allclose(g, expected, rtol=1e-6, atol=1e-7)
    state, _ = step_fn(state, batches[2], 3)
    for frozen, now in zip(leaves(after1.opt_state), leaves(state.replicas.opt_state)):
        np.testing.assert_array_equal(now[1], frozen[1])  # the down replica's optimizer did not move
    assert Schedule(cfg).rejoining(4) == [(1, 0)]
    state = program.rejoin(state, 1, 0)
    for r, g in zip(leaves(state.replicas.params), leaves(state.global_params)):
        np.testing.assert_array_equal(r[1], g)
    for x in leaves(state.replicas.opt_state):
        np.testing.assert_array_equal(x[1], x[0])
    assert program.step_metrics(3)["diloco_alive"] == 1 and program.step_metrics(4)["diloco_alive"] == 2


@pytest.mark.parametrize(
    "drop, message",
    [
        ("0@1-5,1@3-4", "leaves no replica alive at step 3"),
        ("2@1-3", r"replica 2 in '2@1-3' is not in \[0, 2\)"),
        ("1@5", "is not 'replica@first-last'"),
        ("1@5-2", "needs 1 <= first <= last"),
    ],
)
def test_bad_drop_schedules_are_refused(drop, message):
    with pytest.raises(ConfigError, match=message):
        with_diloco(tiny_config(), replicas=2, drop=drop)


@pytest.mark.parametrize(
    "diloco, message",
    [
        (dict(replicas=3), r"data.batch_size \(8\) must be divisible by diloco.replicas \(3\)"),
        (dict(replicas=2, inner_steps=30, fragments=4), r"diloco.fragments must be in \[1, model.num_layers = 2\]"),
        (dict(replicas=2, inner_steps=5, fragments=2), r"inner_steps \(5\) must be divisible by diloco.fragments"),
        (dict(replicas=2, inner_steps=4, fragments=2, overlap_steps=2), r"overlap_steps must be in \[0, .* = 2\)"),
        (dict(replicas=2, compression="fp4"), "diloco.compression must be one of none, bf16, int8, int4"),
        (dict(replicas=2, outer_momentum=1.0), r"outer_momentum must be in \[0, 1\)"),
        (dict(replicas=2, data="shuffled"), "diloco.data must be one of iid, partition"),
        (dict(replicas=2, exchange="ex", sync_timeout_s=0), "diloco.sync_timeout_s must be positive, got 0"),
        (
            dict(replicas=2, exchange="ex", heartbeat_s=-1),
            r"diloco.heartbeat_s must be >= 0 \(0 turns the heartbeat off\)",
        ),
    ],
)
def test_bad_diloco_configs_are_refused(diloco, message):
    with pytest.raises(ConfigError, match=message):
        with_diloco(tiny_config(), **diloco)


def test_layouts_that_cannot_hold_the_replicas_are_refused():
    cfg = with_diloco(tiny_config(), replicas=2)
    with pytest.raises(LayoutError, match="diloco.replicas = 2 is not divisible by mesh axis 'replica' = 4"):
        DiLoCoProgram(cfg, mesh(replica=4))
    with pytest.raises(LayoutError, match=r"per-replica microbatch of 4 rows .* not divisible by data x fsdp = 8"):
        DiLoCoProgram(cfg, mesh(data=8))


def test_streaming_diloco_in_a_zbv_pipeline_equals_diloco_without_one():
    """Replicas whose steps run pipelined (ZB-V from its table: two chunks per stage in a V) sync fragments with an
    overlap exactly as replicas on data parallelism do; SGD, so nothing amplifies a summation order."""
    cfg = tiny_config(optim=SGD, steps=4, data=dict(batch_size=16), model=dict(num_layers=4))
    dl_cfg = with_diloco(cfg, replicas=2, inner_steps=4, fragments=2, overlap_steps=1, outer_lr=0.7, outer_momentum=0.9)
    plain_state, plain_losses = run(DiLoCoProgram(dl_cfg, mesh(replica=2, data=4)), 4, batch_rows=16)
    pipelined = mesh(replica=2, data=2, pipeline=2, pipeline_schedule="zbv", pipeline_microbatches=4)
    piped_state, piped_losses = run(DiLoCoProgram(dl_cfg, pipelined), 4, batch_rows=16)
    assert max_diff(piped_state.global_params, plain_state.global_params) <= 1e-6
    np.testing.assert_allclose(piped_losses, plain_losses, rtol=1e-6)
    assert np.ptp(plain_losses) > 1e-3


def test_diloco_replicas_with_a_context_axis_equal_replicas_without_one():
    """Each replica's sequences split over a context axis (the ring, a sliding-window mask) train and sync exactly as
    replicas on data parallelism alone: the replica axis and the context axis do not meet."""
    model = dict(attention_impl="xla_blocksparse", attention_mask="causal & sliding_window(8)")
    cfg = tiny_config(optim=SGD, steps=2, model=model)
    dl_cfg = with_diloco(cfg, replicas=2, inner_steps=2, outer_lr=0.7, outer_momentum=0.9)
    plain_state, plain_losses = run(DiLoCoProgram(dl_cfg, mesh(replica=2, data=4)), 2)
    context_state, context_losses = run(DiLoCoProgram(dl_cfg, mesh(replica=2, data=2, context=2)), 2)
    assert max_diff(context_state.global_params, plain_state.global_params) <= 1e-6
    np.testing.assert_allclose(context_losses, plain_losses, rtol=1e-6)


@pytest.mark.slow
def test_diloco_replicas_of_an_moe_with_an_expert_axis_equal_replicas_without_one():
    """Each replica's MoE layers split their experts over an expert axis (token copies exchanged by all-to-all
    inside the replica), and train and sync exactly as replicas whose devices each route their own tokens."""
    cfg = tiny_config(optim=SGD, steps=2, model=dict(num_experts=4, experts_per_token=2, expert_mlp_dim=32))
    dl_cfg = with_diloco(cfg, replicas=2, inner_steps=2, outer_lr=0.7, outer_momentum=0.9)
    plain_state, plain_losses = run(DiLoCoProgram(dl_cfg, mesh(replica=2, data=4)), 2)
    expert_state, expert_losses = run(DiLoCoProgram(dl_cfg, mesh(replica=2, data=2, expert=2)), 2)
    assert max_diff(expert_state.global_params, plain_state.global_params) <= 1e-6
    np.testing.assert_allclose(expert_losses, plain_losses, rtol=1e-6)


# ----------------------------------------------------------------------------- resume and data


def test_resume_in_the_middle_of_an_inner_phase_gives_identical_losses(tmp_path):
    """Checkpoints hold the global params, the outer momentum and every replica's inner state: a run that crashes
    after step 7, with its last checkpoint at step 5 (inside the second inner phase of H=4, with a replica down and
    a fragment merge in flight), and is rerun logs the same losses, bit for bit, as one that never stopped."""
    tokens = TokenFile.open(random_token_file(tmp_path / "tokens")).tokens
    cfg = with_diloco(
        tiny_config(model=dict(num_layers=2), steps=10, checkpoint_every=5, optim=dict(learning_rate=1e-2)),
        replicas=2,
        inner_steps=4,
        fragments=2,
        overlap_steps=1,
        compression="int8",
        drop="1@3-6",
    )

    def train(workdir, crash_at=None):
        batches = SeededBatchIterator(tokens, batch_size=8, seq_len=16, seed=0)
        if crash_at:
            batches = CrashingIterator(batches, crash_at)
        return Trainer(cfg, mesh(), workdir, batches, [], progress=False).run()

    def losses(workdir):
        return [(r["step"], r["loss"], r["diloco_bytes"]) for r in read_metrics(workdir / "metrics.jsonl")]

    train(tmp_path / "straight")
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "resumed", crash_at=8)  # fetching batch 8 (for step 8) fails after step 7 ran, before its log
    assert len(losses(tmp_path / "resumed")) == 6
    train(tmp_path / "resumed")
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    assert [s for s, _, _ in losses(tmp_path / "straight")] == list(range(1, 11))


def test_partitioned_data_gives_each_replica_its_own_slice(tmp_path):
    tokens = TokenFile.open(random_token_file(tmp_path / "tokens", num_tokens=4000)).tokens
    make = lambda: PartitionedBatches(tokens, parts=2, batch_size=8, seq_len=16, seed=3, start=0, stop=4000)  # noqa
    it = make()
    half = {
        m: {
            tuple(w)
            for w in SeededBatchIterator(
                tokens, batch_size=4, seq_len=16, seed=3 + m, start=2000 * m, stop=2000 * (m + 1)
            ).__next__()["inputs"]
        }
        for m in (0, 1)
    }
    first = next(it)
    assert {tuple(w) for w in first["inputs"][:4]} == half[0] and {tuple(w) for w in first["inputs"][4:]} == half[1]
    for _ in range(5):
        next(it)
    state = it.get_state()
    resumed, rows = make(), make()
    resumed.set_state(state)
    rows.set_state(state)
    rows.set_rows(4, 8)  # a process holding replica 1's rows reads partition 1 only
    full, second_half = next(it), next(rows)
    np.testing.assert_array_equal(next(resumed)["inputs"], full["inputs"])
    np.testing.assert_array_equal(second_half["inputs"], full["inputs"][4:])
    assert rows.get_state() == it.get_state()  # the skipped partition still moved on
    with pytest.raises(ValueError, match="no entries for partition 1"):
        make().set_state({k: v for k, v in state.items() if k.startswith("part0.")})
