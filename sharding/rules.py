"""Logical axis names (on params and activations) -> mesh axes.

The model tags arrays with names like ("embed", "mlp"); a rules table maps each name to a mesh axis, a tuple of
mesh axes, or None (replicated). Defaults: FSDP shards `embed` over `fsdp` (XLA all-gathers each layer's params
where they are used and reduce-scatters their gradients), and over `context` too when a layout has one; tensor
parallelism splits heads / mlp / vocab over `tensor` (Megatron: QKV and MLP-in by column, attention-out and MLP-out
by row); the batch is split over
replica x data x fsdp (jaxlm.diloco gives each replica its own rows); the stacked `layers` axis over `pipeline`
(one contiguous block of layers per stage); the `seq` axis of activations over `context`.
The defaults table, DEFAULT_RULES, lives in sharding.logical_axes: sharding.mesh checks layouts against it too.

Activations are tagged too (`constrain`), with the rules the running program was built with (`use_rules`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sharding.logical_axes import DEFAULT_RULES
from sharding.mesh import LayoutError

LOGICAL_AXES_KEY = "logical_axes"  # the metadata key jaxlm.model writes

_ACTIVE_RULES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("jaxlm_sharding_rules", default=None)


@contextlib.contextmanager
def use_rules(rules: dict | None):
    """Rules that `constrain` applies while a program is traced (a layout file's overrides)."""
    token = _ACTIVE_RULES.set(rules or {})
    try:
        yield
    finally:
        _ACTIVE_RULES.reset(token)


def active_rules() -> dict[str, str | tuple[str, ...] | None]:
    """The rules in effect: DEFAULT_RULES with the overrides of the enclosing `use_rules` (none outside one)."""
    return {**DEFAULT_RULES, **(_ACTIVE_RULES.get() or {})}


def active_mesh_axes(logical: str) -> tuple[str, ...]:
    """The mesh axes the active rules split logical axis `logical` over, as far as the mesh in context can split
    here: axes that are not manual (inside a shard_map, e.g. pipeline stages or a DiLoCo replica) and of size > 1,
    the ones `constrain` keeps. In rule order; () outside a mesh context."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    return _splitting(mesh, active_rules().get(logical))


def _splitting(mesh, target) -> tuple[str, ...]:
    """The mesh axes of one rule target (an axis, a tuple of axes or None) that `mesh` has, not manual here and of
    size > 1."""
    free = {
        a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != jax.sharding.AxisType.Manual and mesh.shape[a] > 1
    }
    return tuple(a for a in (target if isinstance(target, tuple) else (target,)) if a in free)


def dividing_axes(sizes, axes, size: int) -> tuple[str, ...]:
    """``axes`` in order, less any that would leave their product no longer dividing ``size`` (what a
    ``shard_map`` over a dimension of ``size`` can split it over). ``sizes``: each mesh axis' size (a mesh's
    ``shape``, a layout's ``axis_sizes``)."""
    kept, shards = [], 1
    for a in axes:
        if size % (shards * sizes[a]) == 0:
            kept.append(a)
            shards *= sizes[a]
    return tuple(kept)


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """Pins an activation's sharding by logical names, e.g. ("batch", "seq", "act_embed") at layer boundaries.

    A no-op outside a mesh context, so the model also runs unsharded. Mesh axes that are manual here (inside a
    shard_map, e.g. pipeline stages) or of size 1 are left out of the constraint.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = logical_spec(axes, _ACTIVE_RULES.get())

    def keep(target):
        kept = _splitting(mesh, target)
        return kept if len(kept) > 1 else (kept[0] if kept else None)

    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*(keep(t) for t in spec))))


def logical_spec(axes: tuple[str | None, ...], rules: dict | None = None) -> P:
    """PartitionSpec for an array whose dims carry these logical names. Two dims on one mesh axis is an error.

    Memoized: the planner asks it for every parameter of every layout it weighs (70B over 32 layouts: ~10^5 calls)."""
    key = rules_key(rules)
    if key is None:  # said by the uncached path, as before
        return _logical_spec.__wrapped__(tuple(axes), tuple((rules or {}).items()))
    return _logical_spec(tuple(axes), key)


def rules_key(rules: dict | None) -> tuple | None:
    """A layout's rules as a key for memos (their sorted items), or None where a target cannot be hashed (a list,
    which a layout's validation refuses)."""
    key = tuple(sorted((rules or {}).items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


@functools.lru_cache(maxsize=4096)
def _logical_spec(axes: tuple[str | None, ...], rules: tuple[tuple[str, object], ...]) -> P:
    table = {**DEFAULT_RULES, **dict(rules)}
    used: dict[str, str] = {}
    spec = []
    for name in axes:
        target = table.get(name) if name is not None else None
        for mesh_axis in target if isinstance(target, tuple) else (target,):
            if mesh_axis is None:
                continue
            if mesh_axis in used:
                raise LayoutError(
                    f"logical axes {used[mesh_axis]!r} and {name!r} of array {axes} both map to mesh axis {mesh_axis!r}"
                )
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
            raise LayoutError(
                f"logical axis {name!r} of size {size} (array {axes}, shape {shape}) is not divisible by "
                f"mesh axis {' x '.join(repr(a) for a in mesh_axes)} = {shards}"
            )


def batch_sharding(mesh: Mesh, rules: dict | None = None) -> NamedSharding:
    """[B, T] batches: rows over the batch mesh axes."""
    return NamedSharding(mesh, logical_spec(("batch", "seq"), rules))
