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
from flax import nnx
from jax.sharding import Mesh

from data.atomic_file import write_atomic
from data.fault_points import pause_point
from jaxlm import config as config_lib
from jaxlm import diloco
from jaxlm.checkpoint import Checkpointer, CheckpointSaveError, NonFiniteState, shape_mismatches
from jaxlm.config import TrainConfig
from jaxlm.config_resume import resume_changes
from jaxlm.data_metrics import EvalSets, LoaderMetrics
from jaxlm.generate import generate
from jaxlm.goodput import Goodput, append_record, summary
from jaxlm.metrics import MetricsLogger, NullLogger
from jaxlm.model import model_flops_per_token
from jaxlm.preemption import Preempted, StopSignals
from jaxlm.train import Batch, Program
from sharding.mesh import MeshLayout
from sharding.pipeline import runs_in_lockstep


class TrainingDiverged(RuntimeError):
    """`max_bad_steps` consecutive steps had a non-finite loss or gradient; a checkpoint of the last good
    weights was written."""


OUTCOMES = {Preempted: "preempted", TrainingDiverged: "diverged", CheckpointSaveError: "checkpoint_failed"}
OUTCOMES[NonFiniteState] = OUTCOMES[CheckpointSaveError]


def make_program(cfg: TrainConfig, mesh: Mesh, layout: MeshLayout | None = None) -> Program:
    """The compiled program a config asks for: DiLoCo's when its section is on (the one place the loop's side
    knows of it), else plain synchronous training."""
    if cfg.diloco.enabled:
        return diloco.make_program(cfg, mesh, layout)
    return Program(cfg, mesh, layout)


class BadStepCounter:
    """Reads each step's `skipped` flag one step late (when the next step is already queued on the devices, so
    reading it does not stall them) and counts skipped steps, in total and in a row."""

    def __init__(self, limit: int):
        self.limit, self.total, self.streak, self.last_bad = limit, 0, 0, 0
        self.first_bad: int | None = None  # the first skipped step of this run
        self.pending: list[tuple[int, jax.Array]] = []

    def add(self, step: int, skipped: jax.Array) -> None:
        self.pending.append((step, skipped))

    def resolve(self, keep_last: bool = True) -> list[int]:
        """Reads the pending flags (all but the newest if `keep_last`); returns the steps that were skipped."""
        ready = self.pending[:-1] if keep_last else self.pending
        self.pending = self.pending[len(ready) :]
        bad = []
        for step, skipped in ready:
            if float(jax.device_get(skipped)) > 0:
                self.total, self.streak, self.last_bad = self.total + 1, self.streak + 1, step
                self.first_bad = step if self.first_bad is None else self.first_bad
                bad.append(step)
            else:
                self.streak = 0
        return bad

    @property
    def exhausted(self) -> bool:
        return self.streak >= self.limit


class Throughput:
    """Tokens per second between two log records, leaving out the time spent in eval and blocking saves."""

    def __init__(self, tokens_per_step: int, flops_per_token: float):
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.t, self.steps = time.perf_counter(), 0

    def step(self) -> None:
        self.steps += 1

    def restart(self) -> None:
        """The time since the last record is not training throughput (an eval, a save)."""
        self.t = time.perf_counter()

    def record(self) -> dict:
        now = time.perf_counter()
        tokens_per_s = self.steps * self.tokens_per_step / (now - self.t)
        self.t, self.steps = now, 0
        return {"tokens_per_s": tokens_per_s, "model_gflops_per_s": tokens_per_s * self.flops_per_token / 1e9}


def _holds(path: Path, text: str) -> bool:
    """Whether `path` already holds `text` (a resumed run rewrites nothing it has: a full disk fails at the save)."""
    try:
        return path.read_text() == text
    except (OSError, UnicodeDecodeError):
        return False


def _describe(fingerprint: dict) -> str:
    if "mixture" in fingerprint:
        return f"the mixture of {', '.join(sorted(fingerprint['mixture']))}"
    return (
        f"{fingerprint.get('tokens')} tokens, tokenizer {fingerprint.get('tokenizer')}, "
        f"sample sha256 {fingerprint.get('sample_sha256')}"
    )


def _difference(saved: dict, now: dict) -> str:
    """What the data now is, against a checkpoint's fingerprint; for mixtures, which datasets differ."""
    was, mix = saved.get("mixture"), now.get("mixture")
    if was is None or mix is None:
        return f"{'data.mixture' if mix is not None else 'data.path'} now holds {_describe(now)}"
    parts = [
        f"{what} {', '.join(names)}"
        for what, names in (
            ("data.mixture adds", sorted(set(mix) - set(was))),
            ("drops", sorted(set(was) - set(mix))),
            ("has other data under", sorted(k for k in set(was) & set(mix) if was[k] != mix[k])),
        )
        if names
    ]
    return "; ".join(parts)


class Trainer:
    """Runs `cfg.steps` optimizer steps, resuming from the workdir's latest usable checkpoint if there is one."""

    def __init__(
        self,
        cfg: TrainConfig,
        mesh: Mesh,
        workdir,
        train_iter: Iterator[Batch],
        eval_batches: list[Batch] | dict[str, list[Batch]],
        *,
        layout: MeshLayout | None = None,
        progress: bool = True,
        goodput: Goodput | None = None,
        data_fingerprint: dict | None = None,
        tokenizer=None,
    ):
        """`goodput`: started at process launch by the CLI, so startup time is counted; else starts now.
        `data_fingerprint` (jaxlm.run_data.run_data_fingerprint): saved with each checkpoint, and a checkpoint saved
        with another one is not resumed unless data.allow_other_data.
        `tokenizer` (data.text_tokenizer.TextTokenizer, jaxlm.run_data.run_tokenizer): the data's; saved with each
        checkpoint (a checkpoint is never continued on data of another tokenizer) and as WORKDIR/tokenizer.json,
        and the UTF-8 bytes behind its tokens turn eval losses into eval_bits_per_byte.
        `eval_batches`: a list, or a mixture's {source name: list} (each source's loss is logged too)."""
        self.cfg, self.workdir = cfg, workdir
        self.data_fingerprint, self.tokenizer = data_fingerprint, tokenizer
        self.train_iter = train_iter
        self.eval_sets = EvalSets(eval_batches, tokenizer.token_bytes if tokenizer is not None else None)
        self.eval_batches = self.eval_sets.all
        self.goodput = goodput or Goodput()
        self.program = make_program(cfg, mesh, layout)
        self.primary = jax.process_index() == 0  # the one process that writes logs, plots and config.json
        self._read_rows()
        self.checkpointer = Checkpointer(
            f"{workdir}/checkpoints",
            keep=cfg.keep_checkpoints,
            async_save=cfg.async_checkpointing,
            primary=self.primary,
        )
        self.progress = progress
        self.moved = False  # set by restore_or_init: the program moved the restored state (a replica caught up)
        self.logger = None  # the run's MetricsLogger (NullLogger on other processes), once run() opened it
        self.notes: list[str] = [
            f"removed incomplete checkpoint {name} (a save cut short by a crash)" for name in self.checkpointer.removed
        ]
        if cfg.eval_prompts and jax.process_count() > 1:
            self.notes.append("eval_prompts: samples are generated in single-process runs only")
        if cfg.eval_harness_tasks and (jax.process_count() > 1 or tokenizer is None):
            self.notes.append("eval_harness_tasks: lm-eval runs in single-process runs with a tokenizer only")

    def _read_rows(self) -> None:
        """The iterator reads only the rows of each batch this process's program needs (all, on one process)."""
        rows = self.program.rows_to_read()
        if rows is None:
            return
        if not hasattr(self.train_iter, "set_rows"):
            raise TypeError(
                f"this run reads rows [{rows[0]}, {rows[1]}) of each batch and needs a data iterator with "
                f"set_rows(start, stop); {type(self.train_iter).__name__} has none"
            )
        self.train_iter.set_rows(*rows)  # eval batches stay whole: device_batch takes each device's rows

    def log(self, line: str) -> None:
        """A line for the run log; kept until the log is open."""
        if self.logger is None:
            self.notes.append(line)
        else:
            self.logger.info(line)

    # ------------------------------------------------------------------------- restore

    def restore_or_init(self):
        """The newest usable checkpoint's state (the data iterator repositioned), else a fresh init, as the program
        starts from it. Messages about skipped checkpoints go to the run log."""
        restored = self.checkpointer.restore_latest(
            self.program.abstract_with_shardings(), check=self._check_compatible, log=self.log
        )
        if restored is None:
            state = self.program.init()
        else:
            _, state, data_state, _ = restored
            if self.cfg.data.allow_other_data:  # the stream continues at its step on whatever data is there now
                data_state = {k: v for k, v in data_state.items() if k != "num_samples"}
            self.train_iter.set_state(data_state)
        state, moved_data_state = self.program.start(state, self.train_iter, log=self.log)
        self.moved = moved_data_state is not None
        if moved_data_state:
            self.train_iter.set_state(moved_data_state)
        return state

    def _check_compatible(self, step: int, saved_cfg: dict) -> None:
        """Refuses a checkpoint written with a config that shapes the state or the data differently, naming the
        fields (and the first parameters whose shapes differ): compared before any array is read, so the user
        gets that line instead of an Orbax shape error."""
        changed = resume_changes(saved_cfg, self.cfg)
        if changed:
            try:
                shapes = shape_mismatches(self.checkpointer.saved_shapes(step), self.program.abstract_state)
            except Exception:  # only detail for the message: an unreadable metadata file must not hide the diff
                shapes = []
            params = f"; parameters: {'; '.join(shapes)}" if shapes else ""
            raise config_lib.ConfigError(
                f"checkpoint at step {step} in {self.workdir} was written with a different "
                f"config ({'; '.join(changed)}{params}); use a new --workdir or the "
                f"original config"
            )
        self._check_same_tokenizer(step, saved_cfg.get(config_lib.TOKENIZER_KEY))
        self._check_same_data(step, saved_cfg.get(config_lib.DATA_FINGERPRINT_KEY))

    def _check_same_tokenizer(self, step: int, saved: dict | None) -> None:
        """Refuses data written with another tokenizer than the checkpoint's, whatever data.allow_other_data says:
        its ids mean other text to the model (fine-tuning an imported model on data of another tokenizer)."""
        if saved is None or self.tokenizer is None or saved.get("sha256") == self.tokenizer.sha256:
            return
        raise config_lib.ConfigError(
            f"checkpoint at step {step} in {self.workdir} was trained with tokenizer {saved.get('name')} "
            f"(sha256 {str(saved.get('sha256'))[:12]}) but data.path's tokens were written with "
            f"{self.tokenizer.name} (sha256 {self.tokenizer.sha256[:12]}); prepare the data with the checkpoint's "
            f"tokenizer: python -m data.prepare ... --tokenizer {self.workdir}/tokenizer.json"
        )

    def _check_same_data(self, step: int, saved: dict | None) -> None:
        """Refuses to continue a checkpoint on token data other than its own (same size or not: a rewritten data
        directory would otherwise continue on different data without a word)."""
        now = self.data_fingerprint
        if saved is None or now is None or saved == now:
            return
        if self.cfg.data.allow_other_data:
            self.log(
                f"checkpoint {step} was trained on other data ({_describe(saved)}); continuing on {_describe(now)}"
            )
            return
        raise config_lib.ConfigError(
            f"checkpoint at step {step} in {self.workdir} was trained on other data: it saw {_describe(saved)}, "
            f"{_difference(saved, now)}; use the original data, a new --workdir, or "
            f"--set data.allow_other_data=true to continue on this data"
        )

    # ------------------------------------------------------------------------- the run

    def run(self) -> dict:
        """Trains to `cfg.steps`; returns the last logged record. Raises Preempted (after a checkpoint) on
        SIGTERM / SIGINT, TrainingDiverged, CheckpointSaveError, or ConfigError for an incompatible checkpoint."""
        gp = self.goodput
        gp.seconds["startup"] += time.perf_counter() - gp.start
        outcome = "error"
        with StopSignals() as signals:  # closing too: a second Ctrl-C while the logs close is one line, not a traceback
            try:
                with gp.timing("restore"):
                    state = self.restore_or_init()
                start = int(jax.device_get(state.step))  # replicated: every process reads its local copy
                self._open_log(start)
                last = self._train(state, start, signals)
                with gp.timing("checkpoint"):
                    self.checkpointer.wait()
                outcome = "finished"
                return last
            except Exception as e:
                outcome = OUTCOMES.get(type(e), "error")
                raise
            finally:
                signals.closing = True
                pause_point("trainer.close")
                self._close(outcome)

    def _open_log(self, start: int) -> None:
        """config.json, the metrics logger, and the lines noted before it existed."""
        self.logger = NullLogger()
        if self.primary:
            config_path = Path(self.workdir) / "config.json"
            write_atomic(config_path, json.dumps(config_lib.to_dict(self.cfg), indent=2) + "\n")
            saved_tokenizer = Path(self.workdir) / "tokenizer.json"  # what generate and export_hf read text with
            if self.tokenizer is not None and not _holds(saved_tokenizer, self.tokenizer.json):
                self.tokenizer.save(self.workdir)
            self.logger = MetricsLogger(
                self.workdir,
                total_steps=self.cfg.steps,
                start_step=start,
                progress=self.progress,
                tensorboard=self.cfg.tensorboard,
            )
            self.goodput.lost_steps = self.logger.recomputed_steps
        notes, self.notes = self.notes, []
        for note in notes:
            self.logger.info(note)

    def _close(self, outcome: str) -> None:
        try:
            self.checkpointer.manager.close()
        except Exception:  # a failed save was already reported; closing must not mask the first error
            pass
        logger = self.logger or NullLogger()
        if self.primary and self.goodput.steps:
            logger.info(summary(append_record(self.workdir, self.goodput.record(outcome))))
        logger.close()
        if hasattr(self.train_iter, "close"):
            self.train_iter.close()  # stops prefetch threads; a later next() would start them again
        self.program.close()

    def _describe(self, start: int, flops_per_token: float) -> None:
        program, layout = self.program, self.program.layout
        self.log(
            f"params {program.num_params / 1e6:.2f}M, {flops_per_token / 1e6:.1f} MFLOP/token, "
            f"{'resuming at step ' + str(start) if start else 'starting from scratch'}"
        )
        if layout.pipeline > 1:
            locked = runs_in_lockstep(layout, program.cfg.model.context_parallel)
            self.log(
                f"pipeline: {layout.pipeline} stages, {layout.pipeline_schedule}{' in lockstep' if locked else ''}, "
                f"{layout.num_microbatches} microbatches per step: bubble {pipeline_bubble(layout, locked):.1%}"
            )

    def _batches(self):
        """next_batch() -> the next batch on the devices, its wait counted as data time."""
        if hasattr(self.train_iter, "set_device_put"):  # the loader's thread puts batches on devices
            self.train_iter.set_device_put(self.program.device_batch)
            to_device = lambda batch: batch
        else:
            to_device = self.program.device_batch

        def next_batch():
            with self.goodput.timing("data"):
                return to_device(next(self.train_iter))

        return next_batch

    def _compile(self, state, batch):
        with self.goodput.timing("compile"):
            t0 = time.perf_counter()
            step_fn = self.program.compile_step(state, batch)
        self.log(f"compiled train step in {time.perf_counter() - t0:.1f}s")
        return step_fn

    # ------------------------------------------------------------------------- the loop and its steps

    def _train(self, state, start: int, signals: StopSignals) -> dict:
        """The loop: step, then account for skipped steps, log, evaluate, and stop or save, each in its own method."""
        cfg = self.cfg
        flops_per_token = model_flops_per_token(cfg.model, self.program.num_params, cfg.data.seq_len)
        self._describe(start, flops_per_token)
        if start >= cfg.steps and self.moved:
            return self._finish_moved(state, start)
        if start >= cfg.steps:
            self.log(f"already at step {start} >= steps {cfg.steps}; nothing to do")
            return {}
        next_batch = self._batches()
        batch = next_batch()
        step_fn = self._compile(state, batch)
        bad = self.bad_steps = BadStepCounter(cfg.max_bad_steps)
        speed = Throughput(cfg.data.batch_size * cfg.data.seq_len, flops_per_token)
        loader_metrics = LoaderMetrics(self.train_iter, speed.t, start)
        self.last_save, last = speed.t, {}
        for step in range(start + 1, cfg.steps + 1):
            state, metrics = step_fn(state, batch, step)
            data_state = self.train_iter.get_state()  # the next step's batch, before it is prefetched below
            self.goodput.step_done()
            pause_point("trainer.step", until=lambda: signals.received)
            speed.step()
            if step < cfg.steps:
                batch = next_batch()  # overlaps with the running step
            is_log = step % cfg.log_every == 0 or step == cfg.steps or step == start + 1
            self._account_bad_steps(bad, step, metrics["skipped"], is_log, state, data_state)
            if is_log:
                last = self._log_step(step, metrics, bad, speed, loader_metrics)
            if self.eval_batches and ((cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps):
                last["eval_loss"] = self._evaluate(state, step)
                speed.restart()
            every = cfg.eval_harness_every
            if cfg.eval_harness_tasks and ((every and step % every == 0) or step == cfg.steps):
                self._harness(state, step)
                speed.restart()
            if self._stop_or_save(step, is_log, state, data_state, signals):
                speed.restart()
        return last

    def _account_bad_steps(self, bad: BadStepCounter, step: int, skipped, is_log: bool, state, data_state) -> None:
        """Logs skipped (non-finite) steps; after `max_bad_steps` in a row, checkpoints and stops."""
        bad.add(step, skipped)
        for s in bad.resolve(keep_last=not is_log):
            self.log(f"step {s}: non-finite loss or gradient; update skipped ({bad.streak} in a row)")
        if bad.exhausted:
            self._save(step, state, data_state, wait=True)
            raise TrainingDiverged(
                f"{bad.streak} consecutive steps up to step {bad.last_bad} had a non-finite loss or gradient "
                f"(max_bad_steps = {self.cfg.max_bad_steps}); their updates were skipped and the last good weights "
                f"are checkpointed at step {step}; lower optim.learning_rate or check the data"
            )

    def _log_step(
        self, step: int, metrics: dict, bad: BadStepCounter, speed: Throughput, loader_metrics: LoaderMetrics
    ) -> dict:
        """One metrics.jsonl record: the step's metrics (the program's own figures too), speed, the loader's."""
        metrics = jax.device_get(metrics)  # replicated outputs: a local copy, also across processes
        values = {
            k: (float(v) if isinstance(v, (np.ndarray, np.generic)) else v)
            for k, v in metrics.items()
            if k != "skipped"
        }
        record = {
            "step": step,
            "loss": values.pop("loss"),
            "lr": values.pop("lr"),
            "grad_norm": values.pop("grad_norm"),
            **speed.record(),
            "skipped_steps": bad.total,
            **values,
            **loader_metrics.update(speed.t, step),
        }
        self.logger.log(record)
        for note in loader_metrics.notes:
            self.logger.info(note)
        loader_metrics.notes.clear()
        return record

    def _stop_or_save(self, step: int, is_log: bool, state, data_state, signals: StopSignals) -> bool:
        """Stops with a checkpoint after a signal (every process at the same step); else saves when one is due.
        Returns whether it saved (a blocking part of a save is not throughput)."""
        cfg = self.cfg
        overdue = cfg.checkpoint_minutes > 0 and time.perf_counter() - self.last_save >= 60 * cfg.checkpoint_minutes
        preempt, overdue = self._agree(step, is_log, signals.received is not None, overdue)
        if preempt:
            save_s = self._save(step, state, data_state, wait=True)
            raise Preempted(step, signals.received or "SIGTERM / SIGINT to another process", save_s)
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps or overdue:
            self._save(step, state, data_state)  # every process saves
            self.last_save = time.perf_counter()
            return True
        return False

    def _finish_moved(self, state, step: int) -> dict:
        """The program moved the state to the final step (a DiLoCo replica that came back after the others finished
        rejoined there): that state is this run's result too, so it is evaluated and checkpointed like a run that
        trained to the end."""
        last = {"step": step}
        if self.eval_batches:
            last["eval_loss"] = self._evaluate(state, step)
        self._save(step, state, self.train_iter.get_state())
        return last

    def _evaluate(self, state, step: int) -> float:
        """The eval loss of `state`'s params, logged at `step` (its time counted as eval, not training)."""
        with self.goodput.timing("eval"):
            params = self.program.eval_params(state)
            record = {"step": step, **self.eval_sets.evaluate(lambda batches: self.program.evaluate(params, batches))}
            samples = self._samples(state)
        if samples:
            record["eval_samples"] = samples
            for sample in samples:
                self.logger.info(f"sample at step {step}: {sample['prompt']!r} -> {sample['continuation'][:120]!r}")
        self.logger.log(record)
        return record["eval_loss"]

    def _samples(self, state) -> list[dict] | None:
        """Greedy continuations of cfg.eval_prompts by `state`'s eval params (jaxlm.generate: compiled once)."""
        prompts = [p for p in self.cfg.eval_prompts.split("|") if p]
        if not prompts or self.tokenizer is None or not self.cfg.eval_sample_tokens:
            return None
        if jax.process_count() > 1:  # its ids would need gathering from every process first; __init__ notes it
            return None
        tok = self.tokenizer
        model = nnx.merge(self.program.graphdef, self.program.eval_params(state))
        new_ids = generate(
            model,
            [tok.document(p) for p in prompts],
            max_new_tokens=self.cfg.eval_sample_tokens,
            stop_ids=[tok.eos_id],
            vocab_limit=tok.vocab_size,
            rules=self.program.layout.rules,
        )
        return [
            {"prompt": p, "continuation": tok.decode(ids, skip_special_tokens=True)} for p, ids in zip(prompts, new_ids)
        ]

    def _harness(self, state, step: int) -> None:
        """lm-eval's tasks on `state`'s eval params (jaxlm.harness): metrics.jsonl / TensorBoard get
        harness/<task>/<metric>, WORKDIR/lm_eval lm-eval's results JSON. One process only, as the samples."""
        from jaxlm.harness import RESULTS_DIR, adapter, flat_metrics, run_tasks, save_results, task_names

        cfg = self.cfg
        if jax.process_count() > 1 or self.tokenizer is None:
            return
        with self.goodput.timing("eval"):
            model = nnx.merge(self.program.graphdef, self.program.eval_params(state))
            info = {"workdir": str(self.workdir), "step": step}
            lm = adapter(model, self.tokenizer, rules=self.program.layout.rules, info=info)
            results = run_tasks(
                lm,
                task_names(cfg.eval_harness_tasks),
                include_path=cfg.eval_harness_include_path or None,
                limit=cfg.eval_harness_limit or None,
                bootstrap_iters=0,  # stderrs by resampling cost more than the tasks on a small model
            )
            path = save_results(results, Path(self.workdir) / RESULTS_DIR, step)
        metrics = flat_metrics(results)
        self.logger.log({"step": step, **metrics})
        shown = ", ".join(f"{k.removeprefix('harness/')} {v:.4g}" for k, v in metrics.items())
        self.logger.info(f"lm-eval at step {step}: {shown} ({path})")

    def _save(self, step: int, state, data_state: dict, *, wait: bool = False) -> float:
        """Checkpoints `step` (and waits for it to be on disk if `wait`); returns the seconds it blocked."""
        self.goodput.saves += 1
        with self.goodput.timing("checkpoint"):
            t0 = time.perf_counter()
            saved = config_lib.to_dict(self.cfg)
            if self.data_fingerprint is not None:
                saved[config_lib.DATA_FINGERPRINT_KEY] = self.data_fingerprint
            if self.tokenizer is not None:
                saved[config_lib.TOKENIZER_KEY] = self.tokenizer.describe()
            try:
                self.checkpointer.save(step, state, data_state, saved)
            except NonFiniteState as e:
                raise NonFiniteState(f"{e}; {self._non_finite_cause()}") from None
            if wait:
                self.checkpointer.wait()
            return time.perf_counter() - t0

    def _non_finite_cause(self) -> str:
        """What made the weights non-finite: a skipped step leaves them alone, so an update whose loss and
        gradient were finite did; the optimizer's step sizes are the likely cause."""
        o, first = self.cfg.optim, getattr(getattr(self, "bad_steps", None), "first_bad", None)
        when = f" (step {first} was the first with a non-finite loss or gradient)" if first else ""
        return (
            f"an optimizer update made the weights non-finite{when}: lower optim.learning_rate "
            f"(now {o.learning_rate:g}){f' or optim.weight_decay (now {o.weight_decay:g})' * (o.weight_decay > 1)}"
            f" and rerun"
        )

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


def pipeline_bubble(layout: MeshLayout, in_lockstep: bool = False) -> float:
    """The idle share of the layout's pipeline schedule, from its table (F = B = W), in lockstep under ring
    attention (sharding.pipeline.runs_in_lockstep)."""
    from sharding.schedules import idle_share

    virtual = layout.pipeline_virtual_stages or None
    return idle_share(layout.pipeline_schedule, layout.pipeline, layout.num_microbatches, virtual, in_lockstep)
