"""Multi-process runs: joining the JAX distributed system, and which batch rows this process feeds.

One process per host (or per simulated host, see `sharding.launch`). Every process runs the same program on the
global mesh; each reads and places only the batch rows its own devices hold, so a global batch is assembled with no
cross-host copy and is bit for bit the batch a one-process run sees.
"""

from __future__ import annotations

import os
from functools import lru_cache

import jax
import numpy as np

ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "JAXLM_COORDINATOR", "JAXLM_NUM_PROCESSES", "JAXLM_PROCESS_ID"


class DistributedError(ValueError):
    """A bad multi-process setting or a failed join; the message names the setting."""


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None) -> bool:
    """Joins the distributed system if this is a multi-process run; returns whether it did.

    Values come from the arguments (CLI flags), else from the JAXLM_* variables `sharding.launch` sets. All three
    given: explicit join. None given: if a cluster JAX knows how to read (SLURM, Open MPI, Cloud TPU, ...) reports
    more than one process, `jax.distributed.initialize()` reads it; otherwise this is a single process and nothing
    happens. `num_processes=1` alone means single process. Must run before anything queries devices.
    """
    coordinator = coordinator if coordinator is not None else os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if jax.distributed.is_initialized():
        return True
    given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    if num_processes == 1 and coordinator is None and process_id in (None, 0):
        return False
    if all(v is None for v in given.values()):
        cluster = detect_cluster()
        if cluster is None:
            return False
        _use_gloo_on_cpu()
        _join(f"the {cluster} cluster environment", jax.distributed.initialize)
        return True
    missing = [flag for flag, v in given.items() if v is None]
    if missing:
        raise DistributedError(
            f"a multi-process run needs --coordinator, --num-processes and --process-id together "
            f"(or ${ENV_COORDINATOR} etc.); missing {', '.join(missing)}"
        )
    _check(coordinator, num_processes, process_id)
    _use_gloo_on_cpu()
    _join(
        f"{coordinator} as process {process_id} of {num_processes}",
        jax.distributed.initialize,
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
    )
    return True


def detect_cluster() -> str | None:
    """Name of the cluster environment JAX's own auto-detection would use, if it reports more than one process.

    Delegates to the ClusterEnv classes `jax.distributed.initialize()` consults (SLURM, Open MPI, GCE/GKE TPU,
    Kubernetes; mpi4py is opt-in there and here), so "detected" means exactly "JAX can initialize from it"; a
    1-task SLURM job or a single TPU host stays a plain single-process run.
    """
    try:
        from jax._src.clusters import ClusterEnv
    except ImportError:  # private module moved: no auto-detection, explicit flags still work
        return None
    for env in ClusterEnv._cluster_types:
        if getattr(env, "opt_in_only_method", False) or not env.is_env_present():
            continue
        try:
            count = env.get_process_count()
        except Exception as e:
            raise DistributedError(
                f"detected a {env.name or env.__name__} cluster environment but could not read its "
                f"process count ({type(e).__name__}: {e}); pass --coordinator, --num-processes "
                f"and --process-id, or --num-processes 1 for a single process"
            ) from None
        return (env.name or env.__name__) if count > 1 else None
    return None


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"${name} must be an integer, got {value!r}") from None


def _check(coordinator: str, num_processes: int, process_id: int) -> None:
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"--coordinator must be HOST:PORT (e.g. 10.0.0.1:1234), got {coordinator!r}")
    if num_processes < 1:
        raise DistributedError(f"--num-processes must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise DistributedError(
            f"--process-id must be in [0, {num_processes}) for --num-processes {num_processes}, got {process_id}"
        )


def _use_gloo_on_cpu() -> None:
    """Cross-process collectives on CPU need an implementation (only the CPU client reads this option)."""
    if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def _join(what: str, init, **kwargs) -> None:
    try:
        init(**kwargs)
    except RuntimeError as e:  # includes jaxlib's XlaRuntimeError (coordinator unreachable, timeout)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistributedError(f"could not join the distributed run via {what}: {first}") from None


# ----------------------------------------------------------------------------- this process's batch rows


def process_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> tuple[int, int]:
    """[start, stop) of the leading (batch) dimension held by this process's devices under `sharding`.

    Derived from the sharding, not assumed from the process index: data loaders read exactly these rows. They must
    be one contiguous block: true when the batch is sharded over mesh axes in mesh order, as the default rules do.
    """
    return _process_rows(sharding, tuple(global_shape))


@lru_cache(maxsize=64)
def _process_rows(sharding, global_shape) -> tuple[int, int]:
    n = global_shape[0]
    spans = sorted({row.indices(n)[:2] for row, *_ in sharding.addressable_devices_indices_map(global_shape).values()})
    if not spans:
        raise DistributedError(f"process {jax.process_index()} holds no device of the batch sharding {sharding}")
    start, stop = spans[0]
    for lo, hi in spans[1:]:
        if lo > stop:
            raise DistributedError(
                f"process {jax.process_index()}'s devices hold batch rows {_fmt(spans)} of {n}: not one contiguous "
                f"block, which the data loader needs (batch spec {getattr(sharding, 'spec', sharding)}); "
                f"shard the batch over mesh axes in mesh order (data, then fsdp)"
            )
        stop = max(stop, hi)
    return start, stop


def _fmt(spans) -> str:
    return ", ".join(f"[{lo}, {hi})" for lo, hi in spans)


def put_process_rows(rows_local: np.ndarray, sharding: jax.sharding.Sharding, global_rows: int) -> jax.Array:
    """Builds the global [global_rows, ...] array from this process's rows (`process_rows`) of it.

    Also accepts the whole global array (then each device takes its slice), e.g. small eval batches read in full.
    """
    rest = rows_local.shape[1:]
    start, stop = process_rows(sharding, (global_rows, *rest))
    if rows_local.shape[0] == global_rows:
        start = 0
    elif rows_local.shape[0] != stop - start:
        raise DistributedError(
            f"process {jax.process_index()} holds rows [{start}, {stop}) of the global batch of "
            f"{global_rows} but was given {rows_local.shape[0]} rows"
        )

    def rows_for(index):  # a device's slice of the global array -> the same rows of this process's block
        lo, hi, _ = index[0].indices(global_rows)
        return rows_local[(slice(lo - start, hi - start), *index[1:])]

    return jax.make_array_from_callback((global_rows, *rest), sharding, rows_for)
