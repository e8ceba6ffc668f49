"""Block-sparse flash attention in plain XLA: the same algorithm as the Pallas kernel, differentiable by autodiff.

Every q block (all of them at once, vectorized with every head) scans j over ``range(max_kv)`` and visits kv block
``kv_block_indices[qb, j]`` only: steps with j >= ``kv_block_counts[qb]`` are masked out, and the element mask is
applied only to the PARTIAL entries (the first ``kv_partial_counts[qb]``). Sequences that are not whole blocks are
padded; padded keys are masked, padded queries dropped. Running max / sum / accumulator stay in float32 (the flash-attention
recurrences), so memory is O(T * block_kv) per head, never O(T * S).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from .block_mask import BlockMask
from .masks import And, Document, Mask, Or, ScoreMod


def _mask_for_batch(mask: Mask, b, batch: int):
    """``mask`` restricted to batch element ``b`` (a traced scalar), so it returns no leading batch dim."""
    if mask.is_static:
        return mask
    if isinstance(mask, (And, Or)):
        return type(mask)(tuple(_mask_for_batch(m, b, batch) for m in mask.masks))
    if isinstance(mask, Document):
        def pick(ids):
            if ids.ndim == 1:
                return ids
            if ids.ndim != 2 or ids.shape[0] not in (1, batch):
                raise ValueError(f"block_sparse_attention_xla: document segment ids {list(ids.shape)} do not match "
                                 f"batch size {batch}")
            return jnp.asarray(ids)[b if ids.shape[0] == batch else 0]

        return Document(pick(mask.q_segment_ids), pick(mask.kv_segment_ids))

    def call(q_idx, kv_idx):  # an unknown array-holding mask: evaluate for every batch element, keep ours
        out = mask(q_idx, kv_idx)
        extra = out.ndim - max(jnp.ndim(q_idx), jnp.ndim(kv_idx))
        return out[b] if extra > 0 and out.shape[0] == batch else out.reshape(out.shape[extra:]) if extra else out

    return call


def block_sparse_attention_xla(q, k, v, block_mask: BlockMask, *, scale: float | None = None,
                               score_mod: ScoreMod | None = None):
    """Attention over the non-empty tiles of ``block_mask`` only.

    q [B, Hq, T, D], k/v [B, Hkv, S, D] (Hkv divides Hq); ``block_mask`` from ``make_block_mask(mask, T, S, ...)``,
    static (close over it, e.g. with functools.partial, to jit). Returns (out [B, Hq, T, D] in q.dtype,
    lse [B, Hq, T] float32), equal to ``reference_attention(q, k, v, block_mask.mask, ...)``.
    """
    B, Hq, T, D = q.shape
    _, Hkv, S, _ = k.shape
    if Hq % Hkv:
        raise ValueError(f"block_sparse_attention_xla: kv heads {Hkv} must divide query heads {Hq}")
    if (T, S) != (block_mask.q_len, block_mask.kv_len):
        raise ValueError(f"block_sparse_attention_xla: q/kv lengths {(T, S)} do not match the block mask's "
                         f"{(block_mask.q_len, block_mask.kv_len)}")
    if len(block_mask.batch_shape) > 1 or block_mask.batch_shape not in ((), (1,), (B,)):
        raise ValueError(f"block_sparse_attention_xla: block mask batch shape {block_mask.batch_shape} does not "
                         f"match batch size {B}")
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    G = Hq // Hkv
    bq, bkv = block_mask.block_sizes.block_q, block_mask.block_sizes.block_kv
    nq, nkv = block_mask.num_q_blocks, block_mask.num_kv_blocks
    Tp, Sp = nq * bq, nkv * bkv
    q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, n - x.shape[2]), (0, 0))) for x, n in ((q, Tp), (k, Sp), (v, Sp)))

    def batched(a, tail):
        return jnp.broadcast_to(jnp.asarray(a), (B, *tail))

    npart_BxNQ = batched(block_mask.kv_partial_counts, (nq,))
    idx_BxNQxJ = batched(block_mask.kv_block_indices, block_mask.kv_block_indices.shape[-2:])
    cnt_BxNQ = batched(block_mask.kv_block_counts, (nq,))
    max_kv = idx_BxNQxJ.shape[-1]

    q_idx_NQxBQ = jnp.arange(Tp, dtype=jnp.int32).reshape(nq, bq)
    head_HxG = jnp.arange(Hq, dtype=jnp.int32).reshape(Hkv, G)

    def one_batch(b, q_HxTxD, k_HxSxD, v_HxSxD, npart_NQ, idx_NQxJ, cnt_NQ):
        mask = _mask_for_batch(block_mask.mask, b, B)
        q_NQxHxGxBQxD = q_HxTxD.reshape(Hkv, G, nq, bq, D).transpose(2, 0, 1, 3, 4).astype(jnp.float32)
        # float32 before the gathers: their transposes (scatter-adds over every visiting q block) then accumulate
        # the dK/dV contributions in float32, not in the input dtype
        k_NKVxHxBKVxD = k_HxSxD.reshape(Hkv, nkv, bkv, D).transpose(1, 0, 2, 3).astype(jnp.float32)
        v_NKVxHxBKVxD = v_HxSxD.reshape(Hkv, nkv, bkv, D).transpose(1, 0, 2, 3).astype(jnp.float32)

        def step(carry, j):
            m_prev, l_prev, acc_prev = carry  # [NQ, H, G, BQ], same, [NQ, H, G, BQ, D]
            kv_block_NQ = idx_NQxJ[:, j]
            k_blk = k_NKVxHxBKVxD[kv_block_NQ]  # [NQ, H, BKV, D]
            v_blk = v_NKVxHxBKVxD[kv_block_NQ]
            s = jnp.einsum("nhgqd,nhkd->nhgqk", q_NQxHxGxBQxD, k_blk) * scale

            q_pos = q_idx_NQxBQ[:, :, None]  # [NQ, BQ, 1]
            kv_pos = (kv_block_NQ[:, None] * bkv + jnp.arange(bkv, dtype=jnp.int32))[:, None, :]  # [NQ, 1, BKV]
            if score_mod is not None:
                s = score_mod(s, q_pos[:, None, None], kv_pos[:, None, None], head_HxG[None, :, :, None, None])

            elem = jnp.asarray(mask(q_pos, kv_pos), dtype=bool) & (q_pos < T) & (kv_pos < S)
            keep = (j < cnt_NQ)[:, None, None] & ((j >= npart_NQ)[:, None, None] | elem)
            s = jnp.where(keep[:, None, None], s, -jnp.inf)

            m_new = jnp.maximum(m_prev, s.max(-1))
            m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # a row with nothing seen yet
            alpha = jnp.exp(m_prev - m_safe)
            p = jnp.exp(s - m_safe[..., None])
            l_new = alpha * l_prev + p.sum(-1)
            acc_new = alpha[..., None] * acc_prev + jnp.einsum("nhgqk,nhkd->nhgqd", p, v_blk)
            return (m_new, l_new, acc_new), None

        # carries built from q, so that under a user's shard_map they vary over the same mesh axes as the outputs
        acc0 = jnp.zeros_like(q_NQxHxGxBQxD)
        init = (acc0[..., 0] - jnp.inf, acc0[..., 0], acc0)
        (m, l, acc), _ = lax.scan(step, init, jnp.arange(max_kv))
        seen = l > 0  # False only on padding rows (and rows a traced mask leaves empty)
        out = acc / jnp.where(seen, l, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
        out_HxTxD = out.transpose(1, 2, 0, 3, 4).reshape(Hq, Tp, D)[:, :T]
        lse_HxT = lse.transpose(1, 2, 0, 3).reshape(Hq, Tp)[:, :T]
        return out_HxTxD.astype(q.dtype), lse_HxT

    return jax.vmap(one_batch)(jnp.arange(B), q, k, v, npart_BxNQ, idx_BxNQxJ, cnt_BxNQ)
