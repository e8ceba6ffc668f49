"""Fully sharded data parallelism: params and optimizer state sharded over all devices (`embed` on `fsdp`)."""

from sharding import MeshLayout


def layout(num_devices: int) -> MeshLayout:
    return MeshLayout(fsdp=num_devices)
