"""Block-sparse attention benchmark: blocks computed and forward+backward time, against dense masked attention.

    python -m experiments.bench_attention                               # seq 2k/8k x head dim 64/128 x 4 masks
    python -m experiments.bench_attention --seq-lens 1024 --head-dims 64 --masks causal

On CPU it times, forward + backward (grad of sum(out * w)), all jitted and in one interleaved run: the dense masked
reference (pallas_kernels.reference_attention), the block-list scan (block_sparse_attention_scan) and
block_sparse_attention_xla, which runs these host block masks as large tiles (tiled_attention_xla). The dense
reference does the same work whatever the mask, so it is timed once per (seq, head dim), under causal. "per FLOP"
is the tiled path's time per FLOP it computes over one square float32 matmul's, timed in the same run: FLOPs are
14 * D per score element it computes (forward q.k and p.v, backward q.k again, dO.v, dV, dK, dQ: 2 * D each),
masked tiles counted whole; the softmax's exp and the merges are time without FLOPs.
On a GPU it times the Pallas kernel against jax.nn.dot_product_attention (cuDNN), forward + backward, in bfloat16,
and reports TFLOP/s counted on the non-masked score elements only (4 * D FLOPs forward, 10 * D forward+backward).
The last line is a JSON summary.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource

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
from pallas_kernels.xla_attention import block_sparse_attention_scan, uses_tiled_path
from pallas_kernels.xla_tiled_attention import plan_block_mask

MASK_NAMES = ("causal", "sliding", "document", "prefix-LM")


def masks(T: int, window: int, docs: int) -> dict:
    """The benchmark's masks at length T: causal, sliding window, `docs` equal documents (causal), prefix-LM."""
    segments = np.repeat(np.arange(docs, dtype=np.int32), -(-T // docs))[:T][None]
    return {
        "causal": causal(),
        f"sliding {window}": sliding_window(window),
        f"document x{docs}": causal() & document(segments),
        f"prefix-LM {T // 4}": prefix_lm(T // 4),
    }


def _short(name: str) -> str:
    return name.split()[0]


def visible_elements(mask, T: int) -> int:
    """Score elements the mask keeps (the FLOPs a perfect kernel does), counted row block by row block."""
    total, kv = 0, np.arange(T)[None, :]
    for start in range(0, T, 1024):
        q = np.arange(start, min(start + 1024, T))[:, None]
        total += int(np.broadcast_to(np.asarray(mask(q, kv)), (len(q), T)).sum())
    return total


def fwd_bwd(fn):
    """Jitted forward + backward of ``fn``: (q, k, v, w) -> grad of sum(out * w) w.r.t. q, k, v."""

    def loss(q, k, v, w):
        return jnp.sum(fn(q, k, v)[0].astype(jnp.float32) * w)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def out_weights(q):
    """The w of sum(out * w), an input rather than drawn inside the timed function."""
    return jax.random.normal(jax.random.key(3), q.shape, jnp.float32)


def time_fwd_bwd(fn, q, k, v, repeats: int) -> float:
    """Best wall time of one jitted forward + backward (grad of sum(out * w) w.r.t. q, k, v)."""
    return best_time(fwd_bwd(fn), q, k, v, out_weights(q), repeats=repeats)


def interleaved_times(jobs: dict, repeats: int) -> dict:
    """Best wall time of each ``name: (fn, args)``, the repeats taken in turn so that on a shared machine every
    candidate sees the same background load. Each timed run follows an untimed one of the same function: the first
    run after another function pays for memory that one returned (measured up to 25% for the tiled path right after
    the dense reference)."""
    best = {name: float("inf") for name in jobs}
    for _ in range(repeats):
        for name, (fn, args) in jobs.items():
            best[name] = min(best[name], best_time(fn, *args, repeats=1, warmup=1))
    return best


class BackgroundLoad:
    """Share of the machine's CPU time that other processes used while the block ran (None off Linux): on a shared
    machine, a figure taken beside someone else's job is a different figure."""

    share: float | None = None

    @staticmethod
    def _ticks():
        try:
            with open("/proc/stat") as f:
                ticks = [int(x) for x in f.readline().split()[1:9]]
        except OSError:
            return None
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return sum(ticks), ticks[3] + ticks[4], (usage.ru_utime + usage.ru_stime) * os.sysconf("SC_CLK_TCK")

    def __enter__(self):
        self._start = self._ticks()
        return self

    def __exit__(self, *exc):
        end = self._ticks()
        if self._start and end:
            total, idle, own = (b - a for a, b in zip(self._start, end))
            self.share = max(0.0, (total - idle - own) / max(1, total))


def inputs(B, H, T, D, dtype):
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(kk, (B, H, T, D), dtype) for kk in keys]


def bench_cpu(args) -> dict:
    print(
        f"{'seq':>6s} {'D':>4s} {'mask':>16s} {'blocks':>7s} {'computed':>9s} {'dense ms':>9s} {'scan ms':>9s} "
        f"{'blocksparse ms':>14s} {'speedup':>8s} {'scan':>6s} {'per FLOP':>9s}"
    )
    summary = {}
    for T in args.seq_lens:
        for D in args.head_dims:
            summary.update(bench_cpu_shape(args, T, D))
    return summary


def bench_cpu_shape(args, T: int, D: int) -> dict:
    """One (seq, head dim): every mask's scan and block_sparse_attention_xla, the dense reference and one matmul,
    timed in turn."""
    q, k, v = inputs(args.batch, args.heads, T, D, jnp.float32)
    qkvw = (q, k, v, out_weights(q))
    per_element = 14 * D * args.batch * args.heads  # FLOPs per computed score element, forward + backward
    jobs = {"dense": (fwd_bwd(functools.partial(reference_attention, mask=causal())), qkvw)}
    block_masks, computed = {}, {}
    for name, mask in masks(T, args.window, args.docs).items():
        if _short(name) not in args.masks:
            continue
        bm = block_masks[name] = make_block_mask(mask, T, T, BlockSizes(args.block, args.block))
        if uses_tiled_path(bm):  # score elements the tiled path computes
            computed[name] = plan_block_mask(bm).computed_blocks() * args.block**2
        if not args.no_scan:
            scan = functools.partial(block_sparse_attention_scan, block_mask=bm)
            jobs[f"scan {name}"] = (fwd_bwd(scan), qkvw)
        jobs[name] = (fwd_bwd(functools.partial(block_sparse_attention_xla, block_mask=bm)), qkvw)
    # one square matmul with as many FLOPs as the largest case (n >~ 1000: near the machine's peak)
    n = round((per_element * max(computed.values(), default=T * T) / 2) ** (1 / 3))
    a = jax.random.normal(jax.random.key(5), (n, n), jnp.float32)
    jobs["matmul"] = (jax.jit(jnp.matmul), (a, a))
    with BackgroundLoad() as load:
        t = interleaved_times(jobs, args.repeats)
    matmul_s_per_flop = t["matmul"] / (2 * n**3)

    summary = {}
    for name, bm in block_masks.items():
        dense_s, sparse_s, scan_s = t["dense"], t[name], t.get(f"scan {name}")
        elements = computed.get(name)
        per_flop = sparse_s / (per_element * elements) / matmul_s_per_flop if elements else None
        print(
            f"{T:6d} {D:4d} {name:>16s} {bm.density:7.1%} "
            f"{_fmt(elements and elements / (T * T), '.1%', 'scan'):>9s} {dense_s * 1e3:9.1f} "
            f"{_fmt(scan_s and scan_s * 1e3, '.1f'):>9s} {sparse_s * 1e3:14.1f} {dense_s / sparse_s:7.2f}x "
            f"{_fmt(scan_s and dense_s / scan_s, '.2f', suffix='x'):>6s} {_fmt(per_flop, '.2f', suffix='x'):>9s}",
            flush=True,
        )
        summary[f"{_short(name)}_T{T}_D{D}"] = {
            "blocks": round(bm.density, 4),
            "visited": int(np.sum(bm.kv_block_counts)) // max(1, int(np.prod(bm.batch_shape))),
            "computed": elements and round(elements / (T * T), 4),
            "speedup": round(dense_s / sparse_s, 2),
            "dense_ms": round(dense_s * 1e3, 1),
            "blocksparse_ms": round(sparse_s * 1e3, 1),
            "scan_ms": scan_s and round(scan_s * 1e3, 1),
            "scan_speedup": scan_s and round(dense_s / scan_s, 2),
            "flop_ratio": per_flop and round(per_flop, 2),
            "matmul_gflops": round(1e-9 / matmul_s_per_flop, 1),
            "background_load": load.share and round(load.share, 2),
        }
    if load.share is not None:
        print(f"{'':>6s} other processes used {load.share:.0%} of the CPU during these rows", flush=True)
    return summary


def _fmt(x, spec: str, none: str = "-", suffix: str = "") -> str:
    return none if x is None else f"{x:{spec}}{suffix}"


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
    p.add_argument("--masks", nargs="+", default=list(MASK_NAMES), choices=MASK_NAMES, help="CPU: masks to time")
    p.add_argument("--no-scan", action="store_true", help="CPU: skip the block-list scan")
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
