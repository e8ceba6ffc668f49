"""The grouped matmul of a dropless MoE layer: rows sorted by expert, each group times its own expert's weights.

``jax.lax.ragged_dot`` is the op for it, and on TPU XLA runs it as a grouped kernel. Elsewhere it is every row
times every expert: XLA:CPU computes it so (6.3-8.8x one product of the same FLOPs forward and 13-14x with its
gradient for 8 experts, ``experiments.bench_grouped_matmul``, 2048 and 8192 rows, 256 -> 1024), and XLA:GPU (jax
0.10.2, compiled for an H100) rewrites it into one dense product over a [rows, experts x width] masked copy of the
input: X times the FLOPs, and for Qwen3-30B-A3B's 128 experts on 64 H100s 1.6 TB of temporaries per GPU
(docs/results/scale-moe-2026-11-26.md). On CPU and GPU the rows are therefore laid out in tiles instead: each
group padded to whole tiles, so every tile belongs to one expert.

- **GPU** (tiles of ``GPU_TILE`` rows): a scan multiplies ``GPU_TILES_PER_STEP`` tiles at a time with their
  experts' weights (one batched product per step), skipping the steps past the last group (the static bound pads
  up to X tiles). Its speed on a GPU is unmeasured; a Pallas grouped GEMM is what it still lacks.
  A custom_vjp does the same for the input gradient and adds each tile's weight gradient into its expert's
  (autodiff of the scan would keep every step's weight slice).
- **CPU** (tiles of ``CPU_TILE`` rows): no grouped matmul; ``jaxlm.expert_swiglu`` loops over the experts and
  computes each one's whole MLP on its rows, chunk by chunk.

Shape letters beyond the legend (docs/architecture.md): A sorted rows, X groups (experts), N tiles, S tiles per
scan step, R rows of the tiled layout, I / O a product's input and output widths.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kernel_inputs import target_platform

GPU_TILE = 128  # rows per tile on a GPU
GPU_TILES_PER_STEP = 8  # a GPU's scan step multiplies 8 tiles (1024 rows) at once, gathering their 8 experts' weights
CPU_TILE = 32  # rows per tile on CPU: the padding of each expert's rows, and its smallest chunk (expert_swiglu)


@dataclasses.dataclass(frozen=True)
class Groups:
    """Where each token copy sits among the rows the grouped matmuls take: sorted by expert, and (tiled) padded so
    that each expert's rows fill whole tiles. Copies move in and out by gathers only, forward and backward
    (``_copies_in`` / ``_copies_out``): XLA:CPU runs scatters row by row."""

    sizes_X: jax.Array
    kernel: str  # "ragged_dot" (TPU), "tile_scan" (GPU) or "expert_loop" (CPU)
    tile: int  # rows per tile (1: untiled)
    source_P: jax.Array  # the copy (u * Z + z) each row holds; U * Z for a padding row
    position_UZ: jax.Array  # the row each copy sits in
    tile_expert_N: jax.Array | None = None  # tile_scan: each tile's expert
    used: jax.Array | None = None  # tile_scan: tiles holding rows (the rest, up to X of the N, are padding)
    first_X: jax.Array | None = None  # expert_loop: each expert's first row
    padded_X: jax.Array | None = None  # expert_loop: each expert's rows, padded to whole tiles

    @staticmethod
    def of(experts_UZ, num_experts: int, tiled: bool | None = None) -> Groups:
        """The layout of the copies of tokens routed to ``experts_UZ``; ``tiled`` None: tiles except on TPU. A copy
        whose expert is out of range (>= num_experts: an empty row of an expert exchange's receive buffer) is
        routed nowhere: it takes no row of a tile (so no tile is computed for it) and its output is zero."""
        platform = target_platform()
        tiled = platform != "tpu" if tiled is None else tiled
        kernel = ("tile_scan" if platform == "gpu" else "expert_loop") if tiled else "ragged_dot"
        tile = {"tile_scan": GPU_TILE, "expert_loop": CPU_TILE, "ragged_dot": 1}[kernel]
        U, Z = experts_UZ.shape
        X, A = num_experts, U * Z
        order_A = jnp.argsort(experts_UZ.reshape(-1), stable=True)  # copies by expert, in token order within one
        sizes_X = jnp.bincount(experts_UZ.reshape(-1), length=X).astype(jnp.int32)  # out of range: not counted
        if not tiled:
            return Groups(sizes_X, kernel, 1, order_A.astype(jnp.int32), jnp.argsort(order_A).reshape(U, Z))
        routed_A = jnp.arange(A) < sizes_X.sum()  # the sorted copies that have an expert (the rest sort last)
        step = GPU_TILES_PER_STEP if kernel == "tile_scan" else 1
        n_tiles = -(-(-(-A // tile) + X) // step) * step  # whole scan steps
        padded_X = (sizes_X + tile - 1) // tile * tile
        ends_X = jnp.cumsum(padded_X)
        expert_A = jnp.repeat(jnp.arange(X), sizes_X, total_repeat_length=A)
        pos_A = (ends_X - padded_X)[expert_A] + jnp.arange(A) - (jnp.cumsum(sizes_X) - sizes_X)[expert_A]
        rows = n_tiles * tile
        # a copy routed nowhere reads the last row: always padding (the groups end at most X - 1 tiles of padding
        # past A rows, N covers A / tile + X tiles), whose input and output stay zero
        pos_A = jnp.where(routed_A, pos_A, rows - 1)
        taken_A = jnp.where(routed_A, pos_A, rows)  # nowhere-routed copies fill no row
        source_P = jnp.full((rows,), A, jnp.int32).at[taken_A].set(order_A.astype(jnp.int32), mode="drop")
        position_UZ = pos_A[jnp.argsort(order_A)].reshape(U, Z)
        if kernel == "expert_loop":
            return Groups(sizes_X, kernel, tile, source_P, position_UZ, first_X=ends_X - padded_X, padded_X=padded_X)
        tile_expert_N = jnp.minimum(jnp.searchsorted(ends_X, jnp.arange(n_tiles) * tile, side="right"), X - 1)
        return Groups(sizes_X, kernel, tile, source_P, position_UZ, tile_expert_N, ends_X[-1] // tile)

    def gather(self, x_UD):
        """Each row's token ([N, tile, D] tiles for the scan, else [rows, D]); zero on padding rows."""
        rows = _copies_in(x_UD, self.source_P, self.position_UZ)
        return rows.reshape(-1, self.tile, rows.shape[-1]) if self.kernel == "tile_scan" else rows

    def outputs(self, y):
        """The matmuls' output rows back as each token's copies, [U, Z, O]."""
        return _copies_out(y.reshape(-1, y.shape[-1]), self.position_UZ, self.source_P)

    def matmul(self, x, w_XIO):
        """Each row times its group's [I, O] weights; padding rows stay zero. The CPU's expert loop has none: it
        computes a whole MLP per chunk (jaxlm.expert_swiglu)."""
        if self.kernel == "expert_loop":
            raise NotImplementedError("the CPU's expert loop runs whole MLPs: jaxlm.expert_swiglu.grouped_swiglu")
        if self.kernel == "tile_scan":
            return _tile_matmul(x, w_XIO, self.tile_expert_N, self.used, GPU_TILES_PER_STEP)
        # rows past the groups (copies routed nowhere) are zero whatever the kernel leaves there
        y = jax.lax.ragged_dot(x, w_XIO, self.sizes_X)
        return jnp.where((jnp.arange(x.shape[0]) < self.sizes_X.sum())[:, None], y, jnp.zeros((), y.dtype))


def _with_zero_row(x):
    return jnp.concatenate([x, jnp.zeros((1, x.shape[-1]), x.dtype)])


@jax.custom_vjp
def _copies_in(x_UD, source_P, position_UZ):
    Z = position_UZ.shape[1]
    return _with_zero_row(x_UD)[source_P // Z]  # the padding sentinel U * Z lands on the zero row


def _copies_in_fwd(x_UD, source_P, position_UZ):
    return _copies_in(x_UD, source_P, position_UZ), (source_P, position_UZ)


def _copies_in_bwd(residuals, d_rows_PD):
    source_P, position_UZ = residuals
    return d_rows_PD[position_UZ].sum(axis=1), None, None  # a token's gradient: the sum over its copies' rows


_copies_in.defvjp(_copies_in_fwd, _copies_in_bwd)


@jax.custom_vjp
def _copies_out(y_PO, position_UZ, source_P):
    return y_PO[position_UZ]


def _copies_out_fwd(y_PO, position_UZ, source_P):
    return _copies_out(y_PO, position_UZ, source_P), (position_UZ, source_P)


def _copies_out_bwd(residuals, dy_UZO):
    position_UZ, source_P = residuals
    return _with_zero_row(dy_UZO.reshape(-1, dy_UZO.shape[-1]))[source_P], None, None


_copies_out.defvjp(_copies_out_fwd, _copies_out_bwd)


def _scan_tiles(x_NTI, w_XIO, tile_expert_N, used, step: int, transpose: bool = False):
    """``step`` tiles at a time, each times its expert's weights; steps past ``used`` (all padding) are skipped."""
    N, T, _ = x_NTI.shape
    out_width = w_XIO.shape[1] if transpose else w_XIO.shape[2]

    def tiles(n, args):
        x_STI, experts_S = args

        def product():
            w_SIO = w_XIO[experts_S]
            return jnp.einsum("sti,soi->sto" if transpose else "sti,sio->sto", x_STI, w_SIO)

        zeros = jnp.zeros((step, T, out_width), x_STI.dtype)
        return n + step, jax.lax.cond(n < used, product, lambda: zeros)

    by_step = (x_NTI.reshape(N // step, step, T, -1), tile_expert_N.reshape(-1, step))
    return jax.lax.scan(tiles, 0, by_step)[1].reshape(N, T, out_width)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _tile_matmul(x_NTI, w_XIO, tile_expert_N, used, step):
    return _scan_tiles(x_NTI, w_XIO, tile_expert_N, used, step)


def _tile_matmul_fwd(x_NTI, w_XIO, tile_expert_N, used, step):
    return _scan_tiles(x_NTI, w_XIO, tile_expert_N, used, step), (x_NTI, w_XIO, tile_expert_N, used)


def _tile_matmul_bwd(step, residuals, dy_NTO):
    x_NTI, w_XIO, tile_expert_N, used = residuals
    N, T, _ = x_NTI.shape
    dx_NTI = _scan_tiles(dy_NTO, w_XIO, tile_expert_N, used, step, transpose=True)

    def tiles(dw_XIO, args):
        x_STI, dy_STO, experts_S = args
        return dw_XIO.at[experts_S].add(jnp.einsum("sti,sto->sio", x_STI, dy_STO).astype(dw_XIO.dtype)), None

    by_step = (x_NTI.reshape(N // step, step, T, -1), dy_NTO.reshape(N // step, step, T, -1))
    dw_XIO, _ = jax.lax.scan(tiles, jnp.zeros_like(w_XIO), (*by_step, tile_expert_N.reshape(-1, step)))
    return dx_NTI, dw_XIO, None, None


_tile_matmul.defvjp(_tile_matmul_fwd, _tile_matmul_bwd)
