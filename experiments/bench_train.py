"""Training throughput benchmark: achieved model FLOP/s of the compiled train step / this machine's matmul peak.

    python -m experiments.bench_train                     # the gpt-bench config
    python -m experiments.bench_train --compare           # also the variants (scanned layers, 1 microbatch, ...)
    python -m experiments.bench_train --set model.dtype=bfloat16
    python -m experiments.bench_train --peer              # also PyTorch eager / torch.compile, and the ratio
    python -m experiments.bench_train --peer --nanogpt DIR  # ... and nanoGPT's own model.py beside the peer
    python -m experiments.bench_train --products          # also every matmul of the step timed alone

Both numbers are measured in the same run: the peak is the best of 5 float32 `jnp.dot` 2048x2048 products; the
step's model FLOPs are 6*N*tokens plus attention (12*L*H*E*T per token). The last line is a JSON summary.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.cli import exit_with
from experiments.step_products import print_products
from experiments.timing import best_time
from jaxlm.config import DataConfig, ModelConfig, OptimConfig, TrainConfig, apply_overrides, validate
from jaxlm.model import model_flops_per_token
from jaxlm.train import Program
from sharding import MeshLayout, build_mesh

GPT_BENCH = TrainConfig(
    model=ModelConfig(
        vocab_size=8192,
        d_model=384,
        num_layers=6,
        num_heads=6,
        num_kv_heads=6,
        mlp_dim=1024,
        max_seq_len=256,
        tie_embeddings=True,
        dtype="float32",
    ),
    optim=OptimConfig(learning_rate=1e-3, warmup_steps=10),
    data=DataConfig(seq_len=256, batch_size=16),
    steps=1000,
)

VARIANTS = {  # name -> --set overrides, measured against the library defaults in one run with --compare
    "library defaults": [],
    "scanned layers": ["model.scan_layers=true"],
    "one microbatch": ["data.microbatches=1"],
    "2 microbatches": ["data.microbatches=2"],
    "8 microbatches": ["data.microbatches=8"],
    "reference attention": ["model.attention_impl=reference"],
    "jax.nn.dot_product_attention": ["model.attention_impl=jax"],
    "remat full": ["model.remat=full"],
    "remat dots_no_batch": ["model.remat=dots_no_batch"],
    "the 2026-11-21 defaults": ["model.scan_layers=true", "model.attention_impl=reference", "data.microbatches=1"],
}


def matmul_peak_flops(n: int = 2048, repeats: int = 5) -> float:
    """Best-of-`repeats` float32 jnp.dot throughput on the default device."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    return 2 * n**3 / best_time(jax.jit(jnp.dot), a, b, repeats=repeats)


class CompiledStep:
    """One config's train step compiled for one device, with a fixed random batch, timed window by window: a
    benchmark that compares configs interleaves their windows, so a slow spell of a shared VM hits them alike."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.program = Program(cfg, build_mesh(MeshLayout(data=1), devices=jax.devices()[:1]))
        rng = np.random.default_rng(0)
        B, T, V = cfg.data.batch_size, cfg.data.seq_len, cfg.model.vocab_size
        tokens = rng.integers(0, V, size=(B, T + 1), dtype=np.int32)
        self.batch = self.program.device_batch(
            {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": np.ones((B, T), np.float32)}
        )
        self.state = self.program.init()
        t0 = time.perf_counter()
        self.step_fn = self.program.train_step.lower(self.state, self.batch).compile()
        self.compile_s = time.perf_counter() - t0
        self.state, self.metrics = self.step_fn(self.state, self.batch)
        self.first_loss = float(self.metrics["loss"])  # the warm-up step's; the batch repeats, so the loss must fall

    def window(self, steps: int) -> float:
        """Seconds per step over ``steps`` steps."""
        t0 = time.perf_counter()
        for _ in range(steps):
            self.state, self.metrics = self.step_fn(self.state, self.batch)
        jax.block_until_ready((self.state, self.metrics))
        return (time.perf_counter() - t0) / steps


def measure_train_step(
    cfg: TrainConfig, steps: int, windows: int, profile_dir: str | None = None, keep_hlo: bool = False
) -> dict:
    """Compiles the train step, runs a warm-up step, then times `windows` windows of `steps` steps; best window.
    `keep_hlo`: the result's "hlo" is the compiled step's optimized HLO text."""
    step = CompiledStep(cfg)
    best = min(step.window(steps) for _ in range(windows))
    if profile_dir:
        print_profile(step, profile_dir)
    T, B = cfg.data.seq_len, cfg.data.batch_size
    flops_per_token = model_flops_per_token(cfg.model, step.program.num_params, T)
    tokens_per_s = B * T / best
    return ({"hlo": step.step_fn.as_text()} if keep_hlo else {}) | {
        "params": step.program.num_params,
        "microbatches": step.program.microbatches,
        "mflop_per_token": flops_per_token / 1e6,
        "compile_s": step.compile_s,
        "step_s": best,
        "tokens_per_s": tokens_per_s,
        "model_gflops_per_s": tokens_per_s * flops_per_token / 1e9,
        "first_loss": step.first_loss,
        "loss": float(step.metrics["loss"]),
    }


def print_profile(step: CompiledStep, profile_dir: str, top: int = 15) -> None:
    """Traces one step with jax.profiler (view it with xprof / TensorBoard) and prints the kinds of op that took
    longest, summed over threads: the quickest way to see whether time goes to matmuls, layout copies or scan
    buffers."""
    from experiments.trace_times import op_times, trace
    from sharding.hlo import kernel_kinds

    path = trace(lambda: step.window(1), profile_dir)
    times, kinds = op_times(path), kernel_kinds(step.step_fn.as_text())
    per_kind: collections.Counter = collections.Counter()
    for op, ns in times.ns.items():
        per_kind[kinds.get(op, re.sub(r"\.\d+$", "", op))] += ns
    print(f"profile of one step ({path}), thread-time per op kind (total {sum(per_kind.values()) / 1e6:.0f} ms):")
    for name, ns in per_kind.most_common(top):
        print(f"  {ns / 1e6:9.1f} ms  {name}")
    print("slowest single ops:")
    for name, ns in times.ns.most_common(top):
        print(f"  {ns / 1e6:9.1f} ms  {name}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench_train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a gpt-bench field")
    p.add_argument("--steps", type=int, default=5, help="steps per timed window")
    p.add_argument("--windows", type=int, default=3, help="timed windows; the best is reported")
    p.add_argument("--compare", action="store_true", help="also measure the VARIANTS, in this same run")
    p.add_argument("--profile", metavar="DIR", help="trace one step of the first variant into DIR and print top ops")
    p.add_argument(
        "--products",
        action="store_true",
        help="also time every matrix product of the first variant's compiled step alone (experiments.step_products)",
    )
    p.add_argument(
        "--peer",
        action="store_true",
        help="also run bench_torch_reference (PyTorch eager and torch.compile) in this same run and print the ratio",
    )
    p.add_argument("--nanogpt", metavar="DIR", help="with --peer: a karpathy/nanoGPT checkout, timed beside the peer")
    args = p.parse_args(argv)
    if args.nanogpt and not args.peer:
        p.error("--nanogpt needs --peer")
    if args.steps < 1 or args.windows < 1:
        p.error("--steps and --windows must be >= 1")
    try:
        base = validate(apply_overrides(GPT_BENCH, args.set))
        variants = (
            {name: validate(apply_overrides(base, sets)) for name, sets in VARIANTS.items()}
            if args.compare
            else {"gpt-bench": base}
        )
    except ValueError as e:
        print(f"bench_train: error: {e}", file=sys.stderr)
        return 2

    if args.profile:  # before the backend starts: a GPU's kernels traced one by one, not inside CUDA graphs
        from experiments.trace_times import trace_kernels_one_by_one

        trace_kernels_one_by_one()
    device = jax.devices()[0]
    peak = matmul_peak_flops()
    print(
        f"device: {device.platform} ({device.device_kind}), {jax.device_count()} device(s); "
        f"jnp.dot float32 2048^2 peak: {peak / 1e9:.1f} GFLOP/s"
    )
    print(f"{'variant':34s} {'params':>7s} {'step s':>7s} {'tok/s':>8s} {'GFLOP/s':>8s} {'MFU':>6s} {'compile s':>9s}")
    results = {}
    for i, (name, cfg) in enumerate(variants.items()):
        first = i == 0
        r = measure_train_step(cfg, args.steps, args.windows, args.profile if first else None, args.products and first)
        r["mfu"] = r["model_gflops_per_s"] * 1e9 / peak
        results[name] = r
        print(
            f"{name:34s} {r['params'] / 1e6:6.2f}M {r['step_s']:7.3f} {r['tokens_per_s']:8.0f} "
            f"{r['model_gflops_per_s']:8.1f} {r['mfu']:6.3f} {r['compile_s']:9.1f}",
            flush=True,
        )
    head = next(iter(results.values()))
    summary = {
        "tokens_per_s": round(head["tokens_per_s"], 1),
        "model_gflops_per_s": round(head["model_gflops_per_s"], 2),
        "peak_gflops_per_s": round(peak / 1e9, 2),
        "mfu": round(head["mfu"], 4),
        "mflop_per_token": round(head["mflop_per_token"], 2),
        "params": head["params"],
        "microbatches": head["microbatches"],
        "device": device.device_kind,
    }
    if args.compare:
        summary["variants_mfu"] = {name: round(r["mfu"], 4) for name, r in results.items()}
        best = max(results, key=lambda name: results[name]["mfu"])
        summary["best_variant"] = {
            "name": best,
            "tokens_per_s": round(results[best]["tokens_per_s"], 1),
            "mfu": round(results[best]["mfu"], 4),
        }
    if args.products:
        summary["products"] = print_products(head["hlo"], peak, head["step_s"])
    if args.peer:
        summary["peer"] = measure_peer(head["tokens_per_s"], peak, args.steps, args.windows, args.nanogpt)
    print(json.dumps(summary))
    return 0


def measure_peer(tokens_per_s: float, peak: float, steps: int, windows: int, nanogpt: str | None = None) -> dict:
    """bench_torch_reference, eager and torch.compile, as subprocesses (one framework per process, as each runs
    alone), right after jaxlm's step on the same machine; this run's tokens/s over the faster peer's, and both
    frameworks' float32 matmul peaks (`peak` is jnp.dot's): how much of the ratio is the BLAS. `nanogpt`: a
    karpathy/nanoGPT checkout, timed beside the eager yardstick to show the yardstick runs at its speed."""
    peers, peaks, vs_nanogpt = {}, {}, None
    for mode, extra in (("torch eager", ["--nanogpt", nanogpt] if nanogpt else []), ("torch.compile", ["--compile"])):
        cmd = [
            sys.executable,
            "-m",
            "experiments.bench_torch_reference",
            "--steps",
            str(steps),
            "--windows",
            str(windows),
        ]
        proc = subprocess.run([*cmd, *extra], capture_output=True, text=True)
        if proc.returncode:
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            print(f"{mode:34s} failed: {last}", flush=True)
            continue
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        peers[mode], peaks[mode] = result["tokens_per_s"], result["peak_gflops_per_s"]
        vs_nanogpt = result.get("vs_nanogpt", vs_nanogpt)
        print(f"{mode:34s} {'':>7s} {'':>7s} {peers[mode]:8.0f} {'':>8s} {'':>6s}", flush=True)
    if not peers:
        return {}
    faster = max(peers, key=peers.get)
    ratio = tokens_per_s / peers[faster]
    torch_peak = max(peaks.values())
    print(
        f"matmul peaks, float32 2048^2: jnp.dot {peak / 1e9:.1f} GFLOP/s, torch.mm {torch_peak:.1f} GFLOP/s "
        f"({peak / 1e9 / torch_peak:.2f}x): the BLAS alone would give jaxlm that ratio"
    )
    if vs_nanogpt is not None:
        print(f"the yardstick runs at {vs_nanogpt:.3f}x nanoGPT's own model.py (eager, this run)")
    print(f"jaxlm / {faster}: {ratio:.2f}x (goal >= 1.0x; stretch 1.2x)")
    return {
        "tokens_per_s": {k: round(v, 1) for k, v in peers.items()},
        "faster": faster,
        "ratio": round(ratio, 3),
        "matmul_peak_gflops_per_s": {"jnp.dot": round(peak / 1e9, 2), "torch.mm": round(torch_peak, 2)},
    } | ({"yardstick_vs_nanogpt": vs_nanogpt} if vs_nanogpt is not None else {})


if __name__ == "__main__":
    exit_with(main())
