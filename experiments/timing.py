"""Wall-clock timing shared by the benchmarks: the best of several runs of an already-compiled JAX function."""

from __future__ import annotations

import time

import jax


def best_time(fn, *args, repeats: int, warmup: int = 1) -> float:
    """Best wall time in seconds of ``fn(*args)`` over ``repeats`` runs, after ``warmup`` untimed calls (compile,
    caches); each run waits for its outputs with ``jax.block_until_ready``."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best
