"""An MoE model in a pipeline for a cluster: 4 stages (1F1B, 4 microbatches), each stage's experts split over 4
devices, FSDP over the rest (64 H100s: FSDP 4); for a model with model.num_experts divisible by 4."""

from sharding import MeshLayout


def layout(num_devices: int) -> MeshLayout:
    return MeshLayout(expert=4, pipeline=4, fsdp=num_devices // 16, pipeline_microbatches=4)
