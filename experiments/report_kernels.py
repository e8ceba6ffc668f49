"""The GPU report's correctness checks: every Pallas kernel against its reference, on whatever device runs them.

Attention (``block_sparse_attention``) is checked against ``reference_attention`` computed in float32 at the highest
matmul precision, forward (out, lse) and gradients (dq, dk, dv), for each mask kind in float32 and bfloat16 with
GQA, a length that is not a whole number of blocks, and T != S. Quantized matmuls (``scaled_matmul``) are checked
against the exact float32 product of the same quantized operands (XLA's error beside it), and the training
``quantized_dot`` (forward + custom_vjp) against its XLA twin. Errors are max |got - want| / max |want|.

Each check yields one row: {"check", "error_over_tolerance", "detail", "ok"}; a check that raises is the caller's
to record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from pallas_kernels.quantize import quantize
from pallas_kernels.quantized_matmul import reference_scaled_matmul, scaled_matmul
from pallas_kernels.quantized_training import QuantRecipe, new_amax_history, quantized_dot

# max error / max |reference|: float32 leaves room for TF32 tensor-core products, bfloat16 for its 8-bit mantissa
ATTENTION_TOLERANCE = {"float32": {"forward": 5e-3, "grad": 1e-2}, "bfloat16": {"forward": 2e-2, "grad": 6e-2}}
MATMUL_TOLERANCE = {"int8": 1e-5, "fp8": 1e-4, "weight_only": 1e-2, "quantized_dot": 2e-2}


@dataclasses.dataclass(frozen=True)
class CheckSizes:
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    seq: int  # not a multiple of the block: the ragged case
    block: int
    window: int
    matmul_shapes: tuple[tuple[int, int, int], ...]  # (X, C, Y), the last one ragged
    k_block: int
    every_combination: bool = True  # False (--quick): three masks; bfloat16 and T != S on the first only


def attention_masks(B: int, T: int, window: int) -> dict:
    segments = np.sort(np.random.default_rng(0).integers(0, 4, size=(B, T)), axis=1).astype(np.int32)
    return {
        "causal": pk.causal(),
        f"sliding_window({window})": pk.sliding_window(window),
        "causal & document": pk.causal() & pk.document(segments),
        f"prefix_lm({T // 4})": pk.prefix_lm(T // 4),
        f"global_tokens(4) | sliding_window({window})": pk.global_tokens(4) | pk.sliding_window(window),
    }


def _rel_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _qkv(B, H, K, T, S, E, dtype, seed):
    r = np.random.default_rng(seed)
    return tuple(jnp.asarray(r.normal(size=s), dtype) for s in ((B, H, T, E), (B, K, S, E), (B, K, S, E)))


def _attention_errors(mask, q, k, v, block: int) -> dict[str, float]:
    """Forward and gradient errors of the kernels against the float32 reference on the same inputs."""
    T, S = q.shape[2], k.shape[2]
    bm = pk.make_block_mask(mask, T, S, pk.BlockSizes(block, block))
    w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)

    def loss(fn, out_dtype):
        def f(q, k, v):
            out, lse = fn(q, k, v)
            return jnp.sum(out.astype(out_dtype).astype(jnp.float32) * w) + jnp.sum(jnp.sin(lse))

        return f

    kernel = lambda q, k, v: pk.block_sparse_attention(q, k, v, bm)
    reference = lambda q, k, v: pk.reference_attention(q, k, v, mask)
    got_out, got_lse = jax.jit(kernel)(q, k, v)
    got_grads = jax.jit(jax.grad(loss(kernel, q.dtype), argnums=(0, 1, 2)))(q, k, v)
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    with jax.default_matmul_precision("highest"):
        want_out, want_lse = jax.jit(reference)(*up)
        want_grads = jax.jit(jax.grad(loss(reference, q.dtype), argnums=(0, 1, 2)))(*up)
    errors = {"out": _rel_error(got_out, want_out), "lse": _rel_error(got_lse, want_lse)}
    errors.update({f"d{n}": _rel_error(g, r) for n, g, r in zip("qkv", got_grads, want_grads)})
    return errors


def attention_checks(sizes: CheckSizes, dtypes=("float32", "bfloat16")) -> Iterator[dict]:
    """One row per (mask, dtype, shape case) with the worst forward and gradient errors."""
    B, H, K, E, T = sizes.batch, sizes.heads, sizes.kv_heads, sizes.head_dim, sizes.seq
    shape_cases = {f"T=S={T}": (T, T), f"T={T // 2}, S={T}": (T // 2, T)}
    masks = attention_masks(B, T, sizes.window)
    if not sizes.every_combination:  # causal, document, and a union of two (global tokens | sliding window)
        masks = {k: v for i, (k, v) in enumerate(masks.items()) if i in (0, 2, 4)}
    for i, (mask_name, mask) in enumerate(masks.items()):
        for dtype in dtypes if sizes.every_combination or i == 0 else dtypes[:1]:
            for shape_name, (tq, tk) in shape_cases.items():
                if tq != tk and ("document" in mask_name or not (sizes.every_combination or i == 0)):
                    continue  # one set of segment ids covers queries and keys alike
                q, k, v = _qkv(B, H, K, tq, tk, E, jnp.dtype(dtype), seed=len(mask_name))
                errors = _attention_errors(mask, q, k, v, sizes.block)
                tol = ATTENTION_TOLERANCE[dtype]
                forward = max(errors["out"], errors["lse"])
                grad = max(errors["dq"], errors["dk"], errors["dv"])
                yield {
                    "check": f"attention {mask_name}, {dtype}, {shape_name}, H={H}/K={K}, E={E}",
                    "error_over_tolerance": max(forward / tol["forward"], grad / tol["grad"]),
                    "detail": (
                        f"forward {forward:.1e} (tol {tol['forward']:.0e}), grads {grad:.1e} (tol {tol['grad']:.0e})"
                    ),
                    "ok": forward <= tol["forward"] and grad <= tol["grad"],
                }


MATMUL_CASES = {  # name: (x dtype or None for weight-only float x, w dtype, scales: tensor | channel | block, kind)
    "int8 per channel": ("int8", "int8", "channel", "int8"),
    "int8 per block": ("int8", "int8", "block", "int8"),
    "fp8 per tensor": ("float8_e4m3fn", "float8_e4m3fn", "tensor", "fp8"),
    "fp8 per channel": ("float8_e4m3fn", "float8_e4m3fn", "channel", "fp8"),
    "fp8 e5m2 x e4m3 per block": ("float8_e5m2", "float8_e4m3fn", "block", "fp8"),
    "int8 weight-only per channel": (None, "int8", "channel", "weight_only"),
    "fp8 weight-only per channel": (None, "float8_e4m3fn", "channel", "weight_only"),
}


def _quantized_operands(X, C, Y, x_dtype, w_dtype, scales, k_block, seed=0):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.normal(size=(X, C)), jnp.bfloat16)
    w = jnp.asarray(r.normal(size=(C, Y)) / np.sqrt(C), jnp.bfloat16)
    axes = {"tensor": (None, None), "channel": (1, 0), "block": (1, 0)}[scales]
    block = {"block": k_block} if scales == "block" else {}
    wq, ws = quantize(w, w_dtype, axis=axes[1], **block)
    if x_dtype is None:
        return x, None, wq, ws
    xq, xs = quantize(x, x_dtype, axis=axes[0], **block)
    return xq, xs, wq, ws


def matmul_checks(sizes: CheckSizes) -> Iterator[dict]:
    """Pallas scaled_matmul against the exact float32 product of the dequantized operands, every case and shape.

    XLA's implementation is measured against the same reference and reported beside it, not used as the reference:
    on an H100 its fp8 products (cuBLAS) land 1e-4 to 2e-3 from the exact sum while the Pallas kernel lands at
    float32 rounding (experiments.tune_gpu_tiles, 2026-11-24).
    """
    for name, (x_dtype, w_dtype, scales, kind) in MATMUL_CASES.items():
        for X, C, Y in sizes.matmul_shapes:
            k_block = sizes.k_block if scales == "block" else None
            ops = _quantized_operands(X, C, Y, x_dtype, w_dtype, scales, k_block)
            run = lambda impl: jax.jit(lambda *a: scaled_matmul(*a, k_block=k_block, impl=impl, out_dtype=jnp.float32))(
                *ops
            )
            exact = jax.jit(lambda *a: reference_scaled_matmul(*a, k_block=k_block))(*ops)
            error, tol = _rel_error(run("pallas"), exact), MATMUL_TOLERANCE[kind]
            xla_error = _rel_error(run("xla"), exact)
            yield {
                "check": f"matmul {name}, {X}x{C}x{Y}",
                "error_over_tolerance": error / tol,
                "detail": f"{error:.1e} from the exact product (tol {tol:.0e}; XLA's {xla_error:.1e})",
                "ok": error <= tol,
            }


def quantized_dot_checks(sizes: CheckSizes) -> Iterator[dict]:
    """The training custom_vjp with Pallas products against the same with XLA's: value, dX, dW (and history)."""
    X, C, Y = sizes.matmul_shapes[0]
    r = np.random.default_rng(3)
    x = jnp.asarray(r.normal(size=(X, C)), jnp.bfloat16)
    w = jnp.asarray(r.normal(size=(C, Y)) / np.sqrt(C), jnp.bfloat16)
    g = jnp.asarray(r.normal(size=(X, Y)), jnp.float32)
    for recipe_name, delayed in (("fp8", True), ("fp8", False), ("int8", False), ("int8_weight_only", False)):
        history = new_amax_history(4) if delayed else None

        def run(impl):
            recipe = getattr(QuantRecipe, recipe_name)(impl=impl)
            f = lambda x, w: jnp.sum(quantized_dot(x, w, history, recipe).astype(jnp.float32) * g)
            return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w)

        (value_p, grads_p), (value_x, grads_x) = run("pallas"), run("xla")
        tol = MATMUL_TOLERANCE["quantized_dot"]
        error = max(_rel_error(value_p, value_x), *(_rel_error(a, b) for a, b in zip(grads_p, grads_x)))
        scaling = "delayed" if delayed else "current"
        yield {
            "check": f"quantized_dot {recipe_name} ({scaling} scaling) value + dX + dW, {X}x{C}x{Y}",
            "error_over_tolerance": error / tol,
            "detail": f"{error:.1e} from XLA's (tol {tol:.0e})",
            "ok": error <= tol,
        }
