"""Score mods that capture arrays (FlexAttention's captured buffers): T5's relative-position bias table and learnable
ALiBi slopes, and what the kernels do to take such arrays as inputs and return their gradients.

Every captured array is [H, ...], one row per query head, float, and its row is small (``MAX_ROW`` entries). A
kernel program works on one head, so it loads that head's row as scalars (a ``HeadRow``) and the mod reads entries
with ``head_lookup``: inside a kernel a select chain over the row (kernels cannot gather from registers), elsewhere
an indexing gather. The gradient to a row is the vjp of the mod in those scalars: a sum of dS per entry, per tile.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from .masks import Chain, ScoreMod

MAX_ROW = 64  # entries per head a kernel reads as scalars: each costs a select per score, a sum per tile (backward)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class HeadRow:
    """One head's row of a captured array inside a kernel: its entries as float32 scalars (row-major)."""

    values: tuple
    shape: tuple[int, ...]

    def tree_flatten(self):
        return self.values, self.shape

    @classmethod
    def tree_unflatten(cls, shape, values):
        return cls(tuple(values), shape)


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """A captured array's shape and dtype: what stands for it in the kernels' static (hashable) description."""

    shape: tuple[int, ...]
    dtype: str


def add_lookup(score, array, head, index):
    """``score + head_lookup(array, head, index)``; inside a kernel each entry is added where the index takes it, so
    no tile of looked-up values is live beside the scores (on Mosaic GPU that tile spilled registers)."""
    if not isinstance(array, HeadRow):
        return score + head_lookup(array, head, index).astype(score.dtype)
    for i, value in enumerate(array.values):
        score = jnp.where(index == i, score + value.astype(score.dtype), score)
    return score


def head_lookup(array, head, index=None):
    """``array[head]`` (a per-head value), or ``array[head, index]`` for an int array ``index`` of positions in a
    1-D row, broadcasting against the scores; inside a kernel ``array`` is this program's HeadRow."""
    if isinstance(array, HeadRow):
        if index is None:
            return array.values[0]
        if isinstance(index, int):
            return array.values[index]
        out = jnp.zeros(jnp.shape(index), jnp.float32)
        for i, value in enumerate(array.values):
            out = jnp.where(index == i, value, out)
        return out
    array, head = jnp.asarray(array, jnp.float32), jnp.asarray(head)
    return array[head] if index is None else array[head, index]


# ----------------------------------------------------------------------------- the mods


@dataclasses.dataclass(frozen=True)
class RelativeBias(ScoreMod):
    """score + table[head, bucket(kv_idx - q_idx)]: T5's learned relative-position bias (Raffel et al. 2020), its
    buckets exact for distances under half of them (a quarter when bidirectional), logarithmic up to
    ``max_distance``."""

    table: Any  # [H, num_buckets]
    bidirectional: bool
    max_distance: int
    adds_to_score = True
    adds_late = True

    def __call__(self, score, q_idx, kv_idx, head=0):
        bucket = relative_bucket(kv_idx - q_idx, self.table.shape[-1], self.bidirectional, self.max_distance)
        return add_lookup(score, self.table, head, bucket)

    def arrays(self) -> tuple:
        return (self.table,)

    def with_arrays(self, arrays) -> ScoreMod:
        return dataclasses.replace(self, table=arrays[0])

    def tile_shortcut(self, q_first, q_last, kv_first, kv_last):
        """Keys ``max_distance`` or more from every query of the tile all take the last bucket of their side (and
        when not bidirectional, keys at or after every query bucket 0): one entry for the tile."""
        n = self.table.shape[-1]
        far_past = q_first - kv_last >= self.max_distance
        if self.bidirectional:
            far_future = kv_first - q_last >= self.max_distance
            return far_past | far_future, TableEntry(self.table, (n - 1, n // 2 - 1), far_future)
        not_past = kv_first - q_last >= 0
        return far_past | not_past, TableEntry(self.table, (n - 1, 0), far_past)

    def __repr__(self):
        shape, args = list(self.table.shape), f"bidirectional={self.bidirectional}, max_distance={self.max_distance}"
        return f"relative_bias({shape}, {args})"


@dataclasses.dataclass(frozen=True)
class TableEntry(ScoreMod):
    """score + table[head, entries[0] where ``first`` else entries[1]]: a table mod on a tile where every score
    reads the same entry (``RelativeBias.tile_shortcut``), one scalar add per score instead of a select per entry.
    The two candidates are static and ``first`` a traced bool (a traced index compared in a kernel's branch did not
    lower to Triton)."""

    table: Any  # [H, n]
    entries: tuple[int, int]
    first: Any  # bool scalar
    adds_to_score = True
    adds_late = True  # it reads no positions: added after the mods that do, theirs are free sooner

    def __call__(self, score, q_idx, kv_idx, head=0):
        a, b = (jnp.asarray(head_lookup(self.table, head, e)) for e in self.entries)
        return score + jnp.where(self.first, a, b).astype(score.dtype)

    def arrays(self) -> tuple:
        return (self.table,)

    def with_arrays(self, arrays) -> ScoreMod:
        return dataclasses.replace(self, table=arrays[0])


@dataclasses.dataclass(frozen=True)
class LearnedAlibi(ScoreMod):
    """score - slopes[head] * (q_idx - kv_idx) with the slopes an array [H] (ALiBi whose slopes train)."""

    slopes: Any  # [H]
    adds_to_score = True

    def __call__(self, score, q_idx, kv_idx, head=0):
        slope = head_lookup(self.slopes, head).astype(score.dtype)
        return score + slope * jnp.asarray(kv_idx - q_idx).astype(score.dtype)  # kv - q: the tile relative_bias reads

    def arrays(self) -> tuple:
        return (self.slopes,)

    def with_arrays(self, arrays) -> ScoreMod:
        return dataclasses.replace(self, slopes=arrays[0])

    def __repr__(self):
        return f"learned_alibi({list(self.slopes.shape)})"


def relative_bucket(relative, num_buckets: int, bidirectional: bool, max_distance: int):
    """T5's bucket of each relative position kv - q (int32, broadcastable)."""
    relative = jnp.asarray(relative, jnp.int32)
    bucket = jnp.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + jnp.where(relative > 0, num_buckets, 0)
        distance = jnp.abs(relative)
    else:
        distance = jnp.maximum(-relative, 0)
    exact = num_buckets // 2
    ratio = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / exact) / math.log(max_distance / exact)
    large = jnp.minimum(exact + (ratio * (num_buckets - exact)).astype(jnp.int32), num_buckets - 1)
    return bucket + jnp.where(distance < exact, distance, large)


def relative_bias(table, *, bidirectional: bool = False, max_distance: int = 128) -> ScoreMod:
    """score + table[head, bucket(kv - q)]; ``table`` [H, num_buckets] (T5: 32 buckets, max distance 128; decoders
    are not bidirectional)."""
    shape = jnp.shape(table)
    smallest = 4 if bidirectional else 2
    if len(shape) != 2 or shape[1] < smallest:
        raise ValueError(f"relative_bias: table must be [heads, num_buckets >= {smallest}], got shape {list(shape)}")
    exact = (shape[1] // 2 if bidirectional else shape[1]) // 2
    if not isinstance(max_distance, int) or max_distance <= exact:
        raise ValueError(
            f"relative_bias: max_distance must be an int above the exact buckets ({exact}), got {max_distance!r}"
        )
    return RelativeBias(_float_array("relative_bias", table), bool(bidirectional), max_distance)


def learned_alibi(slopes) -> ScoreMod:
    """score - slopes[head] * (q - kv); ``slopes`` [H] (``alibi_slopes(H)`` is the paper's start)."""
    if len(jnp.shape(slopes)) != 1:
        raise ValueError(f"learned_alibi: slopes must be [heads], got shape {list(jnp.shape(slopes))}")
    return LearnedAlibi(_float_array("learned_alibi", slopes))


def _float_array(name: str, x):
    x = x if isinstance(x, jax.Array) else jnp.asarray(np.asarray(x, np.float32))
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}: the array must be floating (it is learnable), got {x.dtype}")
    return x


# ----------------------------------------------------------------------------- what the kernels do with them


def split_arrays(name: str, score_mod: ScoreMod | None, heads: int) -> tuple[ScoreMod | None, tuple]:
    """(the mod with ArraySpecs for its arrays: hashable, for a kernel's static description; its arrays [H, n]).
    Raises ValueError naming ``name`` for arrays the kernels cannot take."""
    arrays = score_mod.arrays() if score_mod is not None else ()
    if not arrays:
        return score_mod, ()
    flat = []
    for a in arrays:
        shape = tuple(jnp.shape(a))
        if not shape or shape[0] != heads:
            raise ValueError(f"{name}: a score mod's array {list(shape)} must have one row per query head ({heads})")
        if not jnp.issubdtype(jnp.result_type(a), jnp.floating):
            raise ValueError(f"{name}: a score mod's arrays must be floating, got {jnp.result_type(a)}")
        if math.prod(shape[1:]) > MAX_ROW:
            raise ValueError(f"{name}: a score mod's array rows hold at most {MAX_ROW} entries, got {list(shape)}")
        flat.append(jnp.reshape(a, (heads, -1)).astype(jnp.float32))
    specs = tuple(ArraySpec(tuple(jnp.shape(a)), str(jnp.result_type(a))) for a in arrays)
    return score_mod.with_arrays(specs), tuple(flat)


def bind_shapes(static_mod: ScoreMod, flat) -> tuple:
    """The [H, n] arrays ``split_arrays`` returned, back in the shapes the mod captured (for paths that gather)."""
    return tuple(jnp.reshape(a, spec.shape) for spec, a in zip(static_mod.arrays(), flat))


def load_rows(static_mod: ScoreMod, refs, head) -> tuple[HeadRow, ...]:
    """This head's rows of the captured arrays from their [H, n] refs, as scalars."""
    specs = static_mod.arrays()
    return tuple(
        HeadRow(tuple(ref[head, i] for i in range(math.prod(spec.shape[1:]))), spec.shape[1:])
        for spec, ref in zip(specs, refs)
    )


PACKED_ALIGN = 32  # entries: a packed row is whole 128-byte pieces (a warpgroup copy moves a multiple of 128 bytes)


def packed_width(flat) -> int:
    """Entries of one head's packed row (``pack_rows``): every array's row, rounded up to ``PACKED_ALIGN``."""
    return packed_entries(sum(math.prod(jnp.shape(a)[1:]) for a in flat))


def packed_entries(n: int) -> int:
    """``n`` entries rounded up to ``PACKED_ALIGN``: a packed row's width."""
    return -(-n // PACKED_ALIGN) * PACKED_ALIGN


def pack_rows(flat):
    """The [H, n] arrays ``split_arrays`` returned as one [H, packed_width] float32 array, zero past them: a kernel
    copies its head's row of it to shared memory in one piece (the Mosaic GPU kernels)."""
    packed = jnp.concatenate([jnp.reshape(a, (a.shape[0], -1)) for a in flat], axis=1).astype(jnp.float32)
    return jnp.pad(packed, ((0, 0), (0, packed_width(flat) - packed.shape[1])))


def packed_rows(static_mod: ScoreMod, row_ref) -> tuple[HeadRow, ...]:
    """The head's rows of the captured arrays as scalars, read from its packed row ``row_ref`` [packed_width]."""
    rows, at = [], 0
    for spec in static_mod.arrays():
        n = math.prod(spec.shape[1:])
        rows.append(HeadRow(tuple(row_ref[at + i] for i in range(n)), spec.shape[1:]))
        at += n
    return tuple(rows)


def row_grads(static_mod: ScoreMod, rows, s, q_pos, kv_pos, head, ds, tile=None) -> tuple[HeadRow, ...]:
    """d loss / d rows for one tile: the vjp of the mod in the rows' scalars, ``ds`` = d loss / d (modded scores).
    ``tile`` (q_first, q_last, kv_first, kv_last) lets the mod's ``tile_shortcut`` take the tile."""

    def grads(mod_of):
        _, vjp = jax.vjp(lambda rows: mod_of(rows)(s, q_pos, kv_pos, head), rows)
        # entries the mod leaves at zero are literals, which Triton's branch cannot yield
        return jax.tree.map(lambda g, r: g + 0.0 * r, vjp(ds)[0], rows)

    return _shortcut(static_mod, tile, grads)


def add_row_grads_per_row(static_mod: ScoreMod, rows, s, q_pos, kv_pos, head, ds, acc, add, tile=None):
    """``acc`` with d loss / d rows for one tile added per row of the tile: ``add(acc, i, vector)`` adds entry i's
    gradient summed over the tile's columns only, a [rows] vector like ``ds.sum(axis=1)`` (Mosaic GPU reduces one
    axis of a tile at a time, never a tile to a scalar across warps; the rows are summed outside the kernel).
    ``rows`` and the positions may be functions that make them, inside the shortcut's branch.

    Forward mode, an entry at a time: a vjp computes every entry's compare tile before it transposes the first (on
    Mosaic GPU 11 KB of spills for a T5 table); the jvp of one entry uses its compare at once, and the selects of
    the other entries see the same tangent on both sides and fold away."""

    def grads(mod_of):
        values, q, kv = (x() if callable(x) else x for x in (rows, q_pos, kv_pos))
        flat, tree = jax.tree.flatten(values)
        out = acc
        for i in _entries_in_order(static_mod):
            x = flat[i]

            def with_entry(x_i, i=i):
                return mod_of(jax.tree.unflatten(tree, [*flat[:i], x_i, *flat[i + 1 :]]))(s, q, kv, head)

            if _reads(with_entry, x):  # a shortcut's mod reads one or two entries
                _, d_entry = jax.jvp(with_entry, (x,), (jnp.ones_like(x),))
                out = add(out, i, (ds * d_entry).sum(axis=1))
        return out

    return _shortcut(static_mod, tile, grads)


def added_part(static_mod: ScoreMod):
    """The mod's leading part that adds terms to the score and holds every captured array, where the rest acts on
    the score elementwise after it: the mod itself when it only adds, a chain's leading adding mods when the later
    ones capture no arrays (table and slopes, then a soft-cap); else None. d loss / d arrays is then the adding
    part's vjp at d loss / d (score before the rest)."""
    if static_mod.adds_to_score:
        return static_mod
    if not isinstance(static_mod, Chain):
        return None
    mods = static_mod.mods
    lead = next((i for i, m in enumerate(mods) if not m.adds_to_score), len(mods))
    if lead == 0 or any(m.arrays() for m in mods[lead:]):
        return None
    return mods[0] if lead == 1 else Chain(tuple(mods[:lead]))


def _entries_in_order(static_mod: ScoreMod) -> list[int]:
    """The indices of the mod's entries (its arrays' rows, flattened in ``arrays()`` order) in the order its mods
    apply (``Chain.order``): the gradients of the entries whose mods read the positions come first, so the
    positions are free sooner (sm_90, dQ with a T5 table and learned slopes at head dim 128: 464 bytes of spills with
    the table's entries first, 200 with the slopes' first)."""
    mods = static_mod.mods if isinstance(static_mod, Chain) else (static_mod,)
    ranges, at = [], 0
    for m in mods:
        ranges.append(range(at, at + row_entries(m)))
        at += row_entries(m)
    order = static_mod.order() if isinstance(static_mod, Chain) else [0]
    return [i for k in order for i in ranges[k]]


def _reads(fn, x) -> bool:
    """Whether ``fn(x)`` depends on ``x`` at all (its jvp would be zeros, multiplied and summed for nothing)."""
    jaxpr = jax.make_jaxpr(fn)(x).jaxpr
    live = set(jaxpr.invars)

    def used(atoms):
        return any(not isinstance(v, jax.extend.core.Literal) and v in live for v in atoms)

    for eqn in jaxpr.eqns:
        if used(eqn.invars):
            live.update(eqn.outvars)
    return used(jaxpr.outvars)


def _shortcut(static_mod: ScoreMod, tile, grads):
    """``grads(mod_of)`` for the mod, or on a tile where the mod's ``tile_shortcut`` holds for its cheaper mod
    (``mod_of``: the mod with given arrays)."""
    cut = static_mod.tile_shortcut(*tile) if tile is not None else None
    if cut is None:
        return grads(static_mod.with_arrays)
    return jax.lax.cond(cut[0], lambda: grads(cut[1].with_arrays), lambda: grads(static_mod.with_arrays))


def row_entries(static_mod: ScoreMod | None) -> int:
    """Entries in one head's rows of the mod's captured arrays (0 without any)."""
    return sum(math.prod(spec.shape[1:]) for spec in static_mod.arrays()) if static_mod is not None else 0


def rows_as_vector(rows, width: int, leading: tuple[int, ...] = ()):
    """The rows' entries, concatenated, as one float32 vector [*leading, width] (zero past them): what a program
    writes (``leading`` (1,): a TPU kernel's vectors are 2-D)."""
    values = [v for row in rows for v in row.values]
    lane = jax.lax.broadcasted_iota(jnp.int32, (*leading, width), len(leading))
    out = jnp.zeros((*leading, width), jnp.float32)
    for i, v in enumerate(values):
        out = jnp.where(lane == i, v, out)
    return out


def vector_as_grads(partials_BHPW, flat) -> tuple:
    """Per-program (or per-row) gradient vectors [B, H, programs, width] summed over batch rows and programs, split
    into the gradients of the [H, n] arrays ``flat`` (``split_arrays``')."""
    total = partials_BHPW.sum(axis=(0, 2))  # [H, width]
    out, at = [], 0
    for a in flat:
        n = math.prod(jnp.shape(a)[1:])
        out.append(total[:, at : at + n].reshape(jnp.shape(a)).astype(jnp.result_type(a)))
        at += n
    return tuple(out)
