"""The KV cache generation decodes over: new tokens' keys and values written into their slots in place, and
grouped attention of the new queries over every slot (jaxlm.model.Attention.decode). Shape letters beyond the
legend (docs/architecture.md): S cache slots, P = B * K rows and kv heads merged, J = G * T queries of one kv head."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import Mask, full
from pallas_kernels.kernel_mask import DocumentSlot
from pallas_kernels.masks import And, Or

# Cache writes: positions are in bounds and one per (row, token). Said so, XLA writes the slots in place; with the
# default out-of-bounds handling it copied every layer's cache twice per token (XLA:CPU).
_IN_PLACE = dict(mode="promise_in_bounds", unique_indices=True)


def write_cache(k_BKSE, v_BKSE, k_BTKE, v_BTKE, positions_BT):
    """The new tokens' keys and values into their slots; returns the caches with rows and kv heads merged, k_PSE and
    v_PSE (P = B*K), the shape the attention products read. A one-row cache may come without its row axis (generate
    keeps it so; see jaxlm.generate.KVCache)."""
    return _write_slots(k_BKSE, k_BTKE, positions_BT), _write_slots(v_BKSE, v_BTKE, positions_BT)


def _write_slots(cache_BKSE, x_BTKE, positions_BT):
    """One cache (keys or values, both [B, K, S, E]) with x written at its rows' positions -> [B*K, S, E]. One row with
    one token is a dynamic_update_slice: as a scatter XLA:CPU copied each layer's cache twice per token (measured)."""
    B, T = positions_BT.shape
    K, S, E = cache_BKSE.shape[-3:]
    x_BTKE = x_BTKE.astype(cache_BKSE.dtype)
    if B == 1 and T == 1:
        return jax.lax.dynamic_update_slice(
            cache_BKSE.reshape(K, S, E), x_BTKE[0].transpose(1, 0, 2), (0, positions_BT[0, 0], 0)
        )
    rows_B1 = jnp.arange(B)[:, None]
    cache_BKSE = cache_BKSE.reshape(B, K, S, E).at[rows_B1, :, positions_BT].set(x_BTKE, **_IN_PLACE)  # [B, T, K, E]
    return cache_BKSE.reshape(B * K, S, E)


def cached_attention(q_BTHE, k_PSE, v_PSE, mask_BTS, positions_BT, score_mod=None):
    """Dense grouped attention over a KV cache (jaxlm.attention's reference, cache-shaped), rows and kv heads
    merged (P = B*K). Keys and values are both laid out [P, S, E]: the score product contracts the minor axis of q
    and k, which XLA:CPU ran 1.3x faster than over keys [P, E, S] (and with keys [B, S, K, E] it transposed, i.e.
    copied, every layer's keys for every token)."""
    B, T, H, E = q_BTHE.shape
    P, S, _ = k_PSE.shape
    K, G = P // B, H // (P // B)
    q_PJE = q_BTHE.reshape(B, T, K, G, E).transpose(0, 2, 3, 1, 4).reshape(P, G * T, E)  # J = G*T
    scores = jnp.einsum("pje,pse->pjs", q_PJE * E**-0.5, k_PSE, preferred_element_type=jnp.float32)
    scores = scores.reshape(B, K, G, T, S)
    if score_mod is not None:
        head = jnp.arange(H, dtype=jnp.int32).reshape(1, K, G, 1, 1)
        scores = score_mod(scores, positions_BT[:, None, None, :, None], jnp.arange(S), head)
    scores = jnp.where(mask_BTS[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs_PJS = jax.nn.softmax(scores, axis=-1).astype(v_PSE.dtype).reshape(P, G * T, S)
    out_PJE = jnp.einsum("pjs,pse->pje", probs_PJS, v_PSE)
    return out_PJE.reshape(B, K, G, T, E).transpose(0, 3, 1, 2, 4).reshape(B, T, H, E)


def one_document(mask: Mask) -> Mask:
    """The mask over one sequence's cache: generation decodes one document per row, so document slots are full."""
    if isinstance(mask, DocumentSlot):
        return full()
    if isinstance(mask, (And, Or)):
        return type(mask)(tuple(one_document(m) for m in mask.masks))
    return mask
