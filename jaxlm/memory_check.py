"""Memory before compiling: a step that cannot fit is refused in one line, not after minutes of compiling.

The estimate is the planner's (`sharding.memory_model.memory_per_device`): params, grads and optimizer state, the
activations kept for the backward, the logits, per device under the run's layout. It leaves out XLA's scratch, so
it errs low: a refusal is never a false alarm. On TPU the estimate is a fit that reads up to TPU_FIT_HIGH times
XLA's figure, so a TPU step is refused only past that. What a device has: its allocator's limit on an accelerator;
on CPU, where every simulated device shares the host, the host's available RAM divided among the local devices.
"""

from __future__ import annotations

import jax

from jaxlm.config import ConfigError, TrainConfig
from jaxlm.train import step_microbatches
from sharding.hardware import torus_dims
from sharding.memory_model import TPU_FIT_HIGH, memory_per_device, padded_gathers
from sharding.mesh import MeshLayout
from sharding.model_shape import ModelShape


def device_memory_bytes() -> tuple[float, str] | None:
    """(bytes one device may use, what that is), or None when this backend does not say."""
    device = jax.local_devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        limit = stats.get("bytes_limit")
        return (float(limit), f"a {device.device_kind} has") if limit else None
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = float(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    n = jax.local_device_count()
    return available / n, f"this host has available (shared by {n} CPU devices)" if n > 1 else "this host has available"


def estimated_step_bytes(cfg: TrainConfig, layout: MeshLayout, microbatches: int | None = None) -> float:
    """The planner's bytes per device for this run's step on the default device's platform; ``microbatches``
    None is what the step takes (``step_microbatches``)."""
    d = cfg.data
    device = jax.devices()[0]
    if microbatches is None:
        microbatches = step_microbatches(cfg, layout, device.platform)
    memory = memory_per_device(
        ModelShape.from_config(cfg.model),
        layout,
        d.batch_size,
        d.seq_len,
        cfg.model.remat,
        microbatches,
        device.platform,
        padded_gathers(layout, device.platform, torus_dims(device.device_kind)),
    )
    return memory.total


def check_step_fits(cfg: TrainConfig, layout: MeshLayout, available: tuple[float, str] | None = None) -> None:
    """Raises ConfigError naming the estimate, the memory there is and the knobs that shrink the step."""
    available = device_memory_bytes() if available is None else available
    if available is None:
        return
    limit, where = available
    platform = jax.devices()[0].platform
    try:
        microbatches = step_microbatches(cfg, layout, platform)
        need = estimated_step_bytes(cfg, layout, microbatches)
    except (ArithmeticError, ValueError):  # a layout the planner does not model: compiling will tell
        return
    if need <= limit * (TPU_FIT_HIGH if platform == "tpu" else 1.0):
        return
    d, m = cfg.data, cfg.model
    auto = "" if d.microbatches else ", auto"
    raise ConfigError(
        f"the train step needs about {need / 2**30:.1f} GiB per device (estimated before compiling) but {where} "
        f"{limit / 2**30:.1f} GiB; make it smaller: data.batch_size ({d.batch_size}), data.seq_len ({d.seq_len}), "
        f"more data.microbatches (now {microbatches}{auto}), model.remat=full (now {m.remat}), or a --mesh layout "
        f"that shards it (fsdp / tensor / pipeline) over more devices"
    )
