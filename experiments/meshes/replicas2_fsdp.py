"""Two DiLoCo replica groups, each sharding its replicas' params over the rest of the devices (FSDP).

With `--set diloco.replicas=2` each group trains one replica; across two processes (`sharding.launch`) the
replica axis is the process boundary, so only outer syncs cross it. Without DiLoCo, `replica` is one more
data-parallel axis.
"""

from sharding import MeshLayout


def layout(num_devices: int) -> MeshLayout:
    return MeshLayout(replica=2, fsdp=num_devices // 2)
