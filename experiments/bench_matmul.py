"""Low-precision matmul benchmark: accuracy and speed of int8 / fp8 `scaled_matmul` against bf16 and float32 dots.

    python -m experiments.bench_matmul                    # the gpt-bench model's matmuls (M = batch * seq tokens)
    python -m experiments.bench_matmul --large            # plus 4096^3 and 8192^3 squares (meant for GPUs)
    python -m experiments.bench_matmul --impl pallas --block-m 128 --block-n 256 --block-k 64

For every shape (the gpt-bench layer's qkv, attention out, MLP in/out projections and the lm_head) and every mode
(int8 and fp8 e4m3 with per-channel or per-128-block scales, int8 weight-only with bf16 activations, plain bf16)
it reports, on Gaussian inputs:
  rel err      ||out - ref|| / ||ref|| against a float32 HIGHEST-precision product of the unquantized inputs;
  kernel-ref   the same against `reference_scaled_matmul` (the operands dequantized exactly, multiplied in float32):
               what the implementation itself adds, ~1e-7;
  ms, TFLOP/s  best of --repeats after warm-up, jitted, 2*M*K*N FLOPs; quantization is outside the timed region
               (`scaled_matmul` on pre-quantized operands), and "vs bf16" is the bf16 jnp.dot time over this one.
--impl auto runs the Pallas kernel on GPU/TPU and the XLA implementation on CPU. On CPU Pallas only runs in
interpret mode, which says nothing about speed: with --impl pallas on CPU the timing is skipped (accuracy is still
measured). CPU timings of the XLA path show XLA's CPU int8/fp8 dots, not what the formats buy on an accelerator.
The last line is a JSON summary.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
from jax import lax

from experiments.bench_train import GPT_BENCH
from experiments.cli import exit_with
from experiments.timing import best_time
from pallas_kernels.quantize import quantize
from pallas_kernels.quantized_matmul import MatmulBlocks, reference_scaled_matmul, resolve_impl, scaled_matmul

# name -> (x dtype or None for weight-only, w dtype, k_block)
MODES = {
    "int8 channel": ("int8", "int8", None),
    "int8 block128": ("int8", "int8", 128),
    "fp8 channel": ("float8_e4m3fn", "float8_e4m3fn", None),
    "fp8 block128": ("float8_e4m3fn", "float8_e4m3fn", 128),
    "int8 weight-only": (None, "int8", None),
}
BASELINES = ("f32 jnp.dot", "bf16 jnp.dot")


def model_shapes(tokens: int | None = None) -> dict:
    """name -> (M, K, N) for one gpt-bench layer's matmuls and the lm_head; M = batch * seq unless `tokens`."""
    m, d = GPT_BENCH.model, GPT_BENCH.data
    M = tokens or d.batch_size * d.seq_len
    E, D = m.resolved_head_dim, m.d_model
    return {
        "qkv": (M, D, (m.num_heads + 2 * m.num_kv_heads) * E),
        "attn out": (M, m.num_heads * E, D),
        "mlp in": (M, D, 2 * m.mlp_dim),
        "mlp out": (M, m.mlp_dim, D),
        "lm_head": (M, D, m.vocab_size),
    }


def rel_err(out, ref) -> float:
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def quantized_operands(x, w, mode: str):
    """(xq, x_scale, wq, w_scale, k_block) for one mode: x per row, w per column, or per 128-block of K."""
    x_dtype, w_dtype, k_block = MODES[mode]
    block = {} if k_block is None else {"block": k_block}
    wq, ws = quantize(w, w_dtype, axis=0, **block)
    xq, xs = (x.astype(jnp.bfloat16), None) if x_dtype is None else quantize(x, x_dtype, axis=1, **block)
    return xq, xs, wq, ws, k_block


def bf16_dot(x, w):
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def bench_shape(M, K, N, args, impl: str, timed: bool) -> dict:
    """mode -> {rel_err, kernel_vs_ref (quantized modes), seconds (if timed)} for one [M, K] x [K, N] shape."""
    kx, kw = jax.random.split(jax.random.key(M * 7 + K * 13 + N))
    x = jax.random.normal(kx, (M, K), jnp.float32)
    w = jax.random.normal(kw, (K, N), jnp.float32)
    ref = jnp.dot(x, w, precision=lax.Precision.HIGHEST)
    f32_dot, bf16 = jax.jit(jnp.dot), jax.jit(bf16_dot)
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    res = {
        "f32 jnp.dot": {"rel_err": rel_err(f32_dot(x, w), ref)},
        "bf16 jnp.dot": {"rel_err": rel_err(bf16(xb, wb), ref)},
    }
    if timed:
        res["f32 jnp.dot"]["seconds"] = best_time(f32_dot, x, w, repeats=args.repeats, warmup=2)
        res["bf16 jnp.dot"]["seconds"] = best_time(bf16, xb, wb, repeats=args.repeats, warmup=2)
    blocks = MatmulBlocks(args.block_m, args.block_n, args.block_k)
    for mode in MODES:
        xq, xs, wq, ws, k_block = quantized_operands(x, w, mode)
        fn = jax.jit(functools.partial(scaled_matmul, k_block=k_block, blocks=blocks, impl=impl))
        out = fn(xq, xs, wq, ws)
        r = res[mode] = {
            "rel_err": rel_err(out, ref),
            "kernel_vs_ref": rel_err(out, reference_scaled_matmul(xq, xs, wq, ws, k_block=k_block)),
        }
        if timed:
            r["seconds"] = best_time(fn, xq, xs, wq, ws, repeats=args.repeats, warmup=2)
        del out, xq, xs, wq, ws
    return res


def print_rows(name, M, K, N, res, timed: bool) -> None:
    flops = 2 * M * K * N
    bf16_s = res["bf16 jnp.dot"].get("seconds")
    for i, (mode, r) in enumerate(res.items()):
        label = f"{name:9s} {M:5d} {K:5d} {N:5d}" if i == 0 else " " * 27
        kref = f"{r['kernel_vs_ref']:10.1e}" if "kernel_vs_ref" in r else f"{'-':>10s}"
        if timed:
            s = r["seconds"]
            speed = f"{s * 1e3:9.3f} {flops / s / 1e12:8.3f} {bf16_s / s:7.2f}x"
        else:
            speed = f"{'-':>9s} {'-':>8s} {'-':>8s}"
        print(f"{label}  {mode:17s} {r['rel_err']:9.2e} {kref}  {speed}", flush=True)


def summarize(device, impl, timed, results) -> dict:
    """Worst errors over all shapes per mode; speed figures on the largest shape (by FLOPs)."""
    worst = {mode: max(r[mode]["rel_err"] for r, _ in results.values()) for mode in (*BASELINES, *MODES)}
    kref = max(r[mode]["kernel_vs_ref"] for r, _ in results.values() for mode in MODES)
    largest = max(results, key=lambda name: results[name][1][0] * results[name][1][1] * results[name][1][2])
    res, (M, K, N) = results[largest]
    summary = {
        "device": device.device_kind,
        "platform": device.platform,
        "jax": jax.__version__,
        "impl": impl,
        "timed": timed,
        "shapes": len(results),
        "max_rel_err_int8": round(worst["int8 channel"], 5),
        "max_rel_err_int8_block128": round(worst["int8 block128"], 5),
        "max_rel_err_fp8": round(worst["fp8 channel"], 5),
        "max_rel_err_fp8_block128": round(worst["fp8 block128"], 5),
        "max_rel_err_int8_weight_only": round(worst["int8 weight-only"], 5),
        "max_rel_err_bf16": round(worst["bf16 jnp.dot"], 5),
        "max_kernel_vs_reference": float(f"{kref:.3g}"),
        "largest_shape": {"name": largest, "M": M, "K": K, "N": N},
    }
    summary.update(speedup_int8_vs_bf16=None, speedup_fp8_vs_bf16=None, tflops=None)  # null when not timed
    if timed:
        bf16_s = res["bf16 jnp.dot"]["seconds"]
        summary["speedup_int8_vs_bf16"] = round(bf16_s / res["int8 channel"]["seconds"], 3)
        summary["speedup_fp8_vs_bf16"] = round(bf16_s / res["fp8 channel"]["seconds"], 3)
        summary["tflops"] = {mode: round(2 * M * K * N / r["seconds"] / 1e12, 4) for mode, r in res.items()}
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench_matmul",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--impl",
        choices=("auto", "xla", "pallas"),
        default="auto",
        help="scaled_matmul implementation (auto: Pallas on TPU, XLA on GPU and CPU)",
    )
    p.add_argument("--large", action="store_true", help="also 4096^3 and 8192^3 square products (for GPUs)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per case; the best is reported")
    p.add_argument("--quick", action="store_true", help="two small shapes (256 tokens), 2 repeats: for tests")
    defaults = MatmulBlocks()
    p.add_argument("--block-m", type=int, default=defaults.block_m, help="Pallas output tile rows")
    p.add_argument("--block-n", type=int, default=defaults.block_n, help="Pallas output tile columns")
    p.add_argument("--block-k", type=int, default=defaults.block_k, help="Pallas k-slice (per-channel modes)")
    args = p.parse_args(argv)
    for name in ("repeats", "block_m", "block_n", "block_k"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.quick:
        shapes = {k: v for k, v in model_shapes(tokens=256).items() if k in ("qkv", "mlp out")}
        args.repeats = min(args.repeats, 2)
    else:
        shapes = model_shapes()
    if args.large:
        shapes.update({f"sq {n}": (n, n, n) for n in (4096, 8192)})

    device = jax.devices()[0]
    impl = resolve_impl(args.impl)
    timed = not (impl == "pallas" and device.platform == "cpu")
    print(
        f"device: {device.platform} ({device.device_kind}); jax {jax.__version__}; impl {args.impl} -> {impl}; "
        f"blocks {args.block_m}x{args.block_n}x{args.block_k}; best of {args.repeats}"
    )
    if not timed:
        print("note: Pallas on CPU runs in interpret mode, which is not a speed measurement; timing skipped")
    print(
        f"{'shape':9s} {'M':>5s} {'K':>5s} {'N':>5s}  {'mode':17s} {'rel err':>9s} {'kernel-ref':>10s}  "
        f"{'ms':>9s} {'TFLOP/s':>8s} {'vs bf16':>8s}"
    )
    results = {}
    for name, (M, K, N) in shapes.items():
        res = bench_shape(M, K, N, args, impl, timed)
        print_rows(name, M, K, N, res, timed)
        results[name] = (res, (M, K, N))
    print(json.dumps(summarize(device, impl, timed, results)))
    return 0


if __name__ == "__main__":
    exit_with(main())
