"""Multi-process runs: joining the JAX distributed system, and which batch rows this process feeds.

One process per host (or per simulated host, see `sharding.launch`). Every process runs the same program on the
global mesh; each reads and places only the batch rows its own devices hold, so a global batch is assembled with no
cross-host copy and is bit for bit the batch a one-process run sees.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jax
import numpy as np

ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "JAXLM_COORDINATOR", "JAXLM_NUM_PROCESSES", "JAXLM_PROCESS_ID"
ENV_JOIN_TIMEOUT = "JAXLM_JOIN_TIMEOUT_S"
DEFAULT_JOIN_TIMEOUT_S = 300.0  # JAX's own default
# JAX's coordination service ends process 0 with a C++ abort once registration has taken an hour (not settable
# through jax.distributed.initialize): a longer wait would never get to say who is missing.
MAX_JOIN_TIMEOUT_S = 3000.0
NOTE_AFTER_S = 10.0  # a wait this long (or half the timeout, if shorter) is reported with one line


class DistributedError(ValueError):
    """A bad multi-process setting or a failed join; the message names the setting."""


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    join_timeout_s: float | None = None,
) -> bool:
    """Joins the distributed system if this is a multi-process run; returns whether it did.

    Values come from the arguments (CLI flags), else from the JAXLM_* variables `sharding.launch` sets. All three
    given: explicit join. None given: if a cluster JAX knows how to read (SLURM, Open MPI, Cloud TPU, ...) reports
    more than one process, `jax.distributed.initialize()` reads it; otherwise this is a single process and nothing
    happens. `num_processes=1` alone means single process. Must run before anything queries devices.

    The join waits for every process: after NOTE_AFTER_S one stderr line says who is missing, and after
    `join_timeout_s` (else $JAXLM_JOIN_TIMEOUT_S, else 300 s) a one-line DistributedError says who never came.
    """
    coordinator = coordinator if coordinator is not None else os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    timeout_s = join_timeout(join_timeout_s)
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
        _join(_Peers(cluster=cluster), jax.distributed.initialize, timeout_s)
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
        _Peers(coordinator, num_processes, process_id),
        jax.distributed.initialize,
        timeout_s,
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
    )
    return True


def join_timeout(seconds: float | None = None) -> float:
    """The join's time limit: `seconds` (--join-timeout), else $JAXLM_JOIN_TIMEOUT_S, else 300 s; checked here so
    a bad value is one line before anything waits."""
    name, raw = ("--join-timeout", seconds) if seconds is not None else (f"${ENV_JOIN_TIMEOUT}", None)
    if raw is None:
        raw = os.environ.get(ENV_JOIN_TIMEOUT) or DEFAULT_JOIN_TIMEOUT_S
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    if not 0 < value <= MAX_JOIN_TIMEOUT_S:  # also false for nan
        raise DistributedError(
            f"{name} must be a number of seconds in (0, {MAX_JOIN_TIMEOUT_S:g}] (JAX's coordinator gives up "
            f"after an hour by itself), got {raw if isinstance(raw, str) else format(raw, 'g')}"
        )
    return value


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


# ----------------------------------------------------------------------------- waiting for the other processes


@dataclass(frozen=True)
class _Peers:
    """Who this process waits for: an explicit run (address, count, id), or a cluster environment's (name only)."""

    address: str | None = None
    num_processes: int = 0
    process_id: int = 0
    cluster: str | None = None

    def __str__(self) -> str:
        if self.cluster:
            return f"the {self.cluster} cluster environment"
        return f"{self.address} as process {self.process_id} of {self.num_processes}"

    def missing(self) -> str | None:
        """Who has not arrived; None: the coordinator itself is not reachable. Process 0 cannot tell which of the
        others are connected (JAX's coordination service reports nobody before all have), so it names them all."""
        if self.cluster:
            return "the other processes"
        if self.process_id != 0 and not _reachable(self.address):
            return None
        others = [i for i in range(self.num_processes) if i not in (0, self.process_id)]
        if self.process_id == 0 or not others:  # the coordinator answers: process 0 is there (or another run is)
            others = [i for i in range(self.num_processes) if i != self.process_id]
        some = " (or some of them)" if len(others) > 1 else ""
        return f"{_plural(others)} of {self.num_processes}{some}"

    def waiting(self, timeout_s: float) -> str:
        """The note printed while waiting."""
        who = self.missing()
        if self.cluster:
            return f"waiting for {who} of {self} to join; giving up after {timeout_s:g} s"
        if who is None:
            return (
                f"waiting for the coordinator (process 0) at {self.address}: not reachable yet (this is process "
                f"{self.process_id} of {self.num_processes}); giving up after {timeout_s:g} s"
            )
        return (
            f"waiting for {who} to join at {self.address} (this is process {self.process_id}); "
            f"giving up after {timeout_s:g} s"
        )

    def gave_up(self, timeout_s: float) -> str:
        """The error after `timeout_s`: who never came, and what to do."""
        longer = f"or wait longer with --join-timeout S (${ENV_JOIN_TIMEOUT})"
        who = self.missing()
        if self.cluster:
            return f"{who} of {self} did not join within {timeout_s:g} s; check that every task started, {longer}"
        same = f"--coordinator {self.address} --num-processes {self.num_processes}"
        if who is None:
            return (
                f"the coordinator (process 0) at {self.address} is not reachable after {timeout_s:g} s (this is "
                f"process {self.process_id} of {self.num_processes}); start process 0 with {same} --process-id 0 "
                f"on that host, {longer}"
            )
        return (
            f"{who} did not join at {self.address} within {timeout_s:g} s (this is process {self.process_id}); "
            f"start every process with {same} and its own --process-id, {longer}"
        )


def _join(peers: _Peers, init, timeout_s: float, **kwargs) -> None:
    """Runs `init` (jax.distributed.initialize, which blocks in C++ until every process has connected) in a daemon
    thread and waits for it here, so the wait stays interruptible, says who is missing after NOTE_AFTER_S and ends
    after `timeout_s` with one line: JAX alone waits silently and then aborts the process with a C++ stack trace."""
    outcome: list = []
    kwargs["initialization_timeout"] = math.ceil(timeout_s) + 60  # JAX's deadline (a C++ abort) after ours
    thread = threading.Thread(target=_run, args=(init, kwargs, outcome), name="jax-distributed-join", daemon=True)
    thread.start()
    joined = False
    try:
        joined = _wait(thread, peers, timeout_s)
    finally:
        if not joined:  # timed out, or a KeyboardInterrupt
            _abandon(outcome)
    if not joined:
        raise DistributedError(peers.gave_up(timeout_s))
    if outcome and isinstance(outcome[0], RuntimeError):  # includes jaxlib's XlaRuntimeError
        e = outcome[0]
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistributedError(f"could not join the distributed run via {peers}: {first}") from None
    if outcome:
        raise outcome[0]


def _run(init, kwargs: dict, outcome: list) -> None:
    """The join thread. Its frame keeps `outcome` alive until the process ends (a daemon thread's frame is never
    freed), which is what lets `_abandon` park JAX's half-made client and service there."""
    try:
        init(**kwargs)
    except BaseException as e:
        outcome.append(e)


def _wait(thread: threading.Thread, peers: _Peers, timeout_s: float) -> bool:
    """Whether `thread` finished within `timeout_s`; one note line if it takes longer than NOTE_AFTER_S."""
    start = time.monotonic()
    thread.join(min(NOTE_AFTER_S, timeout_s / 2))
    if thread.is_alive():
        _note(peers.waiting(timeout_s))
        thread.join(max(0.0, timeout_s - (time.monotonic() - start)))
    return not thread.is_alive()


def _abandon(outcome: list) -> None:
    """Leaves JAX's half-made join to the stuck thread: JAX's exit handler would otherwise shut down the
    coordination service, which waits 5 s for the blocked connect and logs several lines after our one. Also makes
    `jax.distributed.is_initialized()` false again."""
    try:
        from jax._src.distributed import global_state
    except ImportError:  # private module moved: the exit is then slower and noisier, not wrong
        return
    outcome.append((global_state.service, global_state.client))
    global_state.service = global_state.client = None


def _reachable(address: str) -> bool:
    """Whether anything accepts TCP connections at HOST:PORT (the coordinator's gRPC port)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
    except (OSError, ValueError):
        return False
    return True


def _plural(ids: list[int]) -> str:
    """[1] -> 'process 1'; [1, 2, 3, 5] -> 'processes 1-3, 5'."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)
    return f"process {text}" if len(ids) == 1 else f"processes {text}"


def _note(line: str) -> None:
    script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0].endswith(".py") else ""
    prefix = f"{script}: " if script and script != "__main__" else ""
    print(f"{prefix}note: {line}", file=sys.stderr, flush=True)


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
