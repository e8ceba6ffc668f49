"""A trained model read back for inference: a workdir's checkpoint, or quantize_checkpoint's int8 output, with the
config and tokenizer it was trained with, its params placed on a mesh by the layout's rules.

Every problem a user can cause (no checkpoint, a missing step, a pipeline layout) is a ValueError of one line,
raised before anything compiles.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx, traverse_util

from data.ownership import WORKDIR, kind_of
from data.text_tokenizer import TextTokenizer, tokenizer_from_record
from jaxlm import config as config_lib
from jaxlm.checkpoint import Checkpointer, CheckpointError
from jaxlm.generate import check_layout
from jaxlm.model import Transformer
from jaxlm.train import Program
from sharding import MeshLayout, build_mesh

INT8_MANIFEST = "manifest.json"  # what experiments.quantize_checkpoint writes beside weights/


@dataclasses.dataclass(frozen=True)
class Loaded:
    model: Transformer
    cfg: config_lib.TrainConfig
    tokenizer: TextTokenizer
    step: int
    int8: bool  # int8 weight-only weights (quantize_checkpoint), dequantized into int8 weight-only matmuls
    rules: dict  # the layout's logical-axis overrides the params are placed by (jaxlm.generate takes them too)


def load_model(workdir: str | Path, *, step: int | None = None, layout: MeshLayout | None = None) -> Loaded:
    """The model of `workdir`: a training run's checkpoint (`step`, default the latest) or, if `workdir` is a
    quantize_checkpoint output (manifest.json + weights/), its int8 weights. `layout` None: one device."""
    workdir = Path(workdir)
    if not workdir.is_dir():
        raise ValueError(f"--workdir {workdir} is not a directory")
    layout = layout or MeshLayout()
    check_layout(layout)
    devices = jax.devices()[: np.prod(list(layout.axis_sizes.values()))]
    mesh = build_mesh(layout, devices=devices)
    if (workdir / INT8_MANIFEST).is_file() and (workdir / "weights").is_dir():
        return _load_int8(workdir, step, layout, mesh)
    return _load_checkpoint(workdir, step, layout, mesh)


def _load_checkpoint(workdir: Path, step: int | None, layout: MeshLayout, mesh) -> Loaded:
    if not (workdir / "checkpoints").is_dir():
        kind = kind_of(workdir)
        what = f"it is {kind} ({kind.written_by})" if kind not in (None, WORKDIR) else "it has no checkpoints/"
        raise ValueError(
            f"no checkpoint in {workdir}: {what}; give the --workdir of a training run (or of import_hf), or a "
            f"quantize_checkpoint output directory"
        )
    checkpointer = Checkpointer(workdir / "checkpoints", async_save=False, primary=False)
    try:
        steps = checkpointer.all_steps()
        if not steps:
            raise ValueError(f"no checkpoint in {workdir}: {workdir}/checkpoints holds no complete checkpoint")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise ValueError(f"{workdir} has no checkpoint at step {step}; its steps: {', '.join(map(str, steps))}")
        saved = checkpointer.restore_config(step)
        cfg = _config(saved, f"{workdir}/checkpoints/{step}", layout)
        program = Program(cfg, mesh, layout)
        state, _, _ = checkpointer.restore(step, program.abstract_with_shardings())
    except CheckpointError as e:
        raise ValueError(f"{workdir}/checkpoints/{step}: {e}") from None
    finally:
        checkpointer.close()
    model = nnx.merge(program.graphdef, state.params)
    tokenizer = _tokenizer(saved, cfg, [workdir])
    return Loaded(model, cfg, tokenizer, step, int8=False, rules=layout.rules)


def _load_int8(directory: Path, step: int | None, layout: MeshLayout, mesh) -> Loaded:
    """quantize_checkpoint's int8 q and per-channel scales, dequantized into a model whose matmuls re-quantize
    them per output channel: exactly the int8 weights (its test shows re-quantizing them is exact)."""
    import orbax.checkpoint as ocp

    try:
        manifest = json.loads((directory / INT8_MANIFEST).read_text())
        saved, int8_step = manifest["config"], int(manifest["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{directory}/{INT8_MANIFEST} is not a quantize_checkpoint manifest: {e}") from None
    if step is not None and step != int8_step:
        raise ValueError(f"{directory} holds the int8 weights of step {int8_step} only, not step {step}")
    cfg = _config(saved, str(directory), layout)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, matmul_precision="int8_weight_only"))
    program = Program(cfg, mesh, layout)
    try:
        artifact = ocp.StandardCheckpointer().restore((directory / "weights").absolute())
    except Exception as e:  # Orbax's many ways to fail reading a directory: one line
        raise ValueError(f"{directory}/weights cannot be read: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    weights = {
        **{name: np.asarray(a) for name, a in artifact["float"].items()},
        **{name: np.asarray(e["q"], np.float32) * np.asarray(e["scale"]) for name, e in artifact["int8"].items()},
    }
    params = jax.tree.map(lambda a: a, program.abstract_state.params)
    nnx.replace_by_pure_dict(params, traverse_util.unflatten_dict(weights, sep="/"))
    params = jax.device_put(params, program.state_shardings.params)
    places = [directory, directory.parent, Path(str(manifest.get("workdir", directory)))]
    return Loaded(
        nnx.merge(program.graphdef, params), cfg, _tokenizer(saved, cfg, places), int8_step, True, layout.rules
    )


def _config(saved: dict, where: str, layout: MeshLayout) -> config_lib.TrainConfig:
    """The saved config, checked, and the layout checked against its model (a LayoutError names the axis) before
    any param is placed."""
    try:
        cfg = config_lib.validate(config_lib.from_dict(saved))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: its config is not a jaxlm config: {e}") from None
    if not cfg.model.vocab_size:
        raise ValueError(f"{where}: its config has no resolved vocabulary (model.vocab_size 0)")
    check_layout(layout, cfg.model)
    return cfg


def _tokenizer(saved: dict, cfg: config_lib.TrainConfig, places: list[Path]) -> TextTokenizer:
    """The tokenizer the checkpoint records (its tokenizer.json beside the run), else the run's data's."""
    record = saved.get(config_lib.TOKENIZER_KEY)
    if record is None:
        from jaxlm.run_data import run_tokenizer

        return run_tokenizer(cfg)
    directory = next((p for p in places if (p / "tokenizer.json").is_file()), places[0])
    return tokenizer_from_record(record, directory)
