"""DiLoCo with each replica in its own JAX process, exchanging outer gradients through `jaxlm.diloco.exchange`, so
that a process that dies costs the run one replica, not the run.

A process runs `DiLoCoProgram` with one replica (its B/M rows of each global batch, its own mesh: data / fsdp /
tensor over its devices; a replica may also be a JAX distributed run of several processes, whose process 0 speaks
for it in the exchange) and replaces the in-program sync by an exchange: it encodes its outer gradient on its
devices (`outer_compression.encode`), posts it, and applies the outer step to the decided members' decoded
gradients, laid out as the in-program sync lays out its [R] replicas (zeros and zero weight for non-members), so
without failures both compute the same average. A replica left out of a sync (dead: its heartbeat stood still for
`diloco.heartbeat_s`; or restarting or too slow for `diloco.sync_timeout_s`) takes the new global params, like a
rejoining replica in `jaxlm.diloco.program`.

After each sync its leader (the lowest member) publishes a snapshot: the global params, the outer momentum, its
own inner optimizer state and step, and the data position. A process that starts again replays the decided syncs
since its checkpoint when it took part in all of them (so a whole-job restart resumes exactly); when it missed some
(it was dead), it rejoins from the newest snapshot instead, from the global params with the leader's inner state.
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.config import ConfigError, TrainConfig
from jaxlm.diloco.compression import decode, encode
from jaxlm.diloco.exchange import ExchangeError, ReplicaExchange
from jaxlm.diloco.program import DiLoCoProgram, DiLoCoState
from sharding.distributed import process_rows


def to_host(tree):
    """A pytree of (possibly cross-process sharded) arrays as numpy arrays, whole on every process."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


class ProcessDiLoCoProgram(DiLoCoProgram):
    """Replica `cfg.diloco.replica` of `cfg.diloco.replicas`, one per process, synced through `cfg.diloco.exchange`."""

    def __init__(self, cfg: TrainConfig, mesh, layout=None):
        c, d = cfg.diloco, cfg.data
        self.run_cfg, self.replicas_total, self.index = cfg, c.replicas, c.replica
        rows = d.batch_size // c.replicas
        self.rows = (self.index * rows, (self.index + 1) * rows)  # this replica's rows of every global batch
        local = dataclasses.replace(
            cfg, data=dataclasses.replace(d, batch_size=rows), diloco=dataclasses.replace(c, replicas=1)
        )
        replica_axis = layout.replica if layout else mesh.shape.get("replica", 1)
        if replica_axis != 1:
            raise ConfigError(
                f"with diloco.exchange each process holds one replica: the mesh layout's replica axis "
                f"must be 1, got {replica_axis}"
            )
        super().__init__(local, mesh, layout)
        # a replica spanning several processes (its own jax.distributed run): its process 0 speaks for it in the
        # exchange; the others read the same decisions and payloads, so all compute the same outer step
        self.speaks = jax.process_index() == 0
        self.exchange = ReplicaExchange(c.exchange, c.replicas, c.replica, c.sync_timeout_s, heartbeat_s=c.heartbeat_s)
        # beating from here on, before compiling and restoring: a restarted replica is waited for, a dead one not
        self.heartbeat = self.exchange.beat() if self.speaks and c.heartbeat_s > 0 else None
        self.c = c  # the run's settings (the local program's say 1 replica); self.M stays 1: this process's stack
        shapes = [x.shape for x in jax.tree.leaves(self.replica_abstract.params)]
        self.fragment_shapes = [self.fragments.view_shapes(shapes, p) for p in range(c.fragments)]
        self.local_delta = {p: jax.jit(partial(self._local_delta, p=p)) for p in range(c.fragments)}
        self.apply_outer = {
            (p, merge): jax.jit(
                partial(self._apply_outer, p=p, merge=merge), out_shardings=self.state_shardings, donate_argnums=0
            )
            for p in range(c.fragments)
            for merge in (False, True)
        }
        self.take_global = jax.jit(self._take_global, out_shardings=self.state_shardings, donate_argnums=0)
        keep = cfg.checkpoint_every * cfg.keep_checkpoints
        self.keep_steps = keep + c.inner_steps if keep else None  # what a restore from the oldest checkpoint replays
        self.members, self.excluded, self.waited_s = tuple(range(c.replicas)), 0, 0.0
        self._data_state = lambda: {}

    # ------------------------------------------------------------------------- compiled parts

    def _local_delta(self, state: DiLoCoState, *, p: int) -> tuple:
        """This replica's encoded outer gradient of fragment p, θ_global − θ_local, one dict per member leaf."""
        g_view = self.fragments.view(jax.tree.leaves(state.global_params), p)
        r_view = self.fragments.view(jax.tree.leaves(state.replicas.params), p, lead=1)
        return tuple(encode(g - r[0], self.c.compression, self.c.compression_block) for g, r in zip(g_view, r_view))

    def _apply_outer(self, state: DiLoCoState, sent_R: tuple, w_R, *, p: int, merge: bool) -> DiLoCoState:
        grads = tuple(jnp.tensordot(w_R, s, axes=1) for s in sent_R)  # as DiLoCoProgram._sync averages
        return self._outer_step(state, grads, p=p, merge=merge)

    def _take_global(self, state: DiLoCoState) -> DiLoCoState:
        """The replica continues from the global params (it missed a sync); its inner optimizer state stays."""
        params = jax.tree.map(lambda g: g[None], state.global_params)
        return dataclasses.replace(state, replicas=dataclasses.replace(state.replicas, params=params))

    # ------------------------------------------------------------------------- what the Trainer calls

    def rows_to_read(self) -> tuple[int, int]:
        """This replica's rows of every global batch (this process's part of them, if the replica spans processes)."""
        lo, hi = 0, self.rows[1] - self.rows[0]
        if jax.process_count() > 1:
            lo, hi = process_rows(self.batch_sharding, (hi, self.cfg.data.seq_len))
        return self.rows[0] + lo, self.rows[0] + hi

    def start(self, state, train_iter, log):
        """Catches up with the other replicas (`catch_up`); the data position goes into the snapshots this replica
        publishes."""
        self._data_state = train_iter.get_state
        super().start(state, train_iter, log)
        return self.catch_up(state, log)

    def compile_step(self, state, batch):
        alive = self._alive_array(1)
        inner = self.inner_step.lower(state, batch, alive).compile()
        sched = self.sync_schedule

        def step_fn(state, batch, step):
            state, metrics = inner(state, batch, alive)
            for p in sched.merges_at(step):
                state = self.merge[p](state)
            for p, merge in sched.syncs_at(step):
                state = self._sync_through_exchange(state, step, p, merge)
            return state, {**metrics, **self.step_metrics(step)}

        return step_fn

    def _sync_through_exchange(self, state: DiLoCoState, step: int, p: int, merge: bool) -> DiLoCoState:
        parts = to_host(self.local_delta[p](state))
        payload = {f"{j}.{name}": value for j, leaf in enumerate(parts) for name, value in leaf.items()}
        result = self.exchange.allreduce(step, p, payload if self.speaks else None)
        c, shapes = self.c, self.fragment_shapes[p]
        sent_R = tuple(np.zeros((self.replicas_total, *shape), np.float32) for shape in shapes)
        for m in result.members:
            for j, (shape, names) in enumerate(zip(shapes, parts)):  # every replica sends the same parts
                leaf = {name: result.payloads[m][f"{j}.{name}"] for name in names}
                sent_R[j][m] = decode(leaf, c.compression, shape, c.compression_block)
        w_R = np.zeros(self.replicas_total, np.float32)
        w_R[list(result.members)] = 1.0 / len(result.members)
        state = self.apply_outer[p, merge](state, sent_R, w_R)
        self.members, self.waited_s = result.members, self.waited_s + result.waited_s
        for r, why in result.left_out.items():
            if r != self.index:
                self.log(f"the sync at step {step} went on without replica {r} ({why})")
        if self.index not in result.members:
            state = self.take_global(state)
            self.excluded += 1
            self.log(
                f"replica {self.index} missed the sync at step {step} (members {list(result.members)});"
                f" continuing from the global params"
            )
            self._announce_after(step)
        elif self.index == result.members[0]:
            arrays = self._snapshot_arrays(state)  # every process of the replica takes part in the gather
            if self.speaks:
                self.exchange.publish(step, arrays)
                self.exchange.tidy(step, self.keep_steps)
        return state

    def _announce_after(self, step: int) -> None:
        """Asks the others to wait for this replica at the first sync after `step`."""
        sched = self.sync_schedule
        nxt = next((s for s in range(step + 1, self.run_cfg.steps + 1) if sched.syncs_at(s)), None)
        if nxt is not None and self.speaks:
            self.exchange.announce(nxt, sched.syncs_at(nxt)[0][0])

    # ------------------------------------------------------------------------- snapshots and catching up

    def _snapshot_arrays(self, state: DiLoCoState) -> dict[str, np.ndarray]:
        leaves = to_host(jax.tree.leaves(state))
        arrays = {f"leaf{i:05d}": np.asarray(x) for i, x in enumerate(leaves)}
        arrays["data_state"] = np.array(json.dumps({k: int(v) for k, v in self._data_state().items()}))
        return arrays

    def _state_from_snapshot(self, arrays: dict[str, np.ndarray]) -> tuple[DiLoCoState, dict]:
        abstract, treedef = jax.tree.flatten(self.abstract_state)
        shardings = jax.tree.leaves(self.state_shardings)
        leaves = []
        for i, (a, s) in enumerate(zip(abstract, shardings)):
            x = arrays.get(f"leaf{i:05d}")
            if x is None or x.shape != a.shape or x.dtype != a.dtype:
                got = "missing" if x is None else f"{x.shape} {x.dtype}"
                raise ExchangeError(
                    f"the snapshot in {self.exchange.root} does not fit this model (leaf {i}: {got}, "
                    f"expected {a.shape} {a.dtype}); was the exchange directory used by another run?"
                )
            leaves.append(jax.make_array_from_callback(x.shape, s, lambda index, x=x: x[index]))
        return self.take_global(treedef.unflatten(leaves)), json.loads(str(arrays["data_state"]))

    def catch_up(self, state: DiLoCoState, log) -> tuple[DiLoCoState, dict | None]:
        """After a restore (or init): replay the decided syncs if this replica took part in all of them and the
        exchange still holds them all, else rejoin from the newest snapshot. Returns the state and, on a rejoin,
        the data position to continue from."""
        start = int(jax.device_get(state.step))
        decided = {
            key: m for key in self.exchange.syncs() if key[0] > start and (m := self.exchange.members(*key)) is not None
        }
        latest = max(decided, default=(start, 0))[0]
        # every sync the schedule held since `start`: one tidied away cannot be replayed, and deciding it anew
        # would fork this replica's global params from the others'
        scheduled = [(s, p) for s in range(start + 1, latest + 1) for p, _ in self.sync_schedule.syncs_at(s)]
        gone = [s for s, p in scheduled if (s, p) not in decided]
        missed = sorted(s for (s, _), m in decided.items() if self.index not in m)
        newer = (gone or missed) and max(self.exchange.snapshots(), default=-1) > start  # before reading one
        snapshot = self.exchange.latest_snapshot() if newer else None
        if snapshot is not None and snapshot[0] > start:
            step, arrays = snapshot
            state, data_state = self._state_from_snapshot(arrays)
            why = (
                f"missed {len(missed)} syncs since step {start} (first at step {missed[0]})"
                if missed
                else f"cannot replay the syncs since step {start} (the exchange no longer holds step {gone[0]})"
            )
            log(
                f"replica {self.index} of {self.replicas_total} {why}; rejoining at step {step} from the global "
                f"params in {self.exchange.root}"
            )
            self._announce_after(step)
            return state, data_state
        if gone:
            raise ExchangeError(
                f"replica {self.index} restored step {start}, but {self.exchange.root} no longer holds "
                f"the sync at step {gone[0]} and has no newer snapshot to rejoin from; use the "
                f"exchange directory of this run, or a new --workdir and exchange to start over"
            )
        if decided:
            log(
                f"replica {self.index} of {self.replicas_total}: replaying {len(decided)} decided syncs after step "
                f"{start} from {self.exchange.root}"
            )
        self._announce_after(start)
        return state, None

    def step_metrics(self, step: int) -> dict:
        return {
            **super().step_metrics(step),
            "diloco_alive": len(self.members),
            "diloco_missed": self.excluded,
            "diloco_wait_s": self.waited_s,
        }

    def describe(self) -> str:
        where = "its own process" if jax.process_count() == 1 else f"its own {jax.process_count()} processes"
        beat = f", heartbeat {self.c.heartbeat_s:g}s" if self.c.heartbeat_s > 0 else ", no heartbeat"
        return (
            f"{super().describe()}; replica {self.index} of {self.replicas_total} in {where}, synced through "
            f"{self.exchange.root} (timeout {self.c.sync_timeout_s:g}s{beat})"
        )

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None
