"""The whole future access order, computed from the seed in O(1) per position.

Epoch e visits the samples in the order of a keyed Feistel permutation of [0, n):
a bijection that is evaluated at any position without materializing it, so any
process can compute which sample any process (or worker) reads at any step of
any epoch. That is what makes the loader clairvoyant: its cache and prefetch
decisions are functions of this plan, and resuming needs only the step number.

Layout of a step: the global batch has `global_batch` rows; epoch e, step k,
row r reads sample ``perm_e(k * global_batch + r)``; the remainder of an epoch
(n mod global_batch samples) is dropped. Process p reads a contiguous block of
rows; its W fetch workers split that block's positions round-robin, which never
changes what a process reads, so a resume with another worker count is exact.
"""

from __future__ import annotations

import dataclasses

import numpy as np


def mix64(x) -> np.ndarray:
    """splitmix64's finalizer: a fast, well-mixed 64-bit hash (vectorized)."""
    with np.errstate(over="ignore"):
        z = np.asarray(x, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class FeistelPermutation:
    """A keyed bijection of [0, n), evaluated pointwise.

    A balanced Feistel network permutes [0, 4^h) for the smallest h with
    4^h >= n; values that land outside [0, n) are re-encrypted until they fall
    inside (cycle walking), which keeps it a bijection of [0, n). The domain is
    at most 4n, so a position needs under 4 passes on average.
    """

    def __init__(self, n: int, key: int, rounds: int = 4):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1 elements, got {n}")
        self.n, self.rounds = int(n), rounds
        self.half_bits = max(1, (max(1, (self.n - 1).bit_length()) + 1) // 2)
        self._mask = np.uint64((1 << self.half_bits) - 1)
        self._keys = [mix64((key + 0x632BE59BD9B4E019 * i) & 0xFFFFFFFFFFFFFFFF) for i in range(rounds)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half_bits)
        left, right = x >> shift, x & self._mask
        for k in self._keys:
            left, right = right, left ^ (mix64(right ^ k) & self._mask)
        return (left << shift) | right

    def __call__(self, positions) -> np.ndarray:
        """The permuted values of `positions` (ints in [0, n)), as int64."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= self.n):
            bad = int(pos.min()) if pos.min() < 0 else int(pos.max())
            raise IndexError(f"position {bad} is outside the permutation's range [0, {self.n})")
        y = self._encrypt(pos.astype(np.uint64))
        out = y >= np.uint64(self.n)
        while out.any():
            y[out] = self._encrypt(y[out])
            out = y >= np.uint64(self.n)
        return y.astype(np.int64)


@dataclasses.dataclass(frozen=True)
class AccessPlan:
    """Which sample every (step, row) of the run reads, for every epoch; steps count from 0 across epochs."""

    num_samples: int
    global_batch: int
    seed: int

    def __post_init__(self):
        if self.global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {self.global_batch}")
        if self.num_samples < self.global_batch:
            raise ValueError(
                f"the dataset has {self.num_samples} samples, fewer than one global batch of {self.global_batch}"
            )
        if self.seed < 0:
            raise ValueError(f"seed must be non-negative, got {self.seed}")

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def permutation(self, epoch: int) -> FeistelPermutation:
        return FeistelPermutation(self.num_samples, int(mix64((self.seed * 1_000_003 + epoch) & 0xFFFFFFFFFFFFFFFF)))

    def sample_at(self, step: int, row: int) -> int:
        """The sample read by `row` of the global batch at `step` (O(1))."""
        if not 0 <= row < self.global_batch:
            raise IndexError(f"row {row} is outside the global batch [0, {self.global_batch})")
        if step < 0:
            raise IndexError(f"step must be >= 0, got {step}")
        epoch, k = divmod(step, self.steps_per_epoch)
        return int(self.permutation(epoch)([k * self.global_batch + row])[0])

    def samples(self, step_start: int, step_stop: int, rows: tuple[int, int] | None = None) -> np.ndarray:
        """[steps, rows] sample ids of steps [step_start, step_stop), rows [lo, hi) (default: the whole batch)."""
        lo, hi = rows or (0, self.global_batch)
        if not 0 <= lo < hi <= self.global_batch:
            raise ValueError(f"rows must satisfy 0 <= lo < hi <= {self.global_batch}, got [{lo}, {hi})")
        if not 0 <= step_start <= step_stop:
            raise ValueError(f"need 0 <= step_start <= step_stop, got {step_start}, {step_stop}")
        out = np.empty((step_stop - step_start, hi - lo), np.int64)
        spe = self.steps_per_epoch
        step = step_start
        while step < step_stop:  # one vectorized call per epoch touched
            epoch, k = divmod(step, spe)
            stop = min(step_stop, (epoch + 1) * spe)
            ks = np.arange(k, k + stop - step)
            positions = ks[:, None] * self.global_batch + np.arange(lo, hi)
            out[step - step_start : stop - step_start] = self.permutation(epoch)(positions.ravel()).reshape(
                positions.shape
            )
            step = stop
        return out

    def fingerprint(self) -> str:
        """Identifies the stream; processes compare it before trusting each other's plans."""
        return f"feistel4:n={self.num_samples}:B={self.global_batch}:seed={self.seed}"

    def state_at(self, step: int) -> dict[str, int]:
        """What the loader's state needs besides the step to continue this stream: nothing (data.mixture's plan
        keeps its sources' positions)."""
        return {}

    def resumed(self, state: dict) -> AccessPlan:
        return self


def stream_state(plan, step: int) -> dict[str, int]:
    """A loader's checkpoint state at `step` of `plan`'s stream (an AccessPlan or a data.mixture.MixturePlan): the
    step, what identifies the stream, and what the plan needs to continue it. Every loader writes and reads this."""
    return {
        "seed": plan.seed,
        "step": step,
        "num_samples": plan.num_samples,
        "global_batch": plan.global_batch,
        **plan.state_at(step),
    }


def resume_step(plan, state: dict) -> int:
    """The step a `stream_state` resumes `plan`'s stream at; ValueError naming what does not match this plan."""
    missing = {"seed", "step"} - set(state)
    if missing:
        raise ValueError(f"loader state lacks {sorted(missing)}: {state}")
    expected = {"seed": plan.seed, "num_samples": plan.num_samples, "global_batch": plan.global_batch}
    for key, value in expected.items():
        if key in state and int(state[key]) != value:
            raise ValueError(f"loader state has {key}={int(state[key])} but this loader has {key}={value}")
    if int(state["step"]) < 0:
        raise ValueError(f"loader state step must be >= 0, got {state['step']}")
    return int(state["step"])


def process_rows(global_batch: int, process_index: int, process_count: int) -> tuple[int, int]:
    """Rows [lo, hi) of process p of P when processes split the batch into equal contiguous blocks."""
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"need 0 <= process_index < process_count, got {process_index} and {process_count}")
    if global_batch % process_count:
        raise ValueError(f"global batch_size={global_batch} is not divisible by process_count={process_count}")
    local = global_batch // process_count
    return process_index * local, (process_index + 1) * local


def checked_rows(start, stop, global_batch: int) -> tuple[int, int]:
    """(start, stop) as ints, if they are a non-empty row range [start, stop) of a global batch; set_rows checks."""
    start, stop = int(start), int(stop)
    if not 0 <= start < stop <= global_batch:
        raise ValueError(
            f"rows must be [start, stop) with 0 <= start < stop <= batch_size={global_batch}, got [{start}, {stop})"
        )
    return start, stop


def worker_positions(num_positions: int, worker: int, num_workers: int) -> np.ndarray:
    """The local positions (flattened step-major over a process's rows) that fetch worker w of W reads.

    Round-robin, so every worker count covers every position exactly once and
    the assembled batches do not depend on how many workers fetched them."""
    if num_workers < 1 or not 0 <= worker < num_workers:
        raise ValueError(f"need 0 <= worker < num_workers, got {worker} and {num_workers}")
    return np.arange(worker, num_positions, num_workers)
