"""Which tiles and which lowering each pass of the GPU attention takes: the Triton kernels' tiles (a table of what
fits an H100's shared memory, cut to divide the mask's blocks), and per pass Mosaic GPU (Hopper, where its kernels
take the case) or Triton, logged once on ``jaxlm.kernels``. ``pallas_attention.block_sparse_attention`` asks."""

from __future__ import annotations

import dataclasses
import logging
import math

import jax.numpy as jnp

from .kernel_inputs import hopper_target
from .mosaic_attention import MosaicTiles, mosaic_tiles, supports
from .mosaic_backward_tiles import BackwardTiles, backward_footprint, backward_tiles, supports_backward
from .score_tables import row_entries


@dataclasses.dataclass(frozen=True)
class PassTiles:
    """One kernel's tiling: the tile a program owns (q rows for forward and dQ, kv columns for dK/dV), the tile its
    loop steps by (kv for forward and dQ, q for dK/dV), and Triton's warps and pipeline stages."""

    rows: int
    loop: int
    warps: int = 4
    stages: int = 2


@dataclasses.dataclass(frozen=True)
class KernelTiles:
    """Tiles of the three kernels. They may be smaller than the block mask's blocks (a block is then walked in
    tiles) so that the block size stays a property of the mask while the tiles fit the device's shared memory."""

    forward: PassTiles
    dq: PassTiles
    dkv: PassTiles


# The largest tiles (of 128x128, 128x64, 64x128, 64x64, 64x32, 32x64, with 2 pipeline stages) whose kernels fit an
# H100's 227 KiB of shared memory per block, by (head dim up to, bytes per element); experiments.gpu_compile
# compiles every entry for sm_90. The bfloat16 forward tiles are the fastest that experiments.tune_gpu_tiles timed on
# an H100 (causal, T=8192, 2026-11-24): head dim 64 128x64 with 4 warps and 3 stages, 233 TFLOP/s against 196 for
# 128x128; head dim 128 128x32, 284 against 268. The backward candidates were within 5% of these entries.
_GPU_TILES = {
    # (max head dim, itemsize): (forward, dq, dkv)
    (64, 2): (PassTiles(128, 64, 4, 3), PassTiles(128, 128, 8), PassTiles(128, 128, 8)),
    (64, 4): (PassTiles(128, 128, 8), PassTiles(128, 128, 8), PassTiles(128, 64, 8)),
    (128, 2): (PassTiles(128, 32, 4, 3), PassTiles(128, 128, 8), PassTiles(128, 64, 8)),
    (128, 4): (PassTiles(128, 64, 8), PassTiles(128, 64, 8), PassTiles(64, 64, 4)),
    (256, 2): (PassTiles(128, 64, 8), PassTiles(64, 64, 4), PassTiles(64, 32, 4)),
    (256, 4): (PassTiles(64, 32, 4), PassTiles(64, 32, 4), PassTiles(32, 64, 4)),
}


def kernel_tiles(backend: str, head_dim: int, dtype, block_sizes) -> KernelTiles:
    """The tiles the kernels use: the mask's blocks in interpret mode, on GPU the smallest entry of the
    shared-memory table that covers this head dim and dtype, cut to divide the blocks."""
    bq, bkv = block_sizes.block_q, block_sizes.block_kv
    if backend != "gpu":
        return KernelTiles(PassTiles(bq, bkv), PassTiles(bq, bkv), PassTiles(bkv, bq))
    itemsize = jnp.dtype(dtype).itemsize
    fits = [key for key in _GPU_TILES if key[0] >= head_dim and key[1] >= itemsize]
    if not fits:
        raise ValueError(f"block_sparse_attention: head dim {head_dim} is larger than the GPU kernels support (256)")
    table = KernelTiles(*_GPU_TILES[min(fits)])
    return KernelTiles(
        *(
            dataclasses.replace(t, rows=math.gcd(t.rows, rows_block), loop=math.gcd(t.loop, loop_block))
            for _, t, rows_block, loop_block in passes(table, block_sizes)
        )
    )


def passes(tiles: KernelTiles, bs):
    """(name, tiles, the block its rows tile, the block its loop tiles) of forward, dq and dkv, in that order."""
    return (
        ("forward", tiles.forward, bs.block_q, bs.block_kv),
        ("dq", tiles.dq, bs.block_q, bs.block_kv),
        ("dkv", tiles.dkv, bs.block_kv, bs.block_q),
    )


LOWERINGS = ("mosaic", "triton")
_logged: set = set()


def mosaic_lowerings(
    static, lowering: str | None, dtype, E: int, explicit_tiles: bool = False, deterministic: bool = True
) -> dict:
    """{"mosaic": forward tiles, "mosaic_bwd": backward tiles}, each None where that pass runs on Triton (or the
    Pallas interpreter). An explicit "mosaic" raises when the forward cannot take the case; the backward then still
    falls back to Triton where its kernels cannot (float32, head dims other than 64 / 128 / 256, blocks other than
    128 / 256, what does not fit shared memory). Not ``deterministic``: the backward sums dQ across programs
    (``BackwardTiles.fused_dq``) where it can (head dims 64 and 128, no captured arrays). Which ran is logged
    once."""
    if lowering not in (None, *LOWERINGS):
        raise ValueError(f"block_sparse_attention: unknown lowering {lowering!r}; choose one of {LOWERINGS}")
    if lowering == "triton" or (static.backend == "interpret" and lowering is None):
        return {}
    if explicit_tiles and lowering is None:  # they are the Triton kernels' tiles (tune_gpu_tiles, tests)
        return {}
    older = None if lowering == "mosaic" or hopper_target() else "the GPU is older than Hopper (sm_90)"
    why_not = older or supports(static, dtype, E)
    if why_not is not None and lowering == "mosaic":
        raise ValueError(f"block_sparse_attention: the Mosaic GPU forward cannot take {why_not}")
    why_not_bwd = why_not or supports_backward(static, dtype, E)
    blocks = (static.block_q, static.block_kv)
    footprint = backward_footprint(static)
    fused = None if why_not_bwd or deterministic else backward_tiles(E, dtype, *blocks, **footprint, fused=True)
    _log_once("forward", why_not)
    _log_once("backward summing dQ across programs" if fused else "backward", why_not_bwd)
    return {
        "mosaic": None if why_not else mosaic_tiles(E, dtype, *blocks, row_entries(static.score_mod)),
        "mosaic_bwd": None if why_not_bwd else fused or backward_tiles(E, dtype, *blocks, **footprint),
    }


def check_fused_tiles(tiles: BackwardTiles, deterministic: bool, E: int, captured_arrays: bool) -> None:
    """ValueError where given backward tiles that sum dQ across programs (``fused_dq``) cannot be used."""
    if deterministic:
        raise ValueError(
            "block_sparse_attention: BackwardTiles(fused_dq=True) sums dQ in no fixed order; pass deterministic=False"
        )
    if E not in (64, 128) or captured_arrays:
        what = f"head dim {E}" if E not in (64, 128) else "a score mod's captured arrays"
        raise ValueError(f"block_sparse_attention: BackwardTiles(fused_dq=True) cannot take {what}")


def given_mosaic_tiles(tiles, lowering: str | None, bs) -> dict:
    """{"mosaic": forward tiles, "mosaic_bwd": backward tiles} as far as ``tiles`` gives Mosaic tiles, checked
    against the blocks; {} for Triton tiles or None."""
    parts = tiles if isinstance(tiles, tuple) else (tiles,)
    given = {}
    for t in parts:
        if isinstance(t, MosaicTiles):
            given["mosaic"] = t
            ok = t.rows == bs.block_q // 2 and bs.block_kv % t.kv == 0
        elif isinstance(t, BackwardTiles):
            given["mosaic_bwd"] = t
            ok = (t.dq_rows, t.dkv_rows) == (bs.block_q // 2, bs.block_kv // 2) and not (
                bs.block_kv % t.dq_kv or bs.block_q % t.dkv_q
            )
        else:
            ok = t is None or (isinstance(t, KernelTiles) and len(parts) == 1)
        if not ok:
            raise ValueError(
                f"block_sparse_attention: tiles {t!r} do not fit blocks {bs.block_q}x{bs.block_kv} (Mosaic rows are "
                "half a block; tiles divide the block they walk)"
            )
    if given and lowering == "triton":
        raise ValueError("block_sparse_attention: Mosaic tiles were given with lowering='triton'")
    return given


def _log_once(kernel: str, why_not: str | None) -> None:
    choice = f"{kernel} on Triton: {why_not}" if why_not else f"{kernel} on Mosaic GPU (sm_90)"
    if choice not in _logged:
        _logged.add(choice)
        logging.getLogger("jaxlm.kernels").info("block_sparse_attention %s", choice)


def check_tiles(tiles: KernelTiles, bs) -> None:
    for name, t, rows_block, loop_block in passes(tiles, bs):
        if t.rows < 1 or t.loop < 1 or rows_block % t.rows or loop_block % t.loop:
            raise ValueError(
                f"block_sparse_attention: {name} tiles {t.rows}x{t.loop} "
                f"must divide the blocks {rows_block}x{loop_block}"
            )
