"""Compile for an NVIDIA H100 on a machine that has none.

XLA compiles a program for a GPU it cannot see when it is given that GPU's description (a GpuTargetConfig text
proto, below) and the CUDA PJRT plugin of the same version as jax, with CUDA's ``ptxas`` on the PATH. Triton then
compiles every Pallas kernel for sm_90 and checks its shared memory against the H100's 227 KiB per block, so a
kernel that would fail on the device fails here, with XLA's own RESOURCE_EXHAUSTED message.

The plugin is kept out of the project's environment: installed beside it, jax would try (and fail) to start a
CUDA backend in every CPU process. ``install_plugin`` puts it in a directory of its own and ``enable_plugin``
adds that directory to this process only, before JAX starts its backends, and keeps CPU the default device::

    enable_plugin(install_plugin())            # first thing in the process
    with compile_target("gpu"):
        compiled = compile_for_gpu(f, jax.ShapeDtypeStruct((B, T, D), jnp.bfloat16))
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax

PLUGIN_PACKAGES = ("jax-cuda13-plugin", "jax-cuda13-pjrt")

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
H100_MEMORY = 84942979072  # bytes of HBM3 (device_memory_size above)


class PluginError(RuntimeError):
    """The CUDA plugin cannot be installed or enabled here; the message says what to do."""


def plugin_dir() -> Path:
    """Where the plugin for this jax lives: $JAXLM_CUDA_PLUGIN_DIR, else a per-version cache directory."""
    if os.environ.get("JAXLM_CUDA_PLUGIN_DIR"):
        return Path(os.environ["JAXLM_CUDA_PLUGIN_DIR"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "jaxlm" / f"jax-cuda13-plugin-{jax.__version__}"


def plugin_installed(directory: Path) -> bool:
    return (directory / "jax_plugins" / "xla_cuda13").is_dir() and (directory / "jax_cuda13_plugin").is_dir()


def install_plugin(directory: Path | None = None) -> Path:
    """Install the CUDA plugin matching this jax into ``directory`` (pip, ~130 MB download) unless it is there.

    Installs into a temporary sibling and renames it into place, so concurrent installs (test workers) and an
    interrupted one never leave a half-written plugin behind."""
    directory = plugin_dir() if directory is None else Path(directory)
    if plugin_installed(directory):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=directory.name + ".", dir=directory.parent))
    pins = [f"{name}=={jax.__version__}" for name in PLUGIN_PACKAGES]
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check"]
    proc = subprocess.run([*cmd, "--target", str(staging), *pins], capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        said = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise PluginError(f"could not install {' '.join(pins)} into {directory} (pip: {said})")
    try:
        staging.rename(directory)
    except OSError:  # another process finished first: theirs is as good as ours
        shutil.rmtree(staging, ignore_errors=True)
        if not plugin_installed(directory):
            raise
    return directory


def enable_plugin(directory: Path | None = None) -> None:
    """Make the plugin in ``directory`` visible to this process, with CPU kept as the default device.

    Must run before anything starts JAX's backends (an array, jax.devices()): JAX looks for plugins once."""
    from jax._src import xla_bridge

    directory = plugin_dir() if directory is None else Path(directory)
    if not plugin_installed(directory):
        raise PluginError(f"no CUDA plugin in {directory}; install it with pallas_kernels.gpu_target.install_plugin")
    if str(directory) in sys.path:
        return
    if xla_bridge.backends_are_initialized():
        raise PluginError("enable_plugin must run before JAX starts its backends (it looks for plugins once)")
    sys.path.insert(0, str(directory))
    jax.config.update("jax_platforms", "cpu")  # the plugin compiles; it must not try to run on a GPU that is absent
    if shutil.which("ptxas") is None:
        raise PluginError("CUDA's ptxas is not on the PATH; XLA needs it to compile for a GPU")


@functools.cache
def h100_mesh() -> jax.sharding.Mesh:
    """A one-device mesh (axis "data") on an H100 described by H100_SXM."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="cuda", target_config=H100_SXM, topology="1x1x1")
    return jax.sharding.Mesh(topology.devices, ("data",))


def on_h100(x: jax.ShapeDtypeStruct, mesh: jax.sharding.Mesh | None = None) -> jax.ShapeDtypeStruct:
    """``x`` placed whole on the H100 mesh (an argument spec compile_for_gpu can lower against)."""
    sharding = jax.sharding.NamedSharding(mesh or h100_mesh(), jax.sharding.PartitionSpec())
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def compile_for_gpu(fn, *args):
    """Lower and compile ``fn`` for the H100; ``args`` are ShapeDtypeStructs (None passes through). Returns the
    compiled executable; raises XLA's error (e.g. RESOURCE_EXHAUSTED: shared memory) when it does not compile."""
    from .kernel_inputs import compile_target

    placed = [None if a is None else on_h100(a) for a in args]
    with compile_target("gpu"):
        return jax.jit(fn).lower(*placed).compile()


def first_line(error: BaseException) -> str:
    """An error's first non-empty line: what a report shows."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}".strip()
