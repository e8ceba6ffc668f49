"""Where every sample will be cached, decided from the known future (Belady, de-duplicated across processes).

Every process runs this same deterministic simulation over the same global
stream (the `AccessPlan`) with the same all-gathered capacities, so all agree,
without further messages, on which process holds which sample in which tier at
every step. The simulation walks the stream in order (step, then process, then
row); on each access:

- a sample cached anywhere is a hit: read from the local tier, or from the peer
  that holds it (de-duplication: a sample is cached at most once in the job);
- a miss is read from the source by the reader, which then caches it if it has
  room, or if its cached sample needed furthest in the future is needed later
  than the newcomer (Belady's rule; never evicting something needed sooner than
  what it brings in). RAM holds what is needed soonest: a RAM victim is demoted
  to disk when disk has room for it (or holds something needed later still).

Ranking by next use is what "frequency over the remaining epochs, ties by first
access" becomes when the exact future is known: a sample needed often is, at
each moment, needed soon. Samples not needed within the lookahead rank last and
fill free space only.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from data.access_plan import AccessPlan

SOURCE, RAM, DISK, PEER = 0, 1, 2, 3
TIER_NAMES = {SOURCE: "source", RAM: "ram", DISK: "disk", PEER: "peer"}
DROP, DEMOTE = "drop", "demote"  # cache operations applied once a position is consumed


@dataclasses.dataclass
class ProcessPlan:
    """What one process does at each of its positions in steps [step_start, step_stop); positions are flat
    step-major indices over its rows. `ops[pos]` (drops and demotions, in order) precede the store at `pos`."""

    step_start: int
    step_stop: int
    rows: tuple[int, int]
    samples: np.ndarray  # [positions] int64
    fetch_from: np.ndarray  # [positions] int8: SOURCE | RAM | DISK | PEER
    peer: np.ndarray  # [positions] int32: the holding process when fetch_from == PEER, else -1
    store: np.ndarray  # [positions] int8: 0, or the tier (RAM | DISK) the sample is cached in once read
    ops: dict[int, list[tuple[str, int, int]]]  # pos -> [(DROP, sample, tier) | (DEMOTE, sample, RAM)]


def next_uses(stream: np.ndarray, never: int) -> np.ndarray:
    """next[i] = the index of the next occurrence of stream[i] after i, or `never`."""
    order = np.argsort(stream, kind="stable")
    nxt = np.full(len(stream), never, np.int64)
    same = stream[order[1:]] == stream[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


class PlacementPlanner:
    """Simulates the job's caches over the future stream, one chunk of steps at a time (resumable at any step).

    process_rows[p] = rows [lo, hi) of the global batch that process p reads;
    capacities[p] = (ram_samples, disk_samples). Chunks must be planned in
    order; `lookahead_steps` (default two epochs) beyond a chunk are scanned for next uses.
    """

    def __init__(
        self,
        plan: AccessPlan,
        process_rows: list[tuple[int, int]],
        capacities: list[tuple[int, int]],
        *,
        lookahead_steps: int | None = None,
    ):
        if len(process_rows) != len(capacities) or not process_rows:
            raise ValueError(
                f"need one (ram, disk) capacity per process, got {len(capacities)} capacities for "
                f"{len(process_rows)} processes"
            )
        for p, (ram, disk) in enumerate(capacities):
            if ram < 0 or disk < 0:
                raise ValueError(f"process {p}: cache capacities must be >= 0 samples, got ram={ram} disk={disk}")
        self.plan, self.process_rows = plan, [tuple(map(int, r)) for r in process_rows]
        self.capacities = [(int(r), int(d)) for r, d in capacities]
        # two epochs ahead: every sample read in a chunk is read again within it (the permutations reshuffle)
        self.lookahead_steps = 2 * plan.steps_per_epoch if lookahead_steps is None else int(lookahead_steps)
        self._columns = np.concatenate([np.arange(lo, hi) for lo, hi in self.process_rows])
        self._proc_of_column = np.concatenate([np.full(hi - lo, p) for p, (lo, hi) in enumerate(self.process_rows)])
        self._where: dict[int, tuple[int, int]] = {}  # sample -> (process, tier)
        self._next: dict[int, int] = {}
        self._size = {(p, t): 0 for p in range(len(process_rows)) for t in (RAM, DISK)}
        self._next_step: int | None = None

    def plan_chunk(self, step_start: int, step_stop: int) -> list[ProcessPlan]:
        if self._next_step is not None and step_start != self._next_step:
            raise ValueError(f"chunks must be planned in order: expected step {self._next_step}, got {step_start}")
        self._next_step = step_stop
        n_cols, chunk_steps = len(self._columns), step_stop - step_start
        window = self.plan.samples(step_start, step_stop + self.lookahead_steps)[:, self._columns].ravel()
        never = np.iinfo(np.int64).max
        nxt = next_uses(window, never)
        first = {}
        for i in np.flatnonzero(np.isin(window, np.fromiter(self._where, np.int64, len(self._where)))):
            first.setdefault(int(window[i]), int(i))
        self._next = {s: first.get(s, never) for s in self._where}
        heaps = {key: [] for key in self._size}
        for s, key in self._where.items():
            heaps[key].append((-self._next[s], s))
        for h in heaps.values():
            heapq.heapify(h)

        n_pos = chunk_steps * n_cols
        stream = window[:n_pos]
        fetch_from = np.zeros(n_pos, np.int8)
        peer = np.full(n_pos, -1, np.int32)
        store = np.zeros(n_pos, np.int8)
        ops: dict[int, list] = {}
        where, next_of, size, caps = self._where, self._next, self._size, self.capacities
        procs = np.tile(self._proc_of_column, chunk_steps)

        def victim(key):  # the cached sample of (process, tier) needed furthest ahead; drops stale heap entries
            h = heaps[key]
            while h:
                neg, v = h[0]
                if where.get(v) == key and next_of[v] == -neg:
                    return v, -neg
                heapq.heappop(h)
            return None, -1

        def put(s, key, n):
            where[s], next_of[s] = key, n
            size[key] += 1
            heapq.heappush(heaps[key], (-n, s))

        def remove(s):
            size[where.pop(s)] -= 1
            del next_of[s]

        for i in range(n_pos):
            s, p, n = int(stream[i]), int(procs[i]), int(nxt[i])
            held = where.get(s)
            if held is not None:
                fetch_from[i] = held[1] if held[0] == p else PEER
                if held[0] != p:
                    peer[i] = held[0]
                next_of[s] = n
                heapq.heappush(heaps[held], (-n, s))
                continue
            ram, disk = (p, RAM), (p, DISK)
            if size[ram] < caps[p][0]:
                put(s, ram, n)
                store[i] = RAM
                continue
            v, v_next = victim(ram)
            if v is not None and v_next > n:  # the newcomer is needed sooner than RAM's furthest: v moves down
                my_ops = ops.setdefault(i, [])
                if size[disk] < caps[p][1]:
                    my_ops.append((DEMOTE, v, RAM))
                    remove(v)
                    put(v, disk, v_next)
                else:
                    w, w_next = victim(disk)
                    if w is not None and w_next > v_next:
                        my_ops += [(DROP, w, DISK), (DEMOTE, v, RAM)]
                        remove(w)
                        remove(v)
                        put(v, disk, v_next)
                    else:
                        my_ops.append((DROP, v, RAM))
                        remove(v)
                put(s, ram, n)
                store[i] = RAM
                continue
            if size[disk] < caps[p][1]:
                put(s, disk, n)
                store[i] = DISK
                continue
            w, w_next = victim(disk)
            if w is not None and w_next > n:
                ops.setdefault(i, []).append((DROP, w, DISK))
                remove(w)
                put(s, disk, n)
                store[i] = DISK
        return self._split(step_start, step_stop, stream, fetch_from, peer, store, ops)

    def _split(self, step_start, step_stop, stream, fetch_from, peer, store, ops) -> list[ProcessPlan]:
        n_cols, steps = len(self._columns), step_stop - step_start
        col_start = np.cumsum([0] + [hi - lo for lo, hi in self.process_rows])
        per_process_ops = [{} for _ in self.process_rows]
        for g, o in ops.items():  # global flat index -> (process, its local position)
            step, col = divmod(g, n_cols)
            p = int(self._proc_of_column[col])
            lo, hi = self.process_rows[p]
            per_process_ops[p][step * (hi - lo) + col - int(col_start[p])] = o
        plans = []
        for p, (lo, hi) in enumerate(self.process_rows):
            flat = (np.arange(steps)[:, None] * n_cols + np.arange(col_start[p], col_start[p + 1])).ravel()
            plans.append(
                ProcessPlan(
                    step_start,
                    step_stop,
                    (lo, hi),
                    stream[flat],
                    fetch_from[flat],
                    peer[flat],
                    store[flat],
                    per_process_ops[p],
                )
            )
        return plans


def planned_hit_rates(plans: list[ProcessPlan]) -> dict[str, float]:
    """Fractions of all accesses served by each tier, as planned."""
    fetch = np.concatenate([p.fetch_from for p in plans])
    return {TIER_NAMES[t]: float(np.mean(fetch == t)) for t in (RAM, DISK, PEER, SOURCE)}
