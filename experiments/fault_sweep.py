"""The fault-injection sweep: tiny_lm killed, preempted, corrupted and starved of disk, then rerun.

    python -m experiments.fault_sweep                       # 50 SIGKILLs (15 mid-save), 10 SIGTERMs, 10 corrupt
                                                            # checkpoints, 3 + 3 full disks, and restart timing
    python -m experiments.fault_sweep --kinds sigkill_save --seeds 3    # reproduce one case
    python -m experiments.fault_sweep --processes 2         # two-process runs (sharding.launch): 6 + 4 mid-save
                                                            # SIGKILLs of one process, 5 SIGTERMs

Every scenario (experiments.fault_harness) runs a small tiny_lm in a subprocess, injects one fault, reruns the
same command, and compares its metrics.jsonl with an uninterrupted run, bit for bit. Then it times what a user
waits for: launch to first step for a cold start (empty compilation cache) and for a restart (warm cache,
resuming), with the default tiny_lm config; and a preemption checkpoint against a normal synchronous save.
Prints a table per fault kind, the targets, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from experiments.cli import exit_with
from experiments.fault_harness import (
    KINDS,
    Harness,
    can_mount_tmpfs,
    first_step_seconds,
    preemption_save_seconds,
    run_scenario,
)
from jaxlm.goodput import read_goodput

DEFAULT_COUNTS = {"sigkill": 35, "sigkill_save": 15, "sigterm": 10, "corrupt": 10, "disk_full": 3, "tmpfs_full": 3}
# Two processes: the faults that differ from one process (a host dies, mid-step or mid-save; a host or the job is
# preempted). Checkpoint damage and full disks are the same files either way.
MULTI_PROCESS_COUNTS = {"sigkill": 6, "sigkill_save": 4, "sigterm": 5}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.fault_sweep", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", default="runs/fault_sweep", help="scenario workdirs (wiped first)")
    for kind, n in DEFAULT_COUNTS.items():
        multi = f", {MULTI_PROCESS_COUNTS[kind]} with --processes" if kind in MULTI_PROCESS_COUNTS else ""
        p.add_argument(f"--{kind.replace('_', '-')}", type=int, metavar="N", help=f"{kind} cases ({n}{multi})")
    p.add_argument(
        "--processes", type=int, default=1, help="processes per run (> 1: one distributed run via sharding.launch)"
    )
    p.add_argument("--kinds", help=f"only these kinds, comma-separated ({', '.join(KINDS)})")
    p.add_argument("--seeds", help="only these seeds, comma-separated (with --kinds: reproduce single cases)")
    p.add_argument("--steps", type=int, default=24, help="steps per scenario run")
    p.add_argument("--checkpoint-every", type=int, default=4)
    p.add_argument("--no-timing", action="store_true", help="skip the cold-start / restart timing")
    args = p.parse_args(argv)

    root = Path(args.workdir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    if args.processes < 1:
        p.error(f"--processes must be >= 1, got {args.processes}")
    defaults = DEFAULT_COUNTS if args.processes == 1 else MULTI_PROCESS_COUNTS
    kinds = args.kinds.split(",") if args.kinds else list(defaults)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        p.error(f"unknown kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    counts = {k: n if (n := getattr(args, k)) is not None else defaults.get(k, DEFAULT_COUNTS[k]) for k in kinds}
    if counts.get("tmpfs_full") and not can_mount_tmpfs():
        print("tmpfs_full skipped: mounting a tmpfs needs root with CAP_SYS_ADMIN", file=sys.stderr)
        counts["tmpfs_full"] = 0
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    harness = Harness(
        root,
        steps=args.steps,
        checkpoint_every=args.checkpoint_every,
        cache_dir=root / "cache",
        processes=args.processes,
    )

    t0 = time.perf_counter()
    harness.reference()
    outcomes = []
    for kind, n in counts.items():
        for seed in seeds or range(n):
            out = run_scenario(harness, kind, seed)
            outcomes.append(out)
            status = "ok" if out.ok else "FAILED"
            print(
                f"{kind:13s} seed {seed:3d} {out.detail:42s} exit {out.exit_code!s:4s} lost {out.steps_lost:2d} "
                f"{'mid-save ' if out.in_save else ''}{status}",
                file=sys.stderr,
                flush=True,
            )
    table = summarize(outcomes)
    timing = {} if args.no_timing or args.processes > 1 else measure_timing(harness, root, outcomes)
    report(table, timing, outcomes, time.perf_counter() - t0, args.processes)
    return 0 if all(o.ok for o in outcomes) else 1


def summarize(outcomes) -> dict:
    rows = {}
    for kind in KINDS:
        group = [o for o in outcomes if o.kind == kind]
        if group:
            rows[kind] = {
                "faults": len(group),
                "mid_save": sum(o.in_save for o in group),
                "resumed": sum(o.completed for o in group),
                "steps_lost": sum(o.steps_lost for o in group),
                "loss_mismatches": sum(not o.loss_match for o in group),
                "tmp_left": sum(o.leftover_tmp for o in group),
                "good_checkpoints_lost": sum(o.good_lost for o in group),
            }
    return rows


def measure_timing(harness: Harness, root: Path, outcomes) -> dict:
    """Cold start vs restart with the default tiny_lm config, and preemption vs synchronous save times."""
    cache = Path(tempfile.mkdtemp(prefix="fault-sweep-cache-"))  # empty: a cold start compiles everything
    real = Harness(root / "timing", steps=2, cache_dir=cache, flags=())
    workdir = root / "timing" / "tiny_lm"
    cold, _ = first_step_seconds(real, workdir)
    restart, _ = first_step_seconds(real, workdir, "--steps", "4")  # resumes at step 2, cache warm
    shutil.rmtree(cache, ignore_errors=True)
    sync_dir = root / "sync_saves"
    harness.run(sync_dir, "--set", "async_checkpointing=false")
    record = read_goodput(sync_dir)[-1]
    preempt = [s for s in (preemption_save_seconds(o.message) for o in outcomes if o.kind == "sigterm") if s]
    return {
        "cold_first_step_s": cold,
        "restart_first_step_s": restart,
        "restart_ratio": restart / cold,
        "sync_save_s": record["checkpoint_s"] / max(record["saves"], 1),
        "preemption_save_s": statistics.median(preempt) if preempt else None,
    }


def report(table: dict, timing: dict, outcomes, seconds: float, processes: int = 1) -> None:
    header = (
        f"{'fault':14s} {'injected':>8s} {'mid-save':>8s} {'resumed':>8s} {'steps lost':>10s} "
        f"{'loss mismatches':>15s} {'tmp dirs left':>13s} {'good ckpts lost':>15s}"
    )
    print(header)
    print("-" * len(header))
    for kind, r in table.items():
        print(
            f"{kind:14s} {r['faults']:8d} {r['mid_save']:8d} {r['resumed']:8d} {r['steps_lost']:10d} "
            f"{r['loss_mismatches']:15d} {r['tmp_left']:13d} {r['good_checkpoints_lost']:15d}"
        )
    total = {k: sum(r[k] for r in table.values()) for k in next(iter(table.values()))} if table else {}
    kills = sum(r["faults"] for k, r in table.items() if k.startswith("sigkill"))
    mid_save = sum(r["mid_save"] for k, r in table.items() if k.startswith("sigkill"))
    print(f"\n{len(outcomes)} faults in {seconds / 60:.1f} min; {sum(o.ok for o in outcomes)} runs continued exactly")
    print("targets:")
    print(
        f"  every run completes, bit-exact, no good checkpoint lost, no temporaries left: "
        f"{_met(all(o.ok for o in outcomes))}"
    )
    want_kills = 50 if processes == 1 else 10  # two processes: >= 10 kills of one of them, some mid-save
    want_mid_save = 10 if processes == 1 else 3
    print(
        f"  >= {want_kills} SIGKILLs, >= {want_mid_save} of them mid-save: {kills} kills, {mid_save} mid-save: "
        f"{_met(kills >= want_kills and mid_save >= want_mid_save)}"
    )
    print(f"  one-line reports (no traceback, no ERROR:absl) from the faulted runs: {_met(_clean(outcomes))}")
    if "sigterm" in table:
        print(
            f"  steps lost on SIGTERM: {table['sigterm']['steps_lost']} (target 0): "
            f"{_met(table['sigterm']['steps_lost'] == 0)}"
        )
    if timing:
        if timing["preemption_save_s"] is not None:
            ratio = timing["preemption_save_s"] / timing["sync_save_s"]
            timing["preemption_save_ratio"] = ratio
            print(
                f"  preemption checkpoint {timing['preemption_save_s']:.3f}s vs synchronous save "
                f"{timing['sync_save_s']:.3f}s = {ratio:.2f}x (target < 2x): {_met(ratio < 2)}"
            )
        print(
            f"  restart to first step {timing['restart_first_step_s']:.1f}s vs cold start "
            f"{timing['cold_first_step_s']:.1f}s = {timing['restart_ratio']:.2f}x (target <= 0.5x): "
            f"{_met(timing['restart_ratio'] <= 0.5)}"
        )
    print(
        json.dumps(
            {
                "processes": processes,
                "faults": len(outcomes),
                "ok": sum(o.ok for o in outcomes),
                **total,
                **{k: round(v, 4) for k, v in timing.items() if v is not None},
            }
        )
    )


def _clean(outcomes) -> bool:
    """No fault the run reports itself (SIGTERM, a failed save) printed a traceback or absl ERROR lines."""
    return all(o.tracebacks == 0 and o.absl_errors == 0 for o in outcomes if o.kind not in ("sigkill", "sigkill_save"))


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


if __name__ == "__main__":
    exit_with(main())
