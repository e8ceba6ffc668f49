"""pallas_kernels.byte_transpose: the Triton kernel in the Pallas interpreter is the transpose, bit for bit; on a GPU
target an 8-bit operand goes through it, elsewhere (and for shapes not in whole tiles) it is ``x.T``. Its sm_90
compile is in tests/test_gpu_compile.py (the quantized_dot cases hold it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.byte_transpose import _tiles_transposed, byte_transpose


def test_the_kernel_is_the_transpose_bit_for_bit():
    x = jax.random.randint(jax.random.key(0), (128, 192), 0, 256, jnp.int32).astype(jnp.uint8)
    np.testing.assert_array_equal(np.asarray(_tiles_transposed(x, interpret=True)), np.asarray(x).T)


@pytest.mark.parametrize(
    "shape, dtype, backend, kernel",
    [
        ((128, 192), jnp.float8_e4m3fn, "gpu", True),
        ((128, 192), jnp.int8, "gpu", True),
        ((128, 100), jnp.float8_e4m3fn, "gpu", False),  # not whole 64 x 64 tiles
        ((128, 192), jnp.bfloat16, "gpu", False),  # two bytes: XLA transposes it in its own passes
        ((128, 192), jnp.float8_e4m3fn, "interpret", False),
        ((128, 192), jnp.float8_e4m3fn, "tpu", False),
    ],
)
def test_only_whole_tiles_of_bytes_on_a_gpu_take_the_kernel(shape, dtype, backend, kernel):
    x = jnp.zeros(shape, dtype)
    jaxpr = jax.make_jaxpr(lambda x: byte_transpose(x, backend))(x)
    assert ("pallas_call" in str(jaxpr)) == kernel
    out = jax.eval_shape(lambda x: byte_transpose(x, backend), x)
    assert out.shape == shape[::-1] and out.dtype == dtype
