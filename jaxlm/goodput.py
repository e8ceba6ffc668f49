"""Goodput: where a run's wall time went, and how much of it advanced training.

The loop is split into the activities that are not training steps (startup, restore, compile, data waits,
eval, checkpoint saves); what is left is step time. Steps that a resumed run computes again (they were done
before the failure, after the last checkpoint) are step time too, but lost: goodput counts only the rest.
Each run appends one record to `goodput.jsonl` in the workdir, so a run's cost across restarts adds up.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from jaxlm.metrics import read_metrics, write_records

GOODPUT_FILE = "goodput.jsonl"
ACTIVITIES = ("startup", "restore", "compile", "data", "eval", "checkpoint")


class Goodput:
    def __init__(self, start: float | None = None):
        """`start`: perf_counter() at process launch if known (the CLI records it), else now."""
        self.start = time.perf_counter() if start is None else start
        self.seconds = dict.fromkeys(ACTIVITIES, 0.0)
        self.steps = 0  # steps computed by this run
        self.saves = 0
        self.lost_steps = 0  # of which recomputed: done before a failure, after the checkpoint resumed from
        self.first_step_s: float | None = None  # launch -> first step done: what a restart costs before work

    @contextlib.contextmanager
    def timing(self, activity: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[activity] += time.perf_counter() - t0

    def step_done(self) -> None:
        self.steps += 1
        if self.first_step_s is None:
            self.first_step_s = time.perf_counter() - self.start

    def record(self, outcome: str) -> dict:
        """This run's split of wall time into seconds per activity, step time, lost time and goodput."""
        wall = time.perf_counter() - self.start
        step_s = max(wall - sum(self.seconds.values()), 0.0)
        lost_s = step_s * min(self.lost_steps, self.steps) / max(self.steps, 1)
        productive = step_s - lost_s
        return {
            "outcome": outcome,
            "wall_s": wall,
            **{f"{k}_s": v for k, v in self.seconds.items()},
            "step_s": step_s,
            "steps": self.steps,
            "saves": self.saves,
            "lost_steps": self.lost_steps,
            "lost_s": lost_s,
            "productive_s": productive,
            "goodput": productive / wall if wall > 0 else 0.0,
            "first_step_s": self.first_step_s,
        }


def read_goodput(workdir: str | Path) -> list[dict]:
    """Every run's record in the workdir's goodput.jsonl (a last line torn by a killed run is left out)."""
    return read_metrics(Path(workdir) / GOODPUT_FILE)


def append_record(workdir: str | Path, record: dict) -> list[dict]:
    """Adds `record` to the workdir's goodput.jsonl; returns every run's record so far (this one last). The file is
    rewritten whole, so a line torn by a killed run is dropped instead of glued to the new record."""
    records = read_goodput(workdir) + [record]
    write_records(Path(workdir) / GOODPUT_FILE, records)
    return records


def summary(records: list[dict]) -> str:
    """One line: this run's goodput and its split, and the total over every run in the workdir."""
    run = records[-1]
    parts = [f"{k} {run[f'{k}_s']:.1f}s" for k in ("step", *ACTIVITIES) if run[f"{k}_s"] >= 0.05]
    if run["lost_steps"]:
        parts.append(f"{run['lost_steps']} recomputed steps {run['lost_s']:.1f}s")
    line = f"goodput {run['goodput']:.1%} of {run['wall_s']:.1f}s ({', '.join(parts)})"
    if len(records) > 1:
        wall = sum(r["wall_s"] for r in records)
        line += f"; over {len(records)} runs {sum(r['productive_s'] for r in records) / wall:.1%} of {wall:.1f}s"
    return line
