"""The `diloco` section of a run's config: its fields, their allowed values, and its checks.

Imports nothing of the DiLoCo programs (and no JAX), so `jaxlm.config` can gather it with the other sections.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from jaxlm.config_checks import ConfigError, Section, check_choice
from sharding.launch import ENV_REPLICA_ID  # set by `sharding.launch --independent` for each replica's processes

DATA_SPLITS = ("iid", "partition")
COMPRESSION_BITS = {"none": 32, "bf16": 16, "int8": 8, "int4": 4}  # bits per value of each outer-gradient encoding


@dataclass(frozen=True)
class DiLoCoConfig(Section):
    """Semi-synchronous training (jaxlm.diloco): M replicas take H inner steps, then one outer step on their deltas."""

    replicas: int = 0  # M; 0 turns DiLoCo off (plain synchronous training)
    inner_steps: int = 30  # H: inner steps between two syncs of the same fragment
    outer_lr: float = 0.7
    outer_momentum: float = 0.9  # Nesterov momentum of the outer SGD; 0 -> plain SGD
    fragments: int = 1  # P: streaming DiLoCo syncs one of P layer-strided fragments every H/P steps
    overlap_steps: int = 0  # tau: the synced fragment is merged tau inner steps after its sync (communication overlap)
    mixing: float = 0.0  # alpha: a merged fragment becomes alpha * local + (1 - alpha) * global
    compression: str = "none"  # outer gradients on the wire: none (float32) | bf16 | int8 | int4
    compression_block: int = 256  # values per float32 scale for int8 / int4
    data: str = "iid"  # iid: each replica gets B/M rows of the global batch | partition: a disjoint slice of the data
    drop: str = ""  # simulated failures, "m@first-last,...": replica m is down for steps first..last and then rejoins
    # One replica per independent process (jaxlm.diloco.processes), surviving the death of any of them:
    exchange: str = ""  # directory all replicas' processes share for the outer syncs; "" = replicas in one program
    replica: int = 0  # this process's replica, 0..replicas-1 (the CLI reads $JAXLM_REPLICA_ID, set by launch)
    sync_timeout_s: float = 120.0  # how long a sync waits for a missing replica before going on without it
    heartbeat_s: float = 30.0  # a replica whose heartbeat file stood still this long is dead: no wait; 0: off

    # where and how a replica process syncs, not what the state is: a resume may change them
    RESUME_MAY_CHANGE = ("exchange", "replica", "sync_timeout_s", "heartbeat_s")

    @property
    def enabled(self) -> bool:
        return self.replicas > 0

    @property
    def in_processes(self) -> bool:
        """One replica per process, syncing through `exchange` (jaxlm.diloco.processes)."""
        return self.enabled and bool(self.exchange)

    @property
    def data_partitions(self) -> int:
        """How many disjoint slices of the data the replicas read (0: they share one stream, B/M rows each)."""
        return self.replicas if self.enabled and self.data == "partition" else 0

    def validate(self, run) -> None:
        c, m, d = self, run.model, run.data
        if c.replicas < 0:
            raise ConfigError(f"diloco.replicas must be >= 0 (0 turns DiLoCo off), got {c.replicas}")
        if not c.enabled:
            return
        if c.inner_steps < 1:
            raise ConfigError(f"diloco.inner_steps must be >= 1, got {c.inner_steps}")
        if c.outer_lr <= 0:
            raise ConfigError(f"diloco.outer_lr must be positive, got {c.outer_lr}")
        if not 0 <= c.outer_momentum < 1:
            raise ConfigError(f"diloco.outer_momentum must be in [0, 1), got {c.outer_momentum}")
        if d.batch_size % c.replicas:
            raise ConfigError(f"data.batch_size ({d.batch_size}) must be divisible by diloco.replicas ({c.replicas})")
        if d.microbatches and (d.batch_size // c.replicas) % d.microbatches:
            raise ConfigError(
                f"per-replica batch {d.batch_size // c.replicas} (data.batch_size / diloco.replicas) "
                f"must be divisible by data.microbatches ({d.microbatches})"
            )
        if not 1 <= c.fragments <= m.num_layers:
            raise ConfigError(f"diloco.fragments must be in [1, model.num_layers = {m.num_layers}], got {c.fragments}")
        if c.inner_steps % c.fragments:
            raise ConfigError(
                f"diloco.inner_steps ({c.inner_steps}) must be divisible by diloco.fragments "
                f"({c.fragments}): one fragment is synced every inner_steps / fragments steps"
            )
        if not 0 <= c.overlap_steps < c.inner_steps // c.fragments:
            raise ConfigError(
                f"diloco.overlap_steps must be in [0, inner_steps / fragments = "
                f"{c.inner_steps // c.fragments}), got {c.overlap_steps}"
            )
        if not 0 <= c.mixing <= 1:
            raise ConfigError(f"diloco.mixing must be in [0, 1], got {c.mixing}")
        check_choice("diloco.compression", c.compression, COMPRESSION_BITS, how="comma")
        if c.compression_block < 1:
            raise ConfigError(f"diloco.compression_block must be >= 1, got {c.compression_block}")
        check_choice("diloco.data", c.data, DATA_SPLITS, how="comma")
        if m.keeps_amax_history:
            raise ConfigError(
                "delayed-scaling quantization (model.quant_scaling=delayed) keeps amax histories that "
                "DiLoCo cannot average; set model.quant_scaling=current"
            )
        if c.exchange:
            self._validate_exchange()
        drops = parse_drops(c.drop, c.replicas)
        for step in sorted({first for _, first, _ in drops}):  # the down set only grows where an interval starts
            if len(replicas_down(drops, step)) == c.replicas:
                raise ConfigError(f"diloco.drop {c.drop!r} leaves no replica alive at step {step}")

    def _validate_exchange(self) -> None:
        c = self
        if not 0 <= c.replica < c.replicas:
            raise ConfigError(f"diloco.replica must be in [0, diloco.replicas = {c.replicas}), got {c.replica}")
        if c.sync_timeout_s <= 0:
            raise ConfigError(f"diloco.sync_timeout_s must be positive, got {c.sync_timeout_s}")
        if c.heartbeat_s < 0:
            raise ConfigError(f"diloco.heartbeat_s must be >= 0 (0 turns the heartbeat off), got {c.heartbeat_s}")
        if c.drop:
            raise ConfigError(
                "diloco.drop simulates failures inside one program; with diloco.exchange a replica "
                "fails by its process dying, so leave diloco.drop empty"
            )


def for_this_process(run, workdir: str, replica_id: int | None) -> tuple:
    """(run config, workdir) for this process. A DiLoCo replica in its own process gets its index (the flag, else
    $JAXLM_REPLICA_ID, else the config's), the exchange as an absolute path, and its own workdir WORKDIR/replica_I
    (checkpoints, metrics). Any other run is returned as it is; a replica id given to one is an error."""
    c = run.diloco
    if not c.in_processes:
        if replica_id is not None:
            raise ConfigError(
                "--replica-id needs DiLoCo replicas in their own processes: set diloco.replicas and diloco.exchange=DIR"
            )
        return run, workdir
    replica = replica_id
    if replica is None and os.environ.get(ENV_REPLICA_ID):
        try:
            replica = int(os.environ[ENV_REPLICA_ID])
        except ValueError:
            raise ConfigError(f"${ENV_REPLICA_ID} must be an integer, got {os.environ[ENV_REPLICA_ID]!r}") from None
    if replica is None:
        replica = c.replica
    diloco = dataclasses.replace(c, replica=replica, exchange=str(Path(c.exchange).absolute()))
    return dataclasses.replace(run, diloco=diloco), str(Path(workdir) / f"replica_{replica}")


def parse_drops(spec: str, replicas: int) -> list[tuple[int, int, int]]:
    """'m@first-last,...' -> [(replica, first step, last step)]: replica m is down for steps first..last (1-based)."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            replica, steps = part.split("@")
            first, last = steps.split("-")
            item = (int(replica), int(first), int(last))
        except ValueError:
            raise ConfigError(f"diloco.drop: {part!r} is not 'replica@first-last', e.g. '1@40-80'") from None
        if not 0 <= item[0] < replicas:
            raise ConfigError(f"diloco.drop: replica {item[0]} in {part!r} is not in [0, {replicas})")
        if not 1 <= item[1] <= item[2]:
            raise ConfigError(f"diloco.drop: {part!r} needs 1 <= first <= last")
        out.append(item)
    return out


def replicas_down(drops: list[tuple[int, int, int]], step: int) -> set[int]:
    """The replicas that `parse_drops` intervals keep from taking inner step `step`."""
    return {m for m, first, last in drops if first <= step <= last}
