"""Plan a parallel layout: rank every mesh layout of N devices by estimated step time (sharding.planner).

    python -m sharding.plan --model 70b --devices 1024 --global-batch-tokens 4194304 --seq 4096 --hardware h100-sxm
    python -m sharding.plan --model experiments/configs/tiny_lm.py --devices 8 --global-batch-tokens 4096 \\
        --seq 256 --hardware cpu --out runs/planned_layout.py

Prints the ranked table and notes, then the best layout as a mesh layout file (written to --out when given),
and as its last line one JSON object with the key figures. Bad inputs: one line `plan: error: ...`, exit 2.

`--verify N` compiles the top N layouts' real train step for the hardware (deviceless: H100 and TPU presets) and
prints XLA's memory per device beside the planner's. It runs `python -m experiments.compile_at_scale` in a child
process: the planner imports nothing of jaxlm, and the compile needs the model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from sharding.hardware import PRESETS, get_hardware
from sharding.memory_model import keeps_scores
from sharding.mesh import LayoutError
from sharding.model_shape import MODEL_PRESETS, ModelShape, active_params, count_params
from sharding.planner import REMAT_CHOICES, Plan, describe, plan
from sharding.user_file import call_user_function, exec_python_file

PROG = "plan"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage + error
        raise LayoutError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help=f"a config file (.py) or a preset: {', '.join(MODEL_PRESETS)}")
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--global-batch-tokens", type=int, required=True, help="tokens per optimizer step")
    p.add_argument("--seq", type=int, required=True, help="sequence length in tokens")
    p.add_argument("--hardware", required=True, help=f"one of {', '.join(PRESETS)}")
    p.add_argument("--out", help="write the best layout to this mesh layout file")
    p.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    p.add_argument("--remat", choices=REMAT_CHOICES, help="default: the model config's (presets: none)")
    p.add_argument(
        "--verify",
        type=int,
        default=0,
        metavar="N",
        help="compile the top N layouts for the hardware (deviceless) and print XLA's memory beside the estimate",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=0,
        help="the vocabulary, for a config whose model.vocab_size is 0 (it follows the data's tokenizer)",
    )
    return p


def load_model(spec: str) -> ModelShape:
    """A preset's shape, or the `model` section of a run's config file (read without jaxlm: a config file is
    plain Python that defines `config`)."""
    if spec in MODEL_PRESETS:
        return MODEL_PRESETS[spec]
    path = Path(spec)
    if not spec.endswith(".py") and not path.exists():
        raise LayoutError(f"unknown model {spec!r}: give a config file path or a preset ({', '.join(MODEL_PRESETS)})")
    if not path.is_file():
        raise LayoutError(f"config file not found: {path}")
    module = exec_python_file(path, "config", LayoutError)
    if not hasattr(module, "config"):
        raise LayoutError(f"config file {path} must define `config` (a TrainConfig or a function returning one)")
    cfg = module.config
    if callable(cfg) and not hasattr(cfg, "model"):
        cfg = call_user_function(cfg, path=path, kind="config", error=LayoutError)
    if not hasattr(cfg, "model"):
        raise LayoutError(f"config file {path}: `config` is a {type(cfg).__name__}, expected TrainConfig")
    return ModelShape.from_config(cfg.model)


def layout_file(p: Plan, command: str) -> str:
    """The best layout as a file `sharding.mesh.load_layout` reads."""
    best, lay = p.best, p.best.layout
    fields = f"data={lay.data}, fsdp={lay.fsdp}, tensor={lay.tensor}, pipeline={lay.pipeline}"
    if lay.context > 1:
        fields += f", context={lay.context}"
    if lay.expert > 1:
        fields += f", expert={lay.expert}"
    if lay.pipeline > 1:
        fields += f", pipeline_schedule={lay.pipeline_schedule!r}, pipeline_microbatches={lay.num_microbatches}"
    accumulate = (
        f"\nTrain with {best.accumulation} gradient-accumulation microbatches: "
        f"--set data.microbatches={best.accumulation}.\n"
        if best.accumulation > 1
        else ""
    )
    return (
        f'"""Planned by `{command}`.\n\nEstimate (sharding.planner): {best.step_s:.3g} s/step, '
        f"{best.memory.total / 1e9:.1f} GB/device{'' if best.fits else ' (does not fit)'}, MFU {best.mfu:.2f}.\n"
        f'{accumulate}"""\n\nfrom sharding import MeshLayout\n\nlayout = MeshLayout({fields})\n'
    )


def table(p: Plan, top: int) -> str:
    cols = (
        "#",
        "layout",
        "mem GB",
        "fits",
        "compute s",
        "fsdp s",
        "dp s",
        "tp s",
        "pp s",
        "ep s",
        "step s",
        "bubble",
        "MFU",
        "notes",
    )
    rows = []
    for i, e in enumerate(p.estimates[:top], 1):
        times = (e.compute_s, e.fsdp_s, e.dp_s, e.tp_s, e.pp_s, e.ep_s, e.step_s)
        rows.append(
            (
                str(i),
                describe(e.layout, e.accumulation),
                f"{e.memory.total / 1e9:.1f}",
                "yes" if e.fits else "NO",
                *(f"{x:.3f}" for x in times),
                f"{e.bubble:.2f}",
                f"{e.mfu:.2f}",
                "comms hidden" if e.hidden else "FSDP+DP comms > compute",
            )
        )
    widths = [max(len(r[i]) for r in rows + [cols]) for i in range(len(cols))]

    def line(r):
        return "  ".join(c.ljust(w) if i in (1, 13) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    more = len(p.estimates) - len(rows)
    return "\n".join([line(cols)] + [line(r) for r in rows] + ([f"... {more} more layouts"] if more > 0 else []))


def summary(p: Plan, name: str) -> str:
    cfg, hw = p.cfg, p.hardware
    attention = "dense attention" if keeps_scores(cfg, hw.platform) else "flash attention"
    active = f" ({active_params(cfg) / 1e9:.2f}B active: {cfg.experts_per_token} of {cfg.num_experts} experts)"
    return (
        f"model {name}: {count_params(cfg) / 1e9:.2f}B params{active if cfg.num_experts else ''}, {cfg.dtype} "
        f"compute, {attention}, remat {p.remat}\n"
        f"batch: {p.batch_tokens:,} tokens = {p.batch_tokens // p.seq_len:,} sequences x {p.seq_len:,}\n"
        f"devices: {p.devices:,} x {hw.name}: {hw.peak_flops / 1e12:.0f} TFLOP/s peak x {hw.mfu:.2f} assumed MFU "
        f"= {hw.flops / 1e12:.0f} TFLOP/s, {hw.hbm_bytes / 1e9:.0f} GB ({hw.usable_memory:.0%} usable), "
        f"{hw.devices_per_node}/node, {hw.intra_bw / 1e9:.0f} GB/s in a node, {hw.inter_bw / 1e9:.0f} GB/s across"
    )


def key_figures(p: Plan, name: str) -> dict:
    e, lay = p.best, p.best.layout
    layout = {"data": lay.data, "fsdp": lay.fsdp, "tensor": lay.tensor, "pipeline": lay.pipeline}
    if lay.context > 1:
        layout["context"] = lay.context
    if lay.expert > 1:
        layout["expert"] = lay.expert
    if lay.pipeline > 1:
        layout |= {"pipeline_schedule": lay.pipeline_schedule, "pipeline_microbatches": lay.num_microbatches}
    return {
        "model": name,
        "devices": p.devices,
        "hardware": p.hardware.name,
        "layout": layout,
        "accumulation": e.accumulation,
        "step_s": round(e.step_s, 4),
        "memory_gb": round(e.memory.total / 1e9, 2),
        "fits": e.fits,
        "mfu": round(e.mfu, 4),
        "tokens_per_s": round(p.batch_tokens / e.step_s),
        "compute_s": round(e.compute_s, 4),
        "comm_s": {k: round(getattr(e, f"{k}_s"), 4) for k in ("fsdp", "dp", "cp", "tp", "pp", "ep")},
        "comms_hidden": e.hidden,
    }


def check_out(out: Path) -> None:
    """--out is a new .py file, or one this planner wrote before (which it replaces): never a user's other file."""
    if not str(out).strip():
        raise ValueError("--out is empty; give a .py path")
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; give a .py file path")
    if out.suffix != ".py":
        raise ValueError(f"--out {out} must be a .py file (a mesh layout file)")
    if out.exists():
        try:
            head = out.read_text()[:40]
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--out {out} exists and cannot be read ({e}); give a new path") from None
        if not head.startswith('"""Planned by `'):
            raise ValueError(f"--out {out} exists and was not written by sharding.plan; give a new path")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser().parse_args(argv)
        if args.top < 1:  # rows[:0] would print an empty table, rows[:-2] silently drop the last two
            raise ValueError(f"--top {args.top}: give how many layouts to list (1 or more)")
        if args.out is not None:
            check_out(Path(args.out))
        cfg = load_model(args.model)
        if args.vocab_size:
            cfg = dataclasses.replace(cfg, vocab_size=args.vocab_size)
        elif cfg.vocab_size == 0:
            raise LayoutError(
                f"{args.model} leaves model.vocab_size to the data's tokenizer (0); give it with --vocab-size N "
                f"(the tokenizer's ids, rounded up to a multiple of 128)"
            )
        remat = args.remat or ("full" if cfg.remat == "full" else "none")
        result = plan(cfg, args.devices, args.global_batch_tokens, args.seq, get_hardware(args.hardware), remat)
        if args.verify < 0:
            raise LayoutError(f"--verify {args.verify}: give how many layouts to compile (1 or more)")
        if args.verify:
            from sharding.clusters import cluster_for

            cluster = cluster_for(args.hardware, args.devices)
    except (LayoutError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    command = "python -m sharding.plan " + shlex.join(argv)
    name = args.model if args.model in MODEL_PRESETS else Path(args.model).stem
    print(summary(result, name), "", table(result, args.top), "", sep="\n")
    for note in result.notes:
        print(f"note: {note}")
    text = layout_file(result, command)
    if args.out:
        try:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text)
        except OSError as e:
            print(f"{PROG}: error: cannot write --out {args.out}: {e.strerror}", file=sys.stderr)
            return 2
        print(f"\nbest layout written to {args.out}")
    else:
        print(f"\nbest layout (pass --out PATH.py to write it):\n\n{text}")
    figures = key_figures(result, name)
    if args.verify:
        verified = verify(args, remat, cluster.name)
        if verified is None:
            return 1
        figures["verified"] = verified
    print(json.dumps(figures))
    return 0


def verify(args, remat: str, cluster: str) -> list[dict] | None:
    """The top layouts compiled by experiments.compile_at_scale (a child process; its progress passes through):
    per layout the planner's and XLA's GB per device. None when the child failed."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "experiments.compile_at_scale", "--model", args.model, "--cluster", cluster]
        cmd += ["--seq", str(args.seq), "--batch-tokens", str(args.global_batch_tokens)]
        cmd += ["--layout", f"auto:{args.verify}", "--out", f"{tmp}/verify", "--set", f"model.remat={remat}"]
        if args.vocab_size:
            cmd += ["--set", f"model.vocab_size={args.vocab_size}"]
        print(f"\nverifying the top {args.verify} with XLA: {shlex.join(cmd[1:])}", flush=True)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        lines = proc.stdout.splitlines()
        print("\n".join(line for line in lines[:-1] if not line.startswith("compile_at_scale: wrote")))
        report = Path(tmp) / "verify.json"
        if not report.exists():
            print(f"{PROG}: error: the compile did not finish (exit {proc.returncode})", file=sys.stderr)
            return None
        rows = json.loads(report.read_text())["rows"]
    out = []
    print(f"\n{'layout':<28}{'planner GB':>12}{'XLA GB':>10}{'planner/XLA':>13}  fits")
    for r in rows:
        planner_gb, xla_gb = r["planner_gib"] * 2**30 / 1e9, r["xla_gib"]["total"] * 2**30 / 1e9
        ratio = f"{r['planner_over_xla']:.2f}" if r["planner_over_xla"] else "-"
        fits = "yes" if r["fits"] else (f"no: {r['error']}" if r["error"] else "NO")
        xla = f"{xla_gb:.1f}" if r["compiled"] else "-"
        print(f"{r['layout']:<28}{planner_gb:>12.1f}{xla:>10}{ratio:>13}  {fits}")
        out.append({"layout": r["layout"], "planner_gb": round(planner_gb, 2), "xla_gb": round(xla_gb, 2)})
        out[-1]["fits"] = r["fits"]
    return out


if __name__ == "__main__":
    sys.exit(main())
