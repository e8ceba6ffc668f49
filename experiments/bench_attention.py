"""Block-sparse attention benchmark: blocks computed and forward+backward time, against dense masked attention.

    python -m experiments.bench_attention                               # seq 2k/8k x head dim 64/128 x 4 masks
    python -m experiments.bench_attention --seq-lens 1024 --head-dims 64

On CPU it times the XLA block-sparse path (pallas_kernels.block_sparse_attention_xla) against the dense masked
reference (pallas_kernels.reference_attention), both jitted, forward + backward (grad of sum(out * w)). The dense
reference does the same work whatever the mask, so it is timed once per (seq, head dim), under causal.
On a GPU it times the Pallas kernel against jax.nn.dot_product_attention (cuDNN), forward + backward, in bfloat16,
and reports TFLOP/s counted on the non-masked score elements only (4 * D FLOPs forward, 10 * D forward+backward).
The last line is a JSON summary.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from experiments.cli import exit_with
from experiments.timing import best_time
from pallas_kernels import (
    BlockSizes,
    block_sparse_attention,
    block_sparse_attention_xla,
    causal,
    document,
    full,
    make_block_mask,
    prefix_lm,
    reference_attention,
    sliding_window,
)


def masks(T: int, window: int, docs: int) -> dict:
    """The benchmark's masks at length T: causal, sliding window, `docs` equal documents (causal), prefix-LM."""
    segments = np.repeat(np.arange(docs, dtype=np.int32), -(-T // docs))[:T][None]
    return {
        "causal": causal(),
        f"sliding {window}": sliding_window(window),
        f"document x{docs}": causal() & document(segments),
        f"prefix-LM {T // 4}": prefix_lm(T // 4),
    }


def visible_elements(mask, T: int) -> int:
    """Score elements the mask keeps (the FLOPs a perfect kernel does), counted row block by row block."""
    total, kv = 0, np.arange(T)[None, :]
    for start in range(0, T, 1024):
        q = np.arange(start, min(start + 1024, T))[:, None]
        total += int(np.broadcast_to(np.asarray(mask(q, kv)), (len(q), T)).sum())
    return total


def time_fwd_bwd(fn, q, k, v, repeats: int) -> float:
    """Best wall time of one jitted forward + backward (grad of sum(out * w) w.r.t. q, k, v)."""
    w = jax.random.normal(jax.random.key(3), q.shape, jnp.float32)

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v)[0].astype(jnp.float32) * w)

    return best_time(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v, repeats=repeats)


def inputs(B, H, T, D, dtype):
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(kk, (B, H, T, D), dtype) for kk in keys]


def bench_cpu(args) -> dict:
    print(
        f"{'seq':>6s} {'D':>4s} {'mask':>16s} {'blocks':>7s} {'visited':>9s} {'dense ms':>9s} "
        f"{'blocksparse ms':>14s} {'speedup':>8s}"
    )
    summary = {}
    for T in args.seq_lens:
        for D in args.head_dims:
            q, k, v = inputs(args.batch, args.heads, T, D, jnp.float32)
            dense_s = time_fwd_bwd(functools.partial(reference_attention, mask=causal()), q, k, v, args.repeats)
            for name, mask in masks(T, args.window, args.docs).items():
                bm = make_block_mask(mask, T, T, BlockSizes(args.block, args.block))
                visited = int(np.sum(bm.kv_block_counts)) // max(1, int(np.prod(bm.batch_shape)))
                sparse_s = time_fwd_bwd(
                    functools.partial(block_sparse_attention_xla, block_mask=bm), q, k, v, args.repeats
                )
                print(
                    f"{T:6d} {D:4d} {name:>16s} {bm.density:7.1%} "
                    f"{visited:4d}/{bm.num_q_blocks * bm.num_kv_blocks:<4d} "
                    f"{dense_s * 1e3:9.1f} {sparse_s * 1e3:14.1f} {dense_s / sparse_s:7.2f}x",
                    flush=True,
                )
                key = f"{name.split()[0]}_T{T}_D{D}"
                summary[key] = {
                    "blocks": round(bm.density, 4),
                    "speedup": round(dense_s / sparse_s, 2),
                    "dense_ms": round(dense_s * 1e3, 1),
                    "blocksparse_ms": round(sparse_s * 1e3, 1),
                }
    return summary


def bench_gpu(args) -> dict:
    print(
        f"{'seq':>6s} {'D':>4s} {'mask':>16s} {'blocks':>7s} {'pallas TFLOP/s':>15s} {'cuDNN TFLOP/s':>14s} "
        f"{'pallas/cuDNN':>12s}"
    )
    summary = {}
    for T in args.seq_lens:
        for D in args.head_dims:
            q, k, v = inputs(args.batch, args.heads, T, D, jnp.bfloat16)
            bthd = [x.transpose(0, 2, 1, 3) for x in (q, k, v)]
            cudnn = {}
            for is_causal in (False, True):

                def dpa(q, k, v, is_causal=is_causal):
                    return (jax.nn.dot_product_attention(q, k, v, is_causal=is_causal, implementation="cudnn"),)

                cudnn[is_causal] = time_fwd_bwd(dpa, *bthd, args.repeats)
            for name, mask in {"full": full(), **masks(T, args.window, args.docs)}.items():
                bm = make_block_mask(mask, T, T, BlockSizes(args.block, args.block))
                flops = 10 * D * args.batch * args.heads * visible_elements(mask, T)
                pallas_s = time_fwd_bwd(functools.partial(block_sparse_attention, block_mask=bm), q, k, v, args.repeats)
                same_mask = {"full": False, "causal": True}.get(name)  # cuDNN runs only these two masks
                ref_s = None if same_mask is None else cudnn[same_mask]
                ref_tf = flops / ref_s / 1e12 if ref_s else float("nan")
                print(
                    f"{T:6d} {D:4d} {name:>16s} {bm.density:7.1%} {flops / pallas_s / 1e12:15.1f} "
                    f"{ref_tf:14.1f} {ref_s / pallas_s if ref_s else float('nan'):12.2f}",
                    flush=True,
                )
                summary[f"{name.split()[0]}_T{T}_D{D}"] = {
                    "blocks": round(bm.density, 4),
                    "pallas_tflops": round(flops / pallas_s / 1e12, 2),
                    **({"cudnn_tflops": round(ref_tf, 2)} if ref_s else {}),
                }
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench_attention",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--block", type=int, default=128, help="block_q = block_kv")
    p.add_argument("--window", type=int, default=1024, help="sliding window size")
    p.add_argument("--docs", type=int, default=8, help="documents per sequence for the document mask")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case; the best is reported")
    args = p.parse_args(argv)
    for name in ("batch", "heads", "block", "window", "docs", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if min(args.seq_lens) < 1 or min(args.head_dims) < 1:
        p.error("--seq-lens and --head-dims must be >= 1")

    device = jax.devices()[0]
    print(
        f"device: {device.platform} ({device.device_kind}); batch {args.batch}, heads {args.heads}, "
        f"blocks {args.block}x{args.block}, forward + backward"
    )
    summary = bench_gpu(args) if device.platform == "gpu" else bench_cpu(args)
    print(json.dumps({"device": device.device_kind, "results": summary}))
    return 0


if __name__ == "__main__":
    exit_with(main())
