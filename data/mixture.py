"""A weighted, staged mixture of token datasets as an access plan: which source and which of its samples every
(step, row) of a run reads, computed from the seed in O(1) per position.

Why blocks: drawing each row's source independently would make "the k-th row of source s" a prefix count over the
whole run (O(step) to resume). Instead the row stream of a stage is cut into blocks of MIX_BLOCK rows; a block
holds exactly `quota_s` rows of source s (the weights apportioned to MIX_BLOCK by largest remainder), scattered
over the block by a seeded Feistel permutation. A row's source and its index into that source's stream then
follow from (stage, block, slot) alone: index = used before the stage + block x quota + slot offset. Source s's
stream visits its samples in a new seeded permutation each time it wraps (its "epoch").

Stages: weights change at given steps (annealing). A stage starts new blocks, so the last block of a stage may be
cut short; its unread slots are skipped, never reread (at most MIX_BLOCK indices per source and stage).

Resume: the plan's position is (step, the origin its stages count from). A resumed run whose weights or stages
differ from the checkpoint's continues from the checkpoint's per-source positions with the new weights from the
resumed step on (how annealing is done); the same weights reproduce the uninterrupted run bit for bit. Both are
ints in the loader's state, so any process count or layout resumes the same stream.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from pathlib import Path

import numpy as np

from data.access_plan import FeistelPermutation, mix64

MIX_BLOCK = 4096  # rows per block: a stage's realized proportions are exact to 1 / MIX_BLOCK over whole blocks


class MixtureError(ValueError):
    """A mixture or stage spec that cannot be used; the message names the problem."""


@dataclasses.dataclass(frozen=True)
class Component:
    name: str  # its metrics' suffix (data_mix/<name>, eval_loss/<name>): the directory's name
    path: str
    weight: float


def parse_mixture(spec: str) -> list[Component]:
    """`data.mixture`, "PATH:WEIGHT,PATH:WEIGHT" (a config file's {path: weight} dict becomes that string in
    DataConfig) -> components."""
    pairs = []
    for item in (s.strip() for s in spec.split(",")):
        path, sep, weight = item.rpartition(":")
        if not sep or not path.strip():
            raise MixtureError(f"data.mixture entry {item!r} is not PATH:WEIGHT")
        pairs.append((path.strip(), weight.strip()))
    components = [Component(_name(path), path, _weight(w, f"data.mixture weight of {path}")) for path, w in pairs]
    if len(components) < 2:
        raise MixtureError(f"data.mixture needs at least two datasets, got {len(components)}: use data.path for one")
    names = [c.name for c in components]
    for name in names:
        if names.count(name) > 1:
            same = [c.path for c in components if c.name == name]
            raise MixtureError(f"data.mixture datasets {same} share the name {name!r}: give them distinct directories")
    _check_weights([c.weight for c in components], "data.mixture")
    return components


def check_mixture(path: str, mixture: str, stages: str) -> None:
    """A data section's `path`, `mixture` and `mixture_stages` go together; MixtureError naming what does not."""
    if not mixture:
        if stages:
            raise MixtureError("data.mixture_stages needs data.mixture (the datasets whose weights it changes)")
        return
    if path:
        raise MixtureError("data.path and data.mixture are both set: give one dataset or a mixture")
    parse_stages(stages, len(parse_mixture(mixture)))


def parse_stages(spec: str, num_sources: int) -> list[tuple[int, tuple[float, ...]]]:
    """`data.mixture_stages`: "STEP:W,W;STEP:W,W" (weights in data.mixture's order) -> [(step, weights)] sorted."""
    stages = []
    for item in (s.strip() for s in spec.split(";") if s.strip()):
        step, sep, weights = item.partition(":")
        try:
            step = int(step)
        except ValueError:
            step = -1
        if not sep or step < 0:
            raise MixtureError(f"data.mixture_stages entry {item!r} is not STEP:W,W,... with a step >= 0")
        ws = tuple(_weight(w, f"data.mixture_stages weight in {item!r}") for w in weights.split(","))
        if len(ws) != num_sources:
            raise MixtureError(
                f"data.mixture_stages entry {item!r} has {len(ws)} weights for data.mixture's {num_sources} datasets"
            )
        _check_weights(ws, f"data.mixture_stages at step {step}")
        stages.append((step, ws))
    steps = [s for s, _ in stages]
    if len(set(steps)) != len(steps):
        raise MixtureError(f"data.mixture_stages names a step twice: {steps}")
    return sorted(stages)


def _name(path: str) -> str:
    return Path(os.path.normpath(path)).name or "data"


def _weight(raw, what: str) -> float:
    try:
        w = float(raw)
    except (TypeError, ValueError):
        raise MixtureError(f"{what} is {raw!r}, not a number") from None
    if not math.isfinite(w) or w < 0:
        raise MixtureError(f"{what} is {raw!r}; weights must be finite and >= 0")
    return w


def _check_weights(weights, what: str) -> None:
    if not sum(weights) > 0:
        raise MixtureError(f"{what}: every weight is 0; at least one dataset needs a positive weight")


def quotas(weights, block: int = MIX_BLOCK) -> np.ndarray:
    """Rows of each source in a block: `weights` apportioned to `block` by largest remainder (ties to the first)."""
    w = np.asarray(weights, np.float64) / sum(weights)
    exact = w * block
    q = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - q), kind="stable")
    q[order[: block - q.sum()]] += 1
    return q


def schedule_id(weights, stages) -> int:
    """A 62-bit id of the weights and stages (the plan's state says which schedule its origin was counted under)."""
    text = repr((tuple(float(w) for w in weights), tuple((int(s), tuple(map(float, ws))) for s, ws in stages)))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


@dataclasses.dataclass(frozen=True)
class _Segment:
    start_step: int
    quota: np.ndarray  # [S] rows per block
    used: np.ndarray  # [S] indices of each source's stream used before this segment


class MixturePlan:
    """Which sample of which source every (step, row) reads; sample ids are global (source s's sample i is
    `offsets[s] + i`), so the clairvoyant loader plans, caches and prefetches across sources as over one dataset."""

    def __init__(
        self,
        names: list[str],
        sizes: list[int],
        weights,
        *,
        global_batch: int,
        seed: int,
        stages=(),
        origin_step: int = 0,
        origin_used=None,
    ):
        if global_batch < 1 or seed < 0:
            raise ValueError(f"need global_batch >= 1 and seed >= 0, got {global_batch} and {seed}")
        if len(names) != len(sizes) or len(sizes) != len(weights) or min(sizes) < 1:
            raise ValueError(f"need one size >= 1 and one weight per source, got {sizes} and {list(weights)}")
        self.names, self.sizes = list(names), np.asarray(sizes, np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]])
        self.weights, self.stages = tuple(map(float, weights)), tuple((int(s), tuple(w)) for s, w in stages)
        self.global_batch, self.seed = global_batch, seed
        self.num_samples = int(self.sizes.sum())
        self.schedule = schedule_id(self.weights, self.stages)
        self.origin_step = int(origin_step)
        used = np.zeros(len(names), np.int64) if origin_used is None else np.asarray(origin_used, np.int64)
        self._segments = self._build_segments(used)

    def _weights_at(self, step: int):
        current = self.weights
        for start, weights in self.stages:
            if start <= step:
                current = weights
        return current

    def _build_segments(self, used: np.ndarray) -> list[_Segment]:
        starts = [self.origin_step] + [s for s, _ in self.stages if s > self.origin_step]
        segments = []
        for i, start in enumerate(starts):
            segments.append(_Segment(start, quotas(self._weights_at(start)), used))
            if i + 1 < len(starts):
                rows = (starts[i + 1] - start) * self.global_batch
                used = used + -(-rows // MIX_BLOCK) * segments[-1].quota  # a cut-short block counts whole
        return segments

    # ------------------------------------------------------------------ the AccessPlan interface

    @property
    def steps_per_epoch(self) -> int:
        """Steps that read as many rows as all sources hold (how far the cache planner looks ahead)."""
        return max(1, self.num_samples // self.global_batch)

    def locate(self, step_start: int, step_stop: int, rows: tuple[int, int] | None = None):
        """([steps, rows] source of each row, [steps, rows] its index into that source's stream)."""
        lo, hi = rows or (0, self.global_batch)
        if not 0 <= lo < hi <= self.global_batch:
            raise ValueError(f"rows must satisfy 0 <= lo < hi <= {self.global_batch}, got [{lo}, {hi})")
        if not self.origin_step <= step_start <= step_stop:
            raise ValueError(f"need {self.origin_step} (the plan's origin) <= step_start <= step_stop")
        steps = np.arange(step_start, step_stop)
        source = np.empty((len(steps), hi - lo), np.int64)
        index = np.empty_like(source)
        seg_of = np.searchsorted([g.start_step for g in self._segments], steps, side="right") - 1
        for g in np.unique(seg_of):
            seg, mine = self._segments[g], seg_of == g
            q = (steps[mine] - seg.start_step)[:, None] * self.global_batch + np.arange(lo, hi)
            block, slot = q // MIX_BLOCK, q % MIX_BLOCK
            for b in np.unique(block):  # one Feistel key per block
                at = block == b
                slot[at] = FeistelPermutation(MIX_BLOCK, self._block_key(seg.start_step, int(b)))(slot[at])
            ends = np.cumsum(seg.quota)
            src = np.searchsorted(ends, slot, side="right")
            source[mine] = src
            index[mine] = seg.used[src] + block * seg.quota[src] + slot - (ends - seg.quota)[src]
        return source, index

    def samples(self, step_start: int, step_stop: int, rows: tuple[int, int] | None = None) -> np.ndarray:
        """[steps, rows] global sample ids of steps [step_start, step_stop), rows [lo, hi) (default: all)."""
        source, index = self.locate(step_start, step_stop, rows)
        source, index = source.ravel(), index.ravel()
        epoch = index // self.sizes[source]
        out = np.empty_like(index)
        order = np.lexsort((epoch, source))  # one group per (source, epoch): a small source wraps often
        key = source[order] * (int(epoch.max(initial=0)) + 1) + epoch[order]
        bounds = np.flatnonzero(np.diff(key)) + 1
        for group in np.split(order, bounds) if order.size else []:
            s, e = int(source[group[0]]), int(epoch[group[0]])
            perm = FeistelPermutation(int(self.sizes[s]), self._source_key(s, e))
            out[group] = self.offsets[s] + perm(index[group] - e * self.sizes[s])
        return out.reshape(step_stop - step_start, -1)

    def fingerprint(self) -> str:
        """Identifies the stream (processes compare it before trusting each other's plans)."""
        return (
            f"mixture{MIX_BLOCK}:n={','.join(map(str, self.sizes))}:B={self.global_batch}:seed={self.seed}:"
            f"schedule={self.schedule}:origin={self.origin_step}:{','.join(map(str, self._segments[0].used))}"
        )

    def _block_key(self, segment_start: int, block: int) -> int:
        return int(mix64((self.seed * 0x9E3779B1 + segment_start * 1_000_003 + block) & 0xFFFFFFFFFFFFFFFF))

    def _source_key(self, source: int, epoch: int) -> int:
        salt = (0xD6E8FEB86659FD93 * (source + 1)) & 0xFFFFFFFFFFFFFFFF
        return int(mix64((self.seed * 1_000_003 + epoch) ^ salt))

    # ------------------------------------------------------------------ what it logs and resumes from

    def used_at(self, step: int) -> np.ndarray:
        """[S] indices of each source's stream used before `step` (a block in progress counts whole)."""
        seg = self._segments[int(np.searchsorted([g.start_step for g in self._segments], step, side="right")) - 1]
        rows = (step - seg.start_step) * self.global_batch
        return seg.used + -(-rows // MIX_BLOCK) * seg.quota

    def epochs_at(self, step: int) -> dict[str, int]:
        """Each source's epoch (how often its stream wrapped to a new seeded order) in the rows read before
        `step`: the highest index read so far (those of the block in progress, else the previous block's end)."""
        last = self.used_at(max(self.origin_step, step - 1)) - 1  # through the block the previous step ended
        if step > self.origin_step:
            g = int(np.searchsorted([s.start_step for s in self._segments], step - 1, side="right")) - 1
            seg = self._segments[g]
            block = (step - 1 - seg.start_step) * self.global_batch // MIX_BLOCK
            first = seg.start_step + block * MIX_BLOCK // self.global_batch
            last = seg.used + block * seg.quota - 1
            source, index = self.locate(first, step)
            np.maximum.at(last, source.ravel(), index.ravel())
        return {n: int(e) for n, e in zip(self.names, np.maximum(last, 0) // self.sizes)}

    def fractions(self, step_start: int, step_stop: int) -> dict[str, float]:
        """The share of the global batch's rows each source had over steps [step_start, step_stop)."""
        source, _ = self.locate(step_start, step_stop)
        counts = np.bincount(source.ravel(), minlength=len(self.names))
        return {n: float(c) / max(1, source.size) for n, c in zip(self.names, counts)}

    def state_at(self, step: int) -> dict[str, int]:
        """Ints for the loader's checkpoint state: this schedule and its origin, and each source's position."""
        state = {"mix_schedule": self.schedule, "mix_origin_step": self.origin_step}
        for name, origin, now in zip(self.names, self._segments[0].used, self.used_at(step)):
            state[f"mix_origin_used/{name}"] = int(origin)
            state[f"mix_used/{name}"] = int(now)
        return state

    def resumed(self, state: dict) -> MixturePlan:
        """The plan a run resumed at state["step"] follows: the checkpoint's own when its schedule is this one's,
        else this schedule from the resumed step on, each source continuing where the checkpoint left it (a
        source the checkpoint did not read starts at 0)."""
        step = int(state["step"])
        same = int(state.get("mix_schedule", -1)) == self.schedule and all(f"mix_used/{n}" in state for n in self.names)
        if same:
            origin, used = int(state["mix_origin_step"]), [int(state[f"mix_origin_used/{n}"]) for n in self.names]
        else:
            origin, used = step, [int(state.get(f"mix_used/{n}", 0)) for n in self.names]
        return MixturePlan(
            self.names,
            list(self.sizes),
            self.weights,
            global_batch=self.global_batch,
            seed=self.seed,
            stages=self.stages,
            origin_step=origin,
            origin_used=used,
        )
