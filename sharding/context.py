"""Attention over a sequence split along the `context` mesh axis (context parallelism).

The rules map the logical `seq` axis of activations to `context`: each device holds T / C tokens of every row, in
the order the batch gives them (a balancing reorder, `balanced_order`, moves tokens and their positions together).
Everything but attention works token by token, so XLA's partitioner splits it; attention needs every key a query
may see, and this module brings them, per shard, under the same `jax.shard_map` the block-sparse kernels run in:

  all_gather  gather K and V once (kv heads, not query heads) and attend the local queries to the whole sequence;
              the backward reduce-scatters dK / dV. Holds the whole sequence's K and V on every device.
  ring        C steps: attend the local queries to the K/V shard in hand, merge the partial results by their
              log-sum-exp, pass the shard on with `ppermute`; autodiff sends dK / dV back around the ring. Holds
              two shards; XLA can overlap each pass with the step's compute.

The mask is evaluated at the tokens' positions (`pallas_kernels.at_positions`), so the kernels skip the tiles it
empties on remote shards as on the local one. Shape suffixes follow the legend in docs/architecture.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from pallas_kernels.kernel_mask import DocumentSlot
from pallas_kernels.masks import And, Or

VARIANTS = ("all_gather", "ring")


def bind(template: pk.Mask, q_segment_ids, kv_segment_ids, q_positions, kv_positions) -> pk.Mask:
    """The mask of local queries against one stretch of keys: document slots read the two sides' segment ids,
    every static term the two sides' positions."""

    def fill(m):
        if isinstance(m, DocumentSlot):
            return pk.document(q_segment_ids, kv_segment_ids)
        if isinstance(m, (And, Or)):
            return type(m)(tuple(fill(c) for c in m.masks))
        return m

    return pk.at_positions(fill(template), q_positions, kv_positions)


def context_attention(attend, q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, positions_BT, *, template, axis, variant):
    """Per shard (inside a shard_map whose `axis` splits T): the local queries' attention over every shard's keys.

    ``attend(q_BTHE, k_BSKE, v_BSKE, mask) -> (out_BTHE, lse_BHT)`` runs one block-sparse product; ``template`` is
    the config's mask with document slots; ``positions_BT`` are the local tokens' positions in their sequence."""
    if variant == "all_gather":
        gather = lambda x: None if x is None else jax.lax.all_gather(x, axis, axis=1, tiled=True)  # noqa: E731
        k_BSKE, v_BSKE, kv_segments, kv_positions = (gather(x) for x in (k_BTKE, v_BTKE, segment_ids_BT, positions_BT))
        mask = bind(template, segment_ids_BT, kv_segments, positions_BT, kv_positions)
        return attend(q_BTHE, k_BSKE, v_BSKE, mask)[0]
    if variant != "ring":
        raise ValueError(f"model.context_parallel {variant!r} is unknown; choose one of {', '.join(VARIANTS)}")
    C = jax.lax.axis_size(axis)
    send = [(i, (i + 1) % C) for i in range(C)]
    shard = (k_BTKE, v_BTKE, segment_ids_BT, positions_BT)
    out_BTHE = lse_BTH = None
    for step in range(C):
        k_BSKE, v_BSKE, kv_segments, kv_positions = shard
        mask = bind(template, segment_ids_BT, kv_segments, positions_BT, kv_positions)
        part_BTHE, part_BHT = attend(q_BTHE, k_BSKE, v_BSKE, mask)
        out_BTHE, lse_BTH = merge(out_BTHE, lse_BTH, part_BTHE, part_BHT.transpose(0, 2, 1))
        if step < C - 1:
            shard = tuple(None if x is None else jax.lax.ppermute(x, axis, send) for x in shard)
    return out_BTHE.astype(q_BTHE.dtype)


def merge(out_BTHE, lse_BTH, part_BTHE, part_BTH):
    """Two softmax results over disjoint keys -> theirs over the union, weighted by their log-sum-exps (float32).
    A row that saw no key in a part (its lse not finite: the kernels write +inf there) weighs 0; every `where`
    keeps the unselected branch finite, so no NaN reaches the gradient."""
    seen = jnp.isfinite(part_BTH)
    part_BTH = jnp.where(seen, part_BTH, -jnp.inf)
    part_BTHE = jnp.where(seen[..., None], part_BTHE.astype(jnp.float32), 0.0)
    if out_BTHE is None:
        return part_BTHE, part_BTH
    top = jnp.maximum(lse_BTH, part_BTH)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    a, b = jnp.exp(lse_BTH - top), jnp.exp(part_BTH - top)
    total = a + b
    some = total > 0
    safe = jnp.where(some, total, 1.0)
    new_BTH = jnp.where(some, top + jnp.log(safe), -jnp.inf)
    out_BTHE = (a / safe)[..., None] * out_BTHE + (b / safe)[..., None] * part_BTHE
    return out_BTHE, new_BTH


def balanced_order(seq_len: int, shards: int) -> np.ndarray:
    """A permutation of positions [T] for `shards` devices under a causal mask: the sequence cut into 2 x shards
    chunks, device c holding chunks c and 2 x shards - 1 - c (zigzag), so every device's queries see about as many
    keys. Device c's tokens are order[c * T / shards: (c + 1) * T / shards]."""
    chunks = np.arange(seq_len).reshape(2 * shards, -1)
    return np.concatenate([np.concatenate([chunks[c], chunks[2 * shards - 1 - c]]) for c in range(shards)])
