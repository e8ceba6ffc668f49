"""fp8 / int8 scaled matmul as a Mosaic GPU (Hopper, sm_90) Pallas kernel: ``(a @ b.T) * a_scale * b_scale``.

Why not the Triton kernel of ``quantized_matmul``: on an H100 it reached 357 TFLOP/s fp8 at 8192^3, half a bf16
``jnp.dot``. This kernel drives the Hopper hardware directly: a memory warpgroup issues TMA bulk-tensor copies into a
``stages``-deep shared-memory ring, two compute warpgroups read it with ``wgmma`` (accumulating in float32, int32 for
int8; one wgmma stays in flight while the next slice lands, ``delay_release=1``), and the CTAs stay resident, one per
SM, walking the output tiles so that the next tile's loads overlap this one's epilogue. One warpgroup per CTA and a
CTA per tile reached 1.46x a bf16 ``jnp.dot`` at 8192^3 on an H200; this layout 1.54x (docs/results).

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
from .targets import H100_SHARED_MEMORY_PER_BLOCK, sm_count

FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
SMEM_BYTES = H100_SHARED_MEMORY_PER_BLOCK  # an H100's opt-in shared memory per block (227 KiB)


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """One CTA: ``consumers`` compute warpgroups, each a [tile_m, tile_n] output tile (stacked along M, so they share
    the B tile), fed by one memory warpgroup through a ``stages``-deep TMA ring over K in tile_k slices. The CTAs stay
    resident, one per SM, and walk the output tiles in bands ``band`` CTA rows tall (A and B stay in L2 while a band
    is read). 128x128x64, 6 stages, 2 consumers (the fastest of 15 tilings timed on an H200, docs/results): a
    128x128 f32 accumulator is 128 registers a thread (256 would spill), and the ring (144 KiB) and two bf16 out
    tiles (64 KiB) fit 227 KiB; two float32 out tiles (128 KiB) leave room for 3 stages (``default_tiles``)."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    stages: int = 6
    consumers: int = 2
    band: int = 8

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
        if self.tile_n * self.tile_k > 128 * 128:
            raise ValueError(
                f"MosaicTiles: a {self.tile_n}x{self.tile_k} B tile is over 16 KiB; 256x128 gave products 9% off on "
                f"an H200 (2026-11-27, not understood), so B tiles stay at most 128x128 or 256x64"
            )
        if self.consumers not in (1, 2):
            raise ValueError(f"MosaicTiles.consumers must be 1 or 2 compute warpgroups, got {self.consumers}")
        if self.band < 1:
            raise ValueError(f"MosaicTiles.band must be at least 1 row of tiles, got {self.band}")

    @property
    def cta_m(self) -> int:
        return self.consumers * self.tile_m

    def smem_bytes(self, out_dtype) -> int:
        """Shared memory the kernel asks for: the operand ring, an out tile and the scale vectors per consumer."""
        ring = self.stages * (self.cta_m + self.tile_n) * self.tile_k
        out = self.cta_m * self.tile_n * jnp.dtype(out_dtype).itemsize
        return ring + out + 4 * self.consumers * (self.tile_m + self.tile_n)


def default_tiles(out_dtype) -> MosaicTiles:
    """The tiles for an out dtype: a float32 out tile is twice a bf16 one, so its ring has 3 stages, not 6."""
    return MosaicTiles() if jnp.dtype(out_dtype).itemsize == 2 else MosaicTiles(stages=3)


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


def _load(ref, layout, interpret: bool):
    """A scale vector from shared memory in the accumulator's register layout (the interpreter knows no layouts)."""
    return ref[...] if interpret else plgpu.load(ref, (), layout=layout)


def _kernel(a_gmem, b_gmem, row_gmem, col_gmem, out_gmem, *, tiles: MosaicTiles, acc_dtype, interpret: bool):
    tm, tn, tk, cta_m = tiles.tile_m, tiles.tile_n, tiles.tile_k, tiles.cta_m
    m_tiles, n_tiles = out_gmem.shape[0] // cta_m, out_gmem.shape[1] // tn
    spec = functools.partial(
        plgpu.BlockSpec, transforms=_transforms(tk, a_gmem.dtype), memory_space=plgpu.SMEM, delay_release=1
    )

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(a_gmem.shape[1] // tk,),
            memory_registers=40,
            in_specs=[spec((cta_m, tk), lambda k: (0, k)), spec((tn, tk), lambda k: (0, k))],
            wg_axis="wg",
            num_compute_wgs=tiles.consumers,
            max_concurrent_steps=tiles.stages,
            compute_context=context,
        )

    def scope(allocations, row_smem, col_smem, out_smem, bar, bT_KN=None):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
        def _output_tile(loop):
            m, n = plgpu.planar_snake(loop.index[0], (m_tiles, n_tiles), 0, tiles.band)
            cta_rows, cols = pl.ds(m * cta_m, cta_m), pl.ds(n * tn, tn)
            rows = pl.ds(m * cta_m + wg * tm, tm)

            def step(_, a_smem, b_smem, acc):
                if interpret:  # the interpreter reads no transposed views: a plain [tk, tn] copy instead
                    bT_KN[wg] = b_smem[...].T
                    b = bT_KN.at[wg]
                else:
                    b = plgpu.transpose_ref(b_smem, (1, 0))  # K-major B, what 8-bit wgmma reads
                plgpu.wgmma(acc, a_smem.at[pl.ds(wg * tm, tm)], b)
                plgpu.wgmma_wait(1)  # the previous step's wgmma is done: its slot may be refilled
                return acc

            def consumer(run_pipeline):
                # This tile's scales land while its main loop runs.
                plgpu.copy_gmem_to_smem(row_gmem.at[rows], row_smem.at[wg], bar.at[2 * wg])
                plgpu.copy_gmem_to_smem(col_gmem.at[cols], col_smem.at[wg], bar.at[2 * wg + 1])

                def with_accumulator(acc):
                    out = run_pipeline(acc)[...].astype(jnp.float32)  # waits for the last wgmma
                    plgpu.barrier_wait(bar.at[2 * wg])
                    plgpu.barrier_wait(bar.at[2 * wg + 1])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store has read out_smem
                    row = _load(row_smem.at[wg], plgpu.Layout.WGMMA.reduce(1), interpret)
                    col = _load(col_smem.at[wg], plgpu.Layout.WGMMA.reduce(0), interpret)
                    # One product per scale: a [tm, tn] array of row x col scales beside the accumulator spills.
                    out = out * lax.broadcast_in_dim(row, (tm, tn), (0,)) * lax.broadcast_in_dim(col, (tm, tn), (1,))
                    out_smem[wg] = out.astype(out_smem.dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[rows, cols])

                pl.run_scoped(with_accumulator, plgpu.ACC((tm, tn), acc_dtype))

            pipeline(step, consumer)(a_gmem.at[cta_rows], b_gmem.at[cols], allocations=allocations)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    nc = tiles.consumers
    ignore = lambda *_, **__: None  # noqa: E731 - the allocations depend on the specs alone
    scratch = {"bT_KN": plgpu.SMEM((nc, tk, tn), a_gmem.dtype)} if interpret else {}
    pl.run_scoped(
        scope,
        allocations=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
        row_smem=plgpu.SMEM((nc, tm), jnp.float32),
        col_smem=plgpu.SMEM((nc, tn), jnp.float32),
        out_smem=plgpu.SMEM((nc, tm, tn), out_gmem.dtype, transforms=_transforms(tn, out_gmem.dtype)),
        bar=plgpu.Barrier(num_barriers=2 * nc),
        collective_axes="wg",
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
    tiles = tiles or default_tiles(out_dtype)
    if tiles.smem_bytes(out_dtype) > SMEM_BYTES:
        raise ValueError(f"mosaic_scaled_matmul: {tiles} needs {tiles.smem_bytes(out_dtype)} bytes of shared memory")
    (M, K), N = a_MK.shape, b_NK.shape[0]
    row = _scale_vector(a_scale, M, 0, "a_scale", f"[{M}, 1]")
    col = _scale_vector(b_scale, N, 1, "b_scale", f"[1, {N}]")
    Mp, Np, Kp = (-(-d // t) * t for d, t in ((M, tiles.cta_m), (N, tiles.tile_n), (K, tiles.tile_k)))
    params = _interpret_params(interpret)
    call = plgpu.kernel(
        functools.partial(
            _kernel,
            tiles=tiles,
            acc_dtype=jnp.int32 if kind == "int8" else jnp.float32,
            interpret=params is not None,
        ),
        out_type=like((Mp, Np), out_dtype, a_MK),
        grid=(min(sm_count(), Mp // tiles.cta_m * (Np // tiles.tile_n)),),
        grid_names=("sm",),
        num_threads=tiles.consumers + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=_lowering_semantics()),
        **({"interpret": params} if params is not None else {}),
    )
    out = call(_pad_to(a_MK, Mp, Kp), _pad_to(b_NK, Np, Kp), jnp.pad(row, (0, Mp - M)), jnp.pad(col, (0, Np - N)))
    return out[:M, :N] if (Mp, Np) != (M, N) else out
