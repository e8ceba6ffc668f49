"""The GPU report's timings: Pallas attention against a peer implementation, quantized matmuls against a bfloat16
``jnp.dot``, and the device's bfloat16 matmul peak, all measured in the same run.

Attention throughput counts only the FLOPs of score pairs the mask keeps (a causal mask does half the work of a full
one and is credited with half): 4*E per pair forward (QK^T and PV), 14*E per pair forward + backward (the backward
recomputes QK^T and adds dV, dP, dQ and dK). Each row is one (length, head dim, mask, implementation).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from experiments.timing import best_time
from pallas_kernels.quantize import quantize
from pallas_kernels.quantized_matmul import scaled_matmul


def matmul_peak(n: int, dtype=jnp.bfloat16, repeats: int = 5) -> float:
    """FLOP/s of the best of ``repeats`` n x n x n ``jnp.dot`` products in ``dtype`` on the default device."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    return 2 * n**3 / best_time(jax.jit(jnp.dot), a, b, repeats=repeats)


def kept_pairs(mask: str, T: int, window: int) -> int:
    """Score pairs a [T, T] mask keeps: full T^2, causal T(T+1)/2, sliding window sum of min(i + 1, window)."""
    if mask == "full":
        return T * T
    if mask == "causal":
        return T * (T + 1) // 2
    w = min(window, T)
    return w * (w + 1) // 2 + (T - w) * w


def _masks(window: int) -> dict:
    return {"full": pk.full(), "causal": pk.causal(), f"sliding_window({window})": pk.sliding_window(window)}


def _peer(impl: str, mask: str, window: int):
    """jax.nn.dot_product_attention ([B, T, H, E] layout) with the mask given as its own arguments."""
    kw = {"full": {}, "causal": {"is_causal": True}}.get(
        mask, {"is_causal": True, "local_window_size": (window - 1, 0)}
    )
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=impl, **kw)


def attention_speed(
    seqs, head_dims, *, tokens: int, width: int, window: int, block: int, peer: str, dtype, repeats: int, log
):
    """Rows {T, E, mask, impl, forward_tflops, train_tflops}: ``tokens`` per batch (B = tokens / T), ``width`` / E
    heads (no GQA, so the peer runs its fastest path)."""
    rows = []
    for T in seqs:
        for E in head_dims:
            B, H = max(1, tokens // T), width // E
            r = np.random.default_rng(0)
            q_BHTE, k_BHTE, v_BHTE = (jnp.asarray(r.normal(size=(B, H, T, E)), dtype) for _ in range(3))
            q_BTHE, k_BTHE, v_BTHE = (x.transpose(0, 2, 1, 3) for x in (q_BHTE, k_BHTE, v_BHTE))
            for mask_name, mask in _masks(window).items():
                bm = pk.make_block_mask(mask, T, T, pk.BlockSizes(block, block))
                impls = {
                    "pallas": (
                        lambda q, k, v, bm=bm: pk.block_sparse_attention(q, k, v, bm)[0],
                        q_BHTE,
                        k_BHTE,
                        v_BHTE,
                    ),
                    peer: (_peer(peer, mask_name, window), q_BTHE, k_BTHE, v_BTHE),
                }
                flops = kept_pairs(mask_name, T, window) * B * H * E
                for impl, (fn, q, k, v) in impls.items():
                    train = jax.grad(lambda q, k, v, fn=fn: fn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
                    t_fwd = best_time(jax.jit(fn), q, k, v, repeats=repeats)
                    t_train = best_time(jax.jit(train), q, k, v, repeats=repeats)
                    row = {
                        "T": T,
                        "E": E,
                        "B": B,
                        "H": H,
                        "mask": mask_name,
                        "impl": impl,
                        "forward_ms": t_fwd * 1e3,
                        "train_ms": t_train * 1e3,
                        "forward_tflops": 4 * flops / t_fwd / 1e12,
                        "train_tflops": 14 * flops / t_train / 1e12,
                    }
                    rows.append(row)
                    log(
                        f"attention T={T} E={E} {mask_name:22s} {impl:7s} forward {row['forward_tflops']:8.3f} "
                        f"TFLOP/s, forward+backward {row['train_tflops']:8.3f} TFLOP/s"
                    )
    return rows


def matmul_speed(sizes, *, repeats: int, log):
    """Rows {n, impl, tflops}: bf16 jnp.dot, and int8 / fp8 scaled_matmul (Pallas; XLA's for fp8 too) on
    operands quantized beforehand, so only the product is timed."""
    rows = []
    for n in sizes:
        r = np.random.default_rng(0)
        x = jnp.asarray(r.normal(size=(n, n)), jnp.bfloat16)
        w = jnp.asarray(r.normal(size=(n, n)), jnp.bfloat16)
        xi, xis = quantize(x, "int8", axis=1)
        wi, wis = quantize(w, "int8", axis=0)
        xf, xfs = quantize(x, "float8_e4m3fn")
        wf, wfs = quantize(w, "float8_e4m3fn")
        cases = {
            "bf16 jnp.dot": (jnp.dot, (x, w)),
            "int8 pallas (per channel)": (_scaled("pallas"), (xi, xis, wi, wis)),
            "fp8 pallas (per tensor)": (_scaled("pallas"), (xf, xfs, wf, wfs)),
            "fp8 xla (per tensor)": (_scaled("xla"), (xf, xfs, wf, wfs)),
        }
        for name, (fn, args) in cases.items():
            t = best_time(jax.jit(fn), *args, repeats=repeats)
            rows.append({"n": n, "impl": name, "ms": t * 1e3, "tflops": 2 * n**3 / t / 1e12})
            log(f"matmul {n}^3 {name:26s} {rows[-1]['tflops']:8.3f} TFLOP/s")
    return rows


def _scaled(impl: str):
    return lambda xq, xs, wq, ws: scaled_matmul(xq, xs, wq, ws, impl=impl, out_dtype=jnp.bfloat16)
