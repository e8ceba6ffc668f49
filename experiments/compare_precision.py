"""Train tiny_lm with float32 matmuls and with quantized ones (same seed, data and steps) and compare the losses.

    python -m experiments.compare_precision                  # float32, fp8, int8: ~3 x 4-7 minutes on 2 CPU cores
    python -m experiments.compare_precision --steps 40 --precisions f32,fp8

Each precision trains in ROOT/NAME with `python -m experiments.tiny_lm` semantics, so a rerun resumes (or skips a
finished run) instead of starting over. Quantized runs use the precision on the attention and MLP projections
(the output head stays float32) with delayed scaling. Writes ROOT/loss_by_precision.png (train and eval loss of
every run in one plot), prints a table, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments.cli import exit_with
from experiments.tiny_lm import main as tiny_lm

PRECISIONS = {
    "f32": "default",
    "fp8": "attention=fp8,mlp=fp8",
    "int8": "attention=int8,mlp=int8",
    "int8_weight_only": "attention=int8_weight_only,mlp=int8_weight_only",
}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.compare_precision", description=__doc__.split("\n")[0])
    p.add_argument("--root", default="runs/compare_precision", help="one workdir per precision under this")
    p.add_argument("--precisions", default="f32,fp8,int8", help=f"comma list from {', '.join(PRECISIONS)}")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: tiny_lm's config)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override for every run")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.precisions.split(",") if n.strip()]
    unknown = [n for n in names if n not in PRECISIONS]
    if unknown or not names:
        p.error(f"--precisions: unknown {unknown or 'empty list'}; choose from {', '.join(PRECISIONS)}")
    if names[0] != "f32" and "f32" in names:
        names.remove("f32")
        names.insert(0, "f32")
    return args, names


def main(argv: list[str] | None = None) -> int:
    from jaxlm.metrics import read_metrics

    args, names = parse_args(argv)
    root = Path(args.root)
    curves = {}
    for name in names:
        flags = ["--workdir", str(root / name), "--set", f"model.matmul_precision={PRECISIONS[name]}"]
        flags += ["--steps", str(args.steps)] if args.steps else []
        flags += [a for s in args.set for a in ("--set", s)] + (["--no-progress"] if args.no_progress else [])
        print(f"== {name}: tiny_lm {' '.join(flags)}", file=sys.stderr)
        code = tiny_lm(flags)
        if code:
            return code
        curves[name] = read_metrics(root / name / "metrics.jsonl")

    final = {n: _final(records) for n, records in curves.items()}
    base = final.get("f32")
    print(
        f"{'precision':<18}{'matmuls (attention, mlp)':<52}{'final loss':>11}{'eval loss':>10}{'vs f32':>9}"
        f"{'tokens/s':>10}"
    )
    for name, f in final.items():
        gap = "" if base is None or name == "f32" else f"{100 * (f['eval_loss'] / base['eval_loss'] - 1):+.2f}%"
        print(
            f"{name:<18}{PRECISIONS[name]:<52}{f['loss']:>11.4f}{f['eval_loss']:>10.4f}{gap:>9}"
            f"{f['tokens_per_s']:>10.0f}"
        )
    plot(curves, root / "loss_by_precision.png")
    print(f"plot: {root / 'loss_by_precision.png'}")
    summary = {n: {"eval_loss": round(f["eval_loss"], 4), "loss": round(f["loss"], 4)} for n, f in final.items()}
    if base is not None:
        for n in summary:
            summary[n]["eval_gap_vs_f32"] = round(final[n]["eval_loss"] / base["eval_loss"] - 1, 5)
    print(json.dumps(summary))
    return 0


def _final(records: list[dict]) -> dict:
    """The last logged loss / eval loss / throughput of a run (throughput: median over logged steps)."""
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    rates = sorted(r["tokens_per_s"] for r in train[1:]) or [train[-1]["tokens_per_s"]]
    return {
        "loss": train[-1]["loss"],
        "eval_loss": evals[-1]["eval_loss"] if evals else float("nan"),
        "tokens_per_s": rates[len(rates) // 2],
    }


def plot(curves: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=110)
    for i, (name, records) in enumerate(curves.items()):
        color = f"C{i}"
        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
        ax.plot(*zip(*train), color=color, alpha=0.8, label=f"{name} train")
        if evals:
            ax.plot(*zip(*evals), color=color, marker="o", linestyle="--", label=f"{name} eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("tiny_lm: float32 vs quantized attention + MLP matmuls")
    ax.grid(alpha=0.3)
    ax.legend(ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


if __name__ == "__main__":
    exit_with(main())
