"""Run configuration: frozen dataclasses, Python config files loaded by path, and `--set` overrides.

A config file is plain Python that defines `config` (a `TrainConfig`) or `def config() -> TrainConfig`.
Everything is validated here, before JAX compiles anything, so a typo costs a second, not a compile.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import re
import traceback
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A bad config file, key or value; the message names the problem in one line."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 384
    d_model: int = 256
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0  # 0 -> d_model // num_heads
    mlp_dim: int = 1024  # SwiGLU hidden size
    max_seq_len: int = 256
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    dtype: str = "float32"  # activation/compute dtype; params are always float32
    scan_layers: bool = True  # lax.scan over stacked layers (compile time flat in depth)
    scan_unroll: int = 1  # lax.scan unroll factor; num_layers == fully unrolled
    remat: str = "none"  # per-layer rematerialisation: see jaxlm.model.REMAT_POLICIES
    attention_impl: str = "reference"  # reference | jax | xla_blocksparse | pallas (jaxlm.attention)
    attention_mask: str = "causal"  # a mask spec, e.g. "causal & sliding_window(128)" or "causal & document"
    attention_block_q: int = 128  # tile sizes of the block-sparse implementations
    attention_block_kv: int = 128
    attention_softcap: float = 0.0  # > 0: cap * tanh(score / cap) on attention logits (Gemma 2 style)
    # Low-precision matmuls (jaxlm.quantized): "fp8", or per layer class "attention=fp8,mlp=fp8,lm_head=default";
    # precisions default | int8 | fp8 | int8_weight_only.
    matmul_precision: str = "default"
    quant_scaling: str = "delayed"  # delayed (per-tensor, amax history) | current (per row / per channel)
    quant_backward: str = "quantized"  # quantized (dY in e5m2 / int8) | high (backward in the compute dtype)
    quant_amax_history: int = 16  # steps of amax history for delayed scaling
    matmul_impl: str = "auto"  # auto (Pallas kernel on one GPU/TPU, else XLA) | pallas | xla

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads


OPTIMIZERS = ("adamw", "sgd")


@dataclass(frozen=True)
class OptimConfig:
    optimizer: str = "adamw"  # adamw | sgd (plain SGD with the same schedule, clipping and decoupled weight decay)
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    decay_steps: int = 0  # 0 -> decay over the run's total steps
    min_lr_ratio: float = 0.1  # final lr = learning_rate * min_lr_ratio
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # global-norm clipping; 0 disables


LOADERS = ("clairvoyant", "simple")
# data fields that change how fast batches arrive, never which batches: a resumed run may change them
DATA_SPEED_FIELDS = ("cache_ram_mb", "cache_disk_mb", "cache_dir", "loader_workers", "prefetch_steps",
                     "throttle_latency_ms", "throttle_mb_per_s")
# DiLoCo fields that say where and how a replica process syncs, not what the state is: a resume may change them
DILOCO_PROCESS_FIELDS = ("exchange", "replica", "sync_timeout_s", "heartbeat_s")


@dataclass(frozen=True)
class DataConfig:
    path: str = ""  # a token file directory (python -m data.prepare); "" -> the default stdlib corpus
    seq_len: int = 256
    batch_size: int = 16  # global batch, in sequences
    microbatches: int = 1  # gradient accumulation: batch_size is split into this many microbatches
    val_fraction: float = 0.01
    eval_batches: int = 4
    # the training loader: "clairvoyant" (data.loader: plan-driven cache + prefetch) or "simple" (SeededBatchIterator)
    loader: str = "clairvoyant"
    cache_ram_mb: float = 256.0  # this process's RAM tier (0 disables it)
    cache_disk_mb: float = 0.0  # this process's local-disk tier
    cache_dir: str = ""  # where the disk tier's slot file lives ("" -> the system temp dir)
    loader_workers: int = 16  # fetch threads per process
    prefetch_steps: int = 4  # batches fetched ahead of the training step
    # simulate a remote filesystem under the dataset (benchmarks, tests): per-request latency and shared bandwidth
    throttle_latency_ms: float = 0.0
    throttle_mb_per_s: float = 0.0  # 0 -> unlimited


DILOCO_DATA = ("iid", "partition")


@dataclass(frozen=True)
class DiLoCoConfig:
    """Semi-synchronous training (jaxlm.diloco): M replicas take H inner steps, then one outer step on their deltas."""

    replicas: int = 0  # M; 0 turns DiLoCo off (plain synchronous training)
    inner_steps: int = 30  # H: inner steps between two syncs of the same fragment
    outer_lr: float = 0.7
    outer_momentum: float = 0.9  # Nesterov momentum of the outer SGD; 0 -> plain SGD
    fragments: int = 1  # P: streaming DiLoCo syncs one of P layer-strided fragments every H/P steps
    overlap_steps: int = 0  # tau: the synced fragment is merged tau inner steps after its sync (communication overlap)
    mixing: float = 0.0  # alpha: a merged fragment becomes alpha * local + (1 - alpha) * global
    compression: str = "none"  # outer gradients on the wire: none (float32) | bf16 | int8 | int4
    compression_block: int = 256  # values per float32 scale for int8 / int4
    data: str = "iid"  # iid: each replica gets B/M rows of the global batch | partition: a disjoint slice of the data
    drop: str = ""  # simulated failures, "m@first-last,...": replica m is down for steps first..last and then rejoins
    # One replica per independent process (jaxlm.diloco_processes), surviving the death of any of them:
    exchange: str = ""  # directory all replicas' processes share for the outer syncs; "" = replicas in one program
    replica: int = 0  # this process's replica, 0..replicas-1 (the CLI reads $JAXLM_REPLICA_ID, set by launch)
    sync_timeout_s: float = 120.0  # how long a sync waits for a missing replica before going on without it
    heartbeat_s: float = 30.0  # a replica whose heartbeat file stood still this long is dead: no wait; 0: off


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    steps: int = 200
    seed: int = 0
    log_every: int = 10
    eval_every: int = 50  # 0 disables periodic eval (a final eval still runs when a val split exists)
    checkpoint_every: int = 50
    checkpoint_minutes: float = 0.0  # also checkpoint when this many minutes passed since the last save; 0: off
    keep_checkpoints: int = 3
    max_bad_steps: int = 10  # stop after this many consecutive steps with a non-finite loss or gradient (skipped)
    async_checkpointing: bool = True
    tensorboard: bool = True


# ----------------------------------------------------------------------------- loading


def load_config(path: str | Path) -> TrainConfig:
    """Executes a Python config file and returns its `config` (an instance or a zero-arg function).

    Field types are checked here, so a wrong one names the file even when a flag overrides that field."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    module = exec_python_file(path, "config")
    if not hasattr(module, "config"):
        raise ConfigError(f"config file {path} must define `config` (a TrainConfig or a function returning one)")
    cfg = module.config
    if callable(cfg) and not isinstance(cfg, TrainConfig):
        cfg = call_user_function(cfg, path=path, kind="config")
    if not isinstance(cfg, TrainConfig):
        raise ConfigError(f"config file {path}: `config` is a {type(cfg).__name__}, expected TrainConfig")
    _check_types(cfg, "", where=f"config file {path}:")
    return cfg


def exec_python_file(path: Path, kind: str, error: type[Exception] = ConfigError) -> types.ModuleType:
    """Runs a user's Python file (a config, a mesh layout); whatever goes wrong becomes one line of `error`."""
    spec = importlib.util.spec_from_file_location(f"_jaxlm_{kind.replace(' ', '_')}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise error(f"{kind} file {path}: syntax error at line {e.lineno}: {e.msg}") from None
    except Exception as e:  # a user's file may raise anything
        raise error(_user_code_error(e, path, kind, vars(module))) from None
    return module


def call_user_function(fn, *args, path: Path, kind: str, error: type[Exception] = ConfigError):
    """Calls a function from a user's file (`def config()`, `def layout(num_devices)`); fails as exec_python_file."""
    try:
        return fn(*args)
    except Exception as e:
        raise error(_user_code_error(e, path, kind, getattr(fn, "__globals__", {}))) from None


def _user_code_error(e: Exception, path: Path, kind: str, namespace: dict) -> str:
    """One line for an exception from a user's file: the line of the file that raised it, and a misspelt
    keyword of a dataclass in the file's namespace (ModelConfig, MeshLayout, ...) by name."""
    source = namespace.get("__file__")  # the name its code was compiled under (absolute, unlike `path`)
    lines = [frame.lineno for frame in traceback.extract_tb(e.__traceback__) if frame.filename == source]
    where = f"{kind} file {path}" + (f", line {lines[-1]}" if lines else "")
    kwarg = re.fullmatch(r"(\w+)\.__init__\(\) got an unexpected keyword argument '(\w+)'", str(e))
    cls = namespace.get(kwarg[1]) if isinstance(e, TypeError) and kwarg else None
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        return f"{where} raised {type(e).__name__}: {e}"
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(kwarg[2], names, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"fields: {', '.join(names)}"
    return f"{where}: {cls.__name__} has no field {kwarg[2]!r} ({hint})"


# ----------------------------------------------------------------------------- overrides


def apply_overrides(cfg: TrainConfig, assignments: list[str]) -> TrainConfig:
    """Applies `dotted.key=value` strings, parsing each value by the field's declared type."""
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects dotted.key=value, got {assignment!r}")
        cfg = _set_path(cfg, key.strip().split("."), raw.strip(), key.strip())
    return cfg


def _set_path(obj: Any, parts: list[str], raw: str, full_key: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    name = parts[0]
    if name not in fields:
        where = type(obj).__name__
        raise ConfigError(f"unknown config key {full_key!r}: {where} has no field {name!r} (fields: {', '.join(fields)})")
    current = getattr(obj, name)
    if dataclasses.is_dataclass(current):
        if len(parts) == 1:
            raise ConfigError(f"config key {full_key!r} is a section; set one of its fields, e.g. {full_key}.<field>=...")
        return dataclasses.replace(obj, **{name: _set_path(current, parts[1:], raw, full_key)})
    if len(parts) > 1:
        raise ConfigError(f"unknown config key {full_key!r}: {name!r} is not a section")
    hint = typing.get_type_hints(type(obj))[name]
    return dataclasses.replace(obj, **{name: _parse_value(raw, hint, full_key)})


def _parse_value(raw: str, hint: Any, key: str) -> Any:
    try:
        if hint is bool:
            lowered = raw.lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if hint is int:
            return int(raw)
        if hint is float:
            value = float(raw)
            if not math.isfinite(value):
                raise ValueError
            return value
        if hint is str:
            return raw
    except ValueError:
        raise ConfigError(f"bad value for {key}: {raw!r} is not a valid {hint.__name__}") from None
    raise ConfigError(f"config key {key} has unsupported type {hint}")


# ----------------------------------------------------------------------------- validation


def validate(cfg: TrainConfig) -> TrainConfig:
    """Checks types and cross-field constraints; raises ConfigError naming the first problem."""
    _check_types(cfg, "")
    m, o, d = cfg.model, cfg.optim, cfg.data
    positive = {
        "model.vocab_size": m.vocab_size, "model.d_model": m.d_model, "model.num_layers": m.num_layers,
        "model.num_heads": m.num_heads, "model.num_kv_heads": m.num_kv_heads, "model.mlp_dim": m.mlp_dim,
        "model.max_seq_len": m.max_seq_len, "model.scan_unroll": m.scan_unroll,
        "model.attention_block_q": m.attention_block_q, "model.attention_block_kv": m.attention_block_kv,
        "model.quant_amax_history": m.quant_amax_history,
        "data.seq_len": d.seq_len, "data.batch_size": d.batch_size, "data.microbatches": d.microbatches,
        "steps": cfg.steps, "log_every": cfg.log_every, "keep_checkpoints": cfg.keep_checkpoints,
        "max_bad_steps": cfg.max_bad_steps,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    non_negative = {"model.head_dim": m.head_dim, "optim.warmup_steps": o.warmup_steps, "optim.decay_steps": o.decay_steps,
                    "eval_every": cfg.eval_every, "checkpoint_every": cfg.checkpoint_every, "data.eval_batches": d.eval_batches,
                    "seed": cfg.seed, "optim.grad_clip": o.grad_clip, "optim.weight_decay": o.weight_decay,
                    "model.attention_softcap": m.attention_softcap,
                    "checkpoint_minutes": cfg.checkpoint_minutes}
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")
    if o.learning_rate <= 0:
        raise ConfigError(f"optim.learning_rate must be positive, got {o.learning_rate}")
    if not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    if not 0 <= d.val_fraction < 1:
        raise ConfigError(f"data.val_fraction must be in [0, 1), got {d.val_fraction}")
    if m.head_dim == 0 and m.d_model % m.num_heads:
        raise ConfigError(f"model.d_model ({m.d_model}) must be divisible by model.num_heads ({m.num_heads}) or set model.head_dim")
    if m.resolved_head_dim % 2:
        raise ConfigError(f"head dim must be even for rotary embeddings, got {m.resolved_head_dim}")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(f"model.num_heads ({m.num_heads}) must be divisible by model.num_kv_heads ({m.num_kv_heads})")
    if m.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"model.dtype must be 'float32' or 'bfloat16', got {m.dtype!r}")
    from jaxlm.attention import IMPLEMENTATIONS, parse_mask  # local: these import jax, config must stay light
    from jaxlm.model import REMAT_POLICIES

    if m.remat not in REMAT_POLICIES:
        raise ConfigError(f"model.remat must be one of {sorted(REMAT_POLICIES)}, got {m.remat!r}")

    if m.attention_impl not in IMPLEMENTATIONS:
        raise ConfigError(f"model.attention_impl must be one of {sorted(IMPLEMENTATIONS)}, got {m.attention_impl!r}")
    try:
        parse_mask(m.attention_mask)
    except ValueError as e:
        raise ConfigError(f"model.attention_mask: {e}") from None
    if m.attention_impl == "jax" and m.attention_softcap:
        raise ConfigError("model.attention_softcap needs attention_impl reference, xla_blocksparse or pallas; "
                          "jax.nn.dot_product_attention takes no score mod")
    _check_quantization(m)
    if d.seq_len > m.max_seq_len:
        raise ConfigError(f"data.seq_len ({d.seq_len}) exceeds model.max_seq_len ({m.max_seq_len})")
    if d.loader not in LOADERS:
        raise ConfigError(f"data.loader must be one of {list(LOADERS)}, got {d.loader!r}")
    for key in ("cache_ram_mb", "cache_disk_mb", "throttle_latency_ms", "throttle_mb_per_s"):
        if getattr(d, key) < 0:
            raise ConfigError(f"data.{key} must be >= 0, got {getattr(d, key)}")
    for key in ("loader_workers", "prefetch_steps"):
        if getattr(d, key) < 1:
            raise ConfigError(f"data.{key} must be >= 1, got {getattr(d, key)}")
    if d.batch_size % d.microbatches:
        raise ConfigError(f"data.batch_size ({d.batch_size}) must be divisible by data.microbatches ({d.microbatches})")
    if o.optimizer not in OPTIMIZERS:
        raise ConfigError(f"optim.optimizer must be one of {', '.join(OPTIMIZERS)}, got {o.optimizer!r}")
    if cfg.diloco.replicas:
        _check_diloco(cfg)
    elif cfg.diloco.replicas < 0:
        raise ConfigError(f"diloco.replicas must be >= 0 (0 turns DiLoCo off), got {cfg.diloco.replicas}")
    return cfg


def _check_diloco(cfg: TrainConfig) -> None:
    from jaxlm.outer_compression import BITS
    from jaxlm.quantized import uses_delayed_scaling

    c, m, d = cfg.diloco, cfg.model, cfg.data
    if c.inner_steps < 1:
        raise ConfigError(f"diloco.inner_steps must be >= 1, got {c.inner_steps}")
    if c.outer_lr <= 0:
        raise ConfigError(f"diloco.outer_lr must be positive, got {c.outer_lr}")
    if not 0 <= c.outer_momentum < 1:
        raise ConfigError(f"diloco.outer_momentum must be in [0, 1), got {c.outer_momentum}")
    if d.batch_size % c.replicas:
        raise ConfigError(f"data.batch_size ({d.batch_size}) must be divisible by diloco.replicas ({c.replicas})")
    if (d.batch_size // c.replicas) % d.microbatches:
        raise ConfigError(f"per-replica batch {d.batch_size // c.replicas} (data.batch_size / diloco.replicas) must be "
                          f"divisible by data.microbatches ({d.microbatches})")
    if not 1 <= c.fragments <= m.num_layers:
        raise ConfigError(f"diloco.fragments must be in [1, model.num_layers = {m.num_layers}], got {c.fragments}")
    if c.inner_steps % c.fragments:
        raise ConfigError(f"diloco.inner_steps ({c.inner_steps}) must be divisible by diloco.fragments "
                          f"({c.fragments}): one fragment is synced every inner_steps / fragments steps")
    if not 0 <= c.overlap_steps < c.inner_steps // c.fragments:
        raise ConfigError(f"diloco.overlap_steps must be in [0, inner_steps / fragments = "
                          f"{c.inner_steps // c.fragments}), got {c.overlap_steps}")
    if not 0 <= c.mixing <= 1:
        raise ConfigError(f"diloco.mixing must be in [0, 1], got {c.mixing}")
    if c.compression not in BITS:
        raise ConfigError(f"diloco.compression must be one of {', '.join(BITS)}, got {c.compression!r}")
    if c.compression_block < 1:
        raise ConfigError(f"diloco.compression_block must be >= 1, got {c.compression_block}")
    if c.data not in DILOCO_DATA:
        raise ConfigError(f"diloco.data must be one of {', '.join(DILOCO_DATA)}, got {c.data!r}")
    if uses_delayed_scaling(m):
        raise ConfigError("delayed-scaling quantization (model.quant_scaling=delayed) keeps amax histories that "
                          "DiLoCo cannot average; set model.quant_scaling=current")
    if c.exchange:
        if not 0 <= c.replica < c.replicas:
            raise ConfigError(f"diloco.replica must be in [0, diloco.replicas = {c.replicas}), got {c.replica}")
        if c.sync_timeout_s <= 0:
            raise ConfigError(f"diloco.sync_timeout_s must be positive, got {c.sync_timeout_s}")
        if c.heartbeat_s < 0:
            raise ConfigError(f"diloco.heartbeat_s must be >= 0 (0 turns the heartbeat off), got {c.heartbeat_s}")
        if c.drop:
            raise ConfigError("diloco.drop simulates failures inside one program; with diloco.exchange a replica "
                              "fails by its process dying, so leave diloco.drop empty")
    drops = parse_drops(c.drop, c.replicas)
    for step in sorted({first for _, first, _ in drops}):  # the down set only grows where an interval starts
        if len(replicas_down(drops, step)) == c.replicas:
            raise ConfigError(f"diloco.drop {c.drop!r} leaves no replica alive at step {step}")


def parse_drops(spec: str, replicas: int) -> list[tuple[int, int, int]]:
    """'m@first-last,...' -> [(replica, first step, last step)]: replica m is down for steps first..last (1-based)."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            replica, steps = part.split("@")
            first, last = steps.split("-")
            item = (int(replica), int(first), int(last))
        except ValueError:
            raise ConfigError(f"diloco.drop: {part!r} is not 'replica@first-last', e.g. '1@40-80'") from None
        if not 0 <= item[0] < replicas:
            raise ConfigError(f"diloco.drop: replica {item[0]} in {part!r} is not in [0, {replicas})")
        if not 1 <= item[1] <= item[2]:
            raise ConfigError(f"diloco.drop: {part!r} needs 1 <= first <= last")
        out.append(item)
    return out


def replicas_down(drops: list[tuple[int, int, int]], step: int) -> set[int]:
    """The replicas that `parse_drops` intervals keep from taking inner step `step`."""
    return {m for m, first, last in drops if first <= step <= last}


def _check_quantization(m: ModelConfig) -> None:
    from jaxlm.quantized import BACKWARDS, SCALINGS, parse_matmul_precision
    from pallas_kernels.quantized_matmul import IMPLS

    try:
        parse_matmul_precision(m.matmul_precision)
    except ValueError as e:
        raise ConfigError(f"model.matmul_precision: {e}") from None
    choices = {"model.quant_scaling": (m.quant_scaling, SCALINGS), "model.quant_backward": (m.quant_backward, BACKWARDS),
               "model.matmul_impl": (m.matmul_impl, IMPLS)}
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"{key} must be one of {', '.join(allowed)}, got {value!r}")


def _check_types(obj: Any, prefix: str, where: str = "config") -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, hint, key = getattr(obj, f.name), hints[f.name], prefix + f.name
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, hint):
                raise ConfigError(f"{where} {key} must be a {hint.__name__}, got {type(value).__name__}")
            _check_types(value, key + ".", where)
        elif hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):  # nan would pass every range check in validate()
                raise ConfigError(f"{where} {key} must be a finite float, got {value!r}")
        elif not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise ConfigError(f"{where} {key} must be {hint.__name__}, got {type(value).__name__} {value!r}")


# ----------------------------------------------------------------------------- serialization


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(data: dict) -> TrainConfig:
    sections = {"model": ModelConfig, "optim": OptimConfig, "data": DataConfig, "diloco": DiLoCoConfig}
    kwargs = {k: (sections[k](**v) if k in sections else v) for k, v in data.items()}
    return TrainConfig(**kwargs)


def diff(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """Keys whose values differ between two config dicts, as 'key: saved -> current'."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out
