"""fp8 / int8 scaled matmul as a Mosaic GPU (Hopper, sm_90) Pallas kernel: ``(a @ b.T) * a_scale * b_scale``.

Why not the Triton kernel of ``quantized_matmul``: on an H100 it reached 357 TFLOP/s fp8 at 8192^3, half a bf16
``jnp.dot``. This kernel drives the Hopper hardware directly: TMA bulk-tensor copies feed a ``stages``-deep
shared-memory ring, ``wgmma`` reads both operands from shared memory (accumulating in float32, int32 for int8),
and one wgmma stays in flight while the next tile lands (``delay_release=1``).

8-bit wgmma only reads K-major operands (no transpose bit for 1-byte types), so the weight is stored as
``b_NK`` [N, K] once, and never transposed per call. Both operands must have the same dtype: Mosaic's wgmma
refuses mixed e5m2 x e4m3 (PTX allows it), so mixed fp8 is a ValueError here.

Scales are applied once per output tile in the epilogue: a row vector a_scale [M] and a column vector b_scale [N]
(per-tensor scales are broadcast to them in the wrapper; 4 bytes a row, nothing next to the product). Block-wise
scales along K would need the partial sums rescaled per k-slice (a second accumulator); refused with ValueError.

Shape suffixes: a_MK [M, K] @ b_NK [N, K].T -> out_MN [M, N]; M rows tiled by tile_m, N columns by tile_n,
K the contraction by tile_k. Shapes that are not whole tiles are zero-padded (zeros add nothing) and cut back.

It runs on CPU in the Mosaic GPU interpreter (``interpret=True``), which cannot read a transposed shared-memory
view, so there (only) the b tile is transposed into a scratch buffer before the wgmma.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .kernel_inputs import like
from .targets import H100_SHARED_MEMORY_PER_BLOCK

FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
SMEM_BYTES = H100_SHARED_MEMORY_PER_BLOCK  # an H100's opt-in shared memory per block (227 KiB)


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """One CTA (one warpgroup) computes a [tile_m, tile_n] output tile, stepping over K in tile_k slices through a
    ``stages``-deep TMA ring. 128x128x128x4: a 128x128 f32 accumulator is 128 registers a thread (256 would
    spill), a 128-byte k row is the widest swizzle, and 4 stages x 32 KiB + a 64 KiB f32 out tile fit 227 KiB."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 128
    stages: int = 4

    def __post_init__(self):
        if self.tile_m % 64 or self.tile_m <= 0:
            raise ValueError(f"MosaicTiles.tile_m must be a positive multiple of 64 (wgmma's M), got {self.tile_m}")
        if self.tile_n % 8 or not 0 < self.tile_n <= 256:
            raise ValueError(f"MosaicTiles.tile_n must be a multiple of 8 up to 256 (wgmma's N), got {self.tile_n}")
        if self.tile_k % 32 or self.tile_k <= 0:
            raise ValueError(
                f"MosaicTiles.tile_k must be a positive multiple of 32 (32 bytes of 8-bit), got {self.tile_k}"
            )
        if self.stages < 2:
            raise ValueError(f"MosaicTiles.stages must be at least 2 (one wgmma stays in flight), got {self.stages}")

    def smem_bytes(self, out_dtype) -> int:
        """Shared memory the kernel asks for: the operand ring, the out tile, the two scale vectors."""
        ring = self.stages * (self.tile_m + self.tile_n) * self.tile_k
        return ring + self.tile_m * self.tile_n * jnp.dtype(out_dtype).itemsize + 4 * (self.tile_m + self.tile_n)


def _lowering_semantics():
    # Pinned: jax 0.10 defaults to Lane, 0.11 to Warpgroup. Lane lets the epilogue name the scales' register
    # layouts, and exists in both (the kernel also compiles with Warpgroup on 0.10.2: same registers, no spills).
    return plgpu.LoweringSemantics.Lane


def _interpret_params(interpret):
    """``interpret=True`` -> the Mosaic GPU interpreter's params (a private module: its path may move)."""
    if interpret is True:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        return InterpretGPUParams()
    return interpret or None


def _operand_kind(a_MK, b_NK) -> str:
    da, db = jnp.dtype(a_MK.dtype), jnp.dtype(b_NK.dtype)
    if da == db == jnp.int8:
        return "int8"
    if da in FP8 and db in FP8:
        if da != db:
            raise ValueError(
                f"mosaic_scaled_matmul: mixed fp8 {da} x {db} is not supported (Mosaic's wgmma needs one operand "
                f"dtype); quantize both to the same fp8 type or use quantized_matmul.scaled_matmul"
            )
        return "fp8"
    raise ValueError(f"mosaic_scaled_matmul: operands must both be int8 or the same fp8 dtype, got {da} x {db}")


def _scale_vector(scale, n: int, axis: int, name: str, shape: str) -> jax.Array:
    """A per-tensor or per-channel scale as a float32 vector of length n; anything else is a ValueError."""
    scale = jnp.asarray(scale, jnp.float32)
    if scale.ndim == 2 and scale.shape[axis] in (1, n) and scale.shape[1 - axis] == 1:
        return jnp.broadcast_to(scale.reshape(-1), (n,))
    if scale.ndim == 0 or scale.shape == (1,):
        return jnp.broadcast_to(scale.reshape(()), (n,))
    raise ValueError(
        f"mosaic_scaled_matmul: {name} must be a scalar or {shape} (per tensor or per channel), got "
        f"{list(scale.shape)}; block-wise scales along K are not supported by this kernel"
    )


def _transforms(minor: int, dtype):
    """Tile rows of 8 and swizzle the widest that the minor dimension allows: what TMA and wgmma agree on."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _kernel(a_gmem, b_gmem, row_gmem, col_gmem, out_gmem, *, tiles: MosaicTiles, acc_dtype, interpret: bool):
    tm, tn, tk = tiles.tile_m, tiles.tile_n, tiles.tile_k
    m_slice = pl.ds(lax.axis_index("m") * tm, tm)
    n_slice = pl.ds(lax.axis_index("n") * tn, tn)
    k_steps = a_gmem.shape[1] // tk
    op_transforms = _transforms(tk, a_gmem.dtype)

    def scope(row_smem, col_smem, out_smem, bar, bT_KN=None):
        # The scale vectors land while the main loop runs.
        plgpu.copy_gmem_to_smem(row_gmem.at[m_slice], row_smem, bar.at[0])
        plgpu.copy_gmem_to_smem(col_gmem.at[n_slice], col_smem, bar.at[1])
        # The accumulator lives in registers: a scope of its own (the interpreter wants REGS apart from SMEM).
        pl.run_scoped(
            functools.partial(main_loop, row_smem, col_smem, out_smem, bar, bT_KN), plgpu.ACC((tm, tn), acc_dtype)
        )

    def main_loop(row_smem, col_smem, out_smem, bar, bT_KN, acc):

        def step(_, a_smem, b_smem):
            if interpret:  # the interpreter reads no transposed views: a plain [tk, tn] copy instead
                bT_KN[...] = b_smem[...].T
                b = bT_KN
            else:
                b = plgpu.transpose_ref(b_smem, (1, 0))  # K-major B, what 8-bit wgmma reads
            plgpu.wgmma(acc, a_smem, b)
            plgpu.wgmma_wait(1)  # the previous step's wgmma is done: its slot may be refilled

        spec = functools.partial(plgpu.BlockSpec, transforms=op_transforms, memory_space=plgpu.SMEM, delay_release=1)
        plgpu.emit_pipeline(
            step,
            grid=(k_steps,),
            in_specs=[spec((tm, tk), lambda k: (0, k)), spec((tn, tk), lambda k: (0, k))],
            max_concurrent_steps=tiles.stages,
        )(a_gmem.at[m_slice], b_gmem.at[n_slice])

        out = acc[...].astype(jnp.float32)  # waits for the last wgmma
        plgpu.barrier_wait(bar.at[0])
        plgpu.barrier_wait(bar.at[1])
        if interpret:
            row, col = row_smem[...], col_smem[...]
        else:
            row = plgpu.load(row_smem, (), layout=plgpu.Layout.WGMMA.reduce(1))
            col = plgpu.load(col_smem, (), layout=plgpu.Layout.WGMMA.reduce(0))
        scale = lax.broadcast_in_dim(row, (tm, tn), (0,)) * lax.broadcast_in_dim(col, (tm, tn), (1,))
        out_smem[...] = (out * scale).astype(out_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[m_slice, n_slice])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    scratch = {"bT_KN": plgpu.SMEM((tk, tn), a_gmem.dtype)} if interpret else {}
    pl.run_scoped(
        scope,
        row_smem=plgpu.SMEM((tm,), jnp.float32),
        col_smem=plgpu.SMEM((tn,), jnp.float32),
        out_smem=plgpu.SMEM((tm, tn), out_gmem.dtype, transforms=_transforms(tn, out_gmem.dtype)),
        bar=plgpu.Barrier(num_barriers=2),
        **scratch,
    )


def _pad_to(x, rows: int, cols: int):
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1]))) if x.shape != (rows, cols) else x


def mosaic_scaled_matmul(
    a_MK: jax.Array,
    b_NK: jax.Array,
    a_scale,
    b_scale,
    *,
    out_dtype=jnp.bfloat16,
    tiles: MosaicTiles | None = None,
    interpret=False,
) -> jax.Array:
    """(a_MK @ b_NK.T) * a_scale * b_scale -> [M, N] in out_dtype (bfloat16 or float32).

    a_MK and b_NK: both int8 (exact int32 accumulation) or both the same fp8 dtype (float32 accumulation); b is the
    weight stored K-major, [N, K]. a_scale: a scalar, [1, 1] or [M, 1]; b_scale: a scalar, [1, 1] or [1, N].
    ``interpret``: True (or an InterpretGPUParams) runs the Mosaic GPU interpreter on CPU; False lowers for a GPU.
    """
    if a_MK.ndim != 2 or b_NK.ndim != 2 or a_MK.shape[1] != b_NK.shape[1]:
        raise ValueError(
            f"mosaic_scaled_matmul: expected a [M, K] and b [N, K], got {list(a_MK.shape)}, {list(b_NK.shape)}"
        )
    kind = _operand_kind(a_MK, b_NK)
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        raise ValueError(f"mosaic_scaled_matmul: out_dtype must be bfloat16 or float32, got {jnp.dtype(out_dtype)}")
    tiles = tiles or MosaicTiles()
    if tiles.smem_bytes(out_dtype) > SMEM_BYTES:
        raise ValueError(f"mosaic_scaled_matmul: {tiles} needs {tiles.smem_bytes(out_dtype)} bytes of shared memory")
    (M, K), N = a_MK.shape, b_NK.shape[0]
    row = _scale_vector(a_scale, M, 0, "a_scale", f"[{M}, 1]")
    col = _scale_vector(b_scale, N, 1, "b_scale", f"[1, {N}]")
    Mp, Np, Kp = (-(-d // t) * t for d, t in ((M, tiles.tile_m), (N, tiles.tile_n), (K, tiles.tile_k)))
    params = _interpret_params(interpret)
    call = plgpu.kernel(
        functools.partial(
            _kernel,
            tiles=tiles,
            acc_dtype=jnp.int32 if kind == "int8" else jnp.float32,
            interpret=params is not None,
        ),
        out_type=like((Mp, Np), out_dtype, a_MK),
        grid=(Mp // tiles.tile_m, Np // tiles.tile_n),
        grid_names=("m", "n"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=_lowering_semantics()),
        **({"interpret": params} if params is not None else {}),
    )
    out = call(_pad_to(a_MK, Mp, Kp), _pad_to(b_NK, Np, Kp), jnp.pad(row, (0, Mp - M)), jnp.pad(col, (0, Np - N)))
    return out[:M, :N] if (Mp, Np) != (M, N) else out
