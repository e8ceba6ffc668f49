"""2-way data parallel x 2-way FSDP x 2-way tensor parallel (8 devices).

The batch splits 4 ways (data x fsdp); params shard `embed` over fsdp and heads / mlp / vocab over tensor
(Megatron: the QKV and MLP-in projections split by column, the attention-out and MLP-out ones by row).
"""

from sharding import MeshLayout

layout = MeshLayout(data=2, fsdp=2, tensor=2)
