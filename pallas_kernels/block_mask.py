"""Block-sparse structure of a mask: which (q-block, kv-block) tiles are empty, partial or full.

``make_block_mask(mask, q_len, kv_len, BlockSizes(block_q, block_kv))`` tiles the [q_len, kv_len] score matrix,
padded up to whole blocks (padding rows and columns count as masked), and lists for every q-block row its non-empty
kv blocks, PARTIAL ones first and then FULL ones, so a kernel runs two loops: one applying the element mask, one
without it. The dK/dV pass walks kv-block columns over the transposed lists the same way.

Host path: the mask is evaluated with numpy one q-block row ([block_q, kv_len]) at a time, so memory stays
O(block_q * kv_len) even at 32k x 32k. Static masks (everything but ``document``) are cached by value: every layer
and every step gets the identical ``BlockMask``.

Traced path: a ``document`` mask whose segment ids are traced (they come from the batch inside ``jax.jit``) is
classified on device with jnp, the lists sized for the worst case (every block) and the counts saying how many are
real; kernels loop ``counts`` times, so the skipped work is skipped all the same. An empty query row cannot raise
under tracing; masks with document terms should include a term that lets every query see itself (e.g. causal).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .masks import Mask

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes along the query and key axes."""

    block_q: int = 128
    block_kv: int = 128

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"BlockSizes.{name} must be a positive integer, got {v!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMask:
    """Block classification of ``mask`` over a [q_len, kv_len] score matrix padded to whole blocks.

    Arrays are read-only numpy (host path) or jax arrays (traced path). Shapes carry the mask's leading batch dims
    ``(B,)`` (none for static masks); nq = ceil(q_len / block_q), nkv = ceil(kv_len / block_kv):
      kind              int8  [(B,) nq, nkv]    EMPTY / PARTIAL / FULL
      kv_block_indices  int32 [(B,) nq, max_kv] non-empty kv blocks of each q-block row: the PARTIAL ones in
                                                increasing order, then the FULL ones; padded with the row's last
                                                entry (0 if it has none) so a kernel can clamp
      kv_partial_counts int32 [(B,) nq]         how many of the row's entries are PARTIAL (they come first)
      kv_block_counts   int32 [(B,) nq]         how many entries are real
      q_block_indices   int32 [(B,) nkv, max_q] the transpose: non-empty q blocks of each kv-block column
      q_partial_counts  int32 [(B,) nkv]
      q_block_counts    int32 [(B,) nkv]        (may be 0: keys no query sees, e.g. causal with q_len < kv_len)
    """

    mask: Mask
    q_len: int
    kv_len: int
    block_sizes: BlockSizes
    kind: np.ndarray
    kv_block_indices: np.ndarray
    kv_partial_counts: np.ndarray
    kv_block_counts: np.ndarray
    q_block_indices: np.ndarray
    q_partial_counts: np.ndarray
    q_block_counts: np.ndarray

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.kind.shape[:-2])

    @property
    def num_q_blocks(self) -> int:
        return self.kind.shape[-2]

    @property
    def num_kv_blocks(self) -> int:
        return self.kind.shape[-1]

    @property
    def padded_q_len(self) -> int:
        return self.num_q_blocks * self.block_sizes.block_q

    @property
    def padded_kv_len(self) -> int:
        return self.num_kv_blocks * self.block_sizes.block_kv

    @property
    def is_traced(self) -> bool:
        return not isinstance(self.kind, np.ndarray)

    @property
    def density(self) -> float:
        """Fraction of non-empty blocks (the share of the dense work a block-sparse kernel does)."""
        return float(np.mean(np.asarray(self.kind) != EMPTY))

    def dense(self) -> np.ndarray:
        """The element-wise bool mask [(B,) q_len, kv_len], for tests and the reference path."""
        q = np.arange(self.q_len, dtype=np.int32)[:, None]
        kv = np.arange(self.kv_len, dtype=np.int32)[None, :]
        return np.broadcast_to(np.asarray(self.mask(q, kv), dtype=bool), (*self.batch_shape, self.q_len, self.kv_len))

    def __repr__(self):
        density = "traced" if self.is_traced else f"{self.density:.3f}"
        return (
            f"BlockMask({self.mask!r}, q_len={self.q_len}, kv_len={self.kv_len}, {self.block_sizes}, "
            f"batch_shape={self.batch_shape}, density={density})"
        )


def _is_traced(mask: Mask) -> bool:
    if mask.is_static:
        return False
    leaves = [getattr(mask, n, None) for n in ("q_segment_ids", "kv_segment_ids")]
    children = (*getattr(mask, "masks", ()), *((mask.positions,) if hasattr(mask, "positions") else ()))
    return any(isinstance(x, jax.core.Tracer) for x in leaves) or any(_is_traced(m) for m in children)


def make_block_mask(mask: Mask, q_len: int, kv_len: int, block_sizes: BlockSizes = BlockSizes()) -> BlockMask:
    """Classify every (q-block, kv-block) tile of ``mask`` and list the non-empty ones; cached for static masks.

    Lengths need not be multiples of the block sizes: the grid is padded up and the padding is masked. Raises
    ValueError (host path) if some query attends to no key: its softmax would be undefined.
    """
    if not isinstance(mask, Mask):
        raise TypeError(f"make_block_mask: expected a Mask, got {type(mask).__name__}")
    if not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"make_block_mask: expected BlockSizes, got {type(block_sizes).__name__}")
    for name, n in (("q_len", q_len), ("kv_len", kv_len)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"make_block_mask: {name} must be a positive integer, got {n!r}")
    q_len, kv_len = int(q_len), int(kv_len)
    if mask.is_static:
        return _cached(mask, q_len, kv_len, block_sizes)
    if _is_traced(mask):
        return _build_traced(mask, q_len, kv_len, block_sizes)
    return _build(mask, q_len, kv_len, block_sizes)


@functools.lru_cache(maxsize=256)
def _cached(mask: Mask, q_len: int, kv_len: int, block_sizes: BlockSizes) -> BlockMask:
    return _build(mask, q_len, kv_len, block_sizes)


make_block_mask.cache_clear = _cached.cache_clear  # type: ignore[attr-defined]
make_block_mask.cache_info = _cached.cache_info  # type: ignore[attr-defined]


def _tile_kinds(m, bq: int, nkv: int, bkv: int, xp):
    """[..., bq, nkv * bkv] bool -> [..., nkv] int8 kinds."""
    tiles = m.reshape(*m.shape[:-2], bq, nkv, bkv)
    any_, all_ = tiles.any(axis=(-3, -1)), tiles.all(axis=(-3, -1))
    return xp.where(all_, FULL, xp.where(any_, PARTIAL, EMPTY)).astype(xp.int8)


def _build(mask: Mask, q_len: int, kv_len: int, bs: BlockSizes) -> BlockMask:
    bq, bkv = bs.block_q, bs.block_kv
    nq, nkv = -(-q_len // bq), -(-kv_len // bkv)
    kv = np.arange(kv_len, dtype=np.int32)[None, :]
    rows = []
    for i in range(nq):
        q = np.arange(i * bq, min((i + 1) * bq, q_len), dtype=np.int32)[:, None]
        m = np.asarray(mask(q, kv), dtype=bool)
        m = np.broadcast_to(m, (*m.shape[:-2], len(q), kv_len))
        seen = m.any(axis=-1)  # [..., rows]
        if not seen.all():
            _raise_empty_row(mask, seen, i * bq)
        pad = [(0, 0)] * (m.ndim - 2) + [(0, bq - len(q)), (0, nkv * bkv - kv_len)]
        rows.append(_tile_kinds(np.pad(m, pad), bq, nkv, bkv, np))
    batch = np.broadcast_shapes(*(r.shape[:-1] for r in rows))
    kind = np.stack([np.broadcast_to(r, (*batch, nkv)) for r in rows], axis=-2)
    arrays = (kind, *_compact(kind, np), *_compact(np.swapaxes(kind, -1, -2), np))
    arrays = [np.ascontiguousarray(a) for a in arrays]
    for a in arrays:
        a.setflags(write=False)
    return BlockMask(mask, q_len, kv_len, bs, *arrays)


def _build_traced(mask: Mask, q_len: int, kv_len: int, bs: BlockSizes) -> BlockMask:
    bq, bkv = bs.block_q, bs.block_kv
    nq, nkv = -(-q_len // bq), -(-kv_len // bkv)
    kv = jnp.arange(nkv * bkv, dtype=jnp.int32)[None, :]

    def row(i):
        q = i * bq + jnp.arange(bq, dtype=jnp.int32)[:, None]
        m = jnp.asarray(mask(q, kv), dtype=bool) & (q < q_len) & (kv < kv_len)
        return _tile_kinds(m, bq, nkv, bkv, jnp)

    kind = jnp.moveaxis(jax.lax.map(row, jnp.arange(nq)), 0, -2)  # [..., nq, nkv]
    return BlockMask(mask, q_len, kv_len, bs, kind, *_compact(kind, jnp), *_compact(jnp.swapaxes(kind, -1, -2), jnp))


def coarsen(block_mask: BlockMask, factor_q: int, factor_kv: int) -> BlockMask:
    """The same mask in blocks ``factor_q`` x ``factor_kv`` times larger: a coarse block is EMPTY when all its blocks
    are, FULL when all are, PARTIAL otherwise (blocks past the padded end count as EMPTY, so a coarse block holding
    padding is PARTIAL and its padding is masked). Why: a kernel that wants larger tiles than the mask's blocks (the
    TPU kernels) reads the one block mask at its own granularity, on the host or traced alike."""
    if factor_q == factor_kv == 1:
        return block_mask
    xp = jnp if block_mask.is_traced else np
    kind = block_mask.kind
    nq, nkv = kind.shape[-2:]
    cq, ckv = -(-nq // factor_q), -(-nkv // factor_kv)
    pad = [(0, 0)] * (kind.ndim - 2) + [(0, cq * factor_q - nq), (0, ckv * factor_kv - nkv)]
    tiles = xp.pad(kind, pad, constant_values=EMPTY).reshape(*kind.shape[:-2], cq, factor_q, ckv, factor_kv)
    all_full = (tiles == FULL).all(axis=(-3, -1))
    any_set = (tiles != EMPTY).any(axis=(-3, -1))
    coarse = xp.where(all_full, FULL, xp.where(any_set, PARTIAL, EMPTY)).astype(xp.int8)
    sizes = BlockSizes(block_mask.block_sizes.block_q * factor_q, block_mask.block_sizes.block_kv * factor_kv)
    arrays = (coarse, *_compact(coarse, xp), *_compact(xp.swapaxes(coarse, -1, -2), xp))
    if xp is np:
        arrays = [np.ascontiguousarray(a) for a in arrays]
        for a in arrays:
            a.setflags(write=False)
    return BlockMask(block_mask.mask, block_mask.q_len, block_mask.kv_len, sizes, *arrays)


def _compact(kind, xp):
    """Per row of kinds [..., r, c]: (indices [..., r, width], partial counts [..., r], counts [..., r]).

    Indices list the PARTIAL columns then the FULL ones, each increasing, padded with the last real one (or 0).
    The host path sizes ``width`` to the longest row; the traced path cannot, and uses every column.
    """
    partial = (kind == PARTIAL).sum(axis=-1).astype(xp.int32)
    counts = (kind != EMPTY).sum(axis=-1).astype(xp.int32)
    width = max(1, int(counts.max(initial=0))) if xp is np else kind.shape[-1]
    rank = xp.where(kind == PARTIAL, 0, xp.where(kind == FULL, 1, 2)).astype(xp.int8)
    order = xp.argsort(rank, axis=-1, stable=True)[..., :width].astype(xp.int32)
    last = xp.take_along_axis(order, xp.maximum(counts - 1, 0)[..., None], axis=-1)
    last = xp.where(counts[..., None] > 0, last, 0)
    idx = xp.where(xp.arange(width) < counts[..., None], order, last).astype(xp.int32)
    return idx, partial, counts


def _raise_empty_row(mask: Mask, seen: np.ndarray, q_offset: int):
    where = np.argwhere(~seen)  # rows [..., q] in C order; pick the smallest query index
    first = where[np.argmin(where[:, -1])]
    q = q_offset + int(first[-1])
    b = [int(x) for x in first[:-1]]
    batch = "" if not b else f" (batch {b[0]})" if len(b) == 1 else f" (batch {tuple(b)})"
    raise ValueError(
        f"query {q}{batch} attends to no key under mask {mask!r}; every query must see at least one "
        f"key (its softmax would be undefined)"
    )
