"""Attention masks and score modifiers, in the style of JAX splash attention's lazy masks.

A mask is a small frozen object called as ``mask(q_idx, kv_idx) -> bool`` on broadcastable integer arrays, numpy or
jax (so the same object serves the host-side block classification in ``block_mask`` and the element mask inside a
kernel). Indices are absolute positions, queries and keys counted from the same origin. Masks combine with ``&`` and
``|``::

    mask = causal() & (sliding_window(1024) | global_tokens(4))
    mask = causal() & document(segment_ids)          # packed sequences, segment_ids [B, T]

Every mask except ``document`` is static (no arrays): equal masks compare and hash equal, so a block mask computed
from one is cached and shared by every layer. ``document`` holds per-batch segment ids; its output gains their
leading batch dims ([B, T, S] when evaluated on [T, 1] x [1, S] indices) and its block mask is computed per call.

A score mod is called as ``score_mod(score, q_idx, kv_idx, head) -> score`` after the q.k product (and scaling),
before masking and softmax. ``head`` is the query-head index, a scalar inside a kernel (one head per grid step) or a
broadcastable array such as ``arange(H)[:, None, None]`` in the reference path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _xp(*arrays):
    """jax.numpy if any argument is a jax array (or tracer), else numpy."""
    return jnp if any(isinstance(a, jax.Array) for a in arrays) else np


def _as_index(x):
    return x if isinstance(x, (jax.Array, np.ndarray)) else np.asarray(x)


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


# ----------------------------------------------------------------------------- masks


class Mask:
    """Base class: ``mask(q_idx, kv_idx)`` -> bool array of the broadcast shape (plus any leading batch dims)."""

    #: True when the mask holds no arrays; static masks are hashable by value and their block masks are cached.
    is_static: bool = True

    def __call__(self, q_idx, kv_idx):
        raise NotImplementedError

    def __and__(self, other: Mask) -> Mask:
        if not isinstance(other, Mask):
            return NotImplemented
        return And(_flatten(And, (self, other)))

    def __or__(self, other: Mask) -> Mask:
        if not isinstance(other, Mask):
            return NotImplemented
        return Or(_flatten(Or, (self, other)))


def _flatten(cls, masks) -> tuple[Mask, ...]:
    out: list[Mask] = []
    for m in masks:
        out.extend(m.masks if isinstance(m, cls) else (m,))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Full(Mask):
    """Every query sees every key (bidirectional attention)."""

    def __call__(self, q_idx, kv_idx):
        q_idx, kv_idx = _as_index(q_idx), _as_index(kv_idx)
        xp = _xp(q_idx, kv_idx)
        return xp.ones(np.broadcast_shapes(q_idx.shape, kv_idx.shape), dtype=bool)

    def __repr__(self):
        return "full()"


@dataclasses.dataclass(frozen=True)
class Causal(Mask):
    """kv_idx <= q_idx."""

    def __call__(self, q_idx, kv_idx):
        return _as_index(q_idx) >= _as_index(kv_idx)

    def __repr__(self):
        return "causal()"


@dataclasses.dataclass(frozen=True)
class SlidingWindow(Mask):
    """Causal, and the key is among the last ``window`` positions (the query's own included): 0 <= q - kv < window."""

    window: int

    def __call__(self, q_idx, kv_idx):
        d = _as_index(q_idx) - _as_index(kv_idx)
        return (d >= 0) & (d < self.window)

    def __repr__(self):
        return f"sliding_window({self.window})"


@dataclasses.dataclass(frozen=True)
class ChunkedCausal(Mask):
    """Causal within fixed chunks of ``chunk`` positions: kv <= q and q // chunk == kv // chunk."""

    chunk: int

    def __call__(self, q_idx, kv_idx):
        q_idx, kv_idx = _as_index(q_idx), _as_index(kv_idx)
        return (q_idx >= kv_idx) & (q_idx // self.chunk == kv_idx // self.chunk)

    def __repr__(self):
        return f"chunked_causal({self.chunk})"


@dataclasses.dataclass(frozen=True)
class PrefixLM(Mask):
    """Bidirectional over the first ``prefix_len`` keys, causal after: kv < prefix_len or kv <= q."""

    prefix_len: int

    def __call__(self, q_idx, kv_idx):
        q_idx, kv_idx = _as_index(q_idx), _as_index(kv_idx)
        return (kv_idx < self.prefix_len) | (q_idx >= kv_idx)

    def __repr__(self):
        return f"prefix_lm({self.prefix_len})"


@dataclasses.dataclass(frozen=True)
class GlobalTokens(Mask):
    """The first ``n`` positions are global: every query sees them and they see every key (kv < n or q < n).

    Symmetric on purpose, as in Longformer/BigBird. Combine with ``causal()`` (``causal() & global_tokens(n)`` is
    just causal) or, the usual case, ``causal() & (sliding_window(w) | global_tokens(n))`` for a local-plus-sink
    pattern. With n = 0 the mask is empty.
    """

    n: int

    def __call__(self, q_idx, kv_idx):
        q_idx, kv_idx = _as_index(q_idx), _as_index(kv_idx)
        return (kv_idx < self.n) | (q_idx < self.n)

    def __repr__(self):
        return f"global_tokens({self.n})"


@dataclasses.dataclass(frozen=True)
class And(Mask):
    masks: tuple[Mask, ...]

    @property
    def is_static(self):  # type: ignore[override]
        return all(m.is_static for m in self.masks)

    def __call__(self, q_idx, kv_idx):
        out = self.masks[0](q_idx, kv_idx)
        for m in self.masks[1:]:
            out = out & m(q_idx, kv_idx)
        return out

    def __repr__(self):
        return " & ".join(f"({m!r})" if isinstance(m, Or) else repr(m) for m in self.masks)


@dataclasses.dataclass(frozen=True)
class Or(Mask):
    masks: tuple[Mask, ...]

    @property
    def is_static(self):  # type: ignore[override]
        return all(m.is_static for m in self.masks)

    def __call__(self, q_idx, kv_idx):
        out = self.masks[0](q_idx, kv_idx)
        for m in self.masks[1:]:
            out = out | m(q_idx, kv_idx)
        return out

    def __repr__(self):
        return " | ".join(repr(m) for m in self.masks)  # & binds tighter than |: no parentheses needed


class Document(Mask):
    """Tokens attend only within their own document: q_segment_ids[..., q] == kv_segment_ids[..., kv].

    Segment ids are integer arrays [T] or [B, T] (numpy or jax); kv ids default to the q ids. Evaluated on [T, 1] x
    [1, S] indices the result is [B, T, S]. Equality and hashing go by content (a numpy copy is taken, read-only),
    but ``is_static`` is False: the block mask is recomputed for every call, not cached.
    """

    is_static = False

    def __init__(self, q_segment_ids, kv_segment_ids=None):
        def own(x):
            if isinstance(x, jax.Array):
                return x  # immutable already (and possibly a tracer inside a kernel)
            x = np.array(x, copy=True)
            x.setflags(write=False)
            return x

        q = own(q_segment_ids)
        kv = q if kv_segment_ids is None else own(kv_segment_ids)
        for name, ids in (("q_segment_ids", q), ("kv_segment_ids", kv)):
            if ids.ndim < 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
                raise ValueError(
                    f"document(): {name} must be an integer array [T] or [B, T], got {ids.dtype}{list(ids.shape)}"
                )
        if q.shape[:-1] != kv.shape[:-1]:
            raise ValueError(
                f"document(): q and kv segment ids have different batch dims: {list(q.shape)} vs {list(kv.shape)}"
            )
        object.__setattr__(self, "q_segment_ids", q)
        object.__setattr__(self, "kv_segment_ids", kv)

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __call__(self, q_idx, kv_idx):
        q_idx, kv_idx = _as_index(q_idx), _as_index(kv_idx)
        xp = _xp(q_idx, kv_idx, self.q_segment_ids, self.kv_segment_ids)
        q_ids, kv_ids = xp.asarray(self.q_segment_ids), xp.asarray(self.kv_segment_ids)
        return q_ids[..., q_idx] == kv_ids[..., kv_idx]

    def _key(self):
        def k(x):
            try:
                a = np.asarray(x)
            except Exception:  # a tracer: no content to hash
                return ("id", id(x))
            return (a.dtype.str, a.shape, a.tobytes())

        return k(self.q_segment_ids), k(self.kv_segment_ids)

    def __eq__(self, other):
        return isinstance(other, Document) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        def r(x):
            return f"{np.dtype(x.dtype).name}{list(x.shape)}"

        if self.kv_segment_ids is self.q_segment_ids:
            return f"document(<{r(self.q_segment_ids)}>)"
        return f"document(<{r(self.q_segment_ids)}>, <{r(self.kv_segment_ids)}>)"


class At(Mask):
    """A static mask evaluated at the tokens' own positions instead of their indices: ``mask(q_positions[q_idx],
    kv_positions[kv_idx])``. Why: a device that holds a slice of the sequence (context parallelism, sharding.context),
    possibly reordered for balance, numbers its tokens from 0 but the mask is about where they sit in the whole
    sequence. The positions are integer arrays [T] / [S] or [B, T] / [B, S] held as a Document pair, so kernels load
    their tiles as they load segment ids (kernel_mask) and need no change. Built by ``at_positions``."""

    is_static = False

    def __init__(self, mask: Mask, positions: Document):
        if not mask.is_static:
            raise ValueError(f"at_positions: {mask!r} holds arrays; only static masks are evaluated at positions")
        object.__setattr__(self, "mask", mask)
        object.__setattr__(self, "positions", positions)

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __call__(self, q_idx, kv_idx):
        q_idx, kv_idx = _as_index(q_idx), _as_index(kv_idx)
        p = self.positions
        xp = _xp(q_idx, kv_idx, p.q_segment_ids, p.kv_segment_ids)
        q_pos, kv_pos = xp.asarray(p.q_segment_ids)[..., q_idx], xp.asarray(p.kv_segment_ids)[..., kv_idx]
        return self.mask(q_pos, kv_pos)

    def __eq__(self, other):
        return isinstance(other, At) and self.mask == other.mask and self.positions == other.positions

    def __hash__(self):
        return hash((self.mask, self.positions))

    def __repr__(self):
        return f"at_positions({self.mask!r})"


def at_positions(mask: Mask, q_positions, kv_positions=None) -> Mask:
    """``mask`` with its static terms evaluated at the given token positions (At) and its document terms left on
    the tokens' indices, where their segment ids are. Static terms of one And / Or share one At, so a kernel loads
    one pair of position tiles for them."""
    positions = Document(q_positions, kv_positions)

    def walk(m):
        if m.is_static:
            return At(m, positions)
        if isinstance(m, (And, Or)):
            static = tuple(c for c in m.masks if c.is_static)
            rest = tuple(walk(c) for c in m.masks if not c.is_static)
            parts = ((At(static[0] if len(static) == 1 else type(m)(static), positions),) if static else ()) + rest
            return parts[0] if len(parts) == 1 else type(m)(parts)
        return m  # a document term: on indices

    return walk(mask)


def full() -> Mask:
    """Bidirectional: every query sees every key."""
    return Full()


def causal() -> Mask:
    """kv_idx <= q_idx."""
    return Causal()


def sliding_window(window: int) -> Mask:
    """Causal with a window of ``window`` keys, the query's own position included: 0 <= q - kv < window."""
    return SlidingWindow(_check_int("sliding_window: window", window, 1))


def chunked_causal(chunk: int) -> Mask:
    """Causal within chunks of ``chunk`` positions: kv <= q and q // chunk == kv // chunk."""
    return ChunkedCausal(_check_int("chunked_causal: chunk", chunk, 1))


def prefix_lm(prefix_len: int) -> Mask:
    """Bidirectional over the first ``prefix_len`` keys, causal elsewhere: kv < prefix_len or kv <= q."""
    return PrefixLM(_check_int("prefix_lm: prefix_len", prefix_len, 0))


def global_tokens(n: int) -> Mask:
    """The first ``n`` positions see and are seen by all: kv < n or q < n (see GlobalTokens)."""
    return GlobalTokens(_check_int("global_tokens: n", n, 0))


def document(segment_ids, kv_segment_ids=None) -> Mask:
    """Packed sequences: attend only within the same segment. ``segment_ids`` [T] or [B, T]."""
    return Document(segment_ids, kv_segment_ids)


# ----------------------------------------------------------------------------- score mods


class ScoreMod:
    """Base class: ``score_mod(score, q_idx, kv_idx, head) -> score`` (all broadcastable; numpy or jax).

    A mod may capture arrays (a learnable bias table, per-head slopes): ``arrays()`` lists them, ``with_arrays``
    rebuilds the mod around other values (what the kernels hand it), and it reads them through
    ``score_tables.head_lookup`` only. The kernels take them as inputs and return gradients to the float ones
    (``score_tables``)."""

    # True where the mod is the score plus a term that does not depend on it: its derivative in the score is 1,
    # so the backward passes skip the product by it (and a tile shortcut's branch yields no derivative tile)
    adds_to_score = False
    # True for an adding mod whose term takes a select per table entry: a chain adds it after the adding mods next to
    # it (terms commute), so that the positions those read are not held across its selects (sm_90: a T5 table before
    # learned slopes spilled 376 bytes in the Mosaic forward at head dim 128, after them 84)
    adds_late = False

    def __call__(self, score, q_idx, kv_idx, head=0):
        raise NotImplementedError

    def arrays(self) -> tuple:
        """The arrays this mod captures, each [H, ...] (first dim: the query head)."""
        return ()

    def with_arrays(self, arrays) -> ScoreMod:
        """This mod reading ``arrays`` (as many as ``arrays()``, in its order) instead of its own."""
        return self

    def tile_shortcut(self, q_first, q_last, kv_first, kv_last) -> tuple | None:
        """None, or (holds, cheaper): where the bool ``holds`` (traced from the bounds), the mod ``cheaper`` equals
        this one on every score of the tile of queries q_first..q_last and keys kv_first..kv_last. The kernels take
        it per tile: a mod that looks up a table costs a select per entry per score, while far from the diagonal
        T5's bias reads one entry (``score_tables``)."""
        return None

    @property
    def output_derivative(self):
        """None, or a function of the mod's output (the modded score) that gives d mod / d score: a backward kernel
        that has the probabilities rebuilds the modded score, hence the derivative, from them where it needs it
        instead of holding a derivative tile in registers across its products."""
        return None


@dataclasses.dataclass(frozen=True)
class SoftCap(ScoreMod):
    """cap * tanh(score / cap) (Gemma 2 / Grok logit soft-capping)."""

    cap: float

    def __call__(self, score, q_idx, kv_idx, head=0):
        xp = _xp(score)
        return self.cap * xp.tanh(score / self.cap)

    @property
    def output_derivative(self):
        def derivative(out):  # 1 - tanh^2; the clip keeps a rebuilt -inf (a masked score) at 0
            xp = _xp(out)
            return 1.0 - xp.square(xp.clip(out / self.cap, -1.0, 1.0))

        return derivative

    def __repr__(self):
        return f"soft_cap({self.cap})"


@dataclasses.dataclass(frozen=True)
class Alibi(ScoreMod):
    """score - slopes[head] * (q_idx - kv_idx) (Press et al. 2022, "Train Short, Test Long").

    Meant for causal masks, where q - kv >= 0 is the distance; keys after the query would get a bonus.
    """

    adds_to_score = True

    slopes: tuple[float, ...]

    def __call__(self, score, q_idx, kv_idx, head=0):
        q_idx, kv_idx, head = _as_index(q_idx), _as_index(kv_idx), _as_index(head)
        xp = _xp(score, q_idx, kv_idx, head)
        if head.ndim == 0:  # one head (inside a kernel): a select chain, since kernels cannot capture an array
            slope = xp.asarray(0.0, dtype=score.dtype)
            for i, s in enumerate(self.slopes):
                slope = xp.where(head == i, xp.asarray(s, dtype=score.dtype), slope)
        else:
            slope = xp.asarray(self.slopes, dtype=score.dtype)[head]
        return score - slope * (q_idx - kv_idx).astype(score.dtype)

    def __repr__(self):
        return f"alibi({list(self.slopes)})"


@dataclasses.dataclass(frozen=True)
class Chain(ScoreMod):
    """Apply several score mods in order."""

    mods: tuple[ScoreMod, ...]

    @property
    def adds_to_score(self) -> bool:
        return all(m.adds_to_score for m in self.mods)

    def __call__(self, score, q_idx, kv_idx, head=0):
        for i in self.order():
            score = self.mods[i](score, q_idx, kv_idx, head)
        return score

    def order(self) -> list[int]:
        """The indices of the mods in the order they apply: within each run of adding mods, the ones that add late
        (``adds_late``) last."""
        out, run = [], []
        for i, m in enumerate(self.mods):
            if m.adds_to_score:
                run.append(i)
                continue
            out += sorted(run, key=lambda r: self.mods[r].adds_late) + [i]
            run = []
        return out + sorted(run, key=lambda r: self.mods[r].adds_late)

    def arrays(self) -> tuple:
        return tuple(a for m in self.mods for a in m.arrays())

    def with_arrays(self, arrays) -> ScoreMod:
        arrays, mods = tuple(arrays), []
        for m in self.mods:
            n = len(m.arrays())
            mods.append(m.with_arrays(arrays[:n]))
            arrays = arrays[n:]
        return Chain(tuple(mods))

    def tile_shortcut(self, q_first, q_last, kv_first, kv_last) -> tuple | None:
        cuts = [m.tile_shortcut(q_first, q_last, kv_first, kv_last) for m in self.mods]
        if all(c is None for c in cuts):
            return None
        holds = functools.reduce(lambda a, b: a & b, [c[0] for c in cuts if c is not None])
        return holds, Chain(tuple(m if c is None else c[1] for m, c in zip(self.mods, cuts)))

    @property
    def output_derivative(self):
        *first, last = self.mods  # terms added before the last mod leave its derivative a function of the output
        return last.output_derivative if all(m.adds_to_score for m in first) else None

    def __repr__(self):
        return f"chain({', '.join(map(repr, self.mods))})"


def soft_cap(cap: float) -> ScoreMod:
    """cap * tanh(score / cap)."""
    if not cap > 0:
        raise ValueError(f"soft_cap: cap must be > 0, got {cap!r}")
    return SoftCap(float(cap))


def alibi(slopes: Sequence[float]) -> ScoreMod:
    """score - slopes[head] * (q_idx - kv_idx); one slope per query head."""
    slopes = tuple(float(s) for s in np.asarray(slopes, dtype=np.float64).reshape(-1))
    if not slopes:
        raise ValueError("alibi: need at least one slope")
    return Alibi(slopes)


def alibi_slopes(num_heads: int) -> tuple[float, ...]:
    """The ALiBi paper's slopes: 2^(-8 i / n) for i = 1..n when n is a power of two; otherwise those of the power of
    two below n, then every other slope of the power of two above (as in the paper's reference code)."""
    num_heads = _check_int("alibi_slopes: num_heads", num_heads, 1)

    def pow2(n):
        return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]

    p = 2 ** math.floor(math.log2(num_heads))
    extra = pow2(2 * p)[0::2][: num_heads - p]
    return tuple(pow2(p) + extra)


def chain(*mods: ScoreMod) -> ScoreMod:
    """Compose score mods, applied left to right."""
    if not mods or not all(isinstance(m, ScoreMod) for m in mods):
        raise ValueError(f"chain: expected one or more ScoreMods, got {mods!r}")
    return mods[0] if len(mods) == 1 else Chain(tuple(mods))
