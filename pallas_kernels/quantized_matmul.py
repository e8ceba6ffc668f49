"""x @ w with int8 / fp8 operands: a tiled Pallas kernel (Mosaic GPU or Triton on GPU, Mosaic on TPU, the interpreter
on CPU) and an XLA implementation of the same arithmetic.

``scaled_matmul`` takes operands already quantized (``pallas_kernels.quantize``) with their scales and computes
``(xq * x_scale) @ (wq * w_scale)`` without ever dequantizing a whole operand: int8 x int8 accumulates in int32
(exact), fp8 x fp8 in float32, and the scales are applied in the epilogue, once per output tile. With block-wise
scales along the contraction (``k_block``) each k-slice's partial product is scaled before it is added, in float32.
Weight-only (``x_scale=None``): float activations times int8/fp8 weights converted tile by tile in the kernel, the
memory-bound inference case. ``quantized_matmul`` quantizes float operands (current scaling) and calls it.

On a Hopper-or-newer GPU (sm_90+) the products ``pallas_kernels.mosaic_matmul`` takes (both int8, or both the same
fp8 dtype, with per-tensor / per-channel scales) run as that Mosaic GPU kernel (wgmma, TMA); everything else (older
GPUs, block-wise scales, mixed fp8, weight-only) as the Triton kernel below. ``lowering=`` forces one. The Mosaic
kernel reads the weight K-major, [Y, C]: a caller that can hold it so passes ``w_layout="YC"`` and nothing is
transposed; a [C, Y] weight is transposed per call on that path (and a [Y, C] one on the Triton path).

Each kernel program owns one [block_m, block_n] output tile and loops over C in block_k slices, so nothing is
accumulated across grid steps and one kernel body serves GPU and TPU. Shapes that are not whole tiles are padded
with zeros (which add nothing) and the result is cut back.

Shape suffixes follow the legend in docs/architecture.md, plus the matmul's own: x [X, C] @ w [C, Y] -> [X, Y]
(X rows, tiled by block_m; C the contraction, by block_k; Y output columns, by block_n) and Z elements of a k block
(k_block); N, the legend's block count, is the number of k blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .byte_transpose import byte_transpose
from .kernel_inputs import hopper_target, pad_axis, resolve_backend, target_platform
from .quantize import FLOAT8, dequantize, quantize

IMPLS = ("auto", "pallas", "xla")
LOWERINGS = ("mosaic", "triton")  # the Pallas kernel's GPU lowerings (block_sparse_attention's names)
W_LAYOUTS = ("CY", "YC")  # the weight as [C, Y] (the product's own layout) or K-major [Y, C]


@dataclasses.dataclass(frozen=True)
class MatmulBlocks:
    """Output tile [block_m, block_n] per kernel program and the k-slice per loop step (shrunk to small shapes);
    on GPU also Triton's warps and pipeline stages (None: 8 warps for tiles over 64x64, else 4; 3 stages)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    warps: int | None = None
    stages: int | None = None

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "warps", "stages"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"MatmulBlocks.{name} must be positive, got {value}")


# The fastest of ten candidate tilings of an 8192^3 product on an H100 (experiments.tune_gpu_tiles, 2026-11-24):
# int8 256x128x128 ran 271 TFLOP/s against 181 for 128x128x128; fp8 128x128x64 with 4 warps and 4 stages 361
# against 324. Other kinds and backends keep the 128 blocks.
_GPU_BLOCKS = {"int8": MatmulBlocks(256, 128, 128, 8, 3), "fp8": MatmulBlocks(128, 128, 64, 4, 4)}


def default_blocks(kind: str, backend: str) -> MatmulBlocks:
    """The blocks a scaled_matmul of this operand kind uses on this backend when the caller names none."""
    return _GPU_BLOCKS.get(kind, MatmulBlocks()) if backend == "gpu" else MatmulBlocks()


def resolve_impl(impl: str) -> str:
    """'auto' -> the Pallas kernel on TPU, the XLA implementation on GPU and CPU.

    GPU takes XLA's because it measured faster on an H100 (experiments.gpu_report, 2026-11-24): XLA's fp8 product
    (cuBLASLt) ran 741 TFLOP/s at 8192^3 against the Pallas kernel's 357, and a 1B train step with fp8 matmuls 65.4k
    tokens/s against 36.8k. CPU takes it because Pallas only interprets there.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown quantized matmul impl {impl!r}; choose one of {IMPLS}")
    if impl == "auto":
        return "pallas" if target_platform() == "tpu" else "xla"
    return impl


def _operand_kind(xq, wq, x_scale) -> str:
    """'int8' (int32 accumulation), 'fp8', or 'weight_only'; an unsupported pair is a ValueError."""
    xd, wd = jnp.dtype(xq.dtype), jnp.dtype(wq.dtype)
    if wd != jnp.int8 and wd not in FLOAT8:
        raise ValueError(f"scaled_matmul: unsupported weight dtype {wd}; use int8, float8_e4m3fn or float8_e5m2")
    if x_scale is None:
        if xd not in (jnp.float32, jnp.bfloat16, jnp.float16):
            raise ValueError(f"scaled_matmul: weight-only (x_scale=None) needs float activations, got {xd}")
        return "weight_only"
    if xd == wd == jnp.int8:
        return "int8"
    if xd in FLOAT8 and wd in FLOAT8:
        return "fp8"
    raise ValueError(
        f"scaled_matmul: unsupported operand pair {xd} x {wd}; both int8, both fp8, or float "
        f"activations with x_scale=None (weight-only)"
    )


def _check_scales(x_scale, w_scale, X, C, Y, k_block):
    N = 1 if k_block is None else -(-C // k_block)
    if k_block is not None and k_block <= 0:
        raise ValueError(f"scaled_matmul: k_block must be positive, got {k_block}")
    if x_scale is not None and (x_scale.ndim != 2 or x_scale.shape[0] not in (1, X) or x_scale.shape[1] != N):
        raise ValueError(
            f"scaled_matmul: x_scale must be [{X} or 1, {N}] for x [{X}, {C}]"
            f"{'' if k_block is None else f' with k_block {k_block}'}, got {list(x_scale.shape)}"
        )
    if w_scale.ndim != 2 or w_scale.shape[1] not in (1, Y) or w_scale.shape[0] != N:
        raise ValueError(
            f"scaled_matmul: w_scale must be [{N}, {Y} or 1] for w [{C}, {Y}]"
            f"{'' if k_block is None else f' with k_block {k_block}'}, got {list(w_scale.shape)}"
        )


def scaled_matmul(
    xq: jax.Array,
    x_scale: jax.Array | None,
    wq: jax.Array,
    w_scale: jax.Array,
    *,
    out_dtype=jnp.float32,
    k_block: int | None = None,
    blocks=None,
    impl: str = "auto",
    interpret: bool | None = None,
    backend: str | None = None,
    lowering: str | None = None,
    w_layout: str = "CY",
) -> jax.Array:
    """(xq * x_scale) @ (wq * w_scale) for xq [X, C], wq [C, Y] -> [X, Y] in out_dtype.

    Scales are float32: x_scale [X or 1, N], w_scale [N, Y or 1], with N = 1 (per row / per column / per
    tensor, applied in the epilogue) or N = ceil(C / k_block) (one scale per k_block-long slice of the
    contraction). ``impl``: 'pallas', 'xla', or 'auto' (Pallas on TPU, XLA on GPU and CPU). ``interpret`` defaults to
    True on CPU; ``backend`` ('gpu', 'tpu') picks the kernel lowering and lets a CPU machine export for one.
    ``w_layout``: "CY" (wq [C, Y]) or "YC" (wq stored K-major, [Y, C], what the Mosaic GPU kernel reads; w_scale
    keeps its [N, Y or 1] shape either way).

    ``lowering`` picks the Pallas kernel's GPU lowering: "mosaic" (``mosaic_matmul``, Hopper and newer; in
    interpret mode the Mosaic GPU interpreter; a product it cannot take is a ValueError), "triton", or None: Mosaic
    on sm_90+ where it takes the product, else Triton (in interpret mode: the Pallas interpreter). Which one ran
    is logged once per process and reason (logger "jaxlm.kernels"). It has no effect on the XLA implementation.
    ``blocks``: a ``MatmulBlocks`` (the Triton / TPU kernel's; giving one picks Triton when ``lowering`` is None),
    or a ``mosaic_matmul.MosaicTiles`` for the Mosaic kernel; None: ``default_blocks`` / ``default_tiles``.
    """
    if w_layout not in W_LAYOUTS:
        raise ValueError(f"scaled_matmul: unknown w_layout {w_layout!r}; choose one of {W_LAYOUTS}")
    w_shape = wq.shape if w_layout == "CY" else wq.shape[::-1]
    if xq.ndim != 2 or wq.ndim != 2 or xq.shape[1] != w_shape[0]:
        raise ValueError(
            f"scaled_matmul: expected x [X, C] and w {'[C, Y]' if w_layout == 'CY' else '[Y, C] (w_layout YC)'}, "
            f"got {list(xq.shape)} and {list(wq.shape)}"
        )
    if lowering not in (None, *LOWERINGS):
        raise ValueError(f"scaled_matmul: unknown lowering {lowering!r}; choose one of {LOWERINGS}")
    kind = _operand_kind(xq, wq, x_scale)
    X, C = xq.shape
    Y = w_shape[1]
    _check_scales(x_scale, w_scale, X, C, Y, k_block)
    x_scale_given = x_scale is not None
    if x_scale is None:
        x_scale = jnp.ones((1, w_scale.shape[0]), jnp.float32)
    x_scale, w_scale = x_scale.astype(jnp.float32), w_scale.astype(jnp.float32)
    if resolve_impl(impl) == "xla":
        if w_layout == "YC" and k_block is None:  # a dot contracting both minor dims: no transpose
            acc = _accumulator(kind)
            w = wq.astype(xq.dtype) if kind == "weight_only" else wq
            out = lax.dot_general(xq, w, (((1,), (1,)), ((), ())), preferred_element_type=acc)
            return (out.astype(jnp.float32) * x_scale * w_scale).astype(out_dtype)
        w_CY = wq if w_layout == "CY" else wq.T  # block-wise: XLA fuses the transpose into the reshape
        return _xla(xq, x_scale, w_CY, w_scale, kind, k_block).astype(out_dtype)
    backend = resolve_backend("scaled_matmul", interpret, backend)
    why_not = _mosaic_refusal(xq, wq, x_scale_given, k_block, out_dtype, blocks)
    if _use_mosaic(backend, lowering, why_not):
        from .mosaic_matmul import mosaic_scaled_matmul

        # The Mosaic kernel reads the weight K-major: a [C, Y] weight is transposed here, one pass over its bytes
        # per call, by byte_transpose on a GPU (as x.T, XLA would transpose the passes that made it instead).
        w_YC = wq if w_layout == "YC" else byte_transpose(wq, backend)
        return mosaic_scaled_matmul(
            xq, w_YC, x_scale, w_scale, out_dtype=out_dtype, tiles=blocks, interpret=backend == "interpret"
        )
    if blocks is not None and not isinstance(blocks, MatmulBlocks):
        raise ValueError(f"scaled_matmul: the {_kernel_name(backend)} takes MatmulBlocks, got {blocks!r}")
    # The Triton / TPU kernel reads [C, Y] tiles: a K-major weight is transposed here, one pass over its bytes
    # (by byte_transpose on a GPU, as for the Mosaic kernel).
    w_CY = wq if w_layout == "CY" else byte_transpose(wq, backend)
    return _pallas(
        xq,
        x_scale,
        w_CY,
        w_scale,
        kind=kind,
        k_block=k_block,
        blocks=default_blocks(kind, backend) if blocks is None else blocks,
        out_dtype=jnp.dtype(out_dtype),
        backend=backend,
    )


_logged: set = set()


def _mosaic_refusal(xq, wq, x_scaled: bool, k_block, out_dtype, blocks) -> str | None:
    """Why the Mosaic GPU kernel cannot take this product (the Triton kernel runs it instead), or None."""
    xd, wd = jnp.dtype(xq.dtype), jnp.dtype(wq.dtype)
    if not x_scaled:
        return f"weight-only {xd.name} x {wd.name} (it multiplies two 8-bit operands)"
    if xd != wd:
        return f"mixed operand dtypes {xd.name} x {wd.name} (its wgmma takes one 8-bit type)"
    if k_block is not None:
        return "block-wise scales along the contraction (k_block; per-tensor / per-channel scales only)"
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"out_dtype {jnp.dtype(out_dtype).name} (bfloat16 / float32 only)"
    if isinstance(blocks, MatmulBlocks):
        return "Triton blocks (MatmulBlocks) were given"
    return None


def _kernel_name(backend: str) -> str:
    return {"gpu": "Triton kernel", "tpu": "TPU kernel", "interpret": "Pallas interpreter"}[backend]


def _use_mosaic(backend: str, lowering: str | None, why_not: str | None) -> bool:
    """Whether the Mosaic GPU kernel runs this product; raises where ``lowering`` asks for what cannot run. Which
    lowering ran is logged once per process and reason."""
    if backend == "tpu":
        if lowering is not None:
            raise ValueError(f"scaled_matmul: lowering={lowering!r} picks a GPU kernel; on TPU leave it None")
        return False
    if lowering == "mosaic" and why_not is not None:
        raise ValueError(f"scaled_matmul: the Mosaic GPU kernel cannot take {why_not}; use lowering='triton' or None")
    if lowering is None and why_not is None and backend == "gpu" and not hopper_target():
        why_not = "the GPU is older than Hopper (sm_90)"
    mosaic = lowering == "mosaic" or (lowering is None and why_not is None and backend == "gpu")
    if mosaic:
        choice = "Mosaic GPU interpreter" if backend == "interpret" else "Mosaic GPU kernel (sm_90)"
    elif lowering == "triton" or why_not is None or backend == "interpret":
        choice = _kernel_name(backend)
    else:
        choice = f"{_kernel_name(backend)}: {why_not}"
    if choice not in _logged:
        _logged.add(choice)
        logging.getLogger("jaxlm.kernels").info("scaled_matmul on %s: %s", backend, choice)
    return mosaic


def _accumulator(kind: str):
    return jnp.int32 if kind == "int8" else jnp.float32


def _xla(xq, x_scale, wq, w_scale, kind, k_block):
    """The same arithmetic as the kernel, as XLA ops: int32 / float32 dots, scales on the partial products."""
    acc = _accumulator(kind)
    if kind == "weight_only":
        wq = wq.astype(xq.dtype)
    if k_block is None:
        return lax.dot(xq, wq, preferred_element_type=acc).astype(jnp.float32) * x_scale * w_scale
    X, C = xq.shape
    Y, N = wq.shape[1], x_scale.shape[1]
    x_XNZ = pad_axis(xq, 1, N * k_block).reshape(X, N, k_block)
    w_NZY = pad_axis(wq, 0, N * k_block).reshape(N, k_block, Y)
    partial_NXY = jnp.einsum("xnz,nzy->nxy", x_XNZ, w_NZY, preferred_element_type=acc).astype(jnp.float32)
    return jnp.sum(partial_NXY * x_scale.T[:, :, None] * w_scale[:, None, :], axis=0)


def _fit(block: int, n: int) -> int:
    """The configured block, or n rounded up to a power of two (at least 16: Triton's smallest dot) if smaller."""
    return min(block, max(16, 1 << max(0, (n - 1).bit_length())))


def _pallas(xq, x_scale, wq, w_scale, *, kind, k_block, blocks, out_dtype, backend):
    X, C = xq.shape
    Y = wq.shape[1]
    bm, bn = _fit(blocks.block_m, X), _fit(blocks.block_n, Y)
    bk = k_block if k_block is not None else _fit(blocks.block_k, C)
    Xp, Yp, Cp = -(-X // bm) * bm, -(-Y // bn) * bn, -(-C // bk) * bk
    xq, wq = pad_axis(pad_axis(xq, 0, Xp), 1, Cp), pad_axis(pad_axis(wq, 0, Cp), 1, Yp)
    N = x_scale.shape[1]
    if x_scale.shape[0] == X:
        x_scale = pad_axis(x_scale, 0, Xp, 1.0)
        xs_spec = pl.BlockSpec((bm, N), lambda i, j: (i, 0))
    else:
        xs_spec = pl.BlockSpec((1, N), lambda i, j: (0, 0))
    if w_scale.shape[1] == Y:
        w_scale = pad_axis(w_scale, 1, Yp, 1.0)
        ws_spec = pl.BlockSpec((N, bn), lambda i, j: (0, j))
    else:
        ws_spec = pl.BlockSpec((N, 1), lambda i, j: (0, 0))
    # Triton's dot takes one fp8 type per product; e5m2 x e4m3 (the backward's dY x W) is upcast to bfloat16 tiles
    # in the kernel, which is exact (bfloat16 holds every fp8 value) but runs at bfloat16 tensor-core speed.
    mixed_fp8 = kind == "fp8" and xq.dtype != wq.dtype and backend == "gpu"
    kernel = functools.partial(
        _kernel,
        num_k=Cp // bk,
        bk=bk,
        acc_dtype=_accumulator(kind),
        blockwise=k_block is not None,
        weight_only=kind == "weight_only",
        upcast=jnp.bfloat16 if mixed_fp8 else None,
        lane_aligned=backend == "tpu",
    )
    out = pl.pallas_call(
        kernel,
        grid=(Xp // bm, Yp // bn),
        in_specs=[
            pl.BlockSpec((bm, Cp), lambda i, j: (i, 0)),
            xs_spec,
            pl.BlockSpec((Cp, bn), lambda i, j: (0, j)),
            ws_spec,
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((Xp, Yp), out_dtype),
        interpret=backend == "interpret",
        compiler_params=_compiler_params(backend, bm, bn, blocks),
        name=f"{kind}_matmul",
    )(xq, x_scale, wq, w_scale)
    return out[:X, :Y]


def _kernel(x_ref, xs_ref, w_ref, ws_ref, o_ref, *, num_k, bk, acc_dtype, blockwise, weight_only, upcast, lane_aligned):
    """One output tile: loop over C slices; int32 or float32 partial sums; scales in the epilogue (or per slice)."""

    def x_scales(k):
        """Column k of the x scales [bm, N]. Mosaic (TPU) loads lanes only at multiples of 128, so there the
        column is picked out of the whole block by a one-hot sum (N is a few dozen; the product dwarfs it)."""
        if not lane_aligned:
            return xs_ref[:, pl.ds(k, 1)]
        xs = xs_ref[...]
        return jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, xs.shape, 1) == k, xs, 0.0), axis=1, keepdims=True)

    def partial(k):
        x = x_ref[:, pl.ds(k * bk, bk)]
        w = w_ref[pl.ds(k * bk, bk), :]
        if weight_only:
            w = w.astype(x.dtype)
        if upcast is not None:
            x, w = x.astype(upcast), w.astype(upcast)
        return jnp.dot(x, w, preferred_element_type=acc_dtype)

    if blockwise:

        def body(k, acc):
            return acc + partial(k).astype(jnp.float32) * x_scales(k) * ws_ref[pl.ds(k, 1), :]

        acc = lax.fori_loop(0, num_k, body, jnp.zeros(o_ref.shape, jnp.float32))
    else:
        acc = lax.fori_loop(0, num_k, lambda k, acc: acc + partial(k), jnp.zeros(o_ref.shape, acc_dtype))
        acc = acc.astype(jnp.float32) * xs_ref[...] * ws_ref[...]
    o_ref[...] = acc.astype(o_ref.dtype)


def _compiler_params(backend, bm, bn, blocks: MatmulBlocks):
    if backend == "gpu":
        from jax.experimental.pallas import triton as pltriton

        warps = blocks.warps or (4 if bm * bn <= 64 * 64 else 8)
        return pltriton.CompilerParams(num_warps=warps, num_stages=blocks.stages or 3)
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
    return None


def quantized_matmul(
    x: jax.Array, w: jax.Array, *, x_dtype=None, w_dtype="int8", out_dtype=None, k_block: int | None = None, **kwargs
) -> jax.Array:
    """x [X, C] @ w [C, Y] with both operands quantized on the fly (current scaling), or only w (x_dtype=None).

    x gets one scale per row and w one per output column (per channel), or with ``k_block`` one per row/column
    and k_block-long slice of the contraction. out_dtype defaults to x's dtype. Other keyword arguments go to
    ``scaled_matmul`` (blocks, impl, interpret, backend).
    """
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"quantized_matmul: expected x [X, C] and w [C, Y], got {list(x.shape)} and {list(w.shape)}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    block = {} if k_block is None else {"block": k_block}
    wq, ws = quantize(w, w_dtype, axis=0, **block)  # [1 or N, Y]
    if x_dtype is None:
        xq, xs = x, None
    else:
        xq, xs = quantize(x, x_dtype, axis=1, **block)  # [X, 1 or N]
    return scaled_matmul(xq, xs, wq, ws, out_dtype=out_dtype, k_block=k_block, **kwargs)


def reference_scaled_matmul(xq, x_scale, wq, w_scale, *, k_block: int | None = None) -> jax.Array:
    """Dequantize both operands in float32 and multiply at full precision: what the kernels must equal."""
    axis_block = {} if k_block is None else {"block": k_block}
    x = xq.astype(jnp.float32) if x_scale is None else dequantize(xq, x_scale, axis=1, **axis_block)
    w = dequantize(wq, w_scale, axis=0, **axis_block)
    return jnp.dot(x, w, precision=lax.Precision.HIGHEST)
