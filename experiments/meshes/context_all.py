"""Every device holds a slice of each sequence (and, as FSDP would, of the params): one long sequence per step,
e.g. 1,048,576 tokens over 64 GPUs (docs/results/context_parallel.md)."""

from sharding import MeshLayout

layout = lambda n: MeshLayout(context=n)  # noqa: E731
