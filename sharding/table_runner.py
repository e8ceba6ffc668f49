"""Runs any pipeline schedule table (sharding.schedules) as one SPMD program over the `pipeline` axis.

The table is compiled, in Python, into per-tick instructions for every stage: which op (idle, F, B, W or BW) on
which chunk and microbatch, which buffer slot holds its input and its output gradient, where its result goes
(the next stage, the previous one, or this one for ZB-V's turn), and where each arriving message is kept. Slots are
given out like registers: a value occupies one from the tick it arrives to the tick of its last use (its W), so
the buffers hold what the table's stash says, not M microbatches. Inside a `shard_map` over `pipeline`, a
`lax.scan` over ticks runs each stage's op with `lax.switch` (an idle tick computes nothing), then passes messages
with two `ppermute`s (one each way, around the ring, so interleaved chunks wrap from the last stage to the first).

B and W are separate `jax.vjp`s of the chunk's forward, recomputed from the stashed input: B differentiates by the
input only (the critical path), W by the weights from the stashed input and output gradient. BW does both in one.
The last virtual stage's F also runs the loss head and keeps the head's gradient for its B.

Shape suffixes follow docs/architecture.md; S_x / S_g are the slot counts of the two buffers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sharding.pipeline import AXIS, _at, _head_value_and_grad, _shard_map, _zero_cotangent
from sharding.schedules import Schedule

IDLE, F, B, W, BW = range(5)
KIND = {"F": F, "B": B, "W": W, "BW": BW}
NONE, NEXT, PREVIOUS, HERE = range(4)  # where an op's result goes
X_BUF, G_BUF = 0, 1


def split_chunks(stacked, schedule: Schedule):
    """[L, ...] -> [P, v, L/(P v), ...]: chunk c of stage s holds virtual stage `schedule.virtual_stage(s, c)`."""
    pv = schedule.virtual_stages
    order = np.array([[schedule.virtual_stage(s, c) for c in range(schedule.chunks)] for s in range(schedule.stages)])
    return jax.tree.map(lambda a: a.reshape(pv, a.shape[0] // pv, *a.shape[1:])[order], stacked)


def join_chunks(chunked, schedule: Schedule):
    """The inverse of split_chunks: [P, v, L/(P v), ...] -> [L, ...]."""
    where = {schedule.virtual_stage(s, c): (s, c) for s in range(schedule.stages) for c in range(schedule.chunks)}
    pick = [where[g] for g in range(schedule.virtual_stages)]

    def join(a):
        parts = jnp.stack([a[s, c] for s, c in pick])
        return parts.reshape(-1, *parts.shape[2:])

    return jax.tree.map(join, chunked)


@dataclasses.dataclass(frozen=True)
class Program:
    """The table as instructions: int32 arrays [ticks, stages] (one row of the scan per tick)."""

    kind: np.ndarray
    chunk: np.ndarray
    microbatch: np.ndarray
    first: np.ndarray  # the op is on virtual stage 0 (its input is the batch)
    last: np.ndarray  # the op is on the last virtual stage (its F runs the head)
    x_slot: np.ndarray
    g_slot: np.ndarray
    send: np.ndarray  # NONE / NEXT / PREVIOUS / HERE
    from_previous: np.ndarray  # [ticks, stages, 2]: (buffer, slot) for what stage s - 1 sent, (-1, -1): nothing
    from_next: np.ndarray
    from_here: np.ndarray
    x_slots: int
    g_slots: int

    def rows(self):
        """The per-tick arrays the scan walks over."""
        fields = ("kind", "chunk", "microbatch", "first", "last", "x_slot", "g_slot", "send")
        return {f: jnp.asarray(getattr(self, f)) for f in fields} | {
            f: jnp.asarray(getattr(self, f)) for f in ("from_previous", "from_next", "from_here")
        }


def compile_table(schedule: Schedule) -> Program:
    """Per-tick instructions for `schedule` (which must pass sharding.schedules.check)."""
    sc, ticks, stages = schedule, schedule.ticks, schedule.stages
    last_g = sc.virtual_stages - 1
    owner = {sc.virtual_stage(s, c): (s, c) for s in range(stages) for c in range(sc.chunks)}
    ops = {(op.kind, sc.virtual_stage(op.stage, op.chunk), op.microbatch): op for op in sc.ops}
    free_at = {}  # (buffer, stage, chunk, microbatch) -> the tick its value is last read
    for (kind, g, m), op in ops.items():
        if kind in ("W", "BW"):
            free_at[(X_BUF, op.stage, op.chunk, m)] = free_at[(G_BUF, op.stage, op.chunk, m)] = op.tick
    if not any(op.kind in ("W", "BW") for op in sc.ops):  # a forward-only table: inputs are read once
        for (kind, g, m), op in ops.items():
            free_at[(X_BUF, op.stage, op.chunk, m)] = op.tick
    # Every value a stage keeps: (buffer, stage, chunk, microbatch, the tick it is stored).
    stored = []
    for (kind, g, m), op in ops.items():
        if kind == "F" and g == 0:
            stored.append((X_BUF, op.stage, op.chunk, m, op.tick))  # kept for its B / W
        if kind == "F" and g < last_g:
            s2, c2 = owner[g + 1]
            stored.append((X_BUF, s2, c2, m, op.tick))
        if kind == "F" and g == last_g:
            stored.append((G_BUF, op.stage, op.chunk, m, op.tick))  # the head's gradient
        if kind in ("B", "BW") and g > 0:
            s2, c2 = owner[g - 1]
            stored.append((G_BUF, s2, c2, m, op.tick))
    slot = _allocate(stored, free_at)
    arrays = {name: np.zeros((ticks, stages), np.int32) for name in ("kind", "chunk", "microbatch", "first", "last")}
    arrays |= {name: np.zeros((ticks, stages), np.int32) for name in ("x_slot", "g_slot", "send")}
    recv = {name: np.full((ticks, stages, 2), -1, np.int32) for name in ("from_previous", "from_next", "from_here")}
    for (kind, g, m), op in ops.items():
        t, s, c = op.tick, op.stage, op.chunk
        arrays["kind"][t, s], arrays["chunk"][t, s], arrays["microbatch"][t, s] = KIND[kind], c, m
        arrays["first"][t, s], arrays["last"][t, s] = g == 0, g == last_g
        arrays["x_slot"][t, s] = slot.get((X_BUF, s, c, m), 0)
        arrays["g_slot"][t, s] = slot.get((G_BUF, s, c, m), 0)
        target = None
        if kind == "F" and g < last_g:
            target, buffer = owner[g + 1], X_BUF
        if kind in ("B", "BW") and g > 0:
            target, buffer = owner[g - 1], G_BUF
        if target is None:
            continue
        s2, c2 = target
        direction = HERE if s2 == s else NEXT if s2 == (s + 1) % stages else PREVIOUS
        if direction == PREVIOUS and s2 != (s - 1) % stages:
            raise ValueError(f"{sc.name}: stage {s} sends to stage {s2}, not a neighbour")
        arrays["send"][t, s] = direction
        inbox = {HERE: "from_here", NEXT: "from_previous", PREVIOUS: "from_next"}[direction]
        recv[inbox][t, s2] = (buffer, slot[(buffer, s2, c2, m)])
    x_slots = 1 + max((v for k, v in slot.items() if k[0] == X_BUF), default=0)
    g_slots = 1 + max((v for k, v in slot.items() if k[0] == G_BUF), default=0)
    return Program(**arrays, **recv, x_slots=x_slots, g_slots=g_slots)


def _allocate(stored, free_at) -> dict:
    """A slot per kept value, reused once the value before it was last read (a read comes before the tick's
    stores, so a slot read at tick t may be written at t)."""
    slot, busy_until = {}, {}  # (buffer, stage) -> [tick each slot is read last]
    for buffer, s, c, m, tick in sorted(stored, key=lambda v: v[4]):
        ends = busy_until.setdefault((buffer, s), [])
        free = next((i for i, end in enumerate(ends) if end <= tick), None)
        if free is None:
            free = len(ends)
            ends.append(0)
        ends[free] = free_at.get((buffer, s, c, m), tick)
        slot[(buffer, s, c, m)] = free
    return slot


def table_loss(schedule: Schedule, stage_fn, head_fn, chunk_params, head_params, x_MBTD, stage_side_M, head_side_M):
    """(loss sum, count) of the pipelined model, differentiable in chunk_params ([P, v, ...]: split_chunks), head
    params and x_MBTD; its gradients are those the table's B / W ops compute."""
    return _table(_Static(schedule, stage_fn, head_fn), chunk_params, head_params, x_MBTD, stage_side_M, head_side_M)


class _Static:
    """The table and the user's functions: static arguments of the custom_vjp (hashable by identity)."""

    def __init__(self, schedule, stage_fn, head_fn):
        self.schedule, self.stage_fn, self.head_fn = schedule, stage_fn, head_fn
        self.program = compile_table(schedule)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _table(static, chunk_params, head_params, x_MBTD, stage_side_M, head_side_M):
    loss, count, _ = run(static, chunk_params, head_params, x_MBTD, stage_side_M, head_side_M)
    return loss, count


def _table_fwd(static, chunk_params, head_params, x_MBTD, stage_side_M, head_side_M):
    loss, count, grads = run(static, chunk_params, head_params, x_MBTD, stage_side_M, head_side_M)
    return (loss, count), (grads, stage_side_M, head_side_M)


def _table_bwd(static, residuals, cotangents):
    (g_chunks, g_head, g_x), stage_side_M, head_side_M = residuals
    ct_loss, _ = cotangents
    scale = lambda tree: jax.tree.map(lambda g: (g * ct_loss).astype(g.dtype), tree)
    no_grad = lambda tree: jax.tree.map(_zero_cotangent, tree)
    return scale(g_chunks), scale(g_head), scale(g_x), no_grad(stage_side_M), no_grad(head_side_M)


_table.defvjp(_table_fwd, _table_bwd)


def run(static: _Static, chunk_params, head_params, x_MBTD, stage_side_M, head_side_M):
    """Runs the table: (loss sum, count, (d chunk_params, d head_params, d x_MBTD))."""
    prog, stages = static.program, static.schedule.stages
    stage_fn, head_fn = static.stage_fn, static.head_fn
    rows = prog.rows()

    def body(chunk_params, head_params, x_MBTD, stage_side_M, head_side_M, rows):
        params = jax.tree.map(lambda a: a[0], chunk_params)  # this stage's [v, L/(P v), ...]
        s = jax.lax.axis_index(AXIS)
        x0 = jnp.zeros_like(x_MBTD[0])

        def tick(carry, row):
            xbuf, gbuf, g_params, g_head, g_x_MBTD, loss, count = carry
            mine = jax.tree.map(lambda a: a[s], row)
            c, m = mine["chunk"], mine["microbatch"]
            chunk = _at(params, c)
            side = _at(stage_side_M, m)
            x = jnp.where(mine["first"] == 1, _at(x_MBTD, m), _at(xbuf, mine["x_slot"]))
            g_out = _at(gbuf, mine["g_slot"])
            forward = lambda p, xb: stage_fn(p, xb, side)

            def idle(state):
                return state + (x0,)

            def f_op(state):
                xbuf, gbuf, g_params, g_head, g_x_MBTD, loss, count = state
                y = forward(chunk, x)
                xbuf = jnp.where(mine["first"] == 1, _put(xbuf, x, mine["x_slot"]), xbuf)

                def head(args):
                    g_head, gbuf, loss, count = args
                    (l, n), (g_h, g_y) = _head_value_and_grad(head_fn, head_params, y, _at(head_side_M, m))
                    g_head = jax.tree.map(jnp.add, g_head, g_h)
                    return g_head, _put(gbuf, g_y, mine["g_slot"]), loss + l, count + n

                g_head, gbuf, loss, count = jax.lax.cond(
                    mine["last"] == 1, head, lambda args: args, (g_head, gbuf, loss, count)
                )
                return xbuf, gbuf, g_params, g_head, g_x_MBTD, loss, count, y

            def b_op(state):
                xbuf, gbuf, g_params, g_head, g_x_MBTD, loss, count = state
                _, vjp = jax.vjp(lambda xb: forward(chunk, xb), x)
                (g_x,) = vjp(g_out)
                g_x_MBTD = jnp.where(mine["first"] == 1, _put(g_x_MBTD, g_x, m), g_x_MBTD)
                return xbuf, gbuf, g_params, g_head, g_x_MBTD, loss, count, g_x

            def w_op(state):
                xbuf, gbuf, g_params, g_head, g_x_MBTD, loss, count = state
                _, vjp = jax.vjp(lambda p: forward(p, x), chunk)
                (g_p,) = vjp(g_out)
                return xbuf, gbuf, _add_at(g_params, g_p, c), g_head, g_x_MBTD, loss, count, x0

            def bw_op(state):
                xbuf, gbuf, g_params, g_head, g_x_MBTD, loss, count = state
                _, vjp = jax.vjp(forward, chunk, x)
                g_p, g_x = vjp(g_out)
                g_x_MBTD = jnp.where(mine["first"] == 1, _put(g_x_MBTD, g_x, m), g_x_MBTD)
                return xbuf, gbuf, _add_at(g_params, g_p, c), g_head, g_x_MBTD, loss, count, g_x

            *state, message = jax.lax.switch(mine["kind"], (idle, f_op, b_op, w_op, bw_op), carry)
            xbuf, gbuf = state[0], state[1]
            ring = lambda shift: [(i, (i + shift) % stages) for i in range(stages)]
            send = mine["send"]
            from_previous = jax.lax.ppermute(jnp.where(send == NEXT, message, 0), AXIS, ring(+1))
            from_next = jax.lax.ppermute(jnp.where(send == PREVIOUS, message, 0), AXIS, ring(-1))
            for value, (buffer, slot) in (
                (from_previous, (mine["from_previous"][0], mine["from_previous"][1])),
                (from_next, (mine["from_next"][0], mine["from_next"][1])),
                (message, (mine["from_here"][0], mine["from_here"][1])),
            ):
                xbuf = jnp.where(buffer == X_BUF, _put(xbuf, value, slot), xbuf)
                gbuf = jnp.where(buffer == G_BUF, _put(gbuf, value, slot), gbuf)
            return (xbuf, gbuf, *state[2:]), None

        init = (
            jnp.zeros((prog.x_slots,) + x0.shape, x0.dtype),
            jnp.zeros((prog.g_slots,) + x0.shape, x0.dtype),
            jax.tree.map(jnp.zeros_like, params),
            jax.tree.map(jnp.zeros_like, head_params),
            jnp.zeros_like(x_MBTD),
            jnp.zeros((), jnp.float32),
            jnp.zeros((), jnp.float32),
        )
        carry, _ = jax.lax.scan(tick, init, rows)
        _, _, g_params, g_head, g_x_MBTD, loss, count = carry
        total = lambda tree: jax.tree.map(lambda a: jax.lax.psum(a, AXIS), tree)
        return total(loss), total(count), jax.tree.map(lambda g: g[None], g_params), total(g_head), total(g_x_MBTD)

    out_specs = (P(), P(), jax.tree.map(lambda _: P(AXIS), chunk_params), jax.tree.map(lambda _: P(), head_params), P())
    loss, count, g_chunks, g_head, g_x = _shard_map(
        body, chunk_params, head_params, x_MBTD, stage_side_M, head_side_M, rows, out_specs=out_specs
    )
    return loss, count, (g_chunks, g_head, g_x)


def _put(buffer, value, index):
    return jax.lax.dynamic_update_index_in_dim(buffer, value.astype(buffer.dtype), jnp.maximum(index, 0), 0)


def _add_at(tree, delta, index):
    """tree[index] += delta on every leaf ([v, ...] leaves, `delta` without the v axis)."""
    return jax.tree.map(lambda a, d: _put(a, _at(a, index) + d, index), tree, delta)
