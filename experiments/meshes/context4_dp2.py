"""Context parallelism: every row's sequence split over 4 devices (ring attention by default,
model.context_parallel=all_gather for the other variant), the batch over 2."""

from sharding import MeshLayout

layout = MeshLayout(data=2, context=4)
