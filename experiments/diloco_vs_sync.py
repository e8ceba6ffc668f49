"""DiLoCo vs synchronous data parallelism at equal tokens and equal global batch, on the default corpus.

    python -m experiments.diloco_vs_sync                    # the full sweep (~40 runs; rerun to continue it)
    python -m experiments.diloco_vs_sync --quick            # H=30, outer lr {0.4, 0.7}: a few minutes
    python -m experiments.diloco_vs_sync --steps 600 --set model.d_model=128
    python -m experiments.diloco_vs_sync --warm-start 300   # DiLoCo continues a 300-step data-parallel run
    python -m experiments.diloco_vs_sync --warm-start 300 --inner-steps 30,100 --outer-lrs 0.4,0.7,1.0 \\
        --set model.d_model=128 --set model.mlp_dim=512 --set data.batch_size=32   # 1.03M params: the README's targets

Every run trains the same small model from the same init for the same steps on the same global batch B: data
parallel takes one AdamW step per batch; DiLoCo's M replicas each take inner AdamW steps on B/M rows and sync every
H steps with outer Nesterov SGD. The sweep covers M in {1, 2, 4} x H in {10, 30, 100} x outer lr in
{0.2, 0.4, 0.7, 1.0}, then (at M=4, H=30 and that cell's best outer lr) 4-bit outer gradients, streaming with 2
fragments, and a replica lost for the second half of the DiLoCo steps. Each run lives in WORKDIR/NAME and is
skipped when complete, so an interrupted sweep continues. Prints a table (final eval loss, % gap to data parallel,
bytes each replica sent), writes WORKDIR/eval_loss.png, and ends with one JSON line. With --warm-start W every run
continues the same W-step data-parallel run (in WORKDIR/warm_start_W), as DiLoCo continues a pretrained model in
the paper.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from experiments.cli import exit_with
from jaxlm.config import DataConfig, DiLoCoConfig, ModelConfig, OptimConfig, TrainConfig, apply_overrides, validate
from jaxlm.metrics import read_metrics

SMALL = TrainConfig(
    model=ModelConfig(
        vocab_size=384,
        d_model=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        mlp_dim=256,
        max_seq_len=64,
        scan_layers=False,
    ),
    optim=OptimConfig(learning_rate=3e-3, warmup_steps=30, min_lr_ratio=0.1, weight_decay=0.1, grad_clip=1.0),
    data=DataConfig(seq_len=64, batch_size=16, val_fraction=0.01, eval_batches=8, loader="simple"),
    steps=600,
    log_every=50,
    eval_every=50,
    checkpoint_every=0,
    tensorboard=False,
)
REPLICAS, INNER_STEPS, OUTER_LRS = (1, 2, 4), (10, 30, 100), (0.2, 0.4, 0.7, 1.0)


def runs(grid: dict, steps: int, best_lr: dict | None = None, start: int = 0) -> list[tuple[str, DiLoCoConfig | None]]:
    """(name, DiLoCo config or None for data parallel). The variants use the largest M, H = 30 (or the grid's
    first H) and that cell's best outer lr; the lost replica is down for the second half of the DiLoCo phase
    (steps start+1..steps)."""
    out = [("data_parallel", None)]
    mom, suffix = grid["momentum"], _suffix(grid)
    out += [
        (grid_name(m, h, lr, suffix), DiLoCoConfig(replicas=m, inner_steps=h, outer_lr=lr, outer_momentum=mom))
        for m in grid["replicas"]
        for h in grid["inner_steps"]
        for lr in grid["outer_lrs"]
    ]
    if best_lr is not None:
        m, h = variant_cell(grid)
        base = DiLoCoConfig(replicas=m, inner_steps=h, outer_lr=best_lr[m, h], outer_momentum=mom)
        tag = f"M{m}_H{h}{suffix}"
        out += [
            (f"{tag}_int4", dataclasses.replace(base, compression="int4")),
            (f"{tag}_stream2", dataclasses.replace(base, fragments=2, overlap_steps=min(1, h // 2 - 1))),
        ]
        if m > 1:  # one replica cannot be lost
            out.append((f"{tag}_drop1", dataclasses.replace(base, drop=f"{m - 1}@{(start + steps) // 2 + 1}-{steps}")))
    return out


def grid_name(m: int, h: int, lr: float, suffix: str) -> str:
    """The name (and workdir) of one grid run."""
    return f"M{m}_H{h}_lr{lr}{suffix}"


def _suffix(grid: dict) -> str:
    """Runs with a non-default outer momentum get their own names (and workdirs)."""
    mom = grid["momentum"]
    return "" if mom == DiLoCoConfig.outer_momentum else f"_mom{mom}"


def variant_cell(grid: dict) -> tuple[int, int]:
    hs = grid["inner_steps"]
    return max(grid["replicas"]), (30 if 30 in hs else hs[0])


def train(name: str, cfg: TrainConfig, workdir: Path, warm: Path | None = None):
    """Trains (or continues, or skips) one run; returns (its metrics records, its program). `warm`: a data-parallel
    run whose final checkpoint the run continues from (every DiLoCo replica starts from its params and optimizer
    state)."""
    import jax

    from jaxlm.run_data import open_run_data
    from jaxlm.trainer import Trainer
    from sharding import MeshLayout, build_mesh

    run_dir = workdir / name
    train_iter, eval_data = open_run_data(cfg)
    mesh = build_mesh(MeshLayout(), devices=jax.devices()[:1])
    if warm is not None and not (run_dir / "checkpoints").is_dir():
        _start_from(warm, cfg, mesh, run_dir)
    trainer = Trainer(cfg, mesh, run_dir, train_iter, eval_data, progress=False)
    trainer.run()
    return read_metrics(run_dir / "metrics.jsonl"), trainer.program


def _start_from(warm: Path, cfg: TrainConfig, mesh, run_dir: Path) -> None:
    """Writes `run_dir`'s first checkpoint: the warm run's last state, converted to this run's program, with its
    data position and its metrics so far (so curves cover the whole run)."""
    import shutil

    from jaxlm.checkpoint import Checkpointer
    from jaxlm.config import to_dict
    from jaxlm.train import Program
    from jaxlm.trainer import make_program

    source = Checkpointer(warm / "checkpoints")
    step = source.latest_step()
    plain = Program(dataclasses.replace(cfg, diloco=DiLoCoConfig()), mesh)
    state, data_state, _ = source.restore(step, plain.abstract_with_shardings())
    source.close()
    run_dir.mkdir(parents=True, exist_ok=True)
    target = Checkpointer(run_dir / "checkpoints", async_save=False)
    target.save(step, make_program(cfg, mesh).adopt(state), data_state, to_dict(cfg))
    target.close()
    shutil.copy(warm / "metrics.jsonl", run_dir / "metrics.jsonl")


def summarize(records: list[dict], program, start: int = 0) -> dict:
    """Final eval loss, the eval curve, and the syncs and bytes of the steps after `start` (a warm start's
    data-parallel steps are the same for every run and are not counted)."""
    cfg = program.cfg
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    final = [r for r in records if "loss" in r][-1]
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    syncs, sent = final.get("diloco_syncs", cfg.steps - start), final.get("diloco_bytes")
    if start and cfg.diloco.replicas:
        syncs, sent = _traffic_after(program, start)
    return {
        "eval_loss": evals[-1][1],
        "curve": [(s * tokens_per_step, e) for s, e in evals],
        "bytes": sent,
        "syncs": syncs,
        "peak_sync_bytes": final.get("diloco_peak_sync_bytes"),
    }


def _traffic_after(program, start: int) -> tuple[int, int]:
    """(syncs, bytes one replica sends) of a DiLoCo program over steps start+1..steps (metrics.jsonl counts from
    step 1)."""
    schedule = program.sync_schedule
    counts = [n - m for n, m in zip(schedule.sync_counts(program.cfg.steps), schedule.sync_counts(start))]
    return sum(counts), sum(n * b for n, b in zip(counts, program.sync_bytes))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.diloco_vs_sync",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workdir", default="runs/diloco_vs_sync")
    p.add_argument("--steps", type=int, default=SMALL.steps)
    p.add_argument("--quick", action="store_true", help="H=30 and outer lr {0.4, 0.7} only")
    p.add_argument("--replicas", default=",".join(map(str, REPLICAS)), help="comma-separated M values")
    p.add_argument("--inner-steps", default=",".join(map(str, INNER_STEPS)), help="comma-separated H values")
    p.add_argument("--outer-lrs", default=",".join(map(str, OUTER_LRS)), help="comma-separated outer lrs")
    p.add_argument(
        "--outer-momentum",
        type=float,
        default=DiLoCoConfig.outer_momentum,
        help="outer Nesterov momentum of every DiLoCo run (default %(default)s, the paper's)",
    )
    p.add_argument(
        "--warm-start",
        type=int,
        default=0,
        metavar="W",
        help="train data parallel for W steps first; every run then continues from there (the paper "
        "starts DiLoCo from a pretrained model); 0: all runs from scratch",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override the base config")
    args = p.parse_args(argv)
    try:
        grid = {
            "replicas": _ints(args.replicas, "--replicas"),
            "inner_steps": _ints(args.inner_steps, "--inner-steps"),
            "outer_lrs": [float(x) for x in _items(args.outer_lrs, "--outer-lrs")],
            "momentum": args.outer_momentum,
        }
        if args.quick:
            grid.update(inner_steps=[30], outer_lrs=[0.4, 0.7])
        base = validate(apply_overrides(dataclasses.replace(SMALL, steps=args.steps), args.set))
        if not 0 <= args.warm_start < base.steps:
            raise ValueError(f"--warm-start must be in [0, --steps = {base.steps}), got {args.warm_start}")
        if args.warm_start:  # one lr schedule over the whole run, whichever run it is part of
            base = dataclasses.replace(base, optim=dataclasses.replace(base.optim, decay_steps=base.steps))
    except ValueError as e:
        print(f"diloco_vs_sync: error: {e}", file=sys.stderr)
        return 2
    workdir = Path(args.workdir)
    results: dict[str, dict] = {}
    warm = None
    if args.warm_start:  # its own directory: run names are those of the runs from scratch
        workdir = workdir / f"warm_start_{args.warm_start}"
        warm = workdir / "pretrain"
        train(warm.name, dataclasses.replace(base, steps=args.warm_start), workdir)

    def run_all(plan):
        for name, diloco in plan:
            if name in results:
                continue
            cfg = validate(base if diloco is None else dataclasses.replace(base, diloco=diloco))
            results[name] = {**summarize(*train(name, cfg, workdir, warm), args.warm_start), "diloco": diloco}
            print(f"  {name}: eval loss {results[name]['eval_loss']:.4f}", file=sys.stderr, flush=True)

    run_all(runs(grid, base.steps))
    suffix = _suffix(grid)
    best_lr = {
        (m, h): min(grid["outer_lrs"], key=lambda lr: results[grid_name(m, h, lr, suffix)]["eval_loss"])
        for m in grid["replicas"]
        for h in grid["inner_steps"]
    }
    run_all(runs(grid, base.steps, best_lr, start=args.warm_start))

    params = _num_params(base)
    dp = results["data_parallel"]["eval_loss"]
    # one float32 gradient per step (what a ring all-reduce moves per replica, x2), after the warm start
    dp_bytes = params * 4 * (base.steps - args.warm_start)
    rows = []
    for name, r in results.items():
        gap = 100 * (r["eval_loss"] / dp - 1)
        sent = dp_bytes if r["diloco"] is None else r["bytes"]
        rows.append((name, r["eval_loss"], gap, r["syncs"], sent, r["peak_sync_bytes"] or params * 4))
    start = (
        f", all continuing a {args.warm_start}-step data-parallel run; syncs and bytes of the "
        f"{base.steps - args.warm_start} steps after it"
        if args.warm_start
        else ""
    )
    print(
        f"\nDiLoCo vs data parallel: {params / 1e6:.2f}M params, {base.steps} steps x {base.data.batch_size} x "
        f"{base.data.seq_len} tokens (equal tokens, equal global batch{start})\n"
    )
    print(f"{'run':<22} {'eval loss':>9} {'gap %':>7} {'syncs':>6} {'MB sent/replica':>15} {'peak MB/sync':>12}")
    for name, loss, gap, syncs, sent, peak in rows:
        print(f"{name:<22} {loss:>9.4f} {gap:>+7.2f} {syncs:>6} {sent / 1e6:>15.2f} {peak / 1e6:>12.3f}")
    best_runs = {(m, h): results[grid_name(m, h, lr, suffix)] for (m, h), lr in best_lr.items()}
    best = {
        f"M{m}_H{h}{suffix}": {
            "outer_lr": best_lr[m, h],
            "eval_loss": r["eval_loss"],
            "gap_pct": 100 * (r["eval_loss"] / dp - 1),
        }
        for (m, h), r in best_runs.items()
    }
    print(
        "\nbest outer lr per (M, H): "
        + ", ".join(f"{k} {v['outer_lr']} ({v['gap_pct']:+.2f}%)" for k, v in best.items())
    )
    print("\ntargets:")
    for line in target_lines(results, best, grid, suffix):
        print("  " + line)
    best_names = {grid_name(m, h, lr, suffix) for (m, h), lr in best_lr.items()}
    _plot(
        {name: r for name, r in results.items() if "_lr" not in name or name in best_names}, workdir / "eval_loss.png"
    )
    summary = {
        "data_parallel_eval_loss": dp,
        "best": best,
        **{
            name: {
                "eval_loss": r["eval_loss"],
                "gap_pct": 100 * (r["eval_loss"] / dp - 1),
                "bytes": r["bytes"],
                "peak_sync_bytes": r["peak_sync_bytes"],
            }
            for name, r in results.items()
            if not name.startswith("M") or "_lr" not in name
        },
    }
    print(json.dumps(summary))
    return 0


def target_lines(results: dict, best: dict, grid: dict, suffix: str) -> list[str]:
    """The issue's quality and communication targets, each with the measured figure."""
    lines = []
    for m, limit in ((1, 0.3), (2, 1.0), (4, 3.0)):
        cell = best.get(f"M{m}_H30{suffix}")
        if cell:
            lines.append(f"M={m}, H=30, best outer lr: {cell['gap_pct']:+.2f}% vs data parallel (target <= +{limit}%)")
    h30, h100 = best.get(f"M2_H30{suffix}"), best.get(f"M2_H100{suffix}")
    if h30 and h100:
        lines.append(f"M=2: H=100 vs H=30: {100 * (h100['eval_loss'] / h30['eval_loss'] - 1):+.2f}% (target <= +2%)")
    m, h = variant_cell(grid)
    tag = f"M{m}_H{h}{suffix}"
    base = results.get(grid_name(m, h, best[tag]["outer_lr"], suffix))
    checks = (
        ("int4", "4-bit outer gradients", 0.3),
        ("stream2", "streaming, 2 fragments", 0.5),
        ("drop1", "one of the replicas lost for the second half", 1.0),
    )
    for key, what, limit in checks:
        r = results.get(f"{tag}_{key}")
        if base and r:
            change = 100 * (r["eval_loss"] / base["eval_loss"] - 1)
            extra = ""
            if key == "int4":
                extra = f", {base['bytes'] / r['bytes']:.2f}x fewer bytes (payload 8x, plus a float32 scale per block)"
            if key == "stream2":
                extra = f", peak bytes per sync {base['peak_sync_bytes'] / r['peak_sync_bytes']:.2f}x lower (target 2x)"
            lines.append(f"{what}: {change:+.2f}% eval loss vs {tag} (target within {limit}%){extra}")
    return lines


def _items(text: str, flag: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ValueError(f"{flag} needs at least one value")
    return items


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in _items(text, flag)]
    except ValueError:
        raise ValueError(f"{flag} expects comma-separated integers, got {text!r}") from None


def _num_params(cfg: TrainConfig) -> int:
    import jax

    from jaxlm.train import Program
    from sharding import MeshLayout, build_mesh

    return Program(cfg, build_mesh(MeshLayout(), devices=jax.devices()[:1])).num_params


def _plot(results: dict, out: Path) -> None:
    """Eval loss vs tokens of the given runs (data parallel, each (M, H) cell's best outer lr, the variants)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in results.items():
        tokens, losses = zip(*r["curve"])
        ax.plot(tokens, losses, label=name, lw=2.5 if name == "data_parallel" else 1.2)
    ax.set_xlabel("tokens")
    ax.set_ylabel("eval loss")
    ax.set_title("DiLoCo vs data parallel (equal tokens, equal global batch)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    exit_with(main())
