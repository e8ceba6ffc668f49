"""The training loop: feeds batches to a compiled `Program`, logs, evaluates, checkpoints, and survives failures.

What it promises a user who reruns the same command after any failure:
- it continues from the newest checkpoint that reads and verifies (`jaxlm.checkpoint`), with the data order and
  losses of a run that was never interrupted;
- SIGTERM / SIGINT stop it after the current step with a synchronous checkpoint (`jaxlm.preemption`): no step
  is lost;
- a step with a non-finite loss or gradient is skipped (the compiled step leaves the weights alone); after
  `max_bad_steps` in a row it stops with a checkpoint of the last good weights;
- a save that fails (e.g. a full disk) stops it with the last complete checkpoint intact;
- its wall time is accounted for in `goodput.jsonl` (`jaxlm.goodput`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

import jax
import numpy as np
from jax.sharding import Mesh

from jaxlm import config as config_lib
from jaxlm.checkpoint import Checkpointer, CheckpointSaveError, shape_mismatches
from jaxlm.config import TrainConfig
from jaxlm.goodput import Goodput, append_record, summary
from jaxlm.metrics import MetricsLogger, NullLogger
from jaxlm.model import model_flops_per_token
from jaxlm.preemption import Preempted, StopSignals
from jaxlm.train import Batch, make_program
from sharding.distributed import process_rows
from sharding.mesh import MeshLayout
from sharding.pipeline import bubble_fraction


class TrainingDiverged(RuntimeError):
    """`max_bad_steps` consecutive steps had a non-finite loss or gradient; a checkpoint of the last good
    weights was written."""


OUTCOMES = {Preempted: "preempted", TrainingDiverged: "diverged", CheckpointSaveError: "checkpoint_failed"}


class LoaderMetrics:
    """The loader's counters for metrics.jsonl: cumulative ones as they are, plus the stall fraction since the
    last record (time the loop waited in next() / wall time; an upper bound on device idle time, since the
    asynchronously dispatched step runs meanwhile)."""

    def __init__(self, loader, now: float):
        self.read = getattr(loader, "metrics", None)
        self.t, self.stall = now, self._stall()

    def _stall(self) -> float:
        return self.read()["data_stall_s"] if self.read else 0.0

    def update(self, now: float) -> dict:
        if self.read is None:
            return {}
        record = self.read()
        stall = record["data_stall_s"]
        record["data_stall_frac"] = (stall - self.stall) / max(now - self.t, 1e-9)
        self.t, self.stall = now, stall
        return record


class BadStepCounter:
    """Reads each step's `skipped` flag one step late (when the next step is already queued on the devices, so
    reading it does not stall them) and counts skipped steps, in total and in a row."""

    def __init__(self, limit: int):
        self.limit, self.total, self.streak, self.last_bad = limit, 0, 0, 0
        self.pending: list[tuple[int, jax.Array]] = []

    def add(self, step: int, skipped: jax.Array) -> None:
        self.pending.append((step, skipped))

    def resolve(self, keep_last: bool = True) -> list[int]:
        """Reads the pending flags (all but the newest if `keep_last`); returns the steps that were skipped."""
        ready = self.pending[:-1] if keep_last else self.pending
        self.pending = self.pending[len(ready):]
        bad = []
        for step, skipped in ready:
            if float(jax.device_get(skipped)) > 0:
                self.total, self.streak, self.last_bad = self.total + 1, self.streak + 1, step
                bad.append(step)
            else:
                self.streak = 0
        return bad

    @property
    def exhausted(self) -> bool:
        return self.streak >= self.limit


class Trainer:
    """Runs `cfg.steps` optimizer steps, resuming from the workdir's latest usable checkpoint if there is one."""

    def __init__(self, cfg: TrainConfig, mesh: Mesh, workdir, train_iter: Iterator[Batch], eval_batches: list[Batch],
                 *, layout: MeshLayout | None = None, progress: bool = True, goodput: Goodput | None = None):
        """`goodput`: started at process launch by the CLI, so startup time is counted; else starts now."""
        self.cfg, self.workdir = cfg, workdir
        self.train_iter, self.eval_batches = train_iter, eval_batches
        self.goodput = goodput or Goodput()
        self.program = make_program(cfg, mesh, layout)
        self.primary = jax.process_index() == 0  # the one process that writes logs, plots and config.json
        if jax.process_count() > 1:
            self._read_process_rows()
        self.program.attach(train_iter)
        self.checkpointer = Checkpointer(f"{workdir}/checkpoints", keep=cfg.keep_checkpoints,
                                         async_save=cfg.async_checkpointing, primary=self.primary)
        self.progress = progress
        self.rejoined = False  # set by restore_or_init
        self.notes: list[str] = [f"removed incomplete checkpoint {name} (a save cut short by a crash)"
                                 for name in self.checkpointer.removed]

    def _read_process_rows(self) -> None:
        """Multi-process: each process reads only the training rows its devices hold under the batch sharding."""
        d = self.cfg.data
        lo, hi = process_rows(self.program.batch_sharding, (d.batch_size, d.seq_len))
        if not hasattr(self.train_iter, "set_rows"):
            raise TypeError(f"a multi-process run needs a data iterator with set_rows(start, stop) to read rows "
                            f"[{lo}, {hi}) of each batch; {type(self.train_iter).__name__} has none")
        self.train_iter.set_rows(lo, hi)  # eval batches stay whole: device_batch takes each device's rows

    # ------------------------------------------------------------------------- restore

    def restore_or_init(self):
        """The newest usable checkpoint's state (the data iterator repositioned), else a fresh init. Messages
        about skipped checkpoints go to `self.notes`."""
        restored = self.checkpointer.restore_latest(self.program.abstract_with_shardings(),
                                                    check=self._check_compatible, log=self.notes.append)
        if restored is None:
            state = self.program.init()
        else:
            _, state, data_state, _ = restored
            self.train_iter.set_state(data_state)
        state, moved_data_state = self.program.catch_up(state, log=self.notes.append)
        self.rejoined = moved_data_state is not None  # a DiLoCo replica moved to the others' state
        if moved_data_state:
            self.train_iter.set_state(moved_data_state)
        return state

    def _check_compatible(self, step: int, saved_cfg: dict) -> None:
        """Refuses a checkpoint written with a config that shapes the state or the data differently, naming the
        fields (and the first parameters whose shapes differ): compared before any array is read, so the user
        gets that line instead of an Orbax shape error."""
        changed = config_lib.diff(saved_cfg["model"], config_lib.to_dict(self.cfg.model), "model.")
        saved_data, data = ({k: v for k, v in c.items() if k not in config_lib.DATA_SPEED_FIELDS}
                            for c in (saved_cfg["data"], config_lib.to_dict(self.cfg.data)))
        changed += config_lib.diff(saved_data, data, "data.")
        # the optimizers and DiLoCo settings shape the saved state: another choice cannot continue it
        defaults = config_lib.to_dict(config_lib.TrainConfig())
        saved_diloco, diloco = ({k: v for k, v in c.items() if k not in config_lib.DILOCO_PROCESS_FIELDS}
                                for c in (saved_cfg.get("diloco", defaults["diloco"]),
                                          config_lib.to_dict(self.cfg.diloco)))
        changed += config_lib.diff(saved_diloco, diloco, "diloco.")
        saved_optimizer = saved_cfg["optim"].get("optimizer", "adamw")
        if saved_optimizer != self.cfg.optim.optimizer:
            changed.append(f"optim.optimizer: {saved_optimizer!r} -> {self.cfg.optim.optimizer!r}")
        if changed:
            try:
                shapes = shape_mismatches(self.checkpointer.saved_shapes(step), self.program.abstract_state)
            except Exception:  # only detail for the message: an unreadable metadata file must not hide the diff
                shapes = []
            params = f"; parameters: {'; '.join(shapes)}" if shapes else ""
            raise config_lib.ConfigError(f"checkpoint at step {step} in {self.workdir} was written with a different "
                                         f"config ({'; '.join(changed)}{params}); use a new --workdir or the "
                                         f"original config")

    # ------------------------------------------------------------------------- the loop

    def run(self) -> dict:
        """Trains to `cfg.steps`; returns the last logged record. Raises Preempted (after a checkpoint) on
        SIGTERM / SIGINT, TrainingDiverged, CheckpointSaveError, or ConfigError for an incompatible checkpoint."""
        gp = self.goodput
        gp.seconds["startup"] += time.perf_counter() - gp.start
        logger, outcome = NullLogger(), "error"
        try:
            with StopSignals() as signals:
                with gp.timing("restore"):
                    state = self.restore_or_init()
                start = int(jax.device_get(state.step))  # replicated: every process reads its local copy
                if self.primary:
                    config_path = Path(self.workdir) / "config.json"
                    tmp = config_path.with_suffix(".json.tmp")  # written whole or not at all
                    tmp.write_text(json.dumps(config_lib.to_dict(self.cfg), indent=2) + "\n")
                    tmp.replace(config_path)
                    logger = MetricsLogger(self.workdir, total_steps=self.cfg.steps, start_step=start,
                                           progress=self.progress, tensorboard=self.cfg.tensorboard)
                    gp.lost_steps = logger.recomputed_steps
                for note in self.notes:
                    logger.info(note)
                last = self._loop(state, start, logger, signals)
                with gp.timing("checkpoint"):
                    self.checkpointer.wait()
                outcome = "finished"
                return last
        except Exception as e:
            outcome = OUTCOMES.get(type(e), "error")
            raise
        finally:
            try:
                self.checkpointer.manager.close()
            except Exception:  # a failed save was already reported; closing must not mask the first error
                pass
            if self.primary and gp.steps:
                logger.info(summary(append_record(self.workdir, gp.record(outcome))))
            logger.close()
            if hasattr(self.train_iter, "close"):
                self.train_iter.close()  # stops prefetch threads; a later next() would start them again
            self.program.close()

    def _loop(self, state, start: int, logger, signals: StopSignals) -> dict:
        cfg, program, gp = self.cfg, self.program, self.goodput
        tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
        flops_per_token = model_flops_per_token(cfg.model, program.num_params, cfg.data.seq_len)
        logger.info(f"params {program.num_params / 1e6:.2f}M, {flops_per_token / 1e6:.1f} MFLOP/token, "
                    f"{'resuming at step ' + str(start) if start else 'starting from scratch'}")
        layout = program.layout
        if description := program.describe():
            logger.info(description)
        if layout.pipeline > 1:
            logger.info(f"pipeline: {layout.pipeline} stages, {layout.pipeline_schedule}, {layout.num_microbatches} "
                        f"microbatches per step: bubble {bubble_fraction(layout.pipeline, layout.num_microbatches):.1%}")
        if start >= cfg.steps and self.rejoined:
            return self._finish_rejoined(state, start, logger)
        if start >= cfg.steps:
            logger.info(f"already at step {start} >= steps {cfg.steps}; nothing to do")
            return {}
        if hasattr(self.train_iter, "set_device_put"):  # the loader's thread puts batches on devices
            self.train_iter.set_device_put(program.device_batch)
            to_device = lambda batch: batch  # noqa: E731
        else:
            to_device = program.device_batch

        def next_batch():
            with gp.timing("data"):
                return to_device(next(self.train_iter))

        batch = next_batch()
        with gp.timing("compile"):
            t0 = time.perf_counter()
            step_fn = program.compile_step(state, batch)
        logger.info(f"compiled train step in {time.perf_counter() - t0:.1f}s")
        bad = BadStepCounter(cfg.max_bad_steps)
        last, t_last, steps_since = {}, time.perf_counter(), 0
        last_save = t_last
        loader_metrics = LoaderMetrics(self.train_iter, t_last)
        for step in range(start + 1, cfg.steps + 1):
            state, metrics = step_fn(state, batch, step)
            data_state = self.train_iter.get_state()  # the next step's batch, before it is prefetched below
            gp.step_done()
            bad.add(step, metrics["skipped"])
            steps_since += 1
            is_last = step == cfg.steps
            if step < cfg.steps:
                batch = next_batch()  # overlaps with the running step
            is_log = step % cfg.log_every == 0 or is_last or step == start + 1
            for s in bad.resolve(keep_last=not is_log):
                logger.info(f"step {s}: non-finite loss or gradient; update skipped ({bad.streak} in a row)")
            if bad.exhausted:
                self._save(step, state, data_state, wait=True)
                raise TrainingDiverged(
                    f"{bad.streak} consecutive steps up to step {bad.last_bad} had a non-finite loss or "
                    f"gradient (max_bad_steps = {cfg.max_bad_steps}); their updates were skipped and the last good "
                    f"weights are checkpointed at step {step}; lower optim.learning_rate or check the data")
            if is_log:
                metrics = jax.device_get(metrics)  # replicated outputs: a local copy, also across processes
                now = time.perf_counter()
                tokens_per_s = steps_since * tokens_per_step / (now - t_last)
                last = {"step": step, "loss": float(metrics["loss"]), "lr": float(metrics["lr"]),
                        "grad_norm": float(metrics["grad_norm"]), "tokens_per_s": tokens_per_s,
                        "model_gflops_per_s": tokens_per_s * flops_per_token / 1e9, "skipped_steps": bad.total,
                        **program.step_metrics(step), **loader_metrics.update(now)}
                logger.log(last)
                t_last, steps_since = now, 0
            for note in program.drain_notes():
                logger.info(note)
            if self.eval_batches and ((cfg.eval_every and step % cfg.eval_every == 0) or is_last):
                last["eval_loss"] = self._evaluate(state, step, logger)
                t_last = time.perf_counter()  # eval time is not training throughput
            preempt, overdue = self._agree(step, is_log, signals.received is not None,
                                           cfg.checkpoint_minutes > 0
                                           and time.perf_counter() - last_save >= 60 * cfg.checkpoint_minutes)
            if preempt:
                save_s = self._save(step, state, data_state, wait=True)
                raise Preempted(step, signals.received or "SIGTERM / SIGINT to another process", save_s)
            if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or is_last or overdue:
                self._save(step, state, data_state)  # every process saves
                t_last = last_save = time.perf_counter()  # the blocking part of a save is not throughput either
        return last

    def _finish_rejoined(self, state, step: int, logger) -> dict:
        """A replica that came back after the others finished rejoined at the final step: the run's final global
        params are its result too, so it evaluates and checkpoints them like a replica that trained to the end."""
        last = {"step": step}
        if self.eval_batches:
            last["eval_loss"] = self._evaluate(state, step, logger)
        self._save(step, state, self.train_iter.get_state())
        return last

    def _evaluate(self, state, step: int, logger) -> float:
        """The eval loss of `state`'s params, logged at `step` (its time counted as eval, not training)."""
        with self.goodput.timing("eval"):
            eval_loss = self.program.evaluate(self.program.eval_params(state), self.eval_batches)
        logger.log({"step": step, "eval_loss": eval_loss})
        return eval_loss

    def _save(self, step: int, state, data_state: dict, *, wait: bool = False) -> float:
        """Checkpoints `step` (and waits for it to be on disk if `wait`); returns the seconds it blocked."""
        self.goodput.saves += 1
        with self.goodput.timing("checkpoint"):
            t0 = time.perf_counter()
            self.checkpointer.save(step, state, data_state, config_lib.to_dict(self.cfg))
            if wait:
                self.checkpointer.wait()
            return time.perf_counter() - t0

    def _agree(self, step: int, is_log: bool, *flags: bool) -> tuple[bool, ...]:
        """Every process must take the same decision about stopping and saving. One process decides alone;
        several compare their flags at log steps (a signal may reach only some of them), which costs one small
        all-gather per log interval instead of one per step."""
        if jax.process_count() == 1:
            return flags
        if not is_log:
            return (False,) * len(flags)
        from jax.experimental import multihost_utils

        gathered = multihost_utils.process_allgather(np.asarray(flags, np.int32))
        return tuple(bool(x) for x in np.asarray(gathered).reshape(-1, len(flags)).any(axis=0))
