"""A mesh layout is a few integers (one per mesh axis) written in a Python file; this turns it into a `Mesh`.

Layout files define `layout` as a `MeshLayout`, a dict of axis sizes, or `def layout(num_devices)` returning either.
Everything is checked before compilation, with messages naming the axis and the numbers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from sharding.logical_axes import DEFAULT_RULES
from sharding.user_file import call_user_function, exec_python_file

MESH_AXES = ("replica", "data", "fsdp", "pipeline", "context", "expert", "tensor")  # outermost (slowest links) first
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv")  # sharding.schedules.NAMES


class LayoutError(ValueError):
    """An invalid mesh layout; the message names the axis and the numbers."""


@dataclass(frozen=True)
class MeshLayout:
    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    pipeline: int = 1
    context: int = 1  # the sequence of every row split over it (sharding.context: ring or all-gather attention)
    replica: int = 1  # DiLoCo replicas are split over it; without DiLoCo it is one more data-parallel axis
    # an MoE layer's experts split over it, token copies exchanged by all-to-all (sharding.experts); the batch splits
    # over it too, so for dense layers it is one more data-parallel axis
    expert: int = 1
    rules: dict = field(default_factory=dict)  # logical axis -> mesh axis (or tuple, or None); overrides DEFAULT_RULES
    pipeline_schedule: str = "1f1b"  # one of PIPELINE_SCHEDULES (sharding.schedules); used when pipeline > 1
    pipeline_microbatches: int = 0  # microbatches per pipelined step; 0 -> 2 * pipeline
    pipeline_virtual_stages: int = 0  # interleaved-1f1b: model chunks per stage (0 -> 2); others: 0

    def __post_init__(self):
        # A context axis' devices hold different tokens of the same rows: like FSDP's they share the params, which
        # are gathered over both (torchtitan's FSDP over dp_shard x cp). A layout's own `embed` rule wins.
        if isinstance(self.context, int) and self.context > 1 and isinstance(self.rules, dict):
            if "embed" not in self.rules:
                object.__setattr__(self, "rules", {**self.rules, "embed": ("fsdp", "context")})

    @property
    def num_microbatches(self) -> int:
        """Pipeline microbatches per (accumulation) microbatch: 1 without pipelining."""
        if self.pipeline == 1:
            return 1
        return self.pipeline_microbatches or 2 * self.pipeline

    @property
    def pipeline_chunks(self) -> int:
        """Model chunks each pipeline stage holds: 2 for ZB-V's V, the virtual stages of interleaved 1F1B, else 1."""
        if self.pipeline_schedule == "zbv":
            return 2
        if self.pipeline_schedule == "interleaved-1f1b":
            return self.pipeline_virtual_stages or 2
        return 1

    @property
    def batch_shards(self) -> int:
        """Ways the batch splits: replica x data x fsdp x expert (the default `batch` rule)."""
        return self.replica * self.data * self.fsdp * self.expert

    @property
    def axis_sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    def validate(self, num_devices: int) -> "MeshLayout":
        for axis, size in self.axis_sizes.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise LayoutError(f"mesh axis '{axis}' must be a positive int, got {size!r}")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise LayoutError(
                f"pipeline_schedule {self.pipeline_schedule!r} is unknown; choose one of "
                f"{', '.join(PIPELINE_SCHEDULES)}"
            )
        m = self.pipeline_microbatches
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise LayoutError(f"pipeline_microbatches must be an int >= 0 (0: twice the stages), got {m!r}")
        v = self.pipeline_virtual_stages
        if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v == 1:
            raise LayoutError(f"pipeline_virtual_stages must be 0 (the default) or an int >= 2, got {v!r}")
        if v and self.pipeline_schedule != "interleaved-1f1b":
            raise LayoutError(
                f"pipeline_virtual_stages = {v} applies to pipeline_schedule 'interleaved-1f1b' only, not "
                f"{self.pipeline_schedule!r}"
            )
        if self.pipeline > 1 and self.pipeline_schedule == "interleaved-1f1b" and self.num_microbatches % self.pipeline:
            raise LayoutError(
                f"pipeline_schedule 'interleaved-1f1b' runs microbatches in groups of the stages: "
                f"pipeline_microbatches = {self.num_microbatches} is not a multiple of pipeline = {self.pipeline}"
            )
        product = math.prod(self.axis_sizes.values())
        if product != num_devices:
            sizes = " x ".join(f"{a}={s}" for a, s in self.axis_sizes.items() if s != 1) or "all axes 1"
            raise LayoutError(f"mesh layout {sizes} covers {product} devices but {num_devices} are available")
        if not isinstance(self.rules, dict):
            raise LayoutError(f"rules must be a dict of logical axis -> mesh axis, got {type(self.rules).__name__}")
        check_rules(self.rules)
        return self

    def check_experts(self, num_experts: int) -> None:
        """An MoE model's experts must split evenly over the expert axis (0 experts: a dense model)."""
        if num_experts and num_experts % self.expert:
            raise LayoutError(
                f"model.num_experts = {num_experts} is not divisible by mesh axis 'expert' = {self.expert} (each "
                f"device holds num_experts / expert experts of every MoE layer)"
            )

    def check_divisibility(
        self,
        *,
        batch_size: int,
        microbatches: int,
        num_heads: int,
        num_kv_heads: int,
        mlp_dim: int,
        num_layers: int,
        seq_len: int = 0,
        num_experts: int = 0,
        moe_every: int = 1,
    ) -> None:
        """Model and batch dimensions must split evenly over the mesh axes they are sharded on (`seq_len` 0: no
        sequence to check)."""
        if seq_len and seq_len % self.context:
            raise LayoutError(
                f"data.seq_len = {seq_len} is not divisible by mesh axis 'context' = {self.context} (each device "
                f"holds seq_len / context tokens of every row)"
            )
        self.check_experts(num_experts)
        self.check_batch(batch_size, microbatches)
        check_rules(self.rules)  # an unvalidated layout's unknown axis: a LayoutError, not a KeyError below
        self._check_split("num_heads", num_heads, "heads")
        self._check_split("num_kv_heads", num_kv_heads, "kv_heads")
        self._check_split("mlp_dim", mlp_dim, "mlp")
        self.check_layers(num_layers, moe_every if num_experts else 1)

    def check_batch(self, batch_size: int, microbatches: int) -> None:
        """A step's rows split into its accumulation x pipeline microbatches, and each of those over the batch axes:
        else XLA compiles the step by giving every device every row of a microbatch (64x the work at fsdp 64)."""
        batch_shards = self.batch_shards
        splits = microbatches * self.num_microbatches
        if batch_size % splits:
            raise LayoutError(
                f"batch {batch_size} does not split into {microbatches} accumulation x "
                f"{self.num_microbatches} pipeline microbatches"
            )
        if (batch_size // splits) % batch_shards:
            raise LayoutError(
                f"microbatch size {batch_size // splits} (batch {batch_size} / {microbatches} "
                f"accumulation x {self.num_microbatches} pipeline microbatches) is not divisible by "
                f"replica x data x fsdp x expert = {batch_shards}"
            )

    def check_layers(self, num_layers: int, group: int = 1) -> None:
        """The layers split evenly over the pipeline's stages x chunks; when `group` > 1 (an MoE layer every
        model.moe_every, the rest dense) stages take whole groups of that many layers (jaxlm.train)."""
        units = self.pipeline * self.pipeline_chunks
        if num_layers % units:
            if self.pipeline_chunks > 1:
                raise LayoutError(
                    f"model.num_layers = {num_layers} does not split into pipeline = {self.pipeline} stages x "
                    f"{self.pipeline_chunks} chunks ({self.pipeline_schedule})"
                )
            raise LayoutError(
                f"model.num_layers = {num_layers} is not divisible by mesh axis 'pipeline' = {self.pipeline}"
            )
        if group > 1 and (num_layers // group) % units:
            raise LayoutError(
                f"model.num_layers / model.moe_every = {num_layers // group} groups of dense layers and an MoE layer "
                f"do not split over {units} pipeline stages x chunks per stage"
            )

    def _check_split(self, name: str, size: int, logical: str) -> None:
        """model.`name` must split over the mesh axes the layout's rules (over DEFAULT_RULES) put `logical` on,
        not over `tensor` regardless: a layout may move the heads to fsdp, or leave them whole."""
        target = {**DEFAULT_RULES, **self.rules}.get(logical)
        axes = tuple(a for a in (target if isinstance(target, tuple) else (target,)) if a is not None)
        shards = math.prod(self.axis_sizes[a] for a in axes)
        if size % shards == 0:
            return
        if axes == ("tensor",):
            raise LayoutError(f"model.{name} = {size} is not divisible by mesh axis 'tensor' = {shards}")
        raise LayoutError(
            f"model.{name} = {size} is not divisible by mesh axes {' x '.join(axes)} = {shards} (the layout's "
            f"rules split {logical} over them)"
        )


def check_rules(rules: dict) -> None:
    """Every rule targets a known mesh axis (or a tuple of them, or None)."""
    for logical, target in rules.items():
        targets = target if isinstance(target, tuple) else (target,)
        for t in targets:
            if t is not None and t not in MESH_AXES:
                raise LayoutError(f"rule {logical!r} -> {t!r}: unknown mesh axis; known axes: {', '.join(MESH_AXES)}")


def load_layout(path: str | Path, num_devices: int) -> MeshLayout:
    """Runs a layout file and returns its validated layout; every problem is a LayoutError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise LayoutError(f"mesh layout file not found: {path}")
    module = exec_python_file(path, "mesh layout", LayoutError)
    if not hasattr(module, "layout"):
        raise LayoutError(
            f"mesh layout file {path} must define `layout` (a MeshLayout, a dict, or layout(num_devices))"
        )
    layout = module.layout
    if callable(layout) and not isinstance(layout, MeshLayout):
        layout = call_user_function(layout, num_devices, path=path, kind="mesh layout", error=LayoutError)
    layout = as_layout(layout, where=f"mesh layout file {path}")
    try:
        return layout.validate(num_devices)
    except LayoutError as e:
        raise LayoutError(f"mesh layout file {path}: {e}") from None


def as_layout(value, where: str = "layout") -> MeshLayout:
    if isinstance(value, MeshLayout):
        return value
    if isinstance(value, dict):
        known = {f.name for f in dataclasses.fields(MeshLayout)}
        unknown = [key for key in value if key not in known]  # keys may be anything, e.g. ints: no sorting
        if unknown:
            raise LayoutError(f"{where}: unknown mesh axis {unknown[0]!r}; known axes: {', '.join(MESH_AXES)}")
        return MeshLayout(**value)
    raise LayoutError(f"{where}: `layout` is a {type(value).__name__}, expected MeshLayout or dict")


def build_mesh(layout: MeshLayout, devices=None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    layout.validate(len(devices))
    shape = tuple(layout.axis_sizes.values())
    grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
