"""The embedding lookup done per shard of the table, so that neither the table nor its gradient is ever whole.

Why: XLA cannot split ``jnp.take`` on a table sharded [vocab over tensor, d_model over fsdp]. It gathers the fp32
table whole on every device and forms the gradient (a scatter-add) whole before an all-reduce: on 64 TPU v5p chips
four full-size fp32 [V, D] buffers per chip at once, 8 GiB at Llama 3 8B, 16 at 70B, whatever the FSDP degree.

Here each device looks its tokens up in its own [V / tensor, D / fsdp] slice under ``shard_map``: the token ids of
the rows its FSDP group holds are all-gathered (integers: small), ids outside its vocabulary slice read zeros and the
vocabulary shards are summed (the Megatron vocab-parallel embedding), and an all-to-all trades the group's rows for
the rest of d_model. The gradient is then a scatter-add into the local slice, and the traffic is activations, not
the table. Layouts the rules shard otherwise (several mesh axes on one dimension, vocab and batch on one axis, sizes
that do not divide) take the plain lookup.

Shape suffixes follow the legend in docs/architecture.md.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sharding.rules import active_mesh_axes


def sharded_take(table_VD: jax.Array, ids_BT: jax.Array) -> jax.Array:
    """``jnp.take(table_VD, ids_BT, axis=0)`` [B, T, D], computed per shard when a mesh is in context; rows split
    as the rules split ``batch``, replicated over the table's axes."""
    plan = _plan(table_VD.shape, ids_BT.shape)
    if plan is None:
        return jnp.take(table_VD, ids_BT, axis=0)
    mesh, vocab, embed, batch = plan
    free = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != jax.sharding.AxisType.Manual}
    local_V = table_VD.shape[0] // (mesh.shape[vocab] if vocab else 1)

    def lookup(table_vd, ids_bt):
        if embed:  # the rows of the whole FSDP group: this device holds their slice of d_model
            ids_bt = jax.lax.all_gather(ids_bt, embed, axis=0, tiled=True)
        if vocab:
            local = ids_bt - jax.lax.axis_index(vocab) * local_V
            inside = (local >= 0) & (local < local_V)
            x_btd = jnp.take(table_vd, jnp.where(inside, local, 0), axis=0)
            x_btd = jax.lax.psum(jnp.where(inside[..., None], x_btd, 0), vocab)
        else:
            x_btd = jnp.take(table_vd, ids_bt, axis=0)
        if embed:  # back to this device's rows, with every column of d_model
            x_btd = jax.lax.all_to_all(x_btd, embed, split_axis=0, concat_axis=2, tiled=True)
        return x_btd

    return jax.shard_map(
        lookup,
        mesh=mesh,
        in_specs=(P(vocab, embed), P(batch or None, None)),
        out_specs=P(batch or None, None, None),
        axis_names=free,
    )(table_VD, ids_BT)


def _plan(table_shape, ids_shape):
    """(mesh, vocab axis, embed axis, batch axes) for the sharded lookup, or None for the plain one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return None
    (V, D), (B, _) = table_shape, ids_shape
    vocab, embed, batch = (active_mesh_axes(n) for n in ("vocab", "embed", "batch"))
    if len(vocab) > 1 or len(embed) > 1 or not (vocab or embed) or set(vocab) & set(batch):
        return None
    if embed and embed[0] not in batch:  # d_model split over an axis that does not split the rows
        return None
    shards = math.prod(mesh.shape[a] for a in batch)
    if B % shards or (vocab and V % mesh.shape[vocab[0]]) or (embed and D % mesh.shape[embed[0]]):
        return None
    return mesh, (vocab[0] if vocab else None), (embed[0] if embed else None), batch
