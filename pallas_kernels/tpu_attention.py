"""Block-sparse flash attention for TPUs: forward, dQ and dK/dV as Mosaic kernels that hold only the current blocks.

The GPU kernels (``pallas_attention``) keep a head's whole K and V (or, for dK/dV, the group's whole Q and dO) in
the kernel's view and slice tiles out of it. Triton reads those slices from HBM; Mosaic copies the whole view into
VMEM, which on a v5p overflowed at T = 8192 (dK/dV: 96 of 64 MiB) and on every generation at T = 32768. Here the
grid walks the block lists instead, as JAX's splash attention does: each program of the last grid axis is one entry
of its row's list, the lists are scalar-prefetched into SMEM, and the index maps read them, so the pipeline DMAs
exactly the next non-empty block into VMEM and nothing else. Entries past a row's count repeat its last block (the
lists are padded that way), which Pallas does not fetch again, and their body is skipped. Running statistics live in
VMEM scratch across the row's programs.

Log-sum-exp and delta are stored lane-dense, [B, H, 1, Tp]: a [T, 1] column pads to 128 lanes (32 MiB per head
group at T = 8192). The backward kernels therefore compute in the transposed orientation, scores as [kv, q] tiles,
so the row of lse / delta broadcasts along lanes without a transpose.

Tiles: the TPU's own (``tpu_tiles``: 512 by default, larger when the lists would not fit SMEM), at least the block
mask's blocks; the mask is read at that granularity through ``block_mask.coarsen``.

A score mod's captured arrays (``score_tables``: a bias table, learned slopes, [H, n] each) sit whole in SMEM; a
program reads its head's row as scalars. dQ also sums the gradient to those rows over its scores, a vector per
program kept in VMEM across its kv entries and summed outside.

Shape suffixes follow the legend in docs/architecture.md; Tp and Sp are T and S padded to whole tiles.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .block_mask import BlockMask, coarsen
from .kernel_inputs import AttentionStatic, check_attention_inputs, like, list_arrays, pad_axis, segment_arrays
from .kernel_mask import split_documents
from .masks import ScoreMod
from .score_tables import load_rows, row_grads, rows_as_vector, split_arrays, vector_as_grads
from .tile_math import dot, iota, masked_scores, tile_bounds

LANES = 128  # a TPU vector register's lanes: tiles are multiples of it so ids and lse rows load lane-dense
DEFAULT_TILE = 512  # q and kv tile side: what splash attention's tuned configs use at head dims 64-256
SMEM_LIST_BYTES = 512 * 1024  # of a v5p's 1 MiB SMEM: the block lists a kernel prefetches must fit here
# The largest tile: 1024-square tiles compile for v5e and v5p at head dims 64-256 in bf16 and 64-128 in f32 (fwd +
# bwd, 2026-11-25), not at f32 x 256 (scoped VMEM; v6e takes it), which stays at 512 (MAX_ROW_BYTES); 2048 at f32 x
# 256 overflows v5p too.
MAX_TILE = 1024
MAX_ROW_BYTES = 512  # head dim x itemsize above which the tile stays DEFAULT_TILE


@dataclasses.dataclass(frozen=True)
class _Static(AttentionStatic):
    """Everything a kernel is specialised on (hashable: the custom_vjp's non-differentiable argument)."""

    groups: int  # query heads per kv head
    mask_batched: bool  # list arrays have a batch dim of B (else 1)
    docs_batched: tuple[bool, ...]  # per document slot
    kv_width: int  # entries per q row of the kv lists (the forward's and dQ's last grid axis)
    q_width: int  # entries per kv column of the q lists (dK/dV's, times the group)
    interpret: bool


def tpu_tiles(
    block_sizes, q_len: int, kv_len: int, batch: int = 1, tile: int = DEFAULT_TILE, row_bytes: int = 256
) -> tuple[int, int]:
    """(q tile, kv tile): ``tile`` rounded to a multiple of the block and of LANES, no longer than the padded
    sequence needs, doubled while the worst-case block lists ([batch, rows, columns] int32) exceed SMEM_LIST_BYTES
    (from T = 131072 at batch 1), up to MAX_TILE (DEFAULT_TILE when a q row, head dim x itemsize ``row_bytes``, is
    wider than MAX_ROW_BYTES); longer sequences are refused (context parallelism splits them)."""
    largest = MAX_TILE if row_bytes <= MAX_ROW_BYTES else DEFAULT_TILE

    def side(block, length, t):
        unit = math.lcm(block, LANES)
        return min(-(-t // unit) * unit, -(-length // unit) * unit)

    while True:
        tq, tkv = side(block_sizes.block_q, q_len, tile), side(block_sizes.block_kv, kv_len, tile)
        nq, nkv = -(-q_len // tq), -(-kv_len // tkv)
        if batch * nq * nkv * 4 <= SMEM_LIST_BYTES or (tq >= q_len and tkv >= kv_len):
            return tq, tkv
        if tile * 2 > largest:
            raise ValueError(
                f"block_sparse_attention_tpu: {batch} x {q_len} queries x {kv_len} keys need block lists larger than "
                f"a TPU's SMEM holds even in {tile}-tiles; split the sequence over devices (context parallelism) or "
                f"the batch"
            )
        tile *= 2


def block_sparse_attention_tpu(
    q,
    k,
    v,
    block_mask: BlockMask,
    *,
    scale: float | None = None,
    score_mod: ScoreMod | None = None,
    interpret: bool = False,
    tiles: tuple[int, int] | None = None,
):
    """Attention over the non-empty tiles of ``block_mask``, as Mosaic TPU kernels; differentiable.

    Same contract as ``pallas_kernels.block_sparse_attention`` (q [B, H, T, E], k/v [B, K, S, E]; returns out
    [B, H, T, E] and lse [B, H, T] float32). ``interpret`` runs the kernels in the Pallas interpreter (CPU tests);
    ``tiles`` overrides ``tpu_tiles`` (each a multiple of its block and of 128, or the whole padded sequence).
    """
    check_attention_inputs("block_sparse_attention_tpu", q, k, v, block_mask)
    B, H, T, E = q.shape
    score_mod, mod_arrays = split_arrays("block_sparse_attention_tpu", score_mod, H)
    _, K, S, _ = k.shape
    template, docs = split_documents(block_mask.mask)
    bs = block_mask.block_sizes
    batch = B if block_mask.batch_shape else 1
    row_bytes = E * jnp.dtype(q.dtype).itemsize
    tq, tkv = tpu_tiles(bs, T, S, batch, row_bytes=row_bytes) if tiles is None else tiles
    if tq % bs.block_q or tkv % bs.block_kv:
        raise ValueError(f"block_sparse_attention_tpu: tiles {tq}x{tkv} must be multiples of the blocks {bs}")
    coarse = coarsen(block_mask, tq // bs.block_q, tkv // bs.block_kv)
    Tp, Sp = coarse.padded_q_len, coarse.padded_kv_len
    for name, t, n in (("q", tq, Tp), ("kv", tkv, Sp)):
        if t % LANES and t != n:
            raise ValueError(f"block_sparse_attention_tpu: the {name} tile {t} must be a multiple of {LANES}")
    mask_arrays = list_arrays(coarse)
    segments = [(pad_axis(qi, 1, Tp), pad_axis(ki, 1, Sp)) for qi, ki in segment_arrays("tpu", docs, coarse, B)]
    static = _Static(
        **AttentionStatic.shared(template, score_mod, scale, coarse, E),
        groups=H // K,
        mask_batched=mask_arrays[0].shape[0] == B and B > 1,
        docs_batched=tuple(qi.shape[0] == B and B > 1 for qi, _ in segments),
        kv_width=mask_arrays[0].shape[-1],
        q_width=mask_arrays[3].shape[-1],
        interpret=interpret,
    )
    qp, kp, vp = pad_axis(q, 2, Tp), pad_axis(k, 2, Sp), pad_axis(v, 2, Sp)
    out, lse = _attention(static, qp, kp, vp, mask_arrays, tuple(segments), mod_arrays)
    return out[:, :, :T], lse[:, :, 0, :T]


# ----------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q, k, v, mask_arrays, segments, mod_arrays):
    return _forward(static, q, k, v, mask_arrays, segments, mod_arrays)


def _attention_fwd(static, q, k, v, mask_arrays, segments, mod_arrays):
    out, lse = _forward(static, q, k, v, mask_arrays, segments, mod_arrays)
    return (out, lse), (q, k, v, out, lse, mask_arrays, segments, mod_arrays)


def _attention_bwd(static, residuals, cotangents):
    q, k, v, out, lse, mask_arrays, segments, mod_arrays = residuals
    d_out, d_lse = cotangents
    # d lse / d s = p, so a cotangent on lse enters every ds = p * (dp - delta) as -d_lse in delta.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)[:, :, None, :] - d_lse
    dq, d_rows = _backward_dq(static, q, k, v, d_out, lse, delta, mask_arrays, segments, mod_arrays)
    dk, dv = _backward_dkv(static, q, k, v, d_out, lse, delta, mask_arrays, segments, mod_arrays)
    d_mod_arrays = vector_as_grads(d_rows, mod_arrays) if mod_arrays else ()
    return dq, dk, dv, None, None, d_mod_arrays


_attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------- shared tile math


def _entry(step, n_partial, n_total, j):
    """Run step(masked) for list entry j: with the element mask for the PARTIAL entries, without for the FULL ones,
    not at all past the row's count (those programs only hold the pipeline on the row's last block)."""
    pl.when(j < n_partial)(lambda: step(True))
    pl.when((j >= n_partial) & (j < n_total))(lambda: step(False))


def _params(static, *semantics):
    if static.interpret:
        return None
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _row(x_BT):
    """[B, T] ids -> [B, 1, T]: a row per tile, lane-dense."""
    return x_BT[:, None, :]


def _col(x_BT):
    """[B, T] ids -> [B, T, 1]: a column per tile."""
    return x_BT[:, :, None]


def _mod_specs(mod_arrays):
    """A score mod's captured arrays [H, n], whole in SMEM: a program reads its head's row as scalars."""
    return [pl.BlockSpec(memory_space=pltpu.SMEM)] * len(mod_arrays)


def _rows_width(mod_arrays) -> int:
    """Lanes of a dQ program's gradient vector for the mod's rows: every entry, in whole vector registers."""
    return -(-sum(a.shape[1] for a in mod_arrays) // LANES) * LANES


# ----------------------------------------------------------------------------- forward


def _forward_kernel(static, kv_idx_ref, kv_np_ref, kv_cnt_ref, q_ref, k_ref, v_ref, *refs):
    n_docs, n_mod = len(static.docs_batched), static.n_mod_arrays
    doc_refs, mod_refs = refs[: 2 * n_docs], refs[2 * n_docs : 2 * n_docs + n_mod]
    o_ref, lse_ref, m_ref, l_ref, acc_ref = refs[2 * n_docs + n_mod :]
    b, h, i, j = (pl.program_id(a) for a in range(4))
    bm = b if static.mask_batched else 0
    tq, tkv = q_ref.shape[0], k_ref.shape[0]

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def step(masked):
        q, k, v = q_ref[...], k_ref[...], v_ref[...]
        q_pos = i * tq + iota(tq, 0)
        kv_first = kv_idx_ref[bm, i, j] * tkv
        kv_pos = kv_first + iota(tkv, 1)
        doc_tiles = [(doc_refs[2 * d][...], doc_refs[2 * d + 1][...]) for d in range(n_docs)]
        rows = load_rows(static.score_mod, mod_refs, h) if mod_refs else ()
        bounds = tile_bounds(i * tq, tq, kv_first, tkv)
        s = dot(q, k, 1, 1) * static.scale
        s, _ = masked_scores(static, s, q_pos, kv_pos, h, masked, doc_tiles, False, rows, bounds)
        m_prev, l_prev = m_ref[...], l_ref[...]
        m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet in this row
        alpha = jnp.exp(m_prev - m_safe)
        p = jnp.exp(s - m_safe)
        m_ref[...] = m_new
        l_ref[...] = alpha * l_prev + p.sum(axis=-1, keepdims=True)
        acc_ref[...] = alpha * acc_ref[...] + dot(p.astype(v.dtype), v, 1, 0)

    _entry(step, kv_np_ref[bm, i], kv_cnt_ref[bm, i], j)

    @pl.when(j == static.kv_width - 1)
    def _():
        l = l_ref[...]
        seen = l > 0  # False only on padding rows (and, for traced masks, on rows that see nothing)
        o_ref[...] = (acc_ref[...] / jnp.where(seen, l, 1.0)).astype(o_ref.dtype)
        # +inf makes the backward's p = exp(s - lse) zero on such rows
        lse_col = jnp.where(seen, m_ref[...] + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
        lse_ref[...] = jnp.transpose(jnp.broadcast_to(lse_col, (tq, LANES)))[:1]


def _forward(static, q, k, v, mask_arrays, segments, mod_arrays=()):
    B, H, Tp, E = q.shape
    G, nq = static.groups, mask_arrays[0].shape[1]
    tq, tkv = Tp // nq, k.shape[2] // mask_arrays[3].shape[1]
    b_of = lambda b: b if static.mask_batched else 0
    q_spec = pl.BlockSpec((None, None, tq, E), lambda b, h, i, j, idx, *_: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, tkv, E), lambda b, h, i, j, idx, *_: (b, h // G, idx[b_of(b), i, j], 0))
    doc_specs, doc_args = [], []
    for batched, (q_ids, kv_ids) in zip(static.docs_batched, segments):
        db = (lambda b: b) if batched else (lambda b: 0)
        doc_specs += [
            pl.BlockSpec((None, tq, 1), lambda b, h, i, j, idx, *_, db=db: (db(b), i, 0)),
            pl.BlockSpec((None, 1, tkv), lambda b, h, i, j, idx, *_, db=db: (db(b), 0, idx[b_of(b), i, j])),
        ]
        doc_args += [_col(q_ids), _row(kv_ids)]
    return pl.pallas_call(
        functools.partial(_forward_kernel, static),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B, H, nq, static.kv_width),
            in_specs=[q_spec, kv_spec, kv_spec, *doc_specs, *_mod_specs(mod_arrays)],
            out_specs=[q_spec, pl.BlockSpec((None, None, 1, tq), lambda b, h, i, j, *_: (b, h, 0, i))],
            scratch_shapes=[
                pltpu.VMEM((tq, 1), jnp.float32),
                pltpu.VMEM((tq, 1), jnp.float32),
                pltpu.VMEM((tq, E), jnp.float32),
            ],
        ),
        out_shape=[like(q.shape, q.dtype, q), like((B, H, 1, Tp), jnp.float32, q)],
        interpret=static.interpret,
        compiler_params=_params(static, "parallel", "parallel", "parallel", "arbitrary"),
        name="block_sparse_attention_fwd_tpu",
    )(*mask_arrays[:3], q, k, v, *doc_args, *mod_arrays)


# ----------------------------------------------------------------------------- backward: dQ


def _transposed_step(
    static, q, k, v, do, lse, delta, q_pos, kv_pos, head, masked, doc_tiles, rows=(), grads=False, tile=None
):
    """One tile of the backward in the [kv, q] orientation: (p^T, ds^T), both [tkv, tq] float32, and with ``grads``
    this tile's gradient to ``rows`` (the head's rows of the mod's captured arrays, as scalars), else None.
    ``tile``: its (q_first, q_last, kv_first, kv_last), for the mod's shortcut."""
    s_raw = dot(k, q, 1, 1) * static.scale
    s, d_mod = masked_scores(static, s_raw, q_pos, kv_pos, head, masked, doc_tiles, True, rows, tile)
    p = jnp.exp(s - lse)
    ds = p * (dot(v, do, 1, 1) - delta)  # d loss / d (modded scores)
    d_rows = row_grads(static.score_mod, rows, s_raw, q_pos, kv_pos, head, ds, tile) if grads and rows else None
    if d_mod is not None:
        ds = ds * d_mod
    return p, ds, d_rows


def _dq_kernel(static, kv_idx_ref, kv_np_ref, kv_cnt_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs):
    """dQ of one q tile; with a score mod that captures arrays also the gradient to this head's rows of them, over
    this q tile's scores (one vector per program, in VMEM scratch across its kv entries; summed outside)."""
    n_docs, n_mod = len(static.docs_batched), static.n_mod_arrays
    doc_refs, mod_refs = refs[: 2 * n_docs], refs[2 * n_docs : 2 * n_docs + n_mod]
    outs = refs[2 * n_docs + n_mod :]
    (dq_ref, rows_ref, acc_ref, rows_acc) = outs if n_mod else (outs[0], None, outs[1], None)
    b, h, i, j = (pl.program_id(a) for a in range(4))
    bm = b if static.mask_batched else 0
    tq, tkv = q_ref.shape[0], k_ref.shape[0]

    @pl.when(j == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        if n_mod:
            rows_acc[...] = jnp.zeros(rows_acc.shape, jnp.float32)

    def step(masked):
        k = k_ref[...]
        q_pos = i * tq + iota(tq, 1)
        kv_first = kv_idx_ref[bm, i, j] * tkv
        kv_pos = kv_first + iota(tkv, 0)
        doc_tiles = [(doc_refs[2 * d][...], doc_refs[2 * d + 1][...]) for d in range(n_docs)]
        args = q_ref[...], k, v_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
        rows = load_rows(static.score_mod, mod_refs, h) if n_mod else ()
        bounds = tile_bounds(i * tq, tq, kv_first, tkv)
        _, ds, d_rows = _transposed_step(static, *args, q_pos, kv_pos, h, masked, doc_tiles, rows, True, bounds)
        acc_ref[...] += dot(ds.astype(k.dtype), k, 0, 0)
        if n_mod:
            rows_acc[...] += rows_as_vector(d_rows, rows_acc.shape[-1], leading=(1,))

    _entry(step, kv_np_ref[bm, i], kv_cnt_ref[bm, i], j)

    @pl.when(j == static.kv_width - 1)
    def _():
        dq_ref[...] = (acc_ref[...] * static.scale).astype(dq_ref.dtype)
        if n_mod:
            rows_ref[...] = rows_acc[...]


def _backward_dq(static, q, k, v, d_out, lse, delta, mask_arrays, segments, mod_arrays=()):
    """(dQ, per-program gradient vectors of the mod's rows [B, H, programs, width], or None without mod arrays)."""
    B, H, Tp, E = q.shape
    G, nq = static.groups, mask_arrays[0].shape[1]
    tq, tkv = Tp // nq, k.shape[2] // mask_arrays[3].shape[1]
    b_of = lambda b: b if static.mask_batched else 0
    q_spec = pl.BlockSpec((None, None, tq, E), lambda b, h, i, j, *_: (b, h, i, 0))
    row_spec = pl.BlockSpec((None, None, 1, tq), lambda b, h, i, j, *_: (b, h, 0, i))
    kv_spec = pl.BlockSpec((None, None, tkv, E), lambda b, h, i, j, idx, *_: (b, h // G, idx[b_of(b), i, j], 0))
    doc_specs, doc_args = [], []
    for batched, (q_ids, kv_ids) in zip(static.docs_batched, segments):
        db = (lambda b: b) if batched else (lambda b: 0)
        doc_specs += [
            pl.BlockSpec((None, 1, tq), lambda b, h, i, j, idx, *_, db=db: (db(b), 0, i)),
            pl.BlockSpec((None, tkv, 1), lambda b, h, i, j, idx, *_, db=db: (db(b), idx[b_of(b), i, j], 0)),
        ]
        doc_args += [_row(q_ids), _col(kv_ids)]
    out_specs, out_shape, scratch = [q_spec], [like(q.shape, q.dtype, q)], [pltpu.VMEM((tq, E), jnp.float32)]
    if mod_arrays:
        width = _rows_width(mod_arrays)
        out_specs.append(pl.BlockSpec((None, None, None, 1, width), lambda b, h, i, j, *_: (b, h, i, 0, 0)))
        out_shape.append(like((B, H, nq, 1, width), jnp.float32, q))
        scratch.append(pltpu.VMEM((1, width), jnp.float32))
    outs = pl.pallas_call(
        functools.partial(_dq_kernel, static),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B, H, nq, static.kv_width),
            in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, *doc_specs, *_mod_specs(mod_arrays)],
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        interpret=static.interpret,
        compiler_params=_params(static, "parallel", "parallel", "parallel", "arbitrary"),
        name="block_sparse_attention_dq_tpu",
    )(*mask_arrays[:3], q, k, v, d_out, lse, delta, *doc_args, *mod_arrays)
    return outs[0], (outs[1][:, :, :, 0] if mod_arrays else None)


# ----------------------------------------------------------------------------- backward: dK, dV


def _dkv_kernel(static, q_idx_ref, q_np_ref, q_cnt_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs):
    n_docs, n_mod = len(static.docs_batched), static.n_mod_arrays
    doc_refs, mod_refs = refs[: 2 * n_docs], refs[2 * n_docs : 2 * n_docs + n_mod]
    dk_ref, dv_ref, dk_acc, dv_acc = refs[2 * n_docs + n_mod :]
    b, hk, c, t = (pl.program_id(a) for a in range(4))
    bm = b if static.mask_batched else 0
    g, slot = t // static.q_width, t % static.q_width  # the grid's last axis walks (query head of the group, entry)
    tq, tkv = q_ref.shape[0], k_ref.shape[0]

    @pl.when(t == 0)
    def _():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    def step(masked):
        q, do = q_ref[...], do_ref[...]
        q_first = q_idx_ref[bm, c, slot] * tq
        q_pos = q_first + iota(tq, 1)
        kv_pos = c * tkv + iota(tkv, 0)
        doc_tiles = [(doc_refs[2 * d][...], doc_refs[2 * d + 1][...]) for d in range(n_docs)]
        head = hk * static.groups + g
        rows = load_rows(static.score_mod, mod_refs, head) if n_mod else ()
        bounds = tile_bounds(q_first, tq, c * tkv, tkv)
        p, ds, _ = _transposed_step(static, q, k_ref[...], v_ref[...], do, lse_ref[...], delta_ref[...], q_pos,
                                    kv_pos, head, masked, doc_tiles, rows, tile=bounds)  # fmt: skip
        dv_acc[...] += dot(p.astype(do.dtype), do, 1, 0)
        dk_acc[...] += dot(ds.astype(q.dtype), q, 1, 0)

    _entry(step, q_np_ref[bm, c], q_cnt_ref[bm, c], slot)

    @pl.when(t == static.groups * static.q_width - 1)
    def _():
        dk_ref[...] = (dk_acc[...] * static.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _backward_dkv(static, q, k, v, d_out, lse, delta, mask_arrays, segments, mod_arrays=()):
    B, H, Tp, E = q.shape
    K, Sp = k.shape[1], k.shape[2]
    G, W, nkv = static.groups, static.q_width, mask_arrays[3].shape[1]
    tq, tkv = Tp // mask_arrays[0].shape[1], Sp // nkv
    b_of = lambda b: b if static.mask_batched else 0
    entry = lambda b, c, t, idx: idx[b_of(b), c, t % W]  # the q block of list entry t % W, for query head t // W
    q_spec = pl.BlockSpec((None, None, tq, E), lambda b, h, c, t, idx, *_: (b, h * G + t // W, entry(b, c, t, idx), 0))
    row_spec = pl.BlockSpec(
        (None, None, 1, tq), lambda b, h, c, t, idx, *_: (b, h * G + t // W, 0, entry(b, c, t, idx))
    )
    kv_spec = pl.BlockSpec((None, None, tkv, E), lambda b, h, c, t, *_: (b, h, c, 0))
    doc_specs, doc_args = [], []
    for batched, (q_ids, kv_ids) in zip(static.docs_batched, segments):
        db = (lambda b: b) if batched else (lambda b: 0)
        doc_specs += [
            pl.BlockSpec((None, 1, tq), lambda b, h, c, t, idx, *_, db=db: (db(b), 0, entry(b, c, t, idx))),
            pl.BlockSpec((None, tkv, 1), lambda b, h, c, t, idx, *_, db=db: (db(b), c, 0)),
        ]
        doc_args += [_row(q_ids), _col(kv_ids)]
    return pl.pallas_call(
        functools.partial(_dkv_kernel, static),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B, K, nkv, G * W),
            in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, *doc_specs, *_mod_specs(mod_arrays)],
            out_specs=[kv_spec, kv_spec],
            scratch_shapes=[pltpu.VMEM((tkv, E), jnp.float32), pltpu.VMEM((tkv, E), jnp.float32)],
        ),
        out_shape=[like(k.shape, k.dtype, k), like(v.shape, v.dtype, v)],
        interpret=static.interpret,
        compiler_params=_params(static, "parallel", "parallel", "parallel", "arbitrary"),
        name="block_sparse_attention_dkv_tpu",
    )(*mask_arrays[3:], q, k, v, d_out, lse, delta, *doc_args, *mod_arrays)
