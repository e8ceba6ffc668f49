"""Context parallelism inside a 3D layout: the sequence over 2 devices, params over 2 (FSDP), heads over 2."""

from sharding import MeshLayout

layout = MeshLayout(context=2, fsdp=2, tensor=2)
