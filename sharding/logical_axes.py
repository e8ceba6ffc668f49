"""The default logical axis -> mesh axis table, in a module of its own because two sides read it: the mesh
layout's divisibility checks (sharding.mesh) and the rules that place arrays (sharding.rules, which imports
sharding.mesh, so the table cannot live there)."""

from __future__ import annotations

DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("replica", "data", "fsdp", "expert"),
    "embed": "fsdp",  # a layout with a context axis adds it here (MeshLayout): its devices share the params too
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "expert": "expert",  # the experts of an MoE layer (jaxlm.moe; sharding.experts exchanges their tokens)
    "head_dim": None,
    "layers": "pipeline",
    "seq": "context",  # context parallelism (sharding.context); whole when the layout has no context axis
    "cache_seq": None,  # the slots of a generation's KV cache (jaxlm.generate)
    "act_embed": None,  # the model dimension of activations: replicated (no sequence parallelism)
}
