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
import sys
from pathlib import Path

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
    from jaxlm import config as config_lib
    from jaxlm.checkpoint import Checkpointer, CheckpointError

    if not workdir.is_dir():
        raise ValueError(f"--workdir {workdir} is not a directory")
    if not (workdir / "checkpoints").is_dir():
        raise ValueError(f"{workdir} has no checkpoints/: not a training workdir (train with --workdir {workdir})")
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
    return cfg, checkpointer, step, saved


def check_out(out: Path) -> None:
    """--out must be a new or empty directory, or an earlier output of this tool (which it replaces), and
    writable: nothing else is ever overwritten."""
    from experiments.cli import check_writable_dir

    if out.is_dir() and any(out.iterdir()) and not (out / "manifest.json").is_file():
        raise ValueError(f"--out {out} holds other files; give a new or empty directory")
    check_writable_dir(out, "--out")


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        workdir = Path(args.workdir)
        if not args.workdir.strip() or (args.out is not None and not args.out.strip()):
            raise ValueError("--workdir and --out must not be empty")
        if args.eval_batches < 0:
            raise ValueError(f"--eval-batches must be >= 0, got {args.eval_batches}")
        out = Path(args.out) if args.out else workdir / "quantized_int8"
        check_out(out)
        cfg, checkpointer, step, saved_config = load_run(workdir)
    except (ValueError, OSError) as e:
        print(f"{PROG}: error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2
    try:
        return quantize(args, workdir, out, cfg, checkpointer, step, saved_config)
    except Exception as e:  # one line and the exit code, never a hang on a background thread
        print(f"{PROG}: error: {type(e).__name__}: {' '.join(str(e).splitlines())[:500]}", file=sys.stderr)
        return 1


def quantize(args, workdir: Path, out: Path, cfg, checkpointer, step: int, saved_config: dict) -> int:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from flax import nnx, traverse_util

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
    _, eval_data = open_run_data(cfg)
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
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((out / "weights").absolute(), artifact, force=True)
    checkpointer.wait_until_finished()
    checkpointer.close()
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
    (out / "manifest.json").write_text(json.dumps({**summary, "config": saved_config}, indent=2) + "\n")
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
