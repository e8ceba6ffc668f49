"""Where a run's numbers go: metrics.jsonl (the record), TensorBoard events, a progress bar, and a loss plot.

On resume, records of steps after the restored checkpoint are dropped from metrics.jsonl first: those steps are
about to be recomputed, and the file should read as one uninterrupted run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm import tqdm

from data.atomic_file import write_atomic

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


class MetricsLogger:
    def __init__(
        self,
        workdir: str | Path,
        *,
        total_steps: int,
        start_step: int = 0,
        progress: bool = True,
        tensorboard: bool = True,
    ):
        self.workdir = Path(workdir)
        self.path = self.workdir / METRICS_FILE
        # steps the previous run had done after the checkpoint this run resumes from: computed again, i.e. lost
        self.recomputed_steps = max(_truncate_after(self.path, start_step) - start_step, 0)
        self.file = open(self.path, "a")
        self.tb = None
        if tensorboard:
            self.tb = _summary_writer_class()(str(self.workdir / "tensorboard"))
        self.bar = tqdm(
            total=total_steps,
            initial=start_step,
            unit="step",
            dynamic_ncols=True,
            disable=not progress,
            file=sys.stderr,
        )
        self.step = start_step
        self.shown: dict[str, float] = {}

    def log(self, record: dict) -> None:
        """Appends one record ({"step": int, ...numbers}) everywhere."""
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        step = record["step"]
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, step)
                elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                    self.tb.add_text(key, _markdown(value), step)  # e.g. eval_samples: [{prompt, continuation}]
        if step > self.step:
            self.bar.update(step - self.step)
            self.step = step
        self.shown.update({k: record[k] for k in ("loss", "eval_loss", "tokens_per_s") if k in record})
        self.bar.set_postfix({k: f"{v:.4g}" for k, v in self.shown.items()}, refresh=True)

    def info(self, message: str) -> None:
        self.bar.write(message, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        records = read_metrics(self.path)
        if records:
            plot_loss(records, self.workdir / PLOT_FILE)


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch. Where torch is installed tensorboardX imports it, only
    to accept torch tensors, which a run never logs: 1.7 s of every run's start on 2 cores."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError while this stands
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def _markdown(rows: list[dict]) -> str:
    """A list of records as TensorBoard's text tab shows it: one line per record, its fields in code spans."""
    return "\n\n".join(" → ".join(f"`{str(v)!r}`" for v in row.values()) for row in rows)


class NullLogger:
    """What processes other than 0 log to in a multi-process run: one process writes the files and the bar."""

    def log(self, record: dict) -> None:
        pass

    def info(self, message: str) -> None:
        pass

    def close(self) -> None:
        pass


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl. A last line without its newline is a write cut short by a killed process
    and is left out; any other unreadable line is an error naming it."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines = lines[:-1]
    records = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError:
                raise ValueError(f"{path}: line {number} is not a JSON record: {line[:80]!r}") from None
    return records


def write_records(path: str | Path, records: list[dict]) -> None:
    """Replaces a JSONL file with `records`, whole or not at all (a temporary file, then a rename)."""
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))


def _truncate_after(path: Path, step: int) -> int:
    """Drops the records of steps after `step` (about to be recomputed); returns the highest step the file had."""
    if not path.exists():
        return 0
    records = read_metrics(path)
    write_records(path, [r for r in records if r.get("step", 0) <= step])
    return max((r.get("step", 0) for r in records), default=0)


def plot_loss(records: list[dict], out: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for key, style in (("loss", "-"), ("eval_loss", "o-")):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, style, label=key.replace("_", " "), markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
