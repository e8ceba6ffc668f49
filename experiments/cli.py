"""The experiment CLI contract shared by every training experiment (see DESIGN.md).

    --workdir DIR --steps N --seed S --mesh PATH.py --config PATH.py --log-every K --checkpoint-every K
    --set dotted.key=value (repeatable) [--cpu-devices N] [--no-progress]
    [--coordinator HOST:PORT --num-processes N --process-id I]   (multi-process; see sharding.launch)
    [--replica-id I]   (a DiLoCo replica in its own process, with diloco.exchange)
    [--compilation-cache DIR|none]

Everything a user can get wrong (flags, config, layout, data) is checked before JAX compiles anything; a problem
exits with status 2 and one line naming it. Exit codes:
    0  finished            2  bad input                    3  stopped: too many non-finite steps in a row
    4  a save failed (a checkpoint or the logs; e.g. disk full)   75 preempted by SIGTERM / SIGINT: rerun to continue
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


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage + error
        raise UsageError(message)


def build_parser(prog: str, default_workdir: str) -> argparse.ArgumentParser:
    p = _Parser(prog=f"python -m experiments.{prog}", description=sys.modules["__main__"].__doc__)
    p.add_argument("--workdir", default=default_workdir, help=f"outputs + checkpoints (default: {default_workdir})")
    p.add_argument("--config", help="Python config file defining `config` (default: the experiment's own)")
    p.add_argument("--mesh", help="Python mesh layout file defining `layout` (default: data parallel over all devices)")
    p.add_argument("--steps", type=int, help="total optimizer steps (a resumed run continues up to this)")
    p.add_argument("--seed", type=int, help="seed for init and data order")
    p.add_argument("--log-every", type=int, help="log metrics every K steps")
    p.add_argument("--checkpoint-every", type=int, help="checkpoint every K steps (0: only at the end)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set model.d_model=512 (repeatable)")
    p.add_argument("--cpu-devices", type=int, default=0,
                   help="simulate N CPU devices (set before JAX starts); 0 keeps JAX's default")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--compilation-cache", metavar="DIR",
                   help=f"JAX's persistent compilation cache, so a restart does not compile again; 'none' disables "
                        f"(default: $JAX_COMPILATION_CACHE_DIR if set, else {DEFAULT_COMPILATION_CACHE})")
    mp = p.add_argument_group("multi-process (default: $JAXLM_COORDINATOR etc. as set by sharding.launch, else a "
                              "SLURM / Open MPI / Cloud TPU cluster if detected, else one process)")
    mp.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0's coordination service")
    mp.add_argument("--num-processes", type=int, metavar="N", help="number of processes in the run")
    mp.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0..N-1")
    mp.add_argument("--replica-id", type=int, metavar="I",
                    help="with diloco.exchange: this process's DiLoCo replica, 0..diloco.replicas-1 (default: "
                         "$JAXLM_REPLICA_ID as set by `sharding.launch --independent`); it works in WORKDIR/replica_I")
    return p


def run_training(prog: str, default_config: Path, default_workdir: str, argv: list[str] | None = None) -> int:
    """Parses the CLI, validates everything, then trains. Returns the process exit code."""
    try:
        args = build_parser(prog, default_workdir).parse_args(argv)
        if args.cpu_devices < 0:
            raise UsageError(f"--cpu-devices must be >= 0, got {args.cpu_devices}")
        setup = _prepare(args, default_config)
    except UsageError as e:
        return _fail(prog, str(e))
    except (ValueError, OSError) as e:  # ConfigError, LayoutError, TokenFileError, an unreadable file
        return _fail(prog, str(e))
    return _train(prog, args, *setup)


def _fail(prog: str, message: str, code: int = EXIT_BAD_INPUT, label: str = "error") -> int:
    message = " ".join(message.splitlines())  # one line, whatever an exception (or a user's file) said
    print(f"{prog}: {label}: {message}", file=sys.stderr)
    return code


def _prepare(args, default_config: Path):
    import tempfile

    import jax

    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    from sharding.distributed import initialize

    initialize(args.coordinator, args.num_processes, args.process_id)  # before anything queries devices

    from jaxlm import config as config_lib
    from sharding import MeshLayout, load_layout

    cfg = config_lib.load_config(args.config or default_config)
    flags = {"steps": args.steps, "seed": args.seed, "log_every": args.log_every,
             "checkpoint_every": args.checkpoint_every}
    cfg = config_lib.apply_overrides(cfg, [f"{k}={v}" for k, v in flags.items() if v is not None] + args.set)
    if cfg.diloco.replicas and cfg.diloco.exchange:
        cfg, args.workdir = _replica_process(cfg, args)
    elif args.replica_id is not None:
        raise UsageError("--replica-id needs DiLoCo replicas in their own processes: set diloco.replicas and "
                         "diloco.exchange=DIR")
    config_lib.validate(cfg)

    num_devices = jax.device_count()
    layout = load_layout(args.mesh, num_devices) if args.mesh else MeshLayout(data=num_devices).validate(num_devices)
    m, d = cfg.model, cfg.data
    layout.check_divisibility(batch_size=d.batch_size, microbatches=d.microbatches, num_heads=m.num_heads,
                              num_kv_heads=m.num_kv_heads, mlp_dim=m.mlp_dim, num_layers=m.num_layers)

    train_iter, eval_data = open_data(cfg)
    workdir = Path(args.workdir)
    not_dir = next((p for p in (workdir, *workdir.parents) if p.exists() and not p.is_dir()), None)
    if not_dir:
        raise UsageError(f"--workdir {workdir}: {not_dir} exists and is not a directory")
    try:  # a real write: permission bits do not stop root, and a read-only mount ignores them
        workdir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=workdir).close()
    except OSError as e:
        raise UsageError(f"--workdir {workdir} is not writable: {e.strerror}") from None
    return cfg, layout, train_iter, eval_data


def _replica_process(cfg, args):
    """A DiLoCo replica in its own process: its index (flag, else $JAXLM_REPLICA_ID), the exchange directory as an
    absolute path, and its own workdir WORKDIR/replica_I (checkpoints, metrics)."""
    import dataclasses

    from sharding.launch import ENV_REPLICA_ID

    replica = args.replica_id
    if replica is None and os.environ.get(ENV_REPLICA_ID):
        try:
            replica = int(os.environ[ENV_REPLICA_ID])
        except ValueError:
            raise UsageError(f"${ENV_REPLICA_ID} must be an integer, got {os.environ[ENV_REPLICA_ID]!r}") from None
    if replica is None:
        replica = cfg.diloco.replica
    diloco = dataclasses.replace(cfg.diloco, replica=replica, exchange=str(Path(cfg.diloco.exchange).absolute()))
    return dataclasses.replace(cfg, diloco=diloco), str(Path(args.workdir) / f"replica_{replica}")


def open_data(cfg):
    """(train batch iterator, eval batches) for a config's data, checked against the model's vocabulary."""
    from data import SeededBatchIterator, TokenFile, default_corpus, eval_batches, split_train_val
    from data.iterator import num_windows
    from data.sources import TokenWindowSource
    from jaxlm.attention import parse_mask, uses_documents

    d = cfg.data
    token_file = TokenFile.open(d.path or default_corpus())
    if token_file.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"token file {token_file.path} has vocab_size {token_file.vocab_size} but "
                         f"model.vocab_size is {cfg.model.vocab_size}; raise model.vocab_size")
    # Scan the ids, not only meta.json's max_token_id: an id past model.vocab_size would embed as NaN (jnp.take fills
    # out-of-range rows), silently. Measured on 2 CPU cores: the default corpus (12M tokens = 3 chunks) scans in ~1 ms
    # from the page cache, ~20 ms cold; a file over 16 chunks (64M tokens) gets an evenly spread 16-chunk sample
    # instead (1G tokens: ~5 ms warm, vs ~120 ms warm and seconds cold for all of it).
    token_file.validate_ids(cfg.model.vocab_size, deep=True, chunk_size=1 << 22, max_chunks=16)
    path, n, batch_tokens = token_file.path, token_file.num_tokens, d.batch_size * d.seq_len + 1
    if n < batch_tokens:
        raise ValueError(f"token file {path} holds {n} tokens, fewer than one batch of data.batch_size x "
                         f"data.seq_len + 1 = {batch_tokens}")
    try:
        (train_lo, train_hi), (val_lo, val_hi) = split_train_val(n, d.val_fraction, d.seq_len)
    except ValueError as e:  # the validation split is shorter than a window, or leaves too little to train on
        raise ValueError(f"token file {path}: {e}; adjust data.val_fraction (0: no validation)") from None
    for split, lo, hi in (("training", train_lo, train_hi), ("validation", val_lo, val_hi)):
        windows = num_windows(lo, hi, d.seq_len)
        if (split == "training" or d.eval_batches and hi > lo) and windows < d.batch_size:
            raise ValueError(f"token file {path}: its {split} split ({hi - lo} tokens at data.val_fraction "
                             f"{d.val_fraction}) holds {windows} sequences, fewer than data.batch_size {d.batch_size}")
    eos_id = None  # given, batches carry segment_ids: only when the "document" attention mask needs them
    if uses_documents(parse_mask(cfg.model.attention_mask)):
        eos_id = token_file.meta.get("eos_id")
        if eos_id is None:
            raise ValueError(f"model.attention_mask {cfg.model.attention_mask!r} uses document(), but token file "
                             f"{token_file.path} records no eos_id to find document boundaries")
    if cfg.diloco.replicas and cfg.diloco.data == "partition":
        from data.partitioned import PartitionedBatches

        train_iter = PartitionedBatches(token_file.tokens, parts=cfg.diloco.replicas, batch_size=d.batch_size,
                                        seq_len=d.seq_len, seed=cfg.seed, start=train_lo, stop=train_hi, eos_id=eos_id)
    elif d.loader == "simple":
        train_iter = SeededBatchIterator(token_file.tokens, batch_size=d.batch_size, seq_len=d.seq_len,
                                         seed=cfg.seed, start=train_lo, stop=train_hi, eos_id=eos_id)
    else:
        train_iter = clairvoyant_loader(cfg, TokenWindowSource(token_file.tokens, seq_len=d.seq_len, start=train_lo,
                                                               stop=train_hi), eos_id)
    eval_data = []
    if d.eval_batches and val_hi > val_lo:
        eval_data = eval_batches(token_file.tokens, batch_size=d.batch_size, seq_len=d.seq_len, start=val_lo,
                                 stop=val_hi, max_batches=d.eval_batches, eos_id=eos_id)
    return train_iter, eval_data


def clairvoyant_loader(cfg, source, eos_id=None):
    """The plan-driven loader over `source` with the config's tiers, optionally behind a simulated remote filesystem.

    In a multi-process run the processes' loaders all-gather their plans over jax.distributed and serve each
    other's misses; each process reads the rows its devices hold (the trainer calls set_rows)."""
    import jax

    from data.loader import ClairvoyantLoader, jax_exchange
    from data.sources import ThrottledSource

    d = cfg.data
    if d.throttle_latency_ms or d.throttle_mb_per_s:
        source = ThrottledSource(source, latency_s=d.throttle_latency_ms / 1e3,
                                 bandwidth_bytes_per_s=d.throttle_mb_per_s * 1e6 or None)
    multi = jax.process_count() > 1
    return ClairvoyantLoader(source, batch_size=d.batch_size, seed=cfg.seed, ram_bytes=int(d.cache_ram_mb * 2**20),
                             disk_bytes=int(d.cache_disk_mb * 2**20), disk_dir=d.cache_dir or None,
                             workers=d.loader_workers, prefetch_steps=d.prefetch_steps, eos_id=eos_id,
                             process_index=jax.process_index(), process_count=jax.process_count(),
                             exchange=jax_exchange() if multi else None)


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


def _train(prog, args, cfg, layout, train_iter, eval_data) -> int:
    from jaxlm.checkpoint import CheckpointError
    from jaxlm.config import ConfigError
    from jaxlm.goodput import Goodput
    from jaxlm.preemption import EXIT_PREEMPTED, Preempted
    from jaxlm.replica_exchange import ExchangeError
    from jaxlm.trainer import Trainer, TrainingDiverged
    from sharding import LayoutError, build_mesh
    from sharding.distributed import DistributedError

    use_compilation_cache(args.compilation_cache)
    try:  # builds shardings from the layout's rules (no compilation yet): a clash or an indivisible dim fails here
        trainer = Trainer(cfg, build_mesh(layout), args.workdir, train_iter, eval_data, layout=layout,
                          progress=not args.no_progress, goodput=Goodput(start=LAUNCHED))
    except (LayoutError, DistributedError, ConfigError, ExchangeError) as e:  # e.g. a process whose devices hold
        # non-contiguous batch rows, or DiLoCo in a pipeline layout
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
        return _fail(prog, str(e), EXIT_CHECKPOINT_FAILED)
    except OSError as e:  # e.g. the disk filled up while metrics.jsonl or the events were written
        return _fail(prog, f"cannot write the run's files: {e}", EXIT_CHECKPOINT_FAILED)
    if final and trainer.primary:
        shown = {k: v for k, v in final.items() if k != "step" and (not k.startswith("data_")
                                                                   or k in ("data_hit_rate", "data_stall_frac"))}
        summary = ", ".join(f"{k} {v:.4g}" for k, v in shown.items())
        print(f"{prog}: step {final['step']}: {summary}; outputs in {args.workdir}", file=sys.stderr)
    return 0
