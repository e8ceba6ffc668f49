"""Block-sparse structure of a mask: which (q-block, kv-block) tiles are empty, partial or full.

``make_block_mask(mask, q_len, kv_len, BlockSizes(block_q, block_kv))`` evaluates the mask on the host with numpy,
one q-block row ([block_q, kv_len]) at a time, so memory stays O(block_q * kv_len) even at 32k x 32k. Kernels
iterate a q-block row over ``kv_block_indices[i, :kv_block_counts[i]]`` only, and apply the element mask only where
``kind`` is PARTIAL; the dK/dV pass iterates kv-block columns over ``q_block_indices`` the same way.

Static masks (everything but ``document``) are cached by value: every layer, and every step, gets the identical
``BlockMask``. Document masks carry per-batch arrays and are recomputed per call, with a leading batch dim on every
array.
"""

from __future__ import annotations

import dataclasses
import functools

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
    """Block classification of ``mask`` over a [q_len, kv_len] score matrix. Arrays are read-only numpy.

    Shapes carry the mask's leading batch dims ``(B,)`` (none for static masks):
      kind              int8  [(B,) nq, nkv]   EMPTY / PARTIAL / FULL
      kv_block_indices  int32 [(B,) nq, max_kv] non-empty kv blocks of each q-block row, increasing, padded with
                                                the row's last valid index (0 if it has none) so a kernel can clamp
      kv_block_counts   int32 [(B,) nq]
      q_block_indices   int32 [(B,) nkv, max_q] the transpose: non-empty q blocks of each kv-block column
      q_block_counts    int32 [(B,) nkv]        (may be 0: keys no query sees, e.g. causal with q_len < kv_len)
    """

    mask: Mask
    q_len: int
    kv_len: int
    block_sizes: BlockSizes
    kind: np.ndarray
    kv_block_indices: np.ndarray
    kv_block_counts: np.ndarray
    q_block_indices: np.ndarray
    q_block_counts: np.ndarray

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return self.kind.shape[:-2]

    @property
    def num_q_blocks(self) -> int:
        return self.kind.shape[-2]

    @property
    def num_kv_blocks(self) -> int:
        return self.kind.shape[-1]

    @property
    def density(self) -> float:
        """Fraction of non-empty blocks (the share of the dense work a block-sparse kernel does)."""
        return float(np.mean(self.kind != EMPTY))

    def dense(self) -> np.ndarray:
        """The element-wise bool mask [(B,) q_len, kv_len], for tests and the reference path."""
        q = np.arange(self.q_len, dtype=np.int32)[:, None]
        kv = np.arange(self.kv_len, dtype=np.int32)[None, :]
        return np.broadcast_to(np.asarray(self.mask(q, kv), dtype=bool), (*self.batch_shape, self.q_len, self.kv_len))

    def __repr__(self):
        return (f"BlockMask({self.mask!r}, q_len={self.q_len}, kv_len={self.kv_len}, {self.block_sizes}, "
                f"batch_shape={self.batch_shape}, density={self.density:.3f})")


def make_block_mask(mask: Mask, q_len: int, kv_len: int, block_sizes: BlockSizes = BlockSizes()) -> BlockMask:
    """Classify every (q-block, kv-block) tile of ``mask`` and list the non-empty ones; cached for static masks.

    Raises ValueError if q_len / kv_len are not multiples of the block sizes (pad the sequence first), or if some
    query attends to no key (its softmax would be undefined).
    """
    if not isinstance(mask, Mask):
        raise TypeError(f"make_block_mask: expected a Mask, got {type(mask).__name__}")
    if not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"make_block_mask: expected BlockSizes, got {type(block_sizes).__name__}")
    for name, n, b, bname in (("q_len", q_len, block_sizes.block_q, "block_q"),
                              ("kv_len", kv_len, block_sizes.block_kv, "block_kv")):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"make_block_mask: {name} must be a positive integer, got {n!r}")
        if n % b:
            raise ValueError(f"make_block_mask: {name}={n} is not a multiple of {bname}={b}; pad the sequence or "
                             f"pick a block size that divides it")
    q_len, kv_len = int(q_len), int(kv_len)
    if mask.is_static:
        return _cached(mask, q_len, kv_len, block_sizes)
    return _build(mask, q_len, kv_len, block_sizes)


@functools.lru_cache(maxsize=256)
def _cached(mask: Mask, q_len: int, kv_len: int, block_sizes: BlockSizes) -> BlockMask:
    return _build(mask, q_len, kv_len, block_sizes)


make_block_mask.cache_clear = _cached.cache_clear  # type: ignore[attr-defined]
make_block_mask.cache_info = _cached.cache_info  # type: ignore[attr-defined]


def _build(mask: Mask, q_len: int, kv_len: int, bs: BlockSizes) -> BlockMask:
    bq, bkv = bs.block_q, bs.block_kv
    nq, nkv = q_len // bq, kv_len // bkv
    kv = np.arange(kv_len, dtype=np.int32)[None, :]
    rows = []
    for i in range(nq):
        q = np.arange(i * bq, (i + 1) * bq, dtype=np.int32)[:, None]
        m = np.asarray(mask(q, kv), dtype=bool)
        m = np.broadcast_to(m, (*m.shape[:-2], bq, kv_len))
        seen = m.any(axis=-1)  # [..., bq]
        if not seen.all():
            _raise_empty_row(mask, seen, i * bq)
        tiles = m.reshape(*m.shape[:-2], bq, nkv, bkv)
        any_, all_ = tiles.any(axis=(-3, -1)), tiles.all(axis=(-3, -1))  # [..., nkv]
        rows.append(np.where(all_, FULL, np.where(any_, PARTIAL, EMPTY)).astype(np.int8))
    batch = np.broadcast_shapes(*(r.shape[:-1] for r in rows))
    kind = np.stack([np.broadcast_to(r, (*batch, nkv)) for r in rows], axis=-2)

    nonempty = kind != EMPTY
    kv_idx, kv_cnt = _compact(nonempty)
    q_idx, q_cnt = _compact(np.swapaxes(nonempty, -1, -2))
    arrays = [np.ascontiguousarray(a) for a in (kind, kv_idx, kv_cnt, q_idx, q_cnt)]
    for a in arrays:
        a.setflags(write=False)
    return BlockMask(mask, q_len, kv_len, bs, *arrays)


def _compact(nonempty: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of a bool [..., r, c]: the True columns in increasing order, padded with the last one (or 0)."""
    counts = nonempty.sum(axis=-1).astype(np.int32)
    width = max(1, int(counts.max(initial=0)))
    order = np.argsort(~nonempty, axis=-1, kind="stable")[..., :width].astype(np.int32)
    last = np.take_along_axis(order, np.maximum(counts - 1, 0)[..., None], axis=-1)
    last = np.where(counts[..., None] > 0, last, 0)
    idx = np.where(np.arange(width) < counts[..., None], order, last).astype(np.int32)
    return idx, counts


def _raise_empty_row(mask: Mask, seen: np.ndarray, q_offset: int):
    where = np.argwhere(~seen)  # rows [..., q] in C order; pick the smallest query index
    first = where[np.argmin(where[:, -1])]
    q = q_offset + int(first[-1])
    b = [int(x) for x in first[:-1]]
    batch = "" if not b else f" (batch {b[0]})" if len(b) == 1 else f" (batch {tuple(b)})"
    raise ValueError(f"query {q}{batch} attends to no key under mask {mask!r}; every query must see at least one "
                     f"key (its softmax would be undefined)")
