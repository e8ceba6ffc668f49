"""Clusters by the names people rent them under, as devices XLA can compile for without them.

    h100x64     64 H100 SXM GPUs (8 per host)        v5p-128   Google's name: 128 TensorCores = 64 v5p chips
    v5px64      64 TPU v5p chips                      v6e-256   256 v6e chips (v5e / v6e names count chips)

Each cluster knows its planner preset (sharding.hardware) and, through pallas_kernels.targets, its deviceless
devices: the CUDA plugin's or libtpu's description of that many devices, so a program compiles for the cluster on
a CPU machine (the toolchain must be enabled first, before JAX starts its backends).
"""

from __future__ import annotations

import dataclasses
import re

from pallas_kernels import targets
from sharding.hardware import Hardware, get_hardware
from sharding.mesh import LayoutError

GPUS_PER_HOST = 8
_CORES_PER_CHIP = {"v4": 2, "v5p": 2}  # Google's v4 / v5p names count TensorCores; v5e / v6e names count chips
_HARDWARE = {"h100": "h100-sxm", "v5e": "tpu-v5e", "v5p": "tpu-v5p", "v6e": "tpu-v6e"}


@dataclasses.dataclass(frozen=True)
class Cluster:
    name: str  # as the user wrote it
    kind: str  # h100 | v5e | v5p | v6e
    chips: int

    @property
    def platform(self) -> str:
        return "gpu" if self.kind == "h100" else "tpu"

    @property
    def hardware(self) -> Hardware:
        return get_hardware(_HARDWARE[self.kind])

    @property
    def toolchain(self) -> targets.Toolchain:
        return targets.CUDA_PLUGIN if self.platform == "gpu" else targets.libtpu()

    @property
    def hbm_bytes(self) -> int:
        """Memory of one device as XLA sees it (an H100's 80 GB is 79.1 GiB; a v5p chip's 95 GiB)."""
        if self.platform == "gpu":
            return targets.H100_MEMORY
        return targets.tpu_generation(self.kind).hbm_bytes

    def __str__(self):
        return f"{self.name} ({self.chips} {'H100s' if self.platform == 'gpu' else f'{self.kind} chips'})"


def parse_cluster(spec: str) -> Cluster:
    """``h100x64``, ``v5px64`` (chips) or Google's accelerator types ``v5p-128`` / ``v6e-256``; LayoutError names
    what is wrong."""
    m = re.fullmatch(r"(h100|v5e|v5p|v6e)(?:x(\d+)|-(\d+))", spec.strip().lower())
    if not m:
        raise LayoutError(
            f"unknown cluster {spec!r}: write hardware and count, e.g. h100x64, v5px64, v5p-128 (Google's name: 128 "
            f"TensorCores), v6e-256; hardware one of {', '.join(_HARDWARE)}"
        )
    kind, chips, google = m.group(1), m.group(2), m.group(3)
    if kind == "h100" and google:
        raise LayoutError(f"cluster {spec!r}: write H100 clusters as h100xN (e.g. h100x64)")
    n = int(chips or google)
    if google and kind in _CORES_PER_CHIP:
        if n % _CORES_PER_CHIP[kind]:
            raise LayoutError(f"cluster {spec!r}: a {kind} name counts TensorCores, {_CORES_PER_CHIP[kind]} per chip")
        n //= _CORES_PER_CHIP[kind]
    if kind == "h100":
        if n < 1 or (n > GPUS_PER_HOST and n % GPUS_PER_HOST):
            raise LayoutError(f"cluster {spec!r}: H100s come {GPUS_PER_HOST} to a host; give a multiple of 8 (or 1-8)")
    else:
        try:
            targets.tpu_generation(kind).topology(n)
        except targets.TargetError as e:
            raise LayoutError(f"cluster {spec!r}: {e}") from None
    return Cluster(spec, kind, n)


def cluster_for(hardware: str, devices: int) -> Cluster:
    """The cluster of ``devices`` devices of a planner hardware preset (``h100-sxm`` -> ``h100x64``)."""
    kinds = {preset: kind for kind, preset in _HARDWARE.items()}
    if hardware not in kinds:
        raise LayoutError(
            f"hardware {hardware!r} has no compiler description to check against; one of {', '.join(kinds)}"
        )
    return parse_cluster(f"{kinds[hardware]}x{devices}")


def cluster_devices(cluster: Cluster) -> list:
    """The cluster's deviceless devices, in mesh order (its toolchain must be enabled in this process)."""
    if cluster.platform == "tpu":
        return list(targets.tpu_devices(cluster.kind, cluster.chips))
    return list(targets.h100_devices(cluster.chips))
