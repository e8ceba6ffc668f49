"""Score mods that capture arrays (``pallas_kernels.score_tables``) on the XLA block-sparse paths: forward and
gradients to q, k, v and the captured table / slopes equal the dense reference's autodiff, on the tiled path (a
static mask) and the scan (document ids traced inside jit); padding, GQA, batch > 1, a mod with d mod / d s != 1."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    BlockSizes,
    block_sparse_attention_xla,
    causal,
    chain,
    document,
    make_block_mask,
    prefix_lm,
    reference_attention,
    soft_cap,
)
from pallas_kernels import xla_tiled_attention as tiled
from pallas_kernels.score_tables import learned_alibi, relative_bias
from pallas_kernels.xla_attention import uses_tiled_path

BLOCKS = BlockSizes(32, 32)


def inputs(B, H, K, T, seed=0):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(B, H, T, 16)), jnp.float32)
    k, v = (jnp.asarray(r.normal(size=(B, K, T, 16)), jnp.float32) for _ in range(2))
    w = jnp.asarray(r.normal(size=q.shape), jnp.float32)  # the loss's weights on the output
    return q, k, v, w


def segments(B, T, seed=0):
    return np.sort(np.random.default_rng(seed).integers(0, 3, size=(B, T)), axis=1).astype(np.int32)


def loss_and_grads(attend, make_mod, array, q, k, v, w):
    """((out, lse), d/d(q, k, v, array)) of a loss that reads both outputs (so lse's cotangent is exercised too)."""

    def loss(q, k, v, array):
        out, lse = attend(q, k, v, make_mod(array))
        return jnp.sum(out * w) + jnp.sum(jnp.sin(lse)), (out, lse)

    (_, outputs), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, array)
    return outputs, grads


def tiled_path(mask, T, seg):
    """The dispatcher with a static block mask: the tiled path."""
    bm = make_block_mask(mask, T, T, BLOCKS)
    assert uses_tiled_path(bm)
    return mask, lambda q, k, v, mod, seg: block_sparse_attention_xla(q, k, v, bm, score_mod=mod)


def scan_path(mask, T, seg):
    """The dispatcher with the mask's document ids traced: the block mask is built on device, so the scan runs."""

    def attend(q, k, v, mod, seg):
        bm = make_block_mask(mask & document(seg), T, T, BLOCKS)
        assert bm.is_traced and not uses_tiled_path(bm)
        return block_sparse_attention_xla(q, k, v, bm, score_mod=mod)

    return mask & document(seg), attend


def check(path, make_mod, array, mask, B=1, H=4, K=2, T=100, seed=0):
    q, k, v, w = inputs(B, H, K, T, seed)
    seg = segments(B, T, seed)
    ref_mask, attend = path(mask, T, seg)

    @jax.jit
    def run(q, k, v, array, seg):
        return loss_and_grads(lambda *a: attend(*a, seg), make_mod, array, q, k, v, w)

    got = run(q, k, v, array, jnp.asarray(seg))
    ref = jax.jit(
        functools.partial(
            loss_and_grads, lambda q, k, v, mod: reference_attention(q, k, v, ref_mask, score_mod=mod), make_mod
        )
    )(array, q, k, v, w)
    names = ("out", "lse", "dq", "dk", "dv", "d array")
    for name, g, r in zip(names, (*got[0], *got[1]), (*ref[0], *ref[1])):
        assert g.shape == r.shape, name
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4, err_msg=name)
    assert np.abs(got[1][3]).max() > 1e-3  # the array's gradient is not trivially zero


def table(H, buckets, seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(H, buckets)), jnp.float32)


paths = pytest.mark.parametrize("path", [tiled_path, scan_path], ids=["tiled", "scan"])


@paths
def test_relative_bias_causal(path):
    """T = 100: padded to whole blocks of 32 (padded rows and keys add nothing to the table's gradient); GQA."""
    check(path, relative_bias, table(4, 32), causal())


@pytest.mark.slow  # the causal and chained cases cover both paths in the default suite
@paths
def test_relative_bias_bidirectional(path):
    """prefix_lm: bidirectional over the prefix (keys after the query get their own buckets), causal after it."""

    def make_mod(t):
        return relative_bias(t, bidirectional=True, max_distance=48)

    check(path, make_mod, table(2, 16, seed=2), prefix_lm(40), H=2, K=1, T=96, seed=3)


@pytest.mark.slow  # the causal and chained cases cover both paths in the default suite
@paths
def test_learned_alibi_batched(path):
    """Slopes [H] (flattened to [H, 1] inside); B = 2: the gradient sums over the batch."""
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32)
    check(path, learned_alibi, slopes, causal(), B=2, T=64, seed=4)


@paths
def test_chained_mod_with_a_non_unit_derivative(path):
    """soft_cap after the bias: the table's gradient takes ds at the modded scores, before d mod / d s."""

    def make_mod(t):
        return chain(relative_bias(t), soft_cap(2.0))

    check(path, make_mod, table(2, 8, seed=5), causal(), H=2, K=2, T=64, seed=6)


def test_tiled_quadtree_pieces(monkeypatch):
    """The quadtree instead of strips: several groups of pieces, each adding its tiles' share of the gradient."""
    monkeypatch.setattr(tiled, "STRIPS_MAX_LEN", 0)
    monkeypatch.setattr(tiled, "PIECE_COST", 0)
    assert len(tiled.plan_block_mask(make_block_mask(causal(), 120, 120, BLOCKS)).groups) >= 2
    check(tiled_path, relative_bias, table(2, 32, seed=7), causal(), H=2, K=1, T=120, seed=8)


def test_kept_probabilities_only_without_a_score_mod(monkeypatch):
    """Short sequences keep the forward's probabilities for the backward; a mod's array gradient needs the raw
    scores, so with one they are recomputed (and without arrays nothing changes)."""
    seen = []
    backward = tiled._backward

    def spy(*args, **kwargs):
        seen.append((len(args[8]), args[9] is not None))  # (mod arrays, probabilities kept)
        return backward(*args, **kwargs)

    monkeypatch.setattr(tiled, "_backward", spy)
    q, k, v, _ = inputs(1, 2, 2, 64)
    bm = make_block_mask(causal(), 64, 64, BLOCKS)
    for mod in (None, relative_bias(table(2, 8))):
        jax.make_jaxpr(jax.grad(lambda q: block_sparse_attention_xla(q, k, v, bm, score_mod=mod)[0].sum()))(q)
    assert seen == [(0, True), (1, False)]


def test_array_rows_must_match_the_query_heads():
    q, k, v, _ = inputs(1, 4, 2, 64)
    bm = make_block_mask(causal(), 64, 64, BLOCKS)
    with pytest.raises(ValueError, match="one row per query head"):
        block_sparse_attention_xla(q, k, v, bm, score_mod=relative_bias(table(2, 8)))
