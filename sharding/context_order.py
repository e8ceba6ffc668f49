"""The order a row's tokens are dealt to the `context` mesh axis in, and how evenly it shares the attention's work.

Device c holds the tokens at positions order[c * T / C: (c + 1) * T / C] of each row. Inputs, targets, the loss mask
and segment ids move with the tokens, and RoPE and the mask read the positions, so the loss does not change; only
which device does how much of the attention does.

  contiguous  as they come: keeps a sliding window local (the ring then sends a shard only as far as it reaches).
  zigzag      2C chunks, device c holding chunks c and 2C - 1 - c: exactly even for one causal row.
  documents   per row, from its segment ids: the row cut into a few chunks per device, dealt by their cost (the score
              pairs their queries keep within their documents) so every device's sum is about the same. Packed
              documents break zigzag: short documents' work sits where they do (1.4-2.2x max / mean measured on
              log-normal packings), this keeps it within a few percent.

Shape suffixes follow the legend in docs/architecture.md (K here: a row's chunks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from pallas_kernels.kernel_mask import DocumentSlot
from pallas_kernels.mask_spec import uses_documents
from pallas_kernels.masks import And

ORDERS = ("auto", "documents", "zigzag", "contiguous")
_COUNTED = (pk.masks.Causal, pk.masks.SlidingWindow, pk.masks.Full, DocumentSlot)
MAX_CHUNKS_PER_DEVICE = 8  # 8: within 1.03x max / mean on every packing tried; 4: up to 1.28x, 2 (zigzag's): 2.2x


def pick_order(mask: pk.Mask, shards: int, how: str = "auto") -> str:
    """Which order `how` means for this mask: auto is contiguous for a mask with a local term (window, chunk: the
    ring then passes a shard only as far as it reaches, which a per-row order would stop it knowing), documents for
    another document mask whose kept pairs `visible_keys` counts, zigzag otherwise. documents on a mask without
    documents is auto's choice (its cost is the same for every row: zigzag or contiguous already fit)."""
    if shards == 1 or how == "contiguous":
        return "contiguous"
    if how == "zigzag":
        return "zigzag"
    if how == "auto" and _is_local(mask):
        return "contiguous"
    if uses_documents(mask) and counts(mask):
        return "documents"
    if how == "documents" and uses_documents(mask):
        raise ValueError(
            f"model.context_order=documents deals tokens by the score pairs they keep, which it counts only for "
            f"masks made of causal, sliding_window, document and full; got {mask!r}"
        )
    return "contiguous" if _is_local(mask) else "zigzag"


def sequence_order(
    mask: pk.Mask, seq_len: int, shards: int, how: str = "auto", segment_ids_BT=None, block: int = 1
) -> np.ndarray | jax.Array | None:
    """The positions each row's tokens are dealt in: None (as they come), numpy [T] (the same for every row, known
    when tracing: the ring skips what the mask empties) or, for documents, an int32 array [B, T] computed from the
    batch's segment ids. ``block``: the attention's query tile; chunks are kept at least that long where the row
    allows, so a tile does not straddle two of them."""
    kind = pick_order(mask, shards, how)
    if kind == "contiguous":
        return None
    if kind == "zigzag":
        return balanced_order(seq_len, shards)
    per_device = chunks_per_device(seq_len // shards, block)
    return cost_balanced_order(visible_keys(mask, seq_len, segment_ids_BT), shards, per_device)


def permute_rows(batch: dict, order) -> dict:
    """Every [B, T] field of ``batch`` in the order the context axis deals its tokens (numpy [T] or [B, T])."""
    if isinstance(order, np.ndarray):
        return {k: v[:, order] for k, v in batch.items()}
    return {k: jnp.take_along_axis(v, order, axis=1) for k, v in batch.items()}


def chunks_per_device(local_len: int, block: int = 1) -> int:
    """How many chunks a device's T / C tokens cut into: the most (up to MAX_CHUNKS_PER_DEVICE, at least 2) that
    cut evenly into whole query tiles; when none does (a shard shorter than two tiles), the most that cut evenly."""
    fits = [n for n in range(MAX_CHUNKS_PER_DEVICE, 1, -1) if local_len % n == 0]
    whole_tiles = [n for n in fits if local_len // n >= block]
    return (whole_tiles or fits or [1])[0]


def cost_balanced_order(cost_BT: jax.Array, shards: int, per_device: int) -> jax.Array:
    """Positions [B, T] (int32): each row cut into shards x per_device chunks, dealt so every device holds per_device
    of them and about the same cost (the sum of ``cost_BT`` over its tokens).

    Longest-processing-time first with a cardinality limit: the chunks by falling cost, each to the device with
    the least cost so far among those with room. For one causal row of 2C chunks this is zigzag. Runs on the
    device, per row, in C x per_device steps: small next to a step's attention."""
    B, T = cost_BT.shape
    K = shards * per_device
    L = T // K
    cost_BK = jnp.broadcast_to(cost_BT, (B, T)).astype(jnp.float32).reshape(B, K, L).sum(-1)

    def deal(cost_K):
        by_cost_K = jnp.argsort(-cost_K, stable=True)

        def place(i, carry):
            load_C, room_C, owner_K = carry
            j = by_cost_K[i]
            d = jnp.argmin(jnp.where(room_C > 0, load_C, jnp.inf))
            return load_C.at[d].add(cost_K[j]), room_C.at[d].add(-1), owner_K.at[j].set(d)

        start = (jnp.zeros(shards, jnp.float32), jnp.full(shards, per_device), jnp.zeros(K, jnp.int32))
        owner_K = jax.lax.fori_loop(0, K, place, start)[2]
        return jnp.argsort(owner_K * K + jnp.arange(K))  # device by device, each device's chunks in row order

    chunks_BK = jax.vmap(deal)(cost_BK)
    return (chunks_BK[:, :, None] * L + jnp.arange(L)).reshape(B, T).astype(jnp.int32)


def balanced_order(seq_len: int, shards: int) -> np.ndarray:
    """A permutation of positions [T] for `shards` devices under a causal mask: the sequence cut into 2 x shards
    chunks, device c holding chunks c and 2 x shards - 1 - c (zigzag), so every device's queries see about as many
    keys. Device c's tokens are order[c * T / shards: (c + 1) * T / shards]."""
    chunks = np.arange(seq_len).reshape(2 * shards, -1)
    return np.concatenate([np.concatenate([chunks[c], chunks[2 * shards - 1 - c]]) for c in range(shards)])


def balance(mask: pk.Mask, seq_len: int, order, shards: int, segment_ids_BT=None):
    """max / mean over the context axis' devices of the score pairs their queries keep (1.0: even), for the batch
    in hand, or None for masks `visible_keys` cannot count. ``order``: the positions dealt out (None: in order;
    numpy [T] or [B, T])."""
    keys_BT = visible_keys(mask, seq_len, segment_ids_BT)
    if keys_BT is None:
        return None
    dealt_BT = jnp.arange(seq_len)[None] if order is None else jnp.asarray(order).reshape(-1, seq_len)
    B = max(keys_BT.shape[0], dealt_BT.shape[0])
    kept_BT = jnp.take_along_axis(jnp.broadcast_to(keys_BT, (B, seq_len)), jnp.broadcast_to(dealt_BT, (B, seq_len)), 1)
    work_C = kept_BT.astype(jnp.float32).reshape(B, shards, -1).sum(axis=(0, 2))
    return work_C.max() / jnp.maximum(work_C.mean(), 1.0)


def counts(mask: pk.Mask) -> bool:
    """Whether `visible_keys` counts this mask: an And of causal, sliding windows, documents and full."""
    return all(isinstance(term, _COUNTED) for term in (mask.masks if isinstance(mask, And) else (mask,)))


def visible_keys(mask: pk.Mask, seq_len: int, segment_ids_BT=None):
    """Keys each query sees, [B or 1, T], for masks that are an And of causal, sliding windows, documents (a slot,
    read from ``segment_ids_BT``) and full: each keeps one stretch of keys per query. None for other masks. O(T),
    cheap enough for every step."""
    if not counts(mask):
        return None
    T = seq_len
    pos = jnp.arange(T)[None, :]
    lo, hi = jnp.zeros_like(pos), jnp.full_like(pos, T - 1)
    for term in mask.masks if isinstance(mask, And) else (mask,):
        if isinstance(term, pk.masks.Causal):
            hi = jnp.minimum(hi, pos)
        elif isinstance(term, pk.masks.SlidingWindow):
            lo, hi = jnp.maximum(lo, pos - term.window + 1), jnp.minimum(hi, pos)
        elif isinstance(term, DocumentSlot) and segment_ids_BT is not None:
            first = jnp.ones_like(segment_ids_BT[:, :1], bool)
            starts = jnp.concatenate([first, segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
            ends = jnp.concatenate([starts[:, 1:], first], axis=1)
            lo = jnp.maximum(lo, jax.lax.cummax(jnp.where(starts, pos, 0), axis=1))
            hi = jnp.minimum(hi, jax.lax.cummin(jnp.where(ends, pos, T - 1), axis=1, reverse=True))
    return jnp.maximum(hi - lo + 1, 0)


def _is_local(mask: pk.Mask) -> bool:
    if isinstance(mask, (pk.masks.SlidingWindow, pk.masks.ChunkedCausal)):
        return True
    return isinstance(mask, And) and any(_is_local(c) for c in mask.masks)
