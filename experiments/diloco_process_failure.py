"""A DiLoCo replica process that really dies: M replica processes (`diloco.exchange`), one SIGKILLed mid-run.

    python -m experiments.diloco_process_failure                  # M=4, H=30, 600 steps, replica 3 killed at ~300
    python -m experiments.diloco_process_failure --steps 120 --kill-at 60 --set diloco.inner_steps=10

Three runs of the same M-replica job, each replica its own JAX process (one CPU device each):
  no_failure   nobody dies;
  lost         replica M-1 is SIGKILLed once its metrics reach --kill-at and stays dead: at the next sync the
               others see its heartbeat stand still for `diloco.heartbeat_s` (or wait `diloco.sync_timeout_s`
               with heartbeats off), then average without it and train on;
  restarted    the same kill, and the process is started again at once: it resumes from its checkpoint and
               replays the decided syncs, or, if the others went on without it, rejoins from their snapshot.
The model, data and schedule are experiments.diloco_vs_sync's SMALL config (outer lr 0.4, the from-scratch
M=4/H=30 best). Prints a table (final eval loss of the global params, % vs no_failure, how many replicas the syncs
still kept in the exchange averaged, the time survivors waited in syncs) and ends with one JSON line. Runs live in
WORKDIR/NAME and a finished one is skipped on a rerun.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from experiments.cli import exit_with
from experiments.diloco_vs_sync import SMALL
from jaxlm.config import DiLoCoConfig, apply_overrides, to_dict, validate
from jaxlm.metrics import read_metrics

RUNS = ("no_failure", "lost", "restarted")


def parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m experiments.diloco_process_failure", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--workdir", default="runs/diloco_process_failure")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--kill-at", type=int, help="kill the last replica once it logged this step (default: steps / 2)")
    p.add_argument(
        "--timeout",
        type=float,
        default=DiLoCoConfig.sync_timeout_s,
        help=f"diloco.sync_timeout_s (default {DiLoCoConfig.sync_timeout_s:g})",
    )
    p.add_argument(
        "--heartbeat",
        type=float,
        default=DiLoCoConfig.heartbeat_s,
        help=f"diloco.heartbeat_s, 0 = off (default {DiLoCoConfig.heartbeat_s:g})",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    args = p.parse_args(argv)
    args.kill_at = args.kill_at or args.steps // 2
    if not 0 < args.kill_at < args.steps:
        p.error(f"--kill-at must be in [1, --steps), got {args.kill_at}")
    return args


def write_config(args) -> Path:
    """The runs' config file (WORKDIR/config.py): SMALL with DiLoCo at M replicas, H=30, outer lr 0.4."""
    cfg = dataclasses.replace(
        SMALL,
        steps=args.steps,
        log_every=10,
        checkpoint_every=100,
        diloco=DiLoCoConfig(
            replicas=args.replicas,
            inner_steps=30,
            outer_lr=0.4,
            sync_timeout_s=args.timeout,
            heartbeat_s=args.heartbeat,
        ),
    )
    cfg = validate(apply_overrides(cfg, args.set))
    path = Path(args.workdir) / "config.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"# written by experiments.diloco_process_failure\nimport json\n\nfrom jaxlm.config import "
        f"from_dict\n\nconfig = from_dict(json.loads({json.dumps(json.dumps(to_dict(cfg)))}))\n"
    )
    return path


class Job:
    """M replica processes of one run; any one can be killed and started again."""

    def __init__(self, workdir: Path, config: Path, replicas: int):
        self.workdir, self.config, self.logs = workdir, config, []
        self.procs = [self.start(i) for i in range(replicas)]

    def start(self, i: int) -> subprocess.Popen:
        env = {**os.environ, "JAXLM_REPLICA_ID": str(i), "JAX_NUM_CPU_DEVICES": "1", "PYTHONUNBUFFERED": "1"}
        log = open(self.workdir / f"replica_{i}.log", "a")
        self.logs.append(log)
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "experiments.tiny_lm",
                "--workdir",
                str(self.workdir),
                "--no-progress",
                "--config",
                str(self.config),
                "--set",
                f"diloco.exchange={self.workdir}/exchange",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def last_step(self, i: int) -> int:
        path = self.workdir / f"replica_{i}" / "metrics.jsonl"
        return max((r["step"] for r in read_metrics(path) if "loss" in r), default=0) if path.exists() else 0

    def wait(self) -> list[int]:
        codes = [p.wait() for p in self.procs]
        for log in self.logs:
            log.close()
        return codes


def run(name: str, args, config: Path) -> dict:
    workdir = Path(args.workdir) / name
    result_path = workdir / "result.json"
    if result_path.exists():
        return json.loads(result_path.read_text())
    workdir.mkdir(parents=True, exist_ok=True)
    job, victim, killed_after = Job(workdir, config, args.replicas), args.replicas - 1, None
    t0 = time.perf_counter()
    if name != "no_failure":
        while job.last_step(victim) < args.kill_at and job.procs[victim].poll() is None:
            time.sleep(0.01)
        job.procs[victim].send_signal(signal.SIGKILL)
        job.procs[victim].wait()
        killed_after = job.last_step(victim)
        print(f"  {name}: killed replica {victim} after it logged step {killed_after}", file=sys.stderr)
        if name == "restarted":
            job.procs[victim] = job.start(victim)
    codes = job.wait()
    survivors = [i for i in range(args.replicas) if not (name == "lost" and i == victim)]
    if any(codes[i] for i in survivors):
        raise SystemExit(f"{name}: replica processes exited with {codes}; see {workdir}/replica_*.log")
    records = [read_metrics(workdir / f"replica_{i}" / "metrics.jsonl") for i in survivors]
    evals = [[r["eval_loss"] for r in recs if "eval_loss" in r][-1] for recs in records]
    if len(set(evals)) != 1:
        raise SystemExit(f"{name}: the survivors' final eval losses differ ({evals}): their global params diverged")
    decisions = sorted((workdir / "exchange").glob("sync_*/members.json"))
    sizes = [len(json.loads(p.read_text())["members"]) for p in decisions]
    last = [r for r in records[0] if "diloco_wait_s" in r][-1]
    log_text = (workdir / f"replica_{victim}.log").read_text()
    result = {
        "eval_loss": evals[0],
        "killed_after_step": killed_after,
        "wall_s": time.perf_counter() - t0,
        "kept_syncs": len(sizes),
        "kept_syncs_by_members": {n: sizes.count(n) for n in sorted(set(sizes))},
        "survivor_wait_s": last["diloco_wait_s"],
        "rejoined_from_snapshot": "rejoining at step" in log_text,
        "replayed": "replaying" in log_text,
    }
    result_path.write_text(json.dumps(result))
    return result


def main(argv=None) -> int:
    args = parse(argv)
    config = write_config(args)
    results = {}
    for name in RUNS:
        print(f"running {name} ...", file=sys.stderr)
        results[name] = run(name, args, config)
    base = results["no_failure"]["eval_loss"]
    beat = f"heartbeat {args.heartbeat:g}s" if args.heartbeat > 0 else "no heartbeat"
    print(f"\n{args.replicas} DiLoCo replica processes, {args.steps} steps, sync timeout {args.timeout:g}s, {beat}\n")
    print(
        "| run | final eval loss | vs no failure | killed after step | syncs still in the exchange, by members | "
        "survivor waited (s) |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        how = (
            (" (rejoined from a snapshot)" if r["rejoined_from_snapshot"] else " (replayed)" if r["replayed"] else "")
            if name == "restarted"
            else ""
        )
        members = ", ".join(f"{n}: {c}" for n, c in r["kept_syncs_by_members"].items())
        print(
            f"| {name}{how} | {r['eval_loss']:.4f} | {100 * (r['eval_loss'] / base - 1):+.2f}% | "
            f"{r['killed_after_step'] or ''} | {members} | {r['survivor_wait_s']:.1f} |"
        )
    summary = {name: round(100 * (r["eval_loss"] / base - 1), 3) for name, r in results.items() if name != "no_failure"}
    print(
        f"\ntarget: a run that loses a replica finishes within 1% of no_failure: lost {summary['lost']:+.2f}% "
        f"({'met' if abs(summary['lost']) <= 1 else 'missed'})"
    )
    print(
        json.dumps(
            {
                "no_failure_eval_loss": base,
                **{f"{k}_vs_no_failure_pct": v for k, v in summary.items()},
                **{f"{k}_eval_loss": r["eval_loss"] for k, r in results.items() if k != "no_failure"},
            }
        )
    )
    return 0


if __name__ == "__main__":
    exit_with(main())
