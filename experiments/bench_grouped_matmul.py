"""Time the MoE grouped matmul (jaxlm.grouped_matmul) against lax.ragged_dot and one plain product of the same FLOPs.

    python -m experiments.bench_grouped_matmul                      # 2048 rows x 256 -> 1024, 8 experts
    python -m experiments.bench_grouped_matmul --rows 8192 --experts 16

Rows are split evenly over the experts; the grouped versions include moving rows into their layout and back (as an
MoE layer does). Prints forward and forward + gradient milliseconds (best of --repeats after
a warmup) and each one's ratio to the plain product, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.cli import exit_with
from jaxlm.grouped_matmul import Groups


def _best_ms(fn, *args, repeats: int) -> float:
    fn = jax.jit(fn)
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench_grouped_matmul", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--width-in", type=int, default=256)
    p.add_argument("--width-out", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    A, I, O, X = args.rows, args.width_in, args.width_out, args.experts
    if min(A, I, O, X, args.repeats) < 1 or A % X:
        p.error("--rows, --width-in, --width-out, --experts and --repeats must be positive, rows a multiple of experts")
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(A, I)), jnp.float32)
    w = jnp.asarray(r.normal(size=(X, I, O)), jnp.float32)
    experts = jnp.repeat(jnp.arange(X), A // X)[:, None]  # one copy per row, A / X rows per expert

    def grouped(tiled):
        def fn(x, w):
            groups = Groups.of(experts, X, tiled)
            return groups.outputs(groups.matmul(groups.gather(x), w))[:, 0]

        return fn

    candidates = {"plain product": lambda x, w: x @ w[0], "ragged_dot": grouped(False), "tiles": grouped(True)}
    # a random cotangent: with sum()'s ones XLA simplifies the backward's products into reductions
    cotangent = jnp.asarray(r.normal(size=(A, O)), jnp.float32)
    rows = {}
    for name, fn in candidates.items():
        grad = jax.grad(lambda x, w, fn=fn: jnp.vdot(fn(x, w), cotangent), argnums=(0, 1))
        rows[name] = {"forward_ms": _best_ms(fn, x, w, repeats=args.repeats)}
        rows[name]["with_grad_ms"] = _best_ms(grad, x, w, repeats=args.repeats)
    base = rows["plain product"]
    print(f"{'':<15}{'forward ms':>12}{'x plain':>9}{'fwd+grad ms':>13}{'x plain':>9}")
    for name, row in rows.items():
        row["forward_vs_plain"] = row["forward_ms"] / base["forward_ms"]
        row["with_grad_vs_plain"] = row["with_grad_ms"] / base["with_grad_ms"]
        print(
            f"{name:<15}{row['forward_ms']:>12.2f}{row['forward_vs_plain']:>9.2f}"
            f"{row['with_grad_ms']:>13.2f}{row['with_grad_vs_plain']:>9.2f}"
        )
    print(json.dumps({"rows": A, "in": I, "out": O, "experts": X, "platform": jax.default_backend(), **rows}))
    return 0


if __name__ == "__main__":
    exit_with(main())
