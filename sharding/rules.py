"""Logical axis names (on params and activations) -> mesh axes.

The model tags arrays with names like ("embed", "mlp"); a rules table maps each name to a mesh axis, a tuple of
mesh axes, or None (replicated). Defaults: FSDP shards `embed` over `fsdp`; tensor parallelism splits heads / mlp /
vocab over `tensor`; the batch is split over data x fsdp.
"""

from __future__ import annotations

import math

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sharding.mesh import MESH_AXES, LayoutError  # mesh imports rules only inside functions: no cycle

LOGICAL_AXES_KEY = "logical_axes"  # the metadata key jaxlm.model writes

DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
    "layers": None,
    "seq": None,
}


def check_rules(rules: dict) -> None:
    for logical, target in rules.items():
        targets = target if isinstance(target, tuple) else (target,)
        for t in targets:
            if t is not None and t not in MESH_AXES:
                raise LayoutError(f"rule {logical!r} -> {t!r}: unknown mesh axis; known axes: {', '.join(MESH_AXES)}")


def logical_spec(axes: tuple[str | None, ...], rules: dict | None = None) -> P:
    """PartitionSpec for an array whose dims carry these logical names. Two dims on one mesh axis is an error."""
    table = {**DEFAULT_RULES, **(rules or {})}
    used: dict[str, str] = {}
    spec = []
    for name in axes:
        target = table.get(name) if name is not None else None
        for mesh_axis in (target if isinstance(target, tuple) else (target,)):
            if mesh_axis is None:
                continue
            if mesh_axis in used:
                raise LayoutError(f"logical axes {used[mesh_axis]!r} and {name!r} of array {axes} both map to mesh "
                                  f"axis {mesh_axis!r}")
            used[mesh_axis] = name
        spec.append(target)
    return P(*spec)


def tree_shardings(tree, mesh: Mesh, rules: dict | None = None):
    """NamedShardings for a pytree holding nnx Variables (params, optimizer moments); other leaves replicate."""

    def one(leaf):
        if isinstance(leaf, nnx.Variable):
            axes = leaf.get_metadata(LOGICAL_AXES_KEY, None)
            spec = logical_spec(tuple(axes), rules) if axes is not None else P()
            if axes is not None:
                check_divisible(tuple(axes), tuple(leaf.shape), spec, mesh)
            return leaf.replace(NamedSharding(mesh, spec))
        return NamedSharding(mesh, P())

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def check_divisible(axes: tuple, shape: tuple[int, ...], spec: P, mesh: Mesh) -> None:
    """Every sharded dimension must split evenly over its mesh axes (JAX would fail later, deep in a traceback)."""
    for name, size, target in zip(axes, shape, spec):
        mesh_axes = target if isinstance(target, tuple) else (target,)
        shards = math.prod(mesh.shape[a] for a in mesh_axes if a is not None)
        if size % shards:
            raise LayoutError(f"logical axis {name!r} of size {size} (array {axes}, shape {shape}) is not divisible by "
                              f"mesh axis {' x '.join(repr(a) for a in mesh_axes)} = {shards}")


def batch_sharding(mesh: Mesh, rules: dict | None = None) -> NamedSharding:
    """[B, T] batches: rows over the batch mesh axes."""
    return NamedSharding(mesh, logical_spec(("batch", "seq"), rules))
