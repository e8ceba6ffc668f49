"""Tiny configs, meshes, batches and token files shared by the model / train / resume tests."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from data import write_token_file
from experiments.fault_harness import process_pid as pid_of_process  # noqa: F401 (one process of a launched run)
from jaxlm.config import DataConfig, ModelConfig, OptimConfig, TrainConfig
from sharding import MeshLayout, build_mesh

VOCAB = 64


def compile_env(**extra) -> dict:
    """The environment of a subprocess that compiles for an accelerator this machine lacks: without the suite's CPU
    pin (``targets.enable`` keeps CPU the default itself) and without its compilation cache (GPU and TPU
    executables stay out of the CPU tests' shared one); ``extra`` added."""
    drop = ("JAX_COMPILATION_CACHE_DIR", "JAX_PLATFORMS")
    return {k: v for k, v in os.environ.items() if k not in drop} | extra


def tiny_model(**overrides) -> ModelConfig:
    base = ModelConfig(
        vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=64, max_seq_len=32
    )
    return dataclasses.replace(base, **overrides)


def tiny_config(
    *, model: dict | None = None, optim: dict | None = None, data: dict | None = None, **train
) -> TrainConfig:
    return TrainConfig(
        model=tiny_model(**(model or {})),
        optim=dataclasses.replace(OptimConfig(warmup_steps=2), **(optim or {})),
        data=dataclasses.replace(DataConfig(seq_len=16, batch_size=8, val_fraction=0.0), **(data or {})),
        **{"steps": 30, "log_every": 1, "tensorboard": False, **train},
    )


def tiny_run_sets(**overrides) -> list[str]:
    """`--set` flags for a tiny tiny_lm run from the CLI (2 layers of d_model 32, windows of 32, no evals or
    samples); `overrides` by dotted key with `.` written `__` (data__path=...)."""
    fields = {
        "model.d_model": 32,
        "model.num_layers": 2,
        "model.num_heads": 4,
        "model.num_kv_heads": 2,
        "model.mlp_dim": 64,
        "model.max_seq_len": 64,
        "data.seq_len": 32,
        "data.batch_size": 4,
        "data.microbatches": 1,
        "data.eval_batches": 1,
        "eval_every": 0,
        "eval_prompts": "",
        **{key.replace("__", "."): value for key, value in overrides.items()},
    }
    return [a for k, v in fields.items() for a in ("--set", f"{k}={v}")]


def one_device_mesh():
    return build_mesh(MeshLayout(data=1), devices=jax.devices()[:1])


def random_batch(seed: int, batch: int = 8, seq: int = 16, vocab: int = VOCAB) -> dict:
    rng = np.random.default_rng(seed)
    window = rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    return {"inputs": window[:, :-1], "targets": window[:, 1:], "loss_mask": np.ones((batch, seq), np.float32)}


def repetitive_token_file(path, *, period: int = 16, repeats: int = 400, vocab: int = VOCAB):
    """One long document cycling through `period` ids: easy to learn, so a working optimizer drives the loss down."""
    doc = np.tile(np.arange(period, dtype=np.int64) % (vocab - 1), repeats)
    return write_token_file(path, [doc], vocab_size=vocab, eos_id=vocab - 1)


def random_token_file(path, *, num_tokens: int = 6000, vocab: int = VOCAB, seed: int = 0):
    rng = np.random.default_rng(seed)
    return write_token_file(path, [rng.integers(0, vocab - 1, num_tokens)], vocab_size=vocab, eos_id=vocab - 1)


def pure(state) -> dict:
    """nnx.State -> nested dict of numpy arrays (host copies, safe after donation)."""
    return jax.tree.map(np.asarray, nnx.to_pure_dict(state))


def gaussian(shape, seed: int = 0, dtype=np.float32):
    """Standard normal values as a jax array, reproducible by seed."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def rel(a, b) -> float:
    """||a - b|| / ||b||, computed in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
