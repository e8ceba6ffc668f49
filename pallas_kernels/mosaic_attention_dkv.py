"""The dK/dV kernel of the Mosaic GPU attention backward (``mosaic_attention_bwd`` describes the layout it shares
with dQ), and the same kernel summing dQ across its programs (``mosaic_fused_backward``).

Fused, each step of a program (one block column of keys) also forms dQ's share of its keys, dS K, and adds it to a
float32 dQ in global memory with a TMA reduce-add: S and dP are made once per (query, key) pair, 5 products to the
two kernels' 7 (``BackwardTiles.products``), as cuDNN's backward and FlashAttention's do. dS^T goes to shared
memory (dK's left operand as it is, dQ's read transposed: its registers hold dS^T's layout), and the two consumer
warpgroups share theirs (one barrier a step), so that dS K is summed over the program's keys before the reduce-add:
at head dim 128 each makes 64 of its columns, at 64 one makes all of them, the two taking turns by step. The sums
land in whatever order the programs run, so dQ differs from run to run in its last bits.

Shape suffixes follow the legend in docs/architecture.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .kernel_inputs import COLUMN_ORDER, bhte_shape, head_rows, like
from .mosaic_attention import _LOG2E
from .mosaic_attention_bwd import (
    _layout,
    _load_resident,
    _output_derivative,
    _part_columns,
    _rebuilt_derivative,
    _scores,
)
from .mosaic_backward_tiles import BackwardTiles, fused_dq_columns
from .mosaic_pipeline import (
    BlockList,
    Modes,
    Programs,
    _accumulate,
    drain,
    fresh_zero,
    id_inputs,
    interpret_params,
    over_tiles,
    program_line,
    stream,
    vary_like,
)
from .score_tables import pack_rows, packed_rows, packed_width
from .tile_math import tile_bounds


def mosaic_dkv(
    static,
    tiles: BackwardTiles,
    q,
    k,
    v,
    d_out,
    lse,
    delta,
    mask_arrays,
    doc_arrays=(),
    mod_arrays=(),
    *,
    interpret: bool = False,
):
    """(dK, dV) [B, K, Sp, E] in k.dtype (q, k, v, dO, dK and dV in ``static.layout``), summed over each kv head's
    query heads; lse in log2 units as ``mosaic_dq`` takes it. ``doc_arrays`` as ``mosaic_dq``'s; ``mod_arrays`` as
    ``mosaic_forward``'s: each consumer
    warpgroup copies the packed rows of the kv head's query heads to shared memory once (the arrays' own gradients
    are ``mosaic_dq``'s). With ``tiles.dkv_parts`` > 1 each part of the head dim is a launch of its own,
    concatenated here."""
    parts = [
        _dkv_part(static, tiles, q, k, v, d_out, lse, delta, mask_arrays, doc_arrays, mod_arrays, part, interpret)
        for part in range(tiles.dkv_parts)
    ]
    if len(parts) == 1:
        return parts[0]
    return tuple(jnp.concatenate(xs, axis=-1) for xs in zip(*parts))


def _stage_layout(plgpu):
    """dS K's float32 stage: 64-byte swizzled (sm_90 ptxas, head dim 128, GQA: unswizzled 36 bytes of spills,
    128-byte swizzled 8, this 0; its store addresses, made from the lane, are held across the loop)."""
    return (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(64))


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=("interpret",))  # a Ref in GMEM lives in a jit
def mosaic_fused_backward(
    static, tiles: BackwardTiles, q, k, v, d_out, lse, delta, mask_arrays, doc_arrays=(), *, interpret: bool = False
):
    """(dQ [B, H, Tp, E], dK, dV [B, K, Sp, E], in ``static.layout``) from one launch: the dK/dV kernel also adds
    each step's dS K to a float32 dQ in global memory (a TMA reduce-add), so S and dP are made once per (query, key)
    pair, five products instead of ``mosaic_dq`` + ``mosaic_dkv``'s seven. The programs' sums land in whatever order
    they run: dQ is not bit-for-bit deterministic (as cuDNN's and FlashAttention's backward by default). ``tiles``:
    of ``backward_candidates(..., fused=True)`` (head dims 64 and 128, no captured arrays: their gradients are
    ``mosaic_dq``'s)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    dq_sum = jax.new_ref(jnp.zeros(q.shape, jnp.float32), memory_space=plgpu.GMEM)
    dk, dv = _dkv_part(static, tiles, q, k, v, d_out, lse, delta, mask_arrays, doc_arrays, (), 0, interpret, dq_sum)
    return vary_like((dq_sum[...] * static.scale).astype(q.dtype), q), dk, dv


def _dkv_part(
    static, tiles, q, k, v, d_out, lse, delta, mask_arrays, doc_arrays, mod_arrays, part, interpret, dq_sum=None
):
    """dK and dV's columns of head-dim part ``part`` of ``tiles.dkv_parts``: the scores and dP^T contract over the
    whole head dim (each part computes them again), the accumulators hold only the part's columns (at head dim 256
    the whole dK and dV took 256 registers a thread). ``dq_sum``: a float32 ``Ref`` in global memory shaped as q,
    zeros, to which each step adds its dS K (``mosaic_fused_backward``)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    layout = static.layout
    B, H, Tp, E = bhte_shape(q.shape, layout)
    K, Sp = bhte_shape(k.shape, layout)[1:3]
    G, rows, tq, stages = static.groups, tiles.dkv_rows, tiles.dkv_q, tiles.dkv_stages
    n_wg = tiles.consumers  # consumer warpgroups: a program owns n_wg * rows kv rows
    E_out = E // tiles.dkv_parts  # the part's columns of dK and dV

    def cols(ref):  # a tile's columns of this part
        return _part_columns(ref, part, E_out)

    dtype = q.dtype
    q_idx, q_np, q_cnt, q_order = (mask_arrays[i].astype(jnp.int32) for i in (3, 4, 5, COLUMN_ORDER))
    n_ids, id_arrays, ids_batched = id_inputs("mosaic_dkv", static, doc_arrays, Tp, Sp)
    packed = (pack_rows(mod_arrays),) if mod_arrays else ()
    n_ready = 2 + bool(n_ids) + bool(packed)  # a consumer's own copies: k, v (its kv ids, its heads' mod rows)
    fused = dq_sum is not None
    # The two consumer warpgroups share their dS^T (one barrier a step), so that dS K is summed over the program's
    # keys before it is added to dQ (``fused_dq_columns``). Each making all columns over its own keys doubled the
    # reduce-adds: 32 KB a step per program, at head dim 64 about 6 TB/s at the H100's peak rate of products.
    dq_cols = fused_dq_columns(E, n_wg)
    # the consumer warpgroups' own barriers: shared dS^T's two buffers and the loop's end
    loop_end, ds_barriers = 2, 3 if fused else 0
    if fused and (n_wg != 2 or tiles.dkv_parts != 1 or packed):
        raise ValueError("_dkv_part: dQ is summed here by two warpgroups over the whole head dim, no captured arrays")
    modes = Modes(plgpu, interpret)
    # As dQ's. sm_90 ptxas, spill bytes at 232 / 40 -> 240 / 24: head dim 64 with a document slot 8 -> 0, with a
    # soft-cap 484 -> 404; head dim 128 with GQA (G = 2) 52 -> 20, with a soft-cap 268 -> 164, a document slot 4 -> 4.
    # With the soft-cap's derivative rebuilt from p (``_rebuilt_derivative``), 0 at both head dims; with the
    # resident K and V's descriptors made each step (``fresh_zero``), GQA and a document slot 0 too.
    consumer_regs, producer_regs = (240, 24)
    programs = Programs(tiles.ctas, K, Sp // (n_wg * rows), B, ("heads", "cols", "batch"))

    def kernel(
        q_ref,
        k_ref,
        v_ref,
        do_ref,
        lse_ref,
        delta_ref,
        idx_ref,
        np_ref,
        cnt_ref,
        order_ref,
        qid_ref,
        kvid_ref,
        mod_ref,
        dq_ref,
        dk_ref,
        dv_ref,
        scoped,
    ):
        smem, ready, slot_ready, slot_free, qid_ready, ds_ready = scoped
        k_smem2, v_smem2, q_smem, do_smem, lse_smem, delta_smem, t_smem2, a_smem2, kvid_smem2, qid_smem = smem[:10]
        mod_smem2, out_smem2, ds_smem2, dq_smem2, dst_smem2 = smem[10:]
        wg = lax.axis_index("wg")

        def program(i):
            """(b, kv head, program, ids' batch row, mask's batch row) of this CTA's i-th program."""
            hk, prog, b = programs.at(i)
            return b, hk, prog, b if ids_batched else 0, b if static.mask_batched else 0

        # The column's block list is read in each warpgroup's branch: read before it, its counts were held across
        # both (sm_90 ptxas, the fused kernel at head dim 128 with GQA and documents: 12 bytes of spills -> 0)
        def column(bm, col):
            blocks = BlockList(idx_ref, np_ref, cnt_ref, bm, col, static.block_q, tq)
            return blocks.count, blocks.partial, blocks.start

        @pl.when(wg < n_wg)
        def _consumer():
            if n_wg == 2:  # one consumer and the producer have 255 registers a thread each without reallocation
                plgpu.set_max_registers(consumer_regs, action="increase")

            def consume(i, g0):
                b, hk, prog, bd, bm = program(i)
                col, first_row = program_line(order_ref, bm, prog, n_wg * rows, static.block_kv)  # heaviest first
                per_head, n_partial, tile_start = column(bm, col)
                k_own, v_own = k_smem2.at[wg], v_smem2.at[wg]
                base = first_row + wg * rows
                own_rows = pl.ds(base, rows)
                pairs = ((k_ref, k_own), (v_ref, v_own))
                copies = [(head_rows(src, layout, b, hk, own_rows), dst) for src, dst in pairs]
                if n_ids:
                    copies.append((kvid_ref.at[bd, slice(None), pl.ds(base, rows)], kvid_smem2.at[wg]))
                if packed:
                    copies.append((mod_ref.at[pl.ds(hk * G, G)], mod_smem2.at[wg]))
                _load_resident(plgpu, copies, ready, n_ready, wg)
                # [kv rows] per slot, read once; broadcast over a tile's q columns where a PARTIAL tile needs them
                kv_ids = [modes.vector(kvid_smem2.at[wg, i], 0) for i in range(n_ids)]

                def step(t, carry, g, masked):
                    dk, dv = carry
                    j = g0 + g * per_head + t  # the ring runs on from the CTA's earlier programs
                    slot = lax.rem(j, stages)
                    for r in slot_ready:
                        plgpu.barrier_wait(r.at[slot])
                    q_t = modes.transposed(q_smem.at[slot], t_smem2, wg)
                    q_first = tile_start(t)
                    z = fresh_zero(q_first)
                    s = modes.product(k_smem2.at[wg + z], q_t, (rows, tq))  # s^T [kv rows, q]
                    head = hk * G + g
                    if masked or static.score_mod is not None:
                        kv_pos, q_pos = modes.positions((rows, tq), base, q_first)  # s^T: kv rows, q columns

                        def entries():
                            return packed_rows(static.score_mod, mod_smem2.at[wg, g]) if packed else ()

                        ids = functools.partial(modes.id_tiles, kv_ids, qid_smem, qid_ready, slot, s.shape, False)
                        bounds = tile_bounds(q_first, tq, base, rows)
                        s, d_mod = _scores(static, s, q_pos, kv_pos, head, masked, ids, entries, bounds)
                        s2 = s * _LOG2E
                    else:
                        d_mod = None
                        s2 = s * (static.scale * _LOG2E)
                    # lse is read after the mask: read before it, its [q] vector was held beside a tile's q ids
                    lse2 = lax.broadcast_in_dim(modes.vector(lse_smem.at[slot], 1), (rows, tq), [1])  # log2 units
                    p = jnp.exp2(s2 - lse2)
                    p16 = modes.operand(p.astype(dtype), a_smem2, wg)
                    dv = _accumulate(plgpu, dv, p16, cols(do_smem.at[slot]), lambda: None, interpret)
                    do_t = modes.transposed(do_smem.at[slot], t_smem2, wg)
                    dp = modes.product(v_smem2.at[wg + z], do_t, (rows, tq))
                    delta = lax.broadcast_in_dim(modes.vector(delta_smem.at[slot], 1), (rows, tq), [1])
                    ds = p * (dp - delta)
                    if static.score_mod is not None and _output_derivative(static) is not None:  # lse read again
                        lse2 = lax.broadcast_in_dim(modes.vector(lse_smem.at[slot], 1), (rows, tq), [1])
                        d_mod = _rebuilt_derivative(static, p, lse2, d_mod)
                    if d_mod is not None:
                        ds = ds * d_mod
                    if fused:  # dS^T to shared memory: dK's left operand as it is, dQ's transposed
                        # (the buffer and warpgroup indices carry the step's zero: the stores' addresses are made
                        # each step, not held across the loop: at head dim 128 with GQA 132 -> 44 bytes of spills)
                        buf = lax.rem(j, 2) + z
                        ds_smem2.at[buf, wg + z][...] = ds.astype(dtype)
                        plgpu.commit_smem()
                        ds = ds_smem2.at[buf, wg + z]
                    else:
                        ds = modes.operand(ds.astype(dtype), a_smem2, wg)
                    dk = _accumulate(plgpu, dk, ds, cols(q_smem.at[slot]), lambda: None, interpret)
                    for f in slot_free:
                        plgpu.barrier_arrive(f.at[slot])
                    if fused:
                        add_dq(j, head, t, z)
                    return dk, dv

                def add_dq(j, head, t, z):
                    """This warpgroup's share of dS K [tq, dq_cols] over the program's keys (the scale applied
                    outside), added to the tile's rows of ``dq_sum``: dS^T is read from shared memory transposed as
                    wgmma's left operand (its registers held dS^T's layout, not dS's). Shared across warpgroups, it is
                    double-buffered: a warpgroup writes a buffer again two steps on, past the barrier of the step
                    between, which the other arrives on only once it has read it."""
                    buf = lax.rem(j, 2) + z
                    plgpu.barrier_arrive(ds_ready.at[buf])
                    plgpu.barrier_wait(ds_ready.at[buf])
                    part_cols = pl.ds(wg * dq_cols if dq_cols < E else 0, dq_cols)

                    def make_and_add():
                        dq = modes.zeros((tq, dq_cols))
                        for i in range(n_wg):
                            ds_t = modes.transposed(ds_smem2.at[buf, i + z], dst_smem2, wg)
                            k_cols = k_smem2.at[i + z].at[:, part_cols]
                            dq = _accumulate(plgpu, dq, ds_t, k_cols, lambda: None, interpret)
                        add(dq, head, t, z, part_cols)

                    if dq_cols < E:  # each warpgroup its columns
                        make_and_add()
                    else:  # the warpgroups take turns
                        pl.when(lax.rem(j, n_wg) == wg)(make_and_add)

                def add(dq, head, t, z, part_cols):
                    """``dq`` added to the tile's rows and ``part_cols`` of ``dq_sum``: staged in shared memory for a
                    TMA reduce-add, whose last one must have read the stage before it is written again."""
                    dq_own = dq_smem2.at[wg + z]
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    dq_own[...] = dq
                    plgpu.commit_smem()
                    dst = head_rows(dq_ref, layout, b, head, pl.ds(tile_start(t), tq), part_cols)
                    if interpret:  # the interpreter has no TMA reductions; it runs one program at a time
                        dst[...] = dst[...] + dq_own[...]
                    else:
                        plgpu.copy_smem_to_gmem(dq_own, dst, reduction_op="add")

                def per_group(g, carry):
                    # Padding needs no mask here: a padded query's lse is inf (p = 0, so it adds nothing), a padded
                    # key's dK and dV rows are cut off.
                    step_g = functools.partial(step, g=g)
                    return over_tiles(static, step_g, n_partial, per_head, carry, padding_matters=False)

                zeros = modes.zeros((rows, E_out))
                dk, dv = lax.fori_loop(0, G, per_group, (zeros, zeros))
                if ds_barriers:  # the other warpgroup's last dS K has read this one's K
                    plgpu.barrier_arrive(ds_ready.at[loop_end])
                    plgpu.barrier_wait(ds_ready.at[loop_end])
                # the rows read from the order again: held from the prologue (as the loops hold the line), they took
                # dK/dV with a T5 table chained with learned slopes at head dim 128 to 4 bytes of spills; read again in
                # each step as well, the fused kernel at the ~1B step's shape to 4 (sm_90 ptxas)
                own_rows = pl.ds(program_line(order_ref, bm, prog, n_wg * rows, static.block_kv)[1] + wg * rows, rows)
                if E_out == E:  # K and V are read no more: their tiles take dK and dV
                    k_own[...] = (dk * static.scale).astype(dtype)
                    v_own[...] = dv.astype(dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(k_own, head_rows(dk_ref, layout, b, hk, own_rows))
                    plgpu.copy_smem_to_gmem(v_own, head_rows(dv_ref, layout, b, hk, own_rows))
                else:  # a TMA store reads contiguous shared memory, not a part's columns: one tile, dK's then dV's
                    out_own = out_smem2.at[wg]
                    for acc, ref, factor in ((dk, dk_ref, static.scale), (dv, dv_ref, 1.0)):
                        out_own[...] = (acc * factor).astype(dtype)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(out_own, head_rows(ref, layout, b, hk, own_rows))
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.wait_smem_to_gmem(0)
                return g0 + G * per_head

            programs.over(consume)

        @pl.when(wg == n_wg)
        def _producer():
            if n_wg == 2:
                plgpu.set_max_registers(producer_regs, action="decrease")

            def produce(i, g0):
                b, hk, prog, bd, bm = program(i)
                col = program_line(order_ref, bm, prog, n_wg * rows, static.block_kv)[0]
                per_head, n_partial, tile_start = column(bm, col)
                n_steps = G * per_head

                def load(j, slot):
                    head = hk * G + lax.div(j, jnp.maximum(per_head, 1))
                    t = lax.rem(j, jnp.maximum(per_head, 1))
                    start = tile_start(t)
                    tile = pl.ds(start, tq)
                    sources = (
                        head_rows(q_ref, layout, b, head, tile),
                        head_rows(do_ref, layout, b, head, tile),
                        lse_ref.at[b, head, tile],
                        delta_ref.at[b, head, tile],
                    )
                    for src, dst, r in zip(sources, (q_smem, do_smem, lse_smem, delta_smem), slot_ready):
                        plgpu.copy_gmem_to_smem(src, dst.at[slot], r.at[slot])
                    if n_ids:  # every slot's q ids of a PARTIAL q tile, beside its Q (the slot frees with Q's)

                        @pl.when(t < n_partial)
                        def _():
                            ids_at = (bd, slice(None), pl.ds(start, tq))
                            plgpu.copy_gmem_to_smem(qid_ref.at[ids_at], qid_smem.at[slot], qid_ready.at[slot])

                stream(plgpu, n_steps, stages, load, slot_free, programs.offset(g0))
                return g0 + n_steps

            steps = programs.over(produce)
            if programs.ctas:
                drain(plgpu, steps, stages, slot_free)

    def attention_dkv(*refs):
        ins, outs = refs[:-2], refs[-2:]
        ins, dq = (ins[:-1], ins[-1:]) if fused else (ins, (None,))
        ins, mod = (ins[:-1], ins[-1:]) if packed else (ins, (None,))
        refs = (*ins, *((None, None) if not n_ids else ()), *mod, *dq, *outs)
        swizzled = _layout(plgpu)
        scratch = (
            plgpu.SMEM((n_wg, rows, E), dtype, transforms=swizzled),
            plgpu.SMEM((n_wg, rows, E), dtype, transforms=swizzled),
            plgpu.SMEM((stages, tq, E), dtype, transforms=swizzled),
            plgpu.SMEM((stages, tq, E), dtype, transforms=swizzled),
            plgpu.SMEM((stages, tq), jnp.float32),
            plgpu.SMEM((stages, tq), jnp.float32),
            plgpu.SMEM((n_wg, E, tq), dtype) if interpret else None,
            plgpu.SMEM((n_wg, rows, tq), dtype) if interpret else None,
            plgpu.SMEM((n_wg, n_ids, rows), jnp.int32) if n_ids else None,
            plgpu.SMEM((stages, n_ids, tq), jnp.int32) if n_ids else None,
            plgpu.SMEM((n_wg, G, packed_width(mod_arrays)), jnp.float32) if packed else None,
            plgpu.SMEM((n_wg, rows, E_out), dtype, transforms=swizzled) if E_out < E else None,
            plgpu.SMEM((2, n_wg, rows, tq), dtype, transforms=swizzled) if fused else None,
            plgpu.SMEM((n_wg, tq, dq_cols), jnp.float32, transforms=_stage_layout(plgpu)) if fused else None,
            plgpu.SMEM((n_wg, tq, rows), dtype) if fused and interpret else None,
        )
        pl.run_scoped(
            lambda *scoped: kernel(*refs, scoped),
            scratch,
            plgpu.Barrier(num_barriers=n_wg * n_ready),
            (plgpu.Barrier(num_barriers=stages),) * 4,
            (plgpu.Barrier(num_arrivals=n_wg, num_barriers=stages),),
            plgpu.Barrier(num_barriers=stages) if n_ids else None,
            plgpu.Barrier(num_arrivals=n_wg, num_barriers=ds_barriers) if ds_barriers else None,
            collective_axes="wg",
        )

    out = like((*k.shape[:3], E_out), k.dtype, k)
    grid = dict(**programs.grid, num_threads=n_wg + 1)
    params = dict(compiler_params=plgpu.CompilerParams(approx_math=True), **interpret_params(interpret))
    args = (q, k, v, d_out, lse[..., 0], delta[..., 0], q_idx, q_np, q_cnt, q_order, *id_arrays, *packed)
    if fused:  # pl.kernel: plgpu.kernel's vmap rule cannot take a Ref operand (which it aliases in and out)
        mesh = plgpu.Mesh(**grid, thread_name="wg")
        dk, dv = pl.kernel(attention_dkv, out_type=(out, out), mesh=mesh, name="attention_dkv_dq", **params)(
            *args, dq_sum
        )
    else:
        dk, dv = plgpu.kernel(attention_dkv, out_type=(out, out), **grid, thread_name="wg", **params)(*args)
    return vary_like(dk, k), vary_like(dv, k)
