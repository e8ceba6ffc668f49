"""4-way data parallel x 2 pipeline stages (8 devices), GPipe over 4 microbatches."""

from sharding import MeshLayout

layout = MeshLayout(data=4, pipeline=2, pipeline_schedule="gpipe", pipeline_microbatches=4)
