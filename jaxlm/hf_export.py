"""A jaxlm checkpoint -> a Hugging Face Llama directory (`python -m experiments.export_hf`).

Memory: only the params are restored (not the optimizer state), sharded over every device of every process (FSDP
over `embed`; replicated when d_model does not divide by the device count), so no host holds the whole model. Then
one param at a time (one layer of a stacked one) is gathered whole, converted (`jaxlm.hf.hf_tensors`) and added to
the shard being written, which is flushed at `max_shard_bytes`: a host holds one shard plus one layer's tensor
beyond its share of the model.

Multi-host: every process runs the same command (with `sharding.launch`, or the --coordinator flags, or a cluster
the CLI detects), each restores its own part of the params from the shared workdir, every gather is a collective
all processes take part in, and process 0 alone writes the files.

The output appears whole or not at all: it is written to a temporary directory beside --out and renamed.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from data.atomic_dir import remove_abandoned, scratch_path
from data.ownership import HF_MODEL
from jaxlm import config as config_lib
from jaxlm import hf, hf_files
from jaxlm.config import TrainConfig

SCRATCH_TAG = "export-tmp"  # the export is built in .OUT.export-tmp-HOST-PID beside --out, then renamed


@dataclasses.dataclass
class Source:
    """What export reads, checked before any array is: the checkpoint's step and config, and the tokenizer."""

    workdir: Path
    step: int
    cfg: TrainConfig
    tokenizer: object  # data.text_tokenizer.TextTokenizer


def open_source(workdir: Path, step: int | None) -> Source:
    """The checkpoint at `step` (default: the latest) and its config and tokenizer; HFError naming the problem."""
    from jaxlm.checkpoint import Checkpointer, CheckpointError

    if not workdir.is_dir():
        raise hf.HFError(f"--workdir {workdir} is not a directory")
    if not (workdir / "checkpoints").is_dir():
        raise hf.HFError(f"{workdir} has no checkpoints/: not a training workdir")
    checkpointer = Checkpointer(workdir / "checkpoints", async_save=False, primary=False)
    try:
        steps = checkpointer.all_steps()
        if not steps:
            raise hf.HFError(f"{workdir}/checkpoints holds no complete checkpoint")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise hf.HFError(f"{workdir}/checkpoints has no step {step} (it has {', '.join(map(str, steps))})")
        saved = checkpointer.restore_config(step)
    except CheckpointError as e:
        raise hf.HFError(f"{workdir}/checkpoints/{step}: {e}") from None
    finally:
        checkpointer.close()
    record = saved.pop(config_lib.TOKENIZER_KEY, None)
    try:
        cfg = config_lib.validate(config_lib.from_dict(saved, where=f"{workdir}/checkpoints/{step}"))
    except (TypeError, ValueError) as e:
        raise hf.HFError(f"{workdir}/checkpoints/{step}: its config is not a jaxlm config: {e}") from None
    hf.check_exportable(cfg.model)
    tokenizer = checkpoint_tokenizer(workdir, cfg, record)
    m = cfg.model
    if tokenizer.vocab_size > m.vocab_size or m.tokenizer_vocab_size not in (0, tokenizer.vocab_size):
        raise hf.HFError(
            f"the tokenizer has {tokenizer.vocab_size} ids but model.vocab_size is {m.vocab_size} "
            f"(model.tokenizer_vocab_size {m.tokenizer_vocab_size})"
        )
    return Source(workdir, step, cfg, tokenizer)


def checkpoint_tokenizer(workdir: Path, cfg: TrainConfig, record: dict | None):
    """The tokenizer an imported checkpoint records (saved as WORKDIR/tokenizer.json), else the run's: the one its
    token data was written with."""
    from data.text_tokenizer import TokenizerError, tokenizer_from_record
    from jaxlm.run_data import run_tokenizer

    try:
        return tokenizer_from_record(record, workdir) if record else run_tokenizer(cfg)
    except (TokenizerError, OSError) as e:
        raise hf.HFError(f"the checkpoint's tokenizer: {e}") from None


def check_out(out: Path) -> None:
    """--out must be new or an empty directory (hf_files.check_new_dir)."""
    hf_files.check_new_dir(out, "--out", HF_MODEL)


def export(source: Source, out: Path, *, dtype: str, max_shard_bytes: int) -> dict:
    """Writes the HF directory; returns a summary (files, tensors, bytes). Every process of a multi-process run
    calls it; process 0 writes."""
    params, fetch = restore_params(source)
    cfg, tok = source.cfg.model, source.tokenizer
    tensors = hf.hf_tensors(cfg, tok.vocab_size, fetch)
    if jax.process_index() != 0:
        for _ in tensors:  # the same gathers, in the same order, as process 0's
            pass
        _sync("jaxlm_export_hf_done")
        return {}
    remove_abandoned(out, SCRATCH_TAG)  # what a killed export left
    tmp = scratch_path(out, SCRATCH_TAG)
    tmp.mkdir()
    try:
        counted = _Counted(tensors)
        files = hf_files.write_safetensors(tmp, counted, dtype=dtype, max_shard_bytes=max_shard_bytes)
        del params
        hf_files.write_json(
            tmp / hf_files.CONFIG,
            hf.hf_config(cfg, vocab_size=tok.vocab_size, eos_id=tok.eos_id, bos_id=tok.bos_id, dtype=dtype),
        )
        hf_files.write_json(tmp / hf_files.GENERATION_CONFIG, hf_files.generation_config(tok.eos_id, tok.bos_id))
        hf_files.write_tokenizer(tmp, tok, max_length=cfg.max_seq_len)
        if out.is_dir():
            out.rmdir()  # checked empty
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _sync("jaxlm_export_hf_done")
    return {"step": source.step, "files": files, "tensors": counted.count, "bytes": counted.bytes, "dtype": dtype}


def remove_scratch(out: Path) -> None:
    """Removes this process's unfinished copy of `out`."""
    shutil.rmtree(scratch_path(out, SCRATCH_TAG), ignore_errors=True)


def export_bytes(source: Source, dtype: str) -> int:
    """The bytes of the tensors an export of `source` writes, in `dtype` (what it needs on disk, give or take its
    small JSON files)."""
    shapes = hf.hf_shapes(source.cfg.model, source.tokenizer.vocab_size)
    return int(sum(np.prod(shape) for shape in shapes.values())) * (2 if dtype == "bfloat16" else 4)


class _Counted:
    """Passes (name, array) pairs through, counting them and their float32 bytes."""

    def __init__(self, items):
        self.items, self.count, self.bytes = items, 0, 0

    def __iter__(self):
        for name, array in self.items:
            self.count, self.bytes = self.count + 1, self.bytes + array.nbytes
            yield name, array


def restore_params(source: Source):
    """The checkpoint's params (only they: no optimizer state), sharded FSDP over all devices, verified against
    the checkpoint's checksums; and fetch(path, layer) -> that param (or one layer of it) whole on this host."""
    import orbax.checkpoint as ocp

    from jaxlm.checkpoint import integrity
    from jaxlm.train import Program
    from sharding import MeshLayout, build_mesh

    cfg = source.cfg
    n = jax.device_count()
    layout = MeshLayout(fsdp=n) if cfg.model.d_model % n == 0 else MeshLayout(data=n)  # data: replicated
    plain = dataclasses.replace(cfg, diloco=type(cfg.diloco)())  # the plain program: its params tree
    program = Program(plain, build_mesh(layout), layout)
    key = "global_params" if cfg.diloco.enabled else "params"  # DiLoCo's state keeps the global params there
    abstract = {key: program.abstract_with_shardings().params}
    directory = (source.workdir / "checkpoints" / str(source.step)).absolute()
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
        try:
            restored = reader.restore(
                directory / "state",
                args=ocp.args.PyTreeRestore(
                    item=abstract,
                    restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                    partial_restore=True,
                ),
            )
        except Exception as e:  # Orbax raises many types; the first line says what
            raise hf.HFError(f"{directory}: its params cannot be read: {str(e).splitlines()[0][:300]}") from None
    _verify(directory, integrity(restored))
    params = restored[key]
    pure = nnx.to_pure_dict(params)
    take = jax.jit(lambda a, i: a[i])

    def fetch(path: tuple[str, ...], layer: int | None) -> np.ndarray:
        value = pure
        for part in path:
            value = value[part]
        if layer is not None:
            value = take(value, np.int32(layer))
        return _host_copy(value)

    return params, fetch


def _verify(directory: Path, digests: dict) -> None:
    """The restored params against the checksums saved with them (a checkpoint without any is not verified)."""
    import orbax.checkpoint as ocp

    if not (directory / "integrity").exists():
        return
    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as reader:
        saved = reader.restore(directory / "integrity")
    for path, record in digests.items():
        if saved.get(path, {}).get("digest") != record["digest"]:
            raise hf.HFError(f"{directory}: {path} does not match its saved checksum")


def _host_copy(x: jax.Array) -> np.ndarray:
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(x), np.float32)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True), np.float32)


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
