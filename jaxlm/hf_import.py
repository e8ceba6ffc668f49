"""A Hugging Face Llama directory -> a jaxlm workdir (`python -m experiments.import_hf`).

The workdir is what a training run leaves at step 0: `config.json` (the resolved config), `checkpoints/0` (the
imported params, a fresh optimizer state, the data loader's starting position; the saved config also records the
tokenizer under `config_lib.TOKENIZER_KEY`) and `tokenizer.json`. Training continues it like any run:
`python -m experiments.tiny_lm --config W/config.json --workdir W --steps N`. The config's data section is the
fine-tuning data (`--data`), whose tokenizer must be the model's: a resumed run may not change it.

The workdir appears whole or not at all: it is built in a temporary directory beside it and renamed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp

from data.atomic_dir import remove_abandoned, scratch_path
from data.fault_points import pause_point
from data.ownership import HF_MODEL, WORKDIR, kind_of, mark_workdir
from jaxlm import config as config_lib
from jaxlm import hf, hf_files
from jaxlm.config import DataConfig, TrainConfig

# Model fields config.json decides; an override may set the others (attention_impl, remat, dtype, ...).
HF_FIELDS = (
    "vocab_size",
    "tokenizer_vocab_size",
    "d_model",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "mlp_dim",
    "rope_theta",
    "rope_scaling",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_seq_len",
    "norm_eps",
    "tie_embeddings",
    "num_experts",
    "experts_per_token",
    "expert_mlp_dim",
    "router",
    "router_norm_topk",
)


@dataclasses.dataclass
class Plan:
    """Everything an import needs, checked before a tensor is read."""

    hf_dir: Path
    cfg: TrainConfig
    vocab_size: int  # the HF model's (unpadded) vocabulary
    tokenizer: object  # data.text_tokenizer.TextTokenizer


def plan(hf_dir: Path, *, data: str | None, overrides: list[str]) -> Plan:
    """Reads config.json and the tokenizer, builds and validates the run config; HFError naming the problem."""
    if not hf_dir.is_dir():
        raise hf.HFError(f"--hf {hf_dir} is not a directory")
    check_not_jaxlm(hf_dir)
    hf_config = hf_files.read_json(hf_dir / hf_files.CONFIG)
    model = hf.model_config_from_hf(hf_config)
    vocab_size = model.tokenizer_vocab_size  # config.json vocab_size: the ids the files hold
    tokenizer = hf_tokenizer(hf_dir)
    if tokenizer.vocab_size > vocab_size:
        raise hf.HFError(
            f"{hf_dir}/tokenizer.json has {tokenizer.vocab_size} ids but config.json vocab_size is {vocab_size}"
        )
    model = dataclasses.replace(model, tokenizer_vocab_size=tokenizer.vocab_size)  # ids past it: never predicted
    base = TrainConfig(
        model=model, data=DataConfig(path=data or "", seq_len=min(DataConfig.seq_len, model.max_seq_len))
    )
    try:
        cfg = config_lib.validate_training(config_lib.apply_overrides(base, overrides))  # the workdir is for training
    except ValueError as e:
        raise hf.HFError(str(e)) from None
    for name in HF_FIELDS:
        if getattr(cfg.model, name) != getattr(model, name):
            raise hf.HFError(
                f"model.{name} comes from {hf_dir}/config.json ({getattr(model, name)!r}); it cannot be set"
            )
    if data:
        check_data_tokenizer(data, tokenizer)
    return Plan(hf_dir, cfg, vocab_size, tokenizer)


def check_not_jaxlm(hf_dir: Path) -> None:
    """HFError when --hf is one of jaxlm's own directories (a training workdir: a jaxlm config.json or a
    checkpoints/ folder; token data; a quantized checkpoint), saying how that one is used instead."""
    kind = kind_of(hf_dir)
    if kind is WORKDIR or (kind is None and (hf_dir / "checkpoints").is_dir()):
        train_on = (  # only where training would accept the directory as its own
            f", and python -m experiments.tiny_lm --config {hf_dir}/config.json --workdir {hf_dir} --steps N "
            f"trains it on"
            if kind is WORKDIR
            else ""
        )
        raise hf.HFError(
            f"--hf {hf_dir} is a jaxlm training workdir, not a Hugging Face model: it needs no import; "
            f"python -m experiments.generate (or experiments.evaluate) --workdir {hf_dir} reads it as it is{train_on}"
        )
    if kind is not None and kind is not HF_MODEL:
        use = f" ({kind.use.format(path=hf_dir)})" if kind.use else ""
        raise hf.HFError(f"--hf {hf_dir} is {kind} ({kind.written_by}), not a Hugging Face model{use}")


def hf_tokenizer(hf_dir: Path):
    """The directory's tokenizer.json, EOS / BOS as its tokenizer_config.json names them; the byte tokenizer when
    it is that one (an exported jaxlm model), so byte-level token data matches it by name too."""
    from data.text_tokenizer import TOKENIZER_JSON, TokenizerError, byte_tokenizer, load_tokenizer

    if not (hf_dir / TOKENIZER_JSON).is_file():
        raise hf.HFError(f"{hf_dir} has no {TOKENIZER_JSON} (the tokenizer jaxlm trains and generates with)")
    special = {}
    if (hf_dir / hf_files.TOKENIZER_CONFIG).is_file():
        tok_config = hf_files.read_json(hf_dir / hf_files.TOKENIZER_CONFIG)
        for key in ("eos_token", "bos_token"):
            value = tok_config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                special[key] = value
    try:
        tokenizer = load_tokenizer(hf_dir, **special)
    except TokenizerError as e:
        raise hf.HFError(str(e)) from None
    byte = byte_tokenizer()
    same = (tokenizer.sha256, tokenizer.eos_id, tokenizer.bos_id) == (byte.sha256, byte.eos_id, byte.bos_id)
    return byte if same else tokenizer


def check_data_tokenizer(data: str, tokenizer) -> None:
    """Fine-tuning token data must have been written with the model's own tokenizer (same tokenizer.json)."""
    from data.text_tokenizer import TokenizerError
    from data.text_tokenizer import check_data_tokenizer as check

    try:
        check(data, tokenizer, fix="tokenize the text with the model's tokenizer.json")
    except TokenizerError as e:
        raise hf.HFError(str(e)) from None


SCRATCH_TAG = "import-tmp"  # the workdir is built in .WORKDIR.import-tmp-HOST-PID beside it, then renamed


def check_workdir(workdir: Path) -> None:
    """--workdir must be new or an empty directory (hf_files.check_new_dir)."""
    hf_files.check_new_dir(workdir, "--workdir", WORKDIR)


def read_params(p: Plan) -> dict:
    """The HF tensors as jaxlm params (nested dict of float32 numpy); HFError naming a missing, mis-shaped or
    unexpected tensor."""
    reader = hf_files.TensorReader(p.hf_dir)
    extra = hf.unexpected_tensors(p.cfg.model, p.vocab_size, reader.names)
    if extra:
        raise hf.HFError(
            f"tensor {extra[0]} is not part of a Llama model{f' (and {len(extra) - 1} more)' * (len(extra) > 1)}"
        )
    shapes = hf.hf_shapes(p.cfg.model, p.vocab_size)
    return hf.params_from_hf(p.cfg.model, p.vocab_size, lambda name: reader.read(name, shapes[name]))


def write_workdir(p: Plan, params: dict, workdir: Path) -> None:
    """The step-0 workdir: config.json, tokenizer.json, checkpoints/0 (built aside, then renamed into place)."""
    from jaxlm.checkpoint import Checkpointer
    from jaxlm.run_data import open_run_data
    from sharding import MeshLayout, build_mesh

    train_iter, _ = open_run_data(p.cfg)  # the loader's starting position, as a fresh run saves it
    data_state = train_iter.get_state()
    if hasattr(train_iter, "close"):
        train_iter.close()
    mesh = build_mesh(MeshLayout(data=1), devices=jax.devices()[:1])
    state = train_state(p.cfg, mesh, params)
    remove_abandoned(workdir, SCRATCH_TAG)  # what a killed import left
    tmp = scratch_path(workdir, SCRATCH_TAG)
    tmp.mkdir()
    try:
        checkpointer = Checkpointer(tmp / "checkpoints", async_save=False)
        saved = {**config_lib.to_dict(p.cfg), config_lib.TOKENIZER_KEY: p.tokenizer.describe()}
        checkpointer.save(0, state, data_state, saved)
        checkpointer.close()
        pause_point("import.checkpoint")
        (tmp / "config.json").write_text(json.dumps(config_lib.to_dict(p.cfg), indent=2) + "\n")
        mark_workdir(tmp)
        p.tokenizer.save(tmp)
        if workdir.is_dir():
            workdir.rmdir()  # checked empty
        os.replace(tmp, workdir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_scratch(workdir: Path) -> None:
    """Removes this process's unfinished copy of `workdir`."""
    shutil.rmtree(scratch_path(workdir, SCRATCH_TAG), ignore_errors=True)


def train_state(cfg: TrainConfig, mesh, params: dict):
    """A TrainState at step 0 holding `params` and the optimizer's fresh state, built by one jitted function
    straight into the program's shardings (the random init it traces is dead code: XLA drops it)."""
    from flax import nnx

    from jaxlm.model import Transformer
    from jaxlm.train import Program, TrainState, split_trainable

    program = Program(cfg, mesh)

    def build(pure):
        state = nnx.state(Transformer(cfg.model, rngs=nnx.Rngs(0)))
        nnx.replace_by_pure_dict(state, pure)
        return TrainState(jnp.zeros((), jnp.int32), state, program.tx.init(split_trainable(state)[0]))

    return jax.jit(build, out_shardings=program.state_shardings)(params)
