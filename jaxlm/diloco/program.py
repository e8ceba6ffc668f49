"""DiLoCo: M replicas take H inner steps each, then one outer Nesterov step on their averaged parameter deltas.

Papers: DiLoCo (Douillard et al., arXiv 2311.08105); Streaming DiLoCo (Douillard et al., arXiv 2501.18512).

Every train-state leaf of the replicas is stacked on a leading [R] axis sharded over the `replica` mesh axis, and
the inner step is the ordinary `train_step`, vmapped over the replicas of a slice of the mesh inside a `shard_map`
manual over `replica` only: each replica trains on its own rows of the global batch with its own inner optimizer state,
using data / fsdp / tensor inside its slice of the mesh. Nothing crosses the replica axis between syncs. (A plain
`vmap(spmd_axis_name="replica")` miscomputed the gradients of the second slice's replicas when a slice held two
replicas and a data axis; the shard_map form is exact, see tests/test_diloco.py.) When the replica axis spans
processes (one replica per process group, `sharding.launch`), the sync's mean is the only cross-process traffic of
the parameters.

A sync of fragment p (all params when P = 1):
  outer gradient  Δ = Σ_m w_m · C(θ_global − θ_m)   (w: 1/alive over the live replicas, C: `outer_compression`)
  θ_global        ← optax SGD (Nesterov momentum) step on Δ
  θ_m             ← α·θ_m + (1 − α)·θ_global       at once, or τ inner steps later (overlap)
Fragments are strided over layers (layer l belongs to fragment l mod P; other leaves are strided over their rows
the same way); fragment p syncs at the k-th multiple of H/P with (k − 1) mod P = p, so each fragment
syncs every H steps.

Failures are simulated by `diloco.drop`: a down replica takes no inner steps and is left out of the mean; when it
comes back it restarts from the global params with the inner optimizer state of a live replica. Which fragment
syncs or merges, and who is alive, is a function of the step number alone, so a resumed run replays it exactly.
At the last step every fragment is synced and merged once more (unless that already happened), so the final
global params hold all of the run's training.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlm.config import TrainConfig
from jaxlm.diloco.compression import round_trip, wire_bytes
from jaxlm.diloco.config import parse_drops, replicas_down
from jaxlm.train import Program, TrainState, step_microbatches, train_step
from sharding.mesh import LayoutError, MeshLayout
from sharding.rules import DEFAULT_RULES


@jax.tree_util.register_dataclass
@dataclass
class DiLoCoState:
    step: jax.Array  # int32 scalar: completed inner steps
    global_params: nnx.State
    outer_opt_states: tuple  # one optax state per fragment, over that fragment's view (`Fragments.view`)
    replicas: TrainState  # every leaf [R, ...]: each replica's params, inner optimizer state and step


class Fragments:
    """Views of a param tree's leaves (flattened order) belonging to one streaming fragment.

    Leaves are split by rows of their leading axis: layer l of a layer-stacked leaf belongs to fragment l mod P (the
    paper's strided layers), and so does row r of any other leaf with at least P rows (the embedding's vocabulary
    rows, the final norm), so the P fragments are near-equal and each sync moves ~1/P of the params. A leaf with
    fewer than P rows (or none) goes whole to the fragment with the fewest values so far."""

    def __init__(self, abstract_params: nnx.State, num: int):
        variables = jax.tree.leaves(abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable))
        self.split = [v.ndim >= 1 and v.shape[0] >= num for v in variables]
        self.num = num
        load = [
            sum(
                len(range(p, v.shape[0], num)) * math.prod(v.shape[1:])
                for v, split in zip(variables, self.split)
                if split
            )
            for p in range(num)
        ]
        self.owner = {}  # whole (unsplit) leaf index -> its fragment
        for i in sorted((i for i, s in enumerate(self.split) if not s), key=lambda i: -variables[i].size):
            self.owner[i] = min(range(num), key=lambda p: (load[p], p))
            load[self.owner[i]] += variables[i].size

    def members(self, p: int) -> list[int]:
        return [i for i, split in enumerate(self.split) if split or self.owner[i] == p]

    def _rows(self, p: int, lead: int):
        return (slice(None),) * lead + (slice(p, None, self.num),)

    def view(self, leaves: list, p: int, lead: int = 0) -> tuple:
        """Fragment p's parts of `leaves`: rows p, p+P, ... of split leaves, and the whole leaves it owns.
        `lead` leading axes (the replicas') come before the rows."""
        return tuple(leaves[i][self._rows(p, lead)] if self.split[i] else leaves[i] for i in self.members(p))

    def members_of(self, items: list, p: int) -> tuple:
        """The items (shardings, shapes) of the leaves in fragment p, unsliced."""
        return tuple(items[i] for i in self.members(p))

    def sizes(self, shapes: list[tuple[int, ...]], p: int) -> list[int]:
        """Number of values of each leaf's part in fragment p, for leaves of these shapes."""
        return [math.prod(shape) for shape in self.view_shapes(shapes, p)]

    def view_shapes(self, shapes: list[tuple[int, ...]], p: int) -> list[tuple[int, ...]]:
        """Shapes of `view(leaves, p)` for leaves of these shapes."""
        return [
            (len(range(p, shapes[i][0], self.num)), *shapes[i][1:]) if self.split[i] else tuple(shapes[i])
            for i in self.members(p)
        ]

    def update(self, leaves: list, p: int, values: tuple, lead: int = 0) -> list:
        out = list(leaves)
        for i, value in zip(self.members(p), values):
            out[i] = out[i].at[self._rows(p, lead)].set(value) if self.split[i] else value
        return out


def inner_rules(rules: dict) -> dict:
    """The layout's rules inside one replica: `replica` removed from every target (the step runs manual over it)."""

    def strip(target):
        if isinstance(target, tuple):
            kept = tuple(a for a in target if a != "replica")
            return kept if len(kept) > 1 else (kept[0] if kept else None)
        return None if target == "replica" else target

    return {name: strip(target) for name, target in {**DEFAULT_RULES, **rules}.items()}


class Schedule:
    """Which replicas are alive and which fragments sync or merge at each step: pure functions of the step."""

    def __init__(self, cfg: TrainConfig):
        c = cfg.diloco
        self.replicas, self.fragments, self.overlap = c.replicas, c.fragments, c.overlap_steps
        self.every = c.inner_steps // c.fragments  # steps between two syncs (of consecutive fragments)
        self.total = cfg.steps
        self.down = parse_drops(c.drop, c.replicas)

    def alive(self, step: int) -> np.ndarray:
        """[R] float32: 1 for replicas that take inner step `step`."""
        out = np.ones(self.replicas, np.float32)
        out[list(replicas_down(self.down, step))] = 0.0
        return out

    def rejoining(self, step: int) -> list[tuple[int, int]]:
        """(replica, source) pairs: replicas back at `step`, each restarting from a replica live at step - 1."""
        if step < 2:
            return []
        before, now = self.alive(step - 1), self.alive(step)
        back = [m for m in range(self.replicas) if now[m] and not before[m]]
        source = next((m for m in range(self.replicas) if before[m]), None)
        return [(m, source) for m in back]

    def _fragment_synced(self, step: int) -> int | None:
        if step < 1 or step % self.every:
            return None
        return (step // self.every - 1) % self.fragments

    def is_flush(self, step: int) -> bool:
        """At the last step everything is synced and merged, unless the regular schedule already does exactly that."""
        regular = self.fragments == 1 and self.overlap == 0 and self._fragment_synced(step) is not None
        return step == self.total and not regular

    def merges_at(self, step: int) -> list[int]:
        """Fragments whose delayed merge (overlap > 0) happens after inner step `step`; a flush merges every one
        still in flight (synced at steps step - overlap .. step - 1)."""
        if not self.overlap:
            return []
        if self.is_flush(step):
            pending = [self._fragment_synced(s) for s in range(max(step - self.overlap, 1), step)]
            return [p for p in pending if p is not None]
        p = self._fragment_synced(step - self.overlap)
        return [] if p is None else [p]

    def syncs_at(self, step: int) -> list[tuple[int, bool]]:
        """(fragment, merge now) pairs synced after inner step `step`."""
        if self.is_flush(step):
            return [(p, True) for p in range(self.fragments)]
        p = self._fragment_synced(step)
        return [] if p is None else [(p, self.overlap == 0)]

    def sync_counts(self, step: int) -> list[int]:
        """Syncs of each fragment in steps 1..step."""
        k = step // self.every
        counts = [k // self.fragments + (p < k % self.fragments) for p in range(self.fragments)]
        if step >= self.total and self.is_flush(self.total):
            regular = self._fragment_synced(self.total)
            counts = [n + (p != regular) for p, n in enumerate(counts)]
        return counts


class DiLoCoProgram(Program):
    """The compiled programs of a DiLoCo run: inner step, per-fragment sync and merge, rejoin; and their schedule."""

    def __init__(self, cfg: TrainConfig, mesh: Mesh, layout: MeshLayout | None = None):
        super().__init__(cfg, mesh, layout)  # the one-replica program: model, inner optimizer, eval of global params
        c, layout = cfg.diloco, self.layout
        if c.replicas % layout.replica:
            raise LayoutError(
                f"diloco.replicas = {c.replicas} is not divisible by mesh axis 'replica' = {layout.replica}"
            )
        self.microbatches = step_microbatches(
            cfg,
            layout,
            mesh.devices.flat[0].platform,
            rows=cfg.data.batch_size // c.replicas,
            shards=layout.data * layout.fsdp,
        )
        rows = cfg.data.batch_size // c.replicas // self.microbatches
        if rows % (layout.data * layout.fsdp):
            raise LayoutError(
                f"per-replica microbatch of {rows} rows (data.batch_size / diloco.replicas / "
                f"data.microbatches) is not divisible by data x fsdp = {layout.data * layout.fsdp}"
            )
        self.M, self.c = c.replicas, c
        self.sync_schedule = Schedule(cfg)
        self.rules_inner = inner_rules(layout.rules)
        self.outer_tx = optax.sgd(c.outer_lr, momentum=c.outer_momentum or None, nesterov=c.outer_momentum > 0)
        self.replica_abstract, self.replica_shardings = self.abstract_state, self.state_shardings
        self.fragments = Fragments(self.replica_abstract.params, c.fragments)
        self.abstract_state = jax.eval_shape(self._init_state)
        self.state_shardings = self._state_shardings()
        replicated = NamedSharding(mesh, P())
        self.init = jax.jit(self._init_state, out_shardings=self.state_shardings)
        shard = dict(
            in_shardings=(self.state_shardings, replicated), out_shardings=self.state_shardings, donate_argnums=0
        )
        self.inner_step = jax.jit(
            self._in_mesh(self._inner_step, self.rules_inner),
            in_shardings=(self.state_shardings, self.batch_sharding, replicated),
            out_shardings=(self.state_shardings, replicated),
            donate_argnums=0,
        )
        self.sync = {
            (p, merge): jax.jit(partial(self._sync, p=p, merge=merge), **shard)
            for p in range(c.fragments)
            for merge in (False, True)
        }
        self.merge = {
            p: jax.jit(partial(self._merge, p=p), out_shardings=self.state_shardings, donate_argnums=0)
            for p in range(c.fragments)
        }
        self.rejoin = jax.jit(self._rejoin, out_shardings=self.state_shardings, donate_argnums=0, static_argnums=(1, 2))
        self.sync_bytes = [self._fragment_bytes(p) for p in range(c.fragments)]
        self._alive_arrays: dict[bytes, jax.Array] = {}
        self.log = print  # lines for the run log; the Trainer hands over its own in `start`

    # ------------------------------------------------------------------------- state

    def _init_state(self) -> DiLoCoState:
        return self._from_plain(Program._init(self))  # every replica starts from the same init

    def _from_plain(self, plain: TrainState) -> DiLoCoState:
        """Every replica continues `plain` (params, inner optimizer state, step); the global params are its params
        and the outer momentum starts at zero: DiLoCo from a pretrained model, as in the paper."""
        replicas = jax.tree.map(lambda x: jnp.broadcast_to(x, (self.M, *x.shape)), plain)
        leaves = jax.tree.leaves(plain.params)
        outer = tuple(self.outer_tx.init(self.fragments.view(leaves, p)) for p in range(self.c.fragments))
        return DiLoCoState(plain.step, plain.params, outer, replicas)

    def adopt(self, plain: TrainState) -> DiLoCoState:
        """This program's state continuing a plain run's `TrainState` (a warm start, diloco_vs_sync --warm-start)."""
        return jax.jit(self._from_plain, out_shardings=self.state_shardings)(plain)

    def _state_shardings(self) -> DiLoCoState:
        mesh, replicated = self.mesh, NamedSharding(self.mesh, P())
        stacked = jax.tree.map(lambda s: NamedSharding(mesh, P("replica", *s.spec)), self.replica_shardings)
        param_shardings = jax.tree.leaves(self.replica_shardings.params)
        outer = tuple(
            optax.tree_utils.tree_map_params(
                self.outer_tx,
                lambda _, s: s,
                self.abstract_state.outer_opt_states[p],
                self.fragments.members_of(param_shardings, p),
                transform_non_params=lambda _: replicated,
            )
            for p in range(self.c.fragments)
        )
        return DiLoCoState(replicated, self.replica_shardings.params, outer, stacked)

    @property
    def num_params(self) -> int:
        """Parameters of the model (one replica's)."""
        return sum(x.size for x in jax.tree.leaves(self.replica_abstract.params))

    def eval_params(self, state: DiLoCoState):
        return state.global_params

    # ------------------------------------------------------------------------- programs

    def _inner_step(self, state: DiLoCoState, batch, alive_R):
        """One inner step of every live replica on its own B/M rows; down replicas keep their state.

        Manual over `replica` (shard_map), so each slice of the mesh steps its own replicas with no traffic
        across the replica axis; inside a slice the replicas are vmapped and data / fsdp / tensor stay automatic."""
        M = self.M
        batch_R = jax.tree.map(lambda x: x.reshape(M, x.shape[0] // M, *x.shape[1:]), batch)
        step = partial(
            train_step,
            graphdef=self.graphdef,
            tx=self.tx,
            schedule=self.schedule,
            microbatches=self.microbatches,
        )

        def local(replicas_k, batch_k, alive_k):
            new, metrics_k = jax.vmap(step)(replicas_k, batch_k)
            live = alive_k > 0
            kept = jax.tree.map(lambda n, o: jnp.where(live.reshape(-1, *(1,) * (n.ndim - 1)), n, o), new, replicas_k)
            return kept, metrics_k

        by_replica = P("replica")
        replicas, metrics_R = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(by_replica, by_replica, by_replica),
            out_specs=(by_replica, by_replica),
            axis_names={"replica"},
            check_vma=False,
        )(state.replicas, batch_R, alive_R)
        w_R = alive_R / jnp.sum(alive_R)
        metrics = {k: jnp.sum(w_R * v) for k, v in metrics_R.items()}
        return dataclasses.replace(state, step=state.step + 1, replicas=replicas), metrics

    def _sync(self, state: DiLoCoState, alive_R, *, p: int, merge: bool) -> DiLoCoState:
        """Outer step on fragment p from the live replicas' compressed deltas; optionally merges it at once."""
        frag, c = self.fragments, self.c
        g_view = frag.view(jax.tree.leaves(state.global_params), p)
        r_view = frag.view(jax.tree.leaves(state.replicas.params), p, lead=1)
        w_R = alive_R / jnp.sum(alive_R)

        def outer_grad(g, r_R):
            sent_R = jax.vmap(lambda d: round_trip(d, c.compression, c.compression_block))(g[None] - r_R)
            return jnp.tensordot(w_R, sent_R, axes=1)  # float32 accumulation of the received deltas

        return self._outer_step(state, tuple(map(outer_grad, g_view, r_view)), p=p, merge=merge)

    def _outer_step(self, state: DiLoCoState, grads: tuple, *, p: int, merge: bool) -> DiLoCoState:
        """The outer optimizer's step on fragment p given its averaged outer gradient (one array per member leaf)."""
        frag = self.fragments
        g_leaves, g_def = jax.tree.flatten(state.global_params)
        g_view = frag.view(g_leaves, p)
        updates, opt_state = self.outer_tx.update(grads, state.outer_opt_states[p], g_view)
        g_leaves = frag.update(g_leaves, p, optax.apply_updates(g_view, updates))
        opt_states = tuple(opt_state if q == p else s for q, s in enumerate(state.outer_opt_states))
        state = dataclasses.replace(state, global_params=g_def.unflatten(g_leaves), outer_opt_states=opt_states)
        return self._merge(state, p=p) if merge else state

    def _merge(self, state: DiLoCoState, *, p: int) -> DiLoCoState:
        """Replicas take fragment p of the global params: α·local + (1 − α)·global."""
        frag, alpha = self.fragments, self.c.mixing
        g_view = frag.view(jax.tree.leaves(state.global_params), p)
        r_leaves, r_def = jax.tree.flatten(state.replicas.params)
        r_view = frag.view(r_leaves, p, lead=1)
        mixed = tuple(alpha * r + (1 - alpha) * g[None] for g, r in zip(g_view, r_view))
        params = r_def.unflatten(frag.update(r_leaves, p, mixed, lead=1))
        return dataclasses.replace(state, replicas=dataclasses.replace(state.replicas, params=params))

    def _rejoin(self, state: DiLoCoState, m: int, source: int) -> DiLoCoState:
        """Replica m restarts from the global params, with replica `source`'s inner optimizer state and step."""
        r = state.replicas
        copy = partial(jax.tree.map, lambda x: x.at[m].set(x[source]))
        params = jax.tree.map(lambda x, g: x.at[m].set(g), r.params, state.global_params)
        return dataclasses.replace(state, replicas=TrainState(copy(r.step), params, copy(r.opt_state)))

    # ------------------------------------------------------------------------- the step the Trainer drives

    def _alive_array(self, step: int) -> jax.Array:
        """The [R] alive mask on the devices; one array per pattern (drops change it rarely), not one per step."""
        alive = self.sync_schedule.alive(step)
        key = alive.tobytes()
        if key not in self._alive_arrays:
            self._alive_arrays[key] = jax.make_array_from_callback(
                alive.shape, NamedSharding(self.mesh, P()), lambda idx: alive[idx]
            )
        return self._alive_arrays[key]

    def compile_step(self, state, batch):
        inner = self.inner_step.lower(state, batch, self._alive_array(1)).compile()
        sched = self.sync_schedule

        def step_fn(state, batch, step):
            for m, source in sched.rejoining(step):
                state = self.rejoin(state, m, source)
            alive = self._alive_array(step)
            state, metrics = inner(state, batch, alive)
            for p in sched.merges_at(step):
                state = self.merge[p](state)
            for p, merge in sched.syncs_at(step):
                state = self.sync[p, merge](state, alive)
            return state, {**metrics, **self.step_metrics(step)}

        return step_fn

    def start(self, state, train_iter, log):
        self.log = log
        log(self.describe())
        return state, None

    def step_metrics(self, step: int) -> dict:
        """Syncs so far and the bytes one replica has sent in them (payload + scales); for comparison, data
        parallelism moves params x 4 bytes per step."""
        counts = self.sync_schedule.sync_counts(step)
        return {
            "diloco_alive": int(self.sync_schedule.alive(step).sum()),
            "diloco_syncs": sum(counts),
            "diloco_bytes": sum(n * b for n, b in zip(counts, self.sync_bytes)),
            "diloco_peak_sync_bytes": max(self.sync_bytes),
        }

    def _fragment_bytes(self, p: int) -> int:
        """Bytes one replica sends when fragment p syncs: each leaf's slice is compressed on its own."""
        shapes = [x.shape for x in jax.tree.leaves(self.replica_abstract.params)]
        return sum(
            sum(wire_bytes(n, self.c.compression, self.c.compression_block)) for n in self.fragments.sizes(shapes, p)
        )

    def describe(self) -> str:
        """One line for the run log."""
        c = self.c
        extra = f", {c.fragments} fragments, overlap {c.overlap_steps}, mixing {c.mixing}" if c.fragments > 1 else ""
        return (
            f"DiLoCo: {c.replicas} replicas, H={c.inner_steps}, outer lr {c.outer_lr} momentum "
            f"{c.outer_momentum}{extra}, outer gradients {c.compression}: "
            f"{max(self.sync_bytes) / 1e6:.3f} MB per replica per sync"
        )
