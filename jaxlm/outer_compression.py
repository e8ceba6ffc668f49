"""What a DiLoCo replica sends at an outer sync: its outer gradient, optionally compressed, and its exact size.

Replicas exchange Δ = θ_global − θ_replica. Compressing it is lossy, so the exchange is simulated exactly: every
replica's Δ goes through `round_trip` (quantize, then dequantize as the receivers would) before the float32
average. int8 / int4 are symmetric with one float32 scale per block of `block` consecutive values (a partial last
block is padded), so one outlier only coarsens its own block; bf16 is a plain cast.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

BITS = {"none": 32, "bf16": 16, "int8": 8, "int4": 4}
_QMAX = {"int8": 127, "int4": 7}
SCALE_BYTES = 4  # one float32 scale per block


def check_kind(kind: str, block: int) -> None:
    if kind not in BITS:
        raise ValueError(f"outer-gradient compression must be one of {', '.join(BITS)}, got {kind!r}")
    if kind in _QMAX and block < 1:
        raise ValueError(f"compression block must be >= 1, got {block}")


def round_trip(x, kind: str, block: int = 256):
    """x as the receivers reconstruct it after `kind` compression (float32, x's shape)."""
    check_kind(kind, block)
    x = jnp.asarray(x, jnp.float32)
    if kind == "none":
        return x
    if kind == "bf16":
        return x.astype(jnp.bfloat16).astype(jnp.float32)
    qmax = _QMAX[kind]
    flat = x.reshape(-1)
    pad = -flat.size % block
    blocks_NB = jnp.pad(flat, (0, pad)).reshape(-1, block)
    amax_N1 = jnp.max(jnp.abs(blocks_NB), axis=1, keepdims=True)
    scale_N1 = jnp.where(amax_N1 > 0, amax_N1 / qmax, 1.0)  # an all-zero block stays zero, never NaN
    q_NB = jnp.clip(jnp.round(blocks_NB / scale_N1), -qmax, qmax)
    return (q_NB * scale_N1).reshape(-1)[:flat.size].reshape(x.shape)


def wire_bytes(numel: int, kind: str, block: int = 256) -> tuple[int, int]:
    """(payload bytes, scale bytes) one replica sends for `numel` values."""
    check_kind(kind, block)
    payload = math.ceil(numel * BITS[kind] / 8)
    scales = math.ceil(numel / block) * SCALE_BYTES if kind in _QMAX else 0
    return payload, scales
