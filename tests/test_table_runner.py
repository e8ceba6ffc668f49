"""sharding.table_runner: every schedule table (sharding.schedules) run through the one runner equals the plain
sequential computation, loss and gradients, on 8 simulated devices; with the small dense stack of test_pipeline."""

import jax
import jax.numpy as jnp
import pytest

from sharding import MeshLayout, build_mesh
from sharding import schedules as S
from sharding import table_runner as R
from tests.test_pipeline import assert_matches_sequential, head_fn, inputs, on_mesh, sequential_loss, stage_fn

slow = pytest.mark.slow
# The default suite: interleaved (the ring wraps) and ZB-V (the V turns on a stage; B and W split) at P = 4, M = 2P;
# the slow suite every schedule, GPipe's and 1F1B's tables too, at P = 2, 4 and M = P, 2P, 4P.
FAST = {(4, 8, "interleaved-1f1b"), (4, 8, "zbv")}
CASES = [
    pytest.param(name, p, m, marks=() if (p, m, name) in FAST else slow)
    for name in S.NAMES
    for p in (2, 4)
    for m in (p, 2 * p, 4 * p)
]


@pytest.mark.parametrize("name, stages, microbatches", CASES)
def test_every_schedule_run_from_its_table_equals_the_sequential_model(name, stages, microbatches):
    sc = S.make(name, stages, microbatches)
    layers, head, x_M, keep_M, targets_M = inputs(microbatches)
    ref_loss, ref_grads = jax.value_and_grad(sequential_loss, argnums=(0, 1, 2))(layers, head, x_M, keep_M, targets_M)
    mesh = build_mesh(MeshLayout(data=8 // stages, pipeline=stages))

    def loss_fn(layers, head, x_M):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            chunks = R.split_chunks(layers, sc)
            return R.table_loss(sc, stage_fn, head_fn, chunks, head, x_M, keep_M, targets_M)

    assert_matches_sequential(loss_fn, on_mesh(mesh, (layers, head, x_M)), ref_loss, ref_grads, microbatches)


def test_chunks_split_and_join_back_in_the_model_s_order():
    layers = jnp.arange(16.0).reshape(16, 1)
    for name in ("interleaved-1f1b", "zbv", "1f1b"):
        sc = S.make(name, 4, 8)
        chunks = R.split_chunks(layers, sc)
        assert chunks.shape == (4, sc.chunks, 16 // (4 * sc.chunks), 1)
        assert jnp.array_equal(R.join_chunks(chunks, sc), layers)
    zbv = R.split_chunks(layers, S.make("zbv", 4, 8))
    assert zbv[0, 1, 0, 0] == 14 and zbv[3, 0, 0, 0] == 6 and zbv[3, 1, 0, 0] == 8  # stage 0 holds the V's two ends


def test_buffers_hold_what_the_table_stashes_not_every_microbatch():
    one_f_one_b, gpipe = (R.compile_table(S.make(n, 4, 16)) for n in ("1f1b", "gpipe"))
    assert (one_f_one_b.x_slots, one_f_one_b.g_slots) == (4, 1)  # P inputs in flight; a gradient used at once
    assert gpipe.x_slots == 16
    zbv = R.compile_table(S.make("zbv", 4, 16))
    assert zbv.x_slots <= 2 * 4 + 2  # P microbatches of two half-size chunks, plus the ones in transit
