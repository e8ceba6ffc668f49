"""Block-sparse flash attention as Pallas kernels: forward, dQ and dK/dV, tied together with ``jax.custom_vjp``.

These kernels serve Triton on GPU and the Pallas interpreter on CPU (what most tests run); on TPU
``block_sparse_attention`` hands over to ``tpu_attention``, whose grid walks the block lists so that only the current
blocks sit in VMEM (the view below does not fit it at long sequences).

Each program owns one tile of its output and loops only over the non-empty tiles of its row (forward,
dQ) or column (dK/dV) of the block mask: first the PARTIAL tiles, with the element mask, then the FULL ones, with
none. K and V (or Q and dO for dK/dV) stay whole per head in the kernel's view and tiles are sliced out of them at
the block offsets the mask lists, the way the JAX GPU flash-attention kernel walks its keys.

Sequences that are not whole blocks are padded here; padded keys are masked out, padded queries are dropped.
Grouped-query attention: query head h reads kv head h // G; the dK/dV program of a kv head loops over its G query
heads, so nothing is repeated in memory.

Shape suffixes follow the legend in docs/architecture.md; Tp and Sp are T and S padded to whole blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .block_mask import BlockMask
from .gpu_tiles import (
    KernelTiles,
    PassTiles,
    check_fused_tiles,
    check_tiles,
    given_mosaic_tiles,
    kernel_tiles,
    mosaic_lowerings,
)
from .kernel_inputs import (
    AttentionStatic,
    bhte_shape,
    check_attention_inputs,
    from_bhte,
    like,
    line_orders,
    list_arrays,
    pad_axis,
    resolve_backend,
    segment_arrays,
    seq_axis,
    to_bhte,
)
from .kernel_mask import split_documents
from .masks import ScoreMod
from .mosaic_attention import _LOG2E, MosaicTiles, mosaic_forward
from .mosaic_attention_bwd import mosaic_dq
from .mosaic_attention_dkv import mosaic_dkv, mosaic_fused_backward
from .mosaic_backward_tiles import BackwardTiles
from .score_tables import load_rows, row_grads, rows_as_vector, split_arrays, vector_as_grads
from .tile_math import dot, iota, masked_scores, tile_bounds
from .tpu_attention import block_sparse_attention_tpu


@dataclasses.dataclass(frozen=True)
class _Static(AttentionStatic):
    """Everything a kernel is specialised on (hashable: the custom_vjp's non-differentiable argument)."""

    groups: int  # query heads per kv head
    mask_batched: bool  # block-mask arrays have a batch dim of B (else 1)
    docs_batched: tuple[bool, ...]  # per document slot
    backend: str
    tiles: KernelTiles
    mosaic: MosaicTiles | None = None  # the forward's Mosaic GPU tiles when it runs on Mosaic GPU, else Triton's
    mosaic_bwd: BackwardTiles | None = None  # likewise for the dQ and dK/dV kernels
    layout: str = "BHTE"  # of q, k, v, out and their gradients (``kernel_inputs.LAYOUTS``)


def block_sparse_attention(
    q,
    k,
    v,
    block_mask: BlockMask,
    *,
    scale: float | None = None,
    score_mod: ScoreMod | None = None,
    interpret: bool | None = None,
    backend: str | None = None,
    tiles: KernelTiles | MosaicTiles | BackwardTiles | tuple | None = None,
    lowering: str | None = None,
    deterministic: bool = True,
    layout: str = "BHTE",
):
    """Attention over the non-empty tiles of ``block_mask``, as Pallas kernels; differentiable.

    q [B, H, T, E], k/v [B, K, S, E] with K dividing H, float32 or bfloat16 (accumulation is float32);
    ``block_mask = make_block_mask(mask, T, S, block_sizes)``. Returns (out [B, H, T, E] in q.dtype,
    lse [B, H, T] float32), equal to ``reference_attention(q, k, v, block_mask.mask, ...)``.

    Works under ``jax.shard_map`` on local shards; in interpret mode the shard_map needs ``check_vma=False`` (the
    Pallas interpreter's slices do not track varying mesh axes in jax 0.10). ``interpret`` defaults to True on
    CPU. ``backend`` ("gpu", "tpu") picks the lowering; it defaults to the default JAX backend, and setting it lets
    a CPU machine lower (export) the kernels for an accelerator. ``tiles`` overrides ``kernel_tiles`` (each tile
    must divide its block). On TPU the kernels are ``tpu_attention``'s, which choose their own tiles. A
    ``MosaicTiles`` and / or ``BackwardTiles`` (one, or a tuple of both) instead override the Mosaic kernels' tiles
    and imply ``lowering="mosaic"`` (``forward_candidates`` / ``backward_candidates`` list them; the tile sweep).

    ``lowering`` picks the GPU forward: "mosaic" (``mosaic_attention``, Hopper and newer; in interpret mode the
    Mosaic GPU interpreter), "triton", or None: Mosaic on sm_90+ where it supports the case, else Triton (also
    when ``tiles``, the Triton kernels', are given). The backward follows (``mosaic_attention_bwd``) where its
    kernels take the case, else it is the Triton dQ and dK/dV kernels. Not ``deterministic``: the Mosaic backward
    sums dQ across programs in whatever order they run (``mosaic_fused_backward``: two fifths fewer products, as
    cuDNN's backward by default), where it can take the case (head dims 64 and 128, no captured arrays); otherwise,
    and in the other kernels, gradients are the same bit for bit from run to run.

    ``layout`` "BTHE": q [B, T, H, E], k/v [B, S, K, E] and out [B, T, H, E] (lse stays [B, H, T]), the model's
    layout: the Mosaic GPU kernels read and write it as it is (TMA copies a head's rows strided), the others take
    a transpose each way.
    """
    check_attention_inputs("block_sparse_attention", q, k, v, block_mask, layout)
    backend = resolve_backend("block_sparse_attention", interpret, backend)
    if backend == "tpu":
        if tiles is not None:
            raise ValueError("block_sparse_attention: tiles are the GPU kernels'; the TPU kernels choose their own")
        q, k, v = (to_bhte(x, layout) for x in (q, k, v))
        out, lse = block_sparse_attention_tpu(q, k, v, block_mask, scale=scale, score_mod=score_mod)
        return from_bhte(out, layout), lse
    B, H, T, E = bhte_shape(q.shape, layout)
    K = bhte_shape(k.shape, layout)[1]
    template, docs = split_documents(block_mask.mask)
    score_mod, mod_arrays = split_arrays("block_sparse_attention", score_mod, H)

    bs = block_mask.block_sizes
    mosaic_given = given_mosaic_tiles(tiles, lowering, bs)
    if mosaic_given:
        tiles, lowering = None, "mosaic"
    explicit_tiles = tiles is not None
    tiles = kernel_tiles(backend, E, q.dtype, bs) if tiles is None else tiles
    check_tiles(tiles, bs)
    Tp, Sp = block_mask.padded_q_len, block_mask.padded_kv_len
    segments = segment_arrays("block_sparse_attention", docs, block_mask, B)
    doc_arrays = [a for q_ids, kv_ids in segments for a in (q_ids[:, :, None], kv_ids[:, None, :])]
    mask_arrays = list_arrays(block_mask) + line_orders(block_mask)  # the orders: the Mosaic GPU kernels'
    static = _Static(
        **AttentionStatic.shared(template, score_mod, scale, block_mask, E),
        groups=H // K,
        mask_batched=mask_arrays[0].shape[0] == B and B > 1,
        docs_batched=tuple(q_ids.shape[0] == B and B > 1 for q_ids, _ in segments),
        backend=backend,
        tiles=tiles,
        layout=layout,
    )
    chosen = mosaic_lowerings(static, lowering, q.dtype, E, explicit_tiles, deterministic)
    if "mosaic_bwd" in mosaic_given and chosen["mosaic_bwd"] is None:
        raise ValueError(
            f"block_sparse_attention: the Mosaic GPU backward cannot take head dim {E}; give no BackwardTiles"
        )
    if "mosaic_bwd" in mosaic_given and mosaic_given["mosaic_bwd"].fused_dq:
        check_fused_tiles(mosaic_given["mosaic_bwd"], deterministic, E, bool(mod_arrays))
    static = dataclasses.replace(static, **(chosen | mosaic_given))
    seq = seq_axis(layout)
    qp, kp, vp = pad_axis(q, seq, Tp), pad_axis(k, seq, Sp), pad_axis(v, seq, Sp)
    out, lse = _attention(static, qp, kp, vp, mask_arrays, tuple(doc_arrays), mod_arrays)
    return lax.slice_in_dim(out, 0, T, axis=seq), lse[:, :, :T, 0]


# ----------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q, k, v, mask_arrays, doc_arrays, mod_arrays):
    return _forward(static, q, k, v, mask_arrays, doc_arrays, mod_arrays)


def _attention_fwd(static, q, k, v, mask_arrays, doc_arrays, mod_arrays):
    out, lse = _forward(static, q, k, v, mask_arrays, doc_arrays, mod_arrays)
    return (out, lse), (q, k, v, out, lse, mask_arrays, doc_arrays, mod_arrays)


def _attention_bwd(static, residuals, cotangents):
    q, k, v, out, lse, mask_arrays, doc_arrays, mod_arrays = residuals
    d_out, d_lse = cotangents
    # d lse / d s = p, so a cotangent on lse enters every ds = p * (dp - delta) as -d_lse in delta.
    row_sums = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    delta = to_bhte(row_sums, static.layout) - d_lse
    interpret = static.backend == "interpret"
    # a mod's captured arrays: their gradients are sums per entry over every score, formed by the dQ kernels (the
    # Triton one per program, the Mosaic one per query row); dK/dV only reads them
    if static.mosaic_bwd is not None:
        # the Mosaic kernels take lse in log2 units, made once here rather than a multiply per score in dK/dV
        args = (static, static.mosaic_bwd, q, k, v, d_out, lse * _LOG2E, delta, mask_arrays, doc_arrays)
        if static.mosaic_bwd.fused_dq:
            return (*mosaic_fused_backward(*args, interpret=interpret), None, None, ())
        dq = mosaic_dq(*args, mod_arrays, interpret=interpret)
        dk, dv = mosaic_dkv(*args, mod_arrays, interpret=interpret)
        if not mod_arrays:
            return dq, dk, dv, None, None, ()
        dq, d_rows = dq
        return dq, dk, dv, None, None, vector_as_grads(d_rows, mod_arrays)
    q, k, v, d_out = (to_bhte(x, static.layout) for x in (q, k, v, d_out))  # the Triton kernels' layout
    dq, d_rows = _backward_dq(static, q, k, v, d_out, lse, delta, mask_arrays, doc_arrays, mod_arrays)
    dk, dv = _backward_dkv(static, q, k, v, d_out, lse, delta, mask_arrays, doc_arrays, mod_arrays)
    d_mod_arrays = vector_as_grads(d_rows, mod_arrays) if mod_arrays else ()
    dq, dk, dv = (from_bhte(x, static.layout) for x in (dq, dk, dv))
    return dq, dk, dv, None, None, d_mod_arrays


_attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------- shared tile math


def _scores(static, q, k, q_pos, kv_pos, head, masked, doc_tiles, with_grad=False, rows=(), tile=None):
    """Scaled scores of q against k, one tile [bq, bkv] (float32), score-modded (reading ``rows``, the head's
    rows of the mod's arrays; ``tile``: its bounds, for the mod's shortcut) and masked (tile_math)."""
    s = dot(q, k, 1, 1) * static.scale
    return masked_scores(static, s, q_pos, kv_pos, head, masked, doc_tiles, with_grad, rows, tile)


def _split_refs(static, refs, n_out: int):
    """(document refs, mod array refs, output refs) of a kernel's trailing refs."""
    n_mod = static.n_mod_arrays
    doc_and_mod, outs = refs[: len(refs) - n_out], refs[len(refs) - n_out :]
    return doc_and_mod[: len(doc_and_mod) - n_mod], doc_and_mod[len(doc_and_mod) - n_mod :], outs


def _rows_width(mod_arrays) -> int:
    """Lanes of a program's row-gradient vector: every entry of the rows, rounded up to a power of two (Triton)."""
    return max(16, 1 << (sum(a.shape[1] for a in mod_arrays) - 1).bit_length())


def _two_loops(body, n_partial, n_total, carry):
    """Run body(j, carry, masked) over the PARTIAL entries (masked) then the FULL ones."""
    carry = lax.fori_loop(0, n_partial, functools.partial(body, masked=True), carry)
    return lax.fori_loop(n_partial, n_total, functools.partial(body, masked=False), carry)


def _tiles_of_block(tile_body, block_start, block, tile, carry):
    """Run tile_body(start, carry) over the tiles of one block (one call when the tile is the block)."""
    if tile == block:
        return tile_body(pl.multiple_of(block_start, tile), carry)
    return lax.fori_loop(
        0, block // tile, lambda u, c: tile_body(pl.multiple_of(block_start + u * tile, tile), c), carry
    )


# ----------------------------------------------------------------------------- forward


def _forward_kernel(static, q_ref, k_ref, v_ref, kv_idx_ref, kv_np_ref, kv_cnt_ref, *refs):
    doc_refs, mod_refs, (o_ref, lse_ref) = _split_refs(static, refs, 2)
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = load_rows(static.score_mod, mod_refs, h) if mod_refs else ()
    bm = b if static.mask_batched else 0
    tq, tkv = static.tiles.forward.rows, static.tiles.forward.loop
    row = i * tq // static.block_q  # the block-mask row this program's tile lies in
    q = q_ref[...]
    q_pos = i * tq + iota(tq, 0)
    q_segs = [r[...] for r in doc_refs[0::2]]

    def body(j, carry, masked):
        def tile(start, carry):
            m_prev, l_prev, acc_prev = carry
            k = k_ref[pl.ds(start, tkv), :]
            v = v_ref[pl.ds(start, tkv), :]
            tiles = [(qs, r[:, pl.ds(start, tkv)]) for qs, r in zip(q_segs, doc_refs[1::2])]
            bounds = tile_bounds(i * tq, tq, start, tkv)
            s, _ = _scores(static, q, k, q_pos, start + iota(tkv, 1), h, masked, tiles, rows=rows, tile=bounds)
            m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet in this row
            alpha = jnp.exp(m_prev - m_safe)
            p = jnp.exp(s - m_safe)
            l_new = alpha * l_prev + p.sum(axis=-1, keepdims=True)
            acc_new = alpha * acc_prev + dot(p.astype(v.dtype), v, 1, 0)
            return m_new, l_new, acc_new

        return _tiles_of_block(tile, kv_idx_ref[bm, row, j] * static.block_kv, static.block_kv, tkv, carry)

    init = (
        jnp.full((tq, 1), -jnp.inf, jnp.float32),
        jnp.zeros((tq, 1), jnp.float32),
        jnp.zeros((tq, q.shape[-1]), jnp.float32),
    )
    m, l, acc = _two_loops(body, kv_np_ref[bm, row], kv_cnt_ref[bm, row], init)
    seen = l > 0  # False only on padding rows (and, for traced masks, on rows that see nothing)
    o_ref[...] = (acc / jnp.where(seen, l, 1.0)).astype(o_ref.dtype)
    # +inf makes the backward's p = exp(s - lse) zero on such rows
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)


def _forward(static, q, k, v, mask_arrays, doc_arrays, mod_arrays=()):
    if static.mosaic is not None:
        interpret = static.backend == "interpret"
        return mosaic_forward(static, static.mosaic, q, k, v, mask_arrays, doc_arrays, mod_arrays, interpret=interpret)
    q, k, v = (to_bhte(x, static.layout) for x in (q, k, v))  # the Triton kernels' layout
    B, H, Tp, E = q.shape
    Sp = k.shape[2]
    G, tq = static.groups, static.tiles.forward.rows
    q_spec = pl.BlockSpec((None, None, tq, E), lambda b, h, i: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, Sp, E), lambda b, h, i: (b, h // G, 0, 0))
    doc_specs = _row_doc_specs(static, tq, Sp)
    out, lse = pl.pallas_call(
        functools.partial(_forward_kernel, static),
        grid=(B, H, Tp // tq),
        in_specs=[q_spec, kv_spec, kv_spec, *[_index_spec(static)] * 3, *doc_specs, *_mod_specs(mod_arrays)],
        out_specs=[q_spec, pl.BlockSpec((None, None, tq, 1), lambda b, h, i: (b, h, i, 0))],
        out_shape=[like(q.shape, q.dtype, q), like((B, H, Tp, 1), jnp.float32, q)],
        interpret=static.backend == "interpret",
        compiler_params=_compiler_params(static, static.tiles.forward),
        name="block_sparse_attention_fwd",
    )(q, k, v, *mask_arrays[:3], *doc_arrays, *mod_arrays)
    return from_bhte(out, static.layout), lse


# ----------------------------------------------------------------------------- backward: dQ


def _dq_kernel(static, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, kv_idx_ref, kv_np_ref, kv_cnt_ref, *refs):
    """dQ of one q tile; with a score mod that captures arrays also the gradient to this head's rows of them, over
    this tile's scores (one vector per program, summed outside)."""
    doc_refs, mod_refs, out_refs = _split_refs(static, refs, 2 if static.n_mod_arrays else 1)
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = load_rows(static.score_mod, mod_refs, h) if mod_refs else ()
    bm = b if static.mask_batched else 0
    tq, tkv = static.tiles.dq.rows, static.tiles.dq.loop
    row = i * tq // static.block_q
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_pos = i * tq + iota(tq, 0)
    q_segs = [r[...] for r in doc_refs[0::2]]

    def body(j, carry, masked):
        def tile(start, carry):
            dq, d_rows = carry
            k = k_ref[pl.ds(start, tkv), :]
            v = v_ref[pl.ds(start, tkv), :]
            kv_pos = start + iota(tkv, 1)
            tiles = [(qs, r[:, pl.ds(start, tkv)]) for qs, r in zip(q_segs, doc_refs[1::2])]
            bounds = tile_bounds(i * tq, tq, start, tkv)
            s, d_mod = _scores(static, q, k, q_pos, kv_pos, h, masked, tiles, True, rows, bounds)
            p = jnp.exp(s - lse)
            ds = p * (dot(do, v, 1, 1) - delta)  # d loss / d (modded scores)
            if rows:
                s_raw = dot(q, k, 1, 1) * static.scale
                grads = row_grads(static.score_mod, rows, s_raw, q_pos, kv_pos, h, ds, bounds)
                d_rows = jax.tree.map(jnp.add, d_rows, grads)
            if d_mod is not None:
                ds = ds * d_mod
            return dq + dot(ds.astype(k.dtype), k, 1, 0), d_rows

        return _tiles_of_block(tile, kv_idx_ref[bm, row, j] * static.block_kv, static.block_kv, tkv, carry)

    init = (jnp.zeros(q.shape, jnp.float32), jax.tree.map(jnp.zeros_like, rows))
    dq, d_rows = _two_loops(body, kv_np_ref[bm, row], kv_cnt_ref[bm, row], init)
    out_refs[0][...] = (dq * static.scale).astype(out_refs[0].dtype)
    if rows:
        out_refs[1][...] = rows_as_vector(d_rows, out_refs[1].shape[-1])


def _backward_dq(static, q, k, v, d_out, lse, delta, mask_arrays, doc_arrays, mod_arrays=()):
    """(dQ, per-program gradient vectors of the mod's rows [B, H, programs, width], or None without mod arrays)."""
    B, H, Tp, E = q.shape
    Sp = k.shape[2]
    G, tq = static.groups, static.tiles.dq.rows
    q_spec = pl.BlockSpec((None, None, tq, E), lambda b, h, i: (b, h, i, 0))
    row_spec = pl.BlockSpec((None, None, tq, 1), lambda b, h, i: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, Sp, E), lambda b, h, i: (b, h // G, 0, 0))
    doc_specs = _row_doc_specs(static, tq, Sp)
    out_specs, out_shape = [q_spec], [like(q.shape, q.dtype, q)]
    if mod_arrays:
        width = _rows_width(mod_arrays)
        out_specs.append(pl.BlockSpec((None, None, None, width), lambda b, h, i: (b, h, i, 0)))
        out_shape.append(like((B, H, Tp // tq, width), jnp.float32, q))
    outs = pl.pallas_call(
        functools.partial(_dq_kernel, static),
        grid=(B, H, Tp // tq),
        in_specs=[
            *(q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec),
            *[_index_spec(static)] * 3,
            *doc_specs,
            *_mod_specs(mod_arrays),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=static.backend == "interpret",
        compiler_params=_compiler_params(static, static.tiles.dq),
        name="block_sparse_attention_dq",
    )(q, k, v, d_out, lse, delta, *mask_arrays[:3], *doc_arrays, *mod_arrays)
    return outs[0], (outs[1] if mod_arrays else None)


# ----------------------------------------------------------------------------- backward: dK, dV


def _dkv_kernel(static, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_idx_ref, q_np_ref, q_cnt_ref, *refs):
    doc_refs, mod_refs, (dk_ref, dv_ref) = _split_refs(static, refs, 2)
    b, hk, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bm = b if static.mask_batched else 0
    tkv, tq = static.tiles.dkv.rows, static.tiles.dkv.loop
    col = j * tkv // static.block_kv  # the block-mask column this program's tile lies in
    k, v = k_ref[...], v_ref[...]
    kv_pos = j * tkv + iota(tkv, 1)
    kv_segs = [r[...] for r in doc_refs[1::2]]

    def per_head(g, carry):
        head = hk * static.groups + g
        rows = load_rows(static.score_mod, mod_refs, head) if mod_refs else ()

        def body(t, carry, masked):
            def tile(start, carry):
                dk, dv = carry
                q = q_ref[g, pl.ds(start, tq), :]
                do = do_ref[g, pl.ds(start, tq), :]
                lse = lse_ref[g, pl.ds(start, tq), :]
                delta = delta_ref[g, pl.ds(start, tq), :]
                tiles = [(r[pl.ds(start, tq), :], ks) for r, ks in zip(doc_refs[0::2], kv_segs)]
                q_pos = start + iota(tq, 0)
                bounds = tile_bounds(start, tq, j * tkv, tkv)
                s, d_mod = _scores(static, q, k, q_pos, kv_pos, head, masked, tiles, True, rows, bounds)
                p = jnp.exp(s - lse)
                # p stays float32 here: dV sums p over every query of the column and has the tightest error budget
                dv = dv + dot(p, do.astype(jnp.float32), 0, 0)
                ds = p * (dot(do, v, 1, 1) - delta)
                if d_mod is not None:
                    ds = ds * d_mod
                return dk + dot(ds.astype(q.dtype), q, 0, 0), dv

            return _tiles_of_block(tile, q_idx_ref[bm, col, t] * static.block_q, static.block_q, tq, carry)

        return _two_loops(body, q_np_ref[bm, col], q_cnt_ref[bm, col], carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, static.groups, per_head, (zeros, zeros))
    dk_ref[...] = (dk * static.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward_dkv(static, q, k, v, d_out, lse, delta, mask_arrays, doc_arrays, mod_arrays=()):
    B, H, Tp, E = q.shape
    K, Sp = k.shape[1], k.shape[2]
    G, tkv = static.groups, static.tiles.dkv.rows

    def grouped(x):  # [B, H, Tp, E or 1] -> [B, K, G, Tp, E or 1]: a kv head's query heads side by side, no copy
        return x.reshape(B, K, G, Tp, x.shape[-1])

    kv_spec = pl.BlockSpec((None, None, tkv, E), lambda b, h, j: (b, h, j, 0))
    group_spec = pl.BlockSpec((None, None, G, Tp, E), lambda b, h, j: (b, h, 0, 0, 0))
    row_spec = pl.BlockSpec((None, None, G, Tp, 1), lambda b, h, j: (b, h, 0, 0, 0))
    doc_specs = []
    for batched in static.docs_batched:
        doc_specs += [
            pl.BlockSpec((None, Tp, 1), lambda b, h, j, bb=batched: (b if bb else 0, 0, 0)),
            pl.BlockSpec((None, 1, tkv), lambda b, h, j, bb=batched: (b if bb else 0, 0, j)),
        ]
    return pl.pallas_call(
        functools.partial(_dkv_kernel, static),
        grid=(B, K, Sp // tkv),
        in_specs=[
            *(group_spec, kv_spec, kv_spec, group_spec, row_spec, row_spec),
            *[_index_spec(static)] * 3,
            *doc_specs,
            *_mod_specs(mod_arrays),
        ],
        out_specs=[kv_spec, kv_spec],
        out_shape=[like(k.shape, k.dtype, k), like(v.shape, v.dtype, v)],
        interpret=static.backend == "interpret",
        compiler_params=_compiler_params(static, static.tiles.dkv),
        name="block_sparse_attention_dkv",
    )(grouped(q), k, v, grouped(d_out), grouped(lse), grouped(delta), *mask_arrays[3:6], *doc_arrays, *mod_arrays)


# ----------------------------------------------------------------------------- backends


def _row_doc_specs(static, tq, Sp):
    """Segment-id specs of programs that own a q tile: that tile's q ids, every kv id of the batch row."""
    specs = []
    for batched in static.docs_batched:
        specs += [
            pl.BlockSpec((None, tq, 1), lambda b, h, i, bb=batched: (b if bb else 0, i, 0)),
            pl.BlockSpec((None, 1, Sp), lambda b, h, i, bb=batched: (b if bb else 0, 0, 0)),
        ]
    return specs


def _index_spec(static):
    """Block lists and counts: whole arrays, read as scalars."""
    return pl.BlockSpec()


def _mod_specs(mod_arrays):
    """A score mod's arrays [H, n]: whole, read as scalars (a program reads its head's row)."""
    return [pl.BlockSpec()] * len(mod_arrays)


def _compiler_params(static, tiles: PassTiles):
    if static.backend == "gpu":
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=tiles.warps, num_stages=tiles.stages)
    return None
