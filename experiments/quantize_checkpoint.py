"""Post-training quantization: a trained run's latest checkpoint -> int8 weights, with eval loss before and after.

    python -m experiments.tiny_lm --workdir runs/tiny_lm                 # train (or use any finished run)
    python -m experiments.quantize_checkpoint --workdir runs/tiny_lm     # -> runs/tiny_lm/quantized_int8/

Every matmul weight (attention, MLP, output head / tied embedding) is quantized symmetrically to int8 with one
scale per output channel; norms stay float32. "after" evaluates exactly those weights: the dequantized int8 values
through the model with int8 weight-only matmuls, on the run's own validation batches. The int8 weights, their scales
and the float remainder are written as an Orbax checkpoint beside a manifest.json. The last line is JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

from data.atomic_dir import NO_SPACE_TEXT, no_space, remove_abandoned, scratch_path, space_line
from data.fault_points import pause_point
from experiments.cli import exit_with

PROG = "quantize_checkpoint"


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def parse_args(argv):
    p = _Parser(prog=f"python -m experiments.{PROG}", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, help="a training run's workdir (config.json + checkpoints/)")
    p.add_argument("--out", default=None, help="output directory (default: WORKDIR/quantized_int8)")
    p.add_argument("--eval-batches", type=int, default=0, help="validation batches (default: the run's config)")
    return p.parse_args(argv)


def load_run(workdir: Path):
    """The latest checkpoint's step and the config saved with it (not the workdir's config.json, which a later run
    with other settings may have rewritten); ValueError naming what is missing."""
    from data.ownership import WORKDIR, kind_of
    from jaxlm import config as config_lib
    from jaxlm.checkpoint import Checkpointer, CheckpointError

    if not workdir.is_dir():
        raise ValueError(f"--workdir {workdir} is not a directory")
    if not (workdir / "checkpoints").is_dir():
        kind = kind_of(workdir)
        what = f"it is {kind} ({kind.written_by})" if kind not in (None, WORKDIR) else "it has no checkpoints/"
        raise ValueError(f"no checkpoint to quantize in {workdir}: {what}; give the --workdir of a training run")
    checkpointer = Checkpointer(workdir / "checkpoints", async_save=False, primary=False)
    try:
        step = checkpointer.latest_step()
        if step is None:
            raise ValueError(f"{workdir}/checkpoints holds no complete checkpoint to quantize")
        saved = checkpointer.restore_config(step)
        cfg = config_lib.validate(config_lib.from_dict(saved))
    except CheckpointError as e:
        checkpointer.close()
        raise ValueError(f"{workdir}/checkpoints/{step}: {e}") from None
    except (TypeError, ValueError) as e:
        checkpointer.close()
        raise ValueError(f"{workdir}/checkpoints/{step}: its config is not a jaxlm config: {e}") from None
    if cfg.model.matmul_precision != "default":
        checkpointer.close()
        raise ValueError(
            f"the run in {workdir} already trained with model.matmul_precision="
            f"{cfg.model.matmul_precision!r}; post-training quantization starts from a float model"
        )
    if cfg.model.num_experts:
        checkpointer.close()
        raise ValueError(
            f"the run in {workdir} is a mixture of experts (model.num_experts = {cfg.model.num_experts}); "
            f"post-training quantization covers dense models only (the experts' weights are not quantized yet)"
        )
    return cfg, checkpointer, step, saved


def check_out(out: Path) -> None:
    """--out must be a new or empty directory, or an earlier output of this tool (which it replaces), and
    writable: nothing else is ever overwritten."""
    from data.ownership import QUANTIZED, check_target

    check_target(out, QUANTIZED, "--out")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "manifest.json").is_file():
        raise ValueError(f"--out {out} holds other files; give a new or empty directory")
    parent = next(p for p in out.absolute().parents if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ValueError(f"--out {out}: {parent} is not a writable directory")


SCRATCH_TAG = "quantize-tmp"  # the output is built in .OUT.quantize-tmp-HOST-PID beside --out, then renamed


def replace_dir(build: Path, out: Path) -> None:
    """Moves `build` to `out`, replacing an earlier output of this tool (checked by check_out): the old one is
    moved aside first and deleted after, so a stop in between never leaves neither."""
    from data.command_signals import signals_deferred

    with signals_deferred():
        old = None
        if out.exists():
            old = scratch_path(out, "old")
            os.replace(out, old)
        os.replace(build, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 written, 1 failed, 2 bad input, 4 the disk filled, 130 / 143 stopped by SIGINT / SIGTERM (an
    earlier output at --out is kept whole; the scratch copy is removed, or by the next run if cut short)."""
    from data.command_signals import run_stoppable

    return run_stoppable(
        PROG, lambda signals: _main(argv, signals), after=": --out is as it was; rerun the same command"
    )


def _main(argv: list[str] | None, signals) -> int:
    try:
        args = parse_args(argv)
        workdir = Path(args.workdir)
        if not args.workdir.strip() or (args.out is not None and not args.out.strip()):
            raise ValueError("--workdir and --out must not be empty")
        if args.eval_batches < 0:
            raise ValueError(f"--eval-batches must be >= 0, got {args.eval_batches}")
        out = Path(args.out) if args.out else workdir / "quantized_int8"
        check_out(out)
        signals.cleanup = lambda: shutil.rmtree(scratch_path(out, SCRATCH_TAG), ignore_errors=True)
        cfg, checkpointer, step, saved_config = load_run(workdir)
    except (ValueError, OSError) as e:
        print(f"{PROG}: error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2
    from jaxlm.checkpoint import CheckpointSaveError

    try:
        return quantize(args, workdir, out, cfg, checkpointer, step, saved_config)
    except (OSError, CheckpointSaveError) as e:
        if isinstance(e, CheckpointSaveError):
            full = space_line(out, e.cause, out.absolute().parent) if e.cause in NO_SPACE_TEXT else None
        else:
            full = no_space(e, out.absolute().parent, name=out)
        if full is None:
            print(f"{PROG}: error: cannot write {out}: {e}", file=sys.stderr)
            return 1
        print(f"{PROG}: error: {full}; free space and rerun (--out is as it was)", file=sys.stderr)
        return 4
    except Exception as e:  # one line and the exit code, never a hang on a background thread
        print(f"{PROG}: error: {type(e).__name__}: {' '.join(str(e).splitlines())[:500]}", file=sys.stderr)
        return 1


def quantize(args, workdir: Path, out: Path, cfg, checkpointer, step: int, saved_config: dict) -> int:
    import jax
    import numpy as np
    from flax import nnx, traverse_util

    from jaxlm.checkpoint import save_tree
    from jaxlm.data_metrics import EvalSets
    from jaxlm.quantized import quantize_weights
    from jaxlm.run_data import open_run_data
    from jaxlm.train import Program
    from pallas_kernels.quantize import dequantize
    from sharding import MeshLayout, build_mesh

    if args.eval_batches:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_batches=args.eval_batches))
    if cfg.data.eval_batches == 0:
        checkpointer.close()
        print(
            f"{PROG}: error: the run evaluated on no batches (data.eval_batches = 0); pass --eval-batches N",
            file=sys.stderr,
        )
        return 2
    eval_data = EvalSets(open_run_data(cfg)[1]).all  # a mixture's sets as one
    if not eval_data:
        print(
            f"{PROG}: error: the run's data has no validation split (data.val_fraction = "
            f"{cfg.data.val_fraction}); nothing to evaluate",
            file=sys.stderr,
        )
        checkpointer.close()
        return 2
    mesh = build_mesh(MeshLayout(data=1), devices=jax.devices()[:1])
    program = Program(cfg, mesh)
    state, _, _ = checkpointer.restore(step, program.abstract_with_shardings())
    checkpointer.close()

    before = program.evaluate(state.params, eval_data)
    float_params = nnx.to_pure_dict(state.params)
    quantized = quantize_weights(float_params)
    flat = {k: np.asarray(v) for k, v in traverse_util.flatten_dict(float_params).items()}  # {path tuple: array}
    dequantized = traverse_util.unflatten_dict(
        {**flat, **{path: np.asarray(dequantize(q, scale)) for path, (q, scale) in quantized.items()}}
    )
    int8_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, matmul_precision="int8_weight_only"))
    int8_program = Program(int8_cfg, mesh)
    int8_params = jax.tree.map(lambda a: a, state.params)  # same tree: weight-only matmuls keep no state
    nnx.replace_by_pure_dict(int8_params, dequantized)
    after = int8_program.evaluate(jax.device_put(int8_params, int8_program.state_shardings.params), eval_data)

    float_bytes = sum(a.nbytes for a in flat.values())
    keys = {"/".join(path) for path in quantized}
    artifact = {
        "int8": {"/".join(p): {"q": np.asarray(q), "scale": np.asarray(s)} for p, (q, s) in quantized.items()},
        "float": {"/".join(map(str, k)): v for k, v in flat.items() if k not in quantized},
    }
    int8_bytes = sum(a.nbytes for a in jax.tree.leaves(artifact))
    for tag in (SCRATCH_TAG, "old"):  # what a killed run left
        remove_abandoned(out, tag)
    build = scratch_path(out, SCRATCH_TAG)
    build.mkdir(parents=True)
    summary = {
        "workdir": str(workdir),
        "step": step,
        "precision": "int8 per output channel",
        "eval_loss_before": round(before, 5),
        "eval_loss_after": round(after, 5),
        "eval_loss_change": round((after - before) / before, 5),
        "weight_bytes_before": int(float_bytes),
        "weight_bytes_after": int(int8_bytes),
        "quantized_tensors": sorted(keys),
        "eval_tokens": int(sum(np.sum(b["loss_mask"]) for b in eval_data)),
    }
    try:
        save_tree(build / "weights", artifact)
        pause_point("quantize.weights")
        (build / "manifest.json").write_text(json.dumps({**summary, "config": saved_config}, indent=2) + "\n")
        replace_dir(build, out)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    print(f"checkpoint step {step} of {workdir}: {len(keys)} weight tensors -> int8 per output channel")
    print(f"{'':<22}{'eval loss':>10}{'weight MB':>11}")
    print(f"{'float32':<22}{before:>10.4f}{float_bytes / 1e6:>11.2f}")
    print(f"{'int8 (weight-only)':<22}{after:>10.4f}{int8_bytes / 1e6:>11.2f}")
    print(
        f"change {100 * (after - before) / before:+.2f}% eval loss; {float_bytes / int8_bytes:.2f}x smaller; "
        f"written to {out}"
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    exit_with(main())
