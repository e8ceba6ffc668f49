"""The Mosaic GPU scaled matmul: exact against a float32 reference in the Mosaic GPU interpreter (CPU), the same as the
Triton kernel's result through ``scaled_matmul(lowering=)``, and compiled for an H100 (sm_90a) to PTX with fp8 / int8
wgmma, TMA bulk-tensor loads and no register spills.

Interpreter shapes stay tiny (64-wide tiles, the smallest wgmma M): the interpreter simulates every copy and barrier.
The compile runs in a subprocess, as tests/test_gpu_compile.py's do: the CUDA plugin must be found before JAX starts
its backends, and this process has started them."""

import functools
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compile_env

from pallas_kernels import quantized_matmul as qm
from pallas_kernels import targets
from pallas_kernels.mosaic_matmul import MosaicTiles, default_tiles, mosaic_scaled_matmul

SMALL = MosaicTiles(64, 64, 64, 2)


def _operands(M, N, K, dtype, seed=0):
    ka, kb, ks = jax.random.split(jax.random.key(seed), 3)
    if jnp.dtype(dtype) == jnp.int8:
        a = jax.random.randint(ka, (M, K), -127, 128, jnp.int32).astype(jnp.int8)
        b = jax.random.randint(kb, (N, K), -127, 128, jnp.int32).astype(jnp.int8)
    else:
        a = (4 * jax.random.normal(ka, (M, K))).astype(dtype)
        b = (4 * jax.random.normal(kb, (N, K))).astype(dtype)
    a_scale = jax.random.uniform(ks, (M, 1), minval=0.5, maxval=2.0)
    b_scale = jax.random.uniform(jax.random.fold_in(ks, 1), (1, N), minval=0.5, maxval=2.0)
    return a, b, a_scale, b_scale


def _reference(a, b, a_scale, b_scale):
    """The same scaled product in float64 (every 8-bit product and every partial sum here is exact)."""
    a64, b64 = np.asarray(a.astype(jnp.float32), np.float64), np.asarray(b.astype(jnp.float32), np.float64)
    return (a64 @ b64.T) * np.asarray(a_scale, np.float64) * np.asarray(b_scale, np.float64)


@pytest.mark.parametrize(
    "dtype, out_dtype, shape, per_channel",
    [
        (jnp.float8_e4m3fn, jnp.float32, (128, 128, 256), True),
        (jnp.float8_e5m2, jnp.bfloat16, (128, 64, 128), False),
        (jnp.int8, jnp.float32, (64, 128, 128), True),
        (jnp.float8_e4m3fn, jnp.bfloat16, (100, 72, 200), True),  # not whole tiles: padded and cut back
    ],
)
def test_interpreter_matches_the_exact_scaled_product(dtype, out_dtype, shape, per_channel):
    M, N, K = shape
    a, b, a_scale, b_scale = _operands(M, N, K, dtype)
    if not per_channel:
        a_scale, b_scale = a_scale[0, 0], b_scale[:1, :1]
    out = mosaic_scaled_matmul(a, b, a_scale, b_scale, out_dtype=out_dtype, tiles=SMALL, interpret=True)
    assert out.shape == (M, N) and out.dtype == jnp.dtype(out_dtype)
    want = _reference(a, b, a_scale, b_scale)
    # the exact product, scaled in float32 (a few ulps), then rounded once to out_dtype (bfloat16: half an ulp, 2^-9)
    rtol = 1e-6 if jnp.dtype(out_dtype) == jnp.float32 else 2**-8
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=rtol, atol=rtol * np.abs(want).max() / 64)


@pytest.mark.parametrize("consumers, band", [(2, 1), (1, 2)])
def test_resident_ctas_walk_several_output_tiles(monkeypatch, consumers, band):
    """Two resident CTAs (as if the GPU had 2 SMs) walk six output tiles each way the bands order them: every
    tile's scales and out tile pass through the same shared buffers and barriers, and each lands in its place."""
    from pallas_kernels import mosaic_matmul

    monkeypatch.setattr(mosaic_matmul, "sm_count", lambda: 2)
    tiles = MosaicTiles(64, 64, 64, 2, consumers=consumers, band=band)
    M, N, K = 64 * consumers * 2, 192, 128
    a, b, a_scale, b_scale = _operands(M, N, K, jnp.float8_e4m3fn, seed=3)
    out = mosaic_scaled_matmul(a, b, a_scale, b_scale, out_dtype=jnp.float32, tiles=tiles, interpret=True)
    want = _reference(a, b, a_scale, b_scale)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-6, atol=1e-6 * np.abs(want).max() / 64)


def test_bench_takes_tiles_and_refuses_bad_ones_with_one_line(capsys):
    from experiments import bench_mosaic_matmul as bench

    assert bench.parse_tiles("128,128,64,6;64,128") == (MosaicTiles(128, 128, 64, 6), MosaicTiles(64, 128))
    for text, why in (("12,x", "invalid literal"), ("128,256,128", "B tile is over 16 KiB")):
        assert bench.main(["--tiles", text]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"bench_mosaic_matmul: error: --tiles {text!r}") and why in err and "\n" not in err


@pytest.mark.parametrize(
    "a_dtype, b_dtype, a_scale, b_scale, message",
    [
        (jnp.float8_e5m2, jnp.float8_e4m3fn, (64, 1), (1, 64), "mixed fp8"),
        (jnp.int8, jnp.float8_e4m3fn, (64, 1), (1, 64), "both be int8"),
        (jnp.float8_e4m3fn, jnp.float8_e4m3fn, (64, 2), (1, 64), "block-wise"),
        (jnp.float8_e4m3fn, jnp.float8_e4m3fn, (64, 1), (2, 64), "block-wise"),
    ],
)
def test_unsupported_operands_and_scales_are_refused(a_dtype, b_dtype, a_scale, b_scale, message):
    a, b = jnp.zeros((64, 128), a_dtype), jnp.zeros((64, 128), b_dtype)
    with pytest.raises(ValueError, match=message):
        mosaic_scaled_matmul(a, b, jnp.ones(a_scale), jnp.ones(b_scale), interpret=True)


def test_tiles_are_checked():
    with pytest.raises(ValueError, match="multiple of 64"):
        MosaicTiles(tile_m=96)
    with pytest.raises(ValueError, match="shared memory"):
        a = jnp.zeros((256, 256), jnp.float8_e4m3fn)
        mosaic_scaled_matmul(a, a, 1.0, 1.0, tiles=MosaicTiles(256, 128, 128, 4), interpret=True)
    with pytest.raises(ValueError, match="B tile is over 16 KiB"):
        MosaicTiles(64, 256, 128)
    for out_dtype in (jnp.bfloat16, jnp.float32):
        assert default_tiles(out_dtype).smem_bytes(out_dtype) <= 232448
    with pytest.raises(ValueError, match="1 or 2 compute warpgroups"):
        MosaicTiles(consumers=3)


@pytest.mark.parametrize(
    "dtype, per_channel, w_layout",
    [(jnp.int8, True, "CY"), (jnp.float8_e4m3fn, False, "YC")],
)
def test_scaled_matmul_mosaic_lowering_equals_triton(caplog, dtype, per_channel, w_layout):
    """scaled_matmul(lowering="mosaic") in the Mosaic GPU interpreter gives the Triton kernel's result (the Pallas
    interpreter) on the same operands, with the weight as [C, Y] or K-major [Y, C], and says which ran."""
    M, N, K = 64, 64, 128
    x, w_NK, x_scale, w_scale = _operands(M, N, K, dtype, seed=1)
    if not per_channel:
        x_scale, w_scale = x_scale[:1], w_scale[:, :1]
    w = w_NK if w_layout == "YC" else w_NK.T
    run = functools.partial(qm.scaled_matmul, x, x_scale, w, w_scale, impl="pallas", w_layout=w_layout)
    qm._logged.clear()
    with caplog.at_level(logging.INFO, logger="jaxlm.kernels"):
        mosaic = run(lowering="mosaic", blocks=SMALL)
    assert "Mosaic GPU interpreter" in caplog.text
    triton = run(lowering="triton")
    np.testing.assert_allclose(np.asarray(mosaic), np.asarray(triton), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(mosaic, np.float64), _reference(x, w_NK, x_scale, w_scale), rtol=1e-6)


@pytest.mark.parametrize(
    "x_dtype, w_dtype, k_block, kw, message",
    [
        (jnp.float8_e5m2, jnp.float8_e4m3fn, None, {}, "cannot take mixed operand dtypes"),
        (jnp.int8, jnp.int8, 64, {}, "cannot take block-wise scales"),
        (jnp.bfloat16, jnp.int8, None, {}, "cannot take weight-only"),
        (jnp.int8, jnp.int8, None, {"out_dtype": jnp.float16}, "cannot take out_dtype float16"),
        (jnp.int8, jnp.int8, None, {"blocks": qm.MatmulBlocks()}, "cannot take Triton blocks"),
        (jnp.int8, jnp.int8, None, {"backend": "tpu", "interpret": False}, "picks a GPU kernel"),
    ],
)
def test_scaled_matmul_refuses_what_mosaic_cannot_take(x_dtype, w_dtype, k_block, kw, message):
    x, w = jnp.zeros((64, 128), x_dtype), jnp.zeros((128, 64), w_dtype)
    n = 1 if k_block is None else 128 // k_block
    x_scale = None if x_dtype == jnp.bfloat16 else jnp.ones((64, n))
    with pytest.raises(ValueError, match=message):
        qm.scaled_matmul(x, x_scale, w, jnp.ones((n, 64)), k_block=k_block, impl="pallas", lowering="mosaic", **kw)
    with pytest.raises(ValueError, match="unknown lowering"):
        qm.scaled_matmul(x, x_scale, w, jnp.ones((n, 64)), impl="pallas", lowering="cuda")


@pytest.mark.parametrize("delayed", [True, False])
def test_fp8_training_with_e4m3_gradients_runs_every_product_on_mosaic(delayed):
    """QuantRecipe.fp8_e4m3 quantizes dY in e4m3 like the forward's operands, so the backward's dX and dW are
    e4m3 x e4m3 and the Mosaic GPU kernel takes all three products (``lowering="mosaic"`` raises for one it cannot
    take, as it does for the default recipe's e5m2 x e4m3 backward); in its interpreter they equal XLA's products of
    the same quantized operands."""
    from pallas_kernels.quantized_training import QuantRecipe, new_amax_history, quantized_dot

    kx, kw, kg = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(kx, (64, 128), jnp.float32)
    w = jax.random.normal(kw, (128, 64), jnp.float32) / 8
    g = jax.random.normal(kg, (64, 64), jnp.float32)
    history = new_amax_history(4) if delayed else None

    def grads(recipe):
        y, vjp = jax.vjp(lambda x, w, h: quantized_dot(x, w, h, recipe), x, w, history)
        return (y, *vjp(g)[:2])

    mosaic = grads(QuantRecipe.fp8_e4m3(impl="pallas", lowering="mosaic", blocks=SMALL))
    xla = grads(QuantRecipe.fp8_e4m3(impl="xla"))
    for name, got, want in zip(("y", "dx", "dw"), mosaic, xla):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=name)
    with pytest.raises(ValueError, match="cannot take mixed operand dtypes"):
        grads(QuantRecipe.fp8(impl="pallas", lowering="mosaic", blocks=SMALL))


_COMPILE = """
import sys
from pallas_kernels import targets
targets.enable_plugin(targets.plugin_dir())
import jax, jax.numpy as jnp
from pallas_kernels.mosaic_matmul import mosaic_scaled_matmul
S = jax.ShapeDtypeStruct
for dtype in (jnp.float8_e4m3fn, jnp.int8):
    fn = lambda a, b, sa, sb: mosaic_scaled_matmul(a, b, sa, sb, out_dtype=jnp.bfloat16)
    # 8192^3: 4096 output tiles over 132 resident CTAs, so each walks its share of them
    ab, scales = S((8192, 8192), dtype), (S((8192, 1), jnp.float32), S((1, 8192), jnp.float32))
    targets.compile_for_gpu(fn, ab, ab, *scales)
sys.stdout.flush()
print("COMPILED", file=sys.stderr)
"""


def test_compiles_for_h100_with_fp8_and_int8_wgmma_tma_and_no_spills():
    if not targets.installed(targets.CUDA_PLUGIN, targets.plugin_dir()):
        pytest.skip(f"no CUDA plugin in {targets.plugin_dir()} (pallas_kernels.targets.install_plugin installs it)")
    env = compile_env(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1")
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=300, env=env, cwd=os.getcwd()
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "COMPILED" in proc.stderr, text[-3000:]
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in text
    assert "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8" in text
    assert "cp.async.bulk.tensor" in text
    assert "setmaxnreg.dec.sync.aligned.u32 \t40;" in text  # the memory warpgroup gives its registers away
    spills = [line for line in text.splitlines() if "spill stores" in line]
    assert len(spills) == 2 and all("0 bytes spill stores, 0 bytes spill loads" in s for s in spills), spills
