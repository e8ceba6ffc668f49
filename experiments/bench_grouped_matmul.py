"""Time the experts' MLP of a dropless MoE layer (jaxlm.expert_swiglu) against one dense SwiGLU of the same FLOPs.

    python -m experiments.bench_grouped_matmul                      # 2048 rows, 256 -> 2 x 512 -> 256, 8 experts
    python -m experiments.bench_grouped_matmul --rows 8192 --experts 16

Each row goes to one random expert, a SwiGLU of --width-in -> 2 x --width -> --width-in; the dense peer is one
SwiGLU of the same widths over all the rows: the same FLOPs. The grouped versions include moving the rows into
their layout and back, as an MoE layer does: ``tiles`` is this platform's kernel (the CPU's expert loop, a GPU's
tile scan), ``ragged_dot`` TPU's. Prints forward and forward + gradient milliseconds (best of --repeats after a
warmup) and each one's ratio to the dense SwiGLU, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.cli import exit_with
from jaxlm.expert_swiglu import grouped_swiglu, swiglu_halves
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
    p.add_argument("--width", type=int, default=512, help="each expert's (and the dense SwiGLU's) hidden width")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    A, D, F, X = args.rows, args.width_in, args.width, args.experts
    if min(A, D, F, X, args.repeats) < 1:
        p.error("--rows, --width-in, --width, --experts and --repeats must be positive")
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(A, D)), jnp.float32)
    w_in = jnp.asarray(r.normal(size=(X, D, 2 * F)) * D**-0.5, jnp.float32)
    w_out = jnp.asarray(r.normal(size=(X, F, D)) * F**-0.5, jnp.float32)
    experts = jnp.asarray(r.integers(0, X, size=(A, 1)))

    def grouped(tiled):
        def fn(x, w_in, w_out):
            groups = Groups.of(experts, X, tiled)
            return groups.outputs(grouped_swiglu(groups, groups.gather(x), w_in, w_out))[:, 0]

        return fn

    candidates = {
        "dense SwiGLU": lambda x, w_in, w_out: swiglu_halves(x @ w_in[0]) @ w_out[0],
        "ragged_dot": grouped(False),
        "tiles": grouped(True),
    }
    # a random cotangent: with sum()'s ones XLA simplifies the backward's products into reductions
    cotangent = jnp.asarray(r.normal(size=(A, D)), jnp.float32)
    rows = {}
    for name, fn in candidates.items():
        grad = jax.grad(lambda *a, fn=fn: jnp.vdot(fn(*a), cotangent), argnums=(0, 1, 2))
        rows[name] = {"forward_ms": _best_ms(fn, x, w_in, w_out, repeats=args.repeats)}
        rows[name]["with_grad_ms"] = _best_ms(grad, x, w_in, w_out, repeats=args.repeats)
    base = rows["dense SwiGLU"]
    print(f"{'':<15}{'forward ms':>12}{'x dense':>9}{'fwd+grad ms':>13}{'x dense':>9}")
    for name, row in rows.items():
        row["forward_vs_dense"] = row["forward_ms"] / base["forward_ms"]
        row["with_grad_vs_dense"] = row["with_grad_ms"] / base["with_grad_ms"]
        print(
            f"{name:<15}{row['forward_ms']:>12.2f}{row['forward_vs_dense']:>9.2f}"
            f"{row['with_grad_ms']:>13.2f}{row['with_grad_vs_dense']:>9.2f}"
        )
    print(json.dumps({"rows": A, "in": D, "width": F, "experts": X, "platform": jax.default_backend(), **rows}))
    return 0


if __name__ == "__main__":
    exit_with(main())
