"""How long each place takes to hand over one sample, learned while the loader runs.

The placement plan says where a sample *is* (this process's RAM or disk, a
peer's cache, or only the source); this model says where it is *fastest to read
from*, and whether the loader as a whole keeps up with training:

- `route` sends a chunk's planned disk or peer reads to the source instead when
  that tier has been measured `slack` times slower than the source (a slow
  network disk, a failing peer). The slack keeps marginal cases on the cache:
  a read from the shared source also costs every other reader bandwidth,
  which one request's time does not show. A tier routed away is still probed
  every `probe_every`-th read, so its estimate follows it when it recovers.
- `predict_batch_s` is the time the loader needs per batch at a given tier mix:
  remote reads overlap on the fetch workers (their request times divided by
  the worker count), but all Python work holds one interpreter lock: the
  assembler's per-sample time plus the workers' CPU time per remote read is a
  serial path. The slower of the two sets the pace. Compared with the
  consumer's measured step time it tells whether the tiers can keep up
  (`keeps_up`), which is when stalls should be near zero.

Estimates are exponential moving averages of measured request times, seeded
with priors that put the tiers in their usual order.
"""

from __future__ import annotations

import threading

import numpy as np

from data.cache_plan import DISK, PEER, RAM, SOURCE, TIER_NAMES

PRIOR_S = {RAM: 2e-6, DISK: 1e-4, PEER: 1e-3, SOURCE: 1e-2}  # before any measurement: the usual order


class TierModel:
    """Per-tier seconds per sample (EWMA of observations), the consumer's step time, and what follows from them."""

    def __init__(
        self,
        *,
        smoothing: float = 0.05,
        probe_every: int = 64,
        slack: float = 10.0,
        prior_s: dict[int, float] | None = None,
    ):
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if not slack >= 1:
            raise ValueError(f"slack must be >= 1, got {slack}")
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        self.smoothing, self.probe_every, self.slack = smoothing, probe_every, slack
        self._estimate = dict(PRIOR_S if prior_s is None else prior_s)
        self._observed = dict.fromkeys(TIER_NAMES, 0)
        self._assembler_s: float | None = None  # assembler time per sample, local reads included
        self._worker_cpu_s: float | None = None  # CPU time a fetch worker spends per remote read
        self._step_s: float | None = None  # the consumer's time per batch, excluding its waits for data
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ learning

    def observe(self, tier: int, seconds: float) -> None:
        """One request to `tier` took `seconds` (from asking to having the row)."""
        with self._lock:
            self._estimate[tier] = self._ewma(self._estimate[tier] if self._observed[tier] else None, seconds)
            self._observed[tier] += 1

    def observe_worker_cpu(self, seconds: float) -> None:
        with self._lock:
            self._worker_cpu_s = self._ewma(self._worker_cpu_s, seconds)

    def observe_assembler(self, seconds_per_sample: float) -> None:
        with self._lock:
            self._assembler_s = self._ewma(self._assembler_s, seconds_per_sample)

    def observe_step(self, seconds: float) -> None:
        """The consumer spent `seconds` on a batch (between taking it and asking for the next)."""
        with self._lock:
            self._step_s = self._ewma(self._step_s, seconds)

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def estimate(self, tier: int) -> float:
        with self._lock:
            return self._estimate[tier]

    # ------------------------------------------------------------------ deciding and predicting

    def route(self, fetch_from: np.ndarray) -> np.ndarray:
        """Where to read each position from: the plan's place, or the source where that is `slack`x faster.
        Every `probe_every`-th read of a routed-away tier still goes there, to keep measuring it."""
        routed = fetch_from.copy()
        source_s = self.estimate(SOURCE)
        for tier in (DISK, PEER):
            if self.estimate(tier) > self.slack * source_s:
                positions = np.flatnonzero(fetch_from == tier)
                keep = np.zeros(len(positions), bool)
                keep[:: self.probe_every] = True
                routed[positions[~keep]] = SOURCE
        return routed

    def predict_batch_s(self, tier_counts: dict[int, int], workers: int) -> float:
        """Seconds to produce one batch that reads tier_counts[t] samples from tier t."""
        with self._lock:
            est = dict(self._estimate)
            assembler, worker_cpu = self._assembler_s or 0.0, self._worker_cpu_s or 0.0
        n_local = sum(tier_counts.get(t, 0) for t in (RAM, DISK))
        n_remote = sum(tier_counts.get(t, 0) for t in (PEER, SOURCE))
        local = sum(tier_counts.get(t, 0) * est[t] for t in (RAM, DISK))
        serial = max(local, assembler * (n_local + n_remote)) + worker_cpu * n_remote
        remote = sum(tier_counts.get(t, 0) * est[t] for t in (PEER, SOURCE)) / workers
        return max(serial, remote)

    def keeps_up(self, predicted_batch_s: float) -> bool | None:
        """Whether the loader produces batches at least as fast as the consumer takes them (None: no step yet)."""
        with self._lock:
            step_s = self._step_s
        return None if step_s is None else predicted_batch_s <= step_s

    def metrics(self, tier_counts: dict[int, int], workers: int) -> dict[str, float]:
        predicted = self.predict_batch_s(tier_counts, workers)
        keeps_up = self.keeps_up(predicted)
        with self._lock:
            out = {f"data_est_{TIER_NAMES[t]}_s": v for t, v in self._estimate.items()}
            step_s = self._step_s
        out["data_model_batch_s"] = predicted
        if keeps_up is not None:  # absent until the consumer has taken a step
            out["data_model_step_s"], out["data_model_keeps_up"] = step_s, float(keeps_up)
        return out
