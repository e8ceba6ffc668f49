"""A pipeline for a cluster: 4 stages of two chunks each (interleaved 1F1B, 4 microbatches), FSDP over the rest of
the devices (64 H100s: FSDP 16)."""

from sharding import MeshLayout


def layout(num_devices: int) -> MeshLayout:
    return MeshLayout(pipeline=4, fsdp=num_devices // 4, pipeline_schedule="interleaved-1f1b", pipeline_microbatches=4)
