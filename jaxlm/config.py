"""Run configuration: frozen dataclasses, Python config files loaded by path, and `--set` overrides.

A config file is plain Python that defines `config` (a `TrainConfig`) or `def config() -> TrainConfig`.
Everything is validated here, before JAX compiles anything, so a typo costs a second, not a compile.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxlm.config_checks import ConfigError, Section, check_choice, check_moe, check_non_negative, check_positive
from jaxlm.config_overrides import apply_overrides  # noqa: F401 - part of this module's interface (CLIs, tests)
from jaxlm.data_config import CPU_MICROBATCH_TOKENS, LOADERS, DataConfig  # noqa: F401 - re-exported as a section
from jaxlm.diloco.config import DiLoCoConfig
from sharding.user_file import call_user_function, exec_python_file

__all__ = [
    "ConfigError",
    "DataConfig",
    "DiLoCoConfig",
    "ModelConfig",
    "OptimConfig",
    "TrainConfig",
    "apply_overrides",
    "from_dict",
    "load_config",
    "to_dict",
    "validate",
    "validate_training",
]


# Allowed values live here, with the fields they belong to; the modules that act on them import them from here.
DTYPES = ("float32", "bfloat16")
REMAT_CHOICES = ("none", "full", "dots", "dots_no_batch")  # jaxlm.model.REMAT_POLICIES: what each keeps
ATTENTION_IMPLS = ("auto", "reference", "jax", "xla_blocksparse", "pallas")  # jaxlm.attention
CONTEXT_PARALLEL = ("ring", "all_gather")  # sharding.context.VARIANTS
CONTEXT_ORDERS = ("auto", "documents", "zigzag", "contiguous")  # sharding.context_order.ORDERS
MATMUL_PRECISIONS = ("default", "int8", "fp8", "int8_weight_only")  # jaxlm.quantized
LAYER_CLASSES = ("attention", "mlp", "lm_head")  # the matmuls a precision is set for
QUANT_SCALINGS = ("delayed", "current")
QUANT_BACKWARDS = ("quantized", "e4m3", "high")
MATMUL_IMPLS = ("auto", "pallas", "xla")  # pallas_kernels.quantized_matmul
OPTIMIZERS = ("adamw", "sgd")
ROPE_SCALINGS = ("none", "llama3")  # jaxlm.model.rope_frequencies
FLOAT32_MAX = 3.4028234663852886e38  # what the optimizer's hyperparameters become on the device


@dataclass(frozen=True)
class ModelConfig(Section):
    # 0: the data's tokenizer's vocabulary rounded up to a multiple of VOCAB_MULTIPLE, so `vocab` shards over
    # `tensor` (jaxlm.run_data.resolve_vocab fills it in before the run starts)
    vocab_size: int = 0
    tokenizer_vocab_size: int = 0  # ids >= this are padding, never predicted (logits -inf); 0: every id is a token
    d_model: int = 256
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0  # 0 -> d_model // num_heads
    mlp_dim: int = 1024  # SwiGLU hidden size
    max_seq_len: int = 256
    rope_theta: float = 10_000.0
    # "llama3": Llama 3.1's long-context RoPE (low frequencies slowed by rope_scaling_factor, high ones kept, a smooth
    # ramp between), the rope type Hugging Face calls llama3; the four numbers below apply only to it.
    rope_scaling: str = "none"  # none | llama3
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192  # the context length the model was pretrained at, before scaling
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    dtype: str = "float32"  # activation/compute dtype; params are always float32
    # lax.scan over the stacked layers: compile time flat in depth, for deep models. Off by default: unrolled layers
    # train faster (1.06x the gpt-bench step on CPU: no stacked residual buffers) and compile quickly when shallow.
    scan_layers: bool = False
    scan_unroll: int = 1  # lax.scan unroll factor; num_layers == fully unrolled
    remat: str = "none"  # per-layer rematerialisation: REMAT_CHOICES (jaxlm.model.REMAT_POLICIES)
    # auto (the fastest measured for the platform and mask: jaxlm.attention.auto_impl) | reference | jax |
    # xla_blocksparse | pallas (jaxlm.attention)
    attention_impl: str = "auto"
    attention_mask: str = "causal"  # a mask spec, e.g. "causal & sliding_window(128)" or "causal & document"
    # tile sizes of the block-sparse implementations (`auto` on a CPU takes 64 up to 256 positions: auto_block_sizes)
    attention_block_q: int = 128
    attention_block_kv: int = 128
    attention_softcap: float = 0.0  # > 0: cap * tanh(score / cap) on attention logits (Gemma 2 style)
    # False: pallas on Hopper sums dQ across its backward's programs (5 matrix products a score pair, not 7), in no
    # fixed order, so gradients differ in their last bits from run to run (pallas_kernels.block_sparse_attention)
    attention_deterministic: bool = True
    qk_norm: bool = False  # RMSNorm over each head's query and key before RoPE (Qwen3, OLMo 2): steadier logits
    # under a `context` mesh axis: ring (K/V shards passed around, two in memory) | all_gather (the whole sequence's
    # K/V on every device, one collective) (sharding.context)
    context_parallel: str = "ring"
    # how a row's tokens are dealt to the context axis: auto | documents (per row, by its packed documents' cost) |
    # zigzag (evens out one causal row) | contiguous (keeps a sliding window local) (sharding.context_order)
    context_order: str = "auto"
    # Low-precision matmuls (jaxlm.quantized): "fp8", or per layer class "attention=fp8,mlp=fp8,lm_head=default";
    # precisions default | int8 | fp8 | int8_weight_only.
    matmul_precision: str = "default"
    quant_scaling: str = "delayed"  # delayed (per-tensor, amax history) | current (per row / per channel)
    # quantized (dY in e5m2 / int8) | e4m3 (fp8's dY in e4m3: on Hopper the backward runs on the Mosaic GPU kernel
    # too) | high (backward in the compute dtype)
    quant_backward: str = "quantized"
    quant_amax_history: int = 16  # steps of amax history for delayed scaling
    matmul_impl: str = "auto"  # auto (Pallas kernel on one TPU, else XLA) | pallas | xla
    # Mixture of experts (jaxlm.moe): 0 experts is a dense model. Every moe_every-th layer's MLP (the rest: dense,
    # mlp_dim) is then num_experts SwiGLU experts of expert_mlp_dim, experts_per_token of them per token, plus
    # num_shared_experts always on.
    num_experts: int = 0
    moe_every: int = 1  # layers k-1, 2k-1, ... are MoE (Qwen3-MoE's decoder_sparse_step, Llama 4's interleave step)
    experts_per_token: int = 2
    num_shared_experts: int = 0
    expert_mlp_dim: int = 256
    router: str = "softmax"  # softmax (Mixtral, Qwen3-MoE) | sigmoid_bias (DeepSeek-V3's load-steering bias)
    router_norm_topk: bool = True  # softmax: renormalize the top-k weights to sum to 1 (Mixtral; Qwen3-MoE's flag)
    router_bias_rate: float = 1e-3  # sigmoid_bias: how far each step moves an expert's bias toward uniform load
    moe_aux_loss: float = 0.01  # the Switch / Mixtral load-balancing loss's weight (0: none)
    moe_z_loss: float = 0.001  # the router z-loss's weight (0: none)
    capacity_factor: float = 0.0  # 0: dropless; > 0: each expert takes ceil(f * tokens * k / experts), drops the rest

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers // self.moe_every if self.num_experts else 0

    def is_moe_layer(self, i: int) -> bool:
        """Layer i's MLP is a mixture of experts: the last of every moe_every layers."""
        return bool(self.num_experts) and (i + 1) % self.moe_every == 0

    def layer_slot(self, i: int) -> tuple[str, int]:
        """Where layer i's params are stacked: ("blocks", i), or in a model with dense layers between its MoE ones
        ("moe_blocks", its index among the MoE layers) / ("blocks", its index among the dense ones)."""
        k = self.moe_every
        if not self.num_experts or k == 1:
            return "blocks", i
        return ("moe_blocks", i // k) if self.is_moe_layer(i) else ("blocks", i - i // k)

    @property
    def keeps_amax_history(self) -> bool:
        """Some matmul is quantized (not weight-only) with delayed scaling, so the state holds amax histories."""
        precisions = parse_matmul_precision(self.matmul_precision).values()
        return self.quant_scaling == "delayed" and any(p in ("int8", "fp8") for p in precisions)

    def validate(self, run=None) -> None:
        m = self
        check_non_negative(model__vocab_size=m.vocab_size, model__tokenizer_vocab_size=m.tokenizer_vocab_size)
        if m.vocab_size and m.tokenizer_vocab_size > m.vocab_size:
            raise ConfigError(
                f"model.vocab_size {m.vocab_size} is smaller than the tokenizer's {m.tokenizer_vocab_size} ids; "
                f"raise it, or leave it 0 to follow the tokenizer"
            )
        check_positive(
            model__d_model=m.d_model,
            model__num_layers=m.num_layers,
            model__num_heads=m.num_heads,
            model__num_kv_heads=m.num_kv_heads,
            model__mlp_dim=m.mlp_dim,
            model__max_seq_len=m.max_seq_len,
            model__scan_unroll=m.scan_unroll,
            model__attention_block_q=m.attention_block_q,
            model__attention_block_kv=m.attention_block_kv,
            model__quant_amax_history=m.quant_amax_history,
        )
        check_non_negative(model__head_dim=m.head_dim, model__attention_softcap=m.attention_softcap)
        if m.rope_theta <= 0:  # rope_theta ** -x: 0 gives infinite frequencies, a negative one NaN
            raise ConfigError(f"model.rope_theta must be positive (RoPE's base; 10000 is usual), got {m.rope_theta}")
        if m.norm_eps < 0:  # rsqrt(mean(x^2) + eps) of a negative number is NaN
            raise ConfigError(f"model.norm_eps must be >= 0 (RMSNorm's epsilon; 1e-5 is usual), got {m.norm_eps}")
        if m.head_dim == 0 and m.d_model % m.num_heads:
            raise ConfigError(
                f"model.d_model ({m.d_model}) must be divisible by model.num_heads ({m.num_heads}) or "
                f"set model.head_dim"
            )
        if m.resolved_head_dim % 2:
            raise ConfigError(f"head dim must be even for rotary embeddings, got {m.resolved_head_dim}")
        if m.num_heads % m.num_kv_heads:
            raise ConfigError(
                f"model.num_heads ({m.num_heads}) must be divisible by model.num_kv_heads ({m.num_kv_heads})"
            )
        check_choice("model.rope_scaling", m.rope_scaling, ROPE_SCALINGS, how="comma")
        if m.rope_scaling == "llama3":
            check_positive(
                model__rope_scaling_factor=m.rope_scaling_factor,
                model__rope_low_freq_factor=m.rope_low_freq_factor,
                model__rope_original_max_seq_len=m.rope_original_max_seq_len,
            )
            if m.rope_high_freq_factor <= m.rope_low_freq_factor:
                raise ConfigError(
                    f"model.rope_high_freq_factor ({m.rope_high_freq_factor}) must exceed "
                    f"model.rope_low_freq_factor ({m.rope_low_freq_factor})"
                )
        if m.dtype not in DTYPES:
            raise ConfigError(f"model.dtype must be 'float32' or 'bfloat16', got {m.dtype!r}")
        check_choice("model.remat", m.remat, REMAT_CHOICES, how="sorted")
        check_choice("model.attention_impl", m.attention_impl, ATTENTION_IMPLS, how="sorted")
        check_choice("model.context_parallel", m.context_parallel, CONTEXT_PARALLEL, how="comma")
        check_choice("model.context_order", m.context_order, CONTEXT_ORDERS, how="comma")
        from pallas_kernels.mask_spec import parse_mask  # local: it imports jax, and loading a config must not

        try:
            mask = parse_mask(m.attention_mask)
        except ValueError as e:
            raise ConfigError(f"model.attention_mask: {e}") from None
        if m.context_order == "documents":
            from sharding.context_order import pick_order

            try:
                pick_order(mask, 2, "documents")
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if m.attention_impl == "jax" and m.attention_softcap:
            raise ConfigError(
                "model.attention_softcap needs attention_impl reference, xla_blocksparse or pallas; "
                "jax.nn.dot_product_attention takes no score mod"
            )
        try:
            parse_matmul_precision(m.matmul_precision)
        except ValueError as e:
            raise ConfigError(f"model.matmul_precision: {e}") from None
        check_choice("model.quant_scaling", m.quant_scaling, QUANT_SCALINGS, how="comma")
        check_choice("model.quant_backward", m.quant_backward, QUANT_BACKWARDS, how="comma")
        if m.quant_backward == "e4m3" and "fp8" not in parse_matmul_precision(m.matmul_precision).values():
            raise ConfigError(
                f"model.quant_backward=e4m3 sets fp8 matmuls' gradient dtype, and model.matmul_precision "
                f"{m.matmul_precision!r} has none; use quantized or high"
            )
        check_choice("model.matmul_impl", m.matmul_impl, MATMUL_IMPLS, how="comma")
        check_moe(m)


@functools.lru_cache(maxsize=32)
def parse_matmul_precision(spec: str) -> dict[str, str]:
    """'fp8' -> every class fp8; 'attention=fp8,mlp=int8' -> those, the rest 'default'. ValueError on bad specs."""
    spec = spec.strip()
    if "=" not in spec:
        if spec not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul precision {spec!r} is not one of {', '.join(MATMUL_PRECISIONS)}")
        return {c: spec for c in LAYER_CLASSES}
    out = dict.fromkeys(LAYER_CLASSES, "default")
    seen = set()
    for item in spec.split(","):
        cls, sep, precision = (part.strip() for part in item.partition("="))
        if not sep or cls not in LAYER_CLASSES:
            raise ValueError(
                f"matmul precision spec {spec!r}: {item.strip()!r} must be CLASS=PRECISION with CLASS one "
                f"of {', '.join(LAYER_CLASSES)}"
            )
        if precision not in MATMUL_PRECISIONS:
            raise ValueError(
                f"matmul precision spec {spec!r}: {precision!r} is not one of {', '.join(MATMUL_PRECISIONS)}"
            )
        if cls in seen:
            raise ValueError(f"matmul precision spec {spec!r} names {cls!r} twice")
        seen.add(cls)
        out[cls] = precision
    return out


@dataclass(frozen=True)
class OptimConfig(Section):
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

    def validate(self, run=None) -> None:
        o = self
        check_non_negative(
            optim__warmup_steps=o.warmup_steps,
            optim__decay_steps=o.decay_steps,
            optim__grad_clip=o.grad_clip,
            optim__weight_decay=o.weight_decay,
        )
        if o.learning_rate <= 0:
            raise ConfigError(f"optim.learning_rate must be positive, got {o.learning_rate}")
        for key, usual in (("learning_rate", "1e-4 to 1e-2"), ("weight_decay", "0 to 0.1")):
            if getattr(o, key) > FLOAT32_MAX:  # float32 inf: the first update makes every weight inf or NaN
                raise ConfigError(
                    f"optim.{key} {getattr(o, key):g} overflows float32 (largest {FLOAT32_MAX:.3g}), the precision "
                    f"the optimizer computes in: the first update would make the weights infinite; {usual} is usual"
                )
        for key in ("b1", "b2"):
            if not 0 <= getattr(o, key) < 1:  # b2 = 1: Adam's bias correction divides by 1 - b2**t = 0
                raise ConfigError(f"optim.{key} must be in [0, 1) (Adam's moment decay), got {getattr(o, key)}")
        if o.eps <= 0:
            raise ConfigError(
                f"optim.eps must be positive (Adam divides by sqrt(v) + eps, 0 where a gradient is 0), got {o.eps}"
            )
        if not 0 <= o.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
        check_choice("optim.optimizer", o.optimizer, OPTIMIZERS, how="comma")


# only the optimizer's kind shapes the saved state: a resumed run may change its schedule and hyperparameters
OptimConfig.RESUME_MAY_CHANGE = tuple(f.name for f in dataclasses.fields(OptimConfig) if f.name != "optimizer")


@dataclass(frozen=True)
class TrainConfig(Section):
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    steps: int = 200
    seed: int = 0
    log_every: int = 10
    eval_every: int = 50  # 0 disables periodic eval (a final eval still runs when a val split exists)
    # Text prompts, separated by "|": at each eval, greedy continuations of eval_sample_tokens tokens go to the run
    # log, metrics.jsonl ("eval_samples") and TensorBoard (text), so a user watches the model learn
    eval_prompts: str = ""
    eval_sample_tokens: int = 32
    # lm-evaluation-harness tasks (comma list; docs/lm_eval.md) run on the params every eval_harness_every steps and
    # at the last step (0: the last step only), logged as harness/<task>/<metric>; needs the eval extra
    eval_harness_tasks: str = ""
    eval_harness_every: int = 0
    eval_harness_limit: int = 0  # examples per task; 0: all of them
    eval_harness_include_path: str = ""  # a directory of your own task YAML files
    checkpoint_every: int = 50
    checkpoint_minutes: float = 0.0  # also checkpoint when this many minutes passed since the last save; 0: off
    keep_checkpoints: int = 3
    max_bad_steps: int = 10  # stop after this many consecutive steps with a non-finite loss or gradient (skipped)
    async_checkpointing: bool = True
    tensorboard: bool = True

    def sections(self) -> dict[str, Section]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Section)
        }

    def validate(self, run=None) -> None:
        check_positive(
            steps=self.steps,
            log_every=self.log_every,
            keep_checkpoints=self.keep_checkpoints,
            max_bad_steps=self.max_bad_steps,
        )
        check_non_negative(
            eval_sample_tokens=self.eval_sample_tokens,
            eval_every=self.eval_every,
            eval_harness_every=self.eval_harness_every,
            eval_harness_limit=self.eval_harness_limit,
            checkpoint_every=self.checkpoint_every,
            seed=self.seed,
            checkpoint_minutes=self.checkpoint_minutes,
        )
        for section in self.sections().values():
            section.validate(self)

    def check_evaluation(self) -> None:
        """The evaluations and samples the run is asked for can happen: ConfigError naming the keys otherwise
        (training would skip them silently). Not part of `validate`: a saved config a model is read from for
        generation or export need not pass it."""
        d = self.data
        prompts = [p for p in self.eval_prompts.split("|") if p]
        samples = bool(prompts and self.eval_sample_tokens)
        empty = [f"data.val_fraction is {d.val_fraction:g}"] * (d.val_fraction == 0)
        empty += [f"data.eval_batches is {d.eval_batches}"] * (d.eval_batches == 0)
        asked = [f"eval_every {self.eval_every}"] * bool(self.eval_every)
        asked += [f"eval_prompts {self.eval_prompts!r}"] * samples
        if empty and asked:
            fix = ["data.val_fraction above 0 (e.g. 0.01)"] * (d.val_fraction == 0)
            fix += ["data.eval_batches >= 1"] * (d.eval_batches == 0)
            off = ["eval_every=0"] * bool(self.eval_every) + ["eval_prompts="] * samples
            raise ConfigError(
                f"{' and '.join(asked)} ask{'s' * (len(asked) == 1)} for evaluation, but {' and '.join(empty)}: "
                f"nothing would be evaluated; set {' and '.join(fix)}, or {' and '.join(off)} to train without "
                f"evaluating"
            )
        if samples and self.eval_sample_tokens > self.model.max_seq_len:
            raise ConfigError(
                f"eval_sample_tokens {self.eval_sample_tokens} exceeds model.max_seq_len {self.model.max_seq_len}: "
                f"the eval samples would run past the model's length; lower eval_sample_tokens (a prompt and its "
                f"sample fit in {self.model.max_seq_len} tokens), or set eval_prompts= for no samples"
            )


# ----------------------------------------------------------------------------- loading


def load_config(path: str | Path) -> TrainConfig:
    """Executes a Python config file and returns its `config` (an instance or a zero-arg function), or reads a
    run's resolved config.json (fields it lacks keep their defaults).

    Field types are checked here, so a wrong one names the file even when a flag overrides that field."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.suffix not in (".py", ".json"):
        raise ConfigError(f"config file {path} must be a Python file (.py) or a run's config.json (.json)")
    cfg = _from_json(path) if path.suffix == ".json" else _from_python(path)
    _check_types(cfg, "", where=f"config file {path}:")
    return cfg


def _from_python(path: Path) -> TrainConfig:
    module = exec_python_file(path, "config", ConfigError)
    if not hasattr(module, "config"):
        raise ConfigError(f"config file {path} must define `config` (a TrainConfig or a function returning one)")
    cfg = module.config
    if callable(cfg) and not isinstance(cfg, TrainConfig):
        cfg = call_user_function(cfg, path=path, kind="config", error=ConfigError)
    if not isinstance(cfg, TrainConfig):
        raise ConfigError(f"config file {path}: `config` is a {type(cfg).__name__}, expected TrainConfig")
    return cfg


# ----------------------------------------------------------------------------- validation


def validate(cfg: TrainConfig) -> TrainConfig:
    """Checks types, then each section's fields and cross-field rules; raises ConfigError naming the first problem."""
    _check_types(cfg, "")
    cfg.validate()
    return cfg


def validate_training(cfg: TrainConfig) -> TrainConfig:
    """`validate`, plus what only a run about to train needs (TrainConfig.check_evaluation)."""
    validate(cfg)
    cfg.check_evaluation()
    return cfg


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


DATA_FINGERPRINT_KEY = "data_fingerprint"  # saved beside the config in each checkpoint (jaxlm.trainer)
TOKENIZER_KEY = "tokenizer"  # the run's tokenizer (TextTokenizer.describe()), saved beside it too
SAVED_BESIDE_CONFIG = (DATA_FINGERPRINT_KEY, TOKENIZER_KEY)
VOCAB_MULTIPLE = 128


def _from_json(path: Path) -> TrainConfig:
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"config file {path} is not valid JSON: {e}") from None
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror}") from None
    return _dataclass_from(TrainConfig, data, "", f"config file {path}")


def _dataclass_from(cls, data: Any, prefix: str, where: str):
    """``cls`` built from a dict (a JSON object), field by field, nested sections too; an unknown key or a
    non-object is one ConfigError naming `where` the data came from. Fields it lacks keep their defaults."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {prefix.rstrip('.') or 'the file'} must be a JSON object")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ConfigError(f"{where}: unknown field {prefix}{key}{hint}")
        hint_type = hints[key]
        kwargs[key] = (
            _dataclass_from(hint_type, value, f"{prefix}{key}.", where)
            if dataclasses.is_dataclass(hint_type)
            else value
        )
    return cls(**kwargs)


def from_dict(data: dict, where: str = "config") -> TrainConfig:
    """A config from `to_dict`'s output (a checkpoint's saved config, whose data fingerprint is not config)."""
    data = {k: v for k, v in data.items() if k not in SAVED_BESIDE_CONFIG}
    return _dataclass_from(TrainConfig, data, "", where)
