"""The block-sparse attention forward as a Mosaic GPU kernel for Hopper (sm_90): TMA, wgmma, warp specialisation.

The Triton kernels in ``pallas_attention`` cannot issue TMA copies, split warps into producers and consumers or move
registers between them, and on an H100 they reach about half of cuDNN's forward. This kernel is laid out the way
FlashAttention-3 is, and walks only the tiles the block mask keeps:

- a program owns one row of the block mask (``block_q`` queries) of one head; three warpgroups share it;
- warpgroup 2, the producer, gives most of its registers away and streams the row's K/V tiles, in the order of the
  mask's list (PARTIAL blocks first, then FULL ones), through a ring of ``stages`` shared-memory slots with TMA;
- warpgroups 0 and 1 each own half of the rows and take turns on the tensor cores (one runs its softmax while the
  other's wgmma runs), synchronised by a schedule barrier; both walk the same list, so their turns stay paired
  (``MosaicTiles.turns`` off: no turns, each runs as it comes, for the sweep to time);
- the element mask and score mod run on PARTIAL tiles only; FULL tiles go straight from wgmma to the online softmax,
  kept in base 2 so each exponential is one ``ex2``.

Masks are evaluated on full-tile position iotas in the wgmma register layout, so every static mask written with
elementwise ops works unchanged. Document (segment-id) and position slots (``kernel_mask``) are loaded as ids: each
consumer warpgroup reads its rows' q ids once (a vector in the row layout of the wgmma accumulator), and the producer
streams each PARTIAL tile's kv ids with TMA beside its K tile (one more ring, one more barrier per slot); FULL tiles
load none. A score mod's captured arrays (``score_tables``: a bias table, learned slopes) come packed as one [H, n]
input; each consumer warpgroup copies its head's row to shared memory once and reads the entries as scalars on
every tile. The backward (``mosaic_attention_bwd``, or the Triton kernels where it cannot run) takes the same outputs
(out, lse) from either forward.

Shape suffixes follow the legend in docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .kernel_inputs import ROW_ORDER, bhte_shape, head_rows, like
from .mosaic_pipeline import (
    BlockList,
    Modes,
    Programs,
    _accumulate,
    drain,
    fresh_zero,
    id_inputs,
    id_slots,
    interpret_params,
    over_tiles,
    program_line,
    stream_kv,
    vary_like,
)
from .score_tables import pack_rows, packed_rows, packed_width, row_entries
from .targets import H100_SHARED_MEMORY_PER_BLOCK, sm_count
from .tile_math import tile_bounds

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
# What a kernel may ask for on an H100 / H200 (227 KiB), less room for barriers and alignment (three ring slots
# at head dim 128 asked for 232,568 B).
_SHARED_MEMORY = H100_SHARED_MEMORY_PER_BLOCK - 4096


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """Rows per compute warpgroup (half the mask's block_q), kv columns per tile, and K/V ring slots. ``turns``:
    the two compute warpgroups take turns on the tensor cores (FlashAttention-3's ping-pong, the default); without
    them each runs its steps as they come. Why both: turns pay where a warpgroup's softmax is shorter than the
    other's products; at head dim 64 a tile's products are half as long, its 66 exponentials a warp the same.
    ``ctas``: 0, a CTA per program, as many as the grid has, which the GPU starts as SMs free up; n > 0, n CTAs
    that stay resident and each take every n-th program (persistent, as FlashAttention-3's), the K/V ring running
    on from one program into the next: no wave of CTAs half full at the end, and no program's start waiting on its
    first loads."""

    rows: int
    kv: int
    stages: int
    turns: bool = True
    ctas: int = 0


def _smem_bytes(tiles: MosaicTiles, head_dim: int, itemsize: int, n_slots: int = 0) -> int:
    """Q/O staging, the K/V ring and lse, plus per document / position slot its q ids and a ring of kv ids."""
    qo = 2 * tiles.rows * head_dim * itemsize
    kv = 2 * tiles.stages * tiles.kv * head_dim * itemsize
    ids = n_slots * (2 * tiles.rows + tiles.stages * tiles.kv) * 4
    return qo + kv + 2 * tiles.rows * 4 + ids


def forward_candidates(head_dim: int, dtype, block_q: int, block_kv: int, entries: int = 0) -> list[MosaicTiles]:
    """Every tiling the kernel can take for this head dim and blocks, best guess first: the rows of a program are
    one block row of 128 split between two warpgroups (wgmma's 64 rows each), kv tiles divide the block, and the
    K/V ring (two slots at least) fits shared memory. ``experiments.hopper_attention --only sweep`` times them.
    With a mod's captured arrays (``entries`` per head) 64-wide kv tiles come first from head dim 128 on: a table's
    bucket tile takes registers beside the scores and the wider accumulator (sm_90, head dim 128, T5 table: 96 bytes
    of spills with 128-wide tiles, 0 with 64; chained with learned slopes 84 and 0; at head dim 64 128-wide spill
    nothing)."""
    itemsize = jnp.dtype(dtype).itemsize
    if block_q != 128 or head_dim % 64 or head_dim > 256:  # block_q 256 (128 rows a warpgroup) spills
        return []
    rows = block_q // 2
    widths = (64, 128) if entries and head_dim >= 128 else (128, 64)
    candidates = [MosaicTiles(rows, kv, stages) for kv in widths if block_kv % kv == 0 for stages in (4, 3, 2)]
    fitting = [t for t in candidates if _smem_bytes(t, head_dim, itemsize) <= _SHARED_MEMORY]
    # for the sweep, right after the first: each width's deepest ring without turns, and the first in resident CTAs
    untaken = [dataclasses.replace(t, turns=False) for t in fitting if t == next(u for u in fitting if u.kv == t.kv)]
    resident = [dataclasses.replace(fitting[0], ctas=sm_count())] if fitting else []
    return fitting[:1] + untaken + resident + fitting[1:]


def mosaic_tiles(head_dim: int, dtype, block_q: int, block_kv: int, entries: int = 0) -> MosaicTiles | None:
    """The tiles for this head dim and blocks (the widest kv tile with the deepest ring that fits; from head dim 128
    on, 64 wide with a mod's captured arrays), or None when the kernel cannot take them."""
    return next(iter(forward_candidates(head_dim, dtype, block_q, block_kv, entries)), None)


def supports(static, dtype, head_dim: int) -> str | None:
    """None when the Mosaic forward can run this attention, else why not (the Triton kernel runs instead)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} (wgmma takes bfloat16 / float16 here)"
    tiles = mosaic_tiles(head_dim, dtype, static.block_q, static.block_kv, row_entries(static.score_mod))
    if tiles is None:
        return f"head dim {head_dim} with blocks {static.block_q}x{static.block_kv}"
    slots = id_slots(static.template)
    if _smem_bytes(tiles, head_dim, jnp.dtype(dtype).itemsize, slots) > _SHARED_MEMORY:
        return f"{slots} document / position slots at head dim {head_dim} (their ids do not fit shared memory)"
    return None


def mosaic_forward(
    static, tiles: MosaicTiles, q, k, v, mask_arrays, doc_arrays=(), mod_arrays=(), *, interpret: bool = False
):
    """(out [B, H, Tp, E] in q.dtype, lse [B, H, Tp, 1] float32) over the padded q/k/v, like the Triton forward;
    q, k, v and out in ``static.layout`` (out [B, Tp, H, E] in "BTHE").

    ``mask_arrays`` are ``kernel_inputs.list_arrays``' and ``line_orders``' (kv block indices, partial counts,
    counts, ..., the rows' order: programs take the rows with the most tiles first);
    ``doc_arrays`` per document / position slot of ``static.template``, in slot order, its q ids [1 or B, Tp] and
    kv ids [1 or B, Sp] (int32, zero-padded: ``kernel_inputs.segment_arrays``), 2-D or as the Triton kernels'
    [.., Tp, 1] / [.., 1, Sp] views. ``mod_arrays``: the [H, n] arrays a score mod captures (``score_tables.
    split_arrays``); each compute warpgroup copies its head's packed row of them to shared memory once and reads
    the entries as scalars where the mod looks them up."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    layout = static.layout
    B, H, Tp, E = bhte_shape(q.shape, layout)
    Sp = bhte_shape(k.shape, layout)[2]
    G = static.groups
    rows, tkv, stages = tiles.rows, tiles.kv, tiles.stages
    dtype = q.dtype
    kv_idx, kv_np, kv_cnt, kv_order = (mask_arrays[i] for i in (0, 1, 2, ROW_ORDER))
    n_ids, id_arrays, ids_batched = id_inputs("mosaic_forward", static, doc_arrays, Tp, Sp)
    packed = (pack_rows(mod_arrays),) if mod_arrays else ()
    modes = Modes(plgpu, interpret)
    # Registers per thread of a consumer / the producer warpgroup (2 x consumer + producer <= 504). With id slots or a
    # mod's arrays the consumers take FlashAttention-3's 240 / 24: at head dim 256 two slots' ids spilled 8 bytes at
    # 232 / 40, and at head dim 128 a T5 bias table 72 bytes.
    consumer_regs, producer_regs = (240, 24) if n_ids or packed else (232, 40)
    programs = Programs(tiles.ctas, H, Tp // (2 * rows), B, ("heads", "rows", "batch"))

    def kernel(
        q_ref, k_ref, v_ref, idx_ref, np_ref, cnt_ref, order_ref, qid_ref, kvid_ref, mod_ref, out_ref, lse_ref, scoped
    ):
        smem, (k_ready, v_ready, q_ready), (k_free, v_free), turn, (kvid_ready, qid_ready), mod_ready = scoped
        qo_smem2, k_smem, v_smem, lse_smem2, kt_smem, p_smem, qid_smem2, kvid_smem, mod_smem2 = smem
        wg = lax.axis_index("wg")

        def program(i):
            """(b, h, its mask's batch row, its ids' batch row, first row, block list) of this CTA's i-th program."""
            h, prog, b = programs.at(i)
            bm = b if static.mask_batched else 0
            row, first_row = program_line(order_ref, bm, prog, 2 * rows, static.block_q)
            blocks = BlockList(idx_ref, np_ref, cnt_ref, bm, row, static.block_kv, tkv)
            return b, h, bm, b if ids_batched else 0, first_row, blocks

        def take_turn():
            if tiles.turns:
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(turn)

        @pl.when(wg < 2)
        def _consumer():
            plgpu.set_max_registers(consumer_regs, action="increase")

            def consume(i, g0):
                b, h, _, bd, first_row, blocks = program(i)
                n_tiles, n_partial, tile_start = blocks.count, blocks.partial, blocks.start
                qo_smem, lse_smem = qo_smem2.at[wg], lse_smem2.at[wg]
                q_base = first_row + wg * rows
                plgpu.copy_gmem_to_smem(head_rows(q_ref, layout, b, h, pl.ds(q_base, rows)), qo_smem, q_ready.at[wg])
                if n_ids:
                    at = (bd, slice(None), pl.ds(q_base, rows))
                    plgpu.copy_gmem_to_smem(qid_ref.at[at], qid_smem2.at[wg], qid_ready.at[wg])
                if packed:
                    plgpu.copy_gmem_to_smem(mod_ref.at[h], mod_smem2.at[wg], mod_ready.at[wg])
                    plgpu.barrier_wait(mod_ready.at[wg])
                plgpu.barrier_wait(q_ready.at[wg])
                q_ids = []
                if n_ids:  # [rows] per slot, read once; broadcast over a tile's columns where a PARTIAL tile needs them
                    plgpu.barrier_wait(qid_ready.at[wg])
                    q_ids = [modes.vector(qid_smem2.at[wg, i], 0) for i in range(n_ids)]

                m = modes.cast(jnp.full((rows,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
                l = modes.cast(jnp.full((rows,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
                acc = modes.zeros((rows, E))

                @pl.when(n_tiles > 0)
                def _():
                    plgpu.barrier_wait(k_ready.at[lax.rem(g0, stages)])

                if tiles.turns:
                    pl.when(wg == 1)(take_turn)  # warpgroup 1 starts half a turn behind

                def step(j, carry, masked: bool):
                    acc, m, l = carry
                    slot = lax.rem(g0 + j, stages)  # the ring runs on from the CTA's earlier programs

                    k_t = modes.transposed(k_smem.at[slot], kt_smem, wg)

                    # at head dim 256 Q's wgmma descriptors (16 k-steps) are made anew each step (sm_90 ptxas, documents
                    # with GQA: 12 bytes of spills -> 0); head dims 64 and 128, measured on a GPU, keep their code
                    z = fresh_zero(tile_start(j)) if E > 128 else 0

                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, qo_smem2.at[wg + z], k_t)
                        take_turn()
                        return acc_ref[...]

                    s = pl.run_scoped(qk, plgpu.ACC((rows, tkv), jnp.float32))
                    plgpu.barrier_arrive(k_free.at[slot])
                    if masked or static.score_mod is not None:
                        kv_first = tile_start(j)

                        make_q_pos, make_kv_pos = modes.positions((rows, tkv), q_base, kv_first)

                        # the mod's entries are read from shared memory on every tile (inside the branch that reads
                        # them, with a tile shortcut), not held in registers
                        def read_entries():
                            return packed_rows(static.score_mod, mod_smem2.at[wg]) if packed else ()

                        bounds = tile_bounds(q_base, rows, kv_first, tkv)
                        scaled = s * static.scale
                        s, _ = static.mod_scores(scaled, make_q_pos, make_kv_pos, h, arrays=read_entries, tile=bounds)
                        if masked:
                            # the kv ids are read here, where the mask needs them (their ring slot frees with V's;
                            # read sooner, two slots' ids held 64 more registers across the wgmma wait and spilled)
                            ids = modes.id_tiles(q_ids, kvid_smem, kvid_ready, slot, s.shape, True)
                            s = jnp.where(static.keep(ids, make_q_pos(), make_kv_pos()), s, -jnp.inf)
                        to_log2 = _LOG2E
                    else:
                        to_log2 = static.scale * _LOG2E
                    # in log2 units: the row max taken on s and scaled once a row (to_log2 > 0, so it is the max
                    # of the scaled scores), and each score scaled inside its exponent's fma: one multiply a score
                    # less (sm_90, head dim 64: 491 -> 429 instructions a tile)
                    m_new = jnp.maximum(m, s.max(axis=1) * to_log2)
                    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen nothing yet
                    alpha = jnp.exp2(m - m_safe)
                    p = jnp.exp2(s * to_log2 - lax.broadcast_in_dim(m_safe, s.shape, [0]))
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    l = l * alpha + p.sum(axis=1)
                    p16 = p.astype(dtype)
                    acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
                    if tiles.turns:
                        plgpu.barrier_arrive(turn)  # softmax done
                    plgpu.barrier_wait(v_ready.at[slot])
                    if tiles.turns:
                        plgpu.barrier_wait(turn)  # the tensor cores are ours

                    def wait_next_k():
                        nxt = j + 1

                        @pl.when(nxt < n_tiles)
                        def _():
                            plgpu.barrier_wait(k_ready.at[lax.rem(g0 + nxt, stages)])

                    p16 = modes.operand(p16, p_smem, wg)
                    acc = _accumulate(plgpu, acc, p16, v_smem.at[slot], wait_next_k, interpret)
                    plgpu.barrier_arrive(v_free.at[slot])
                    return acc, m_new, l

                acc, m, l = over_tiles(static, step, n_partial, n_tiles, (acc, m, l))
                if tiles.turns:
                    pl.when(wg == 0)(take_turn)  # pair warpgroup 1's first half turn

                seen = l > 0.0  # False on padding rows and rows the mask empties
                l_safe = jnp.where(seen, l, 1.0)
                acc = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
                qo_smem[...] = acc.astype(dtype)
                lse_smem[...] = jnp.where(seen, (m + jnp.log2(l_safe)) * _LN2, jnp.inf)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(qo_smem, head_rows(out_ref, layout, b, h, pl.ds(q_base, rows)))
                plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(q_base, rows)])
                plgpu.wait_smem_to_gmem(0)
                return g0 + n_tiles

            programs.over(consume)

        @pl.when(wg == 2)
        def _producer():
            plgpu.set_max_registers(producer_regs, action="decrease")
            kv = ((k_ref, k_smem, k_ready), (v_ref, v_smem, v_ready))

            def produce(i, g):
                b, h, _, bd, _, blocks = program(i)
                ids = (kvid_ref.at[bd], kvid_smem, kvid_ready) if n_ids else None
                free = (k_free, v_free)
                stream_kv(plgpu, blocks, stages, b, lax.div(h, G), kv, free, ids, layout, programs.offset(g))
                return g + blocks.count

            steps = programs.over(produce)
            if programs.ctas:
                drain(plgpu, steps, stages, (k_free, v_free))

    def attention_forward(q_ref, k_ref, v_ref, idx_ref, np_ref, cnt_ref, order_ref, *refs):  # the name a profile
        # reads off the instruction's op_name (sharding.hlo.kernel_kinds), as dQ's and dK/dV's
        qid_ref, kvid_ref = refs[:2] if n_ids else (None, None)
        mod_ref = refs[-3] if packed else None
        out_ref, lse_ref = refs[-2:]
        swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        scratch = (
            plgpu.SMEM((2, rows, E), dtype, transforms=swizzled),
            plgpu.SMEM((stages, tkv, E), dtype, transforms=swizzled),
            plgpu.SMEM((stages, tkv, E), dtype, transforms=swizzled),
            plgpu.SMEM((2, rows), jnp.float32),
            plgpu.SMEM((2, E, tkv), dtype) if interpret else None,
            plgpu.SMEM((2, rows, tkv), dtype) if interpret else None,
            plgpu.SMEM((2, n_ids, rows), jnp.int32) if n_ids else None,
            plgpu.SMEM((stages, n_ids, tkv), jnp.int32) if n_ids else None,
            plgpu.SMEM((2, packed_width(mod_arrays)), jnp.float32) if packed else None,
        )
        refs = (q_ref, k_ref, v_ref, idx_ref, np_ref, cnt_ref, order_ref, qid_ref, kvid_ref, mod_ref, out_ref, lse_ref)
        pl.run_scoped(
            lambda *scoped: kernel(*refs, scoped),
            scratch,
            (
                plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=2),
            ),
            (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=2),
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=2)) if n_ids else (None, None),
            plgpu.Barrier(num_barriers=2) if packed else None,
            collective_axes="wg",
        )

    out, lse = plgpu.kernel(
        attention_forward,
        out_type=(
            like(q.shape, dtype, q),
            like((B, H, Tp), jnp.float32, q),
        ),
        **programs.grid,
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **interpret_params(interpret),
    )(q, k, v, *(a.astype(jnp.int32) for a in (kv_idx, kv_np, kv_cnt, kv_order)), *id_arrays, *packed)
    return vary_like(out, q), vary_like(lse[..., None], q)
