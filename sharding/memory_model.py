"""Peak memory of one train step per device: the state, the activations kept for the backward, and the larger of
the loss's and one layer's working sets, as XLA's program on each platform holds them (`memory_per_device`).
The planner ranks layouts with it; jaxlm.memory_check refuses a step too big before compiling."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pallas_kernels.targets import cudnn_attention_takes
from sharding.mesh import MeshLayout
from sharding.model_shape import (
    ModelShape,
    expert_hidden_shards,
    fsdp_gathered_params,
    fsdp_size,
    largest_gathered_param,
    logical_shards,
    params_per_device,
)
from sharding.pipeline import buffer_slots, runs_in_lockstep

# XLA:TPU's step, fitted to 36 deviceless compiles (memory_per_device; docs/results/tpu-memory-2026-11-26.md): the
# compute-dtype weight copy it keeps, per param; the loss's fp32 logit-sized buffers, and bytes per head weight when
# the gathers are padded all-reduces; a layer's backward per byte of its residuals (beside the recomputed ones) and
# per gathered weight, and per gathered weight more when padded. TPU_FIT_HIGH: the most the fit reads over XLA's
# figure on those compiles (memory_check allows for it).
TPU_WEIGHT_COPY_BYTES = 0.9
TPU_LOGITS = 2.32
TPU_PADDED_HEAD_BYTES = 1.72
TPU_LAYER_COTANGENTS = 1.26
TPU_LAYER_WEIGHT_BYTES = 6.05
TPU_PADDED_LAYER_BYTES = 1.5
TPU_FIT_HIGH = 1.1
# Mixtures of experts, fitted on 21 compiles of Mixtral-8x7B and Qwen3-30B-A3B on v5p and v6e
# (docs/results/tpu-moe-memory-2026-11-27.md): per expert param a device holds, what XLA keeps beyond the dense fit's
# (a whole compute-dtype copy of the stacked experts, and a second fp32 buffer of w_in's gradient in the layers'
# backward loop: its peak buffers); per gathered expert weight in a layer's backward, in place of the dense layer's
# bytes (the gathered weight in the compute dtype), and per gathered expert weight more when gathers are padded; the
# SwiGLU residuals of each row the expert exchange receives, in expert widths (six elsewhere).
TPU_EXPERT_PARAM_BYTES = 4.0
TPU_EXPERT_LAYER_BYTES = 2.0
TPU_PADDED_EXPERT_BYTES = 2.0
TPU_EXCHANGE_SWIGLU_WIDTHS = 5


def padded_gathers(layout: MeshLayout, platform: str, torus_dims: int) -> bool:
    """Whether XLA writes the FSDP gathers as all-reduces of zero-padded full-size buffers: on TPU when FSDP spans
    every chip of a 3D-torus slice (v5p); over part of one, or on a 2D torus (v5e, v6e), it all-gathers."""
    gather = fsdp_size(layout)
    return platform == "tpu" and torus_dims == 3 and 1 < gather == math.prod(layout.axis_sizes.values())


def dtype_bytes(cfg: ModelShape) -> int:
    return {"float32": 4, "bfloat16": 2}[cfg.dtype]


def keeps_scores(cfg: ModelShape, platform: str) -> bool:
    """Whether attention keeps every query x key pair for its backward: ``reference`` does, and ``jax`` too but on
    a GPU, where cuDNN's fused kernel takes it (a causal mask, the default, or a sliding window; a dtype and head
    dim ``pallas_kernels.targets.cudnn_attention_takes``) and keeps a row's softmax statistics, as the
    flash-style kernels do. On H100s the dense residuals had the planner at 11x XLA's memory for ``jax`` (tiny_lm
    at T = 4096, 2026-11-28). The shape carries no mask: other masks under ``jax`` on a GPU are dense (XLA's)."""
    if cfg.attention_impl == "jax" and platform == "gpu":
        return not cudnn_attention_takes(cfg.dtype, cfg.resolved_head_dim)
    return cfg.attention_impl in ("reference", "jax")


def layer_residual_bytes(
    cfg: ModelShape, seq_len: int, tensor: int = 1, hidden: int = 1, platform: str = "cpu"
) -> float:
    """Bytes per token one transformer layer keeps from its forward for its backward (no remat), on one device of
    a `tensor`-way split: what jax's reverse mode saves for this block (`jax.ad_checkpoint.print_saved_residuals`),
    minus what no backward rule reads (the masked scores, the boolean mask), which XLA drops.

    - each RMSNorm: its input and the normalised x in fp32, its output (compute dtype), rsqrt and mean (fp32)
    - dense attention (reference; jax but on a GPU, ``keeps_scores``): q, k, v and the attention output, the fp32
      exp and the (compute dtype) probabilities of every query x key pair, the softmax max and sum; flash-style
      kernels (xla_blocksparse / pallas; cuDNN's for jax on a GPU): q, k, v and the output in the kernel's [B, H, T,
      E] layout, the log-sum-exp, and the output again as the output projection's input
    - SwiGLU: the gate and up halves, sigmoid and silu of the gate (silu's derivative), silu(gate) * up
    Heads and the MLP hidden size split over `tensor` (an MoE layer's experts' width `hidden` ways); d_model-sized
    tensors are replicated across it.
    """
    cb = dtype_bytes(cfg)
    D, E = cfg.d_model, cfg.resolved_head_dim
    h, k, f = cfg.num_heads / tensor, cfg.num_kv_heads / tensor, cfg.mlp_dim / tensor
    norms = 2 * (D * (4 + 4 + cb) + 2 * 4)
    if keeps_scores(cfg, platform):
        attention = (2 * h + 2 * k) * E * cb + h * seq_len * (4 + cb) + 2 * h * 4
    else:
        attention = (3 * h + 2 * k) * E * cb + h * 4
    mlp = 6 * f * cb
    if cfg.num_experts:  # a layer's share: one MoE layer in every moe_every
        mlp = (mlp * (cfg.moe_every - 1) + moe_residual_bytes(cfg, hidden=hidden)) / cfg.moe_every
    return norms + attention + mlp


def moe_residual_bytes(cfg: ModelShape, expert: int = 1, hidden: int = 1, swiglu_widths: float = 6) -> float:
    """Bytes per token an MoE layer (jaxlm.moe) keeps for its backward: the router's fp32 logits and
    probabilities, and per routed copy (experts_per_token of them) its gathered input and a SwiGLU's residuals,
    plus the shared experts'. Dropless under an `expert` axis of E devices sharding.experts sends the copies
    themselves (a ragged all-to-all) but receives into, and computes over, the worst case, E x a device's copies;
    with capacity the experts' slots are capacity_factor x the copies, sent and received, with or without the axis.
    The ranks of a tensor axis take the same tokens, each its ``hidden``-th of every expert's width
    (model_shape.expert_hidden_shards). ``swiglu_widths``: a row's SwiGLU residuals in expert widths (six in jax's
    reverse mode; TPU_EXCHANGE_SWIGLU_WIDTHS for the exchange's rows on TPU)."""
    cb = dtype_bytes(cfg)
    D, Z = cfg.d_model, cfg.experts_per_token
    f, shared = cfg.expert_mlp_dim / hidden, cfg.num_shared_experts * cfg.expert_mlp_dim
    router = 2 * cfg.num_experts * 4
    if cfg.capacity_factor > 0:
        copies = cfg.capacity_factor * ((2 if expert > 1 else 1) * D + swiglu_widths * f)
    else:
        copies = expert * (D + swiglu_widths * f) + (D if expert > 1 else 0)  # received and computed; sent
    return router + Z * copies * cb + 6 * shared * cb


def context_kv_bytes(cfg: ModelShape, layout: MeshLayout, tokens: float) -> float:
    """K and V a layer's attention holds beyond its own under a context axis (sharding.context): the ring the
    shard in hand and the one arriving, all_gather every shard's, with their gradients in the backward."""
    C = logical_shards("seq", layout)
    if C == 1:
        return 0.0
    kv_token = 2 * cfg.num_kv_heads / logical_shards("kv_heads", layout) * cfg.resolved_head_dim * dtype_bytes(cfg)
    shards = 2 if cfg.context_parallel == "ring" else C
    return 2 * shards * tokens * kv_token  # the keys and values, and their cotangents


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
    # interleaved 1F1B and ZB-V: the copy of a stage's params put in its chunks' order (sharding.pipeline.
    # split_chunks moves them between stages), which the schedule's loop reads the whole step
    reorder: float = 0.0

    @property
    def state(self) -> float:
        return self.params + self.optimizer

    @property
    def total(self) -> float:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.other
            + self.reorder
            + self.activations
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
    padded_gathers: bool = False,
) -> Memory:
    """Peak bytes per device of one train step of `accumulation` gradient-accumulation microbatches (each split
    into the layout's pipeline microbatches). Rule for scans (layers, pipeline ticks, accumulation): the forward
    stacks every step's residuals, the backward of a step holds that step's residuals sliced out of the stack, and
    the gradient of a loop constant (params) is formed per step, then added to an accumulator.

    Not counted: the cotangents formed inside one layer's backward (on CPU, XLA's peak runs 0.1-0.4 of a layer's
    residuals above this estimate; more under remat), XLA's scratch and the runtime's own memory.

    ``platform`` "gpu" follows XLA's GPU program (Llama 3 8B / 70B / 405B on 64-1024 H100s, seq 8k-128k: 0.96-1.09x
    of its memory, 2026-11-26): it keeps the logits once in fp32 and once in the compute dtype, gathers the head and
    each layer's weights in the compute dtype, reduce-scatters each gradient in it as it is formed (one whole at a
    time), and keeps no sharded compute-dtype copy of the weights. "cpu" keeps two fp32 logits, fp32 gradients of
    the gathered weights and that copy.

    "tpu" is fitted, not read off buffers: XLA's TPU figure is a heap that packs buffers of different lifetimes with
    gaps (docs/scale.md). Its six coefficients (TPU_*) were fitted to 36 deviceless compiles (Llama 2 / 3, 1B-405B,
    v5e / v5p / v6e, 64-1024 chips, seq 2k-64k, FSDP, data, tensor and accumulation, remat full and none): 0.91-1.09x
    of XLA's memory on every one. It keeps the norms' outputs but not their fp32 insides without remat, and
    ``padded_gathers`` (XLA writes FSDP gathers as all-reduces of zero-padded full-size buffers: FSDP over every chip
    of a 3D-torus slice, v5p) costs bytes per head and layer weight more. Experts have four terms of their own
    (TPU_*EXPERT*, TPU_EXCHANGE_SWIGLU_WIDTHS), fitted to 21 Mixtral and Qwen3 compiles on v5p and v6e: 0.91-1.10x
    of XLA's memory on those and on 4 compiled after.
    """
    cb = dtype_bytes(cfg)
    n_params = params_per_device(cfg, layout)
    S, M = layout.pipeline, layout.num_microbatches
    rows = batch_sequences // (logical_shards("batch", layout) * accumulation * M)  # per device per microbatch
    tokens = rows * seq_len // logical_shards("seq", layout)  # a context axis splits every row
    layers = cfg.num_layers // S  # sharding.pipeline runs L/S layers per stage, whatever the `layers` rule
    hidden = expert_hidden_shards(cfg, layout) if cfg.num_experts else 1
    E = logical_shards("expert", layout) if cfg.num_experts else 1  # devices an MoE layer's experts split over
    residuals = layer_residual_bytes(cfg, seq_len, logical_shards("heads", layout), hidden, platform) * tokens
    exchange = 0.0
    if E > 1:  # worst-case exchange buffers (sharding.experts)
        widths = TPU_EXCHANGE_SWIGLU_WIDTHS if platform == "tpu" else 6
        exchange = moe_residual_bytes(cfg, E, hidden, widths) - moe_residual_bytes(cfg, 1, hidden, widths)
        exchange *= tokens / cfg.moe_every
        residuals += exchange
    layer_input = cfg.d_model * cb * tokens
    kept = layer_input if remat == "full" else residuals  # what a layer keeps per microbatch for the backward
    if platform == "tpu" and remat != "full":  # XLA:TPU keeps the norms' outputs, not their fp32 insides
        kept -= 2 * (cfg.d_model * 8 + 2 * 4) * tokens
    logits = tokens * cfg.vocab_size / logical_shards("vocab", layout) * 4
    other = 12 * tokens * M * accumulation  # inputs, targets, loss_mask
    if accumulation > 1:  # train_step's scan over microbatches: the accumulated grads beside this microbatch's
        other += 4 * n_params
    if cb != 4 and platform != "gpu":  # the compute-dtype copy of every weight, kept for the backward (TPU: fitted)
        other += n_params * (TPU_WEIGHT_COPY_BYTES if platform == "tpu" else cb)
    # FSDP: the weights in use all-gathered (compute dtype) and their gradients before the reduce-scatter
    layer_weights = fsdp_gathered_params(cfg, layout, "layers") / layers
    if platform == "gpu":  # each gradient reduce-scattered as it is formed (compute dtype): one whole at a time
        layer_phase = residuals + layer_weights * cb + largest_gathered_param(cfg, layout, "layers") * cb
    elif platform == "tpu":  # fitted (docstring)
        own = residuals - exchange  # a layer's own residuals: recomputed under remat, then their cotangents
        layer_phase = (own if remat == "full" else 0.0) + TPU_LAYER_COTANGENTS * own + exchange
        per_weight = TPU_LAYER_WEIGHT_BYTES + (TPU_PADDED_LAYER_BYTES if padded_gathers else 0)
        expert_weights = fsdp_gathered_params(cfg, layout, "experts") / layers  # 0 for a dense model
        expert_bytes = TPU_EXPERT_LAYER_BYTES + (TPU_PADDED_EXPERT_BYTES if padded_gathers else 0)
        layer_phase += per_weight * (layer_weights - expert_weights) + expert_bytes * expert_weights
        other += TPU_EXPERT_PARAM_BYTES * params_per_device(cfg, layout, "experts")
    else:  # all of the layer's gradients whole in fp32
        layer_phase = residuals + layer_weights * (cb + 4)
    layer_phase += context_kv_bytes(cfg, layout, tokens)
    if E > 1:
        # the exchange's backward, beside that layer's residuals: the gradient of the outputs it received and that of
        # the inputs before it is sent back, each E x a device's copies of d_model (XLA's buffers, Qwen3-30B-A3B on
        # 64 H100s: [262144, 2048] each)
        layer_phase += 2 * E * cfg.experts_per_token * cfg.d_model * cb * tokens / cfg.moe_every
    if platform == "gpu":
        # XLA's GPU program: the logits in the compute dtype and in fp32 (the loss's and its cotangent's buffers
        # shared), the gathered head in the compute dtype; its gradient reduce-scattered as it is formed
        loss_phase = logits / 4 * (4 + cb) + fsdp_gathered_params(cfg, layout, "head") * cb
    elif platform == "tpu":  # fitted (docstring): no gathered head, but a padded one where gathers are all-reduces
        padded_head = fsdp_gathered_params(cfg, layout, "head") if padded_gathers else 0
        loss_phase = TPU_LOGITS * logits + TPU_PADDED_HEAD_BYTES * padded_head
    else:
        loss_phase = 2 * logits + fsdp_gathered_params(cfg, layout, "head") * (cb + 4)  # logits and their cotangent
    reorder = 0.0
    if S == 1:
        activations = layers * kept
    else:
        # sharding.pipeline: the embedded inputs of all M microbatches and their gradient sit on every stage. The
        # stage and head params are constants of the schedule's loops, so each microbatch's gradient of them is
        # formed (one chunk's and the head's at a time), then added to an accumulator: a second fp32 copy of those
        # grads, and a third of one chunk's.
        chunks = layout.pipeline_chunks
        stage_params, head_params = params_per_device(cfg, layout, "layers"), params_per_device(cfg, layout, "head")
        other += 2 * M * layer_input + 4 * (stage_params + head_params) + 4 * (stage_params / chunks + head_params)
        # Each stage's buffers of chunk inputs (from F to the chunk's last backward op) and of output gradients
        # (from their arrival to the W or BW that reads them), one layer input each: GPipe M and M, 1F1B P and 1.
        # B, W and BW recompute one chunk's forward at a time.
        in_lockstep = runs_in_lockstep(layout, cfg.context_parallel)
        v = layout.pipeline_virtual_stages or None
        x_slots, g_slots = buffer_slots(layout.pipeline_schedule, S, M, v, in_lockstep)
        activations = (x_slots + g_slots) * layer_input
        activations += layers // chunks * kept
        if chunks > 1:
            # one fp32 copy of the stage's params in chunk order (ppermuted in; when XLA gathered them it held S - 1)
            reorder = 4 * stage_params
    return Memory(
        reorder=reorder,
        params=4 * n_params,
        grads=4 * n_params,
        optimizer=8 * n_params,
        activations=activations,
        loss_phase=loss_phase,
        layer_phase=layer_phase,
        other=other,
    )
