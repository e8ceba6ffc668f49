"""What the Mosaic GPU attention kernels (the forward, dQ, dK/dV) share: where a program's work lies (its block
line, its place among resident CTAs), the producer warpgroup's ring of TMA loads, the consumers' products, the
document / position ids they load, and what differs in the Mosaic GPU interpreter. Each kernel's own math lives in
``mosaic_attention`` (the forward), ``mosaic_attention_bwd`` (dQ) and ``mosaic_attention_dkv`` (dK/dV).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .kernel_inputs import head_rows
from .kernel_mask import DocumentSlot, PositionSlot
from .masks import And, Or


def id_slots(mask) -> int:
    """How many id arrays (document / position slots) a template loads."""
    if isinstance(mask, (DocumentSlot, PositionSlot)):
        return mask.index + 1
    if isinstance(mask, (And, Or)):
        return max((id_slots(m) for m in mask.masks), default=0)
    return 0


def vary_like(out, x):
    """``out`` marked as varying over the manual mesh axes ``x`` varies over: a Mosaic GPU kernel's results come
    back without them (jax 0.10), and inside shard_map a custom_vjp's gradients must match its inputs' types."""
    missing = tuple(sorted(jax.typeof(x).mat.varying - jax.typeof(out).mat.varying))
    return jax.lax.pcast(out, missing, to="varying") if missing else out


class BlockList:
    """One row (or column) of the block mask as a kernel walks it in tiles of ``tile`` (a block is ``block`` long):
    how many tiles, how many of them PARTIAL (they come first), and where tile j starts."""

    def __init__(self, idx_ref, np_ref, cnt_ref, bm, line, block: int, tile: int):
        self.idx_ref, self.bm, self.line, self.block, self.tile = idx_ref, bm, line, block, tile
        self.sub = block // tile  # tiles per block
        self.count = cnt_ref[bm, line] * self.sub
        self.partial = np_ref[bm, line] * self.sub

    def start(self, j):
        return self.idx_ref[self.bm, self.line, lax.div(j, self.sub)] * self.block + lax.rem(j, self.sub) * self.tile


def program_line(order_ref, bm, prog, rows: int, block: int):
    """(the block line program ``prog`` of a kernel walks, its first row): lines in ``kernel_inputs.heavy_first``
    order (``order_ref`` [Bm, lines]), ``rows`` rows a program, ``block`` rows a line (a line may take several
    programs, in index order)."""
    per_line = block // rows
    if per_line == 1:
        line = order_ref[bm, prog]
        return line, line * block
    line = order_ref[bm, lax.div(prog, per_line)]
    return line, line * block + lax.rem(prog, per_line) * rows


class Programs:
    """A kernel's programs, (head, line, batch row) over a grid of ``heads`` x ``lines`` x ``batch``: a CTA each
    (grid axes named ``names``), or with ``ctas`` > 0 that many resident CTAs, each taking every ctas-th program in
    the grid's order (heads fastest) and running its rings on from one into the next (``MosaicTiles.ctas``)."""

    def __init__(self, ctas: int, heads: int, lines: int, batch: int, names: tuple[str, str, str]):
        self.ctas = min(ctas, heads * lines * batch)
        self.heads, self.lines, self.batch, self.names = heads, lines, batch, names

    @property
    def grid(self) -> dict:
        """``plgpu.kernel``'s grid and grid_names."""
        if self.ctas:
            return {"grid": (self.ctas,), "grid_names": ("cta",)}
        return {"grid": (self.heads, self.lines, self.batch), "grid_names": self.names}

    def at(self, i):
        """(head, line, batch row) of this CTA's i-th program: the grid's own, or i x ctas programs on."""
        if not self.ctas:
            return tuple(lax.axis_index(n) for n in self.names)
        n = lax.axis_index("cta") + i * self.ctas
        return lax.rem(n, self.heads), lax.rem(lax.div(n, self.heads), self.lines), lax.div(n, self.heads * self.lines)

    def over(self, body):
        """``body(i, g)`` for each of this CTA's programs, ``g`` the ring steps before it (it returns g plus its own);
        the steps of all of them."""
        if not self.ctas:
            return body(0, jnp.int32(0))
        total = self.heads * self.lines * self.batch
        mine = lax.div(total - lax.axis_index("cta") + self.ctas - 1, self.ctas)  # every ctas-th from its index on
        return lax.fori_loop(0, mine, body, jnp.int32(0))

    def offset(self, g):
        """``stream``'s offset: the ring steps before a program, where the ring runs on across programs."""
        return g if self.ctas else None


def over_tiles(static, step, n_partial, n_tiles, carry, padding_matters: bool = True):
    """A kernel's loop over its row's (or column's) tiles: ``step(j, carry, masked)`` on the PARTIAL ones, which
    come first, then on the FULL ones. Where ``static.masks_nothing`` no tile is PARTIAL, and where the kernel's
    result does not depend on masking padding (not ``padding_matters``) and padding is all the mask cuts
    (``static.masks_padding_only``), PARTIAL tiles take the FULL ones' path: either way the masked loop is not
    built. Its code alone, never run, cost the Mosaic GPU dK/dV registers (sm_90, head dim 64: 120 bytes of
    spills)."""
    if static.masks_nothing or (static.masks_padding_only and not padding_matters):
        return lax.fori_loop(0, n_tiles, functools.partial(step, masked=False), carry)
    carry = lax.fori_loop(0, n_partial, functools.partial(step, masked=True), carry)
    return lax.fori_loop(n_partial, n_tiles, functools.partial(step, masked=False), carry)


def fresh_zero(tile_first):
    """0, from a step's tile start (>= 0, read off the block list): a resident tile indexed with it (``ref.at[wg +
    zero]``) gets its wgmma descriptors made anew each step, a few integer adds, instead of held across the loop, one
    64-bit register pair per k-step of 16. The held descriptors took the registers that spilled (sm_90 ptxas, B 2,
    T 1024: the backward at head dim 256, one consumer warpgroup, 208-236 bytes per kernel -> 0; at head dim 128
    dK/dV with GQA 20 -> 0, dQ / dK/dV with a T5 table 80 / 48 -> 0)."""
    return jnp.minimum(tile_first, 0)


def stream(plgpu, n_steps, stages: int, load, free, offset=None) -> None:
    """The producer warpgroup's loop: fill the ring's ``stages`` slots, then refill each slot once both consumer
    warpgroups have arrived on its ``free`` barriers; at the end, wait for the last ``stages`` steps' releases too,
    so that every arrival is observed (the interpreter checks this once a row is longer than the ring).
    ``load(j, slot)`` issues step j's TMA copies. ``offset``: with resident CTAs, the ring steps of the CTA's
    earlier programs; the ring runs on from them, and the waits at the end are ``drain``'s, after the last."""

    def release(j):  # step j - stages has left its slot
        for barrier in free:
            plgpu.barrier_wait(barrier.at[lax.rem(j, stages)])

    if offset is not None:

        @pl.loop(0, n_steps)
        def _(j):
            g = offset + j
            pl.when(g >= stages)(functools.partial(release, g))
            load(j, lax.rem(g, stages))

        return
    for i in range(stages):
        pl.when(i < n_steps)(functools.partial(load, i, i))

    @pl.loop(stages, jnp.maximum(n_steps, stages))
    def _(j):
        release(j)
        load(j, lax.rem(j, stages))

    for i in range(stages):
        pl.when(n_steps + i >= stages)(functools.partial(release, n_steps + i))


def drain(plgpu, steps, stages: int, free) -> None:
    """After a resident CTA's last program: wait for the ring's last ``stages`` releases of its ``steps`` in all
    (``stream``'s end, once)."""
    for i in range(stages):

        @pl.when(steps + i >= stages)
        def _(i=i):
            for barrier in free:
                plgpu.barrier_wait(barrier.at[lax.rem(steps + i, stages)])


def stream_kv(
    plgpu, blocks: BlockList, stages: int, b, kv_head, kv, free, ids=None, layout: str = "BHTE", offset=None
) -> None:
    """The producer of the forward and dQ kernels: each tile of the row's list, K then V, into the ring
    (``kv`` = ((k_ref, k_smem, k_ready), (v_ref, v_smem, v_ready)), K and V in ``layout``); on PARTIAL tiles every
    slot's kv ids too, beside K (``ids`` = (this batch row's ids [slots, Sp], their ring, its barriers); their slot
    frees with K's)."""

    def load(j, slot):
        start = blocks.start(j)
        (k_ref, k_smem, k_ready), (v_ref, v_smem, v_ready) = kv
        tile = pl.ds(start, blocks.tile)
        plgpu.copy_gmem_to_smem(head_rows(k_ref, layout, b, kv_head, tile), k_smem.at[slot], k_ready.at[slot])
        if ids is not None:
            ids_ref, ids_smem, ids_ready = ids

            @pl.when(j < blocks.partial)
            def _():
                plgpu.copy_gmem_to_smem(ids_ref.at[:, pl.ds(start, blocks.tile)], ids_smem.at[slot], ids_ready.at[slot])

        plgpu.copy_gmem_to_smem(head_rows(v_ref, layout, b, kv_head, tile), v_smem.at[slot], v_ready.at[slot])

    stream(plgpu, blocks.count, stages, load, free, offset)


def _accumulate(plgpu, acc, a, b, then, interpret: bool):
    """acc + a @ b on the tensor cores, running ``then`` while the wgmma is in flight. On the device the product
    accumulates into ``acc`` in place; the interpreter has no ``run_state``, so there it lands in a fresh
    accumulator that is added."""
    if interpret:

        def fresh(acc_ref):
            plgpu.wgmma(acc_ref, a, b)
            then()
            return acc_ref[...]

        return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))

    def in_place(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        then()

    return pl.run_state(in_place)(plgpu.ACC.init(acc))


def _id_arrays(doc_arrays, Tp: int, Sp: int):
    """(q ids [Bd, slots, Tp], kv ids [Bd, slots, Sp]) int32 from per-slot (q ids, kv ids) pairs of [1 or B, Tp]
    / [1 or B, Sp] (or the Triton kernels' [.., Tp, 1] / [.., 1, Sp] views): every slot in one array, so a tile's
    ids of all slots are one TMA copy. Bd is B when any slot's ids are per batch row, else 1."""
    flat = [a.reshape(a.shape[0], -1).astype(jnp.int32) for a in doc_arrays]
    Bd = max(a.shape[0] for a in flat)

    def stack(arrays, length):
        return jnp.stack([jnp.broadcast_to(a, (Bd, length)) for a in arrays], axis=1)

    return stack(flat[0::2], Tp), stack(flat[1::2], Sp)


class Modes:
    """What differs between the device and the Mosaic GPU interpreter (no layouts, no transposed shared-memory
    views, no register operands for wgmma), kept out of the kernels' math."""

    def __init__(self, plgpu, interpret: bool):
        self.plgpu, self.interpret = plgpu, interpret

    def cast(self, x, layout):
        return x if self.interpret else self.plgpu.layout_cast(x, layout)

    def zeros(self, shape):
        return self.cast(jnp.full(shape, 0.0, jnp.float32), self.plgpu.Layout.WGMMA)

    def iota(self, shape, axis):
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, axis)
        return self.plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=self.plgpu.Layout.WGMMA)

    def positions(self, shape, first_row, first_col):
        """(rows' positions, columns' positions) of a tile of ``shape`` whose first row and column are at those
        places, as functions: each iota is made where the mask or mod reads it, not held across them."""
        return (lambda: self.iota(shape, 0) + first_row), (lambda: self.iota(shape, 1) + first_col)

    def vector(self, smem, axis):
        """A [n] vector (float32, or int32 ids) from shared memory, laid out to broadcast along ``axis`` of a wgmma
        tile."""
        if self.interpret:
            return smem[...]
        return self.plgpu.load(smem, (), layout=self.plgpu.Layout.WGMMA.reduce(1 - axis))

    def transposed(self, ref, scratch2, wg):
        """``ref`` transposed as wgmma's right operand (in the interpreter a copy in this warpgroup's scratch)."""
        if not self.interpret:
            return self.plgpu.transpose_ref(ref, (1, 0))
        scratch2.at[wg][...] = ref[...].T
        return scratch2.at[wg]

    def operand(self, x, scratch2, wg):
        """A register tile as wgmma's left operand (shared memory in the interpreter)."""
        if not self.interpret:
            return x
        scratch2.at[wg][...] = x
        return scratch2.at[wg]

    def product(self, a, b, shape):
        """a @ b on the tensor cores into a fresh float32 accumulator."""

        def run(acc_ref):
            self.plgpu.wgmma(acc_ref, a, b)
            return acc_ref[...]

        return pl.run_scoped(run, self.plgpu.ACC(shape, jnp.float32))

    def id_tiles(self, own, ring, ready, slot, shape, own_are_q: bool):
        """Per document / position slot, the (q ids, kv ids) tiles of ``shape`` a PARTIAL tile's mask compares:
        ``own`` the program's own ids (a vector per slot along axis 0, read once), the other axis's from ``ring``'s
        ``slot`` once its ``ready`` barrier fires (they came with the tile's first operand). [] without slots."""
        if not own:
            return []
        self.plgpu.barrier_wait(ready.at[slot])
        pairs = []
        for i, x in enumerate(own):
            mine = lax.broadcast_in_dim(x, shape, [0])
            theirs = lax.broadcast_in_dim(self.vector(ring.at[slot, i], 1), shape, [1])
            pairs.append((mine, theirs) if own_are_q else (theirs, mine))
        return pairs


def id_inputs(name, static, doc_arrays, Tp: int, Sp: int):
    """(slots, (q ids [Bd, slots, Tp], kv ids [Bd, slots, Sp]) or (), ids per batch row) from ``doc_arrays``
    (``mosaic_forward`` describes them); ValueError naming ``name`` when they do not match the mask's slots."""
    n_ids = len(doc_arrays) // 2
    if len(doc_arrays) % 2 or n_ids != id_slots(static.template):
        raise ValueError(
            f"{name}: {len(doc_arrays)} id arrays for a mask with {id_slots(static.template)} document / "
            f"position slots (want a q and a kv array per slot)"
        )
    id_arrays = _id_arrays(doc_arrays, Tp, Sp) if n_ids else ()
    return n_ids, id_arrays, bool(n_ids) and id_arrays[0].shape[0] > 1


def interpret_params(interpret: bool) -> dict:
    if not interpret:
        return {}
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return {"interpret": InterpretGPUParams()}
