"""A run's train step, or generate's decode step, compiled for a cluster this machine does not have, and what XLA
says of it.

XLA compiles for GPUs and TPUs that are absent (pallas_kernels.targets): the real compiler, kernels included, checks
that the program compiles and fits each device's memory, and its optimized HLO shows the collectives it will send.
That is what a user needs to know before renting 256 GPUs. What it cannot say is how fast the step runs: the
planner's step time and MFU stand beside the train step as a model, not a measurement (the planner has no model of
decoding).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm import generate
from jaxlm.config import TrainConfig, validate
from jaxlm.train import Program, step_microbatches
from pallas_kernels.mask_spec import parse_mask, uses_documents
from pallas_kernels.targets import first_line, tracing_for
from sharding import MeshLayout, build_mesh
from sharding.clusters import Cluster, cluster_devices
from sharding.hlo import Collective, collectives, custom_kernels
from sharding.model_shape import ModelShape
from sharding.planner import evaluate


@dataclasses.dataclass
class StepCompile:
    """One layout's compile of a step ("train" or "decode"): XLA's per-device memory (bytes), the planner's (None
    where it has no estimate), the program's kernels and collectives. ``error`` is XLA's first line when it did
    not compile."""

    layout: MeshLayout
    microbatches: int
    compile_s: float
    error: str = ""
    step: str = "train"
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    held_bytes: int = 0  # decode: inputs the step does not read but a run keeps on the device (compile_decode_step)
    rows: int = 0  # decode: the batch's rows, one new token each per step
    cache_len: int = 0  # decode: the KV cache's slots
    planner_bytes: float | None = None
    planner_step_s: float | None = None
    planner_mfu: float | None = None
    kernels: Counter = dataclasses.field(default_factory=Counter)
    hlo_error: str = ""  # why the optimized HLO (kernels, collectives) could not be read, when it could not
    collectives: list[Collective] = dataclasses.field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        """What one device holds at the peak: arguments and temporaries, outputs not donated into the arguments."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def compiled(self) -> bool:
        return not self.error


def batch_specs(program: Program, cfg: TrainConfig) -> dict:
    """The train step's batch as ShapeDtypeStructs on the program's mesh (with segment ids when the mask reads
    them)."""
    B, T = cfg.data.batch_size, cfg.data.seq_len
    fields = [("inputs", jnp.int32), ("targets", jnp.int32), ("loss_mask", jnp.float32)]
    if uses_documents(parse_mask(cfg.model.attention_mask)):
        fields.append(("segment_ids", jnp.int32))
    return {name: jax.ShapeDtypeStruct((B, T), dtype, sharding=program.batch_sharding) for name, dtype in fields}


def compile_train_step(cfg: TrainConfig, layout: MeshLayout, cluster: Cluster) -> StepCompile:
    """Compile ``cfg``'s train step under ``layout`` for ``cluster`` (its toolchain enabled in this process).
    A program that does not compile (too big for a device's memory, a kernel that does not fit) is returned with
    ``error`` set to XLA's first line; bad configs and layouts raise as they would in a run."""
    validate(cfg)
    mesh = build_mesh(layout, devices=cluster_devices(cluster))
    program = Program(cfg, mesh, layout)
    report = StepCompile(layout, program.microbatches, 0.0)
    _planner_figures(report, cfg, layout, cluster)
    t0 = time.perf_counter()
    try:
        with tracing_for(cluster.platform), jax.set_mesh(mesh):
            compiled = program.train_step.lower(program.abstract_with_shardings(), batch_specs(program, cfg)).compile()
    except Exception as e:  # XLA's RESOURCE_EXHAUSTED and friends: the row says why
        report.compile_s, report.error = time.perf_counter() - t0, first_line(e)
        return report
    report.compile_s = time.perf_counter() - t0
    _read(report, compiled)
    return report


def compile_decode_step(
    cfg: TrainConfig, layout: MeshLayout, cluster: Cluster, prompts: int = 1, sampler: generate.Sampler | None = None
) -> StepCompile:
    """Compile generate's decode step (`generate.lower_decode_step`, the step `stream` runs per token) for
    ``cfg``'s model as load_model places it under ``layout`` on ``cluster``: float32 params by the layout's rules,
    the compute and KV cache in the model's dtype. The batch is ``prompts`` rounded up as generate rounds it (a
    power of two, then a multiple of the layout's batch shards); the cache holds ``cfg.data.seq_len`` tokens
    (prompt and new), bucketed as generate buckets it; ``sampler`` (default greedy) picks the tokens. Layouts
    generation refuses raise ValueError.

    XLA leaves out of the program the inputs it does not read, and the decode step reads per-layer copies of the
    weights (`_decode_weights`; for one row on one device, transposed output projections in place of two of
    them), not the stacked params a run also keeps: their bytes per device are ``held_bytes``, beside XLA's."""
    validate(cfg)
    generate.check_layout(layout, cfg.model)
    mesh = build_mesh(layout, devices=cluster_devices(cluster))
    program = Program(cfg, mesh, layout)
    model = nnx.merge(program.graphdef, program.abstract_with_shardings().params)
    where = generate.placement_of(nnx.state(model), layout.rules)
    rows = generate.batch_rows(prompts, where.batch_shards() if where else 1)
    cache_len = generate.bucket(cfg.data.seq_len)
    report = StepCompile(layout, 1, 0.0, step="decode", rows=rows, cache_len=cache_len)
    sampler = sampler or generate.Sampler()
    t0 = time.perf_counter()
    try:
        with tracing_for(cluster.platform):
            lowered, args = generate.lower_decode_step(model, rows, cache_len, sampler, layout.rules)
            compiled = lowered.compile()
    except Exception as e:  # as in compile_train_step
        report.compile_s, report.error = time.perf_counter() - t0, first_line(e)
        return report
    report.compile_s = time.perf_counter() - t0
    _read(report, compiled)
    passed = sum(_device_bytes(a) for a in jax.tree.leaves(args))
    report.held_bytes = max(0, passed - report.argument_bytes)
    return report


def _read(report: StepCompile, compiled) -> None:
    """XLA's per-device memory, and the kernels and collectives of the optimized HLO."""
    memory = compiled.memory_analysis()
    report.argument_bytes = memory.argument_size_in_bytes
    report.output_bytes = memory.output_size_in_bytes
    report.alias_bytes = memory.alias_size_in_bytes
    report.temp_bytes = memory.temp_size_in_bytes
    try:
        text = compiled.as_text()
    except Exception as e:  # e.g. a program of over 2 GiB cannot be printed: its memory still stands
        report.hlo_error = first_line(e)
        return
    report.kernels, report.collectives = custom_kernels(text), collectives(text)


def _device_bytes(arg) -> int:
    """One device's share of an argument (its shard's bytes; a whole host value, without a sharding)."""
    shape = arg.shape if arg.sharding is None else arg.sharding.shard_shape(arg.shape)
    return math.prod(shape) * arg.dtype.itemsize


def _planner_figures(report: StepCompile, cfg: TrainConfig, layout: MeshLayout, cluster: Cluster) -> None:
    """The planner's memory, step time and MFU for the same step (microbatches as the program resolved them)."""
    d = cfg.data
    try:
        e = evaluate(
            ModelShape.from_config(cfg.model),
            layout,
            cluster.hardware,
            d.batch_size * d.seq_len,
            d.seq_len,
            cfg.model.remat,
            step_microbatches(cfg, layout, cluster.platform),
        )
    except (ArithmeticError, ValueError):  # a layout the planner does not model
        return
    report.planner_bytes, report.planner_step_s, report.planner_mfu = e.memory.total, e.step_s, e.mfu
