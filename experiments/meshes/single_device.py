"""One device: no parallelism. The reference every other layout must match."""

from sharding import MeshLayout

layout = MeshLayout()
