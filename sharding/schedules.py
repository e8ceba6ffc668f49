"""Pipeline schedules as data: a table of (tick, stage, op, microbatch, chunk) that a checker validates and that
can be printed, measured and compared before anything runs.

The model's layers are cut into P * v chunks ("virtual stages"); each of the P stages (devices) holds v of them:
one for GPipe, 1F1B and ZB-H1; v for interleaved 1F1B (chunk c of stage s is virtual stage c * P + s, a loop);
two for ZB-V (stage s holds virtual stages s and 2P - 1 - s, a V: the last stage turns the microbatch around).
Ops: F (forward), B (the input gradient, on the critical path), W (the weight gradient, which may wait), or for
schedules that do not split the backward BW (both, two ticks). With F = B = W = one tick (the zero-bubble paper's
unit, arXiv 2401.10241), a table's idle share is its bubble.

How a table is made: each stage, at every tick it is free, starts the first op its schedule's rule picks among
those whose inputs are ready (an op's output is ready the tick after it ends, on any stage). GPipe: forwards
first. 1F1B: backwards first, forwards while fewer than P - s microbatches are in flight. Interleaved 1F1B: Megatron's
fixed per-stage order (warm-up forwards, then one forward one backward). ZB-H1: 1F1B's rule with B and W split and
W done only when nothing else can run, so W fills the bubbles. ZB-V: the same on the V, with twice the chunks in
flight (each is half a stage).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict

NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv")
DURATION = {"F": 1, "B": 1, "W": 1, "BW": 2}


class ScheduleError(ValueError):
    """A schedule that cannot be made (bad settings) or a table that breaks a rule; one line naming it."""


@dataclasses.dataclass(frozen=True)
class Op:
    tick: int  # when it starts
    stage: int
    kind: str  # F, B, W or BW
    microbatch: int
    chunk: int = 0  # which of the stage's virtual stages

    @property
    def end(self) -> int:
        return self.tick + DURATION[self.kind]


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: str
    stages: int
    microbatches: int
    chunks: int  # virtual stages per stage
    ops: tuple[Op, ...]
    lockstep: bool = False  # every tick's ops are of one kind, and the stages without one run it too (`lockstep`)

    @property
    def forward_only(self) -> bool:
        """A table of forwards alone (`forward_pass`): what evaluation runs."""
        return all(op.kind == "F" for op in self.ops)

    @property
    def ticks(self) -> int:
        return max(op.end for op in self.ops)

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    def virtual_stage(self, stage: int, chunk: int) -> int:
        """Where chunk `chunk` of `stage` sits in the model's order of layers."""
        return virtual_stage(self.name, self.stages, stage, chunk)

    @property
    def bubble_fraction(self) -> float:
        """Idle stage-ticks over all stage-ticks of the step."""
        busy = sum(DURATION[op.kind] for op in self.ops)
        return 1 - busy / (self.stages * self.ticks)

    def peak_stash(self) -> list[float]:
        """Per stage, the most microbatches whose activations it holds at once (a forward done, its weight
        gradient not yet), in units of one stage's layers: a chunk counts 1 / chunks."""
        peaks = []
        for s in range(self.stages):
            events = []
            for op in self.ops:
                if op.stage == s and op.kind == "F":
                    events.append((op.tick, 1))
                elif op.stage == s and op.kind in ("W", "BW"):
                    events.append((op.end, -1))
            held = peak = 0
            for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
                held += delta
                peak = max(peak, held)
            peaks.append(peak / self.chunks)
        return peaks

    def chart(self) -> str:
        """Stages as rows, ticks as columns: F / B / W (lower case for a stage's second and later chunks), idle
        as `.`; a BW shows as B then W."""
        grid = [["."] * self.ticks for _ in range(self.stages)]
        for op in self.ops:
            letters = "BW" if op.kind == "BW" else op.kind
            for i, letter in enumerate(letters):
                grid[op.stage][op.tick + i] = letter if op.chunk == 0 else letter.lower()
        width = len(str(self.stages - 1))
        return "\n".join(f"stage {s:>{width}} {''.join(row)}" for s, row in enumerate(grid))


def virtual_stage(name: str, stages: int, stage: int, chunk: int) -> int:
    if name == "zbv":
        return stage if chunk == 0 else 2 * stages - 1 - stage
    return chunk * stages + stage


def chunks_of(name: str, virtual_stages: int | None) -> int:
    if name == "zbv":
        return 2
    if name == "interleaved-1f1b":
        return virtual_stages or 2
    return 1


def make(name: str, stages: int, microbatches: int, virtual_stages: int | None = None) -> Schedule:
    """The table of schedule `name` for P = `stages`, M = `microbatches` (`virtual_stages`: chunks per stage for
    interleaved 1F1B, default 2). ScheduleError for settings the schedule cannot run."""
    check_settings(name, stages, microbatches, virtual_stages)
    chunks = chunks_of(name, virtual_stages)
    if name == "interleaved-1f1b":
        ops = _run_in_order(name, stages, microbatches, chunks, _megatron_orders(stages, microbatches, chunks))
    else:
        ops = _run_greedy(name, stages, microbatches, chunks)
    schedule = Schedule(name, stages, microbatches, chunks, tuple(sorted(ops, key=lambda o: (o.tick, o.stage))))
    check(schedule)
    return schedule


def forward_pass(schedule: Schedule) -> Schedule:
    """The forwards of `schedule`'s chunk placement alone, each as soon as its input is ready (GPipe's forward on
    any layout): a loss without gradients needs no backward, nor its ticks. A lockstep table's stays lockstep."""
    sc = schedule
    ops = _run_greedy(sc.name, sc.stages, sc.microbatches, sc.chunks, forward_only=True)
    ops = tuple(sorted(ops, key=lambda o: (o.tick, o.stage)))
    table = Schedule(sc.name, sc.stages, sc.microbatches, sc.chunks, ops, lockstep=sc.lockstep)
    check(table)
    return table


def lockstep(schedule: Schedule) -> Schedule:
    """The same ops, each kind in its order on every stage, packed into ticks of one kind each, F then BW (or F, B,
    W) in turn: on a tick every stage runs that kind's computation, the stages without an op of it on inputs they
    then discard.

    What a stage needs when its computation pairs devices of different stages in one collective (ring attention's
    `ppermute`: one collective-permute over every stage's context group): such a collective must be run by all of
    its devices together, which a tick of different ops on different stages breaks (on XLA:CPU it silently mixes
    the stages' data). GPipe, 1F1B and interleaved 1F1B keep their idle share (1F1B's stages then hold more
    inputs); the zero-bubble tables lose what filling the gaps with W gained (P = 4, M = 8: ZB-H1 25%, ZB-V 53%)."""
    sc = schedule
    kinds = ("F", "B", "W") if splits_backward(sc.name) else ("F", "BW")
    last = sc.virtual_stages - 1
    queues = [[op for op in sorted(sc.ops, key=lambda o: o.tick) if op.stage == s] for s in range(sc.stages)]
    # A stage may run forwards ahead of its table's order (its backward not ready yet), up to twice the
    # microbatch-chunks the table holds on it, less one (1F1B: 2(P - s) - 1, as its old hand-written loop); a
    # backward op never runs ahead of a forward.
    bound = [2 * round(peak * sc.chunks) - 1 for peak in sc.peak_stash()]
    held, clock, ops, tick, turn, stalled = [0] * sc.stages, _Clock(), [], 0, 0, 0
    while any(queues):
        kind = kinds[turn % len(kinds)]
        started = []
        for s in range(sc.stages):
            for i, op in enumerate(queues[s]):
                if op.kind != kind:
                    if op.kind == "F" and kind != "F":
                        break  # a backward op never runs ahead of a forward before it
                    continue
                ready = clock.ready(kind, sc.virtual_stage(s, op.chunk), op.microbatch, last, tick)
                if ready and (kind != "F" or held[s] < bound[s]):
                    started.append(Op(tick, s, kind, op.microbatch, op.chunk))
                    del queues[s][i]
                    held[s] += 1 if kind == "F" else -1 if kind in ("W", "BW") else 0
                break  # each kind runs in the table's order on each stage
        for op in started:
            clock.record(op.kind, sc.virtual_stage(op.stage, op.chunk), op.microbatch, op.end)
        ops += started
        tick += DURATION[kind] if started else 0
        stalled = 0 if started else stalled + 1
        if stalled > len(kinds):
            raise ScheduleError(f"{sc.name}: its per-stage order cannot run in lockstep")
        turn += 1
    table = Schedule(sc.name, sc.stages, sc.microbatches, sc.chunks, tuple(ops), lockstep=True)
    check(table)
    return table


@functools.lru_cache(maxsize=None)
def cached(
    name: str, stages: int, microbatches: int, virtual_stages: int | None = None, in_lockstep: bool = False
) -> Schedule:
    """`make` (and `lockstep`), once per settings: the planner asks for the same few tables for many layouts."""
    table = make(name, stages, microbatches, virtual_stages)
    return lockstep(table) if in_lockstep else table


def idle_share(
    name: str, stages: int, microbatches: int, virtual_stages: int | None = None, in_lockstep: bool = False
) -> float:
    """The idle share of a schedule's table, what the planner ranks it by: GPipe's and 1F1B's in closed form (equal
    to their tables; a table of thousands of microbatches takes seconds to make), the others' and lockstep tables'
    from their tables."""
    if name in ("gpipe", "1f1b") and not in_lockstep:
        return theory(name, stages, microbatches)
    return cached(name, stages, microbatches, virtual_stages, in_lockstep).bubble_fraction


def splits_backward(name: str) -> bool:
    """Whether the schedule runs B and W apart (sharding.pipeline then recomputes the chunk's forward for
    each: two recomputed forwards per microbatch, against one for a BW)."""
    return name in ("zb-h1", "zbv")


def check_settings(name: str, stages: int, microbatches: int, virtual_stages: int | None) -> None:
    if name not in NAMES:
        raise ScheduleError(f"schedule {name!r} is unknown; choose one of {', '.join(NAMES)}")
    if stages < 1 or microbatches < 1:
        raise ScheduleError(f"stages and microbatches must be >= 1, got {stages} and {microbatches}")
    if virtual_stages is not None and name != "interleaved-1f1b":
        raise ScheduleError(f"virtual stages apply to interleaved-1f1b only, not {name}")
    if name == "interleaved-1f1b":
        v = virtual_stages or 2
        if v < 2:
            raise ScheduleError(f"interleaved-1f1b needs >= 2 virtual stages per stage, got {v}")
        if microbatches % stages:
            raise ScheduleError(
                f"interleaved-1f1b runs microbatches in groups of the stage count: {microbatches} microbatches do "
                f"not divide into groups of {stages}"
            )


# ----------------------------------------------------------------------------- the simulation


def _dependencies(op_kind: str, g: int, m: int, last: int) -> list[tuple[str, int, int]]:
    """What op (kind, virtual stage g, microbatch m) waits for, as (kind, virtual stage, microbatch)."""
    if op_kind == "F":
        return [("F", g - 1, m)] if g > 0 else []
    if op_kind in ("B", "BW"):
        return [("F", g, m)] + ([("B", g + 1, m)] if g < last else [])
    return [("B", g, m)]  # W


class _Clock:
    """When each (kind, virtual stage, microbatch) ended; BW counts as the end of its B and of its W."""

    def __init__(self):
        self.ended: dict[tuple[str, int, int], int] = {}

    def record(self, kind: str, g: int, m: int, end: int) -> None:
        for k in ("B", "W") if kind == "BW" else (kind,):
            self.ended[(k, g, m)] = end

    def ready(self, kind: str, g: int, m: int, last: int, tick: int) -> bool:
        return all(self.ended.get(dep, tick + 1) <= tick for dep in _dependencies(kind, g, m, last))


def _run_greedy(name: str, stages: int, microbatches: int, chunks: int, forward_only: bool = False) -> list[Op]:
    kinds = ("F",) if forward_only else _kinds(splits_backward(name))
    last = stages * chunks - 1
    clock, ops = _Clock(), []
    todo = {s: {(k, c, m) for c in range(chunks) for m in range(microbatches) for k in kinds} for s in range(stages)}
    free_at = [0] * stages
    in_flight = defaultdict(int)  # stage -> microbatch-chunks with F started and the backward (B / BW) not
    held = defaultdict(int)  # stage -> microbatch-chunks with F started and W (or BW) not
    tick = 0
    while any(todo.values()):
        for s in range(stages):
            if free_at[s] > tick or not todo[s]:
                continue
            ready = [
                (k, c, m) for (k, c, m) in todo[s] if clock.ready(k, virtual_stage(name, stages, s, c), m, last, tick)
            ]
            pick = _pick("gpipe" if forward_only else name, stages, chunks, s, ready, in_flight[s], held[s])
            if pick is None:
                continue
            k, c, m = pick
            todo[s].remove(pick)
            op = Op(tick, s, k, m, c)
            ops.append(op)
            clock.record(k, virtual_stage(name, stages, s, c), m, op.end)
            free_at[s] = op.end
            in_flight[s] += 1 if k == "F" else -1 if k in ("B", "BW") else 0
            held[s] += 1 if k == "F" else -1 if k in ("W", "BW") else 0
        tick += 1
        if tick > 10 * stages * chunks * microbatches * 3 + 100:
            raise ScheduleError(f"{name}: the simulation made no progress (a rule that deadlocks)")
    return ops


def _kinds(split: bool) -> tuple[str, ...]:
    return ("F", "B", "W") if split else ("F", "BW")


def _pick(name, stages, chunks, s, ready, in_flight, held):
    """The schedule's rule: which ready op stage `s` starts now (None: it idles). `in_flight`: the stage's
    microbatch-chunks between forward and input gradient; `held`: between forward and weight gradient."""
    forwards = sorted((op for op in ready if op[0] == "F"), key=lambda op: (op[2], -op[1]))
    backwards = sorted((op for op in ready if op[0] in ("B", "BW")), key=lambda op: (op[2], -op[1]))
    weights = sorted((op for op in ready if op[0] == "W"), key=lambda op: (op[2], op[1]))
    first = lambda ops: ops[0] if ops else None
    if name == "gpipe":
        return first(forwards) or first(backwards)
    if name == "1f1b":  # backwards first; forwards while fewer than P - s microbatches are in flight
        return first(backwards) or (first(forwards) if in_flight < stages - s else None)
    if name == "zb-h1":
        # 1F1B's bound between forward and input gradient; weight gradients wait while there is other work, up to
        # P + 1 microbatches held for them (P: 1F1B's most, on stage 0). Measured: the published (P-1)/(3M+P-1).
        room = held < stages + 1
        if backwards and room:
            return backwards[0]
        if forwards and in_flight < stages - s and room:
            return forwards[0]
        return first(weights) or first(backwards)
    # zbv: input gradients first, forwards while the stage holds fewer than P microbatches' worth of its two
    # half-size chunks (1F1B's most), weight gradients in the gaps. Measured: the bound below, at every P and M tried.
    if backwards:
        return backwards[0]
    if forwards and held < 2 * stages:
        return forwards[0]
    return first(weights)


def _megatron_orders(stages: int, microbatches: int, chunks: int) -> list[list[tuple[str, int, int]]]:
    """Megatron-LM's interleaved order per stage: forwards by groups of P microbatches, chunk by chunk; backwards the
    same with the chunks reversed; (P - s - 1) * 2 + (v - 1) * P warm-up forwards, then one forward one backward."""
    forwards = [("F", c, g + i) for g in range(0, microbatches, stages) for c in range(chunks) for i in range(stages)]
    backwards = [
        ("BW", c, g + i) for g in range(0, microbatches, stages) for c in reversed(range(chunks)) for i in range(stages)
    ]
    orders = []
    for s in range(stages):
        warm = min((stages - s - 1) * 2 + (chunks - 1) * stages, len(forwards))
        order = forwards[:warm]
        f, b = warm, 0
        while f < len(forwards):
            order += [forwards[f], backwards[b]]
            f, b = f + 1, b + 1
        orders.append(order + backwards[b:])
    return orders


def _run_in_order(name, stages, microbatches, chunks, orders) -> list[Op]:
    """Each stage runs its own list in order, waiting (idle) while the next op's inputs are not ready."""
    last = stages * chunks - 1
    clock, ops = _Clock(), []
    position, free_at, tick = [0] * stages, [0] * stages, 0
    while any(position[s] < len(orders[s]) for s in range(stages)):
        for s in range(stages):
            if free_at[s] > tick or position[s] == len(orders[s]):
                continue
            k, c, m = orders[s][position[s]]
            g = virtual_stage(name, stages, s, c)
            if not clock.ready(k, g, m, last, tick):
                continue
            op = Op(tick, s, k, m, c)
            ops.append(op)
            clock.record(k, g, m, op.end)
            free_at[s], position[s] = op.end, position[s] + 1
        tick += 1
        if tick > 10 * stages * chunks * microbatches * 3 + 100:
            raise ScheduleError(f"{name}: the per-stage orders deadlock")
    return ops


# ----------------------------------------------------------------------------- the checker


def check(schedule: Schedule, max_stash: float | None = None) -> None:
    """ScheduleError naming the first broken rule: an op missing or twice, two ops on a stage at once, an op
    before what it needs has ended, or a stage holding more than `max_stash` microbatches of activations."""
    sc = schedule
    kinds = ("F",) if sc.forward_only else _kinds(any(op.kind in ("B", "W") for op in sc.ops))
    last = sc.virtual_stages - 1
    seen: dict[tuple[str, int, int], Op] = {}
    for op in sc.ops:
        key = (op.kind, sc.virtual_stage(op.stage, op.chunk), op.microbatch)
        if key in seen:
            raise ScheduleError(f"{op.kind} of microbatch {op.microbatch} on stage {op.stage} appears twice")
        seen[key] = op
    for g in range(sc.virtual_stages):
        for m in range(sc.microbatches):
            for kind in kinds:
                if (kind, g, m) not in seen:
                    raise ScheduleError(f"{kind} of microbatch {m} on virtual stage {g} is missing")
    busy: dict[tuple[int, int], Op] = {}
    for op in sc.ops:
        for t in range(op.tick, op.end):
            if (op.stage, t) in busy:
                other = busy[(op.stage, t)]
                raise ScheduleError(
                    f"stage {op.stage} runs {other.kind}{other.microbatch} and {op.kind}{op.microbatch} at tick {t}"
                )
            busy[(op.stage, t)] = op
    ended = {}
    for key, op in seen.items():
        for k in ("B", "W") if op.kind == "BW" else (op.kind,):
            ended[(k, key[1], key[2])] = op.end
    for (kind, g, m), op in seen.items():
        for dep in _dependencies(kind, g, m, last):
            if ended.get(dep, op.tick + 1) > op.tick:
                raise ScheduleError(
                    f"tick {op.tick}: {kind} of microbatch {m} on stage {op.stage} starts before {dep[0]} of "
                    f"microbatch {m} on virtual stage {dep[1]} has ended"
                )
    if max_stash is not None:
        for s, peak in enumerate(sc.peak_stash()):
            if peak > max_stash:
                raise ScheduleError(f"stage {s} holds {peak:g} microbatches of activations, more than {max_stash:g}")


def theory(name: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """The idle share each schedule should have with F = B = W: GPipe and 1F1B (P-1)/(M+P-1), interleaved
    (P-1)/(vM+P-1), ZB-H1 (P-1)/(3M+P-1) (a third of 1F1B's idle time, as its paper counts), ZB-V (P-1)/(6M+P-1).

    The last is the least any schedule can idle in a step that begins with the first forward on stage 0 and ends
    on every stage together (our step: one optimizer update for all stages): the last stage cannot start before
    P - 1 chunk-ticks and has 6M of work. ZB-V's paper reaches near zero by letting one step's tail overlap the
    next step's head (its optimizer step is validated after the fact), which a synchronous step does not do."""
    p, m = stages, microbatches
    return {
        "gpipe": (p - 1) / (m + p - 1),
        "1f1b": (p - 1) / (m + p - 1),
        "interleaved-1f1b": (p - 1) / (chunks * m + p - 1),
        "zb-h1": (p - 1) / (3 * m + p - 1),
        "zbv": (p - 1) / (6 * m + p - 1),
    }[name]
