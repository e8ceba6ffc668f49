"""The math the Pallas attention kernels (GPU / interpreter and TPU) do on one tile, written once: float32-accumulated
products, position iotas, and scores score-modded and masked.

Shape suffixes follow the legend in docs/architecture.md."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def dot(a, b, contract_a: int, contract_b: int):
    """a . b contracting one dim of each, accumulated in float32 (any orientation: 0 / 1 per operand)."""
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32)


def tile_bounds(q_first, q_count: int, kv_first, kv_count: int) -> tuple:
    """(q_first, q_last, kv_first, kv_last) of a tile of ``q_count`` queries by ``kv_count`` keys."""
    return q_first, q_first + q_count - 1, kv_first, kv_first + kv_count - 1


def iota(n: int, axis: int):
    """Positions 0..n-1 as a column [n, 1] (axis 0) or a row [1, n] (axis 1)."""
    shape = (n, 1) if axis == 0 else (1, n)
    return lax.broadcasted_iota(jnp.int32, shape, axis)


def masked_scores(static, s, q_pos, kv_pos, head, masked: bool, doc_tiles, with_grad: bool = False, rows=(), tile=None):
    """Scaled scores ``s`` of one tile (either orientation: the positions broadcast) -> score-modded (reading
    ``rows``: this head's rows of the mod's arrays), -inf outside the mask where ``masked`` (a PARTIAL tile); and
    d mod / d s when ``with_grad`` (None without a score mod). ``tile``: the tile's (q_first, q_last, kv_first,
    kv_last), for the mod's ``tile_shortcut``."""
    s, d_mod = static.mod_scores(s, q_pos, kv_pos, head, with_grad, rows, tile)
    if masked:
        s = jnp.where(static.keep(doc_tiles, q_pos, kv_pos), s, -jnp.inf)
    return s, d_mod
