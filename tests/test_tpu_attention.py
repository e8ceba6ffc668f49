"""The TPU attention kernels (pallas_kernels.tpu_attention) in the Pallas interpreter against the dense reference:
forward, gradients through out and lse, every mask kind (document ids on the host and traced), GQA, T != S, sequences
that are not whole tiles, bf16, score mods; the block-mask coarsening they read; the tiles they choose. That the
kernels compile and fit a TPU's VMEM and SMEM at T = 8k-128k is tests/test_tpu_compile.py's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import (
    BlockSizes,
    causal,
    chunked_causal,
    document,
    full,
    global_tokens,
    make_block_mask,
    prefix_lm,
    reference_attention,
    sliding_window,
    soft_cap,
)
from pallas_kernels.block_mask import coarsen
from pallas_kernels.tpu_attention import MAX_TILE, SMEM_LIST_BYTES, block_sparse_attention_tpu, tpu_tiles


def qkv(B, H, K, T, S, E, dtype=jnp.float32, seed=0):
    r = np.random.default_rng(seed)
    return tuple(jnp.asarray(r.normal(size=shape), dtype) for shape in ((B, H, T, E), (B, K, S, E), (B, K, S, E)))


def _loss(fn, w):
    def f(q, k, v):
        out, lse = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(jnp.sin(lse)), (out, lse)

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))


def check(mask_of, q, k, v, *, block=64, tiles=(128, 128), atol=2e-5, grad_atol=1e-4, **kw):
    """Our forward and gradients (through out and lse) against the float32 reference. ``mask_of(ids)`` builds the
    mask inside jit, so document ids from the arguments are traced as in training."""
    T, S = q.shape[2], k.shape[2]
    w = jnp.asarray(np.random.default_rng(4).normal(size=q.shape), jnp.float32)

    def ours(q, k, v):
        bm = make_block_mask(mask_of(), T, S, BlockSizes(block, block))
        return block_sparse_attention_tpu(q, k, v, bm, interpret=True, tiles=tiles, **kw)

    def ref(q, k, v):
        out, lse = reference_attention(q, k, v, mask_of(), **kw)
        return out.astype(q_dtype), lse

    q_dtype = q.dtype
    (_, (out, lse)), got = _loss(ours, w)(q, k, v)
    (_, (ref_out, ref_lse)), want = _loss(ref, w)(*(x.astype(jnp.float32) for x in (q, k, v)))
    assert out.dtype == q.dtype and lse.shape == q.shape[:3]
    np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, atol=atol, rtol=atol)
    np.testing.assert_allclose(lse, ref_lse, atol=atol, rtol=atol)
    for name, g, r, x in zip("qkv", got, want, (q, k, v)):
        assert g.dtype == x.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), r, atol=grad_atol, rtol=grad_atol, err_msg=f"d{name}")


def segments(B, T, seed=0):
    r = np.random.default_rng(seed)
    return np.sort(r.integers(0, 4, size=(B, T)), axis=1).astype(np.int32)


MASKS = {
    "causal": causal(),
    "sliding_window": sliding_window(70),
    "chunked_causal": chunked_causal(96),
    "prefix_lm": prefix_lm(100),
    "global_tokens | sliding_window": global_tokens(5) | sliding_window(40),
    "full": full(),
    "causal & document (host ids)": causal() & document(segments(2, 300)),
}


@pytest.mark.parametrize("name", MASKS)
def test_every_mask_matches_the_reference_over_several_tiles(name):
    """T = 300 in tiles of 128 (three tiles, the last mostly padding), blocks of 64 coarsened to the tiles, GQA."""
    check(lambda: MASKS[name], *qkv(2, 4, 2, 300, 300, 32))


def test_traced_document_ids_and_a_batch_of_masks():
    """The training path: segment ids are a jit argument, so the block mask is classified on device, per batch row."""
    ids = jnp.asarray(segments(2, 300, seed=3))
    q, k, v = qkv(2, 4, 1, 300, 300, 32)
    check(lambda: causal() & document(jax.lax.stop_gradient(ids) + 0), q, k, v)


def test_queries_and_keys_of_different_lengths_and_a_score_mod():
    q, k, v = qkv(1, 2, 2, 200, 330, 32, seed=1)
    check(lambda: prefix_lm(50) | full(), q, k, v, score_mod=soft_cap(5.0), scale=0.3)


def test_captured_arrays_and_their_gradients():
    """A T5 bias table and learned slopes read from SMEM (two query heads on one kv head: dK/dV reads both heads'
    rows), then a soft-cap; the tables' gradients from the dQ kernel's per-program vectors, against the reference."""
    from pallas_kernels import chain, learned_alibi, relative_bias

    q, k, v = qkv(1, 2, 1, 128, 200, 32, seed=2)
    r = np.random.default_rng(5)
    arrays = (jnp.asarray(r.normal(size=(2, 8)), jnp.float32), jnp.asarray([0.05, 0.2], jnp.float32))  # 8 buckets
    w = jnp.asarray(r.normal(size=q.shape), jnp.float32)
    bm = make_block_mask(prefix_lm(50) | full(), 128, 200, BlockSizes(64, 64))

    def loss(attention):
        def f(q, k, v, arrays):
            mod = chain(relative_bias(arrays[0]), learned_alibi(arrays[1]), soft_cap(5.0))
            out, lse = attention(q, k, v, mod)
            return jnp.sum(out * w) + jnp.sum(jnp.sin(lse))

        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))

    got = loss(
        lambda q, k, v, m: block_sparse_attention_tpu(q, k, v, bm, score_mod=m, interpret=True, tiles=(128, 128))
    )
    want = loss(lambda q, k, v, m: reference_attention(q, k, v, prefix_lm(50) | full(), score_mod=m))
    got, want = got(q, k, v, arrays), want(q, k, v, arrays)
    for name, g, r in zip(("dq", "dk", "dv", "d table", "d slopes"), (*got[:3], *got[3]), (*want[:3], *want[3])):
        np.testing.assert_allclose(g, r, atol=1e-4 * float(jnp.abs(r).max()), rtol=1e-4, err_msg=name)


def test_bfloat16_inputs_keep_their_dtype_within_bf16_error():
    check(lambda: causal(), *qkv(1, 2, 2, 256, 256, 64, dtype=jnp.bfloat16), block=128, atol=3e-2, grad_atol=6e-2)


def test_the_tiles_default_to_the_tpu_s_and_the_blocks_need_not_be_them():
    """No tiles given: the kernels pick tpu_tiles (one 384-row tile here) and still equal the reference."""
    q, k, v = qkv(1, 2, 1, 300, 300, 32)
    bm = make_block_mask(causal(), 300, 300, BlockSizes(32, 64))
    assert tpu_tiles(bm.block_sizes, 300, 300) == (384, 384)
    out, lse = block_sparse_attention_tpu(q, k, v, bm, interpret=True)
    ref_out, ref_lse = reference_attention(q, k, v, causal())
    np.testing.assert_allclose(out, ref_out, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5)


def test_tiles_that_are_not_lane_multiples_are_refused():
    q, k, v = qkv(1, 1, 1, 512, 512, 16)
    bm = make_block_mask(causal(), 512, 512, BlockSizes(64, 64))
    with pytest.raises(ValueError, match="the q tile 192 must be a multiple of 128"):
        block_sparse_attention_tpu(q, k, v, bm, interpret=True, tiles=(192, 128))


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(["causal", "window", "prefix", "globals", "document"]),
    q_len=st.integers(1, 200),
    kv_len=st.integers(1, 200),
    block=st.sampled_from([8, 16, 32]),
    factors=st.tuples(st.integers(1, 5), st.integers(1, 5)),
    traced=st.booleans(),
)
def test_coarsening_a_block_mask_equals_building_it_at_the_coarse_blocks(kind, q_len, kv_len, block, factors, traced):
    """Coarse kinds, lists and counts from the fine block mask equal those of make_block_mask at the coarse size,
    padding included (a coarse block holding padding is never FULL), on the host and traced alike."""
    ids = segments(1, max(q_len, kv_len), seed=q_len)[:, :q_len]
    masks = {
        "causal": full() if q_len > kv_len else causal(),  # causal leaves late queries without keys when q_len > kv_len
        "window": sliding_window(7) | full() if q_len > kv_len else sliding_window(7),
        "prefix": prefix_lm(5),
        "globals": global_tokens(3) | sliding_window(4),
        "document": causal() & document(ids, ids) if q_len == kv_len else full(),
    }
    mask = masks[kind]
    fq, fkv = factors
    fine_sizes, coarse_sizes = BlockSizes(block, block), BlockSizes(block * fq, block * fkv)

    def build(mask, sizes):
        return make_block_mask(mask, q_len, kv_len, sizes)

    if traced and kind == "document" and q_len == kv_len:
        got = jax.jit(lambda ids: _arrays(coarsen(build(causal() & document(ids, ids), fine_sizes), fq, fkv)))(ids)
    else:
        got = _arrays(coarsen(build(mask, fine_sizes), fq, fkv))
    want = _arrays(build(mask, coarse_sizes))
    for name, g, w in zip(("kind", "kv counts", "kv partial", "q counts", "q partial"), got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


def _arrays(bm):
    """What a kernel reads of a block mask, independent of the lists' padded width (host and traced differ there)."""
    return bm.kind, bm.kv_block_counts, bm.kv_partial_counts, bm.q_block_counts, bm.q_partial_counts


@pytest.mark.parametrize("T", [2048, 8192, 131072, 262144])
@pytest.mark.parametrize("batch", [1, 4])
def test_tiles_are_lane_multiples_of_the_blocks_and_their_lists_fit_smem(T, batch):
    for block in (64, 128, 256):
        if batch * (-(-T // MAX_TILE)) ** 2 * 4 > SMEM_LIST_BYTES:  # even the largest tiles' lists overflow
            with pytest.raises(ValueError, match="larger than a TPU's SMEM holds even in 1024-tiles"):
                tpu_tiles(BlockSizes(block, block), T, T, batch)
            continue
        tq, tkv = tpu_tiles(BlockSizes(block, block), T, T, batch)
        assert tq % 128 == 0 and tq % block == 0 and tkv % block == 0 and tq <= MAX_TILE
        assert batch * -(-T // tq) * -(-T // tkv) * 4 <= SMEM_LIST_BYTES
        assert tq == 512 or T * batch > 131072  # the default tile until the lists outgrow SMEM


def test_float32_at_head_dim_256_keeps_512_tiles_and_is_refused_sooner():
    """1024-square tiles of float32 x 256 overflow the VMEM a kernel may scope on v5e / v5p (measured)."""
    assert tpu_tiles(BlockSizes(128, 128), 262144, 262144, 1, row_bytes=128 * 2) == (1024, 1024)
    with pytest.raises(ValueError, match="even in 512-tiles"):
        tpu_tiles(BlockSizes(128, 128), 262144, 262144, 1, row_bytes=256 * 4)


def test_a_document_mask_is_exact_at_tile_boundaries():
    """Documents whose edges fall inside and on tile edges (129, 255, 256) with the kernel's coarse PARTIAL tiles."""
    ids = np.zeros((1, 400), np.int32)
    for edge in (129, 255, 256, 300):
        ids[:, edge:] += 1
    check(functools.partial(lambda ids: causal() & document(ids), ids), *qkv(1, 2, 2, 400, 400, 16))
