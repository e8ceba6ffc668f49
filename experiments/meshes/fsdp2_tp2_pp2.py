"""2-way FSDP x 2-way tensor parallel x 2 pipeline stages (8 devices), 1F1B over 4 microbatches.

Each stage holds half of the layers; inside a stage the layers are FSDP- and tensor-sharded as usual.
"""

from sharding import MeshLayout

layout = MeshLayout(fsdp=2, tensor=2, pipeline=2, pipeline_schedule="1f1b", pipeline_microbatches=4)
