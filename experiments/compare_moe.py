"""Train tiny_lm dense and as mixtures of experts at equal active parameters and equal tokens, and compare.

    python -m experiments.compare_moe                       # dense, moe_aux, moe_bias: ~3 x 4-8 minutes on 2 cores
    python -m experiments.compare_moe --steps 40 --variants dense,moe_bias
    python -m experiments.compare_moe --step-time           # compiled steps only, interleaved: ~3 minutes

The MoE variants replace every layer's SwiGLU (mlp_dim 1024) by 8 experts of 512, two per token: the same active
MLP parameters and FLOPs per token, 4x the MLP parameters. ``moe_aux`` balances load with the Switch / Mixtral aux
loss (softmax router), ``moe_bias`` with DeepSeek-V3's load-steering bias and no aux loss. Each variant trains in
ROOT/NAME with `python -m experiments.tiny_lm` semantics (a rerun resumes or skips a finished run). Prints eval loss
and bits per byte, tokens/s and the step time over dense's (equal active FLOPs), and the expert load at the end
(busiest expert over the mean, per layer); ends with one JSON line.

``--step-time`` trains nothing: it compiles each variant's train step (tiny_lm's config, a fixed random batch) and
times rounds of one window per variant, in turn, so that a slow spell of a shared VM hits every variant alike. It
prints each variant's best window and its median per-round ratio to dense: the step time the issue's goal is about,
without the loader, logging and evaluation that training throughput also counts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from experiments.cli import exit_with
from experiments.compare_precision import _final
from experiments.tiny_lm import main as tiny_lm

MOE = ["model.num_experts=8", "model.experts_per_token=2", "model.expert_mlp_dim=512"]
VARIANTS = {
    "dense": [],
    "moe_aux": [*MOE, "model.router=softmax", "model.moe_aux_loss=0.01"],
    "moe_bias": [*MOE, "model.router=sigmoid_bias", "model.moe_aux_loss=0"],
}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.compare_moe", description=__doc__.split("\n")[0])
    p.add_argument("--root", default="runs/compare_moe", help="one workdir per variant under this")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list from {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: tiny_lm's config)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override for every run")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--step-time", action="store_true", help="time the compiled steps, interleaved; no training")
    p.add_argument("--rounds", type=int, default=5, help="--step-time: rounds of one window per variant")
    p.add_argument("--window", type=int, default=3, help="--step-time: steps per window")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.window < 1:
        p.error("--rounds and --window must be >= 1")
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        p.error(f"--variants: unknown {unknown or 'empty list'}; choose from {', '.join(VARIANTS)}")
    return args, names


def main(argv: list[str] | None = None) -> int:
    from jaxlm.metrics import read_metrics

    args, names = parse_args(argv)
    if args.step_time:
        return step_time(names, args.set, args.rounds, args.window)
    root = Path(args.root)
    final = {}
    for name in names:
        flags = ["--workdir", str(root / name)] + [a for s in VARIANTS[name] + args.set for a in ("--set", s)]
        flags += (["--steps", str(args.steps)] if args.steps else []) + (["--no-progress"] if args.no_progress else [])
        print(f"== {name}: tiny_lm {' '.join(flags)}", file=sys.stderr)
        code = tiny_lm(flags)
        if code:
            return code
        records = read_metrics(root / name / "metrics.jsonl")
        final[name] = _final(records) | _routing(records)
    dense = final.get("dense")
    header = f"{'variant':<10}{'eval loss':>10}{'eval bpb':>10}{'tokens/s':>10}{'step / dense':>14}"
    print(f"{header}  load max/mean per layer")
    for name, f in final.items():
        ratio = f"{dense['tokens_per_s'] / f['tokens_per_s']:.2f}x" if dense else ""
        load = " ".join(f"{x:.2f}" for x in f.get("load_max_over_mean", []))
        print(f"{name:<10}{f['eval_loss']:>10.4f}{f['eval_bpb']:>10.4f}{f['tokens_per_s']:>10.0f}{ratio:>14}  {load}")
    summary = {n: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in f.items()} for n, f in final.items()}
    if dense:
        for n in summary:
            summary[n]["step_time_vs_dense"] = round(dense["tokens_per_s"] / final[n]["tokens_per_s"], 3)
    print(json.dumps(summary))
    return 0


def step_time(names: list[str], extra: list[str], rounds: int, window: int) -> int:
    """Each variant's compiled step time (best window) and, where dense is among them, the median over rounds of
    its window's time over dense's window of the same round."""
    from experiments.bench_train import CompiledStep
    from jaxlm.config import apply_overrides, load_config, validate
    from jaxlm.run_data import resolve_vocab

    base = load_config(Path(__file__).parent / "configs" / "tiny_lm.py")
    try:
        steps = {n: CompiledStep(validate(resolve_vocab(apply_overrides(base, VARIANTS[n] + extra)))) for n in names}
    except ValueError as e:  # a bad --set
        print(f"compare_moe: error: {e}", file=sys.stderr)
        return 2
    times = {n: [] for n in names}
    for _ in range(rounds):
        for n, step in steps.items():
            times[n].append(step.window(window))
    print(f"{'variant':<10}{'params':>9}{'step ms':>9}{'step / dense':>14}  (median of {rounds} interleaved rounds)")
    summary = {}
    for n, step in steps.items():
        ratio = statistics.median(t / d for t, d in zip(times[n], times["dense"])) if "dense" in times else None
        summary[n] = {"params": step.program.num_params, "step_ms": round(min(times[n]) * 1e3, 2)}
        summary[n]["step_time_vs_dense"] = round(ratio, 3) if ratio else None
        shown = f"{ratio:.2f}x" if ratio else ""
        print(f"{n:<10}{step.program.num_params / 1e6:>8.2f}M{min(times[n]) * 1e3:>9.1f}{shown:>14}")
    print(json.dumps({"step_time": summary, "rounds": rounds, "window": window}))
    return 0


def _routing(records: list[dict]) -> dict:
    """Eval bits per byte, and the last logged load of the busiest expert over the mean, per MoE layer."""
    evals = [r for r in records if "eval_bits_per_byte" in r]
    out = {"eval_bpb": evals[-1]["eval_bits_per_byte"] if evals else float("nan")}
    logged = [r for r in records if "moe_load_max_over_mean/0" in r]
    if logged:
        last = logged[-1]
        layers = sorted(int(k.split("/")[1]) for k in last if k.startswith("moe_load_max_over_mean/"))
        out["load_max_over_mean"] = [round(last[f"moe_load_max_over_mean/{i}"], 3) for i in layers]
    return out


if __name__ == "__main__":
    exit_with(main())
