"""Dense masked-softmax attention: the plain reference every other implementation is tested against.

Materializes the whole [B, Hq, T, S] score matrix, so it is for tests and small shapes only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .masks import Mask, ScoreMod


def reference_attention(q, k, v, mask: Mask, *, scale: float | None = None, score_mod: ScoreMod | None = None):
    """softmax(score_mod(scale * q k^T) masked by ``mask``) v, in float32.

    q [B, Hq, T, D], k/v [B, Hkv, S, D] with Hkv dividing Hq (query head h reads kv head h // (Hq // Hkv)).
    Returns (out [B, Hq, T, D] in q.dtype, lse [B, Hq, T] float32: log-sum-exp of the masked, scaled scores).
    """
    B, Hq, T, D = q.shape
    _, Hkv, S, _ = k.shape
    if Hq % Hkv:
        raise ValueError(f"reference_attention: kv heads {Hkv} must divide query heads {Hq}")
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    group = Hq // Hkv
    k_BxHxSxD = jnp.repeat(k.astype(jnp.float32), group, axis=1)
    v_BxHxSxD = jnp.repeat(v.astype(jnp.float32), group, axis=1)

    s_BxHxTxS = jnp.einsum("bhtd,bhsd->bhts", q.astype(jnp.float32), k_BxHxSxD) * scale
    q_idx = jnp.arange(T, dtype=jnp.int32)[:, None]
    kv_idx = jnp.arange(S, dtype=jnp.int32)[None, :]
    if score_mod is not None:
        head = jnp.arange(Hq, dtype=jnp.int32)[:, None, None]
        s_BxHxTxS = score_mod(s_BxHxTxS, q_idx, kv_idx, head)

    m = jnp.asarray(mask(q_idx, kv_idx), dtype=bool)  # [T, S] or [B, T, S]
    m = m[None, None] if m.ndim == 2 else m[:, None]
    s_BxHxTxS = jnp.where(m, s_BxHxTxS, -jnp.inf)

    lse_BxHxT = jax.nn.logsumexp(s_BxHxTxS, axis=-1)
    p_BxHxTxS = jnp.exp(s_BxHxTxS - lse_BxHxT[..., None])
    out = jnp.einsum("bhts,bhsd->bhtd", p_BxHxTxS, v_BxHxSxD)
    return out.astype(q.dtype), lse_BxHxT
