"""Block-sparse flash attention in plain XLA, for CPU training and as a fallback.

``block_sparse_attention_xla`` picks one of two algorithms. A block mask known on the host (static masks, numpy
segment ids) takes ``xla_tiled_attention``: its non-empty tiles as a few large products, 1.3-1.9x faster than the
dense reference for causal masks on a 2-core CPU where this scan was 0.4-0.9x (docs/results/bench_attention.md). A
traced block mask (``document`` with segment ids from the batch, inside ``jit``) takes the scan below, the Pallas
kernels' algorithm, whose lists are sized on device.

Forward: every q block (all of them at once, vectorized with every head) scans j over ``range(max_kv)`` and visits
kv block ``kv_block_indices[qb, j]`` only: steps with j >= ``kv_block_counts[qb]`` are masked out, and the element
mask is applied only to the PARTIAL entries (the first ``kv_partial_counts[qb]``). Running max / sum / accumulator
stay in float32 (the flash-attention recurrences), so memory is O(T * block_kv) per head, never O(T * S).

Backward (``jax.custom_vjp``, FlashAttention-2 style): probabilities are recomputed from the saved log-sum-exp; dQ
scans the same kv lists, dK/dV scan the transposed q lists. Both only gather: autodiff of the forward scan would
store every step's probabilities and scatter-add dK/dV over every visiting q block. A score mod's captured arrays
(``score_tables``) are differentiable inputs; the dQ scan, which visits every live tile once, sums their gradient.

Sequences that are not whole blocks are padded; padded keys are masked, padded queries dropped.

Shape suffixes follow the legend in docs/architecture.md, plus: Q queries of a q block (block_q), W keys of a kv
block (block_kv), J slots of a block list (one per scan step), O every block of the other axis (kv blocks in the
forward and dQ, q blocks in dK/dV) before a step gathers from it. N counts the blocks a pass computes: q blocks,
or kv blocks in dK/dV.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .block_mask import EMPTY, BlockMask
from .kernel_inputs import AttentionStatic, check_attention_inputs, list_arrays, pad_axis, segment_arrays
from .kernel_mask import split_documents
from .masks import ScoreMod
from .score_tables import bind_shapes, split_arrays
from .xla_tiled_attention import mod_array_grads, plan_block_mask, tiled_attention_xla

#: The tiled path computes whole pieces of the union of a per-batch block mask; past this multiple of the blocks one
#: batch element needs, the scan's exact lists win (the tiled path's FLOPs run ~2x faster, measured on CPU).
TILED_MAX_OVERCOMPUTE = 2.0


@dataclasses.dataclass(frozen=True)
class _Static(AttentionStatic):
    groups: int  # query heads per kv head


def block_sparse_attention_xla(
    q, k, v, block_mask: BlockMask, *, scale: float | None = None, score_mod: ScoreMod | None = None
):
    """Attention over the non-empty tiles of ``block_mask`` only; differentiable.

    q [B, H, T, E], k/v [B, K, S, E] (K divides H); ``block_mask`` from ``make_block_mask(mask, T, S, ...)``.
    Returns (out [B, H, T, E] in q.dtype, lse [B, H, T] float32), equal to
    ``reference_attention(q, k, v, block_mask.mask, ...)``. Host block masks take ``tiled_attention_xla``, traced ones
    (and per-batch ones whose union would compute too much) ``block_sparse_attention_scan``. Arrays a ``score_mod``
    captures (``score_tables``: a relative-bias table, learned slopes) get gradients too.
    """
    check_attention_inputs("block_sparse_attention_xla", q, k, v, block_mask)
    fn = tiled_attention_xla if uses_tiled_path(block_mask) else block_sparse_attention_scan
    return fn(q, k, v, block_mask, scale=scale, score_mod=score_mod)


def uses_tiled_path(block_mask: BlockMask) -> bool:
    """Whether ``block_sparse_attention_xla`` runs ``block_mask`` as large tiles (else it scans block lists)."""
    if block_mask.is_traced:
        return False
    live = np.count_nonzero(np.asarray(block_mask.kind) != EMPTY) / max(1, math.prod(block_mask.batch_shape))
    return plan_block_mask(block_mask).computed_blocks() <= TILED_MAX_OVERCOMPUTE * max(1.0, live)


def block_sparse_attention_scan(
    q, k, v, block_mask: BlockMask, *, scale: float | None = None, score_mod: ScoreMod | None = None
):
    """``block_sparse_attention_xla``'s scan algorithm, whatever the block mask (signature and results the same)."""
    check_attention_inputs("block_sparse_attention_xla", q, k, v, block_mask)
    B, H, T, E = q.shape
    _, K, S, _ = k.shape
    template, docs = split_documents(block_mask.mask)

    mask_arrays = tuple(jnp.broadcast_to(a, (B, *a.shape[1:])) for a in list_arrays(block_mask))
    doc_arrays = [
        jnp.broadcast_to(ids, (B, ids.shape[1]))
        for pair in segment_arrays("block_sparse_attention_xla", docs, block_mask, B)
        for ids in pair
    ]
    score_mod, mod_arrays = split_arrays("block_sparse_attention_xla", score_mod, H)
    static = _Static(**AttentionStatic.shared(template, score_mod, scale, block_mask, E), groups=H // K)
    qp = pad_axis(q, 2, block_mask.padded_q_len)
    kp, vp = (pad_axis(x, 2, block_mask.padded_kv_len) for x in (k, v))
    out, lse = _attention(static, qp, kp, vp, mask_arrays, tuple(doc_arrays), mod_arrays)
    return out[:, :, :T], lse[:, :, :T]


# ----------------------------------------------------------------------------- custom_vjp


# mod_arrays: the score mod's arrays [H, n] float32 (``split_arrays``), shared by the batch (vmap's in_axes None).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q, k, v, mask_arrays, doc_arrays, mod_arrays):
    in_axes = (0,) * 5 + (None,)
    return jax.vmap(functools.partial(_forward, static), in_axes)(q, k, v, mask_arrays, doc_arrays, mod_arrays)


def _attention_fwd(static, q, k, v, mask_arrays, doc_arrays, mod_arrays):
    out, lse = _attention(static, q, k, v, mask_arrays, doc_arrays, mod_arrays)
    return (out, lse), (q, k, v, out, lse, mask_arrays, doc_arrays, mod_arrays)


def _attention_bwd(static, residuals, cotangents):
    q, k, v, out, lse, mask_arrays, doc_arrays, mod_arrays = residuals
    d_out, d_lse = cotangents
    # d lse / d s = p, so a cotangent on lse enters ds = p * (dp - delta) as -d_lse in delta.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - d_lse
    args = (q, k, v, d_out, lse, delta, mask_arrays, doc_arrays, mod_arrays)
    in_axes = (0,) * 8 + (None,)
    dq, d_mod_arrays = jax.vmap(functools.partial(_dq, static), in_axes)(*args)
    dk, dv = jax.vmap(functools.partial(_dkv, static), in_axes)(*args)
    d_mod_arrays = tuple(d.sum(0) for d in d_mod_arrays)  # [B, H, n]: every batch element's tiles
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, d_mod_arrays


_attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------- one batch element


def _q_blocks(static, x_HTE):
    H, T, E = x_HTE.shape
    K, G, bq = H // static.groups, static.groups, static.block_q
    return x_HTE.astype(jnp.float32).reshape(K, G, T // bq, bq, E).transpose(2, 0, 1, 3, 4)


def _q_rows(static, x_HT):
    H, T = x_HT.shape
    K, G, bq = H // static.groups, static.groups, static.block_q
    return x_HT.reshape(K, G, T // bq, bq).transpose(2, 0, 1, 3)


def _kv_blocks(static, x_KSE):
    K, S, E = x_KSE.shape
    return x_KSE.astype(jnp.float32).reshape(K, S // static.block_kv, static.block_kv, E).transpose(1, 0, 2, 3)


def _raw_scores(static, q_NKGQE, k_NKWE):
    """Scaled scores [N, K, G, Q, W] before the score mod (what the mod's array gradient is taken at)."""
    return jnp.einsum("nkgqe,nkwe->nkgqw", q_NKGQE, k_NKWE) * static.scale


def _coords(s_NKGQW, q_pos_NQ1, kv_pos_N1W):
    """(q positions, kv positions, query head), each broadcasting against the scores [N, K, G, Q, W]."""
    K, G = s_NKGQW.shape[1], s_NKGQW.shape[2]
    head = jnp.arange(K * G, dtype=jnp.int32).reshape(1, K, G, 1, 1)
    return q_pos_NQ1[:, None, None], kv_pos_N1W[:, None, None], head


def _scores(static, s, q_pos_NQ1, kv_pos_N1W, live, masked, doc_tiles, mod_arrays=(), with_grad=False):
    """Raw scores [N, K, G, Q, W] -> score-modded, -inf outside the mask; optionally d mod / d s."""
    arrays = bind_shapes(static.score_mod, mod_arrays) if mod_arrays else ()
    s, d_mod = static.mod_scores(s, *_coords(s, q_pos_NQ1, kv_pos_N1W), with_grad, arrays)
    elem = static.keep(doc_tiles, q_pos_NQ1, kv_pos_N1W)
    keep = live[:, None, None] & (~masked[:, None, None] | elem)  # [N, Q, W]
    return jnp.where(keep[:, None, None], s, -jnp.inf), d_mod


def _doc_tiles(doc_arrays, q_pos_NQ1, kv_pos_N1W):
    return [(q_ids[q_pos_NQ1], kv_ids[kv_pos_N1W]) for q_ids, kv_ids in zip(doc_arrays[0::2], doc_arrays[1::2])]


def _entries(idx_NJ, np_N, cnt_N):
    """Scan inputs, one list entry per step: block indices [J, N], live (a real entry) and masked (a PARTIAL entry,
    needing the element mask) [J, N]. Batching several entries per step (wider tiles) measured slower on CPU."""
    j_J1 = jnp.arange(idx_NJ.shape[1], dtype=jnp.int32)[:, None]
    return idx_NJ.T, j_J1 < cnt_N[None], j_J1 < np_N[None]


def _positions(blocks_N, block):
    return blocks_N[:, None] * block + jnp.arange(block, dtype=jnp.int32)  # [N, block]


def _forward(static, q_HTE, k_KSE, v_KSE, mask_arrays, doc_arrays, mod_arrays):
    H, T, E = q_HTE.shape
    bq, bkv = static.block_q, static.block_kv
    xs = _entries(*mask_arrays[:3])
    q_NKGQE = _q_blocks(static, q_HTE)
    k_OKWE, v_OKWE = _kv_blocks(static, k_KSE), _kv_blocks(static, v_KSE)
    q_pos_NQ1 = jnp.arange(T, dtype=jnp.int32).reshape(-1, bq, 1)

    def step(carry, xs):
        m_prev, l_prev, acc_prev = carry  # [N, K, G, Q], same, [N, K, G, Q, E]
        blocks_N, live_N, masked_N = xs
        kv_pos_N1W = _positions(blocks_N, bkv)[:, None, :]
        s, _ = _scores(
            static,
            _raw_scores(static, q_NKGQE, k_OKWE[blocks_N]),
            q_pos_NQ1,
            kv_pos_N1W,
            live_N,
            masked_N,
            _doc_tiles(doc_arrays, q_pos_NQ1, kv_pos_N1W),
            mod_arrays,
        )
        m_new = jnp.maximum(m_prev, s.max(-1))
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # a row with nothing seen yet
        alpha = jnp.exp(m_prev - m_safe)
        p = jnp.exp(s - m_safe[..., None])
        l_new = alpha * l_prev + p.sum(-1)
        acc_new = alpha[..., None] * acc_prev + jnp.einsum("nkgqw,nkwe->nkgqe", p, v_OKWE[blocks_N])
        return (m_new, l_new, acc_new), None

    # carries built from q, so that under a user's shard_map they vary over the same mesh axes as the outputs
    acc0 = jnp.zeros_like(q_NKGQE)
    (m, l, acc), _ = lax.scan(step, (acc0[..., 0] - jnp.inf, acc0[..., 0], acc0), xs)
    seen = l > 0  # False only on padding rows (and rows a traced mask leaves empty)
    out = acc / jnp.where(seen, l, 1.0)[..., None]
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)  # +inf: p = 0 there in the backward
    return (out.transpose(1, 2, 0, 3, 4).reshape(H, T, E).astype(q_HTE.dtype), lse.transpose(1, 2, 0, 3).reshape(H, T))


def _dq(static, q_HTE, k_KSE, v_KSE, do_HTE, lse_HT, delta_HT, mask_arrays, doc_arrays, mod_arrays):
    """(dQ, d mod_arrays): the scan over kv lists visits every live tile once, so it also sums the arrays'
    gradient."""
    H, T, E = q_HTE.shape
    bq, bkv = static.block_q, static.block_kv
    xs = _entries(*mask_arrays[:3])
    q_NKGQE, do_NKGQE = _q_blocks(static, q_HTE), _q_blocks(static, do_HTE)
    lse_NKGQ, delta_NKGQ = _q_rows(static, lse_HT), _q_rows(static, delta_HT)
    k_OKWE, v_OKWE = _kv_blocks(static, k_KSE), _kv_blocks(static, v_KSE)
    q_pos_NQ1 = jnp.arange(T, dtype=jnp.int32).reshape(-1, bq, 1)

    def step(carry, xs):
        dq, d_arrays = carry
        blocks_N, live_N, masked_N = xs
        kv_pos_N1W = _positions(blocks_N, bkv)[:, None, :]
        k_NKWE, v_NKWE = k_OKWE[blocks_N], v_OKWE[blocks_N]
        s_raw = _raw_scores(static, q_NKGQE, k_NKWE)
        s, d_mod = _scores(
            static,
            s_raw,
            q_pos_NQ1,
            kv_pos_N1W,
            live_N,
            masked_N,
            _doc_tiles(doc_arrays, q_pos_NQ1, kv_pos_N1W),
            mod_arrays,
            with_grad=True,
        )
        p = jnp.exp(s - lse_NKGQ[..., None])  # 0 outside the mask and on padding rows (lse +inf): so is ds
        ds = p * (jnp.einsum("nkgqe,nkwe->nkgqw", do_NKGQE, v_NKWE) - delta_NKGQ[..., None])
        if mod_arrays:  # ds is the gradient to the modded scores here
            grads = mod_array_grads(static.score_mod, mod_arrays, s_raw, *_coords(s, q_pos_NQ1, kv_pos_N1W), ds)
            d_arrays = tuple(a + b for a, b in zip(d_arrays, grads))
        if d_mod is not None:
            ds = ds * d_mod
        return (dq + jnp.einsum("nkgqw,nkwe->nkgqe", ds, k_NKWE), d_arrays), None

    zeros = (jnp.zeros_like(q_NKGQE), tuple(jnp.zeros_like(a) for a in mod_arrays))
    (dq, d_arrays), _ = lax.scan(step, zeros, xs)
    return (dq * static.scale).transpose(1, 2, 0, 3, 4).reshape(H, T, E), d_arrays


def _dkv(static, q_HTE, k_KSE, v_KSE, do_HTE, lse_HT, delta_HT, mask_arrays, doc_arrays, mod_arrays):
    K, S, E = k_KSE.shape
    bq, bkv = static.block_q, static.block_kv
    xs = _entries(*mask_arrays[3:])
    q_OKGQE, do_OKGQE = _q_blocks(static, q_HTE), _q_blocks(static, do_HTE)
    lse_OKGQ, delta_OKGQ = _q_rows(static, lse_HT), _q_rows(static, delta_HT)
    k_NKWE, v_NKWE = _kv_blocks(static, k_KSE), _kv_blocks(static, v_KSE)
    kv_pos_N1W = jnp.arange(S, dtype=jnp.int32).reshape(-1, 1, bkv)

    def step(carry, xs):
        dk, dv = carry
        blocks_N, live_N, masked_N = xs
        q_pos_NQ1 = _positions(blocks_N, bq)[:, :, None]
        q_NKGQE, do_NKGQE = q_OKGQE[blocks_N], do_OKGQE[blocks_N]
        s, d_mod = _scores(
            static,
            _raw_scores(static, q_NKGQE, k_NKWE),
            q_pos_NQ1,
            kv_pos_N1W,
            live_N,
            masked_N,
            _doc_tiles(doc_arrays, q_pos_NQ1, kv_pos_N1W),
            mod_arrays,
            with_grad=True,
        )
        p = jnp.exp(s - lse_OKGQ[blocks_N][..., None])
        dv = dv + jnp.einsum("nkgqw,nkgqe->nkwe", p, do_NKGQE)
        ds = p * (jnp.einsum("nkgqe,nkwe->nkgqw", do_NKGQE, v_NKWE) - delta_OKGQ[blocks_N][..., None])
        if d_mod is not None:
            ds = ds * d_mod
        return (dk + jnp.einsum("nkgqw,nkgqe->nkwe", ds, q_NKGQE), dv), None

    zeros = jnp.zeros_like(k_NKWE)
    (dk, dv), _ = lax.scan(step, (zeros, zeros), xs)

    def unblock(x_NKWE):
        return x_NKWE.transpose(1, 0, 2, 3).reshape(K, S, E)

    return unblock(dk * static.scale), unblock(dv)
