"""The experiment CLI contract shared by every training experiment (docs/architecture.md).

    --workdir DIR --steps N --seed S --mesh PATH.py --config PATH.py --log-every K --checkpoint-every K
    --set dotted.key=value (repeatable) [--cpu-devices N] [--no-progress]
    [--coordinator HOST:PORT --num-processes N --process-id I [--join-timeout S]]   (multi-process; see sharding.launch)
    [--replica-id I]   (a DiLoCo replica in its own process, with diloco.exchange)
    [--compilation-cache DIR|none]

Everything a user can get wrong (flags, config, layout, data) is checked before JAX compiles anything; a problem
exits with status 2 and one line naming it. Exit codes:
    0  finished            2  bad input                    3  stopped: too many non-finite steps in a row
    4  a save failed (a checkpoint or the logs; e.g. disk full)   75 preempted by SIGTERM / SIGINT: rerun to continue
    130 a second Ctrl-C (at any moment, shutdown included)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

LAUNCHED = time.perf_counter()  # this module is imported first: a restart's cost is counted from here
EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_CHECKPOINT_FAILED = 4
DEFAULT_COMPILATION_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxlm" / "compilation"


# After main returns, how long background threads and exit handlers get before the process ends anyway: a finished
# or preempted run's (its saves are already complete: the trainer waits for them), and after an error.
EXIT_GRACE_S = 30.0
ERROR_EXIT_GRACE_S = 5.0


class UsageError(ValueError):
    pass


def exit_with(code: int, grace_s: float | None = None) -> None:
    """Ends the process with `code`, even if a background thread or an exit handler never finishes.

    Every experiment module's `__main__` ends here. A normal exit joins every non-daemon thread and runs the exit
    handlers (jax.distributed's shutdown barrier, which other processes of a run wait for), but a thread a failed
    Orbax save or loader left behind can wait forever, and the command would hang after printing its error. A
    daemon watchdog ends the process after `grace_s` with the same code and a line naming what was still running.
    """
    import signal
    import threading

    if grace_s is None:
        grace_s = EXIT_GRACE_S if code in (0, 75) else ERROR_EXIT_GRACE_S
    sys.stdout.flush()
    sys.stderr.flush()

    def give_up() -> None:
        main = threading.main_thread()
        left = [t.name for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]
        waiting = f"background threads {', '.join(left[:5])}" if left else "exit handlers"
        print(f"note: {waiting} still running {grace_s:.0f}s after the end; exiting with {code}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(code)

    def stop_now(signum, frame):  # a signal while threads and exit handlers finish: one line, not a traceback
        print(f"\n{Path(sys.argv[0]).stem}: {signal.Signals(signum).name}: exiting now", file=sys.stderr, flush=True)
        os._exit(code)

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, stop_now)
    watchdog = threading.Timer(grace_s, give_up)
    watchdog.daemon = True
    watchdog.start()
    sys.exit(code)


def csv_of(kind, choices=None):
    """An argparse type: a comma-separated list of ``kind`` (from ``choices`` when given), as a tuple."""

    def parse(text):
        items = [kind(x) for x in text.split(",") if x]
        bad = [x for x in items if choices is not None and x not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(map(str, choices or ()))}")
        return tuple(items)

    return parse


def check_writable_dir(path: Path, flag: str) -> None:
    """Creates `path` if needed and proves it writable with a real write (permission bits do not stop root, and a
    read-only mount ignores them); UsageError naming `flag` when a parent is a file or it cannot be written."""
    import tempfile

    not_dir = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if not_dir:
        raise UsageError(f"{flag} {path}: {not_dir} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise UsageError(f"{flag} {path} is not writable: {e.strerror}") from None


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage + error
        raise UsageError(message)


def trained_model_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The flags of a command that reads a trained model (`generate`, `evaluate`): --workdir, --step, --mesh,
    --cpu-devices, for `load_trained_model`. Errors are one-line ValueErrors (UsageError), not argparse's exit."""
    p = _Parser(prog=f"python -m {prog}", description=description)
    p.add_argument("--workdir", required=True, help="a training workdir, or an import_hf / quantize_checkpoint output")
    p.add_argument("--step", type=int, help="the checkpoint step (default: the latest)")
    p.add_argument("--mesh", help="Python mesh layout file defining `layout` (default: one device)")
    p.add_argument("--cpu-devices", type=int, default=0, help="simulate N CPU devices (set before JAX starts)")
    return p


def load_trained_model(args):
    """`--cpu-devices`, `--mesh`, `--workdir`, `--step` -> the model, as `generate` and `evaluate` read it
    (jaxlm.inference.Loaded). ValueError (LayoutError among them): one line naming the problem."""
    import jax

    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    from jaxlm.inference import load_model
    from sharding import load_layout

    layout = load_layout(args.mesh, jax.device_count()) if args.mesh else None
    return load_model(args.workdir, step=args.step, layout=layout)


def build_parser(prog: str, default_workdir: str) -> argparse.ArgumentParser:
    p = _Parser(prog=f"python -m experiments.{prog}", description=sys.modules["__main__"].__doc__)
    p.add_argument("--workdir", default=default_workdir, help=f"outputs + checkpoints (default: {default_workdir})")
    p.add_argument(
        "--config", help="Python config file defining `config`, or a run's config.json (default: the experiment's own)"
    )
    p.add_argument("--mesh", help="Python mesh layout file defining `layout` (default: data parallel over all devices)")
    p.add_argument("--steps", type=int, help="total optimizer steps (a resumed run continues up to this)")
    p.add_argument("--seed", type=int, help="seed for init and data order")
    p.add_argument("--log-every", type=int, help="log metrics every K steps")
    p.add_argument("--checkpoint-every", type=int, help="checkpoint every K steps (0: only at the end)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set model.d_model=512 (repeatable)",
    )
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=0,
        help="simulate N CPU devices (set before JAX starts); 0 keeps JAX's default",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--compilation-cache",
        metavar="DIR",
        help=f"JAX's persistent compilation cache, so a restart does not compile again; 'none' disables "
        f"(default: $JAX_COMPILATION_CACHE_DIR if set, else {DEFAULT_COMPILATION_CACHE})",
    )
    mp = p.add_argument_group(
        "multi-process (default: $JAXLM_COORDINATOR etc. as set by sharding.launch, else a "
        "SLURM / Open MPI / Cloud TPU cluster if detected, else one process)"
    )
    mp.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0's coordination service")
    mp.add_argument("--num-processes", type=int, metavar="N", help="number of processes in the run")
    mp.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0..N-1")
    mp.add_argument(
        "--join-timeout",
        type=float,
        metavar="S",
        help="give up with one line naming who is missing if the other processes have not all joined within S "
        "seconds (default: $JAXLM_JOIN_TIMEOUT_S, else 300; at most 3000)",
    )
    mp.add_argument(
        "--replica-id",
        type=int,
        metavar="I",
        help="with diloco.exchange: this process's DiLoCo replica, 0..diloco.replicas-1 (default: "
        "$JAXLM_REPLICA_ID as set by `sharding.launch --independent`); it works in WORKDIR/replica_I",
    )
    return p


def run_training(prog: str, default_config: Path, default_workdir: str, argv: list[str] | None = None) -> int:
    """Parses the CLI, validates everything, then trains. Returns the process exit code. SIGINT / SIGTERM before
    training starts end the process at once with one line (jaxlm.preemption; once training runs, they stop it
    after a step with a checkpoint)."""
    from jaxlm.preemption import StopSignals

    busy = ()  # (WorkdirBusy,) once imported, for the except below
    try:
        with StopSignals(prog, nothing_to_save=True):
            # imported under StopSignals: it brings in `data`, which takes a while, and a Ctrl-C meanwhile must be
            # the one line too (it was a KeyboardInterrupt traceback)
            from jaxlm.workdir_lock import WorkdirBusy

            busy = (WorkdirBusy,)
            args = build_parser(prog, default_workdir).parse_args(argv)
            if args.cpu_devices < 0:
                raise UsageError(f"--cpu-devices must be >= 0, got {args.cpu_devices}")
            for flag in ("workdir", "config", "mesh", "compilation_cache"):
                value = getattr(args, flag)
                if value is not None and not value.strip():
                    raise UsageError(f"--{flag.replace('_', '-')} is empty; give a path (or leave the flag out)")
            check_compilation_cache(args.compilation_cache)
            *setup, lock = _prepare(prog, args, default_config)
    # UsageError, ConfigError, LayoutError, TokenFileError, an unreadable file, another run holding the workdir
    except (ValueError, OSError, *busy) as e:
        return _fail(prog, str(e))
    try:
        return _train(prog, args, *setup)
    finally:
        lock.release()


def _fail(prog: str, message: str, code: int = EXIT_BAD_INPUT, label: str = "error") -> int:
    message = " ".join(message.splitlines())  # one line, whatever an exception (or a user's file) said
    print(f"{prog}: {label}: {message}", file=sys.stderr)
    return code


def _prepare(prog: str, args, default_config: Path):

    import jax

    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    from sharding.distributed import initialize

    initialize(args.coordinator, args.num_processes, args.process_id, args.join_timeout)  # before any device query

    from data.ownership import claim_workdir, mark_workdir
    from jaxlm import config as config_lib
    from jaxlm.diloco.config import for_this_process
    from jaxlm.memory_check import check_step_fits
    from jaxlm.run_data import open_run_data, resolve_vocab, run_tokenizer
    from jaxlm.train import check_splits
    from jaxlm.workdir_lock import WorkdirLock
    from sharding import LayoutError, MeshLayout, load_layout

    cfg = config_lib.load_config(args.config or default_config)
    flags = {
        "steps": args.steps,
        "seed": args.seed,
        "log_every": args.log_every,
        "checkpoint_every": args.checkpoint_every,
    }
    cfg = config_lib.apply_overrides(cfg, [f"{k}={v}" for k, v in flags.items() if v is not None] + args.set)
    cfg, args.workdir = for_this_process(cfg, args.workdir, args.replica_id)  # a DiLoCo replica's own process
    config_lib.validate_training(cfg)  # and what it asks to evaluate and sample can be
    check_harness_tasks(cfg)
    cfg = resolve_vocab(cfg)  # model.vocab_size from the data's tokenizer, unless set

    num_devices = jax.device_count()
    layout = load_layout(args.mesh, num_devices) if args.mesh else MeshLayout(data=num_devices).validate(num_devices)
    check_splits(cfg, layout, jax.devices()[0].platform)
    if layout.context > 1 and cfg.model.attention_impl == "jax":
        raise LayoutError(
            "mesh axis 'context' splits the sequence, which attention_impl 'jax' (cuDNN / XLA's fused attention) "
            "cannot take; use xla_blocksparse, pallas or auto"
        )
    check_step_fits(cfg, layout)  # minutes of compiling saved when it cannot fit

    train_iter, eval_data = open_run_data(cfg)
    tokenizer = run_tokenizer(cfg)  # a TokenizerError (a ValueError) when its tokenizer.json changed
    workdir = Path(args.workdir)
    claim_workdir(workdir)  # never a dataset, an HF export or a user's folder: nothing of theirs is overwritten
    check_writable_dir(workdir, "--workdir")
    # One run per workdir, taken before the run writes there. Process 0 holds it for all processes of its run (a
    # DiLoCo replica's processes, with their own sub-workdir, hold their own).
    lock = WorkdirLock(workdir)
    if jax.process_index() == 0:
        note = lock.acquire()
        if note:
            print(f"{prog}: note: {note}", file=sys.stderr)
        mark_workdir(workdir)
    return cfg, layout, train_iter, eval_data, tokenizer, lock


def check_compilation_cache(choice: str | None) -> None:
    """--compilation-cache DIR must be a directory, or a path one can be made at, that can be written (JAX would
    only warn and compile everything again); UsageError naming it otherwise. Writes nothing that stays."""
    import tempfile

    if choice is None or choice == "none":
        return
    path = Path(choice)
    not_dir = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if not_dir is not None:
        where = "is a file" if not_dir == path else f"is under {not_dir}, a file"
        raise UsageError(
            f"--compilation-cache {path} {where}, not a directory; give a directory (made if missing), or none "
            f"to run without the cache"
        )
    nearest = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    try:
        tempfile.TemporaryFile(dir=nearest).close()  # a real write: permission bits do not stop root
    except OSError as e:
        raise UsageError(
            f"--compilation-cache {path} is not writable ({nearest}: {e.strerror}); give a writable directory, or "
            f"none to run without the cache"
        ) from None


def use_compilation_cache(choice: str | None) -> None:
    """Turns on JAX's persistent compilation cache: a rerun after a failure loads its compiled programs instead
    of compiling them again. $JAX_COMPILATION_CACHE_DIR (read by JAX itself) wins over the default."""
    import jax

    if choice == "none":
        jax.config.update("jax_enable_compilation_cache", False)
        return
    if choice or not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(choice or DEFAULT_COMPILATION_CACHE))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # the eval step compiles in < 1 s


def check_harness_tasks(cfg) -> None:
    """The lm-eval tasks `eval_harness_tasks` names are known and the eval extra is installed (ConfigError naming
    the first that is not), before anything compiles."""
    if not cfg.eval_harness_tasks:
        return
    from jaxlm import config as config_lib
    from jaxlm.harness import task_manager, task_names

    try:
        task_manager(task_names(cfg.eval_harness_tasks), cfg.eval_harness_include_path or None)
    except ValueError as e:
        raise config_lib.ConfigError(f"eval_harness_tasks: {e}") from None


def _train(prog, args, cfg, layout, train_iter, eval_data, tokenizer) -> int:
    from data.atomic_dir import NO_SPACE_TEXT, no_space, room
    from jaxlm.checkpoint import CheckpointError
    from jaxlm.config import ConfigError
    from jaxlm.diloco.exchange import ExchangeError
    from jaxlm.goodput import Goodput
    from jaxlm.preemption import EXIT_PREEMPTED, Preempted
    from jaxlm.run_data import run_data_fingerprint
    from jaxlm.trainer import Trainer, TrainingDiverged
    from sharding import LayoutError, build_mesh
    from sharding.distributed import DistributedError

    use_compilation_cache(args.compilation_cache)
    try:  # builds shardings from the layout's rules (no compilation yet): a clash or an indivisible dim fails here
        trainer = Trainer(
            cfg,
            build_mesh(layout),
            args.workdir,
            train_iter,
            eval_data,
            layout=layout,
            progress=not args.no_progress,
            goodput=Goodput(start=LAUNCHED),
            data_fingerprint=run_data_fingerprint(cfg),
            tokenizer=tokenizer,
        )
    except (LayoutError, DistributedError, ConfigError, ExchangeError) as e:  # e.g. a process whose devices hold
        # non-contiguous batch rows
        return _fail(prog, str(e))
    try:
        final = trainer.run()
    except (ConfigError, ExchangeError) as e:  # e.g. resuming a workdir written with another model config
        return _fail(prog, str(e))
    except Preempted as e:
        return _fail(prog, str(e), EXIT_PREEMPTED, "stopped")
    except TrainingDiverged as e:
        return _fail(prog, str(e), EXIT_DIVERGED, "stopped")
    except CheckpointError as e:  # e.g. the disk filled up during a save
        if getattr(e, "cause", "") in NO_SPACE_TEXT:  # params + Adam's two moments, float32
            needs = room(Path(args.workdir), trainer.program.num_params * 12).replace("it needs", "a checkpoint needs")
            return _fail(prog, f"{e}; {needs}: free space and rerun", EXIT_CHECKPOINT_FAILED)
        return _fail(prog, str(e), EXIT_CHECKPOINT_FAILED)
    except OSError as e:  # e.g. the disk filled up while metrics.jsonl or the events were written
        full = no_space(e, Path(args.workdir), name=e.filename or f"the run's files in {args.workdir}")
        return _fail(prog, full or f"cannot write the run's files: {e}", EXIT_CHECKPOINT_FAILED)
    except Exception as e:  # an out-of-memory past the estimate: one line with its cause, not XLA's traceback
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        first = next((line for line in str(e).splitlines() if line.strip()), "")
        return _fail(
            prog,
            f"out of memory: {first}; make the step smaller (data.batch_size, data.seq_len, data.microbatches, "
            f"model.remat=full) or shard it over more devices (--mesh)",
        )
    if final and trainer.primary:
        shown = {
            k: v
            for k, v in final.items()
            if k != "step" and (not k.startswith("data_") or k in ("data_hit_rate", "data_stall_frac"))
        }
        summary = ", ".join(f"{k} {v:.4g}" for k, v in shown.items())
        print(f"{prog}: step {final['step']}: {summary}; outputs in {args.workdir}", file=sys.stderr)
    return 0
