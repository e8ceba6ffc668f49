"""Dense masked-softmax attention: the plain reference every other implementation is tested against.

Materializes the whole [B, H, T, S] score matrix, so it is for tests and small shapes only.

Shape suffixes follow the legend in docs/architecture.md.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .masks import Mask, ScoreMod


def reference_attention(q, k, v, mask: Mask, *, scale: float | None = None, score_mod: ScoreMod | None = None):
    """softmax(score_mod(scale * q k^T) masked by ``mask``) v, in float32.

    q [B, H, T, E], k/v [B, K, S, E] with K dividing H (query head h reads kv head h // G, G = H // K).
    Returns (out [B, H, T, E] in q.dtype, lse [B, H, T] float32: log-sum-exp of the masked, scaled scores).
    """
    B, H, T, E = q.shape
    _, K, S, _ = k.shape
    if H % K:
        raise ValueError(f"reference_attention: kv heads {K} must divide query heads {H}")
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    G = H // K
    k_BHSE = jnp.repeat(k.astype(jnp.float32), G, axis=1)
    v_BHSE = jnp.repeat(v.astype(jnp.float32), G, axis=1)

    s_BHTS = jnp.einsum("bhte,bhse->bhts", q.astype(jnp.float32), k_BHSE) * scale
    q_idx = jnp.arange(T, dtype=jnp.int32)[:, None]
    kv_idx = jnp.arange(S, dtype=jnp.int32)[None, :]
    if score_mod is not None:
        head = jnp.arange(H, dtype=jnp.int32)[:, None, None]
        s_BHTS = score_mod(s_BHTS, q_idx, kv_idx, head)

    m = jnp.asarray(mask(q_idx, kv_idx), dtype=bool)  # [T, S] or [B, T, S]
    m = m[None, None] if m.ndim == 2 else m[:, None]
    s_BHTS = jnp.where(m, s_BHTS, -jnp.inf)

    lse_BHT = jax.nn.logsumexp(s_BHTS, axis=-1)
    p_BHTS = jnp.exp(s_BHTS - lse_BHT[..., None])
    out = jnp.einsum("bhts,bhse->bhte", p_BHTS, v_BHSE)
    return out.astype(q.dtype), lse_BHT
