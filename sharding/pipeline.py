"""Pipeline parallelism over the `pipeline` mesh axis: any schedule table (sharding.schedules: GPipe, 1F1B,
interleaved 1F1B, ZB-H1, ZB-V) run as one SPMD program by one runner.

The table is compiled, in Python, into per-tick instructions for every stage: which op (idle, F, B, W or BW) on
which chunk and microbatch, which buffer slot holds its input and its output gradient, where its result goes
(the next stage, the previous one, or this one for ZB-V's turn), and where each arriving message is kept. Slots are
given out like registers: a value occupies one from the tick it arrives to the tick of its last use (its W), so
the buffers hold what the table's stash says (1F1B: P - s microbatch inputs on stage s; GPipe: all M), not every
microbatch's residuals. Inside a `jax.shard_map` that is manual over `pipeline` only (data / fsdp / tensor stay
automatic, so FSDP and tensor parallelism keep working inside a stage), a `lax.scan` over ticks runs each stage's op
with `lax.switch` (an idle tick computes nothing), then passes messages with `ppermute` around the ring (so
interleaved chunks wrap from the last stage to the first), skipped on ticks when no stage sends that way.

B and W are separate `jax.vjp`s of the chunk's forward, recomputed from the stashed input: B differentiates by the
input only (the critical path), W by the weights from the stashed input and output gradient. BW does both in one.
The last virtual stage's F also runs the loss head and keeps the head's gradient for its B. A stage may also return
a term of the objective and statistics of its layers (`StageOut`: an MoE stage's router losses and routing
statistics): its F sums them, its B / W differentiate the term with the output. The schedule computes
the gradients itself; a `jax.custom_vjp` hands them to the surrounding autodiff. A loss without gradients (eval)
runs the forwards alone (`sharding.schedules.forward_pass`). A lockstep table (`sharding.schedules.lockstep`, for
stages holding ring attention: `runs_in_lockstep`) switches on the tick's one kind instead, every stage running it.

Shape suffixes follow docs/architecture.md (B: the rows of one microbatch; a `_M` suffix is a leading [M] axis).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sharding.schedules import Schedule, cached, forward_pass

AXIS = "pipeline"

# (chunk params [L/(P v), ...], x_BTD, side inputs) -> x_BTD, or a StageOut when the stage adds to the objective
StageFn = Callable[[Any, jax.Array, Any], Any]
HeadFn = Callable[[Any, jax.Array, Any], tuple[jax.Array, jax.Array]]  # (head params, y_BTD, side) -> (sum, count)


class StageOut(NamedTuple):
    """What a stage may return besides its output: a term of the objective (summed with the head's losses and
    differentiated with them: an MoE router's aux and z losses) and statistics of its layers (leaves [layers of the
    chunk, ...], averaged over the microbatches and returned per layer, without gradients)."""

    y: jax.Array
    objective: jax.Array
    stats: Any


class PipelineAux(NamedTuple):
    """pipeline_loss's outputs besides the objective, without gradients: the head's count and loss sum (the
    objective less the stages' terms) and the stages' statistics per layer [L, ...] in the model's order."""

    count: jax.Array
    head_loss: jax.Array
    stats: Any


IDLE, F, B, W, BW = range(5)
KIND = {"F": F, "B": B, "W": W, "BW": BW}
NONE, NEXT, PREVIOUS, HERE = range(4)  # where an op's result goes
X_BUF, G_BUF = 0, 1


def split_chunks(stacked, schedule: Schedule):
    """[L, ...] -> [P, v, L/(P v), ...]: chunk c of stage s holds virtual stage `schedule.virtual_stage(s, c)`.

    With one chunk per stage (GPipe, 1F1B, ZB-H1) a reshape: a stage's layers are its own. With v (interleaved, ZB-V)
    the L/P layers a device holds in the model's order are v chunks of other stages; under a mesh with a `pipeline`
    axis they move in v rounds of `ppermute`, one chunk per device per round (`chunk_moves`), so a device holds its
    own layers and one reordered copy, where XLA's gather for the same index holds every stage's (S - 1 copies more).
    Autodiff sends the gradients back the same way."""
    pv, stages, v = schedule.virtual_stages, schedule.stages, schedule.chunks
    order = np.array([[schedule.virtual_stage(s, c) for c in range(v)] for s in range(stages)])
    if (order == np.arange(pv).reshape(stages, v)).all():  # each stage's chunks are its own layers
        return jax.tree.map(lambda a: a.reshape(stages, v, a.shape[0] // pv, *a.shape[1:]), stacked)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get(AXIS, 1) != stages:  # the layers are not split over stages: index them
        return jax.tree.map(lambda a: a.reshape(pv, a.shape[0] // pv, *a.shape[1:])[order], stacked)
    moves = chunk_moves(schedule)

    def reorder(local):  # this device's [L/P, ...] -> its stage's [1, v, L/(P v), ...]
        d = jax.lax.axis_index(AXIS)
        mine = local.reshape(v, local.shape[0] // v, *local.shape[1:])
        out = jnp.zeros_like(mine)
        for pairs, send_chunk, recv_slot in moves:
            sent = _at(mine, jnp.asarray(send_chunk)[d])
            got = jax.lax.ppermute(sent, AXIS, [(a, b) for a, b in pairs if a != b])
            stays = jnp.asarray([(i, i) in pairs for i in range(stages)])[d]  # a chunk already on its stage
            out = _put(out, jnp.where(stays, sent, got), jnp.asarray(recv_slot)[d])
        return out[None]

    specs = jax.tree.map(lambda _: P(AXIS), stacked)
    mapped = jax.shard_map(
        lambda tree: jax.tree.map(reorder, tree), mesh=mesh, in_specs=(specs,), out_specs=specs, axis_names={AXIS}
    )
    return mapped(stacked)


def chunk_moves(schedule: Schedule) -> list[tuple[list[tuple[int, int]], list[int], list[int]]]:
    """The rounds that put every chunk on its stage: per round the (from, to) device pairs (a permutation), the
    chunk each device sends (its j-th of v, in the model's order) and the slot each device files what it receives
    in. Each device sends v chunks and receives v, so the moves split into v permutations (a regular bipartite
    multigraph is a union of perfect matchings); each is found by augmenting paths."""
    stages, v = schedule.stages, schedule.chunks
    owner = {schedule.virtual_stage(s, c): (s, c) for s in range(stages) for c in range(v)}
    left = [(g // v, g % v, *owner[g]) for g in range(stages * v)]  # (from device, its chunk, to device, slot)
    rounds = []
    for _ in range(v):
        match: dict[int, int] = {}  # receiving device -> index into `left`

        def augment(src, seen):
            for i, (a, _, b, _) in enumerate(left):
                if a == src and b not in seen:
                    seen.add(b)
                    if b not in match or augment(left[match[b]][0], seen):
                        match[b] = i
                        return True
            return False

        for src in range(stages):
            if not augment(src, set()):
                raise ValueError(f"{schedule.name}: the chunk moves do not split into permutations")
        picked = [left[i] for i in match.values()]
        send_chunk, recv_slot = [0] * stages, [0] * stages
        for a, j, b, c in picked:
            send_chunk[a], recv_slot[b] = j, c
        rounds.append(([(a, b) for a, _, b, _ in picked], send_chunk, recv_slot))
        left = [e for i, e in enumerate(left) if i not in set(match.values())]
    return rounds


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
    kinds: tuple[int, ...]  # the ops the table uses: the runner builds only their branches
    lockstep: bool  # every stage runs each tick's kind (sharding.schedules.lockstep), masked where it has no op

    @property
    def training(self) -> bool:
        return self.kinds != (F,)

    def rows(self):
        """The per-tick arrays the scan walks over: the ticks where some stage works (after a BW every stage may
        rest), with the kind every stage runs in lockstep and whether any stage sends each way."""
        busy = (self.kind != IDLE).any(axis=1)
        fields = ("kind", "chunk", "microbatch", "first", "last", "x_slot", "g_slot", "send")
        fields += ("from_previous", "from_next", "from_here")
        rows = {f: jnp.asarray(getattr(self, f)[busy]) for f in fields}
        rows["any_kind"] = jnp.asarray(self.kind.max(axis=1)[busy])
        rows["any_next"] = jnp.asarray((self.send == NEXT).any(axis=1)[busy])
        rows["any_previous"] = jnp.asarray((self.send == PREVIOUS).any(axis=1)[busy])
        return rows


def compile_table(schedule: Schedule) -> Program:
    """Per-tick instructions for `schedule` (which must pass sharding.schedules.check)."""
    sc, ticks, stages = schedule, schedule.ticks, schedule.stages
    training = not sc.forward_only
    last_g = sc.virtual_stages - 1
    owner = {sc.virtual_stage(s, c): (s, c) for s in range(stages) for c in range(sc.chunks)}
    ops = {(op.kind, sc.virtual_stage(op.stage, op.chunk), op.microbatch): op for op in sc.ops}
    free_at = {}  # (buffer, stage, chunk, microbatch) -> the tick its value is last read
    for (kind, g, m), op in ops.items():
        if kind in ("W", "BW") or not training:  # without a backward, an input is read once, by its F
            free_at[(X_BUF, op.stage, op.chunk, m)] = free_at[(G_BUF, op.stage, op.chunk, m)] = op.tick
    # Every value a stage keeps: (buffer, stage, chunk, microbatch, the tick it is stored).
    stored = []
    for (kind, g, m), op in ops.items():
        if kind == "F" and g == 0 and training:
            stored.append((X_BUF, op.stage, op.chunk, m, op.tick))  # kept for its B / W
        if kind == "F" and g < last_g:
            s2, c2 = owner[g + 1]
            stored.append((X_BUF, s2, c2, m, op.tick))
        if kind == "F" and g == last_g and training:
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
    kinds = tuple(sorted({KIND[op.kind] for op in sc.ops}))
    return Program(**arrays, **recv, x_slots=x_slots, g_slots=g_slots, kinds=kinds, lockstep=sc.lockstep)


def runs_in_lockstep(layout, context_parallel: str) -> bool:
    """Whether the layout's pipeline runs its table in lockstep (sharding.schedules.lockstep): when a stage's
    computation holds a collective that pairs devices of every stage, ring attention's ppermute over a context
    axis. Such a collective must be run by all its devices at once, not by the stages whose op has it."""
    return layout.pipeline > 1 and layout.context > 1 and context_parallel == "ring"


@functools.lru_cache(maxsize=None)
def buffer_slots(
    name: str, stages: int, microbatches: int, virtual_stages: int | None = None, in_lockstep: bool = False
) -> tuple[int, int]:
    """(x_slots, g_slots) of a schedule's program: the chunk inputs and output gradients each stage's buffers hold,
    what its activation memory is made of. GPipe's (M, M) and 1F1B's (min(M, P), 1) in closed form (equal to their
    programs at every P <= 8, M <= 4P)."""
    if name == "gpipe" and not in_lockstep:
        return microbatches, microbatches
    if name == "1f1b" and not in_lockstep:
        return min(microbatches, stages), 1
    program = compile_table(cached(name, stages, microbatches, virtual_stages, in_lockstep))
    return program.x_slots, program.g_slots


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


def pipeline_loss(
    schedule: Schedule, stage_fn: StageFn, head_fn: HeadFn, chunk_params, head_params, x_MBTD, stage_side_M, head_side_M
) -> tuple[jax.Array, PipelineAux]:
    """(objective, PipelineAux): the objective is `head_fn(stage_fn(...stage_fn(x)))`'s loss summed over
    microbatches, plus the stages' own terms when they return a `StageOut`, pipelined by `schedule`.

    chunk_params: [P, v, L/(P v), ...] leaves (`split_chunks`); x_MBTD: the first stage's inputs; *_side_M: pytrees
    with a leading [M] axis (e.g. segment ids for the stages, targets for the head). The objective is differentiable
    in chunk_params, head_params and x_MBTD; the gradients are those the table's B / W ops compute."""
    static = _Static(schedule, stage_fn, head_fn)
    objective, count, head_loss, stats = _pipelined(
        static, chunk_params, head_params, x_MBTD, stage_side_M, head_side_M
    )
    return objective, PipelineAux(count, head_loss, join_chunks(stats, schedule))


class _Static:
    """The tables and the user's functions: static arguments of the custom_vjp (hashable by identity)."""

    def __init__(self, schedule: Schedule, stage_fn: StageFn, head_fn: HeadFn):
        self.schedule, self.stage_fn, self.head_fn = schedule, stage_fn, head_fn
        self.train, self.forward = _programs(schedule)


@functools.lru_cache(maxsize=None)
def _programs(schedule: Schedule) -> tuple[Program, Program]:
    """The training table's program and its forward pass's, once per table (a step is traced for training, eval
    and gradients alike, and a table of many microbatches takes a while to simulate and compile)."""
    return compile_table(schedule), compile_table(forward_pass(schedule))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _pipelined(static, chunk_params, head_params, x_MBTD, stage_side_M, head_side_M):
    return run(static, static.forward, chunk_params, head_params, x_MBTD, stage_side_M, head_side_M)


def _pipelined_fwd(static, chunk_params, head_params, x_MBTD, stage_side_M, head_side_M):
    *sums, grads = run(static, static.train, chunk_params, head_params, x_MBTD, stage_side_M, head_side_M)
    return tuple(sums), (grads, stage_side_M, head_side_M)


def _pipelined_bwd(static, residuals, cotangents):
    """The table's gradients are the objective's; count, head loss and statistics carry none."""
    (g_chunks, g_head, g_x), stage_side_M, head_side_M = residuals
    ct_objective = cotangents[0]
    scale = lambda tree: jax.tree.map(lambda g: (g * ct_objective).astype(g.dtype), tree)
    no_grad = lambda tree: jax.tree.map(_zero_cotangent, tree)
    return scale(g_chunks), scale(g_head), scale(g_x), no_grad(stage_side_M), no_grad(head_side_M)


def _zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return jnp.zeros(x.shape, jax.dtypes.float0)


_pipelined.defvjp(_pipelined_fwd, _pipelined_bwd)


def run(static: _Static, prog: Program, chunk_params, head_params, x_MBTD, stage_side_M, head_side_M):
    """Runs one of the static's programs: (objective, count, head loss sum, stage statistics [P, v, ...]) for the
    forward pass, and (d chunk_params, d head_params, d x_MBTD) after them for the training table."""
    stages, training = static.schedule.stages, prog.training
    stage_fn, head_fn = static.stage_fn, static.head_fn

    def body(chunk_params, head_params, x_MBTD, stage_side_M, head_side_M, rows):
        params = jax.tree.map(lambda a: a[0], chunk_params)  # this stage's [v, L/(P v), ...]
        s = jax.lax.axis_index(AXIS)
        x0 = jnp.zeros_like(x_MBTD[0])
        microbatches = x_MBTD.shape[0]

        def tick(carry, row):
            xbuf, gbuf, g_params, g_head, g_x_MBTD, loss, count, extra, stats = carry
            mine = {k: a[s] for k, a in row.items() if not k.startswith("any_")}  # this stage's column
            c, m, first = mine["chunk"], mine["microbatch"], mine["first"] == 1
            # Lockstep: every stage runs the tick's kind, and one without an op of it (`active` false) discards
            # what it computes. Otherwise each stage runs its own op, and only it.
            kind = row["any_kind"] if prog.lockstep else mine["kind"]
            active = mine["kind"] == kind
            first, last = first & active, (mine["last"] == 1) & active
            chunk = _at(params, c)
            side = _at(stage_side_M, m)
            x = jnp.where(first, _at(x_MBTD, m), _at(xbuf, mine["x_slot"]))
            g_out = _at(gbuf, mine["g_slot"])
            forward = lambda p, xb: _stage_out(stage_fn(p, xb, side))
            seed = lambda g_y, out: StageOut(g_y, jnp.ones_like(out.objective), jax.tree.map(jnp.zeros_like, out.stats))

            def idle(state):
                return state + (x0,)

            def f_op(state):
                xbuf, gbuf, g_params, g_head, g_x_MBTD, loss, count, extra, stats = state
                y, objective, chunk_stats = forward(chunk, x)
                extra = extra + jnp.where(active, objective, 0.0)
                stats = _add_at(stats, chunk_stats, c, active)
                if not training:

                    def head_value(sums):
                        l, n = head_fn(head_params, y, _at(head_side_M, m))
                        return sums[0] + l, sums[1] + n

                    loss, count = jax.lax.cond(last, head_value, lambda sums: sums, (loss, count))
                    return xbuf, gbuf, g_params, g_head, g_x_MBTD, loss, count, extra, stats, y
                xbuf = _put_if(xbuf, x, mine["x_slot"], first)

                def head(args):
                    g_head, gbuf, loss, count = args
                    (l, n), (g_h, g_y) = _head_value_and_grad(head_fn, head_params, y, _at(head_side_M, m))
                    g_head = jax.tree.map(lambda acc, g: acc + g.astype(acc.dtype), g_head, g_h)
                    return g_head, _put(gbuf, g_y, mine["g_slot"]), loss + l, count + n

                g_head, gbuf, loss, count = jax.lax.cond(last, head, lambda args: args, (g_head, gbuf, loss, count))
                return xbuf, gbuf, g_params, g_head, g_x_MBTD, loss, count, extra, stats, y

            # The backward ops pull the output gradient and a 1 for the stage's own objective term through it.
            def b_op(state):
                xbuf, gbuf, g_params, g_head, g_x_MBTD, *sums = state
                out, vjp = jax.vjp(lambda xb: forward(chunk, xb), x)
                (g_x,) = vjp(seed(g_out, out))
                return xbuf, gbuf, g_params, g_head, _put_if(g_x_MBTD, g_x, m, first), *sums, g_x

            def w_op(state):
                xbuf, gbuf, g_params, g_head, g_x_MBTD, *sums = state
                out, vjp = jax.vjp(lambda p: forward(p, x), chunk)
                (g_p,) = vjp(seed(g_out, out))
                return xbuf, gbuf, _add_at(g_params, g_p, c, active), g_head, g_x_MBTD, *sums, x0

            def bw_op(state):
                xbuf, gbuf, g_params, g_head, g_x_MBTD, *sums = state
                out, vjp = jax.vjp(forward, chunk, x)
                g_p, g_x = vjp(seed(g_out, out))
                g_x_MBTD = _put_if(g_x_MBTD, g_x, m, first)
                return xbuf, gbuf, _add_at(g_params, g_p, c, active), g_head, g_x_MBTD, *sums, g_x

            ops = {IDLE: idle, F: f_op, B: b_op, W: w_op, BW: bw_op}
            used = (IDLE,) + prog.kinds  # only the branches the table uses are built
            branch = jnp.asarray(np.searchsorted(np.array(used), np.arange(5)).clip(0, len(used) - 1))[kind]
            *state, message = jax.lax.switch(branch, [ops[k] for k in used], carry)
            xbuf, gbuf = state[0], state[1]
            from_previous = _pass(message, mine["send"] == NEXT, row["any_next"], stages, +1)
            from_next = _pass(message, mine["send"] == PREVIOUS, row["any_previous"], stages, -1)
            for value, inbox in ((from_previous, "from_previous"), (from_next, "from_next"), (message, "from_here")):
                buffer, slot = mine[inbox][0], mine[inbox][1]
                xbuf = _put_if(xbuf, value, slot, buffer == X_BUF)
                gbuf = _put_if(gbuf, value, slot, buffer == G_BUF)
            return (xbuf, gbuf, *state[2:]), None

        # head params given in a compute dtype (gathered in it) still sum their gradients in float32
        head_zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.promote_types(a.dtype, jnp.float32)), head_params)
        zero_grads = (jax.tree.map(jnp.zeros_like, params), head_zeros)
        side0 = _at(stage_side_M, 0)
        out0 = jax.eval_shape(lambda p, xb: _stage_out(stage_fn(p, xb, side0)), _at(params, 0), x0)
        zero_stats = jax.tree.map(lambda a: jnp.zeros((static.schedule.chunks,) + a.shape, a.dtype), out0.stats)
        init = (
            jnp.zeros((prog.x_slots,) + x0.shape, x0.dtype),
            jnp.zeros((prog.g_slots if training else 1,) + x0.shape, x0.dtype),
            *(zero_grads if training else ((), ())),
            jnp.zeros_like(x_MBTD) if training else (),
            jnp.zeros((), jnp.float32),
            jnp.zeros((), jnp.float32),
            jnp.zeros((), jnp.float32),
            zero_stats,
        )
        carry, _ = jax.lax.scan(tick, init, rows)
        _, _, g_params, g_head, g_x_MBTD, loss, count, extra, stats = carry
        # Chunk params' gradients and statistics stay on their stage; the rest lives on one stage and is summed.
        total = lambda tree: jax.tree.map(lambda a: jax.lax.psum(a, AXIS), tree)
        per_stage = lambda tree: jax.tree.map(lambda g: g[None], tree)
        loss, stats = total(loss), per_stage(jax.tree.map(lambda a: a / microbatches, stats))
        sums = (loss + total(extra), total(count), loss, stats)
        if not training:
            return sums
        g_head = jax.tree.map(lambda g, p: g.astype(p.dtype), total(g_head), head_params)
        return (*sums, per_stage(g_params), g_head, total(g_x_MBTD))

    out_specs = (P(), P(), P(), P(AXIS))  # statistics: [P, v, ...], each stage its own
    if prog.training:
        out_specs += (jax.tree.map(lambda _: P(AXIS), chunk_params), jax.tree.map(lambda _: P(), head_params), P())
    out = _shard_map(
        body, chunk_params, head_params, x_MBTD, stage_side_M, head_side_M, prog.rows(), out_specs=out_specs
    )
    return out if not prog.training else (*out[:4], out[4:])


def _shard_map(body, stage_params, *args, out_specs):
    """Manual over `pipeline` only: stage params split on their leading axis, everything else replicated."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.axis_names:
        raise ValueError("pipelining needs a mesh with a 'pipeline' axis in context (jax.sharding.use_abstract_mesh)")
    in_specs = (jax.tree.map(lambda _: P(AXIS), stage_params),) + tuple(jax.tree.map(lambda _: P(), a) for a in args)
    # check_vma=False: the block-sparse attention inside a stage runs its own shard_map over the other axes (also
    # unchecked: the Pallas interpreter cannot be), whose cotangents would not carry this map's `pipeline` typing.
    # Unchecked, the values a stage receives or writes must be combined explicitly: every psum above is deliberate.
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={AXIS}, check_vma=False)
    return mapped(stage_params, *args)


def _stage_out(out) -> StageOut:
    """A stage's result as a StageOut (an objective term of 0 and no statistics for a plain output), the term and
    the statistics in float32 (they are summed over microbatches)."""
    if not isinstance(out, StageOut):
        return StageOut(out, jnp.zeros((), jnp.float32), {})
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    return StageOut(out.y, f32(out.objective), jax.tree.map(f32, out.stats))


def _pass(message, sending, anyone, stages: int, shift: int):
    """`message` from every stage that is `sending` to stage s + shift around the ring (zeros where none is sent);
    on a tick when no stage sends this way (`anyone`, the same on every stage) the collective is skipped."""

    def send():
        pairs = [(i, (i + shift) % stages) for i in range(stages)]
        return jax.lax.ppermute(jnp.where(sending, message, 0), AXIS, pairs)

    return jax.lax.cond(anyone, send, lambda: jnp.zeros_like(message))


def _head_value_and_grad(head_fn: HeadFn, head_params, y_BTD, side):
    """((loss sum, count), (d head_params, d y)) of the head on one microbatch."""
    (l, n), vjp = jax.vjp(lambda h, y: head_fn(h, y, side), head_params, y_BTD)
    g_h, g_y = vjp((jnp.ones_like(l), jnp.zeros_like(n)))
    return (l, n), (g_h, g_y)


def _at(tree_M, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree_M)


def _put(buffer, value, index):
    return jax.lax.dynamic_update_index_in_dim(buffer, value.astype(buffer.dtype), jnp.maximum(index, 0), 0)


def _put_if(buffer, value, index, cond):
    """buffer[index] = value where `cond`, in place (a select over the whole buffer would copy it every tick)."""
    index = jnp.maximum(index, 0)
    old = jax.lax.dynamic_index_in_dim(buffer, index, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(cond, value.astype(buffer.dtype), old), index, 0)


def _add_at(tree, delta, index, cond=True):
    """tree[index] += delta where `cond`, on every leaf ([v, ...] leaves, `delta` without the v axis)."""
    return jax.tree.map(lambda a, d: _put(a, _at(a, index) + jnp.where(cond, d, 0), index), tree, delta)
