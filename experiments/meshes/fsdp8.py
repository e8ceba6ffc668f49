"""FSDP over 8 devices: the batch and every parameter's `embed` dimension split 8 ways; each layer's params are
all-gathered for its matmuls and their gradients reduce-scattered."""

from sharding import MeshLayout

layout = MeshLayout(fsdp=8)
