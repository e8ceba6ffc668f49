"""The transpose of an 8-bit matrix as a kernel of its own on a GPU, so that XLA transposes the 1-byte values.

Why: an 8-bit wgmma reads both operands K-major, so dW = Xᵀ·dY on the Mosaic GPU matmul needs Xᵀ and dYᵀ. Written as
``xq.T``, the transpose is a layout to XLA, which it moves up through the quantizing convert into the bfloat16 and
float32 passes that made X and dY, and writes those transposed, some of them twice (the ~1B step's program moved 136
GB a step more than XLA's own fp8 one in such transposes: docs/results/fp8-step-traffic-2026-11-27.md). A custom
call fixes the layouts of its operand and result, so XLA keeps the producers as they are and this kernel moves the
bytes: one read, one write, of one byte each.

Elsewhere (CPU, the interpreters, TPU) and for shapes not in whole tiles it is ``x.T``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .kernel_inputs import like

TILE = 64  # rows and columns a program transposes: 4 KiB in, 4 KiB out


def _kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...].T


def byte_transpose(x_AB: jax.Array, backend: str) -> jax.Array:
    """x [A, B] of a 1-byte dtype -> [B, A]; on ``backend`` "gpu" (and whole TILE x TILE tiles) by a Triton kernel."""
    A, B = x_AB.shape
    if backend != "gpu" or jnp.dtype(x_AB.dtype).itemsize != 1 or A % TILE or B % TILE:
        return x_AB.T
    u8 = lax.bitcast_convert_type(x_AB, jnp.uint8)  # bytes are bytes: Triton's fp8 types vary by GPU
    return lax.bitcast_convert_type(_tiles_transposed(u8, interpret=False), x_AB.dtype)


def _tiles_transposed(x_AB: jax.Array, interpret: bool) -> jax.Array:
    """The Triton kernel (``interpret``: in the Pallas interpreter, for the tests): program (i, j) writes tile (i, j)
    of x as tile (j, i) of the result."""
    from jax.experimental.pallas import triton as pltriton

    A, B = x_AB.shape
    return pl.pallas_call(
        _kernel,
        grid=(A // TILE, B // TILE),
        in_specs=[pl.BlockSpec((TILE, TILE), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((TILE, TILE), lambda i, j: (j, i)),
        out_shape=like((B, A), x_AB.dtype, x_AB),
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="byte_transpose",
    )(x_AB)
