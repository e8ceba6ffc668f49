"""Compile for accelerators this machine does not have: an NVIDIA H100, and TPU v4 / v5e / v5p / v6e pods.

XLA compiles a program for a device it cannot see when it has the device's compiler: jax's CUDA PJRT plugin (with a
GpuTargetConfig text proto describing the GPU, below, and CUDA's ``ptxas`` on the PATH), or ``libtpu`` (with a TPU
topology such as ``v5p:4x4x4``, 64 chips). Triton then compiles every Pallas kernel for sm_90 and checks its shared
memory against the H100's 227 KiB per block; Mosaic compiles every TPU kernel and checks VMEM and SMEM. So a kernel
or a step that would not fit on the device fails here, with XLA's own RESOURCE_EXHAUSTED message.

Each toolchain is kept out of the project's environment: installed beside jax, it would make every CPU process try
(and fail) to start that backend. ``install`` puts it in a cache directory of its own and ``enable`` adds that
directory to this process only, before JAX starts its backends, and keeps CPU the default device::

    enable(LIBTPU, install(LIBTPU))            # first thing in the process (or CUDA_PLUGIN)
    mesh = tpu_mesh("v5p", 64)
    compiled = compile_on(mesh, f, jax.ShapeDtypeStruct((B, T, D), jnp.bfloat16))

Pallas TPU lowering asks the mesh in context which TPU generation it compiles for; ``compile_on`` sets it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np


class TargetError(RuntimeError):
    """A toolchain cannot be installed or enabled here, or a target is not known; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """A compiler jax loads as a plugin, installed with pip into a directory of its own."""

    name: str  # what messages call it
    packages: tuple[str, ...]  # pip requirements, pinned to this jax
    env_var: str  # overrides the directory
    markers: tuple[str, ...]  # paths inside the directory that a finished install has

    @property
    def cache_name(self) -> str:
        return "-".join(p.replace("==", "-").replace(".*", "") for p in self.packages[:1])


def _libtpu_requirement() -> str:
    """The libtpu jax's own ``tpu`` extra pins (``libtpu==0.0.42.*`` for jax 0.10.2): the one it was built with."""
    for req in importlib.metadata.requires("jax") or ():
        m = re.match(r"libtpu\s*(==\s*[\w.*]+)", req)
        if m and "tpu" in req.split(";", 1)[-1]:
            return "libtpu" + m.group(1).replace(" ", "")
    raise TargetError(f"jax {jax.__version__} names no libtpu in its 'tpu' extra; cannot pick a libtpu to install")


CUDA_PLUGIN = Toolchain(
    "CUDA plugin",
    (f"jax-cuda13-plugin=={jax.__version__}", f"jax-cuda13-pjrt=={jax.__version__}"),
    "JAXLM_CUDA_PLUGIN_DIR",
    ("jax_plugins/xla_cuda13", "jax_cuda13_plugin"),
)


@functools.cache
def libtpu() -> Toolchain:
    return Toolchain("libtpu", (_libtpu_requirement(),), "JAXLM_LIBTPU_DIR", ("libtpu",))


def toolchain_dir(toolchain: Toolchain) -> Path:
    """Where ``toolchain`` for this jax lives: its environment variable, else a per-version cache directory."""
    if os.environ.get(toolchain.env_var):
        return Path(os.environ[toolchain.env_var])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "jaxlm" / toolchain.cache_name


def installed(toolchain: Toolchain, directory: Path) -> bool:
    return all((Path(directory) / m).is_dir() for m in toolchain.markers)


def install(toolchain: Toolchain, directory: Path | None = None) -> Path:
    """Install ``toolchain`` into ``directory`` with pip unless it is there (CUDA ~130 MB, libtpu ~300 MB download).

    Installs into a temporary sibling and renames it into place, so concurrent installs (test workers) and an
    interrupted one never leave a half-written toolchain behind."""
    directory = toolchain_dir(toolchain) if directory is None else Path(directory)
    if installed(toolchain, directory):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=directory.name + ".", dir=directory.parent))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check"]
    proc = subprocess.run([*cmd, "--target", str(staging), *toolchain.packages], capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        said = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise TargetError(f"could not install {' '.join(toolchain.packages)} into {directory} (pip: {said})")
    try:
        staging.rename(directory)
    except OSError:  # another process finished first: theirs is as good as ours
        shutil.rmtree(staging, ignore_errors=True)
        if not installed(toolchain, directory):
            raise
    return directory


# libtpu looks for a TPU VM's metadata server and host list when it loads, and prints a page of warnings when there is
# none, and it takes /tmp/libtpu_lockfile so that one process owns the chips (a second one aborts: parallel test
# workers, two compiles at once). These say "no TPU here, compile only" before it loads.
_LIBTPU_COMPILE_ONLY = {
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_ACCELERATOR_TYPE": "v5p-8",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}


def enable(toolchain: Toolchain, directory: Path | None = None) -> None:
    """Make ``toolchain`` in ``directory`` visible to this process, with CPU kept as the default device.

    Must run before anything starts JAX's backends (an array, jax.devices()): JAX looks for plugins once."""
    from jax._src import xla_bridge

    directory = toolchain_dir(toolchain) if directory is None else Path(directory)
    if not installed(toolchain, directory):
        raise TargetError(f"no {toolchain.name} in {directory}; install it with pallas_kernels.targets.install")
    if str(directory) in sys.path:
        return
    if xla_bridge.backends_are_initialized():
        raise TargetError("targets.enable must run before JAX starts its backends (it looks for plugins once)")
    sys.path.insert(0, str(directory))
    jax.config.update("jax_platforms", "cpu")  # the toolchain compiles; it must not try to run on an absent device
    if toolchain is CUDA_PLUGIN and shutil.which("ptxas") is None:
        raise TargetError("CUDA's ptxas is not on the PATH; XLA needs it to compile for a GPU")
    if toolchain.name == "libtpu":
        for key, value in _LIBTPU_COMPILE_ONLY.items():
            os.environ.setdefault(key, value)


def install_plugin(directory: Path | None = None) -> Path:
    """The CUDA plugin, installed (``install(CUDA_PLUGIN, directory)``)."""
    return install(CUDA_PLUGIN, directory)


def enable_plugin(directory: Path | None = None) -> None:
    """The CUDA plugin, enabled (``enable(CUDA_PLUGIN, directory)``)."""
    enable(CUDA_PLUGIN, directory)


def plugin_dir() -> Path:
    return toolchain_dir(CUDA_PLUGIN)


def set_up_plugin(install_missing: bool = True) -> Path:
    """The CUDA plugin enabled from its directory, installed there first unless ``install_missing`` is False: what
    a command that compiles for an H100 does before JAX starts its backends. TargetError says what is missing."""
    directory = plugin_dir()
    if install_missing:
        directory = install_plugin(directory)
    enable_plugin(directory)
    return directory


# ----------------------------------------------------------------------------- GPU: the H100

# An H100 SXM5 80 GB as XLA's GPU compiler sees it (values from NVIDIA's published device properties: compute
# capability 9.0, 132 SMs, 228 KiB shared memory per SM of which 227 KiB opt-in per block, 64K registers, 50 MiB L2,
# 80 GB HBM3 at 3.35 TB/s, 1.98 GHz boost clock).
H100_SXM = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  cuda_compute_capability { major: 9 minor: 0 }
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

H100_SHARED_MEMORY_PER_BLOCK = 232448  # bytes: what a kernel may ask for, and what the compile checks against
H100_SMS = 132  # streaming multiprocessors (core_count above): how many resident CTAs fill one
H100_MEMORY = 84942979072  # bytes of HBM3 (device_memory_size above)
H100_CUDNN = (91000, "9.0")  # cuDNN 9.10 and sm_90 (dnn_version_info and cuda_compute_capability above)


def sm_count() -> int:
    """The SMs that resident CTAs fill: the local GPU's, else an H100's (compiling for one, or the interpreter)."""
    device = jax.devices()[0]
    return (getattr(device, "core_count", None) if device.platform == "gpu" else None) or H100_SMS


def cudnn_attention_takes(dtype, head_dim: int) -> bool:
    """Whether cuDNN's fused attention (``jax.nn.dot_product_attention(implementation="cudnn")``) takes queries of
    this dtype and head dim: bf16 or fp16, head dim a multiple of 8 up to 128 (its forward and backward both
    support those on Ampere and Hopper). The model's attention and the planner's memory ask the same question."""
    return jax.numpy.dtype(dtype) in (jax.numpy.bfloat16, jax.numpy.float16) and head_dim % 8 == 0 and head_dim <= 128


@functools.cache
def h100_devices(count: int = 1) -> tuple:
    """``count`` deviceless H100s described by H100_SXM, 8 to a host (topology slices x hosts x GPUs per host)."""
    from jax.experimental import topologies

    hosts, per_host = (1, count) if count <= 8 else (count // 8, 8)
    if hosts * per_host != count:
        raise TargetError(f"{count} H100s: give a multiple of 8 (8 to a host), or 1-8")
    topology = topologies.get_topology_desc(platform="cuda", target_config=H100_SXM, topology=f"1x{hosts}x{per_host}")
    return tuple(topology.devices)


@functools.cache
def h100_mesh() -> jax.sharding.Mesh:
    """A one-device mesh (axis "data") on an H100 described by H100_SXM."""
    return jax.sharding.Mesh(np.array(h100_devices(1)), ("data",))


def on_h100(x: jax.ShapeDtypeStruct, mesh: jax.sharding.Mesh | None = None) -> jax.ShapeDtypeStruct:
    """``x`` placed whole on the H100 mesh (an argument spec compile_for_gpu can lower against)."""
    sharding = jax.sharding.NamedSharding(mesh or h100_mesh(), jax.sharding.PartitionSpec())
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


@contextlib.contextmanager
def tracing_for(platform: str):
    """Trace for ``platform``, "gpu" (the H100 that H100_SXM describes) or "tpu", whatever this machine has: kernels
    lower for it (``kernel_inputs.compile_target``), and on "gpu" jax's cuDNN attention (``attention_impl=jax``,
    what ``auto`` picks for causal bf16 attention) traces without a GPU. While it traces, jax asks the local cuDNN
    for its version and the local GPU for its compute capability, and refuses ("cuDNN is not detected") where there
    is none; told H100_SXM's, it emits the custom calls, which XLA compiles deviceless: their HLO, layouts and the
    kernels around them, not cuDNN's own graph, whose workspace is sized on a device. Where a GPU is here, jax asks
    it as usual."""
    from .kernel_inputs import compile_target

    version, capability = H100_CUDNN
    answers = {
        "check_cudnn_version": lambda: version,
        "check_compute_capability": lambda wanted: _capability(capability) >= _capability(wanted),
        "is_cuda_compute_capability_equal": lambda wanted: _capability(capability) == _capability(wanted),
    }
    cudnn = _cudnn_attention_module() if platform == "gpu" and jax.default_backend() != "gpu" else None
    if cudnn is None or not all(hasattr(cudnn, name) for name in answers):  # nothing to answer, or a jax that
        with compile_target(platform):  # asks elsewhere: cuDNN's attention then fails as jax makes it
            yield
        return
    saved = {name: getattr(cudnn, name) for name in answers}
    for name, answer in answers.items():
        setattr(cudnn, name, answer)
    try:
        with compile_target("gpu"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(cudnn, name, fn)


def _cudnn_attention_module():
    """jax's cuDNN attention module, where jax 0.10 asks its questions (a private path), or None."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo
    except ImportError:
        return None
    return fused_attention_stablehlo


def _capability(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def compile_for_gpu(fn, *args):
    """Lower and compile ``fn`` for the H100; ``args`` are ShapeDtypeStructs (None passes through). Returns the
    compiled executable; raises XLA's error (e.g. RESOURCE_EXHAUSTED: shared memory) when it does not compile."""
    placed = [None if a is None else on_h100(a) for a in args]
    with tracing_for("gpu"):
        return jax.jit(fn).lower(*placed).compile()


# ----------------------------------------------------------------------------- TPU: v4, v5e, v5p, v6e


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
    """A TPU generation as libtpu's topology descriptions name it; a device's HBM as XLA's TPU compiler reports it
    available (its RESOURCE_EXHAUSTED message, 2026-11-25: a v4 device is one of a chip's two TensorCores), and a
    chip's dense bf16 peak (Google's published specs)."""

    name: str  # v5p
    dims: int  # 3 for 3D tori (v4, v5p), 2 for 2D (v5e, v6e)
    max_chips: int  # one slice
    hbm_bytes: int  # per device, as XLA makes it available
    peak_flops: float  # dense bf16 FLOP/s per chip

    def topology(self, chips: int) -> str:
        """libtpu's name of a slice of ``chips`` chips, e.g. ``v5p:4x4x4``: powers of two, as square as possible,
        at least a host's 4 chips (libtpu describes whole hosts)."""
        if chips < 4 or chips & (chips - 1) or chips > self.max_chips:
            raise TargetError(
                f"TPU {self.name}: {chips} chips is not a slice libtpu describes (a power of two from 4 to "
                f"{self.max_chips})"
            )
        sides = [1] * self.dims
        for _ in range(chips.bit_length() - 1):
            sides[sides.index(min(sides))] *= 2
        return f"{self.name}:{'x'.join(str(n) for n in sorted(sides, reverse=True))}"


GiB = 1 << 30
TPU_GENERATIONS = {
    "v4": TpuGeneration("v4", 3, 4096, int(15.25 * GiB), 275e12),
    "v5e": TpuGeneration("v5e", 2, 256, int(15.75 * GiB), 197e12),
    "v5p": TpuGeneration("v5p", 3, 8960, int(95.74 * GiB), 459e12),
    "v6e": TpuGeneration("v6e", 2, 256, int(31.25 * GiB), 918e12),
}


def tpu_generation(name: str) -> TpuGeneration:
    if name not in TPU_GENERATIONS:
        raise TargetError(f"unknown TPU generation {name!r}; choose one of {', '.join(TPU_GENERATIONS)}")
    return TPU_GENERATIONS[name]


@functools.cache
def tpu_devices(generation: str, chips: int = 4) -> tuple:
    """The deviceless devices of a ``chips``-chip slice (libtpu must be enabled). A v4 chip shows as two devices
    (its TensorCores), a v5p chip as one (megacore)."""
    from jax.experimental import topologies

    name = tpu_generation(generation).topology(chips)
    return tuple(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)


def tpu_mesh(generation: str, chips: int = 4, shape: tuple[int, ...] | None = None, names=("data",)):
    """A mesh over a ``chips``-chip slice; one axis of every device unless ``shape`` / ``names`` say otherwise."""
    devices = np.array(tpu_devices(generation, chips))
    return jax.sharding.Mesh(devices.reshape(shape or (devices.size,)), tuple(names))


def compile_on(mesh: jax.sharding.Mesh, fn, *args, platform: str | None = None):
    """Lower and compile ``fn`` for ``mesh``'s devices; ``args`` are ShapeDtypeStructs (placed whole on the mesh
    unless they carry a sharding; None passes through). The mesh is set while tracing, which Pallas TPU lowering
    reads for the generation, and kernels trace for the mesh's platform. Raises XLA's error when it does not fit."""
    platform = platform or ("tpu" if mesh.devices.flat[0].platform == "tpu" else "gpu")
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def place(a):
        if a is None or getattr(a, "sharding", None) is not None:
            return a
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole)

    with tracing_for(platform), jax.set_mesh(mesh):
        return jax.jit(fn).lower(*(place(a) for a in args)).compile()


def compile_for_tpu(fn, *args, generation: str = "v5p"):
    """``compile_on`` one chip of ``generation`` (the smallest slice's first device)."""
    return compile_on(_one_chip(generation), fn, *args)


def _one_chip(generation: str) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(tpu_devices(generation, 4)[:1]), ("data",))


def first_line(error: BaseException) -> str:
    """An error's first non-empty line: what a report shows."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}".strip()
