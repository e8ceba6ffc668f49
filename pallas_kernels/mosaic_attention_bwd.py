"""The block-sparse attention backward as two Mosaic GPU kernels for Hopper (sm_90): dQ (here), and dK/dV
(``mosaic_attention_dkv``), with what both compute alike.

Both are laid out like the forward in ``mosaic_attention``: a producer warpgroup streams tiles with TMA through a
ring of shared-memory slots, in the order of the block mask's lists (PARTIAL blocks first, then FULL ones), and two
consumer warpgroups each own half of the program's rows and multiply on the tensor cores with wgmma:

- dQ: a program owns one block row of queries of one head; the producer streams that row's K and V tiles;
  p = exp(s - lse), dp = dO V^T, ds = p (dp - delta), dQ += ds K.
- dK/dV: a program owns one block column of keys of one kv head; the producer streams, for each of the kv head's
  query heads in turn, the column's Q and dO tiles with their lse and delta; in transposed form
  p^T = exp(K Q^T - lse), dV += p^T dO, dp^T = V dO^T, ds^T = p^T (dp^T - delta), dK += ds^T Q. Summing the query
  heads of a group inside the program keeps grouped-query attention free of repeated K/V.

A score mod's captured arrays come packed, as to the forward: each consumer warpgroup copies its head's row (dK/dV:
its kv head's query heads' rows) to shared memory once. dQ also forms their gradients: per query row, each entry's
share of dS summed over the row's keys (``score_tables.add_row_grads_per_row``: Mosaic GPU reduces a tile one axis
at a time), carried in registers across the row's tiles as a [rows, packed entries] tile (entry i in column i) and
written as [B, H, Tp, packed entries]; the rows and batch are summed outside. Where the arrays only add terms before
the rest of the mod acts (``score_tables.added_part``: a table and slopes, then a soft-cap), the gradients are the
adding part's, at dS times the mod's derivative.

The element mask runs on PARTIAL tiles only, the score mod on every tile; where the mask cuts only padding
(``full()`` over lengths that are not whole blocks) neither kernel needs it (``over_tiles``): a padded query's lse
is inf, so its p is 0, and a padded key's K and V rows are zeros (its dK / dV rows are cut off), unless a mod's
captured arrays take gradients in dQ. A mod's derivative in the score is a tile
held from the scores to dS, unless the mod only adds to the score (it is 1) or has an ``output_derivative`` (a
soft-cap: 1 - (out / cap)^2), which is rebuilt from p where dS needs it. Nothing is accumulated across programs, so
the result is deterministic (``mosaic_attention_dkv.mosaic_fused_backward`` is the dK/dV kernel summing dQ too, in
whatever order its programs run). Document and position slots (``kernel_mask``) are loaded as ids, as the forward
loads them: each consumer warpgroup reads the ids of its own rows once (dQ: its q ids; dK/dV: its kv ids), a vector
in the row layout of the wgmma accumulator, and the producer streams the ids of each PARTIAL tile's other axis with
TMA beside its first operand (dQ: kv ids beside K; dK/dV: q ids beside Q) through one more ring, one more barrier per
slot; FULL tiles load none.

Head dim 256 (``BackwardTiles.consumers`` 1, ``dkv_parts`` 2): its resident tiles leave shared memory for a ring of
one slot with two consumer warpgroups, so a program has one, of 64 rows (two programs per block), and no register
reallocation (each of its 256 threads may take 255); dK and dV at once took 256 registers a thread, so dK/dV runs as
two launches, each accumulating half of the head dim's columns, the scores and dP^T over all of it computed in both
(1.5x dK/dV's products); with a mod's captured arrays dQ too (``dq_parts`` 2; the first launch forms the arrays'
gradients: their tile beside the whole accumulator spilled 224 bytes with a T5 table). The resident tiles' wgmma
descriptors are made each step (``fresh_zero``): held across the loop, 16 k-steps' of them for two resident
operands spilled about 210 bytes per kernel on sm_90.

Shape suffixes follow the legend in docs/architecture.md.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .kernel_inputs import ROW_ORDER, bhte_shape, head_rows, like
from .mosaic_attention import _LN2, _LOG2E
from .mosaic_backward_tiles import BackwardTiles
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
    stream_kv,
    vary_like,
)
from .score_tables import (
    add_row_grads_per_row,
    added_part,
    pack_rows,
    packed_entries,
    packed_rows,
    packed_width,
    row_entries,
)
from .tile_math import tile_bounds


def _scores(static, s, q_pos, kv_pos, head, masked, doc_tiles, entries=(), tile=None):
    """Scaled, score-modded scores (masked to -inf on PARTIAL tiles) and d mod / d s (None without a mod, or where
    the mod rebuilds it from its output: ``_rebuilt_derivative``).
    ``doc_tiles()`` gives the mask's (q ids, kv ids) tiles per slot, shaped like ``s``; called on PARTIAL tiles
    only, where the mask needs them. ``q_pos()`` / ``kv_pos()`` make the positions and ``entries()`` reads the
    head's rows of the mod's captured arrays (HeadRows) where they are used (with the mod's tile shortcut, inside
    its branch: held across it, they spilled); ``tile``: the tile's bounds, for that shortcut."""
    with_grad = _output_derivative(static) is None
    s, d_mod = static.mod_scores(s * static.scale, q_pos, kv_pos, head, with_grad=with_grad, arrays=entries, tile=tile)
    if masked:
        s = jnp.where(static.keep(doc_tiles(), q_pos(), kv_pos()), s, -jnp.inf)
    return s, d_mod


def _output_derivative(static):
    return static.score_mod.output_derivative if static.score_mod is not None else None


def _rebuilt_derivative(static, p, lse2, d_mod):
    """``d_mod``, or where the mod has an ``output_derivative`` (a soft-cap), d mod / d s rebuilt from the
    probabilities ``p`` = exp2(modded * log2(e) - ``lse2``): held from the scores to dS instead, the derivative tile
    spilled registers (sm_90, dK/dV: 404 bytes at head dim 64, 164 at 128). Where p is 0 (masked scores, rows that
    see nothing, whose lse is inf) it is 0."""
    derivative = _output_derivative(static)
    if derivative is None:
        return d_mod
    return jnp.where(p > 0.0, derivative((jnp.log2(p) + lse2) * _LN2), 0.0)


def _load_resident(plgpu, copies, ready, n_ready: int, wg):
    """A consumer warpgroup's resident tiles (``copies``: (source, shared-memory destination) pairs), each on its own
    barrier of the warpgroup's ``n_ready``, waited for before its loop starts."""
    for i, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src, dst, ready.at[n_ready * wg + i])
    for i in range(n_ready):
        plgpu.barrier_wait(ready.at[n_ready * wg + i])


def _part_columns(ref, part: int, width: int):
    """``ref``'s columns of head-dim part ``part`` (``width`` each), or the whole ref where one part is all of them:
    the operand of a launch that accumulates part of dQ, dK or dV."""
    return ref if width == ref.shape[-1] else ref.at[:, pl.ds(part * width, width)]


def _layout(plgpu):
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


# ----------------------------------------------------------------------------- dQ


def mosaic_dq(
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
    """dQ [B, H, Tp, E] in q.dtype (q, k, v, dO and dQ in ``static.layout``); lse and delta [B, H, Tp, 1] float32
    as the Triton kernels take them, but lse in log2 units (lse * log2(e): dK/dV then scales no score's).
    ``doc_arrays``: the forward's (``mosaic_forward``), per document / position slot its q ids and kv ids.
    ``mod_arrays``: the mod's captured arrays as ``mosaic_forward`` takes them; with them the result is (dQ, their
    gradients per query row [B, H, Tp, packed entries] float32: each entry's share of dS summed over the row's keys,
    ``add_row_grads_per_row``), summed over rows and batch outside. With ``tiles.dq_parts`` > 1 each part of the
    head dim is a launch of its own, concatenated here (the first also forms the arrays' gradients)."""
    n_entries = row_entries(static.score_mod)
    if bool(n_entries) != bool(mod_arrays):
        raise ValueError(f"mosaic_dq: {len(mod_arrays)} captured arrays for a mod with {n_entries} entries")
    args = (static, tiles, q, k, v, d_out, lse, delta, mask_arrays, doc_arrays, mod_arrays)
    parts = [_dq_part(*args, part, interpret) for part in range(tiles.dq_parts)]
    dq = parts[0][0] if len(parts) == 1 else jnp.concatenate([p[0] for p in parts], axis=-1)
    return (dq, parts[0][1]) if mod_arrays else dq


def _dq_part(static, tiles, q, k, v, d_out, lse, delta, mask_arrays, doc_arrays, mod_arrays, part, interpret):
    """(dQ's columns of head-dim part ``part`` of ``tiles.dq_parts``, the arrays' gradients per row or None): the
    scores and dP contract over the whole head dim (each part makes them again), the accumulator holds the part's
    columns (at head dim 256 beside the arrays' gradient tile the whole of it spilled registers); the first part
    forms the gradients."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    n_entries = row_entries(static.score_mod)
    layout = static.layout
    B, H, Tp, E = bhte_shape(q.shape, layout)
    Sp = bhte_shape(k.shape, layout)[2]
    G, rows, tkv, stages = static.groups, tiles.dq_rows, tiles.dq_kv, tiles.dq_stages
    n_wg = tiles.consumers  # consumer warpgroups: a program owns n_wg * rows query rows
    E_out = E // tiles.dq_parts  # the part's columns of dQ

    dtype = q.dtype
    kv_idx, kv_np, kv_cnt, kv_order = (mask_arrays[i].astype(jnp.int32) for i in (0, 1, 2, ROW_ORDER))
    n_ids, id_arrays, ids_batched = id_inputs("mosaic_dq", static, doc_arrays, Tp, Sp)
    packed = (pack_rows(mod_arrays),) if mod_arrays else ()
    row_grads = bool(packed) and part == 0  # this launch forms the arrays' gradients
    width = packed_entries(n_entries)  # of the gradient tile: a packed row's
    # where the arrays only add terms to the scores before the rest of the mod (a soft-cap) acts, their gradients
    # take dS through the mod's derivative and the adding part alone: no jvp through the rest per entry (through a
    # soft-cap that spilled 2.4 KB at head dim 128)
    added = added_part(static.score_mod) if packed else None
    n_ready = 4 + bool(n_ids) + bool(packed)  # a consumer's own copies: q, dO, lse, delta (its q ids, its mod row)
    modes = Modes(plgpu, interpret)
    # Registers per thread of a consumer / the producer warpgroup: the forward's 240 / 24. sm_90 ptxas, dQ: head dim 64
    # with document and position slots spilled 20 bytes at 232 / 40, 4 at 240 / 24; with a soft-cap 308 and 272 (0
    # since its derivative is rebuilt from p).
    consumer_regs, producer_regs = (240, 24)
    programs = Programs(tiles.ctas, H, Tp // (n_wg * rows), B, ("heads", "rows", "batch"))

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
        rows_ref,
        scoped,
    ):
        smem, ready, (k_ready, v_ready), (k_free, v_free), kvid_ready = scoped
        q_smem2, do_smem2, lse_smem2, delta_smem2, k_smem, v_smem, t_smem2, a_smem2, qid_smem2, kvid_smem = smem[:10]
        mod_smem2, out_smem2 = smem[10:]
        wg = lax.axis_index("wg")

        def program(i):
            """(b, h, ids' batch row, first row, block list) of this CTA's i-th program."""
            h, prog, b = programs.at(i)
            bm = b if static.mask_batched else 0
            row, first_row = program_line(order_ref, bm, prog, n_wg * rows, static.block_q)  # heaviest rows first
            blocks = BlockList(idx_ref, np_ref, cnt_ref, bm, row, static.block_kv, tkv)
            return b, h, b if ids_batched else 0, first_row, blocks

        @pl.when(wg < n_wg)
        def _consumer():
            if n_wg == 2:  # one consumer and the producer have 255 registers a thread each without reallocation
                plgpu.set_max_registers(consumer_regs, action="increase")

            def consume(i, g0):
                b, h, bd, first_row, blocks = program(i)
                n_tiles, n_partial, tile_start = blocks.count, blocks.partial, blocks.start
                q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
                base = first_row + wg * rows
                own_rows = pl.ds(base, rows)
                pairs = ((q_ref, q_smem), (do_ref, do_smem))
                copies = [(head_rows(x, layout, b, h, own_rows), own) for x, own in pairs]
                vectors = ((lse_ref, lse_smem2), (delta_ref, delta_smem2))
                copies += [(x.at[b, h, own_rows], own.at[wg]) for x, own in vectors]
                if n_ids:
                    copies.append((qid_ref.at[bd, slice(None), pl.ds(base, rows)], qid_smem2.at[wg]))
                if packed:
                    copies.append((mod_ref.at[h], mod_smem2.at[wg]))
                _load_resident(plgpu, copies, ready, n_ready, wg)
                lse2 = lax.broadcast_in_dim(modes.vector(lse_smem2.at[wg], 0), (rows, tkv), [0])  # log2 units
                delta = lax.broadcast_in_dim(modes.vector(delta_smem2.at[wg], 0), (rows, tkv), [0])
                # [rows] per slot, read once; broadcast over a tile's columns where a PARTIAL tile needs them
                q_ids = [modes.vector(qid_smem2.at[wg, i], 0) for i in range(n_ids)]

                def entries():
                    return packed_rows(static.score_mod, mod_smem2.at[wg]) if packed else ()

                def step(j, carry, masked):
                    dq, d_rows = carry
                    slot = lax.rem(g0 + j, stages)  # the ring runs on from the CTA's earlier programs
                    plgpu.barrier_wait(k_ready.at[slot])
                    plgpu.barrier_wait(v_ready.at[slot])
                    k_t = modes.transposed(k_smem.at[slot], t_smem2, wg)
                    # the tile start read again below where the mask and mod need it: held from here, it spilled 88
                    # bytes beside a T5 table and learned slopes at head dim 128 (sm_90 ptxas; 8 read twice)
                    z = fresh_zero(tile_start(j))
                    s = modes.product(q_smem2.at[wg + z], k_t, (rows, tkv))
                    if masked or static.score_mod is not None:
                        kv_first = tile_start(j)

                        q_pos, kv_pos = modes.positions((rows, tkv), base, kv_first)

                        ids = functools.partial(modes.id_tiles, q_ids, kvid_smem, kvid_ready, slot, s.shape, True)
                        bounds = tile_bounds(base, rows, kv_first, tkv)
                        scaled = s * static.scale
                        s, d_mod = _scores(static, s, q_pos, kv_pos, h, masked, ids, entries, bounds)
                        p = jnp.exp2(s * _LOG2E - lse2)
                    else:
                        s, d_mod = s, None
                        p = jnp.exp2(s * (static.scale * _LOG2E) - lse2)
                    v_t = modes.transposed(v_smem.at[slot], t_smem2, wg)
                    dp = modes.product(do_smem2.at[wg + z], v_t, (rows, tkv))
                    plgpu.barrier_arrive(v_free.at[slot])
                    ds = p * (dp - delta)  # d loss / d (modded scores)
                    if static.score_mod is not None:
                        d_mod = _rebuilt_derivative(static, p, lse2, d_mod)
                    if row_grads and added is None:
                        args = (static.score_mod, entries, scaled, q_pos, kv_pos, h, ds, d_rows, add_entry, bounds)
                        d_rows = add_row_grads_per_row(*args)
                    if d_mod is not None:
                        ds = ds * d_mod  # d loss / d (scaled scores): of the terms the arrays add to them too
                    if row_grads and added is not None:
                        args = (added, entries, scaled, q_pos, kv_pos, h, ds, d_rows, add_entry, bounds)
                        d_rows = add_row_grads_per_row(*args)
                    ds = modes.operand(ds.astype(dtype), a_smem2, wg)
                    k_cols = _part_columns(k_smem.at[slot], part, E_out)
                    dq = _accumulate(plgpu, dq, ds, k_cols, lambda: None, interpret)
                    plgpu.barrier_arrive(k_free.at[slot])
                    return dq, d_rows

                def add_entry(d_rows, i, vector):  # entry i's column: a [rows, width] tile holds 4x fewer registers
                    # than a [rows] vector per entry (each of those is held by the 4 threads of its rows)
                    column = modes.iota(d_rows.shape, 1) == i
                    return d_rows + jnp.where(column, lax.broadcast_in_dim(vector, d_rows.shape, [0]), 0.0)

                carry = (modes.zeros((rows, E_out)), modes.zeros((rows, width)) if row_grads else ())
                # Padding needs no mask here unless captured arrays take gradients: a padded key's K row is zeros, so
                # its dS adds nothing to dQ (but would to the arrays'), and a padded query's row is cut off.
                dq, d_rows = over_tiles(static, step, n_partial, n_tiles, carry, padding_matters=row_grads)
                out_own = q_smem if E_out == E else out_smem2.at[wg]  # Q is read no more; a part's has its own tile
                out_own[...] = (dq * static.scale).astype(dtype)
                if row_grads:  # straight from registers: a shared-memory stage for its TMA store took 16 KB, which at
                    # head dim 256 left a table chained with slopes 2.2 KB over the H100's 227 KB
                    rows_ref.at[b, h, pl.ds(base, rows)][...] = d_rows
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_own, head_rows(dq_ref, layout, b, h, pl.ds(base, rows)))
                plgpu.wait_smem_to_gmem(0)
                return g0 + n_tiles

            programs.over(consume)

        @pl.when(wg == n_wg)
        def _producer():
            if n_wg == 2:
                plgpu.set_max_registers(producer_regs, action="decrease")
            kv = ((k_ref, k_smem, k_ready), (v_ref, v_smem, v_ready))

            def produce(i, g):
                b, h, bd, _, blocks = program(i)
                ids = (kvid_ref.at[bd], kvid_smem, kvid_ready) if n_ids else None
                free = (k_free, v_free)
                stream_kv(plgpu, blocks, stages, b, lax.div(h, G), kv, free, ids, layout, programs.offset(g))
                return g + blocks.count

            steps = programs.over(produce)
            if programs.ctas:
                drain(plgpu, steps, stages, (k_free, v_free))

    def attention_dq(*refs):
        n_out = 1 + row_grads
        ins, outs = refs[:-n_out], refs[-n_out:]
        ins, mod = (ins[:-1], ins[-1:]) if packed else (ins, (None,))
        refs = (*ins, *((None, None) if not n_ids else ()), *mod, *outs, *((None,) if not row_grads else ()))
        swizzled = _layout(plgpu)
        scratch = (
            plgpu.SMEM((n_wg, rows, E), dtype, transforms=swizzled),
            plgpu.SMEM((n_wg, rows, E), dtype, transforms=swizzled),
            plgpu.SMEM((n_wg, rows), jnp.float32),
            plgpu.SMEM((n_wg, rows), jnp.float32),
            plgpu.SMEM((stages, tkv, E), dtype, transforms=swizzled),
            plgpu.SMEM((stages, tkv, E), dtype, transforms=swizzled),
            plgpu.SMEM((n_wg, E, tkv), dtype) if interpret else None,
            plgpu.SMEM((n_wg, rows, tkv), dtype) if interpret else None,
            plgpu.SMEM((n_wg, n_ids, rows), jnp.int32) if n_ids else None,
            plgpu.SMEM((stages, n_ids, tkv), jnp.int32) if n_ids else None,
            plgpu.SMEM((n_wg, packed_width(mod_arrays)), jnp.float32) if packed else None,
            plgpu.SMEM((n_wg, rows, E_out), dtype, transforms=swizzled) if E_out < E else None,
        )
        pl.run_scoped(
            lambda *scoped: kernel(*refs, scoped),
            scratch,
            plgpu.Barrier(num_barriers=n_wg * n_ready),
            (plgpu.Barrier(num_barriers=stages),) * 2,
            (plgpu.Barrier(num_arrivals=n_wg, num_barriers=stages),) * 2,
            plgpu.Barrier(num_barriers=stages) if n_ids else None,
            collective_axes="wg",
        )

    out_type = like((*q.shape[:3], E_out), dtype, q)
    if row_grads:
        out_type = (out_type, like((B, H, Tp, width), jnp.float32, q))
    out = plgpu.kernel(
        attention_dq,
        out_type=out_type,
        **programs.grid,
        num_threads=n_wg + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **interpret_params(interpret),
    )(q, k, v, d_out, lse[..., 0], delta[..., 0], kv_idx, kv_np, kv_cnt, kv_order, *id_arrays, *packed)
    return (vary_like(out[0], q), vary_like(out[1], q)) if row_grads else (vary_like(out, q), None)
