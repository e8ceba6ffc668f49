"""int8 / fp8 quantization and matmuls: quantize round trips, the Pallas kernel (interpret mode) and the XLA path
against the exactly dequantized reference, accuracy against float32, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gaussian, rel
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pallas_kernels.quantize import amax, dequantize, qmax, quantize, round_to
from pallas_kernels.quantized_matmul import MatmulBlocks, quantized_matmul, reference_scaled_matmul, scaled_matmul

FP8 = ("float8_e4m3fn", "float8_e5m2")


# ----------------------------------------------------------------------------- quantize


@settings(max_examples=10, deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 300),
    axis=st.sampled_from([None, 0, 1, (0, 1)]),
    dtype=st.sampled_from(("int8",) + FP8),
    seed=st.integers(0, 2**16),
)
@example(rows=27, cols=224, axis=0, dtype="int8", seed=39501)
def test_quantize_round_trip_error_is_within_half_a_step(rows, cols, axis, dtype, seed):
    x = gaussian((rows, cols), seed) * 3
    q, s = quantize(x, dtype, axis=axis)
    assert q.dtype == jnp.dtype(dtype) and q.shape == x.shape
    assert s.shape == tuple(
        1 if axis is None or a in ((axis,) if isinstance(axis, int) else axis) else n for a, n in enumerate(x.shape)
    )
    err = np.abs(np.asarray(dequantize(q, s)) - np.asarray(x))
    s = np.broadcast_to(np.asarray(s), x.shape)
    if dtype == "int8":  # half a step, and the float32 rounding of the dequantized value (rows=27, cols=224,
        # axis=0, seed=39501: 0.02737188 against half a step of 0.02737175 at x = 3.48)
        assert np.all(err <= s / 2 * (1 + 1e-6) + np.abs(np.asarray(x)) * np.finfo(np.float32).eps)
    else:  # relative half-ulp for normal values, half the subnormal spacing below them
        info = jnp.finfo(jnp.dtype(dtype))
        bound = np.maximum(np.abs(np.asarray(x)) * 2.0 ** -(info.nmant + 1), s * 2.0 ** (info.minexp - info.nmant - 1))
        assert np.all(err <= bound * (1 + 1e-6))
    # the largest magnitude of each slice maps to the type's max
    assert np.isclose(float(jnp.max(jnp.abs(q.astype(jnp.float32)))), qmax(dtype), rtol=0.07)


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 500), block=st.sampled_from([16, 32, 128]), dtype=st.sampled_from(("int8",) + FP8))
def test_block_quantization_pads_partial_blocks(n, block, dtype):
    x = gaussian((3, n), n)
    q, s = quantize(x, dtype, axis=1, block=block)
    assert s.shape == (3, -(-n // block))
    np.testing.assert_allclose(s, np.asarray(amax(x, 1, block)) / qmax(dtype), rtol=1e-6)
    err = rel(dequantize(q, s, axis=1, block=block), x)
    assert err < (0.01 if dtype == "int8" else 0.08)


@pytest.mark.parametrize("dtype", ("int8",) + FP8)
def test_all_zero_tensor_and_rows_give_zeros_not_nan(dtype):
    x = jnp.zeros((4, 8)).at[1].set(gaussian((8,)))
    for axis in (None, 1):
        q, s = quantize(x, dtype, axis=axis)
        out = np.asarray(dequantize(q, s))
        assert np.all(np.isfinite(out)) and np.all(np.asarray(s) > 0)
        np.testing.assert_array_equal(out[[0, 2, 3]], 0)
    q, s = quantize(jnp.zeros((5, 7)), dtype)
    assert float(s.reshape(())) == 1.0 and not np.any(np.asarray(q.astype(jnp.float32)))
    out = quantized_matmul(
        jnp.zeros((5, 7)),
        jnp.zeros((7, 3)),
        x_dtype=dtype if dtype != "float8_e5m2" else "float8_e4m3fn",
        w_dtype="int8" if dtype == "int8" else "float8_e4m3fn",
    )
    np.testing.assert_array_equal(out, 0)


def test_non_finite_input_stays_non_finite():
    x = gaussian((4, 8)).at[2, 3].set(jnp.nan)
    q, s = quantize(x, "int8", axis=1)
    assert np.isnan(np.asarray(dequantize(q, s))[2]).all() and np.isfinite(np.asarray(dequantize(q, s))[0]).all()


@pytest.mark.parametrize("dtype", ("int8",) + FP8)
def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours(dtype):
    y = jnp.asarray(np.random.default_rng(1).uniform(-100, 100, 64), jnp.float32)
    keys = jax.random.split(jax.random.key(0), 4000)
    samples = np.asarray(jax.vmap(lambda k: round_to(y, dtype, k).astype(jnp.float32))(keys))
    nearest = np.asarray(round_to(y, dtype).astype(jnp.float32))
    if dtype == "int8":
        lo, hi = np.floor(np.asarray(y)), np.ceil(np.asarray(y))
        step = np.ones_like(lo)
    else:
        info = jnp.finfo(jnp.dtype(dtype))
        _, e = np.frexp(np.abs(np.asarray(y)))
        step = 2.0 ** (np.maximum(e - 1, info.minexp) - info.nmant)
        lo = np.sign(y) * np.floor(np.abs(y) / step) * step
        hi = lo + np.sign(y) * step
    assert np.all((samples == lo) | (samples == hi))  # only the two neighbours
    std_err = step / np.sqrt(len(keys))
    assert np.all(np.abs(samples.mean(0) - np.asarray(y)) < 5 * std_err)  # unbiased
    assert np.mean(samples != nearest) > 0.1  # and not round-to-nearest in disguise


def test_unsupported_dtype_and_bad_axes_are_named():
    x = gaussian((4, 8))
    with pytest.raises(ValueError, match="unsupported quantized dtype 'int4'"):
        quantize(x, "int4")
    with pytest.raises(ValueError, match="unsupported quantized dtype"):
        quantize(x, jnp.float16)
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        quantize(x, "int8", axis=2)
    with pytest.raises(ValueError, match="one integer axis"):
        quantize(x, "int8", axis=(0, 1), block=4)


# ----------------------------------------------------------------------------- scaled_matmul

PAIRS = [
    ("int8", "int8"),
    ("float8_e4m3fn", "float8_e4m3fn"),
    ("float8_e5m2", "float8_e4m3fn"),
    (None, "int8"),
    (None, "float8_e4m3fn"),
]


def operands(M, K, N, x_dtype, w_dtype, k_block, per_tensor=False, seed=0, x_float=jnp.float32):
    x, w = gaussian((M, K), seed, x_float), gaussian((K, N), seed + 1)
    blk = {} if k_block is None else {"block": k_block}
    wq, ws = quantize(w, w_dtype, axis=None if per_tensor else 0, **({} if per_tensor else blk))
    if x_dtype is None:
        return x, None, wq, ws
    xq, xs = quantize(x, x_dtype, axis=None if per_tensor else 1, **({} if per_tensor else blk))
    return xq, xs, wq, ws


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # each example compiles
@given(
    M=st.integers(1, 150),
    K=st.integers(1, 300),
    N=st.integers(1, 150),
    pair=st.sampled_from(PAIRS),
    k_block=st.sampled_from([None, None, 32, 64]),
    seed=st.integers(0, 1000),
)
def test_kernel_and_xla_equal_dequantized_reference(M, K, N, pair, k_block, seed):
    xq, xs, wq, ws = operands(M, K, N, *pair, k_block, seed=seed)
    ref = reference_scaled_matmul(xq, xs, wq, ws, k_block=k_block)
    blocks = MatmulBlocks(32, 64, 32)
    for impl in ("pallas", "xla"):
        out = scaled_matmul(xq, xs, wq, ws, k_block=k_block, impl=impl, blocks=blocks)
        assert out.shape == (M, N) and out.dtype == jnp.float32
        assert rel(out, ref) <= 1e-5, (impl, pair, k_block)


@pytest.mark.parametrize("pair", PAIRS[:3])
def test_per_tensor_scales_and_bfloat16_output(pair):
    xq, xs, wq, ws = operands(70, 130, 90, *pair, None, per_tensor=True)
    assert xs.shape == (1, 1) and ws.shape == (1, 1)
    ref = reference_scaled_matmul(xq, xs, wq, ws)
    for impl in ("pallas", "xla"):
        out = scaled_matmul(xq, xs, wq, ws, impl=impl, out_dtype=jnp.bfloat16)
        assert out.dtype == jnp.bfloat16 and rel(out, ref) < 4e-3  # bfloat16 rounding of the result


def test_weight_only_with_bfloat16_activations():
    x, _, wq, ws = operands(33, 96, 40, None, "int8", None, x_float=jnp.bfloat16)
    ref = reference_scaled_matmul(x, None, wq, ws)
    for impl in ("pallas", "xla"):
        assert rel(scaled_matmul(x, None, wq, ws, impl=impl), ref) < 1e-2  # bf16 weights in the product


@pytest.mark.parametrize(
    "x_dtype, w_dtype, k_block, bound",
    [
        ("int8", "int8", None, 0.015),
        ("int8", "int8", 128, 0.015),
        (None, "int8", None, 0.015),
        ("float8_e4m3fn", "float8_e4m3fn", None, 0.05),
        ("float8_e4m3fn", "float8_e4m3fn", 128, 0.05),
    ],
)
def test_accuracy_against_float32_on_gaussian_inputs(x_dtype, w_dtype, k_block, bound):
    """The issue's targets: int8 per channel <= 1.5%, fp8 e4m3 <= 5% (norm of the error / norm of the result)."""
    x, w = gaussian((256, 384), 3), gaussian((384, 512), 4)
    out = quantized_matmul(x, w, x_dtype=x_dtype, w_dtype=w_dtype, k_block=k_block, impl="xla")
    assert rel(out, np.asarray(x, np.float64) @ np.asarray(w, np.float64)) <= bound


def test_bad_operands_and_scales_are_named():
    xq, xs, wq, ws = operands(8, 16, 4, "int8", "int8", None)
    f8, f8s, _, _ = operands(8, 16, 4, "float8_e4m3fn", "float8_e4m3fn", None)
    with pytest.raises(ValueError, match="unsupported operand pair int8 x float8_e4m3fn"):
        scaled_matmul(xq, xs, quantize(gaussian((16, 4)), "float8_e4m3fn")[0], ws)
    with pytest.raises(ValueError, match="unsupported weight dtype float32"):
        scaled_matmul(f8, f8s, gaussian((16, 4)), ws)
    with pytest.raises(ValueError, match=r"expected x \[X, C\] and w \[C, Y\]"):
        scaled_matmul(xq, xs, wq[:15], ws)
    with pytest.raises(ValueError, match=r"w_scale must be \[1, 4 or 1\]"):
        scaled_matmul(xq, xs, wq, ws[:, :3])
    with pytest.raises(ValueError, match=r"x_scale must be \[8 or 1, 2\] for x \[8, 16\] with k_block 8"):
        scaled_matmul(xq, xs, wq, jnp.ones((2, 4)), k_block=8)
    with pytest.raises(ValueError, match="unknown quantized matmul impl 'cuda'"):
        scaled_matmul(xq, xs, wq, ws, impl="cuda")
    with pytest.raises(ValueError, match="weight-only .* needs float activations"):
        scaled_matmul(xq, None, wq, ws)
    with pytest.raises(ValueError, match="MatmulBlocks.block_k must be positive"):
        MatmulBlocks(block_k=0)


def test_kernel_under_jit_with_default_blocks():
    xq, xs, wq, ws = operands(300, 200, 260, "int8", "int8", None)
    out = jax.jit(lambda *a: scaled_matmul(*a, impl="pallas"))(xq, xs, wq, ws)
    assert rel(out, reference_scaled_matmul(xq, xs, wq, ws)) <= 1e-6


def test_auto_picks_pallas_on_tpu_only_and_gpu_blocks_follow_the_measured_table():
    from pallas_kernels.kernel_inputs import compile_target
    from pallas_kernels.quantized_matmul import default_blocks, resolve_impl

    assert resolve_impl("auto") == "xla"  # CPU: Pallas would only interpret
    with compile_target("gpu"):
        assert resolve_impl("auto") == "xla"  # XLA's fp8 product measured 2.1x the kernel's on an H100
    with compile_target("tpu"):
        assert resolve_impl("auto") == "pallas"
    assert resolve_impl("pallas") == "pallas"
    assert default_blocks("int8", "gpu") == MatmulBlocks(256, 128, 128, 8, 3)
    assert default_blocks("fp8", "gpu") == MatmulBlocks(128, 128, 64, 4, 4)
    assert default_blocks("weight_only", "gpu") == default_blocks("int8", "tpu") == MatmulBlocks()
    with pytest.raises(ValueError, match="MatmulBlocks.warps must be positive"):
        MatmulBlocks(warps=0)
