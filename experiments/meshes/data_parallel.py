"""Pure data parallelism: the batch is split over every device; params are replicated."""

from sharding import MeshLayout


def layout(num_devices: int) -> MeshLayout:
    return MeshLayout(data=num_devices)
