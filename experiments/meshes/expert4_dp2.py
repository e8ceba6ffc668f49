"""Expert parallelism: every MoE layer's experts split over 4 devices (token copies exchanged by all-to-all,
sharding.experts), the batch over all 8 (expert x data); for a model with model.num_experts divisible by 4."""

from sharding import MeshLayout

layout = MeshLayout(data=2, expert=4)
