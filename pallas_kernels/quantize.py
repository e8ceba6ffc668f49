"""Symmetric quantization to int8 and fp8 with amax-based scales: per tensor, per channel, or per block.

``x ≈ q * scale`` where ``q = round(x / scale)`` in the target type and ``scale = amax / qmax``: 127 for int8,
448 for float8_e4m3fn (weights, activations), 57344 for float8_e5m2 (gradients: range over precision). The scale's
shape is x's shape with every axis in ``axis`` reduced to 1 (per channel: reduce the contraction axis), or, with
``block``, that axis cut into ceil(n / block) blocks (DeepSeek-V3 style fine-grained scales).

An all-zero slice gets scale 1 (q = 0, so it dequantizes to 0, never NaN); non-finite inputs stay non-finite.
Values beyond the range saturate (a delayed scale can be smaller than the current amax).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .kernel_inputs import pad_axis

QUANT_DTYPES = {"int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2}
FLOAT8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))

Axis = int | tuple[int, ...] | None


def quant_dtype(dtype) -> jnp.dtype:
    """A supported quantized dtype from a name or a dtype; anything else is a ValueError naming the choices."""
    try:
        dt = jnp.dtype(QUANT_DTYPES.get(dtype, dtype))
    except TypeError:
        dt = None
    if dt is None or dt not in {jnp.dtype(d) for d in QUANT_DTYPES.values()}:
        raise ValueError(f"unsupported quantized dtype {dtype!r}; choose one of {', '.join(QUANT_DTYPES)}")
    return dt


def qmax(dtype) -> float:
    """The largest representable magnitude used for scaling: 127 (symmetric int8) or the fp8 type's max."""
    dt = quant_dtype(dtype)
    return 127.0 if dt == jnp.int8 else float(jnp.finfo(dt).max)


def _axes(axis: Axis, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"quantization axis {a} is out of range for an array of rank {ndim}")
    return tuple(sorted(a % ndim for a in axes))


def _block_axis(axis: Axis, ndim: int, block: int) -> int:
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise ValueError(f"block-wise quantization needs one integer axis to cut into blocks, got axis={axis!r}")
    if block <= 0:
        raise ValueError(f"quantization block must be positive, got {block}")
    return _axes(axis, ndim)[0]


def _blocked(x: jax.Array, axis: int, block: int) -> jax.Array:
    """x with `axis` padded (zeros) to whole blocks and split into [.., n_blocks, block, ..]."""
    nb = -(-x.shape[axis] // block)
    x = pad_axis(x, axis, nb * block)
    return x.reshape(x.shape[:axis] + (nb, block) + x.shape[axis + 1 :])


def amax(x: jax.Array, axis: Axis = None, block: int | None = None) -> jax.Array:
    """max |x| over `axis` (kept as size-1 dims), or per block of `block` along one axis; float32."""
    x = jnp.abs(x.astype(jnp.float32))
    if block is None:
        return jnp.max(x, axis=_axes(axis, x.ndim), keepdims=True)
    a = _block_axis(axis, x.ndim, block)
    return jnp.max(_blocked(x, a, block), axis=a + 1)


def scale_from_amax(amax_: jax.Array, dtype, margin: float = 0.0) -> jax.Array:
    """amax / qmax * 2**margin, with 1 where that is 0 (an all-zero slice must not divide by zero)."""
    s = amax_.astype(jnp.float32) * (2.0**margin / qmax(dtype))
    return jnp.where(s == 0, 1.0, s)


def expand_scale(scale: jax.Array, shape: tuple[int, ...], axis: Axis = None, block: int | None = None) -> jax.Array:
    """A block-wise scale repeated back to the full length of its axis (other layouts broadcast as they are)."""
    if block is None:
        return scale
    a = _block_axis(axis, len(shape), block)
    return jax.lax.slice_in_dim(jnp.repeat(scale, block, axis=a), 0, shape[a], axis=a)


def quantize(
    x: jax.Array,
    dtype,
    axis: Axis = None,
    block: int | None = None,
    *,
    scale: jax.Array | None = None,
    key: jax.Array | None = None,
    margin: float = 0.0,
) -> tuple[jax.Array, jax.Array]:
    """x -> (q, scale) with x ≈ q * scale (scale float32, broadcastable to x after `expand_scale`).

    axis: the axes one scale spans (None: the whole tensor; the contraction axis: per channel). block: cut that
    single axis into blocks of this many elements instead. scale: use this scale (delayed scaling) instead of the
    one from x's amax. key: stochastic rounding (unbiased: E[q * scale] = x), for gradients.
    """
    dt = quant_dtype(dtype)
    if scale is None:
        scale = scale_from_amax(amax(x, axis, block), dt, margin)
    y = x.astype(jnp.float32) / expand_scale(scale, x.shape, axis, block)
    return round_to(y, dt, key), scale.astype(jnp.float32)


def dequantize(
    q: jax.Array, scale: jax.Array, axis: Axis = None, block: int | None = None, dtype=jnp.float32
) -> jax.Array:
    return (q.astype(jnp.float32) * expand_scale(scale, q.shape, axis, block)).astype(dtype)


def round_to(y: jax.Array, dtype, key: jax.Array | None = None) -> jax.Array:
    """float32 values already in the target's range (after scaling) -> the quantized type, saturating.

    Round to nearest (even), or stochastically with `key`: floor(|y| / ulp + u) * ulp with u ~ U[0, 1), where ulp is
    the spacing of the target type at |y| (1 for int8; 2**(e - mantissa bits) for fp8, subnormals included), so
    the result is exactly representable and the cast after it exact.
    """
    dt = quant_dtype(dtype)
    limit = qmax(dt)
    if key is not None:
        if dt == jnp.int8:
            ulp = jnp.ones_like(y)
        else:
            info = jnp.finfo(dt)
            _, exp = jnp.frexp(jnp.abs(y))  # |y| = m * 2**exp with m in [0.5, 1)
            ulp = jnp.exp2((jnp.maximum(exp - 1, info.minexp) - info.nmant).astype(jnp.float32))
        u = jax.random.uniform(key, y.shape, jnp.float32)
        y = jnp.sign(y) * jnp.floor(jnp.abs(y) / ulp + u) * ulp
    y = jnp.clip(y, -limit, limit)  # saturate: float8_e4m3fn has no inf, an out-of-range cast would be NaN
    if dt == jnp.int8:
        return jnp.round(y).astype(jnp.int8)
    return y.astype(dt)
