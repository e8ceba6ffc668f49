"""Expert parallelism for a cluster: every MoE layer's experts split over 8 devices (one 8-GPU node: the token
copies' all-to-alls stay on its fast links), FSDP over the rest; for a model with model.num_experts divisible by 8."""

from sharding import MeshLayout


def layout(num_devices: int) -> MeshLayout:
    return MeshLayout(expert=8, fsdp=num_devices // 8)
