"""Accelerator presets for the cost planner: what a device computes, holds and moves per second.

Figures are vendor datasheet numbers per device. `mfu` is the fraction of dense peak a well-tuned large-model
training step reaches on matmuls (40-55% is what published Llama-scale runs report on H100/A100/TPU); the planner
divides model FLOPs by `peak_flops * mfu`. Bandwidths are per device, per direction: `intra_bw` inside the fast
domain (NVLink inside a node, ICI inside a TPU slice), `inter_bw` across it (InfiniBand, DCN).
"""

from __future__ import annotations

from dataclasses import dataclass

from sharding.mesh import LayoutError

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 FLOP/s per device (datasheet)
    mfu: float  # assumed achievable fraction of peak_flops
    hbm_bytes: float  # memory per device
    devices_per_node: int  # the fast domain: tensor parallelism stays inside it
    intra_bw: float  # bytes/s per device per direction inside the fast domain
    inter_bw: float  # bytes/s per device per direction across fast domains
    usable_memory: float = 0.9  # of hbm_bytes; the rest is runtime, XLA workspace and fragmentation
    platform: str = "gpu"  # gpu | tpu | cpu: whose XLA program the memory estimate follows (planner.memory_per_device)

    @property
    def torus_dims(self) -> int:
        """A TPU slice's ICI torus (3 on v5p), from the name as from a device's kind (`torus_dims`): XLA:TPU gathers
        over a whole 3D torus by all-reduce."""
        return torus_dims(self.name)

    @property
    def flops(self) -> float:
        """Achievable FLOP/s per device: the planner's compute rate."""
        return self.peak_flops * self.mfu

    def bandwidth(self, span: int) -> float:
        """Per-device bandwidth of a collective whose group spans `span` consecutive devices."""
        return self.intra_bw if span <= self.devices_per_node else self.inter_bw


PRESETS = {
    # H100 SXM: 989 TFLOP/s bf16 dense, 80 GB HBM3, 8 per node, NVLink 4 (900 GB/s bidirectional = 450 per
    # direction), one 400 Gb/s InfiniBand NIC per GPU = 50 GB/s.
    "h100-sxm": Hardware("h100-sxm", 989e12, 0.45, 80 * GB, 8, 450 * GB, 50 * GB),
    # H200: the H100's compute and links with 141 GB of HBM3e.
    "h200": Hardware("h200", 989e12, 0.45, 141 * GB, 8, 450 * GB, 50 * GB),
    # A100 SXM 80GB: 312 TFLOP/s bf16, NVLink 3 (600 GB/s bidirectional), one 200 Gb/s HDR NIC per GPU.
    "a100": Hardware("a100", 312e12, 0.45, 80 * GB, 8, 300 * GB, 25 * GB),
    # TPU v5p: 459 TFLOP/s bf16, 95 GB HBM; a slice (up to 8,960 chips) is one ICI 3D torus: 4,800 Gb/s per chip
    # over 6 links, of which a ring along one torus dimension uses 2 (~200 GB/s); slices talk over DCN, about
    # 200 Gb/s per 4-chip host (~6 GB/s per chip).
    "tpu-v5p": Hardware("tpu-v5p", 459e12, 0.5, 95 * GB, 8960, 200 * GB, 6.25 * GB, platform="tpu"),
    # TPU v5e: 197 TFLOP/s bf16, 16 GB HBM; slices of up to 256 chips in a 2D torus, 1,600 Gb/s of ICI per chip over
    # 4 links, of which a ring along one dimension uses 2 (~100 GB/s); DCN as v5p's.
    "tpu-v5e": Hardware("tpu-v5e", 197e12, 0.5, 16 * GB, 256, 100 * GB, 6.25 * GB, platform="tpu"),
    # TPU v6e (Trillium): 918 TFLOP/s bf16, 32 GB HBM; slices of up to 256 chips in a 2D torus, 3,584 Gb/s of ICI per
    # chip over 4 links (~224 GB/s along one dimension); DCN as v5p's.
    "tpu-v6e": Hardware("tpu-v6e", 918e12, 0.5, 32 * GB, 256, 224 * GB, 6.25 * GB, platform="tpu"),
    # A small fake for tests and CPU experiments (8 simulated devices per "node").
    "cpu": Hardware("cpu", 200e9, 0.5, 16 * GB, 8, 10 * GB, 1 * GB, platform="cpu"),
}


def torus_dims(device_kind: str) -> int:
    """The ICI torus of the TPU a jax ``device_kind`` names ("TPU v4", "TPU v5p", "TPU v5 lite", "TPU v6 lite"): 3 for
    v4 and v5p slices, 2 for v5e and v6e; 0 for anything that is not a TPU."""
    kind = device_kind.lower()
    if "tpu" not in kind:
        return 0
    return 3 if ("v4" in kind or "v5p" in kind) else 2


def get_hardware(name: str) -> Hardware:
    if name not in PRESETS:
        raise LayoutError(f"unknown hardware preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]
