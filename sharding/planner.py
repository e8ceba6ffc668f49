"""Parallelism cost planner: every mesh layout of N devices, its memory per device and its step time, ranked.

Formulas, not profiling, so each number can be checked by hand:

* memory: fp32 params, fp32 grads and AdamW's two fp32 moments (16 bytes per param), each sharded as the
  logical-axis rules say; the activations reverse-mode autodiff keeps per layer (`layer_residual_bytes`), for the
  microbatches a pipeline schedule keeps live; fp32 logits; one layer's backward working set. Each layout gets the
  fewest gradient-accumulation microbatches that make it fit. The loss's and a layer's working sets follow the XLA
  program of the hardware's platform where they differ (GPU: measured against deviceless H100 compiles,
  docs/scale.md); CPU's rules serve TPU too until TPU's are measured.
* compute: (6 N + attention) FLOPs per token / (devices x achievable FLOP/s), x 4/3 where the forward is recomputed,
  / (1 - bubble) with pipelining: bubble = (S - 1) / (M + S - 1) for S stages and M microbatches.
* communication, ring collectives (bandwidth terms, in the compute dtype) at the bandwidth of the link the axis
  spans (inside a node or across): FSDP all-gathers (forward, backward) + gradient reduce-scatter, and the DP
  gradient all-reduce, overlap with compute; tensor-parallel activation all-reduces (2 forward + 2 backward per
  layer, 2 more when the forward is recomputed) and pipeline sends do not.  step = max(compute, FSDP + DP) + TP + PP.

Not modelled: collective latency, the embedding's and the loss's small vocab-parallel all-reduces, imperfect
overlap, kernel efficiency changing with microbatch size (all absorbed into the hardware's assumed MFU).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from sharding.hardware import Hardware
from sharding.mesh import LayoutError, MeshLayout
from sharding.pipeline import bubble_fraction, stash_slots
from sharding.rules import logical_spec

FSDP_COLLECTIVES = 3  # all-gather for the forward, again for the backward, reduce-scatter of the gradients
REMAT_CHOICES = ("none", "full")


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
    attention_impl: str = "reference"  # reference / jax keep T x T residuals; the block-sparse ones do not
    remat: str = "none"

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

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
}


# ----------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, as jaxlm.model tags them


def param_specs(cfg: ModelShape) -> list[ParamSpec]:
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
    specs = [
        ParamSpec("embed", (V, D), ("vocab", "embed")),
        ParamSpec("blocks.attn_norm.scale", (L, D), ("layers", "embed")),
        ParamSpec("blocks.attn.wqkv", (L, D, K, H // K + 2, E), ("layers", "embed", "kv_heads", None, "head_dim")),
        ParamSpec("blocks.attn.wo", (L, H, E, D), ("layers", "heads", "head_dim", "embed")),
        ParamSpec("blocks.mlp_norm.scale", (L, D), ("layers", "embed")),
        ParamSpec("blocks.mlp.w_in", (L, D, 2, F), ("layers", "embed", None, "mlp")),
        ParamSpec("blocks.mlp.w_out", (L, F, D), ("layers", "mlp", "embed")),
        ParamSpec("final_norm.scale", (D,), ("embed",)),
    ]
    if not cfg.tie_embeddings:
        specs.append(ParamSpec("lm_head", (D, V), ("embed", "vocab")))
    return specs


def count_params(cfg: ModelShape) -> int:
    return sum(math.prod(p.shape) for p in param_specs(cfg))


def _mesh_axes(target) -> tuple[str, ...]:
    """A PartitionSpec entry (None, an axis, or a tuple of axes) -> its mesh axes."""
    return tuple(a for a in (target if isinstance(target, tuple) else (target,)) if a)


def _shards(logical: str, layout: MeshLayout) -> int:
    """Ways the layout's rules split a dimension named `logical` (sharding.rules.logical_spec decides)."""
    return math.prod(layout.axis_sizes[a] for a in _mesh_axes(logical_spec((logical,), layout.rules)[0]))


def _local_size(spec: ParamSpec, layout: MeshLayout, skip: str | None = None) -> int:
    """Elements of `spec` on one device (ignoring mesh axis `skip`, e.g. 'fsdp' for the all-gathered size)."""
    sizes = {**layout.axis_sizes, **({skip: 1} if skip else {})}
    return math.prod(
        -(-n // math.prod(sizes[a] for a in _mesh_axes(t)))
        for n, t in zip(spec.shape, logical_spec(spec.axes, layout.rules))
    )


def _in_group(spec: ParamSpec, cfg: ModelShape, group: str | None) -> bool:
    """group None: every param; "layers": the stacked layers; "head": what the loss head reads (final norm and
    lm_head, or the embedding when tied)."""
    if group == "layers":
        return "layers" in spec.axes
    if group == "head":
        return spec.name in ("final_norm.scale", "lm_head") or (cfg.tie_embeddings and spec.name == "embed")
    return True


def params_per_device(cfg: ModelShape, layout: MeshLayout, group: str | None = None) -> int:
    return sum(_local_size(p, layout) for p in param_specs(cfg) if _in_group(p, cfg, group))


def _on_mesh_axis(spec: ParamSpec, layout: MeshLayout, mesh_axis: str) -> bool:
    return any(mesh_axis in _mesh_axes(t) for t in logical_spec(spec.axes, layout.rules))


def fsdp_gathered_params(cfg: ModelShape, layout: MeshLayout, group: str | None = None) -> int:
    """Params one device all-gathers over its FSDP ring: its tensor/pipeline slice of every FSDP-sharded array."""
    if layout.fsdp == 1:
        return 0
    return sum(
        _local_size(p, layout, skip="fsdp")
        for p in param_specs(cfg)
        if _on_mesh_axis(p, layout, "fsdp") and _in_group(p, cfg, group)
    )


# ----------------------------------------------------------------------------- memory


def dtype_bytes(cfg: ModelShape) -> int:
    return {"float32": 4, "bfloat16": 2}[cfg.dtype]


def layer_residual_bytes(cfg: ModelShape, seq_len: int, tensor: int = 1) -> float:
    """Bytes per token one transformer layer keeps from its forward for its backward (no remat), on one device of
    a `tensor`-way split: what jax's reverse mode saves for this block (`jax.ad_checkpoint.print_saved_residuals`),
    minus what no backward rule reads (the masked scores, the boolean mask), which XLA drops.

    - each RMSNorm: its input and the normalised x in fp32, its output (compute dtype), rsqrt and mean (fp32)
    - dense attention (reference / jax): q, k, v and the attention output, the fp32 exp and the (compute dtype)
      probabilities of every query x key pair, the softmax max and sum; flash-style kernels (xla_blocksparse /
      pallas): q, k, v and the output in the kernel's [B, H, T, E] layout, the log-sum-exp, and the output again as
      the output projection's input
    - SwiGLU: the gate and up halves, sigmoid and silu of the gate (silu's derivative), silu(gate) * up
    Heads and the MLP hidden size split over `tensor`; d_model-sized tensors are replicated across it.
    """
    cb = dtype_bytes(cfg)
    D, E = cfg.d_model, cfg.resolved_head_dim
    h, k, f = cfg.num_heads / tensor, cfg.num_kv_heads / tensor, cfg.mlp_dim / tensor
    norms = 2 * (D * (4 + 4 + cb) + 2 * 4)
    if cfg.attention_impl in ("reference", "jax"):
        attention = (2 * h + 2 * k) * E * cb + h * seq_len * (4 + cb) + 2 * h * 4
    else:
        attention = (3 * h + 2 * k) * E * cb + h * 4
    mlp = 6 * f * cb
    return norms + attention + mlp


@dataclass(frozen=True)
class Memory:
    """Peak bytes on one device (a pipeline's last stage: it also holds the logits).

    The step has two high-water marks on top of the state, the grads and the kept activations: the loss (fp32
    logits and their cotangent) and the backward of one layer (its residuals, sliced out of the scan's stack or
    recomputed, while its cotangents are formed); the peak is the larger of the two.
    """

    params: float
    grads: float
    optimizer: float
    activations: float  # residuals kept for the backward, over the layers and microbatches live at once
    loss_phase: float  # fp32 logits and their cotangent for one microbatch, the FSDP-gathered head and its grads
    layer_phase: float  # one layer's backward: its residuals, plus its FSDP-gathered weights and full-size grads
    other: float  # the batch, compute-dtype weight copies, gradient accumulators, pipeline buffers

    @property
    def state(self) -> float:
        return self.params + self.optimizer

    @property
    def total(self) -> float:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.activations
            + self.other
            + max(self.loss_phase, self.layer_phase)
        )


def memory_per_device(
    cfg: ModelShape,
    layout: MeshLayout,
    batch_sequences: int,
    seq_len: int,
    remat: str = "none",
    accumulation: int = 1,
    platform: str = "cpu",
) -> Memory:
    """Peak bytes per device of one train step of `accumulation` gradient-accumulation microbatches (each split
    into the layout's pipeline microbatches). Rule for scans (layers, pipeline ticks, accumulation): the forward
    stacks every step's residuals, the backward of a step holds that step's residuals sliced out of the stack, and
    the gradient of a loop constant (params) is formed per step, then added to an accumulator.

    Not counted: the cotangents formed inside one layer's backward (on CPU, XLA's peak runs 0.1-0.4 of a layer's
    residuals above this estimate; more under remat), XLA's scratch and the runtime's own memory.

    ``platform`` "gpu" follows XLA's GPU program (Llama 3 8B / 70B / 405B on 64-1024 H100s, seq 8k-128k: 0.95-1.00x
    of its memory but two 405B rows, 2026-11-25): it keeps the logits once in fp32 and once in the compute dtype,
    gathers the head and each layer's weights in the compute dtype and reduce-scatters their gradients in it, and
    keeps no sharded compute-dtype copy of the weights. "cpu" (and, for now, "tpu") keep two fp32 logits, fp32
    gradients of the gathered weights and that copy.
    """
    cb = dtype_bytes(cfg)
    n_params = params_per_device(cfg, layout)
    S, M = layout.pipeline, layout.num_microbatches
    rows = batch_sequences // (_shards("batch", layout) * accumulation * M)  # per device per microbatch
    tokens = rows * seq_len
    layers = cfg.num_layers // S  # sharding.pipeline runs L/S layers per stage, whatever the `layers` rule
    residuals = layer_residual_bytes(cfg, seq_len, _shards("heads", layout)) * tokens  # one layer, no remat
    layer_input = cfg.d_model * cb * tokens
    kept = layer_input if remat == "full" else residuals  # what a layer keeps per microbatch for the backward
    logits = tokens * cfg.vocab_size / _shards("vocab", layout) * 4
    other = 12 * tokens * M * accumulation  # inputs, targets, loss_mask
    if accumulation > 1:  # train_step's scan over microbatches: the accumulated grads beside this microbatch's
        other += 4 * n_params
    if cb != 4 and platform != "gpu":  # the compute-dtype copy of every weight, kept for the backward
        other += n_params * cb
    # FSDP: the weights in use all-gathered (compute dtype) and their gradient before the reduce-scatter (fp32)
    gathered_grad = cb if platform == "gpu" else 4
    layer_phase = residuals + fsdp_gathered_params(cfg, layout, "layers") / layers * (cb + gathered_grad)
    if platform == "gpu":
        # XLA's GPU program: the logits in the compute dtype and in fp32 (the loss's and its cotangent's buffers
        # shared), the gathered head in the compute dtype; its gradient reduce-scattered as it is formed
        loss_phase = logits / 4 * (4 + cb) + fsdp_gathered_params(cfg, layout, "head") * cb
    else:
        loss_phase = 2 * logits + fsdp_gathered_params(cfg, layout, "head") * (cb + 4)  # logits and their cotangent
    if S == 1:
        activations = layers * kept
    else:
        # sharding.pipeline: the embedded inputs of all M microbatches and their gradient sit on every stage. The
        # stage and head params are constants of the schedule's loops, so each microbatch's gradient of them is
        # formed, then added to an accumulator: a second fp32 copy of those grads.
        loop_params = params_per_device(cfg, layout, "layers") + params_per_device(cfg, layout, "head")
        other += 2 * M * layer_input + 4 * loop_params
        if layout.pipeline_schedule == "gpipe":
            # Autodiff of the tick loop keeps every tick's stage residuals (idle ticks too) and its backward holds
            # one tick's; the last stage's outputs, their cotangents and every microbatch's fp32 logits wait too.
            activations = (M + S - 1) * layers * kept
            layer_phase += layers * kept
            other += 2 * M * layer_input + M * logits
        else:
            # 1F1B: a ring of stashed stage inputs; each backward recomputes one microbatch's stage forward.
            activations = stash_slots(S) * layer_input + layers * kept
    return Memory(
        params=4 * n_params,
        grads=4 * n_params,
        optimizer=8 * n_params,
        activations=activations,
        loss_phase=loss_phase,
        layer_phase=layer_phase,
        other=other,
    )


# ----------------------------------------------------------------------------- time


def compute_seconds(
    num_params: float, tokens: float, devices: int, flops_per_device: float, attention_flops_per_token: float = 0.0
) -> float:
    """6 N FLOPs per token (forward 2N, backward 4N), plus attention, spread evenly over the devices."""
    return (6 * num_params + attention_flops_per_token) * tokens / (devices * flops_per_device)


def attention_flops_per_token(cfg: ModelShape, seq_len: int) -> float:
    """12 L H E T: QK^T and PV, forward and backward, over the full T x T (jaxlm.model.model_flops_per_token)."""
    return 12 * cfg.num_layers * cfg.num_heads * cfg.resolved_head_dim * seq_len


def fsdp_comm_seconds(
    num_params: float, bytes_per_param: float, collectives: int, bandwidth: float, ring_size: int | None = None
) -> float:
    """Ring all-gathers / reduce-scatters of the params over an FSDP axis. Each device sends (n-1)/n of the whole
    array per collective, so for a large ring (ring_size=None: the limit) the time is the params' bytes over the
    per-device bandwidth, however many devices share the work."""
    share = 1.0 if ring_size is None else (ring_size - 1) / ring_size
    return num_params * bytes_per_param * collectives * share / bandwidth


def ring_all_reduce_seconds(nbytes: float, ring_size: int, bandwidth: float) -> float:
    """A ring all-reduce is a reduce-scatter plus an all-gather: each device sends 2 (n-1)/n of the array."""
    return 2 * (ring_size - 1) / ring_size * nbytes / bandwidth


def fsdp_crossover_devices(
    bytes_per_param: float,
    bandwidth: float,
    tokens: float,
    flops_per_device: float,
    collectives: int = FSDP_COLLECTIVES,
) -> float:
    """Devices at which compute (falling as 1/devices) equals the FSDP comms (flat): beyond it they cannot hide.
    N cancels: 6 N tokens / (n F) = N b c / bw  <=>  n = 6 tokens bw / (F b c)."""
    return compute_seconds(1.0, tokens, 1, flops_per_device) / fsdp_comm_seconds(
        1.0, bytes_per_param, collectives, bandwidth
    )


def axis_spans(layout: MeshLayout) -> dict[str, int]:
    """Devices one group of each axis spans. Mesh axes run outermost first (sharding.mesh.MESH_AXES), so a group of
    an axis covers its size times every inner axis: tensor is innermost, then pipeline, fsdp, data."""
    spans, inner = {}, 1
    for axis in ("tensor", "pipeline", "fsdp", "data", "replica"):
        inner *= getattr(layout, axis)
        spans[axis] = inner
    return spans


@dataclass(frozen=True)
class Estimate:
    layout: MeshLayout
    accumulation: int  # gradient-accumulation microbatches (jaxlm's data.microbatches)
    memory: Memory
    fits: bool
    compute_s: float  # with recomputation and the pipeline bubble
    bubble: float
    fsdp_s: float
    dp_s: float
    tp_s: float
    pp_s: float
    step_s: float
    mfu: float  # model FLOPs / (step x devices x datasheet peak)

    @property
    def overlapped_s(self) -> float:
        return self.fsdp_s + self.dp_s

    @property
    def hidden(self) -> bool:
        """FSDP and DP comms finish within the compute they overlap with."""
        return self.overlapped_s <= self.compute_s


def evaluate(
    cfg: ModelShape,
    layout: MeshLayout,
    hw: Hardware,
    batch_tokens: int,
    seq_len: int,
    remat: str = "none",
    accumulation: int = 1,
) -> Estimate:
    """One layout's estimate. With gradient accumulation every microbatch gathers the params again and reduces its
    gradients (the SPMD program keeps the accumulator sharded like the params), so FSDP and DP comms scale with it."""
    devices = math.prod(layout.axis_sizes.values())
    cb, S, M = dtype_bytes(cfg), layout.pipeline, layout.num_microbatches
    n_params, attn = count_params(cfg), attention_flops_per_token(cfg, seq_len)
    recompute = remat == "full" or (S > 1 and layout.pipeline_schedule == "1f1b")
    bubble = bubble_fraction(S, M)
    compute = compute_seconds(n_params, batch_tokens, devices, hw.flops, attn) * (4 / 3 if recompute else 1)
    compute /= 1 - bubble
    spans = axis_spans(layout)
    bw = {axis: hw.bandwidth(span) for axis, span in spans.items()}
    fsdp = 0.0
    if layout.fsdp > 1:
        fsdp = accumulation * fsdp_comm_seconds(
            fsdp_gathered_params(cfg, layout), cb, FSDP_COLLECTIVES, bw["fsdp"], layout.fsdp
        )
    dp = accumulation * ring_all_reduce_seconds(params_per_device(cfg, layout) * cb, layout.data, bw["data"])
    shard_activation_bytes = batch_tokens / (layout.data * layout.fsdp) * cfg.d_model * cb  # all microbatches
    layers = cfg.num_layers // S
    tp = layers * (6 if recompute else 4) * ring_all_reduce_seconds(shard_activation_bytes, layout.tensor, bw["tensor"])
    pp = 2 * shard_activation_bytes / bw["pipeline"] if S > 1 else 0.0  # activations forward, gradients back
    step = max(compute, fsdp + dp) + tp + pp
    memory = memory_per_device(cfg, layout, batch_tokens // seq_len, seq_len, remat, accumulation, hw.platform)
    mfu = (6 * n_params + attn) * batch_tokens / (step * devices * hw.peak_flops)
    return Estimate(
        layout,
        accumulation,
        memory,
        memory.total <= hw.hbm_bytes * hw.usable_memory,
        compute,
        bubble,
        fsdp,
        dp,
        tp,
        pp,
        step,
        mfu,
    )


# ----------------------------------------------------------------------------- candidates and ranking


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tensor_sizes(cfg: ModelShape, devices: int, hw: Hardware) -> list[int]:
    """Tensor-parallel sizes: inside the fast domain, splitting heads, kv heads, MLP and vocab evenly."""
    dims = (cfg.num_heads, cfg.num_kv_heads, cfg.mlp_dim, cfg.vocab_size)
    return [t for t in _divisors(devices) if t <= hw.devices_per_node and all(n % t == 0 for n in dims)]


def pipeline_sizes(cfg: ModelShape, devices: int) -> list[int]:
    return [p for p in _divisors(devices) if cfg.num_layers % p == 0]


def candidate_layouts(cfg: ModelShape, devices: int, batch_sequences: int, hw: Hardware) -> list[MeshLayout]:
    """devices = data x fsdp x tensor x pipeline, each dimension splitting evenly; pipelines in both schedules with
    every microbatch count M <= 8 S that divides the per-shard batch."""
    out = []
    for t in tensor_sizes(cfg, devices, hw):
        for p in pipeline_sizes(cfg, devices // t):
            for f in _divisors(devices // (t * p)):
                d = devices // (t * p * f)
                if cfg.d_model % f or batch_sequences % (d * f):
                    continue
                if p == 1:
                    out.append(MeshLayout(data=d, fsdp=f, tensor=t))
                    continue
                for m in _divisors(batch_sequences // (d * f)):
                    if m <= 8 * p:
                        out += [
                            MeshLayout(
                                data=d, fsdp=f, tensor=t, pipeline=p, pipeline_schedule=s, pipeline_microbatches=m
                            )
                            for s in ("1f1b", "gpipe")
                        ]
    return out


@dataclass
class Plan:
    cfg: ModelShape
    hardware: Hardware
    devices: int
    batch_tokens: int
    seq_len: int
    remat: str
    estimates: list[Estimate]  # ranked best first: one per data x fsdp x tensor x pipeline (its best variant)
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Estimate:
        return self.estimates[0]


def fitting_estimate(
    cfg: ModelShape, layout: MeshLayout, hw: Hardware, batch_tokens: int, seq_len: int, remat: str
) -> Estimate:
    """The layout with the fewest gradient-accumulation microbatches that fits (more only add comms), or with the
    most if none fits (the least memory)."""
    per_shard = batch_tokens // seq_len // (layout.data * layout.fsdp * layout.num_microbatches)
    for accumulation in _divisors(per_shard):
        e = evaluate(cfg, layout, hw, batch_tokens, seq_len, remat, accumulation)
        if e.fits:
            break
    return e


def _rank_key(e: Estimate):
    return (not e.fits, e.step_s, e.memory.total)


def plan(cfg: ModelShape, devices: int, batch_tokens: int, seq_len: int, hw: Hardware, remat: str = "none") -> Plan:
    """All valid layouts, evaluated and ranked (fitting ones first, then by step time); notes say why."""
    batch_sequences = check_inputs(cfg, devices, batch_tokens, seq_len, remat)
    layouts = candidate_layouts(cfg, devices, batch_sequences, hw)
    if not layouts:
        raise LayoutError(_no_layout_reason(cfg, devices, batch_sequences, hw))
    best: dict[tuple, Estimate] = {}
    for layout in layouts:
        e = fitting_estimate(cfg, layout, hw, batch_tokens, seq_len, remat)
        key = (layout.data, layout.fsdp, layout.tensor, layout.pipeline)
        if key not in best or _rank_key(e) < _rank_key(best[key]):
            best[key] = e
    result = Plan(cfg, hw, devices, batch_tokens, seq_len, remat, sorted(best.values(), key=_rank_key))
    result.notes = _notes(result, batch_sequences)
    return result


def check_inputs(cfg: ModelShape, devices: int, batch_tokens: int, seq_len: int, remat: str) -> int:
    """Returns the batch in sequences; raises LayoutError naming the first bad input."""
    for name, value in (("devices", devices), ("global batch tokens", batch_tokens), ("seq", seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise LayoutError(f"{name} must be a positive integer, got {value!r}")
    for name in ("d_model", "num_layers", "num_heads", "num_kv_heads", "mlp_dim", "vocab_size"):
        if getattr(cfg, name) <= 0:
            raise LayoutError(f"model.{name} must be positive, got {getattr(cfg, name)}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise LayoutError(f"model.num_heads ({cfg.num_heads}) must be divisible by num_kv_heads ({cfg.num_kv_heads})")
    if cfg.dtype not in ("float32", "bfloat16"):
        raise LayoutError(f"model.dtype must be float32 or bfloat16, got {cfg.dtype!r}")
    if remat not in REMAT_CHOICES:
        raise LayoutError(f"remat must be one of {', '.join(REMAT_CHOICES)}, got {remat!r}")
    if batch_tokens % seq_len:
        lo = batch_tokens // seq_len
        nearest = [n for n in (lo, lo + 1) if n > 0]
        raise LayoutError(
            f"global batch tokens {batch_tokens} is not a multiple of seq {seq_len} "
            f"({batch_tokens / seq_len:.2f} sequences); e.g. "
            + " or ".join(f"{n * seq_len} ({n} sequence{'s' * (n > 1)})" for n in nearest)
        )
    return batch_tokens // seq_len


def _no_layout_reason(cfg: ModelShape, devices: int, batch_sequences: int, hw: Hardware) -> str:
    ts = tensor_sizes(cfg, devices, hw)
    model_parallel = sorted({t * p for t in ts for p in pipeline_sizes(cfg, devices // t)})
    smallest_dp = devices // model_parallel[-1]
    limits = (
        f"tensor in {ts} (<= {hw.devices_per_node} devices per node, dividing heads {cfg.num_heads}, kv heads "
        f"{cfg.num_kv_heads}, mlp {cfg.mlp_dim}, vocab {cfg.vocab_size}), pipeline dividing "
        f"{cfg.num_layers} layers"
    )
    if batch_sequences < smallest_dp:
        return (
            f"global batch of {batch_sequences} sequences is smaller than the smallest data x fsdp size "
            f"{smallest_dp} for {devices} devices ({limits})"
        )
    return (
        f"no layout of {devices} devices fits a batch of {batch_sequences} sequences: data x fsdp must divide "
        f"both ({math.gcd(batch_sequences, devices)} at most) and fsdp must divide d_model {cfg.d_model}, so "
        f"tensor x pipeline must cover >= {devices // math.gcd(batch_sequences, devices)} devices, but {limits} "
        f"allow only {model_parallel}"
    )


def _notes(p: Plan, batch_sequences: int) -> list[str]:
    notes, best, lay, hw = [], p.best, p.best.layout, p.hardware
    most_dp = math.gcd(batch_sequences, p.devices)
    if most_dp < p.devices:
        notes.append(
            f"the global batch is {batch_sequences:,} sequences of {p.seq_len:,} tokens: data x fsdp can "
            f"use at most {most_dp:,} of the {p.devices:,} devices (it must divide both), so tensor x "
            f"pipeline must cover the other {p.devices // most_dp:,}x"
        )
    remat_hint = " (or try --remat full)" if p.remat == "none" else ""
    if lay.tensor * lay.pipeline > 1:
        flat = [e for e in p.estimates if e.layout.tensor * e.layout.pipeline == 1]
        if not flat:
            why = "no data x fsdp-only layout exists for this batch"
        elif not any(e.fits for e in flat):
            why = (
                f"no data x fsdp-only layout fits in {hw.hbm_bytes / 1e9:.0f} GB (smallest "
                f"{min(e.memory.total for e in flat) / 1e9:.1f} GB/device){remat_hint}"
            )
        else:
            e = min((e for e in flat if e.fits), key=_rank_key)
            why = f"the best data x fsdp-only layout ({describe(e.layout, e.accumulation)}) takes {e.step_s:.2f} s/step"
        notes.append(f"the best layout uses tensor={lay.tensor} x pipeline={lay.pipeline} because {why}")
    if not best.fits:
        notes.append(
            f"no layout fits in {hw.hbm_bytes / 1e9:.0f} GB x {hw.usable_memory:.0%} usable: more devices "
            f"or a shorter sequence{remat_hint}"
        )
    if lay.fsdp > 1:
        bw = hw.bandwidth(axis_spans(lay)["fsdp"])
        cross = fsdp_crossover_devices(
            dtype_bytes(p.cfg), bw, p.batch_tokens, hw.flops, FSDP_COLLECTIVES * best.accumulation
        )
        notes.append(
            f"FSDP gathers of the whole model ({FSDP_COLLECTIVES * best.accumulation} per step) over "
            f"{bw / 1e9:.0f} GB/s links take as long as this batch's compute at ~{cross:,.0f} devices; beyond "
            f"that they cannot hide (compute falls as 1/devices, each device's FSDP traffic does not)"
        )
    if not best.hidden:
        notes.append(
            f"FSDP + DP comms ({best.overlapped_s:.2f} s) exceed compute ({best.compute_s:.2f} s): they do "
            f"not hide behind it; the step is comm-bound"
        )
    return notes


def describe(layout: MeshLayout, accumulation: int = 1) -> str:
    text = f"d{layout.data} f{layout.fsdp} t{layout.tensor} p{layout.pipeline}"
    if layout.pipeline > 1:
        text += f" {layout.pipeline_schedule} M={layout.num_microbatches}"
    return text + (f" accum={accumulation}" if accumulation > 1 else "")
