"""Block-sparse attention, the Pallas kernels (interpret mode on CPU) and the XLA paths (the dispatcher, its scan and
its tiled path), against the dense pallas_kernels.reference_attention: forward, gradients, every mask, GQA/MQA,
T != S, padding, score mods, bf16; the tiled path's cover of the block mask."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pallas_kernels import (
    EMPTY,
    FULL,
    PARTIAL,
    BlockSizes,
    alibi,
    alibi_slopes,
    block_sparse_attention,
    block_sparse_attention_xla,
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
    tiled_attention_xla,
)
from pallas_kernels import xla_tiled_attention as tiled
from pallas_kernels.xla_attention import block_sparse_attention_scan, uses_tiled_path

IMPLS = {
    "xla": block_sparse_attention_xla,  # host block masks: the tiled path
    "scan": block_sparse_attention_scan,
    "tiled": tiled_attention_xla,
    "pallas": block_sparse_attention,
}
impls = pytest.mark.parametrize("impl", ["xla", "pallas"])
with_scan = pytest.mark.parametrize("impl", ["xla", "scan", "pallas"])  # host masks: xla runs the tiled path


def qkv(B=1, Hq=2, Hkv=2, T=64, S=None, D=16, dtype=jnp.float32, seed=0):
    S = T if S is None else S
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(B, Hq, T, D)), dtype)
    k = jnp.asarray(r.normal(size=(B, Hkv, S, D)), dtype)
    v = jnp.asarray(r.normal(size=(B, Hkv, S, D)), dtype)
    return q, k, v


def segments(B, T, seed=0):
    r = np.random.default_rng(seed)
    return np.sort(r.integers(0, 4, size=(B, T)), axis=1).astype(np.int32)


def check_forward(impl, q, k, v, mask, block_sizes, atol=1e-5, impl_kw=None, **kw):
    bm = make_block_mask(mask, q.shape[2], k.shape[2], block_sizes)
    out, lse = jax.jit(functools.partial(IMPLS[impl], block_mask=bm, **kw, **(impl_kw or {})))(q, k, v)
    # the reference in float32 on the same (possibly bf16) inputs: the target is the exact result, not its rounding
    ref_out, ref_lse = reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)), mask, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, atol=atol, rtol=atol)
    np.testing.assert_allclose(lse, ref_lse, atol=atol, rtol=atol)


def grads(fn, q, k, v, w, out_dtype=None):
    """d/d(q, k, v) of a loss that reads both outputs, so the lse cotangent path is exercised too.

    ``out_dtype`` rounds the output (and so the incoming cotangent) as a bf16 implementation's would be, so that a
    float32 reference and a bf16 kernel are compared on the same cotangent."""

    def f(q, k, v):
        out, lse = fn(q, k, v)
        out = out if out_dtype is None else out.astype(out_dtype)
        return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(jnp.sin(lse))

    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)


def check_gradients(impl, q, k, v, mask, block_sizes, tols=(1e-4, 1e-4, 1e-4), impl_kw=None, **kw):
    bm = make_block_mask(mask, q.shape[2], k.shape[2], block_sizes)
    w = jnp.asarray(np.random.default_rng(4).normal(size=q.shape), jnp.float32)
    got = grads(functools.partial(IMPLS[impl], block_mask=bm, **kw, **(impl_kw or {})), q, k, v, w)
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    want = grads(functools.partial(reference_attention, mask=mask, **kw), *up, w, out_dtype=q.dtype)
    for name, g, r, tol, x in zip("qkv", got, want, tols, (q, k, v)):
        assert g.dtype == x.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), r, atol=tol, rtol=tol, err_msg=f"d{name}")


@impls
@pytest.mark.parametrize(
    "mask,block_sizes",
    [
        (causal(), BlockSizes(16, 16)),
        (causal(), BlockSizes(32, 16)),
        (sliding_window(20), BlockSizes(16, 16)),
        (sliding_window(1), BlockSizes(16, 32)),
        (chunked_causal(24), BlockSizes(16, 16)),
        (prefix_lm(40), BlockSizes(16, 32)),
        (global_tokens(8) | sliding_window(16), BlockSizes(16, 16)),
        (causal() & (global_tokens(4) | sliding_window(16)), BlockSizes(32, 32)),
        (full(), BlockSizes(32, 16)),
    ],
    ids=repr,
)
def test_forward_matches_reference(impl, mask, block_sizes):
    check_forward(impl, *qkv(B=2, T=128), mask, block_sizes)


@impls
def test_document_mask_batched(impl):
    B, T = 2, 128
    seg = segments(B, T)
    mask = causal() & document(seg)
    bm = make_block_mask(mask, T, T, BlockSizes(16, 16))
    assert bm.batch_shape == (B,)
    check_forward(impl, *qkv(B=B, T=T), mask, BlockSizes(16, 16))
    check_forward(impl, *qkv(B=B, T=T), document(seg) | global_tokens(3), BlockSizes(32, 16))


@impls
@pytest.mark.parametrize("Hkv", [2, 1], ids=["gqa", "mqa"])
def test_gqa_and_mqa(impl, Hkv):
    check_forward(impl, *qkv(B=2, Hq=4, Hkv=Hkv, T=64), causal(), BlockSizes(16, 16))
    check_gradients(
        impl, *qkv(B=2, Hq=4, Hkv=Hkv, T=64), causal() & document(segments(2, 64, seed=1)), BlockSizes(16, 32)
    )


@impls
@pytest.mark.parametrize("mask", [prefix_lm(16), full(), global_tokens(2)], ids=repr)
def test_non_square(impl, mask):
    check_forward(impl, *qkv(B=2, T=64, S=128), mask, BlockSizes(16, 32))
    check_forward(impl, *qkv(B=2, T=128, S=64), mask, BlockSizes(32, 16))


@with_scan
def test_lengths_not_multiples_of_blocks_are_padded(impl):
    T, S = 50, 37
    check_forward(impl, *qkv(B=2, Hq=2, Hkv=1, T=T, S=S), prefix_lm(5), BlockSizes(16, 16))
    check_gradients(impl, *qkv(B=2, Hq=2, Hkv=1, T=T), causal() & document(segments(2, T, seed=5)), BlockSizes(16, 32))


def test_the_model_layout_equals_the_kernels_own():
    """layout="BTHE" (q [B, T, H, E], k/v [B, S, K, E], out [B, T, H, E]: the model's, which the Mosaic GPU kernels
    read as it is) through the Triton kernels in the interpreter, which transpose it: the same out, lse and
    gradients as the [B, H, T, E] call, at a padded length with GQA; an unknown layout is refused in one line."""
    T = 50
    mask = causal() & document(segments(2, T, seed=5))
    bm = make_block_mask(mask, T, T, BlockSizes(16, 16))
    q, k, v = qkv(B=2, Hq=4, Hkv=2, T=T)
    w = jnp.asarray(np.random.default_rng(4).normal(size=q.shape), jnp.float32)

    def heads_second(q, k, v):
        return block_sparse_attention(q, k, v, bm)

    def model_layout(q, k, v):
        out, lse = block_sparse_attention(*(x.swapaxes(1, 2) for x in (q, k, v)), bm, layout="BTHE")
        assert out.shape == (2, T, 4, 16)
        return out.swapaxes(1, 2), lse

    for got, want in zip(model_layout(q, k, v), heads_second(q, k, v)):
        np.testing.assert_allclose(got, want, atol=1e-6)
    for got, want in zip(grads(model_layout, q, k, v, w), grads(heads_second, q, k, v, w)):
        np.testing.assert_allclose(got, want, atol=1e-6)
    with pytest.raises(ValueError, match="block_sparse_attention: unknown layout 'BSHD'"):
        block_sparse_attention(q, k, v, bm, layout="BSHD")


@impls
def test_score_mods(impl):
    check_forward(impl, *qkv(B=2, T=64), causal(), BlockSizes(16, 16), score_mod=soft_cap(2.0))
    check_forward(
        impl,
        *qkv(B=1, Hq=4, Hkv=2, T=64),
        sliding_window(24),
        BlockSizes(16, 16),
        score_mod=alibi(alibi_slopes(4)),
        scale=0.3,
    )
    check_gradients(impl, *qkv(B=1, Hq=4, Hkv=2, T=64), causal(), BlockSizes(16, 16), score_mod=alibi(alibi_slopes(4)))
    check_gradients(impl, *qkv(B=1, T=64), sliding_window(24), BlockSizes(16, 16), score_mod=soft_cap(1.5))


@with_scan
@pytest.mark.parametrize("doc", [False, True], ids=["causal", "document"])
def test_gradients_match_reference(impl, doc):
    B, T = 2, 64
    mask = causal() & document(segments(B, T, seed=2)) if doc else causal()
    check_gradients(impl, *qkv(B=B, Hq=4, Hkv=2, T=T, seed=3), mask, BlockSizes(16, 16))


@pytest.mark.parametrize(
    "mask", [causal(), causal() & document(segments(2, 90, seed=9)), sliding_window(20) | global_tokens(3)], ids=repr
)
def test_kernel_tiles_smaller_than_blocks(mask):
    """The GPU walks a block in tiles that fit its shared memory: the block mask stays 32x32, every kernel runs on
    16x8 / 8x16 tiles (partial and full blocks, padded tails, GQA) and the result is the same."""
    from pallas_kernels.gpu_tiles import KernelTiles, PassTiles

    tiles = KernelTiles(PassTiles(16, 8), PassTiles(8, 16), PassTiles(16, 8))
    q, k, v = qkv(B=2, Hq=4, Hkv=2, T=90, seed=10)
    check_forward("pallas", q, k, v, mask, BlockSizes(32, 32), impl_kw={"tiles": tiles})
    check_gradients("pallas", q, k, v, mask, BlockSizes(32, 32), impl_kw={"tiles": tiles})


def test_kernel_tiles_must_divide_the_blocks():
    from pallas_kernels.gpu_tiles import KernelTiles, PassTiles

    q, k, v = qkv(T=64)
    bm = make_block_mask(causal(), 64, 64, BlockSizes(32, 32))
    tiles = KernelTiles(PassTiles(32, 32), PassTiles(32, 32), PassTiles(32, 24))
    with pytest.raises(ValueError, match="dkv tiles 32x24 must divide the blocks 32x32"):
        block_sparse_attention(q, k, v, bm, tiles=tiles)


def test_gpu_tiles_follow_head_dim_and_dtype():
    from pallas_kernels.gpu_tiles import kernel_tiles

    small = kernel_tiles("gpu", 64, jnp.bfloat16, BlockSizes(128, 128))
    big = kernel_tiles("gpu", 256, jnp.float32, BlockSizes(128, 128))
    assert small.forward.rows * small.forward.loop > big.forward.rows * big.forward.loop
    assert kernel_tiles("gpu", 128, jnp.bfloat16, BlockSizes(32, 96)).dkv.rows in (32, 16, 8)  # divides 96
    assert kernel_tiles("interpret", 256, jnp.float32, BlockSizes(64, 32)).dkv.rows == 32  # interpret: the blocks
    with pytest.raises(ValueError, match="head dim 512"):
        kernel_tiles("gpu", 512, jnp.bfloat16, BlockSizes())


@impls
def test_bfloat16_targets(impl):
    """bf16 in, float32 accumulation: forward <= 3e-3, dv <= 4e-3, dq/dk <= 5e-2 from the float32 reference."""
    q, k, v = qkv(B=2, Hq=4, Hkv=2, T=128, D=32, dtype=jnp.bfloat16, seed=7)
    mask = causal() & document(segments(2, 128, seed=8))
    check_forward(impl, q, k, v, mask, BlockSizes(32, 32), atol=3e-3)
    check_gradients(impl, q, k, v, mask, BlockSizes(32, 32), tols=(5e-2, 5e-2, 4e-3))


@pytest.mark.parametrize("impl", ["xla", "pallas"])  # xla: a traced block mask takes the scan
def test_traced_document_mask_under_jit(impl):
    """Segment ids arriving as a traced batch: the block mask is built on device, results unchanged."""
    B, T = 2, 96
    q, k, v = qkv(B=B, Hq=2, Hkv=1, T=T, seed=9)
    seg = segments(B, T, seed=10)

    @jax.jit
    def run(q, k, v, seg):
        bm = make_block_mask(causal() & document(seg), T, T, BlockSizes(32, 32))
        assert bm.is_traced
        return IMPLS[impl](q, k, v, bm)

    out, lse = run(q, k, v, jnp.asarray(seg))
    ref_out, ref_lse = reference_attention(q, k, v, causal() & document(seg))
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-5, rtol=1e-5)


_BASE = st.sampled_from(
    [
        causal(),
        full(),
        sliding_window(1),
        sliding_window(17),
        chunked_causal(16),
        chunked_causal(9),
        prefix_lm(0),
        prefix_lm(20),
        global_tokens(0),
        global_tokens(5),
    ]
)


def _draw_mask(a, b, op, doc, B, T, seed):
    mask = a & b if op == "&" else a | b if op == "|" else a
    return mask & document(segments(B, T, seed=seed)) if doc else mask


@contextlib.contextmanager
def _fine_pieces_if(fine: bool):
    """The tiled path with pieces as fine as they go (see ``fine_pieces``), inside a hypothesis example."""
    with pytest.MonkeyPatch.context() as mp:
        if fine:
            mp.setattr(tiled, "PIECE_COST", 0)
            mp.setattr(tiled, "MAX_SIDE", 32)
            mp.setattr(tiled, "STRIPS_MAX_LEN", 0)  # the quadtree; "xla" runs these short sequences as strips
        yield


def _assume_no_empty_rows(mask, T, S, bs):
    try:
        make_block_mask(mask, T, S, bs)
    except ValueError as e:
        assume("attends to no key" not in str(e))
        raise


@settings(max_examples=6, deadline=None)  # each example compiles anew; the parametrized tests cover every mask
@given(
    impl=st.sampled_from(list(IMPLS)),
    a=_BASE,
    b=_BASE,
    op=st.sampled_from(["&", "|", "a"]),
    bq=st.sampled_from([8, 16, 32]),
    bkv=st.sampled_from([8, 16, 32]),
    T=st.integers(20, 64),
    doc=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_forward(impl, a, b, op, bq, bkv, T, doc, seed):
    mask = _draw_mask(a, b, op, doc, 2, T, seed)
    _assume_no_empty_rows(mask, T, T, BlockSizes(bq, bkv))
    with _fine_pieces_if(impl == "tiled"):
        check_forward(impl, *qkv(B=2, Hq=2, Hkv=1, T=T, seed=seed), mask, BlockSizes(bq, bkv))


@settings(max_examples=4, deadline=None)  # each example compiles a forward and backward anew
@given(
    impl=st.sampled_from(list(IMPLS)),
    a=_BASE,
    b=_BASE,
    op=st.sampled_from(["&", "|", "a"]),
    bq=st.sampled_from([8, 16]),
    bkv=st.sampled_from([8, 16]),
    T=st.integers(16, 48),
    Hkv=st.sampled_from([1, 2]),
    doc=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_gradients(impl, a, b, op, bq, bkv, T, Hkv, doc, seed):
    mask = _draw_mask(a, b, op, doc, 1, T, seed)
    _assume_no_empty_rows(mask, T, T, BlockSizes(bq, bkv))
    with _fine_pieces_if(impl == "tiled"):
        check_gradients(impl, *qkv(B=1, Hq=2, Hkv=Hkv, T=T, seed=seed), mask, BlockSizes(bq, bkv))


# ----------------------------------------------------------------------------- the tiled path


@pytest.fixture
def fine_pieces(monkeypatch):
    """Small shapes with the tiled path's pieces as fine as they go: no per-piece cost in its cost model (so it splits
    every mixed square down to single masked tiles) and squares of at most 4 blocks of 16; the quadtree even where
    the sequence is short enough for strips."""
    monkeypatch.setattr(tiled, "PIECE_COST", 0)
    monkeypatch.setattr(tiled, "MAX_SIDE", 64)
    monkeypatch.setattr(tiled, "STRIPS_MAX_LEN", 0)


def _covers(plan):
    """[nq, nkv] count of pieces over each tile, and of unmasked pieces."""
    count = np.zeros((plan.num_q_blocks, plan.num_kv_blocks), int)
    unmasked = np.zeros_like(count)
    for g in plan.groups:
        for r, c in zip(g.q_starts, g.kv_starts):
            assert 0 <= r <= plan.num_q_blocks - g.rows and 0 <= c <= plan.num_kv_blocks - g.cols
            count[r : r + g.rows, c : c + g.cols] += 1
            unmasked[r : r + g.rows, c : c + g.cols] += not g.masked
    return count, unmasked


def _random_kinds(nq, nkv, p_empty, seed):
    """A [nq, nkv] block grid: EMPTY with probability p_empty, else PARTIAL or FULL."""
    r = np.random.default_rng(seed)
    return np.where(r.random((nq, nkv)) < p_empty, EMPTY, r.choice([PARTIAL, FULL], size=(nq, nkv))).astype(np.int8)


@settings(max_examples=40, deadline=None)  # host-side only: no compiling
@given(
    nq=st.integers(1, 13),
    nkv=st.integers(1, 13),
    p_empty=st.floats(0, 1),
    piece_cost=st.sampled_from([0, 256, 16384]),
    max_side=st.sampled_from([16, 64, 2048]),
    seed=st.integers(0, 2**16),
)
def test_tiled_plan_covers_every_live_tile_once(nq, nkv, p_empty, piece_cost, max_side, seed):
    kind = _random_kinds(nq, nkv, p_empty, seed)
    count, unmasked = _covers(tiled._plan(kind.tobytes(), kind.shape, 16, 16, max_side, (piece_cost, 1.6)))
    assert np.all(count[kind != EMPTY] == 1)  # every live tile computed exactly once
    assert np.all(count <= 1) and np.all(kind[unmasked > 0] == FULL)  # no element mask only on FULL tiles


@settings(max_examples=40, deadline=None)  # host-side only: no compiling
@given(
    nq=st.integers(1, 13),
    nkv=st.integers(1, 13),
    p_empty=st.floats(0, 1),
    seed=st.integers(0, 2**16),
)
def test_strips_cover_every_live_tile_once_with_one_piece_per_q_block(nq, nkv, p_empty, seed):
    kind = _random_kinds(nq, nkv, p_empty, seed)
    plan = tiled._strips(kind.tobytes(), kind.shape)
    count, unmasked = _covers(plan)
    assert np.all(count[kind != EMPTY] == 1) and np.all(count <= 1)
    assert np.all(kind[unmasked > 0] == FULL)
    assert all(g.rows == 1 for g in plan.groups)
    rows = [r for g in plan.groups for r in g.q_starts]
    assert sorted(rows) == [i for i in range(nq) if (kind[i] != EMPTY).any()]  # every live q block, once
    assert plan.computed_blocks() == sum(np.ptp(np.flatnonzero(k != EMPTY)) + 1 for k in kind if (k != EMPTY).any())


def test_short_sequences_are_planned_as_strips():
    plan = tiled.plan_block_mask(make_block_mask(causal(), 256, 256, BlockSizes(64, 64)))
    assert [(g.cols, g.masked, g.q_starts, g.kv_starts) for g in plan.groups] == [
        (w, True, (w - 1,), (0,)) for w in (1, 2, 3, 4)
    ]
    plan = tiled.plan_block_mask(make_block_mask(causal(), 512, 512, BlockSizes(64, 64)))
    assert max(g.rows for g in plan.groups) > 1  # past STRIPS_MAX_LEN: the quadtree


@pytest.mark.parametrize(
    "mask",
    [causal(), sliding_window(40), prefix_lm(40), causal() & (global_tokens(8) | sliding_window(20))],
    ids=repr,
)
def test_strips_forward_and_gradients_match_reference(mask):
    """96 = 6 q blocks of 16, strips of 1 to 6 blocks; the last mask leaves EMPTY tiles inside some strips."""
    q, k, v = qkv(B=2, Hq=4, Hkv=2, T=96, seed=17)
    plan = tiled.plan_block_mask(make_block_mask(mask, 96, 96, BlockSizes(16, 16)))
    assert all(g.rows == 1 for g in plan.groups)
    check_forward("tiled", q, k, v, mask, BlockSizes(16, 16))
    check_gradients("tiled", q, k, v, mask, BlockSizes(16, 16))


@pytest.mark.parametrize("strips", [True, False], ids=["strips", "quadtree"])
def test_kept_probabilities_give_the_recomputed_gradients(strips, monkeypatch):
    """Up to KEEP_PROBS_MAX_LEN the backward rescales the forward's probability tiles instead of recomputing them;
    the gradients (the lse cotangent's too) equal the recomputing backward's and the reference's."""
    if not strips:
        monkeypatch.setattr(tiled, "STRIPS_MAX_LEN", 0)
    mask = causal() & (global_tokens(8) | sliding_window(40))
    q, k, v = qkv(B=2, Hq=4, Hkv=2, T=96, seed=23)
    bm = make_block_mask(mask, 96, 96, BlockSizes(16, 16))
    w = jnp.asarray(np.random.default_rng(5).normal(size=q.shape), jnp.float32)
    fn = functools.partial(tiled.tiled_attention_xla, block_mask=bm)
    kept = grads(fn, q, k, v, w)
    monkeypatch.setattr(tiled, "KEEP_PROBS_MAX_LEN", 0)
    recomputed = grads(fn, q, k, v, w)
    want = grads(functools.partial(reference_attention, mask=mask), q, k, v, w)
    for g, r, x in zip(kept, recomputed, want):
        np.testing.assert_allclose(g, r, atol=2e-6, rtol=2e-6)
        np.testing.assert_allclose(g, x, atol=1e-4, rtol=1e-4)


def test_tiled_plan_for_causal_is_a_few_large_unmasked_squares():
    bm = make_block_mask(causal(), 8192, 8192, BlockSizes(128, 128))
    plan = tiled.plan_block_mask(bm)
    count, unmasked = _covers(plan)
    assert np.all(count[bm.kind != EMPTY] == 1)
    assert len(plan.groups) <= 6  # one batched product per shape
    assert max(g.rows for g in plan.groups if not g.masked) * 128 == tiled.MAX_SIDE
    masked = [g for g in plan.groups if g.masked]
    assert all(r == c for g in masked for r, c in zip(g.q_starts, g.kv_starts))  # the diagonal only
    assert plan.computed_blocks() <= 1.02 * int(np.count_nonzero(bm.kind))
    assert int(unmasked.sum()) >= 0.9 * plan.computed_blocks()


@pytest.mark.parametrize(
    "mask",
    [
        causal(),
        sliding_window(40),
        prefix_lm(40),
        chunked_causal(40),
        causal() & (global_tokens(20) | sliding_window(36)),
    ],
    ids=repr,
)
def test_tiled_forward_and_gradients_match_reference(mask, fine_pieces):
    """96 = 6 blocks of 16: pieces of 1, 2 and 4 blocks, clipped at the grid's edge; B=2, GQA."""
    q, k, v = qkv(B=2, Hq=4, Hkv=2, T=96, seed=11)
    plan = tiled.plan_block_mask(make_block_mask(mask, 96, 96, BlockSizes(16, 16)))
    assert len(plan.groups) >= 2
    check_forward("tiled", q, k, v, mask, BlockSizes(16, 16))
    check_gradients("tiled", q, k, v, mask, BlockSizes(16, 16))


def test_tiled_padding_non_square_score_mods_and_documents(fine_pieces):
    check_gradients("tiled", *qkv(B=2, Hq=2, Hkv=1, T=50, S=37), prefix_lm(5), BlockSizes(16, 8))
    check_forward("tiled", *qkv(B=1, T=40, S=72), causal() | global_tokens(3), BlockSizes(8, 16))
    check_gradients(
        "tiled", *qkv(B=1, Hq=4, Hkv=2, T=64), causal(), BlockSizes(16, 16), score_mod=alibi(alibi_slopes(4))
    )
    check_forward("tiled", *qkv(B=2, T=64), sliding_window(24), BlockSizes(16, 16), score_mod=soft_cap(1.5))
    mask = causal() & document(segments(2, 80, seed=12))  # host ids, different per row: the union is planned
    bm = make_block_mask(mask, 80, 80, BlockSizes(16, 16))
    assert bm.batch_shape == (2,) and uses_tiled_path(bm)
    check_gradients("tiled", *qkv(B=2, Hq=2, Hkv=1, T=80, seed=13), mask, BlockSizes(16, 16))


def test_xla_dispatch_takes_the_tiled_path_for_host_block_masks():
    q = jnp.zeros((2, 2, 64, 8))

    def scans(bm):
        return "scan" in str(jax.make_jaxpr(lambda q: block_sparse_attention_xla(q, q, q, bm))(q))

    assert not scans(make_block_mask(causal(), 64, 64, BlockSizes(16, 16)))
    mask = causal() & document(np.array([[0] * 32 + [1] * 32, [0] * 64]))
    assert not scans(make_block_mask(mask, 64, 64, BlockSizes(16, 16)))  # per-batch host ids: union planned

    @jax.jit
    def traced(q, seg):
        bm = make_block_mask(causal() & document(seg), 64, 64, BlockSizes(16, 16))
        assert not uses_tiled_path(bm)
        return block_sparse_attention_xla(q, q, q, bm)[0]

    assert "scan" in str(jax.make_jaxpr(traced)(q, jnp.zeros((2, 64), jnp.int32)))


def _has_dense(hlo_text):
    return "4096x4096" in hlo_text or "4096,4096" in hlo_text  # StableHLO / HLO shape spellings


@pytest.mark.parametrize("impl", ["xla", "scan"])
@pytest.mark.parametrize("mask", [sliding_window(128), causal()], ids=repr)
def test_no_dense_score_matrix_for_long_sequences(impl, mask):
    T, D = 4096, 16
    bm = make_block_mask(mask, T, T, BlockSizes(128, 128))
    x = jax.ShapeDtypeStruct((1, 1, T, D), jnp.float32)
    f = functools.partial(IMPLS[impl], block_mask=bm)
    assert _has_dense(
        jax.jit(functools.partial(reference_attention, mask=mask)).lower(x, x, x).as_text()
    )  # the check itself sees a dense matrix
    assert not _has_dense(jax.jit(f).lower(x, x, x).as_text())
    grad_hlo = jax.jit(jax.grad(lambda q, k, v: f(q, k, v)[0].sum(), argnums=(0, 1, 2))).lower(x, x, x).as_text()
    assert not _has_dense(grad_hlo)
