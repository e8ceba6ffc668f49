"""Mesh layout files: each defines `layout`, a sharding.MeshLayout, a dict, or `layout(num_devices)`."""
