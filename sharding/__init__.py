"""Mesh layouts (Python files passed by path) -> jax Mesh, and logical-axis rules -> shardings."""

from sharding.mesh import MESH_AXES, LayoutError, MeshLayout, build_mesh, load_layout
from sharding.rules import DEFAULT_RULES, batch_sharding, logical_spec, tree_shardings

__all__ = [
    "MESH_AXES",
    "LayoutError",
    "MeshLayout",
    "build_mesh",
    "load_layout",
    "DEFAULT_RULES",
    "batch_sharding",
    "logical_spec",
    "tree_shardings",
]
