"""Where the GPU report's ~1B train step spends its device time, kind of kernel by kind, for several variants of it
traced in one run, and how each variant's kinds differ from the first's.

    python -m experiments.step_profile            # on a GPU: cuDNN (layers unrolled, scanned) against Pallas attention
    python -m experiments.step_profile --variant "attention jax, matmuls fp8" \\
        --variant "attention jax, matmuls fp8 pallas, e4m3 gradients"
    python -m experiments.step_profile --quick    # the tiny model: the code paths, on a CPU in seconds

Why: on an H100 (2026-11-28) the step with Pallas attention ran 4.5 ms slower than cuDNN's, yet its attention
kernels, timed alone at the step's shape, are 1.0-2.4 ms faster (docs/results/hopper-h100-2026-11-28.md): the time
goes somewhere else, and a trace says where. Variants are ``experiments.gpu_report.TRAIN_VARIANTS``' names. Kinds
are ``sharding.hlo.kernel_kinds``' (the custom kernels by name, a Pallas kernel with its own, e.g. the attention's
forward, dQ and dK/dV apart; cuBLAS, XLA's GEMM fusions, the rest by instruction name). Each variant is timed
untraced first; its kernels' time is per step, from ``--steps`` traced steps. Then its attention alone (one layer's
forward + backward at the step's shape, the model's own call) is traced too, and its kinds, times the layers, are
printed beside the same kinds in the step: whether the kernels run slower inside the step is then read off one run.
Exit 2 when a variant is unknown.

On a GPU the steps run without CUDA graphs (XLA's command buffers): a kernel traced inside one names the graph's
call, not its own instruction, so the 2026-11-28 H200 trace placed none of its kernels. Step times here are
therefore a little apart from the report's, which keeps the graphs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from collections import Counter

import jax

from experiments.cli import exit_with

DEFAULT_VARIANTS = (
    "attention jax, matmuls default",
    "attention jax, matmuls default, layers scanned",
    "attention pallas, matmuls default",
    "attention pallas (dQ summed across programs), matmuls default",
)


def profile_variant(cfg, steps: int, trace_dir: str) -> dict:
    """One config's step: untraced seconds a step, per kind and per instruction the device time a step, and its
    attention alone (``attention_alone``)."""
    from experiments.bench_train import CompiledStep

    step = CompiledStep(cfg)
    step_s = min(step.window(steps) for _ in range(2))
    by_kind, times, kinds = kind_times(step.step_fn.as_text(), lambda: step.window(steps), steps, trace_dir)
    top = sorted(((ns / steps, op) for op, ns in times.ns.items() if op in kinds), reverse=True)
    return {
        "step_ms": step_s * 1e3,
        "kernels_ms": sum(by_kind.values()) / 1e6,
        "source": times.source,
        "kinds_ms": {kind: ns / 1e6 for kind, ns in by_kind.most_common()},
        "top_ops": [
            {"op": op, "kind": kinds[op], "kernel": times.kernel_names.get(op, ""), "ms": ns / 1e6}
            for ns, op in top[:40]
        ],
        "alone": attention_alone(cfg, steps, f"{trace_dir}-alone"),
    }


def kind_times(hlo: str, run, calls: int, trace_dir: str):
    """(nanoseconds per kind of kernel a call, the trace's ``OpTimes``, instruction -> kind) of the program whose
    optimized HLO is ``hlo``, traced over ``run()``, which makes ``calls`` calls of it."""
    from experiments.trace_times import op_times, trace
    from sharding.hlo import kernel_kinds

    module = re.search(r"^HloModule ([\w.\-]+)", hlo, re.M)
    kinds = kernel_kinds(hlo)
    times = op_times(trace(run, trace_dir), module.group(1) if module else None, known=set(kinds))
    if times.source == "device kernels":  # events named by their CUDA kernel, not an instruction
        kinds = {op: "kernel " + re.sub(r"[_.]?\d+$", "", op)[:60] for op in times.ns}
    by_kind: Counter = Counter()
    for op, ns in times.ns.items():
        if op in kinds:  # control flow and ops of other programs launch nothing of the program's
            by_kind[kinds[op]] += ns / calls
    return by_kind, times, kinds


def attention_alone(cfg, calls: int, trace_dir: str) -> dict:
    """One layer's attention, forward + backward, at the step's shape and with the model's own call of it, traced
    alone: its device time per kind, times the layers a step has. Why: the step's attention kinds inside the step
    against these, in one run, say whether the kernels run slower inside the step or the time goes elsewhere."""
    import jax.numpy as jnp

    from jaxlm.model import attend

    m = cfg.model
    B, T, H, K, E = cfg.data.batch_size, cfg.data.seq_len, m.num_heads, m.num_kv_heads, m.resolved_head_dim
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, d_out = (
        jax.random.normal(key, (B, T, heads, E), jnp.dtype(m.dtype)) for key, heads in zip(keys, (H, K, K, H))
    )

    def loss(q, k, v):
        return jnp.vdot(attend(m, q, k, v).astype(jnp.float32), d_out.astype(jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()

    def run():
        for _ in range(calls):
            jax.block_until_ready(grads(q, k, v))

    run()
    by_kind, times, _ = kind_times(grads.as_text(), run, calls, trace_dir)
    layers = m.num_layers
    return {
        "layers": layers,
        "source": times.source,
        "kinds_ms": {kind: ns * layers / 1e6 for kind, ns in by_kind.most_common()},
    }


def report(results: dict[str, dict], top: int) -> list[str]:
    """Each variant's step, its kernels' time and largest kinds; then each later variant's kinds against the first's,
    largest differences first."""
    lines = []
    for name, r in results.items():
        lines.append(f"{name}: step {r['step_ms']:.1f} ms, kernels {r['kernels_ms']:.1f} ms a step ({r['source']})")
        lines += [f"  {ms:9.2f} ms  {kind}" for kind, ms in list(r["kinds_ms"].items())[:top]]
    first, *others = results
    base = results[first]
    for name in others:
        r = results[name]
        lines.append(
            f"{name} - {first}: step {r['step_ms'] - base['step_ms']:+.1f} ms, "
            f"kernels {r['kernels_ms'] - base['kernels_ms']:+.1f} ms"
        )
        kinds = set(r["kinds_ms"]) | set(base["kinds_ms"])
        diff = {k: r["kinds_ms"].get(k, 0.0) - base["kinds_ms"].get(k, 0.0) for k in kinds}
        for kind in sorted(diff, key=lambda k: (-abs(diff[k]), k))[:top]:
            was, now = base["kinds_ms"].get(kind, 0.0), r["kinds_ms"].get(kind, 0.0)
            lines.append(f"  {diff[kind]:+9.2f} ms  {kind} ({was:.2f} -> {now:.2f})")
    for name, r in results.items():
        if alone := r.get("alone"):
            total = sum(alone["kinds_ms"].values())
            lines.append(f"{name}: its attention alone, x{alone['layers']} layers: {total:.1f} ms a step")
            lines += [
                f"  {ms:9.2f} ms alone, {r['kinds_ms'].get(kind, 0.0):9.2f} ms in the step  {kind}"
                for kind, ms in list(alone["kinds_ms"].items())[:top]
            ]
    for name, r in results.items():
        lines.append(f"{name}: slowest instructions")
        lines += [f"  {o['ms']:9.2f} ms  {o['op']} ({o['kind']}) {o['kernel'][:80]}" for o in r["top_ops"][:top]]
    return lines


def main(argv=None) -> int:
    from experiments.gpu_report import TRAIN_VARIANTS, llama_1b, llama_tiny, with_model

    p = argparse.ArgumentParser(
        prog="python -m experiments.step_profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--variant",
        action="append",
        metavar="NAME",
        help="a gpu_report train variant; repeat it; the first is the base",
    )
    p.add_argument("--steps", type=int, default=3, help="steps a window, traced and untraced (3)")
    p.add_argument("--top", type=int, default=12, help="kinds and instructions listed per variant (12)")
    p.add_argument("--quick", action="store_true", help="the tiny model instead of the ~1B one")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    p.add_argument("--trace-dir", metavar="DIR", help="keep the traces here (default: a temporary folder)")
    args = p.parse_args(argv)
    names = tuple(args.variant or DEFAULT_VARIANTS)
    unknown = [n for n in names if n not in TRAIN_VARIANTS]
    if unknown:
        p.error(f"unknown variant {unknown[0]!r}; known: {'; '.join(TRAIN_VARIANTS)}")
    if args.steps < 1 or args.top < 1:
        p.error("--steps and --top must be >= 1")

    from experiments.trace_times import trace_kernels_one_by_one
    from jaxlm.config import validate

    trace_kernels_one_by_one()
    base = llama_tiny() if args.quick else llama_1b()
    device = jax.devices()[0]
    print(f"step_profile: {device.device_kind} ({device.platform}), jax {jax.__version__}, {args.steps} steps a window")
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            cfg = validate(with_model(base, TRAIN_VARIANTS[name]))
            t0 = time.perf_counter()
            results[name] = profile_variant(cfg, args.steps, f"{args.trace_dir or scratch}/{len(results)}")
            print(f"done {name} ({time.perf_counter() - t0:.1f} s)", flush=True)
            if args.json:  # after every variant: a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    meta = {"device": device.device_kind, "jax": jax.__version__, "xla_flags": os.environ["XLA_FLAGS"]}
                    json.dump({**meta, "variants": results}, f, indent=1)
    print("\n".join(report(results, args.top)))
    return 0


if __name__ == "__main__":
    exit_with(main())
