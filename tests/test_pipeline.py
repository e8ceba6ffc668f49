"""sharding.pipeline: every schedule table (sharding.schedules) run through the one runner equals the plain
sequential computation, loss and gradients, on 8 simulated devices, with a small stack of dense layers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sharding import MeshLayout, build_mesh
from sharding import pipeline as pp
from sharding import schedules as S

L, D, V, B, T = 8, 16, 6, 4, 8


def stage_fn(layers_LDD, x_BTD, keep_BT):
    """A few tanh layers; `keep_BT` is a per-microbatch side input (like segment ids for attention)."""

    def layer(x, w):
        return jnp.tanh(x @ w) * keep_BT[..., None], None

    return jax.lax.scan(layer, x_BTD, layers_LDD)[0]


def head_fn(head, y_BTD, targets_BT):
    logp = jax.nn.log_softmax(y_BTD @ head["w_DV"])
    picked = jnp.sum(logp * jax.nn.one_hot(targets_BT, V), axis=-1)
    return -jnp.sum(picked), jnp.asarray(targets_BT.size, jnp.float32)


def inputs(M, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    return (
        0.4 * jax.random.normal(k[0], (L, D, D)),
        {"w_DV": jax.random.normal(k[1], (D, V))},
        jax.random.normal(k[2], (M, B, T, D)),
        (jax.random.uniform(k[3], (M, B, T)) > 0.2).astype(jnp.float32),
        jax.random.randint(k[4], (M, B, T), 0, V),
    )


def sequential_loss(layers, head, x_M, keep_M, targets_M):
    total = 0.0
    for m in range(x_M.shape[0]):
        total += head_fn(head, stage_fn(layers, x_M[m], keep_M[m]), targets_M[m])[0]
    return total


def pipelined(schedule, mesh, keep_M, targets_M):
    def loss(layers, head, x_M):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            chunks = pp.split_chunks(layers, schedule)
            return pp.pipeline_loss(schedule, stage_fn, head_fn, chunks, head, x_M, keep_M, targets_M)

    return loss


def on_mesh(mesh, tree):
    return jax.device_put(tree, NamedSharding(mesh, P()))


slow = pytest.mark.slow
# The default suite: 1F1B at P = 4 and GPipe at P = 2 with M = 6 (not a multiple of the stages: warm-up and drain
# overlap unevenly), interleaved (the ring wraps) and ZB-V (the V turns on a stage; B and W split) at P = 4, M = 2P;
# the slow suite every schedule at P = 2, 4 and M = P, 2P, 4P.
FAST = [("1f1b", 4, 6), ("gpipe", 2, 6), ("interleaved-1f1b", 4, 8), ("zbv", 4, 8)]
CASES = FAST + [
    pytest.param(name, p, m, marks=slow)
    for name in S.NAMES
    for p in (2, 4)
    for m in (p, 2 * p, 4 * p)
    if (name, p, m) not in FAST
]


@pytest.mark.parametrize("name, stages, microbatches", CASES)
def test_every_schedule_equals_the_sequential_model(name, stages, microbatches):
    schedule = S.make(name, stages, microbatches)
    layers, head, x_M, keep_M, targets_M = inputs(microbatches)
    ref_loss, ref_grads = jax.value_and_grad(sequential_loss, argnums=(0, 1, 2))(layers, head, x_M, keep_M, targets_M)
    mesh = build_mesh(MeshLayout(data=8 // stages, pipeline=stages))
    loss_fn = pipelined(schedule, mesh, keep_M, targets_M)
    assert_matches_sequential(loss_fn, on_mesh(mesh, (layers, head, x_M)), ref_loss, ref_grads, microbatches)


def assert_matches_sequential(loss_fn, args, ref_loss, ref_grads, microbatches):
    """`loss_fn(*args)` -> (sum, PipelineAux), pipelined: its value, count and gradients are the sequential ones."""
    (loss, aux), grads = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1, 2), has_aux=True))(*args)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert float(aux.count) == microbatches * B * T and float(aux.head_loss) == float(loss) and aux.stats == {}
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        # float32 sums in another order: up to 1.06e-6 seen (tests compile without LLVM's optimizations)
        assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 3e-6
    # Without differentiation (eval) the forwards alone (sharding.schedules.forward_pass) give the same value.
    np.testing.assert_allclose(float(jax.jit(loss_fn)(*args)[0]), float(ref_loss), rtol=1e-6)


def temp_bytes(name, M, stages=2):
    mesh = build_mesh(MeshLayout(data=8 // stages, pipeline=stages))
    schedule = S.make(name, stages, M)

    def grads(layers, head, x_M, keep_M, targets_M):
        loss_fn = pipelined(schedule, mesh, keep_M, targets_M)
        return jax.grad(lambda *a: loss_fn(*a)[0], argnums=(0, 1, 2))(layers, head, x_M)

    def sds(shape, spec, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    compiled = (
        jax.jit(grads)
        .lower(
            sds((L, D, D), P("pipeline")),
            {"w_DV": sds((D, V), P())},
            sds((M, B, T, D), P()),
            sds((M, B, T), P()),
            sds((M, B, T), P(), jnp.int32),
        )
        .compile()
    )
    return compiled.memory_analysis().temp_size_in_bytes


def test_1f1b_activation_memory_does_not_grow_with_microbatches():
    """Both recompute a stage's forward from its stashed input; 1F1B stashes at most P inputs, GPipe all M. From 4 to
    16 microbatches 1F1B's scratch memory may grow by the [M] input-gradient buffer only (12 more [B, T, D] float32
    rows, give or take buffer alignment), GPipe's by that and 12 more stashed inputs."""
    row = B * T * D * 4
    one_f_one_b = temp_bytes("1f1b", 16) - temp_bytes("1f1b", 4)
    gpipe = temp_bytes("gpipe", 16) - temp_bytes("gpipe", 4)
    assert one_f_one_b <= 12 * row + 1024
    assert gpipe >= 2 * 12 * row


def test_chunks_split_and_join_back_in_the_model_s_order():
    layers = jnp.arange(16.0).reshape(16, 1)
    for name in ("interleaved-1f1b", "zbv", "1f1b"):
        sc = S.make(name, 4, 8)
        chunks = pp.split_chunks(layers, sc)
        assert chunks.shape == (4, sc.chunks, 16 // (4 * sc.chunks), 1)
        assert jnp.array_equal(pp.join_chunks(chunks, sc), layers)
    zbv = pp.split_chunks(layers, S.make("zbv", 4, 8))
    assert zbv[0, 1, 0, 0] == 14 and zbv[3, 0, 0, 0] == 6 and zbv[3, 1, 0, 0] == 8  # stage 0 holds the V's two ends


def test_chunks_reach_their_stages_in_rounds_of_ppermute_not_a_gather_of_every_stage():
    """Under a mesh the v chunks a device holds in the model's order move to their stages in v permutations; the
    result and its gradient equal the plain index, and no device gathers every stage's layers."""
    mesh = build_mesh(MeshLayout(data=2, pipeline=4))
    layers = jax.device_put(jnp.arange(16.0 * 3).reshape(16, 3), NamedSharding(mesh, P("pipeline")))
    for p in (2, 4, 8):
        for sc in (S.make("interleaved-1f1b", p, p, 3), S.make("zbv", p, p)):
            for pairs, _, _ in pp.chunk_moves(sc):
                assert sorted(a for a, _ in pairs) == sorted(b for _, b in pairs) == list(range(p))
    # ZB-V on the mesh (interleaved's moves run in test_every_schedule_...): stage 0 keeps one of its own chunks (a
    # move to itself) and sends the other on
    sc = S.make("zbv", 4, 8)
    weights = jnp.arange(16.0 * 3).reshape(4, 2, 2, 3) % 5
    moved = jax.jit(lambda layers: pp.split_chunks(layers, sc))
    with jax.set_mesh(mesh):
        got = moved(layers)
        grad = jax.jit(jax.grad(lambda x: jnp.sum(pp.split_chunks(x, sc) * weights)))(layers)
        hlo = moved.lower(layers).compile().as_text()
    assert jnp.array_equal(got, pp.split_chunks(jnp.arange(16.0 * 3).reshape(16, 3), sc))  # no mesh: the index
    assert jnp.array_equal(grad, pp.join_chunks(weights, sc))
    assert "collective-permute" in hlo and "all-gather" not in hlo


def test_buffers_hold_what_the_table_stashes_not_every_microbatch():
    one_f_one_b, gpipe = (pp.compile_table(S.make(n, 4, 16)) for n in ("1f1b", "gpipe"))
    assert (one_f_one_b.x_slots, one_f_one_b.g_slots) == (4, 1)  # P inputs in flight; a gradient used at once
    assert gpipe.x_slots == 16
    zbv = pp.compile_table(S.make("zbv", 4, 16))
    assert zbv.x_slots <= 2 * 4 + 2  # P microbatches of two half-size chunks, plus the ones in transit
    gpipe_eval, zbv_eval = (pp.compile_table(S.forward_pass(S.make(n, 4, 16))) for n in ("gpipe", "zbv"))
    assert not gpipe_eval.training and gpipe_eval.x_slots == 1  # eval: an input is read the tick after it arrives
    assert zbv_eval.x_slots == 2  # ... or waits a tick where the V turns


def _ring_stage_fn(layers_LDD, x_BTD, keep_BT):
    """stage_fn plus each token's value from the other half of the row, passed with a ppermute over a context axis
    (as ring attention does): one collective-permute that pairs the devices of every stage."""

    def swap(x):
        return jax.lax.ppermute(x, "context", [(0, 1), (1, 0)])

    mesh = jax.sharding.get_abstract_mesh()
    spec = P(None, "context")
    swapped = jax.shard_map(swap, mesh=mesh, in_specs=spec, out_specs=spec, axis_names={"context"}, check_vma=False)
    return stage_fn(layers_LDD, x_BTD, keep_BT) + 0.5 * swapped(x_BTD)


@slow
@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_a_stage_whose_collective_pairs_every_stage_runs_in_lockstep(name):
    """Run by the stages whose op holds it, such a collective mixes the stages' data (XLA:CPU: the loss is wrong);
    in lockstep every stage runs each tick's op (masked where it has none) and the loss and gradients are right."""
    M = 4
    layers, head, x_M, keep_M, targets_M = inputs(M)

    def sequential(layers, head, x_M):
        total = 0.0
        for m in range(M):
            y = x_M[m]
            for s in range(2):  # each stage's layers, then the swap of the row's halves
                y = stage_fn(layers[4 * s : 4 * s + 4], y, keep_M[m]) + 0.5 * jnp.roll(y, T // 2, axis=1)
            total += head_fn(head, y, targets_M[m])[0]
        return total

    ref_loss, ref_grads = jax.value_and_grad(sequential, argnums=(0, 1, 2))(layers, head, x_M)
    mesh = build_mesh(MeshLayout(pipeline=2, context=2, data=2))
    table = S.lockstep(S.make(name, 2, M))
    assert table.lockstep and all(len({op.kind for op in table.ops if op.tick == t}) <= 1 for t in range(table.ticks))

    def loss_fn(layers, head, x_M):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            chunks = pp.split_chunks(layers, table)
            return pp.pipeline_loss(table, _ring_stage_fn, head_fn, chunks, head, x_M, keep_M, targets_M)

    assert_matches_sequential(loss_fn, on_mesh(mesh, (layers, head, x_M)), ref_loss, ref_grads, M)


def test_missing_mesh():
    layers, head, x_M, keep_M, targets_M = inputs(2)
    schedule = S.make("gpipe", 2, 2)
    with pytest.raises(ValueError, match=r"needs a mesh with a 'pipeline' axis"):
        pp.pipeline_loss(schedule, stage_fn, head_fn, pp.split_chunks(layers, schedule), head, x_M, keep_M, targets_M)
