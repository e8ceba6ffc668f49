"""Which tiles the Mosaic GPU attention backward (``mosaic_attention_bwd``) takes: the candidates for a head dim (64,
128, 256) and blocks whose shared memory fits beside what else the kernels load (document slots, a mod's captured
arrays), and whether the kernels can take a case at all (else the Triton kernels run)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .mosaic_attention import _SHARED_MEMORY
from .mosaic_pipeline import id_slots
from .score_tables import PACKED_ALIGN, packed_entries, row_entries
from .targets import sm_count


@dataclasses.dataclass(frozen=True)
class BackwardTiles:
    """Rows per consumer warpgroup, the streamed tile, and ring slots, per kernel; consumer warpgroups per program
    (two, each half a block; one at head dim 256, whose resident tiles leave shared memory for a one-slot ring
    only with two), and launches of dK/dV over parts of the head dim (at 256 two: the whole dK and dV accumulators
    took 256 registers a thread), and of dQ (at 256 two where a mod's captured arrays take gradients: their
    gradient tile beside the whole dQ accumulator spilled registers). ``fused_dq``: dK/dV also sums dQ across its
    programs (``mosaic_fused_backward``; the dQ fields unused). ``ctas``: dQ and dK/dV each in that many resident
    CTAs, as ``MosaicTiles.ctas`` (0: a CTA per program)."""

    dq_rows: int
    dq_kv: int
    dq_stages: int
    dkv_rows: int
    dkv_q: int
    dkv_stages: int
    consumers: int = 2
    dkv_parts: int = 1
    fused_dq: bool = False
    dq_parts: int = 1
    ctas: int = 0

    def __post_init__(self):
        if self.consumers not in (1, 2) or self.dkv_parts not in (1, 2) or self.dq_parts not in (1, 2):
            raise ValueError(f"BackwardTiles: consumers, dkv_parts and dq_parts are 1 or 2, got {self}")
        if self.fused_dq and (self.dkv_parts != 1 or self.consumers != 2):
            raise ValueError(
                f"BackwardTiles: dQ is summed in dK/dV by two warpgroups over the whole head dim, got {self}"
            )

    @property
    def products(self) -> int:
        """Matrix products the backward makes per (query, key) pair: dQ's three (S, dP, dQ) and dK/dV's four (S^T,
        dV, dP^T, dK), S and dP once per dQ part, S^T and dP^T once per dK/dV part: 7, or 9 at head dim 256 (11
        with captured arrays). The kernels sum nothing across programs (a deterministic result), so S and dP are
        made twice; a backward that sums dQ across programs (``fused_dq``, as cuDNN's, FlashAttention 2 and 3) makes
        FUSED_BACKWARD_PRODUCTS."""
        return FUSED_BACKWARD_PRODUCTS if self.fused_dq else 2 * self.dq_parts + 1 + 2 + 2 * self.dkv_parts


FUSED_BACKWARD_PRODUCTS = 5  # S, dP, dV, dK, dQ


def fused_dq_columns(head_dim: int, consumers: int) -> int:
    """Columns of dS K a consumer warpgroup of ``mosaic_fused_backward`` makes and adds to dQ at a step: at head dim
    128 each of two makes 64, at 64 (the least a 128-byte swizzled K tile gives wgmma) one makes all of them, the
    two taking turns by step."""
    return max(64, head_dim // consumers)


def _smem_bytes(rows, tile, stages, head_dim, itemsize, per_slot_extra=0, n_slots=0, consumers=2) -> int:
    """One kernel's shared memory: the consumer warpgroups' resident tiles (q, dO or k, v) and, per document /
    position slot, their ids; ``stages`` ring slots of two streamed tiles, ``per_slot_extra`` bytes and each slot's
    tile ids."""
    own = consumers * (2 * rows * head_dim * itemsize + n_slots * rows * 4)
    slot = 2 * tile * head_dim * itemsize + per_slot_extra + n_slots * tile * 4
    return own + stages * slot


def _dkv_slot_extra(tiles: BackwardTiles) -> int:
    return 2 * tiles.dkv_q * 4  # lse and delta


def _dq_smem(t: BackwardTiles, head_dim: int, itemsize: int, slots: int, entries: int) -> int:
    """dQ's shared memory; with a mod's captured arrays also each warpgroup's packed row (their gradient tile goes
    from registers to global memory); in head-dim parts the tile that stages a part's dQ for its TMA store."""
    arrays = t.consumers * 4 * packed_entries(entries) if entries else 0
    part = t.consumers * t.dq_rows * (head_dim // t.dq_parts) * itemsize if t.dq_parts > 1 else 0
    return _smem_bytes(t.dq_rows, t.dq_kv, t.dq_stages, head_dim, itemsize, 0, slots, t.consumers) + arrays + part


def _dkv_smem(t: BackwardTiles, head_dim: int, itemsize: int, slots: int, entries: int, groups: int) -> int:
    """dK/dV's shared memory; with a mod's captured arrays also each warpgroup's packed rows of its query heads."""
    arrays = t.consumers * 4 * groups * packed_entries(entries) if entries else 0
    extra = _dkv_slot_extra(t)
    rest = _smem_bytes(t.dkv_rows, t.dkv_q, t.dkv_stages, head_dim, itemsize, extra, slots, t.consumers)
    if t.dkv_parts > 1:  # the tile that stages a part's dK, then dV, for their TMA stores
        rest += t.consumers * t.dkv_rows * (head_dim // t.dkv_parts) * itemsize
    if t.fused_dq:  # per consumer warpgroup dS^T in two buffers, and its columns of dS K in float32 staged for the
        # reduce-add
        rest += t.consumers * t.dkv_q * (2 * t.dkv_rows * itemsize + fused_dq_columns(head_dim, t.consumers) * 4)
    return rest + arrays


def backward_candidates(
    head_dim: int,
    dtype,
    block_q: int,
    block_kv: int,
    slots: int = 0,
    entries: int = 0,
    groups: int = 1,
    fused: bool = False,
) -> list[BackwardTiles]:
    """Every tiling these kernels can take for this head dim and blocks, best guess first, whose shared memory fits
    with ``slots`` document / position slots and a mod's captured arrays of ``entries`` per head (``groups`` query
    heads per kv head). Streamed tiles are 64 wide from head dim 128 on in the first guess, so that the score tiles,
    the float32 accumulators and the softmax fit 232 registers, and at every head dim with captured arrays (dQ's
    gradient tile takes registers too; sm_90 ptxas at head dim 64, T5 table and learned slopes chained: dQ 12 bytes
    of spills, dK/dV 0, against 240 with 128-wide tiles) or two document / position slots (each PARTIAL tile
    compares two pairs of id tiles; at head dim 64 dK/dV spilled 64 bytes with 128-wide tiles, 0 with 64-wide);
    ``experiments.hopper_attention --only sweep`` times the rest. Head dim 256 has one tiling: one consumer
    warpgroup of 64 rows, 64-wide tiles, two-slot rings, dK/dV in two halves of the head dim; none for more than 32
    captured entries a head with document / position slots. ``fused``: the
    tilings of ``mosaic_fused_backward`` (dK/dV summing dQ; head dims 64 and 128 without captured arrays), 64-wide
    q tiles first (its dS K tile [q, E] in float32 takes registers beside dK and dV); not with two document /
    position slots at head dim 128."""
    itemsize = jnp.dtype(dtype).itemsize
    if head_dim not in (64, 128, 256) or block_q % 128 or block_kv % 128 or max(block_q, block_kv) > 256:
        return []
    if fused:
        # two id slots at head dim 128 (documents at positions, as context parallelism's shards load them: a
        # PARTIAL tile compares two pairs of id tiles) spilled 16 bytes, with GQA 72 (sm_90 ptxas)
        if head_dim > 128 or entries or (head_dim == 128 and slots > 1):
            return []
        dkv_rows = block_kv // 2
        tiles = [BackwardTiles(block_q // 2, w, b, dkv_rows, w, b, fused_dq=True) for w in (64, 128) for b in (4, 3, 2)]
        return _with_resident(
            [t for t in tiles if _dkv_smem(t, head_dim, itemsize, slots, entries, groups) <= _SHARED_MEMORY]
        )
    if head_dim == 256 and slots and packed_entries(entries) > PACKED_ALIGN:
        # dQ's gradient tile of 64 entries (a table chained with slopes) beside a slot's ids spilled 8 bytes (sm_90
        # ptxas; 32 entries, or no slot: 0)
        return []
    if head_dim == 256:  # one consumer warpgroup of 64 rows per program, dK/dV (and with arrays dQ) in halves
        dq_rows, dkv_rows, widths = 64, 64, (64,)
        layout = {"consumers": 1, "dkv_parts": 2, "dq_parts": 2 if entries else 1}
    else:
        dq_rows, dkv_rows, layout = block_q // 2, block_kv // 2, {}
        widths = (128, 64) if head_dim <= 64 and not entries and slots < 2 else (64, 128)
    out = []
    for wide in widths:
        fitting = [
            t
            for a in (4, 3, 2)
            for b in (4, 3, 2)
            for t in [BackwardTiles(dq_rows, wide, a, dkv_rows, wide, b, **layout)]
            if _dq_smem(t, head_dim, itemsize, slots, entries) <= _SHARED_MEMORY
            and _dkv_smem(t, head_dim, itemsize, slots, entries, groups) <= _SHARED_MEMORY
        ]
        out += sorted(fitting, key=lambda t: -(t.dq_stages + t.dkv_stages))  # the deepest rings first
    return out if head_dim == 256 else _with_resident(out)


def _with_resident(candidates: list[BackwardTiles]) -> list[BackwardTiles]:
    """``candidates`` with, right after the first, the first with dQ and dK/dV in resident CTAs, one per SM, for
    the sweep to time (two consumer warpgroups only)."""
    return candidates[:1] + [dataclasses.replace(candidates[0], ctas=sm_count())] + candidates[1:] if candidates else []


def backward_tiles(head_dim: int, dtype, block_q: int, block_kv: int, **footprint) -> BackwardTiles | None:
    """The tiles these kernels use for this head dim and blocks (the first candidate), or None when they cannot.
    ``footprint``: ``backward_footprint``'s, what beside the tiles takes shared memory."""
    return next(iter(backward_candidates(head_dim, dtype, block_q, block_kv, **footprint)), None)


def backward_footprint(static) -> dict:
    """What beside the tiles takes these kernels' shared memory: document / position slots, the mod's captured
    arrays (entries per head), query heads per kv head."""
    return {"slots": id_slots(static.template), "entries": row_entries(static.score_mod), "groups": static.groups}


def supports_backward(static, dtype, head_dim: int) -> str | None:
    """None when these kernels can run this backward, else why not (the Triton kernels run instead)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name}"
    if backward_tiles(head_dim, dtype, static.block_q, static.block_kv) is None:
        return f"head dim {head_dim} with blocks {static.block_q}x{static.block_kv}"
    footprint = backward_footprint(static)
    if backward_tiles(head_dim, dtype, static.block_q, static.block_kv, **footprint) is None:
        slots, entries = footprint["slots"], footprint["entries"]
        return (
            f"{slots} document / position slots and {entries} captured score-mod entries at head dim {head_dim} "
            "(they do not fit the kernels' shared memory and registers)"
        )
    return None
