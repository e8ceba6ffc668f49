"""Time the Mosaic GPU scaled matmul (pallas_kernels.mosaic_matmul) against XLA's fp8 product and a bf16 jnp.dot on a
GPU, at M = N = K = size.

    python -m experiments.bench_mosaic_matmul            # sizes 4096 and 8192 (under a minute on an H100)
    python -m experiments.bench_mosaic_matmul --sizes 8192 --tiles '128,128,128,4,1;64,128'   # other tiles beside

Each item is the median of 20 timed calls (each waited for with jax.block_until_ready) after a warmup call, on random
inputs (zeros would flatter the tensor cores' power draw). Prints TFLOP/s and the ratio to bf16, and for the Mosaic
kernels the largest error relative to the largest magnitude of the exact float32 product of the same 8-bit operands.
An item that fails prints its error's first line; the run still exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

from experiments.cli import exit_with
from pallas_kernels.mosaic_matmul import MosaicTiles, mosaic_scaled_matmul
from pallas_kernels.targets import first_line

ITERS = 20
NT = (((1,), (1,)), ((), ()))  # a [M, K] . b [N, K] -> [M, N]


def median_seconds(fn, *args, iters: int = ITERS) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def operands(size: int, dtype, seed: int = 0):
    """a [size, size], b [size, size] (K-major: [N, K]) in dtype, and per-channel scales a [M, 1], b [1, N]."""
    ka, kb, ks = jax.random.split(jax.random.key(seed), 3)
    if jnp.dtype(dtype) == jnp.int8:
        a = jax.random.randint(ka, (size, size), -127, 128, jnp.int32).astype(jnp.int8)
        b = jax.random.randint(kb, (size, size), -127, 128, jnp.int32).astype(jnp.int8)
    else:
        a = (8 * jax.random.normal(ka, (size, size))).astype(dtype)
        b = (8 * jax.random.normal(kb, (size, size))).astype(dtype)
    a_scale = jax.random.uniform(ks, (size, 1), minval=0.5, maxval=2.0)
    b_scale = jax.random.uniform(jax.random.fold_in(ks, 1), (1, size), minval=0.5, maxval=2.0)
    return a, b, a_scale, b_scale


@jax.jit
def exact_product(a, b, a_scale, b_scale):
    prod = lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), NT, precision=lax.Precision.HIGHEST)
    return prod * a_scale * b_scale


def rel_error(out, ref) -> float:
    return float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))


def _mosaic(tiles: MosaicTiles | None):
    return jax.jit(lambda a, b, sa, sb: mosaic_scaled_matmul(a, b, sa, sb, out_dtype=jnp.bfloat16, tiles=tiles))


def items(size: int, tiles: tuple[MosaicTiles, ...] = ()):
    """(name, function, operands, whether to check against the exact product) for one size; each of ``tiles`` adds
    an fp8 row of the Mosaic kernel with those tiles."""
    mosaic = _mosaic(None)

    @jax.jit
    def xla_fp8(a, b, sa, sb):
        return (lax.dot_general(a, b, NT, preferred_element_type=jnp.float32) * sa * sb).astype(jnp.bfloat16)

    fp8 = lambda: operands(size, jnp.float8_e4m3fn)  # noqa: E731
    int8 = lambda: operands(size, jnp.int8)  # noqa: E731

    def bf16():
        a, b, _, _ = operands(size, jnp.float8_e4m3fn)
        return a.astype(jnp.bfloat16), b.astype(jnp.bfloat16).T  # [K, N], as a model holds it

    return [
        ("bf16 jnp.dot", jax.jit(jnp.dot), bf16, False),
        ("mosaic fp8 e4m3", mosaic, fp8, True),
        ("mosaic int8", mosaic, int8, True),
        ("xla fp8 dot_general", xla_fp8, fp8, True),
        *((f"mosaic fp8 {_short(t)}", _mosaic(t), fp8, True) for t in tiles),
    ]


def _short(t: MosaicTiles) -> str:
    return f"{t.tile_m},{t.tile_n},{t.tile_k},{t.stages},{t.consumers},{t.band}"


def parse_tiles(text: str) -> tuple[MosaicTiles, ...]:
    """'128,128,128,3,2,8;...' -> MosaicTiles (tile_m, tile_n, tile_k, stages, consumers, band; trailing ones
    may be left out)."""
    return tuple(MosaicTiles(*(int(x) for x in part.split(","))) for part in text.split(";") if part)


def bench(sizes=(4096, 8192), tiles: tuple[MosaicTiles, ...] = ()) -> list[dict]:
    print(f"device: {jax.devices()[0].device_kind}, median of {ITERS} calls")
    rows = []
    for size in sizes:
        flops = 2 * size**3
        bf16_s = None
        for name, fn, make, check in items(size, tiles):
            row = {"size": size, "item": name}
            try:
                args = make()
                seconds = median_seconds(fn, *args)
                row.update(ms=seconds * 1e3, tflops=flops / seconds / 1e12)
                if name.startswith("bf16"):
                    bf16_s = seconds
                if bf16_s:
                    row["vs_bf16"] = bf16_s / seconds
                if check:
                    row["rel_err"] = rel_error(fn(*args), exact_product(*args))
                line = f"{row['tflops']:7.1f} TFLOP/s {row['ms']:8.3f} ms"
                line += f"  {row['vs_bf16']:.2f}x bf16" if "vs_bf16" in row else ""
                line += f"  max err {row['rel_err']:.2e} of max |exact|" if "rel_err" in row else ""
            except Exception as e:  # noqa: BLE001 - one failing item must not stop the others
                row["error"] = line = first_line(e)
            rows.append(row)
            print(f"{size:6d}^3 {name:30s} {line}", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench_mosaic_matmul", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="4096,8192", help="M = N = K sizes, comma-separated")
    p.add_argument(
        "--tiles", default="", help="more fp8 rows with these MosaicTiles, e.g. '128,128,64,4;128,128,128,3,1'"
    )
    args = p.parse_args(argv)
    try:
        sizes = tuple(int(x) for x in args.sizes.split(","))
    except ValueError:
        message = f"--sizes {args.sizes!r}: give whole numbers, e.g. 4096,8192"
        print(f"bench_mosaic_matmul: error: {message}", file=sys.stderr)
        return 2
    try:
        tiles = parse_tiles(args.tiles)
    except (TypeError, ValueError) as e:
        print(f"bench_mosaic_matmul: error: --tiles {args.tiles!r}: {first_line(e)}", file=sys.stderr)
        return 2
    bench(sizes, tiles)
    return 0


if __name__ == "__main__":
    exit_with(main())
