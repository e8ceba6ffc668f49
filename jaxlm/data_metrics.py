"""What the training loop logs about its data: the loader's counters, a mixture's realized proportions and source
epochs, and the eval figures (loss, bits per byte), overall and per source of a mixture."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from jaxlm.train import Batch


class LoaderMetrics:
    """The loader's counters for metrics.jsonl: cumulative ones as they are, plus the stall fraction since the
    last record (time the loop waited in next() / wall time; an upper bound on device idle time, since the
    asynchronously dispatched step runs meanwhile). Over a mixture (a loader whose plan has `fractions`), also
    each source's share of the rows since the last record (`data_mix/<name>`) and its epoch (`data_epoch/<name>`);
    `notes` collects a line each time a source wraps to a new epoch."""

    def __init__(self, loader, now: float, step: int = 0):
        self.loader, self.read = loader, getattr(loader, "metrics", None)
        self.t, self.stall, self.step = now, self._stall(), step
        plan = self._plan()
        self.epochs = plan.epochs_at(step) if plan else {}
        self.notes: list[str] = []

    def _plan(self):
        plan = getattr(self.loader, "plan", None)
        return plan if hasattr(plan, "fractions") else None

    def _stall(self) -> float:
        return self.read()["data_stall_s"] if self.read else 0.0

    def update(self, now: float, step: int) -> dict:
        """The record for the steps since the last one, up to training step `step` (its batch is step - 1's)."""
        record = {}
        if self.read is not None:
            record = self.read()
            stall = record["data_stall_s"]
            record["data_stall_frac"] = (stall - self.stall) / max(now - self.t, 1e-9)
            self.t, self.stall = now, stall
        plan = self._plan()
        if plan is not None and step > self.step:
            first = max(self.step, plan.origin_step)
            record.update({f"data_mix/{k}": v for k, v in plan.fractions(first, step).items()})
            epochs = plan.epochs_at(step)
            record.update({f"data_epoch/{k}": v for k, v in epochs.items()})
            for name, epoch in epochs.items():
                if epoch > self.epochs.get(name, 0):
                    self.notes.append(f"data.mixture: {name} ran out and wrapped to epoch {epoch} (a new order)")
            self.epochs = epochs
        self.step = step
        return record


def bits_per_nat(eval_batches: list[Batch], token_bytes: np.ndarray) -> float | None:
    """eval_bits_per_byte / eval_loss: the eval targets' token count / (ln 2 x the UTF-8 bytes they stand for),
    fixed for a run (its eval batches are). Bits per byte compares runs across tokenizers (Levanter's metric);
    None without eval batches, or for target ids the tokenizer lacks."""
    tokens = num_bytes = 0.0
    for batch in eval_batches:
        targets, mask = np.asarray(batch["targets"]), np.asarray(batch["loss_mask"], np.float64)
        if targets.max() >= len(token_bytes):
            return None
        tokens += mask.sum()
        num_bytes += (token_bytes[targets] * mask).sum()
    return tokens / (math.log(2) * num_bytes) if num_bytes else None


class EvalSets:
    """A run's eval batches: one list (one dataset), or a mixture's {source name: list}. Evaluates each set and
    reports eval_loss (token-weighted over all sets, as one list would be) and, per source of a mixture,
    eval_loss/<name>; with the tokenizer's bytes, eval_bits_per_byte alike."""

    def __init__(self, eval_data, token_bytes: np.ndarray | None = None):
        self.sets = dict(eval_data) if isinstance(eval_data, dict) else ({"": list(eval_data)} if eval_data else {})
        self.sets = {k: v for k, v in self.sets.items() if v}
        self.all = [b for batches in self.sets.values() for b in batches]
        self.tokens = {k: float(sum(np.sum(b["loss_mask"]) for b in v)) for k, v in self.sets.items()}
        self.per_nat = {}
        if token_bytes is not None:
            self.per_nat = {k: bits_per_nat(v, token_bytes) for k, v in self.sets.items()}
            self.per_nat[None] = self.per_nat[""] if "" in self.sets else bits_per_nat(self.all, token_bytes)

    def __bool__(self) -> bool:
        return bool(self.all)

    def evaluate(self, evaluate: Callable[[list[Batch]], float]) -> dict:
        """{eval_loss, eval_bits_per_byte (when known), and per source eval_loss/<name>, eval_bits_per_byte/<name>}
        from `evaluate(batches) -> token-weighted mean loss`."""
        losses = {k: evaluate(v) for k, v in self.sets.items()}
        total = sum(self.tokens.values())
        overall = losses[""] if "" in losses else sum(losses[k] * self.tokens[k] for k in losses) / max(total, 1.0)
        record = {"eval_loss": overall}
        if self.per_nat.get(None):
            record["eval_bits_per_byte"] = record["eval_loss"] * self.per_nat[None]
        if "" not in self.sets:
            for k, loss in losses.items():
                record[f"eval_loss/{k}"] = loss
                if self.per_nat.get(k):
                    record[f"eval_bits_per_byte/{k}"] = loss * self.per_nat[k]
        return record
