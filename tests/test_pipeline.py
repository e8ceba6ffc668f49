"""sharding.pipeline on a small stack of dense layers: both schedules against the plain sequential computation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sharding import MeshLayout, build_mesh
from sharding import pipeline as pp

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


def pipelined(schedule, stages, mesh, keep_M, targets_M):
    def loss(layers, head, x_M):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            total, count = pp.pipeline_loss(
                schedule,
                stage_fn,
                head_fn,
                pp.split_stages(layers, stages),
                head,
                x_M,
                keep_M,
                targets_M,
                stages=stages,
            )
        return total, count

    return loss


def on_mesh(mesh, tree):
    return jax.device_put(tree, NamedSharding(mesh, P()))


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedule_matches_sequential(schedule, stages):
    M = 6  # not a multiple of the stages: warm-up and drain overlap unevenly
    layers, head, x_M, keep_M, targets_M = inputs(M)
    ref_loss, ref_grads = jax.value_and_grad(sequential_loss, argnums=(0, 1, 2))(layers, head, x_M, keep_M, targets_M)

    mesh = build_mesh(MeshLayout(data=8 // stages, pipeline=stages))
    loss_fn = pipelined(schedule, stages, mesh, keep_M, targets_M)
    assert_matches_sequential(loss_fn, on_mesh(mesh, (layers, head, x_M)), ref_loss, ref_grads, M)


def assert_matches_sequential(loss_fn, args, ref_loss, ref_grads, microbatches):
    """`loss_fn(*args)` -> (sum, count), pipelined: its value, count and gradients are the sequential ones."""
    (loss, count), grads = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1, 2), has_aux=True))(*args)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert float(count) == microbatches * B * T
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        # float32 sums in another order: up to 1.06e-6 seen (tests compile without LLVM's optimizations)
        assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 3e-6
    # Without differentiation (eval) the schedule gives the same value.
    np.testing.assert_allclose(float(jax.jit(loss_fn)(*args)[0]), float(ref_loss), rtol=1e-6)


def temp_bytes(schedule, M, stages=2):
    mesh = build_mesh(MeshLayout(data=8 // stages, pipeline=stages))

    def grads(layers, head, x_M, keep_M, targets_M):
        loss_fn = pipelined(schedule, stages, mesh, keep_M, targets_M)
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
    """GPipe keeps every microbatch's residuals until its backward; 1F1B stashes at most 2S-1 stage inputs. From 4 to
    16 microbatches 1F1B's scratch memory may grow by the [M] input-gradient buffer only (12 more [B, T, D] float32
    rows, give or take buffer alignment), GPipe's by the residuals of 12 more microbatches in every layer."""
    row = B * T * D * 4
    one_f_one_b = temp_bytes("1f1b", 16) - temp_bytes("1f1b", 4)
    gpipe = temp_bytes("gpipe", 16) - temp_bytes("gpipe", 4)
    assert one_f_one_b <= 12 * row + 1024
    assert gpipe >= 10 * 12 * row
    assert pp.stash_slots(2) == 3 and pp.stash_slots(4) == 7


def test_bubble_fraction():
    assert pp.bubble_fraction(1, 8) == 0
    assert pp.bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert pp.bubble_fraction(4, 8) == pytest.approx(3 / 11)


def test_bad_schedule_and_missing_mesh():
    layers, head, x_M, keep_M, targets_M = inputs(2)
    with pytest.raises(ValueError, match=r"pipeline schedule 'interleaved' is unknown; choose one of gpipe, 1f1b"):
        pp.pipeline_loss("interleaved", stage_fn, head_fn, layers, head, x_M, keep_M, targets_M, stages=2)
    with pytest.raises(ValueError, match=r"needs a mesh with a 'pipeline' axis"):
        pp.pipeline_loss("gpipe", stage_fn, head_fn, pp.split_stages(layers, 2), head, x_M, keep_M, targets_M, stages=2)
