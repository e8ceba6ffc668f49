"""Block-sparse attention in XLA as a few large dense products: the CPU path for block masks known on the host.

Why: on XLA:CPU a batch of 128 x 128 score tiles runs forward + backward at about half the FLOP rate of 512 x 512
squares (measured per piece shape, head dim 128: 56-71 against 108-131 GFLOP/s on 2 cores), and the scan path
(``xla_attention``) multiplies 128 x 128 tiles one list slot at a time. Here the non-empty tiles of a host (numpy) block
mask are covered by a quadtree over the (q-block, kv-block) grid, in squares of at most ``MAX_SIDE`` positions: a square
whose tiles are all FULL is one unmasked product, all EMPTY is skipped, a mixed one is computed whole under the element
mask or split in four, whichever the cost model says is cheaper. For causal masks this is the recursive split: big
squares below the diagonal, masked tiles on it. Short sequences (``STRIPS_MAX_LEN``) are planned as strips instead: each
q block one piece over its span of live kv blocks, with nothing to merge. Pieces of one shape are one batched einsum
over static gathers of their q / kv blocks. Each piece yields its rows' max, sum and un-normalized output, and every q
block merges its pieces by the log-sum-exp rule through a static table.

Backward (``jax.custom_vjp``, FlashAttention-2 style): per piece the probabilities are recomputed from the saved
log-sum-exp, and that one score tile feeds dQ, dK and dV; the pieces' gradients are summed per block through tables
like the forward's. Nothing of size [T, S] is saved beyond ``KEEP_PROBS_MAX_LEN`` query positions (up to it the
forward's probability tiles are kept, which saves a product and an exp per tile); the transients are the score tiles
of one group of pieces. A score mod's captured arrays (``score_tables``) are differentiable inputs: their gradient is
the mod's vjp in them, summed over the pieces.

Shape suffixes follow the legend in docs/architecture.md, plus: A batch x query heads (flattened), N pieces of a
group, Q / W query / key positions of a piece, O every block of an axis, R the blocks of all groups' pieces stacked
(plus one empty slot).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .block_mask import EMPTY, FULL, PARTIAL, BlockMask
from .kernel_inputs import AttentionStatic, check_attention_inputs, pad_axis, segment_arrays
from .kernel_mask import split_documents
from .masks import ScoreMod
from .score_tables import bind_shapes, split_arrays

#: Largest piece side, in positions: bigger squares are split (a score tile stays <= 16 MiB per head; 4096-wide
#: ones measured no faster).
MAX_SIDE = 2048
#: Cost model of a piece of h x w positions: h * w (times MASKED_COST under the element mask) + PIECE_COST. A piece
#: costs about one 128 x 128 tile beyond its area (the per-shape rates above), and splitting causal's 256 x 256
#: diagonal squares into tiles measured 8-20% faster than computing them whole under the mask.
PIECE_COST = 128 * 128
MASKED_COST = 1.6
#: Query lengths (padded to whole blocks) up to which the plan is strips instead: one piece per q block, spanning
#: the kv blocks from its first live one to its last, so no q block merges partial softmaxes. For short sequences
#: that merge is what costs: causal forward + backward at T=256, head dim 64, in strips of 64 ran 1.3-1.6x the
#: quadtree; from T=512 on strips were 0.8-1.2x it (docs/results/bench_attention.md).
STRIPS_MAX_LEN = 256
#: Query lengths (padded) up to which the forward's probability tiles are kept for the backward instead of recomputed
#: from q, k and the log-sum-exp: one score product and one exp per tile fewer. Short sequences only, where the
#: tiles are small (at most 256 x 256 per head): causal forward + backward at T=256, head dim 64, batch 4 x 6 heads
#: 1.35x. Longer sequences keep FlashAttention's O(T) residuals: kept tiles are O(T^2) (at T=2048, batch 16 x 6
#: heads, ~860 MB a layer), for 0.96-1.05x measured at T=2048.
KEEP_PROBS_MAX_LEN = 256


@dataclasses.dataclass(frozen=True)
class Group:
    """Pieces of one shape, ``rows`` x ``cols`` blocks, the i-th at block (q_starts[i], kv_starts[i])."""

    rows: int
    cols: int
    masked: bool  # True: the pieces need the element mask (they hold PARTIAL or EMPTY tiles)
    q_starts: tuple[int, ...]
    kv_starts: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a block mask's non-empty tiles are covered by pieces, grouped by shape."""

    groups: tuple[Group, ...]
    num_q_blocks: int
    num_kv_blocks: int

    def computed_blocks(self) -> int:
        """Tiles the pieces compute (masked pieces count whole: their EMPTY tiles are computed too)."""
        return sum(g.rows * g.cols * len(g.q_starts) for g in self.groups)


def plan_block_mask(block_mask: BlockMask, max_side: int | None = None) -> Plan:
    """The pieces covering a host block mask's non-empty tiles (of every batch element: a tile FULL in all of them
    counts FULL, one EMPTY in all counts EMPTY, anything else PARTIAL): strips up to ``STRIPS_MAX_LEN`` query
    positions, the quadtree beyond."""
    if block_mask.is_traced:
        raise ValueError("plan_block_mask: the block mask is traced; its tiles are known on device only")
    kind = np.asarray(block_mask.kind).reshape(-1, block_mask.num_q_blocks, block_mask.num_kv_blocks)
    bs = block_mask.block_sizes
    union = np.where((kind == FULL).all(0), FULL, np.where((kind == EMPTY).all(0), EMPTY, PARTIAL)).astype(np.int8)
    if block_mask.num_q_blocks * bs.block_q <= STRIPS_MAX_LEN:
        return _strips(union.tobytes(), union.shape)
    costs = (PIECE_COST, MASKED_COST)
    return _plan(union.tobytes(), union.shape, bs.block_q, bs.block_kv, max_side or MAX_SIDE, costs)


@functools.lru_cache(maxsize=256)
def _strips(kind_bytes: bytes, shape: tuple[int, int]) -> Plan:
    """One piece per q block over its first to last live kv block (masked unless all of them are FULL); q blocks
    of equal span form one group."""
    kind = np.frombuffer(kind_bytes, np.int8).reshape(shape)
    shapes: dict[tuple[int, bool], list[tuple[int, int]]] = {}
    for row, row_kind in enumerate(kind):
        live = np.flatnonzero(row_kind != EMPTY)
        if live.size:
            c0, c1 = int(live[0]), int(live[-1]) + 1
            shapes.setdefault((c1 - c0, bool((row_kind[c0:c1] != FULL).any())), []).append((row, c0))
    groups = tuple(
        Group(1, w, m, tuple(r for r, _ in at), tuple(c for _, c in at)) for (w, m), at in sorted(shapes.items())
    )
    return Plan(groups, *shape)


@functools.lru_cache(maxsize=256)
def _plan(kind_bytes: bytes, shape: tuple[int, int], bq: int, bkv: int, max_side: int, costs: tuple) -> Plan:
    kind = np.frombuffer(kind_bytes, np.int8).reshape(shape)
    piece_cost, masked_cost = costs

    def cost(pieces):
        return sum(
            (r1 - r0) * bq * (c1 - c0) * bkv * (masked_cost if masked else 1.0) + piece_cost
            for r0, r1, c0, c1, masked in pieces
        )

    pieces = _quadtree(kind, bq, bkv, max_side, cost)
    shapes: dict[tuple[int, int, bool], list[tuple[int, int]]] = {}
    for r0, r1, c0, c1, masked in sorted(pieces):
        shapes.setdefault((r1 - r0, c1 - c0, masked), []).append((r0, c0))
    groups = tuple(
        Group(h, w, m, tuple(r for r, _ in at), tuple(c for _, c in at)) for (h, w, m), at in sorted(shapes.items())
    )
    return Plan(groups, *shape)


def _quadtree(kind, bq, bkv, max_side, cost):
    """Pieces (r0, r1, c0, c1, masked) in blocks: squares of at most ``max_side`` positions, each all FULL (one
    unmasked product), or mixed and computed whole under the mask, or split in four, whichever ``cost`` prefers."""
    nq, nkv = kind.shape

    def table(x):  # summed-area table: count(r0, r1, c0, c1) in four lookups
        t = np.zeros((nq + 1, nkv + 1), np.int64)
        t[1:, 1:] = np.cumsum(np.cumsum(x, 0), 1)
        return t.tolist()

    full, live = table(kind == FULL), table(kind != EMPTY)

    def count(t, r0, r1, c0, c1):
        return t[r1][c1] - t[r0][c1] - t[r1][c0] + t[r0][c0]

    def best(r0, c0, size):
        """(cost, pieces) of the square of ``size`` blocks at (r0, c0), clipped to the grid."""
        r1, c1 = min(r0 + size, nq), min(c0 + size, nkv)
        if r0 >= r1 or c0 >= c1 or count(live, r0, r1, c0, c1) == 0:
            return 0.0, []
        if count(full, r0, r1, c0, c1) == (r1 - r0) * (c1 - c0):
            return cost([(r0, r1, c0, c1, False)]), [(r0, r1, c0, c1, False)]
        whole = [(r0, r1, c0, c1, True)]
        if size == 1:
            return cost(whole), whole
        half = size // 2
        parts = [best(r0 + a, c0 + b, half) for a in (0, half) for b in (0, half)]
        split = sum(c for c, _ in parts), [p for _, ps in parts for p in ps]
        return split if split[0] < cost(whole) else (cost(whole), whole)

    side = 1 << max(0, (max_side // max(bq, bkv)).bit_length() - 1)  # a power of two, in blocks
    return [p for r0 in range(0, nq, side) for c0 in range(0, nkv, side) for p in best(r0, c0, side)[1]]


@functools.lru_cache(maxsize=256)
def _tables(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """(q table [nq, Cq], kv table [nkv, Ck]) int32: per block, the stacked row blocks of the pieces meeting it,
    padded with the empty slot (the index one past the last)."""

    def build(n, size_of, starts_of):
        lists, offset = [[] for _ in range(n)], 0
        for g in plan.groups:
            size = size_of(g)
            for i, start in enumerate(starts_of(g)):
                for j in range(size):
                    lists[start + j].append(offset + i * size + j)
            offset += size * len(starts_of(g))
        width = max(1, max(len(x) for x in lists))
        return np.array([x + [offset] * (width - len(x)) for x in lists], np.int32)

    q = build(plan.num_q_blocks, lambda g: g.rows, lambda g: g.q_starts)
    kv = build(plan.num_kv_blocks, lambda g: g.cols, lambda g: g.kv_starts)
    return q, kv


@dataclasses.dataclass(frozen=True)
class _Static(AttentionStatic):
    plan: Plan


def tiled_attention_xla(
    q, k, v, block_mask: BlockMask, *, scale: float | None = None, score_mod: ScoreMod | None = None
):
    """Attention over the non-empty tiles of a host ``block_mask``, as a few large products; differentiable.

    q [B, H, T, E], k/v [B, K, S, E] (K divides H); ``block_mask`` from ``make_block_mask(mask, T, S, ...)`` with a
    static mask or host (numpy) segment ids. Returns (out [B, H, T, E] in q.dtype, lse [B, H, T] float32), equal to
    ``reference_attention(q, k, v, block_mask.mask, ...)``; arrays a ``score_mod`` captures get gradients too.
    """
    check_attention_inputs("tiled_attention_xla", q, k, v, block_mask)
    B, H, T, E = q.shape
    template, docs = split_documents(block_mask.mask)
    doc_arrays = tuple(ids for pair in segment_arrays("tiled_attention_xla", docs, block_mask, B) for ids in pair)
    score_mod, mod_arrays = split_arrays("tiled_attention_xla", score_mod, H)
    static = _Static(
        **AttentionStatic.shared(template, score_mod, scale, block_mask, E), plan=plan_block_mask(block_mask)
    )
    qp = pad_axis(q, 2, block_mask.padded_q_len)
    kp, vp = (pad_axis(x, 2, block_mask.padded_kv_len) for x in (k, v))
    out, lse = _attention(static, qp, kp, vp, doc_arrays, mod_arrays)
    return out[:, :, :T], lse[:, :, :T]


def mod_array_grads(score_mod: ScoreMod, mod_arrays, s, q_pos, kv_pos, head, ds) -> tuple:
    """d loss / d ``mod_arrays`` (a mod's arrays [H, n], ``split_arrays``') from one set of tiles: the vjp of the
    mod in its arrays at the raw scores ``s``, ``ds`` = d loss / d (modded scores). ``ds`` is 0 (never NaN) outside
    the mask and on padding, so those entries add nothing."""

    def mod(arrays):
        return score_mod.with_arrays(bind_shapes(score_mod, arrays))(s, q_pos, kv_pos, head)

    _, vjp = jax.vjp(mod, tuple(mod_arrays))
    return vjp(ds)[0]


# ----------------------------------------------------------------------------- custom_vjp
# Inside, batch and query heads are one axis A = B * H (free reshapes of [B, H, ...]); kv heads are repeated to H,
# so every product is batched over (A, pieces) with no transposes of the score tiles (measured: XLA:CPU copies a
# score tile transposed when a batch or contracting dim sits elsewhere, at about the cost of the product).


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q, k, v, doc_arrays, mod_arrays):
    return _forward(static, q, k, v, doc_arrays, mod_arrays)[:2]


def _attention_fwd(static, q, k, v, doc_arrays, mod_arrays):
    out, lse, probs = _forward(static, q, k, v, doc_arrays, mod_arrays)
    keep = static.score_mod is None and q.shape[2] <= KEEP_PROBS_MAX_LEN  # a score mod's gradient needs the scores
    return (out, lse), (q, k, v, out, lse, doc_arrays, mod_arrays, probs if keep else None)


def _attention_bwd(static, residuals, cotangents):
    q, k, v, out, lse, doc_arrays, mod_arrays, probs = residuals
    d_out, d_lse = cotangents
    # d lse / d s = p, so a cotangent on lse enters ds = p * (dp - delta) as -d_lse in delta.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - d_lse
    # materialized: XLA otherwise fuses lse's merge (gathers and an exp per piece) into every score element's exp
    lse, delta = jax.lax.optimization_barrier((lse, delta))
    dq, dk, dv, d_mod_arrays = _backward(static, q, k, v, d_out, lse, delta, doc_arrays, mod_arrays, probs)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, d_mod_arrays


_attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------- the pieces


def _blocks(x_BH_T_, block):
    """[B, H, T, ...] -> [A, T / block, block, ...] float32 (a reshape)."""
    B, H, T = x_BH_T_.shape[:3]
    return x_BH_T_.astype(jnp.float32).reshape(B * H, T // block, block, *x_BH_T_.shape[3:])


def _kv_blocks(static, x_BKSE, H):
    """[B, K, S, E] -> [A, nkv, block_kv, E]: kv heads repeated to the query heads they serve."""
    return _blocks(jnp.repeat(x_BKSE, H // x_BKSE.shape[1], axis=1), static.block_kv)


def _pieces(x_AO_, starts, size):
    """Blocks [A, O, b, ...] -> pieces [A, N, size * b, ...]: piece i holds blocks starts[i] .. starts[i] + size - 1.
    Evenly spaced pieces (the causal split's) are a strided slice, others a gather."""
    A, n, b, rest = x_AO_.shape[0], x_AO_.shape[1], x_AO_.shape[2], x_AO_.shape[3:]
    N = len(starts)
    step = starts[1] - starts[0] if N > 1 else size
    if step >= size and all(y - x == step for x, y in zip(starts, starts[1:])):
        end = starts[0] + N * step
        x = jax.lax.slice_in_dim(x_AO_, starts[0], min(end, n), axis=1)
        x = pad_axis(x, 1, end - starts[0]) if end > n else x
        x = jax.lax.slice_in_dim(x.reshape(A, N, step, b, *rest), 0, size, axis=2)
    else:
        idx = (np.asarray(starts, np.int32)[:, None] + np.arange(size, dtype=np.int32)).reshape(-1)
        x = jnp.take(x_AO_, idx, axis=1)
    return x.reshape(A, N, size * b, *rest)


def _stack(pieces_AN_, fill):
    """Per-group results [A, N, size * b, ...] -> blocks [A, R + 1, b, ...]: every group's, then a slot of ``fill``
    (what a missing piece contributes)."""
    out = [x.reshape(x.shape[0], -1, *blocks_shape) for x, blocks_shape in pieces_AN_]
    out.append(jnp.full((out[0].shape[0], 1, *out[0].shape[2:]), fill, jnp.float32))
    return jnp.concatenate(out, axis=1)


def _slots(x_AR_, table, combine=None):
    """Per block, its slots of ``table`` [n, C] combined: [A, R + 1, ...] -> [A, n, ...]. One slot at a time: a
    gather of all slots reduced in one op measured ~100x slower on CPU."""
    slots = [x_AR_[:, c] for c in table.T]
    return functools.reduce(combine, slots) if combine else slots


def _dot(spec, x, y):
    """einsum over [A, N, ...] operands with (A, N) flattened into one batch dim: a size-1 N otherwise made XLA copy
    the score tile to a layout that only moves that dim (measured ~10% of a causal forward)."""
    A, N = x.shape[:2]
    out = jnp.einsum(spec, x.reshape(A * N, *x.shape[2:]), y.reshape(A * N, *y.shape[2:]))
    return out.reshape(A, N, *out.shape[1:])


def _positions(starts, size, block):
    """[N, size * block] absolute positions of each piece (static)."""
    return np.asarray(starts, np.int32)[:, None] * block + np.arange(size * block, dtype=np.int32)


def _tile_coords(static, group, H, transposed=False):
    """(q positions [N, Q, 1], kv positions [N, 1, W], query head [1, H, 1, 1, 1]), broadcasting against a group's
    tiles as [B, H, N, Q, W] (positions [N, 1, Q] / [N, W, 1] when ``transposed``)."""
    q_pos = _positions(group.q_starts, group.rows, static.block_q)
    kv_pos = _positions(group.kv_starts, group.cols, static.block_kv)
    q_pos, kv_pos = (q_pos[:, None, :], kv_pos[:, :, None]) if transposed else (q_pos[:, :, None], kv_pos[:, None])
    return jnp.asarray(q_pos), jnp.asarray(kv_pos), jnp.arange(H, dtype=jnp.int32).reshape(1, H, 1, 1, 1)


def _by_head(x_AN__, B):
    """[A, N, ., .] -> [B, H, N, ., .] (a reshape): what score mods read heads from."""
    return x_AN__.reshape(B, -1, *x_AN__.shape[1:])


def _mask_and_mod(static, group, s, B, doc_arrays, mod_arrays=(), transposed=False, with_grad=False):
    """Score tiles [A, N, Q, W] (or [A, N, W, Q] ``transposed``) -> score-modded, -inf outside the mask (masked
    groups only); optionally d mod / d s."""
    shape = s.shape
    s = _by_head(s, B)
    q_pos, kv_pos, head = _tile_coords(static, group, s.shape[1], transposed)
    arrays = bind_shapes(static.score_mod, mod_arrays) if mod_arrays else ()
    s, d_mod = static.mod_scores(s, q_pos, kv_pos, head, with_grad, arrays)
    d_mod = None if d_mod is None else d_mod.reshape(shape)
    if group.masked:
        tiles = [(q_ids[:, q_pos], kv_ids[:, kv_pos]) for q_ids, kv_ids in zip(doc_arrays[0::2], doc_arrays[1::2])]
        keep = static.keep(tiles, q_pos, kv_pos)  # [(B,) N, ., .]
        s = jnp.where(keep[:, None] if keep.ndim == 4 else keep, s, -jnp.inf)
    return s.reshape(shape), d_mod


def _forward(static, q, k, v, doc_arrays, mod_arrays=()):
    B, H, T, E = q.shape
    q_blocks = _blocks(q * static.scale, static.block_q)  # scaling q: no pass over the score tiles
    k_blocks, v_blocks = _kv_blocks(static, k, H), _kv_blocks(static, v, H)
    ms, ls, accs, probs = [], [], [], []
    for g in static.plan.groups:
        q_ANQE = _pieces(q_blocks, g.q_starts, g.rows)
        k_ANWE, v_ANWE = (_pieces(x, g.kv_starts, g.cols) for x in (k_blocks, v_blocks))
        s, _ = _mask_and_mod(static, g, _dot("bqe,bwe->bqw", q_ANQE, k_ANWE), B, doc_arrays, mod_arrays)
        m = s.max(-1)
        m_safe = jnp.where(jnp.isneginf(m), 0.0, m)  # a row the piece's mask leaves empty
        p = jnp.exp(s - m_safe[..., None])
        probs.append((p, m_safe))  # exp(s - lse) = p * exp(m_safe - lse): what the backward needs, if kept
        ms.append((m, (static.block_q,)))
        ls.append((p.sum(-1), (static.block_q,)))
        accs.append((_dot("bqw,bwe->bqe", p, v_ANWE), (static.block_q, E)))
    q_table, _ = _tables(static.plan)
    m_ARB, l_ARB, acc_ARBE = _stack(ms, -jnp.inf), _stack(ls, 0.0), _stack(accs, 0.0)
    m = _slots(m_ARB, q_table, jnp.maximum)  # [A, nq, bq]
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    w = [jnp.exp(mc - m_safe) for mc in _slots(m_ARB, q_table)]
    l = sum(wc * lc for wc, lc in zip(w, _slots(l_ARB, q_table)))
    acc = sum(wc[..., None] * ac for wc, ac in zip(w, _slots(acc_ARBE, q_table)))
    seen = l > 0  # False only on padding rows (and rows a static document mask leaves empty)
    out = acc / jnp.where(seen, l, 1.0)[..., None]
    lse = jnp.where(seen, m_safe + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)  # +inf: p = 0 there in the backward
    return out.reshape(B, H, T, E).astype(q.dtype), lse.reshape(B, H, T), probs


def _backward(static, q, k, v, do, lse, delta, doc_arrays, mod_arrays=(), probs=None):
    """(dQ, dK, dV, d mod_arrays): FlashAttention-2's backward per piece. Recomputed from q, k and the log-sum-exp,
    the probability tiles are transposed [W, Q]: dK and dV contract the tile's last axis, as XLA:CPU's fast products
    want; only dQ's [E, Q] result is transposed, and it is small. Rescaled from the forward's ``probs`` (per group:
    tiles [A, N, Q, W] and their rows' max) when it kept them, they stay [Q, W] as the forward made them: transposing
    them cost more than it saved (causal, T = 256, batch 4 x 6 heads, head dim 64: 1.01-1.05x without, in-process)."""
    B, H, T, E = q.shape
    K, S = k.shape[1], k.shape[2]
    bq = static.block_q
    q_blocks, do_blocks = _blocks(q * static.scale, bq), _blocks(do, bq)
    lse_blocks, delta_blocks = _blocks(lse, bq), _blocks(delta, bq)
    k_blocks, v_blocks = _kv_blocks(static, k, H), _kv_blocks(static, v, H)
    dqs, dks, dvs, d_arrays = [], [], [], tuple(jnp.zeros_like(a) for a in mod_arrays)
    for i, g in enumerate(static.plan.groups):
        q_ANQE, do_ANQE, lse_ANQ, delta_ANQ = (
            _pieces(x, g.q_starts, g.rows) for x in (q_blocks, do_blocks, lse_blocks, delta_blocks)
        )
        k_ANWE, v_ANWE = (_pieces(x, g.kv_starts, g.cols) for x in (k_blocks, v_blocks))
        if probs is not None:  # kept: no score mod (see _attention_fwd), tiles [Q, W]
            tile = "bqw"
            p_ANQW, m_ANQ = probs[i]
            p = p_ANQW * jnp.exp(m_ANQ - lse_ANQ)[..., None]
            ds = p * (_dot("bqe,bwe->bqw", do_ANQE, v_ANWE) - delta_ANQ[..., None])
            dq = _dot("bqw,bwe->bqe", ds, k_ANWE)
        else:  # recomputed, tiles [W, Q]
            tile = "bwq"
            s_raw = _dot("bwe,bqe->bwq", k_ANWE, q_ANQE)
            s, d_mod = _mask_and_mod(static, g, s_raw, B, doc_arrays, mod_arrays, transposed=True, with_grad=True)
            p = jnp.exp(s - lse_ANQ[:, :, None])  # 0 outside the mask and on padding rows (lse +inf): so is ds
            ds = p * (_dot("bwe,bqe->bwq", v_ANWE, do_ANQE) - delta_ANQ[:, :, None])
            if mod_arrays:  # ds is the gradient to the modded scores here
                coords = _tile_coords(static, g, H, transposed=True)
                grads = mod_array_grads(static.score_mod, mod_arrays, _by_head(s_raw, B), *coords, _by_head(ds, B))
                d_arrays = tuple(a + b for a, b in zip(d_arrays, grads))
            if d_mod is not None:
                ds = ds * d_mod
            dq = _dot("bwe,bwq->beq", k_ANWE, ds).swapaxes(-1, -2)
        dvs.append((_dot(f"{tile},bqe->bwe", p, do_ANQE), (static.block_kv, E)))
        dks.append((_dot(f"{tile},bqe->bwe", ds, q_ANQE), (static.block_kv, E)))
        dqs.append((dq, (bq, E)))
    q_table, kv_table = _tables(static.plan)
    dq = sum(_slots(_stack(dqs, 0.0), q_table)) * static.scale
    dk, dv = (sum(_slots(_stack(x, 0.0), kv_table)).reshape(B, K, H // K, S, E).sum(2) for x in (dks, dvs))
    return dq.reshape(B, H, T, E), dk, dv, d_arrays
