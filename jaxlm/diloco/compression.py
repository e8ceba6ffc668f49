"""What a DiLoCo replica sends at an outer sync: its outer gradient, optionally compressed, and its exact size.

Replicas exchange Δ = θ_global − θ_replica. Compressing it is lossy. Inside one program the exchange is simulated
exactly: every replica's Δ goes through `round_trip` (quantize, then dequantize as the receivers would) before the
float32 average. Between independent processes (`jaxlm.diloco.exchange`) the sender `encode`s on its devices and
the receivers `decode` on the host, with the same arithmetic, so both paths average the same float32 values.
int8 / int4 are symmetric with one float32 scale per block of `block` consecutive values (a partial last block is
padded), so one outlier only coarsens its own block; int4 packs two values per byte; bf16 is a plain cast.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.diloco.config import COMPRESSION_BITS

BITS = COMPRESSION_BITS  # the encodings the config allows, and their bits per value
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
    q_NB, scale_N1 = _quantize(x, kind, block)
    return (q_NB * scale_N1).reshape(-1)[: x.size].reshape(x.shape)


def _quantize(x, kind: str, block: int):
    """(q_NB float32 integers in [-qmax, qmax], scale_N1): x's values in blocks of `block` (the last padded)."""
    qmax = _QMAX[kind]
    flat = x.reshape(-1)
    blocks_NB = jnp.pad(flat, (0, -flat.size % block)).reshape(-1, block)
    amax_N1 = jnp.max(jnp.abs(blocks_NB), axis=1, keepdims=True)
    scale_N1 = jnp.where(amax_N1 > 0, amax_N1 / qmax, 1.0)  # an all-zero block stays zero, never NaN
    return jnp.clip(jnp.round(blocks_NB / scale_N1), -qmax, qmax), scale_N1


def encode(x, kind: str, block: int = 256) -> dict[str, jax.Array]:
    """What a replica puts on the wire for x (traceable; run it on the devices): `wire_bytes` bytes in all."""
    check_kind(kind, block)
    x = jnp.asarray(x, jnp.float32)
    if kind == "none":
        return {"values": x.reshape(-1)}
    if kind == "bf16":
        return {"bits": jax.lax.bitcast_convert_type(x.reshape(-1).astype(jnp.bfloat16), jnp.uint16)}
    q_NB, scale_N1 = _quantize(x, kind, block)
    q = q_NB.reshape(-1)[: x.size].astype(jnp.int8)
    if kind == "int4":  # two's-complement nibbles, two per byte (low nibble first)
        nibbles = jnp.pad(q, (0, q.size % 2)).astype(jnp.uint8) & 0xF
        q = nibbles[0::2] | (nibbles[1::2] << 4)
    return {"q": q, "scale": scale_N1.reshape(-1)}


def decode(parts: dict[str, np.ndarray], kind: str, shape: tuple[int, ...], block: int = 256) -> np.ndarray:
    """The float32 values a receiver reconstructs from `encode`'s parts (on the host): equal, bit for bit, to
    a compiled `round_trip` of the same x (a zero may lose its sign)."""
    check_kind(kind, block)
    n = math.prod(shape)
    if kind == "none":
        return np.asarray(parts["values"], np.float32).reshape(shape)
    if kind == "bf16":
        bits = np.asarray(parts["bits"], np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    q = np.asarray(parts["q"])
    if kind == "int4":
        nibbles = np.stack([q & 0xF, q >> 4], axis=1).reshape(-1)[:n].astype(np.int8)
        q = np.where(nibbles > 7, nibbles - 16, nibbles).astype(np.int8)
    scale_N1 = np.asarray(parts["scale"], np.float32).reshape(-1, 1)
    q_NB = np.pad(q.astype(np.float32), (0, scale_N1.size * block - n)).reshape(-1, block)
    return (q_NB * scale_N1).reshape(-1)[:n].reshape(shape)


def wire_bytes(numel: int, kind: str, block: int = 256) -> tuple[int, int]:
    """(payload bytes, scale bytes) one replica sends for `numel` values."""
    check_kind(kind, block)
    payload = math.ceil(numel * BITS[kind] / 8)
    scales = math.ceil(numel / block) * SCALE_BYTES if kind in _QMAX else 0
    return payload, scales
