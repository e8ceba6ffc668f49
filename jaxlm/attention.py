"""The one attention entry point. Backends (XLA reference today, Pallas block-sparse kernels later) sit behind it.

Shapes: B batch, T query length, S key length, K kv heads, G query heads per kv head (H = K * G), D head dim.
Query head h uses kv head h // G (the usual grouped-query convention).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("xla", "jax")


def attention(
    q_BTHD: jax.Array,
    k_BSKD: jax.Array,
    v_BSKD: jax.Array,
    *,
    causal: bool = True,
    mask_BTS: jax.Array | None = None,
    segment_ids_BT: jax.Array | None = None,
    scale: float | None = None,
    impl: str = "xla",
) -> jax.Array:
    """Softmax attention returning [B, T, H, D].

    `mask_BTS` (True = may attend) and `segment_ids_BT` (tokens attend only within their own segment, for
    packed documents) combine with `causal` by logical AND.
    """
    B, T, H, D = q_BTHD.shape
    K = k_BSKD.shape[2]
    if H % K:
        raise ValueError(f"query heads ({H}) must be a multiple of kv heads ({K})")
    scale = D**-0.5 if scale is None else scale
    if impl == "xla":
        return _xla_attention(q_BTHD, k_BSKD, v_BSKD, causal, mask_BTS, segment_ids_BT, scale)
    if impl == "jax":
        mask = _combined_mask(T, k_BSKD.shape[1], False, mask_BTS, segment_ids_BT)
        return jax.nn.dot_product_attention(
            q_BTHD, k_BSKD, v_BSKD, mask=None if mask is None else mask[:, None], is_causal=causal,
            scale=scale, implementation="xla")
    raise ValueError(f"unknown attention impl {impl!r}; choose one of {IMPLEMENTATIONS}")


def _combined_mask(T, S, causal, mask_BTS, segment_ids_BT):
    mask = None
    if causal:
        mask = (jnp.arange(T)[:, None] >= jnp.arange(S)[None, :])[None]  # [1, T, S]
    if mask_BTS is not None:
        mask = mask_BTS if mask is None else mask & mask_BTS
    if segment_ids_BT is not None:
        same = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
        mask = same if mask is None else mask & same
    return mask


def _xla_attention(q_BTHD, k_BSKD, v_BSKD, causal, mask_BTS, segment_ids_BT, scale):
    """Grouped attention without materialising repeated K/V: scores are [B, K, G, T, S]."""
    B, T, H, D = q_BTHD.shape
    S, K = k_BSKD.shape[1], k_BSKD.shape[2]
    q_BTKGD = q_BTHD.reshape(B, T, K, H // K, D)
    scores = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD * scale, k_BSKD, preferred_element_type=jnp.float32)
    mask = _combined_mask(T, S, causal, mask_BTS, segment_ids_BT)
    if mask is not None:
        scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSKD.dtype)
    out_BTKGD = jnp.einsum("bkgts,bskd->btkgd", probs, v_BSKD)
    return out_BTKGD.reshape(B, T, H, D)
