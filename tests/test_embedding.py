"""sharding.embedding.sharded_take on 8 simulated devices: the lookup and its gradient equal the plain one under
every way the rules can split the table, and a sharded table is never gathered whole (the compiled program moves
activations with an all-to-all and holds no full-size table)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from sharding import MeshLayout, build_mesh
from sharding.embedding import sharded_take
from sharding.rules import logical_spec, use_rules

V, D, B, T = 256, 64, 8, 12

LAYOUTS = {
    "fsdp 8": MeshLayout(fsdp=8),
    "fsdp 4 x tensor 2": MeshLayout(fsdp=4, tensor=2),
    "data 2 x fsdp 2 x tensor 2": MeshLayout(data=2, fsdp=2, tensor=2),
    "tensor 8 (vocab only)": MeshLayout(tensor=8),
    "data 8 (table replicated: the plain lookup)": MeshLayout(data=8),
}


def _run(layout, table, ids, w):
    """Value, gradient and compiled text of sum(lookup * w), the table placed as the rules shard the embedding."""
    mesh = build_mesh(layout)
    table = jax.device_put(table, NamedSharding(mesh, logical_spec(("vocab", "embed"), layout.rules)))

    def loss(table, ids):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), use_rules(layout.rules):
            x = sharded_take(table, ids)
        return jnp.sum(x * w), x

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (_, x), grad = step(table, ids)
    return x, grad, step.lower(table, ids).compile().as_text()


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_lookup_and_its_gradient_equal_the_plain_one(name):
    r = np.random.default_rng(0)
    table = jnp.asarray(r.normal(size=(V, D)), jnp.float32)
    ids = jnp.asarray(np.concatenate([r.integers(0, V, (B, T - 2)), np.full((B, 2), V - 1)], 1), jnp.int32)
    w = jnp.asarray(r.normal(size=(B, T, D)), jnp.float32)
    x, grad, hlo = _run(LAYOUTS[name], table, ids, w)
    want_x = jnp.take(table, ids, axis=0)
    want_grad = jax.grad(lambda t: jnp.sum(jnp.take(t, ids, axis=0) * w))(table)
    np.testing.assert_array_equal(x, want_x)  # a lookup: exact
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-6)  # repeated ids sum in another order
    if "fsdp" in name:
        assert "all-to-all" in hlo
    if "replicated" not in name:  # neither the table nor its gradient is ever whole on a device
        whole = [line for line in hlo.splitlines() if re.search(rf"= f32\[{V},{D}\]", line)]
        assert not whole, whole[:3]


def test_sizes_the_mesh_cannot_split_take_the_plain_lookup():
    """A batch of 3 rows over 8 FSDP devices (generation's single prompt, say) still gives the right answer."""
    table = jnp.arange(V * D, dtype=jnp.float32).reshape(V, D)
    ids = jnp.asarray([[1, 2], [3, 4], [5, 255]], jnp.int32)
    x, _, _ = _run(MeshLayout(fsdp=8), table, ids, jnp.ones((3, 2, D)))
    np.testing.assert_array_equal(x, jnp.take(table, ids, axis=0))
