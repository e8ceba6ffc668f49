"""Sweep the GPU kernels' tiles on the device at hand: attention (forward, dQ and dK/dV tiles, Triton warps and
pipeline stages) and the scaled matmul (output tile, k step, warps, stages), printing each candidate's TFLOP/s.

The tables in ``pallas_kernels`` were first chosen to fit an H100's shared memory; this tool measures which of the
fitting candidates is fastest, so the tables can be set from figures. It also measures how far the fp8 matmuls
(Pallas and XLA) land from the exact float32 product of the same quantized operands. GPU only.

    python -m experiments.tune_gpu_tiles [--only attention,matmul,precision] [--T 8192]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from experiments.cli import exit_with
from experiments.timing import best_time
from pallas_kernels import quantized_matmul as qm
from pallas_kernels.gpu_tiles import KernelTiles, PassTiles, kernel_tiles
from pallas_kernels.quantize import quantize

FORWARD = [PassTiles(128, 128, 8, 2), PassTiles(128, 64, 4, 3), PassTiles(128, 64, 8, 3), PassTiles(128, 128, 8, 3),
           PassTiles(64, 64, 4, 3), PassTiles(128, 32, 4, 3), PassTiles(64, 128, 4, 2)]  # fmt: skip
DQ = [PassTiles(128, 128, 8, 2), PassTiles(128, 64, 8, 2), PassTiles(128, 64, 4, 3), PassTiles(64, 64, 4, 3),
      PassTiles(64, 128, 4, 2), PassTiles(128, 32, 4, 3)]  # fmt: skip
DKV = [PassTiles(128, 64, 8, 2), PassTiles(128, 128, 8, 2), PassTiles(64, 64, 4, 3), PassTiles(128, 32, 8, 2),
       PassTiles(128, 64, 4, 3), PassTiles(64, 128, 4, 2), PassTiles(128, 32, 4, 3)]  # fmt: skip


def _tflops(flops, fn, *args):
    return flops / best_time(jax.jit(fn), *args, repeats=10) / 1e12


def sweep_attention(T: int, log):
    for E in (64, 128):
        B, H = max(1, 32768 // T), 2048 // E
        r = np.random.default_rng(0)
        q, k, v = (jnp.asarray(r.normal(size=(B, H, T, E)), jnp.bfloat16) for _ in range(3))
        bm = pk.make_block_mask(pk.causal(), T, T, pk.BlockSizes(128, 128))
        pairs = T * (T + 1) // 2 * B * H * E
        base = kernel_tiles("gpu", E, jnp.bfloat16, pk.BlockSizes(128, 128))
        log(f"attention causal T={T} E={E} B={B} H={H}; table: {base}")

        def fwd(tiles):
            return lambda q, k, v: pk.block_sparse_attention(q, k, v, bm, tiles=tiles)[0]

        def train(tiles):
            f = fwd(tiles)
            return jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))

        for name, cands, build, flops, timed in (
            ("forward", FORWARD, lambda t: KernelTiles(t, base.dq, base.dkv), 4 * pairs, fwd),
            ("dq", DQ, lambda t: KernelTiles(base.forward, t, base.dkv), 14 * pairs, train),
            ("dkv", DKV, lambda t: KernelTiles(base.forward, base.dq, t), 14 * pairs, train),
        ):
            for t in cands:
                try:
                    got = f"{_tflops(flops, timed(build(t)), q, k, v):8.1f} TFLOP/s"
                except Exception as e:  # noqa: BLE001 - a candidate that does not fit is a result too
                    got = "FAIL " + str(e).splitlines()[0][:100]
                log(f"  E={E} {name:7s} rows={t.rows:3d} loop={t.loop:3d} warps={t.warps} stages={t.stages}: {got}")


MATMUL = [(128, 128, 128, 8, 3), (128, 128, 128, 4, 3), (128, 256, 128, 8, 3), (256, 128, 128, 8, 3),
          (128, 256, 64, 8, 4), (128, 128, 64, 4, 4), (128, 256, 128, 8, 4), (256, 128, 64, 8, 4),
          (64, 256, 128, 4, 3), (128, 128, 256, 8, 3)]  # fmt: skip


def sweep_matmul(n: int, log):
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(n, n)), jnp.bfloat16)
    w = jnp.asarray(r.normal(size=(n, n)), jnp.bfloat16)
    cases = {
        "fp8 per tensor": (*quantize(x, "float8_e4m3fn"), *quantize(w, "float8_e4m3fn")),
        "int8 per channel": (*quantize(x, "int8", axis=1), *quantize(w, "int8", axis=0)),
    }
    for name, (xq, xs, wq, ws) in cases.items():
        for bm, bn, bk, warps, stages in MATMUL:
            fn = lambda a, b, c, d, blocks=qm.MatmulBlocks(bm, bn, bk, warps, stages): qm.scaled_matmul(  # noqa: E731
                a, b, c, d, impl="pallas", blocks=blocks, out_dtype=jnp.bfloat16
            )
            try:
                got = f"{_tflops(2 * n**3, fn, xq, xs, wq, ws):8.1f} TFLOP/s"
            except Exception as e:  # noqa: BLE001
                got = "FAIL " + str(e).splitlines()[0][:100]
            log(f"  matmul {n}^3 {name:16s} {bm}x{bn}x{bk} warps={warps} stages={stages}: {got}")


def precision(log):
    """Relative error of the fp8 / int8 products against the exact float32 product of the dequantized operands."""
    r = np.random.default_rng(1)
    for X, C, Y in ((256, 512, 384), (1000, 1024, 3000), (4096, 8192, 4096)):
        x = jnp.asarray(r.normal(size=(X, C)), jnp.float32)
        w = jnp.asarray(r.normal(size=(C, Y)), jnp.float32)
        for fmt, axes in (("float8_e4m3fn", (None, None)), ("float8_e4m3fn", (1, 0)), ("int8", (1, 0))):
            xq, xs = quantize(x, fmt, axis=axes[0])
            wq, ws = quantize(w, fmt, axis=axes[1])
            exact = qm.reference_scaled_matmul(xq, xs, wq, ws)
            got = {impl: qm.scaled_matmul(xq, xs, wq, ws, impl=impl) for impl in ("pallas", "xla")}
            norm = jnp.linalg.norm(exact)
            errs = {impl: float(jnp.linalg.norm(g - exact) / norm) for impl, g in got.items()}
            errs["pallas vs xla"] = float(jnp.linalg.norm(got["pallas"] - got["xla"]) / norm)
            scale = "tensor" if axes[0] is None else "channel"
            log(f"  {fmt} per {scale} {X}x{C}x{Y}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))


PARTS = ("precision", "matmul", "attention")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.tune_gpu_tiles", description=__doc__)
    p.add_argument("--only", default=",".join(PARTS), metavar="P,P", help=f"parts to run, of {','.join(PARTS)}")
    p.add_argument("--T", type=int, default=8192, help="attention sequence length (a multiple of 128)")
    args = p.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    if not only or any(s not in PARTS for s in only):
        print(f"tune_gpu_tiles: error: --only {args.only!r}: parts are {', '.join(PARTS)}", file=sys.stderr)
        return 2
    if args.T < 128 or args.T % 128:
        print(f"tune_gpu_tiles: error: --T {args.T}: must be a positive multiple of 128", file=sys.stderr)
        return 2
    if jax.devices()[0].platform != "gpu":
        print("tune_gpu_tiles: error: no GPU here; the sweep times Triton kernels on a GPU", file=sys.stderr)
        return 2
    log = lambda s: print(s, flush=True)  # noqa: E731
    if "precision" in only:
        precision(log)
    if "matmul" in only:
        sweep_matmul(8192, log)
    if "attention" in only:
        sweep_attention(args.T, log)
    return 0


if __name__ == "__main__":
    exit_with(main())
