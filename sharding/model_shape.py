"""What the planner knows of a model: its shape (ModelShape, the Llama presets), its parameters with their logical
axes, and how many of them one device holds under a layout's rules (sharded, or FSDP-gathered). The memory model
and the planner both count from here."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from sharding.mesh import LayoutError, MeshLayout
from sharding.rules import dividing_axes, logical_spec, rules_key


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know of a model. `jaxlm.config.ModelConfig` has these fields too, so either is
    accepted wherever a ModelShape is; `from_config` copies them from any object that has them."""

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    mlp_dim: int
    head_dim: int = 0  # 0 -> d_model // num_heads
    tie_embeddings: bool = True
    dtype: str = "float32"  # the compute dtype: float32 | bfloat16
    attention_impl: str = "reference"  # reference keeps T x T residuals, jax too but on a GPU (keeps_scores)
    remat: str = "none"
    context_parallel: str = "ring"  # under a context axis: ring (two K/V shards in hand) | all_gather (all of them)
    qk_norm: bool = False  # per-head query / key RMSNorm scales (Qwen3)
    # mixture of experts (jaxlm.moe): 0 experts is dense; else every layer's MLP is num_experts experts of
    # expert_mlp_dim, experts_per_token chosen per token, plus num_shared_experts always on
    num_experts: int = 0
    moe_every: int = 1  # experts in layers k-1, 2k-1, ...; the rest dense
    experts_per_token: int = 2
    expert_mlp_dim: int = 0
    num_shared_experts: int = 0
    capacity_factor: float = 0.0  # 0: dropless; > 0: each expert's slots per device (sharding.experts)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def num_moe_layers(self) -> int:  # as jaxlm.config.ModelConfig's
        return self.num_layers // self.moe_every if self.num_experts else 0

    @classmethod
    def from_config(cls, model) -> "ModelShape":
        missing = [f.name for f in dataclasses.fields(cls) if not hasattr(model, f.name)]
        if missing:
            raise LayoutError(f"a {type(model).__name__} is not a model config: it has no {', '.join(missing)}")
        return cls(**{f.name: getattr(model, f.name) for f in dataclasses.fields(cls)})


_LLAMA = dict(vocab_size=32000, tie_embeddings=False, dtype="bfloat16", attention_impl="pallas")
_LLAMA3 = dict(_LLAMA, vocab_size=128256, remat="full")
MODEL_PRESETS = {  # Llama-2 shapes; bf16 compute with flash attention (no T x T residuals), as one trains them
    "7b": ModelShape(d_model=4096, num_layers=32, num_heads=32, num_kv_heads=32, mlp_dim=11008, **_LLAMA),
    "13b": ModelShape(d_model=5120, num_layers=40, num_heads=40, num_kv_heads=40, mlp_dim=13824, **_LLAMA),
    "70b": ModelShape(d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8, mlp_dim=28672, **_LLAMA),
    # Llama 3 shapes (3.2 1B, 3.1 8B / 70B / 405B): a 128,256-token vocabulary, 8 kv heads
    "llama3-1b": ModelShape(
        d_model=2048, num_layers=16, num_heads=32, num_kv_heads=8, mlp_dim=8192, **{**_LLAMA3, "tie_embeddings": True}
    ),
    "llama3-8b": ModelShape(d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8, mlp_dim=14336, **_LLAMA3),
    "llama3-70b": ModelShape(d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8, mlp_dim=28672, **_LLAMA3),
    "llama3-405b": ModelShape(d_model=16384, num_layers=126, num_heads=128, num_kv_heads=8, mlp_dim=53248, **_LLAMA3),
    # mixtures of experts: Mixtral 8x7B (46.7B params, 12.9B active), Qwen3-30B-A3B (30.5B, 3.3B active)
    "mixtral-8x7b": ModelShape(
        d_model=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        mlp_dim=14336,
        num_experts=8,
        experts_per_token=2,
        expert_mlp_dim=14336,
        **{**_LLAMA, "remat": "full"},
    ),
    "qwen3-30b-a3b": ModelShape(
        d_model=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        mlp_dim=6144,
        qk_norm=True,
        num_experts=128,
        experts_per_token=8,
        expert_mlp_dim=768,
        **{**_LLAMA, "vocab_size": 151936, "remat": "full"},
    ),
}
# RoPE base of the presets that differ from Llama 3's 500,000 (jaxlm's compile of a preset takes it from here)
PRESET_ROPE_THETA = {"7b": 10_000.0, "13b": 10_000.0, "70b": 10_000.0, "mixtral-8x7b": 1e6, "qwen3-30b-a3b": 1e6}


# ----------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, as jaxlm.model tags them


@functools.lru_cache(maxsize=64)  # the planner counts the same model's parameters for every layout it weighs
def param_specs(cfg: ModelShape) -> tuple[ParamSpec, ...]:
    """jaxlm.model's parameters: fused wqkv [D, K, G+2, E], wo [H, E, D], SwiGLU w_in [D, 2, F] and w_out [F, D],
    RMSNorm scales, stacked over a leading `layers` axis; embedding [V, D]; lm_head [D, V] unless tied."""
    D, V, L, H, K, F, E = (
        cfg.d_model,
        cfg.vocab_size,
        cfg.num_layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.mlp_dim,
        cfg.resolved_head_dim,
    )
    specs = [ParamSpec("embed", (V, D), ("vocab", "embed")), ParamSpec("final_norm.scale", (D,), ("embed",))]
    moe_layers = cfg.num_moe_layers
    # one stack of every layer, or with dense layers between MoE ones (moe_every > 1) `blocks` and `moe_blocks`
    stacks = [("blocks", L, moe_layers == L)] if moe_layers in (0, L) else [("blocks", L - moe_layers, False)]
    if 0 < moe_layers < L:
        stacks.append(("moe_blocks", moe_layers, True))
    for stack, n, moe in stacks:
        specs += [
            ParamSpec(f"{stack}.attn_norm.scale", (n, D), ("layers", "embed")),
            ParamSpec(
                f"{stack}.attn.wqkv", (n, D, K, H // K + 2, E), ("layers", "embed", "kv_heads", None, "head_dim")
            ),
            ParamSpec(f"{stack}.attn.wo", (n, H, E, D), ("layers", "heads", "head_dim", "embed")),
            ParamSpec(f"{stack}.mlp_norm.scale", (n, D), ("layers", "embed")),
        ]
        if cfg.qk_norm:
            specs += [
                ParamSpec(f"{stack}.attn.{q}.scale", (n, E), ("layers", "head_dim")) for q in ("q_norm", "k_norm")
            ]
        specs += _moe_specs(cfg, stack, n) if moe else [
            ParamSpec(f"{stack}.mlp.w_in", (n, D, 2, F), ("layers", "embed", None, "mlp")),
            ParamSpec(f"{stack}.mlp.w_out", (n, F, D), ("layers", "mlp", "embed")),
        ]  # fmt: skip
    if not cfg.tie_embeddings:
        specs.append(ParamSpec("lm_head", (D, V), ("embed", "vocab")))
    return tuple(specs)


def _moe_specs(cfg: ModelShape, stack: str, n: int) -> list[ParamSpec]:
    """jaxlm.moe.MoE's params: the router, the stacked experts, the shared experts fused into one SwiGLU."""
    D, X, F, S = cfg.d_model, cfg.num_experts, cfg.expert_mlp_dim, cfg.num_shared_experts * cfg.expert_mlp_dim
    specs = [
        ParamSpec(f"{stack}.mlp.router", (n, D, X), ("layers", "embed", None)),
        ParamSpec(f"{stack}.mlp.w_in", (n, X, D, 2, F), ("layers", "expert", "embed", None, "mlp")),
        ParamSpec(f"{stack}.mlp.w_out", (n, X, F, D), ("layers", "expert", "mlp", "embed")),
    ]
    if S:
        specs += [
            ParamSpec(f"{stack}.mlp.shared_in", (n, D, 2, S), ("layers", "embed", None, "mlp")),
            ParamSpec(f"{stack}.mlp.shared_out", (n, S, D), ("layers", "mlp", "embed")),
        ]
    return specs


def count_params(cfg: ModelShape) -> int:
    return sum(math.prod(p.shape) for p in param_specs(cfg))


def active_params(cfg: ModelShape) -> int:
    """Params one token's forward multiplies by: an MoE layer's unchosen experts do not count (the FLOPs' N)."""
    return count_params(cfg) - cfg.num_moe_layers * (cfg.num_experts - cfg.experts_per_token) * expert_params(cfg)


def expert_params(cfg: ModelShape) -> int:
    """One expert's SwiGLU weights (gate, up, down)."""
    return 3 * cfg.d_model * cfg.expert_mlp_dim


def _mesh_axes(target) -> tuple[str, ...]:
    """A PartitionSpec entry (None, an axis, or a tuple of axes) -> its mesh axes."""
    return tuple(a for a in (target if isinstance(target, tuple) else (target,)) if a)


def logical_shards(logical: str, layout: MeshLayout) -> int:
    """Ways the layout's rules split a dimension named `logical` (sharding.rules.logical_spec decides)."""
    return math.prod(layout.axis_sizes[a] for a in _mesh_axes(logical_spec((logical,), layout.rules)[0]))


def expert_hidden_shards(cfg: ModelShape, layout: MeshLayout) -> int:
    """Ways sharding.experts splits each expert's hidden width: over the `mlp` rule's mesh axes (tensor) that split
    neither the tokens nor the experts, while they divide it. Every rank of an axis not among them computes whole
    experts over the same tokens."""
    taken = {a for name in ("batch", "seq", "expert") for a in _mesh_axes(logical_spec((name,), layout.rules)[0])}
    free = [a for a in _mesh_axes(logical_spec(("mlp",), layout.rules)[0]) if a not in taken]
    return math.prod(layout.axis_sizes[a] for a in dividing_axes(layout.axis_sizes, free, cfg.expert_mlp_dim))


def _local_size(spec: ParamSpec, layout: MeshLayout, skip: tuple[str, ...] = ()) -> int:
    """Elements of `spec` on one device (ignoring mesh axes `skip`, e.g. FSDP's for the all-gathered size)."""
    sizes = {**layout.axis_sizes, **dict.fromkeys(skip, 1)}
    return math.prod(
        -(-n // math.prod(sizes[a] for a in _mesh_axes(t)))
        for n, t in zip(spec.shape, logical_spec(spec.axes, layout.rules))
    )


def _in_group(spec: ParamSpec, cfg: ModelShape, group: str | None) -> bool:
    """group None: every param; "layers": the stacked layers; "experts": the MoE layers' experts; "head": what the
    loss head reads (final norm and lm_head, or the embedding when tied)."""
    if group == "layers":
        return "layers" in spec.axes
    if group == "experts":
        return "expert" in spec.axes
    if group == "head":
        return spec.name in ("final_norm.scale", "lm_head") or (cfg.tie_embeddings and spec.name == "embed")
    return True


def _per_layout(count):
    """Memoizes a count by the model, what the layout's split depends on (its axis sizes and rules) and the group:
    the planner asks the same counts of many layouts that differ only in schedule or microbatches."""
    cache: dict = {}

    @functools.wraps(count)
    def memoized(cfg: ModelShape, layout: MeshLayout, group: str | None = None) -> int:
        rules = rules_key(layout.rules)
        if rules is None:  # a rule that cannot be hashed (a list): counted, not kept
            return count(cfg, layout, group)
        key = (cfg, tuple(layout.axis_sizes.items()), rules, group)
        if key not in cache:
            if len(cache) >= 4096:
                cache.clear()
            cache[key] = count(cfg, layout, group)
        return cache[key]

    return memoized


@_per_layout
def params_per_device(cfg: ModelShape, layout: MeshLayout, group: str | None = None) -> int:
    return sum(_local_size(p, layout) for p in param_specs(cfg) if _in_group(p, cfg, group))


def fsdp_axes(layout: MeshLayout) -> tuple[str, ...]:
    """The mesh axes params are gathered over before use (the `embed` rule's: fsdp, and context when the layout
    has one), those of size > 1."""
    return tuple(a for a in _mesh_axes(logical_spec(("embed",), layout.rules)[0]) if layout.axis_sizes[a] > 1)


def fsdp_size(layout: MeshLayout) -> int:
    """Devices one FSDP gather spans."""
    return math.prod(layout.axis_sizes[a] for a in fsdp_axes(layout))


@_per_layout
def largest_gathered_param(cfg: ModelShape, layout: MeshLayout, group: str | None = None) -> int:
    """The largest single array (one layer's slice of a stacked one) one device all-gathers over its FSDP ring."""
    axes = fsdp_axes(layout)
    if not axes:
        return 0
    one_layer = [
        dataclasses.replace(p, shape=(1, *p.shape[1:])) if "layers" in p.axes else p
        for p in param_specs(cfg)
        if any(_on_mesh_axis(p, layout, a) for a in axes) and _in_group(p, cfg, group)
    ]
    return max((_local_size(p, layout, skip=axes) for p in one_layer), default=0)


def _on_mesh_axis(spec: ParamSpec, layout: MeshLayout, mesh_axis: str) -> bool:
    return any(mesh_axis in _mesh_axes(t) for t in logical_spec(spec.axes, layout.rules))


@_per_layout
def fsdp_gathered_params(cfg: ModelShape, layout: MeshLayout, group: str | None = None) -> int:
    """Params one device all-gathers over its FSDP ring: its tensor/pipeline slice of every FSDP-sharded array."""
    axes = fsdp_axes(layout)
    if not axes:
        return 0
    return sum(
        _local_size(p, layout, skip=axes)
        for p in param_specs(cfg)
        if any(_on_mesh_axis(p, layout, a) for a in axes) and _in_group(p, cfg, group)
    )
