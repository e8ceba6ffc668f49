"""Check a model on a cluster before renting it: compile the real train step (and, with --decode, generate's decode
step) for H100 clusters and TPU pods on this machine, and report what XLA says of each layout: per-device memory
against the device's, the planner's estimate beside it, compile time, the custom kernels and the collectives of one
step.

    python -m experiments.compile_at_scale --model llama3-8b --cluster v5p-128 --seq 8192
    python -m experiments.compile_at_scale --model llama3-70b --cluster h100x256 --layout auto:3
    python -m experiments.compile_at_scale --model runs/my/config.json --cluster h100x64 --layout my_layout.py
    python -m experiments.compile_at_scale --model llama3-8b,llama3-70b --cluster h100x64,v5px64 --out runs/matrix
    python -m experiments.compile_at_scale --model llama3-8b --cluster h100x8 --layout auto:1 --decode

Models: a preset (sharding.model_shape.MODEL_PRESETS: llama3-1b / 8b / 70b / 405b, Llama 2's 7b / 13b / 70b) or a
run's config file (.py or config.json). Clusters: h100xN, v5pxN / v5exN / v6exN (chips), or Google's names v5p-128
(TensorCores: 64 chips) / v6e-256. Layouts: a layout file, or auto[:N] (the planner's top N, default 3). The batch
is --batch-tokens per step (default one sequence per device). Attention defaults to the Pallas kernels, remat to
full (--set overrides either). Writes a Markdown report and a JSON file (--out PREFIX; default
docs/results/scale-DATE), refusing to overwrite one. Exit 0 when some layout of every model x cluster fits, 1 when
none does, 2 on bad input (before anything compiles). Compiles take seconds to minutes each on 2 cores; a line per
layout shows progress.

--decode adds, after each layout's train row, a row for the step experiments.generate runs per token under that
layout (jaxlm.generate's decode step, sampling at its default temperature): the params in float32 as a checkpoint
holds them, placed by the layout's rules; a KV cache of --seq tokens (prompt and new) in the model's dtype; and
--decode-batch prompts (default 1), rounded up as generate rounds its batch: a power of two, then a multiple of the
layout's batch shards (data x fsdp x replica), so by default one row per shard. Its memory adds to XLA's what a run
keeps that the step does not read (the stacked params beside the per-layer weight copies it reads); the planner has
no decode estimate. Generation refuses
pipeline layouts: a layout file with pipeline stages is bad input with --decode, and a planner layout with them gets
a decode row saying so.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import sys
from pathlib import Path

from experiments.cli import UsageError, _Parser, exit_with

PROG = "compile_at_scale"
GiB = 2**30


def build_parser():
    p = _Parser(prog=f"python -m experiments.{PROG}", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="presets or config files, comma-separated")
    p.add_argument("--cluster", required=True, help="e.g. h100x64, v5p-128, v6e-256; comma-separated")
    p.add_argument("--seq", type=int, default=8192, help="sequence length (default 8192)")
    p.add_argument("--batch-tokens", type=int, default=0, help="tokens per step (default: one sequence per device)")
    p.add_argument("--layout", default="auto", help="a layout file, or auto[:N] (the planner's top N; default 3)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--out", help="report prefix: writes PREFIX.md and PREFIX.json (default docs/results/scale-DATE)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing report")
    p.add_argument("--no-install", action="store_true", help="fail instead of installing the toolchains with pip")
    p.add_argument(
        "--decode",
        action="store_true",
        help="also compile generate's decode step per layout (a row after its train row): a KV cache of --seq "
        "tokens, float32 params as a checkpoint holds them",
    )
    p.add_argument(
        "--decode-batch",
        type=int,
        metavar="N",
        help="prompts decoded at once (default 1), rounded up as generate does: a power of two, then a multiple of "
        "the layout's batch shards (data x fsdp x replica); so by default one row per shard",
    )
    return p


@dataclasses.dataclass
class Job:
    model: str
    cluster: object  # sharding.clusters.Cluster
    cfg: object  # jaxlm.config.TrainConfig (batch and microbatches per layout)
    layouts: list  # [(MeshLayout, microbatches or 0)]
    decode_prompts: int = 0  # --decode: the prompts of each layout's decode step (0: no decode rows)


def model_config(spec: str, seq: int, batch: int, sets: list[str]):
    """A preset's shape as a TrainConfig (bf16, Pallas attention, full remat, scanned layers), or a config file;
    then --set. The sequence and batch are this command's."""
    from jaxlm.config import DataConfig, ModelConfig, OptimConfig, TrainConfig, apply_overrides, load_config
    from sharding.model_shape import MODEL_PRESETS, PRESET_ROPE_THETA

    if spec in MODEL_PRESETS:
        shape = dataclasses.asdict(MODEL_PRESETS[spec])
        theta = PRESET_ROPE_THETA.get(spec, 500_000.0)
        model = ModelConfig(**shape, max_seq_len=seq, scan_layers=True, rope_theta=theta)
        cfg = TrainConfig(model=model, optim=OptimConfig(warmup_steps=100), data=DataConfig(), steps=10_000)
    elif spec.endswith((".py", ".json")) or Path(spec).exists():
        cfg = load_config(spec)
    else:
        presets = ", ".join(MODEL_PRESETS)
        raise UsageError(f"unknown model {spec!r}: a config file (.py / .json) or a preset ({presets})")
    model = dataclasses.replace(cfg.model, max_seq_len=max(cfg.model.max_seq_len, seq))
    cfg = dataclasses.replace(cfg, model=model, data=dataclasses.replace(cfg.data, seq_len=seq, batch_size=batch))
    cfg = apply_overrides(cfg, sets)
    if cfg.model.vocab_size == 0:
        raise UsageError(f"model {spec}: model.vocab_size is 0 (it follows the data); give one with --set")
    return cfg


def plan_jobs(args) -> list[Job]:
    """Everything checked before a compile: models, clusters, sizes, layouts (the planner's or a file's)."""
    from jaxlm.config import validate
    from jaxlm.generate import check_layout
    from jaxlm.train import check_splits
    from sharding.clusters import parse_cluster
    from sharding.mesh import load_layout
    from sharding.model_shape import ModelShape
    from sharding.planner import plan

    if args.seq < 1 or args.batch_tokens < 0:
        raise UsageError(f"--seq {args.seq} / --batch-tokens {args.batch_tokens}: give positive token counts")
    if args.decode_batch is not None and not args.decode:
        raise UsageError(f"--decode-batch {args.decode_batch} sizes the decode step: add --decode")
    if args.decode_batch is not None and args.decode_batch < 1:
        raise UsageError(f"--decode-batch {args.decode_batch}: give a positive number of prompts")
    auto = args.layout.split(":", 1)
    if auto[0] == "auto":
        if len(auto) == 2 and not (auto[1].isdigit() and int(auto[1]) > 0):
            raise UsageError(f"--layout {args.layout}: write auto or auto:N with N a positive count")
        top = int(auto[1]) if len(auto) == 2 else 3
    clusters = [parse_cluster(c) for c in args.cluster.split(",") if c]
    jobs = []
    for spec in [m for m in args.model.split(",") if m]:
        for cluster in clusters:
            batch_tokens = args.batch_tokens or args.seq * cluster.chips
            if batch_tokens % args.seq:
                raise UsageError(f"--batch-tokens {batch_tokens} is not a multiple of --seq {args.seq}")
            cfg = model_config(spec, args.seq, batch_tokens // args.seq, args.set)
            validate(cfg)
            if auto[0] == "auto":
                shape = ModelShape.from_config(cfg.model)
                p = plan(shape, cluster.chips, batch_tokens, args.seq, cluster.hardware, cfg.model.remat)
                layouts = [(e.layout, e.accumulation) for e in p.estimates[:top]]
            else:
                layouts = [(load_layout(args.layout, cluster.chips), 0)]
                if args.decode:
                    check_layout(layouts[0][0], cfg.model)
                check_splits(cfg, layouts[0][0], cluster.platform)  # what the trainer refuses, refused here too
            jobs.append(Job(spec, cluster, cfg, layouts, (args.decode_batch or 1) if args.decode else 0))
    return jobs


def run_job(job: Job, progress) -> list[dict]:
    from experiments.generate import DEFAULT_TEMPERATURE
    from jaxlm.deviceless import StepCompile, compile_decode_step, compile_train_step
    from jaxlm.generate import Sampler, check_layout
    from sharding.planner import describe

    rows = []
    for i, (layout, accumulation) in enumerate(job.layouts, 1):
        cfg = job.cfg
        if accumulation:
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, microbatches=accumulation))
        name = describe(layout, max(1, accumulation or cfg.data.microbatches))
        progress(f"[{i}/{len(job.layouts)}] {job.model} on {job.cluster}: {name}: compiling ...")
        rows.append(row_of(job, name, compile_train_step(cfg, layout, job.cluster)))
        progress(f"    {summary(rows[-1])}")
        if not job.decode_prompts:
            continue
        progress(f"[{i}/{len(job.layouts)}] {job.model} on {job.cluster}: {name}: compiling the decode step ...")
        try:
            check_layout(layout, cfg.model)  # a planner layout generation refuses: a row that says so
        except ValueError as e:
            r = StepCompile(layout, 1, 0.0, error=str(e), step="decode")
        else:
            r = compile_decode_step(cfg, layout, job.cluster, job.decode_prompts, Sampler(DEFAULT_TEMPERATURE))
        rows.append(row_of(job, name, r))
        progress(f"    {summary(rows[-1])}")
    return rows


def row_of(job: Job, layout_name: str, r) -> dict:
    """One report row: the train step's, or with step "decode" the decode step's (rows x cache slots; XLA's memory
    plus the params the run holds beside it; no planner figures)."""
    hbm = job.cluster.hbm_bytes
    train = r.step == "train"
    planner = r.planner_bytes
    return {
        "model": job.model,
        "cluster": job.cluster.name,
        "chips": job.cluster.chips,
        "step": r.step,
        "seq": job.cfg.data.seq_len,
        "batch_tokens": job.cfg.data.batch_size * job.cfg.data.seq_len if train else r.rows,
        "decode_rows": None if train else r.rows,
        "cache_len": None if train else r.cache_len,
        "attention": job.cfg.model.attention_impl,
        "layout": layout_name,
        "microbatches": r.microbatches,
        "compiled": r.compiled,
        "error": r.error,
        "fits": r.compiled and r.total_bytes + r.held_bytes <= hbm,
        "hbm_gib": hbm / GiB,
        "xla_gib": {
            "arguments": r.argument_bytes / GiB,
            "temporaries": r.temp_bytes / GiB,
            "outputs_not_donated": (r.output_bytes - r.alias_bytes) / GiB,
            "total": r.total_bytes / GiB,
        },
        "held_gib": None if train else r.held_bytes / GiB,
        "planner_gib": None if planner is None else planner / GiB,
        "planner_over_xla": planner / r.total_bytes if planner and r.compiled and r.total_bytes else None,
        "planner_step_s": r.planner_step_s,
        "planner_mfu": r.planner_mfu,
        "compile_s": r.compile_s,
        "kernels": dict(r.kernels),
        "collectives": [dataclasses.asdict(c) for c in r.collectives],
        "hlo_error": r.hlo_error,
    }


def summary(row: dict) -> str:
    if not row["compiled"] and row["step"] == "decode" and not row["decode_rows"]:
        return f"decode step not compiled: {row['error']}"  # a layout generation refuses
    if not row["compiled"]:
        return f"does not compile ({row['compile_s']:.0f} s): {row['error']}"
    x = row["xla_gib"]
    fits = "fits" if row["fits"] else "DOES NOT FIT"
    if row["step"] == "decode":
        return (
            f"decode step, {row['decode_rows']} rows x {row['cache_len']} cache slots: {fits}: {x['total']:.1f} "
            f"+ {row['held_gib']:.1f} held of {row['hbm_gib']:.0f} GiB, compiled in {row['compile_s']:.0f} s"
        )
    ratio = f" = {row['planner_over_xla']:.2f}x" if row["planner_over_xla"] else ""
    return (
        f"{fits}: {x['total']:.1f} of {row['hbm_gib']:.0f} GiB (planner {_number(row['planner_gib'], '.1f')}{ratio}), "
        f"compiled in {row['compile_s']:.0f} s"
    )


def _number(x, spec: str) -> str:
    """A figure, or '-' where there is none (the planner's, for a decode step or a layout it does not model)."""
    return "-" if x is None else format(x, spec)


def _collectives_text(row: dict) -> str:
    if row.get("hlo_error"):
        return f"not read: {row['hlo_error']}"
    parts = []
    for c in row["collectives"][:4]:
        over = f"/{c['group']}" if c["group"] else ""
        parts.append(f"{c['kind']}{over} x{c['count']} {c['bytes'] / GiB:.2f} GiB")
    return "; ".join(parts) or "none"


def markdown(rows: list[dict], command: str, machine: str, date: str) -> str:
    head = (
        "| model | cluster | seq | layout | step | fits | XLA GiB (args + temp) | of HBM | planner GiB | planner / XLA "
        "| compile s | kernels | collectives per step (kind/group, count, bytes) | planner step s, MFU |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        step = f"decode, {r['decode_rows']} rows x {r['cache_len']} slots" if r["decode_rows"] else r["step"]
        first = f"| {r['model']} | {r['cluster']} | {r['seq']} | {r['layout']} | {step} "
        if not r["compiled"]:
            lines.append(
                f"{first}| no: {r['error']} | | {r['hbm_gib']:.0f} | {_number(r['planner_gib'], '.1f')} | "
                f"| {r['compile_s']:.0f} | | | |"
            )
            continue
        x = r["xla_gib"]
        memory = f"{x['total']:.1f} ({x['arguments']:.1f} + {x['temporaries']:.1f})"
        if r["held_gib"] is not None:
            memory += f" + {r['held_gib']:.1f} held"
        kernels = ", ".join(f"{k} x{n}" for k, n in r["kernels"].items()) or "none"
        planner = f"{_number(r['planner_step_s'], '.2f')}, {_number(r['planner_mfu'], '.2f')}"
        lines.append(
            f"{first}| {'yes' if r['fits'] else 'NO'} | {memory} | {r['hbm_gib']:.0f} "
            f"| {_number(r['planner_gib'], '.1f')} | {_number(r['planner_over_xla'], '.2f')} | {r['compile_s']:.0f} "
            f"| {kernels} | {_collectives_text(r)} | {'-' if r['planner_mfu'] is None else planner} |"
        )
    decode = (
        " A decode row is the step experiments.generate runs per token (rows x KV-cache slots): its fit adds to "
        "XLA's total what a run keeps on each device that the step does not read ('held': the stacked params "
        "beside the per-layer weight copies it reads); the planner has no decode estimate ('-')."
        if any(r["step"] == "decode" for r in rows)
        else ""
    )
    return (
        f"# Compiled at scale, {date}\n\n"
        f"`{command}`\n\nMachine: {machine}. Memory is XLA's `memory_analysis()` per device (GiB = 2^30 bytes); "
        "the planner's estimate (sharding.planner) beside it; step time and MFU are the planner's model, not a "
        "measurement (nothing ran). Collective bytes are each array's size per device per step."
        + decode
        + "\n\n"
        + head
        + "\n".join(lines)
        + "\n"
    )


def machine_name() -> str:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{cpu or platform.processor() or 'unknown CPU'}, {os.cpu_count()} cores"


def main(argv=None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser().parse_args(args_list)
        date = datetime.date.today().isoformat()
        prefix = Path(args.out or f"docs/results/scale-{date}")
        md, js = prefix.with_name(prefix.name + ".md"), prefix.with_name(prefix.name + ".json")
        existing = [str(p) for p in (md, js) if p.exists()]
        if existing and not args.overwrite:
            raise UsageError(f"{existing[0]} exists; give another --out or --overwrite to replace it")
        jobs = plan_jobs(args)
    except ValueError as e:  # UsageError, LayoutError, ConfigError: one line, before anything compiles
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    from pallas_kernels import targets

    try:
        for toolchain in {job.cluster.toolchain for job in jobs}:
            directory = targets.toolchain_dir(toolchain)
            targets.enable(toolchain, directory if args.no_install else targets.install(toolchain, directory))
    except targets.TargetError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    rows = []
    for job in jobs:
        rows += run_job(job, lambda line: print(line, flush=True))
    command = "python -m experiments.compile_at_scale " + " ".join(args_list)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(markdown(rows, command, machine_name(), date))
    js.write_text(json.dumps({"command": command, "machine": machine_name(), "date": date, "rows": rows}, indent=1))
    steps = ("train", "decode") if args.decode else ("train",)
    fitting = {(r["model"], r["cluster"], r["step"]) for r in rows if r["fits"]}
    missing = [
        f"{j.model} on {j.cluster.name}" + ("" if step == "train" else " (decode)")
        for j in jobs
        for step in steps
        if (j.model, j.cluster.name, step) not in fitting
    ]
    train = [r for r in rows if r["step"] == "train"]
    decode = [r for r in rows if r["step"] == "decode"]
    fit = f"{sum(r['fits'] for r in train)} of {len(train)} layouts fit"
    if args.decode:
        fit += f", {sum(r['fits'] for r in decode)} of {len(decode)} decode steps"
    print(f"{PROG}: wrote {md} and {js}; {fit}")
    if missing:
        print(f"{PROG}: nothing fits for {', '.join(missing)}")
    figures = {"layouts": len(train), "fit": sum(r["fits"] for r in train)}
    if args.decode:
        figures["decode_fit"] = sum(r["fits"] for r in decode)
    print(json.dumps({**figures, "nothing_fits": missing}))
    return 1 if missing else 0


if __name__ == "__main__":
    exit_with(main())
