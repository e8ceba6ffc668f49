"""Parallelism cost planner: every mesh layout of N devices, its memory per device and its step time, ranked.

Formulas, not profiling, so each number can be checked by hand:

* memory (`sharding.memory_model`, over `sharding.model_shape`'s parameter counts): fp32 params, fp32 grads and
  AdamW's two fp32 moments (16 bytes per param), each sharded as the logical-axis rules say; the activations
  reverse-mode autodiff keeps per layer, for the microbatches a pipeline schedule keeps live; fp32 logits; one
  layer's backward working set. Each layout gets the fewest gradient-accumulation microbatches that make it fit. The
  loss's and a layer's working sets follow the XLA program of the hardware's platform where they differ (GPU:
  measured against deviceless H100 compiles; TPU: fitted to deviceless v5p and v6e compiles, docs/scale.md).
* compute: (6 N + attention) FLOPs per token / (devices x achievable FLOP/s), x 4/3 where the forward is recomputed
  (x 5/3 for ZB-H1 and ZB-V, which recompute it for B and for W), / (1 - bubble) with pipelining: bubble = (S - 1) /
  (M + S - 1) for GPipe and 1F1B with S stages and M microbatches, the table's idle share for the others
  (`sharding.schedules`: interleaved 1F1B, ZB-H1, ZB-V). Every schedule a pipeline can run is a candidate, so the
  plan recommends one.
* communication, ring collectives (bandwidth terms, in the compute dtype) at the bandwidth of the link the axis
  spans (inside a node or across): FSDP all-gathers (forward, backward) + gradient reduce-scatter, and the DP
  gradient all-reduce, overlap with compute; tensor-parallel activation all-reduces (2 forward + 2 backward per
  layer, 2 more when the forward is recomputed), pipeline sends and an expert axis' all-to-alls (the copies out and
  back per MoE layer, forward and backward, in worst-case buffers) do not.  step = max(compute, FSDP + DP) + TP + PP
  + EP. An MoE model's FLOPs count its active params (the chosen experts).

Not modelled: collective latency, the embedding's and the loss's small vocab-parallel all-reduces, imperfect
overlap, kernel efficiency changing with microbatch size (all absorbed into the hardware's assumed MFU).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from sharding.hardware import Hardware
from sharding.memory_model import Memory, dtype_bytes, memory_per_device, padded_gathers
from sharding.mesh import MESH_AXES, LayoutError, MeshLayout
from sharding.model_shape import (
    ModelShape,
    active_params,
    expert_hidden_shards,
    expert_params,
    fsdp_axes,
    fsdp_gathered_params,
    fsdp_size,
    logical_shards,
    params_per_device,
)
from sharding.pipeline import runs_in_lockstep
from sharding.schedules import idle_share, splits_backward

FSDP_COLLECTIVES = 3  # all-gather for the forward, again for the backward, reduce-scatter of the gradients
REMAT_CHOICES = ("none", "full")


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
    for axis in reversed(MESH_AXES):
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
    cp_s: float = 0.0  # context parallelism's K/V passes (overlapped with compute, as a ring attention is)
    ep_s: float = 0.0  # expert parallelism's all-to-alls (not overlapped: the experts wait for their tokens)

    @property
    def overlapped_s(self) -> float:
        return self.fsdp_s + self.dp_s + self.cp_s

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
    cb, S = dtype_bytes(cfg), layout.pipeline
    n_params, attn = active_params(cfg), attention_flops_per_token(cfg, seq_len)
    bubble, recompute = pipeline_costs(layout, remat, runs_in_lockstep(layout, cfg.context_parallel))
    # the ranks of a tensor axis that do not split the experts' width multiply the same tokens by whole experts
    # (sharding.experts): those FLOPs are repeated
    repeats = layout.tensor / expert_hidden_shards(cfg, layout) - 1 if cfg.num_experts else 0
    done = n_params + max(repeats, 0) * cfg.num_moe_layers * cfg.experts_per_token * expert_params(cfg)
    compute = compute_seconds(done, batch_tokens, devices, hw.flops, attn) * recompute
    compute /= 1 - bubble
    spans = axis_spans(layout)
    bw = {axis: hw.bandwidth(span) for axis, span in spans.items()}
    fsdp = 0.0
    if fsdp_size(layout) > 1:  # over the outermost of the gather's axes (fsdp, and context when present)
        gather_bw = min(bw[a] for a in fsdp_axes(layout))
        fsdp = accumulation * fsdp_comm_seconds(
            fsdp_gathered_params(cfg, layout), cb, FSDP_COLLECTIVES, gather_bw, fsdp_size(layout)
        )
    # gradients summed over the batch's replicas: the experts' over data, the rest over data x expert too
    experts = params_per_device(cfg, layout, "experts")
    dp = accumulation * (
        ring_all_reduce_seconds(experts * cb, layout.data, bw["data"])
        + ring_all_reduce_seconds(
            (params_per_device(cfg, layout) - experts) * cb, layout.data * layout.expert, bw["data"]
        )
    )
    shard_activation_bytes = batch_tokens / layout.batch_shards * cfg.d_model * cb  # all microbatches
    layers = cfg.num_layers // S
    forwards = 3 * recompute - 2  # forward passes per step: 1, and one per recomputation
    tp = layers * 2 * (forwards + 1) * ring_all_reduce_seconds(shard_activation_bytes, layout.tensor, bw["tensor"])
    # activations forward, gradients back, at every chunk boundary (interleaved and ZB-V cross the stages v times)
    pp = 2 * layout.pipeline_chunks * shard_activation_bytes / bw["pipeline"] if S > 1 else 0.0
    cp = accumulation * context_comm_seconds(cfg, layout, batch_tokens, remat, bw["context"])
    ep = expert_comm_seconds(cfg, layout, batch_tokens, remat, bw["expert"])
    step = max(compute, fsdp + dp + cp) + tp + pp + ep
    padded = padded_gathers(layout, hw.platform, hw.torus_dims)
    memory = memory_per_device(cfg, layout, batch_tokens // seq_len, seq_len, remat, accumulation, hw.platform, padded)
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
        cp,
        ep,
    )


def pipeline_costs(layout: MeshLayout, remat: str, in_lockstep: bool = False) -> tuple[float, float]:
    """(idle share, compute over a step without recomputation) of the layout's pipeline schedule: its table's idle
    share (sharding.schedules.idle_share; the lockstep table's under ring attention, sharding.pipeline.
    runs_in_lockstep). Compute (forward = 1, backward = 2): each backward op of a pipeline recomputes its chunk's
    forward, once per microbatch for a BW (GPipe, 1F1B, interleaved: 4/3), twice for B and W apart (ZB-H1, ZB-V:
    5/3); `remat` full recomputes each layer once more inside every one of those."""
    S, M, name = layout.pipeline, layout.num_microbatches, layout.pipeline_schedule
    again = 1 if remat == "full" else 0
    if S == 1:
        return 0.0, (3 + again) / 3
    idle = idle_share(name, S, M, layout.pipeline_virtual_stages or None, in_lockstep)
    backward_ops = 2 if splits_backward(name) else 1
    return idle, (3 + backward_ops * (1 + again)) / 3


def context_comm_seconds(cfg: ModelShape, layout: MeshLayout, batch_tokens: int, remat: str, bandwidth: float):
    """A context axis' K/V traffic per step: each layer's forward passes every other shard's K and V to each device
    (ring: C - 1 sends of one shard; all_gather: the same bytes at once), the backward their gradients, and a
    recomputed forward (remat) once more."""
    C = logical_shards("seq", layout)
    if C == 1:
        return 0.0
    device_tokens = batch_tokens / math.prod(layout.axis_sizes.values()) * layout.tensor * layout.pipeline
    kv_token = 2 * cfg.num_kv_heads / logical_shards("kv_heads", layout) * cfg.resolved_head_dim * dtype_bytes(cfg)
    passes = 3 if remat == "full" else 2
    layers = cfg.num_layers // layout.pipeline
    return layers * passes * (C - 1) * device_tokens * kv_token / bandwidth


def expert_all_to_all_bytes(cfg: ModelShape, layout: MeshLayout, batch_tokens: int, remat: str) -> float:
    """Bytes one device sends per step in an expert axis' all-to-alls (sharding.experts): per MoE layer the token
    copies out and the outputs back, forward and backward (and the forward again under remat), of which (E - 1) / E
    leave the device: dropless the device's A copies themselves (a ragged all-to-all; evenly routed), with capacity
    E x [W, Q] slots, capacity_factor x A rows."""
    E = logical_shards("expert", layout)
    if not cfg.num_experts or E == 1:
        return 0.0
    device_tokens = batch_tokens / logical_shards("batch", layout)  # every microbatch's
    rows = cfg.capacity_factor if cfg.capacity_factor > 0 else 1  # rows sent per copy
    buffer = rows * device_tokens * cfg.experts_per_token * cfg.d_model * dtype_bytes(cfg)
    passes = 2 * (3 if remat == "full" else 2)  # out and back, in each forward and backward
    return cfg.num_moe_layers * passes * buffer * (E - 1) / E


def expert_comm_seconds(cfg: ModelShape, layout: MeshLayout, batch_tokens: int, remat: str, bandwidth: float):
    return expert_all_to_all_bytes(cfg, layout, batch_tokens, remat) / bandwidth


# ----------------------------------------------------------------------------- candidates and ranking


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tensor_sizes(cfg: ModelShape, devices: int, hw: Hardware) -> list[int]:
    """Tensor-parallel sizes: inside the fast domain, splitting heads, kv heads, MLP and vocab evenly."""
    dims = (cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size)
    dims += (cfg.expert_mlp_dim,) if cfg.num_experts else ()
    dims += (cfg.mlp_dim,) if not cfg.num_experts or cfg.moe_every > 1 else ()
    return [t for t in _divisors(devices) if t <= hw.devices_per_node and all(n % t == 0 for n in dims)]


def pipeline_sizes(cfg: ModelShape, devices: int) -> list[int]:
    """Stage counts the layers split evenly over (with MoE layers every k-th, their groups of k layers)."""
    return [p for p in _divisors(devices) if cfg.num_layers % (p * _group(cfg)) == 0]


def _group(cfg: ModelShape) -> int:
    """The layers a pipeline stage takes whole: moe_every for an MoE model with dense layers between (jaxlm.train
    splits groups of a dense run and an MoE layer), else one."""
    return cfg.moe_every if cfg.num_experts else 1


def expert_sizes(cfg: ModelShape, devices: int) -> list[int]:
    """Expert-parallel sizes: 1 for a dense model, else those dividing the experts (each device holds X / E)."""
    return [e for e in _divisors(devices) if cfg.num_experts % e == 0] if cfg.num_experts else [1]


def candidate_layouts(cfg: ModelShape, devices: int, batch_sequences: int, hw: Hardware) -> list[MeshLayout]:
    """devices = data x fsdp x expert x tensor x pipeline, each dimension splitting evenly; pipelines in every
    schedule they can run (`pipeline_schedules`) with every microbatch count M <= 8 S that divides the per-shard
    batch."""
    out = []
    for t in tensor_sizes(cfg, devices, hw):
        for p in pipeline_sizes(cfg, devices // t):
            for e, f in [
                (e, f) for e in expert_sizes(cfg, devices // (t * p)) for f in _divisors(devices // (t * p * e))
            ]:
                d = devices // (t * p * e * f)
                if cfg.d_model % f or batch_sequences % (d * f * e):
                    continue
                if p == 1:
                    out.append(MeshLayout(data=d, fsdp=f, tensor=t, expert=e))
                    continue
                for m in _divisors(batch_sequences // (d * f * e)):
                    if m <= 8 * p:
                        out += [
                            MeshLayout(
                                data=d,
                                fsdp=f,
                                tensor=t,
                                expert=e,
                                pipeline=p,
                                pipeline_schedule=s,
                                pipeline_microbatches=m,
                            )
                            for s in pipeline_schedules(cfg, p, m)
                        ]
    return out


TABLE_LIMIT = (8, 4)  # table schedules are planned for stages <= 8 and microbatches <= 4 x stages


def pipeline_schedules(cfg: ModelShape, stages: int, microbatches: int) -> list[str]:
    """The schedules a pipeline of `stages` can run `microbatches` with: all five where the layers split into
    two chunks per stage (interleaved 1F1B with v = 2 and ZB-V; interleaved also needs M a multiple of the stages).
    The table schedules only within TABLE_LIMIT: their tables are simulated (sharding.schedules, ~0.4 s for ZB-V at
    8 stages and 64 microbatches, growing as S x M x ticks), and past M = 4 S 1F1B's bubble is under 16%."""
    names = ["1f1b", "gpipe"]
    if stages > TABLE_LIMIT[0] or microbatches > TABLE_LIMIT[1] * stages:
        return names
    names.append("zb-h1")
    if cfg.num_layers % (2 * stages * _group(cfg)) == 0:
        names += ["interleaved-1f1b"] * (microbatches % stages == 0) + ["zbv"]
    return names


def context_layouts(cfg: ModelShape, devices: int, batch_sequences: int, seq_len: int, hw: Hardware) -> list:
    """Layouts with a context axis C (dividing the devices and the sequence), the rest of the devices laid out as
    `candidate_layouts` would; tried when no layout without one fits."""
    out = []
    for c in _divisors(devices)[1:]:
        if seq_len % c == 0:
            rest = candidate_layouts(cfg, devices // c, batch_sequences, hw)
            out += [dataclasses.replace(lay, context=c) for lay in rest]
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

    def consider(layouts):
        for layout in layouts:
            e = fitting_estimate(cfg, layout, hw, batch_tokens, seq_len, remat)
            key = (layout.data, layout.fsdp, layout.tensor, layout.pipeline, layout.context, layout.expert)
            if key not in best or _rank_key(e) < _rank_key(best[key]):
                best[key] = e

    consider(layouts)
    if not any(e.fits for e in best.values()):  # the sequence may not fit one device: split it (context axis)
        consider(context_layouts(cfg, devices, batch_sequences, seq_len, hw))
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
            f"pipeline x context must cover the other {p.devices // most_dp:,}x"
        )
    if lay.context > 1:
        notes.append(
            f"no layout fits with whole sequences: context={lay.context} splits each into "
            f"{p.seq_len // lay.context:,}-token shards (ring attention passes K/V around; "
            f"{best.cp_s:.2f} s of it per step, overlapped with compute)"
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
    if layout.context > 1:
        text += f" c{layout.context}"
    if layout.expert > 1:
        text += f" e{layout.expert}"
    if layout.pipeline > 1:
        text += f" {layout.pipeline_schedule} M={layout.num_microbatches}"
        text += f" v={layout.pipeline_chunks}" if layout.pipeline_schedule == "interleaved-1f1b" else ""
    return text + (f" accum={accumulation}" if accumulation > 1 else "")
