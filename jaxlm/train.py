"""The compiled training program: train state, loss, `train_step` / `eval_step` (the loop around them is
`jaxlm.trainer`).

The step is one jit-compiled function with the state donated. Gradient accumulation is a `lax.scan` over
microbatches inside the same program. A step whose loss or gradient is not finite leaves the weights alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlm import config as config_lib
from jaxlm.config import OptimConfig, TrainConfig
from jaxlm.model import LOGICAL_AXES, Transformer, apply_layers, head_logits
from jaxlm.moe import RouterBias
from jaxlm.quantized import layer_recipe
from pallas_kernels.mask_spec import parse_mask
from sharding.context_order import balance, permute_rows, sequence_order
from sharding.distributed import process_rows, put_process_rows
from sharding.mesh import MESH_AXES, MeshLayout
from sharding.pipeline import PipelineAux, StageOut, pipeline_loss, runs_in_lockstep, split_chunks
from sharding.rules import batch_sharding, tree_shardings, use_rules
from sharding.schedules import cached as cached_schedule

Batch = dict[str, Any]  # "inputs" [B, T] int32, "targets" [B, T] int32, "loss_mask" [B, T] float32


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    step: jax.Array  # int32 scalar: completed optimizer steps
    params: nnx.State  # every model variable: the Params and, with delayed-scaling quantization, amax histories
    opt_state: Any  # over the Params only


def split_trainable(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(Params, everything else): the optimizer sees the first; the rest (amax histories) is overwritten with the
    value its gradient carries (pallas_kernels.quantized_training)."""
    return nnx.split_state(state, nnx.Param, ...)


# ----------------------------------------------------------------------------- optimizer


def lr_schedule(ocfg: OptimConfig, total_steps: int) -> Callable[[jax.Array], jax.Array]:
    """Linear warmup to the peak (step 0 already trains), then cosine decay to peak * min_lr_ratio."""
    peak, warmup = ocfg.learning_rate, ocfg.warmup_steps
    decay = max((ocfg.decay_steps or total_steps) - warmup, 1)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * (step + 1) / max(warmup, 1)
        progress = jnp.clip((step - warmup) / decay, 0.0, 1.0)
        cosine = peak * (ocfg.min_lr_ratio + (1 - ocfg.min_lr_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * progress)))
        return jnp.where(step < warmup, warm, cosine)

    return schedule


def decay_mask(params) -> Any:
    """Weight decay on matrices and embeddings, not on norm scales: those are 1-D per layer, 2-D once stacked, so
    the stacked `layers` axis does not count."""

    def decays(p) -> bool:
        axes = p.get_metadata(LOGICAL_AXES, None) if isinstance(p, nnx.Variable) else None
        return p.ndim >= 2 if axes is None else sum(a != "layers" for a in axes) >= 2

    return jax.tree.map(decays, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(ocfg: OptimConfig, total_steps: int) -> tuple[optax.GradientTransformation, Callable]:
    """Clipping, then AdamW, or SGD with the same decoupled weight decay (DiLoCo's exactness identities use SGD)."""
    schedule = lr_schedule(ocfg, total_steps)
    if ocfg.optimizer == "sgd":
        decay = optax.add_decayed_weights(ocfg.weight_decay, mask=decay_mask) if ocfg.weight_decay else optax.identity()
        inner = optax.chain(decay, optax.sgd(schedule))
    else:
        inner = optax.adamw(
            schedule, b1=ocfg.b1, b2=ocfg.b2, eps=ocfg.eps, weight_decay=ocfg.weight_decay, mask=decay_mask
        )
    clip = optax.clip_by_global_norm(ocfg.grad_clip) if ocfg.grad_clip > 0 else optax.identity()
    return optax.chain(clip, inner), schedule


# ----------------------------------------------------------------------------- loss and steps


def loss_sums(
    params: nnx.State, graphdef: nnx.GraphDef, batch: Batch, layout: MeshLayout | None = None
) -> tuple[jax.Array, jax.Array]:
    """(sum of masked next-token cross-entropies, number of unmasked tokens): sums, so microbatches add up exactly.

    With a layout of more than one pipeline stage, the layers run pipelined (`sharding.pipeline`)."""
    _, (ce_sum, count, _) = objective_sums(params, graphdef, batch, layout, router_losses=False)
    return ce_sum, count


def objective_sums(
    params: nnx.State, graphdef: nnx.GraphDef, batch: Batch, layout: MeshLayout | None = None, router_losses=True
):
    """(what the step minimises, summed like the cross-entropy: its sum plus count x the MoE routers' weighted aux
    and z losses (none without `router_losses`); (cross-entropy sum, count, MoE routing statistics per layer: {}
    for a dense model)). A pipeline computes the objective's gradients only: with router losses its cross-entropy
    sum carries none, so `loss_sums` asks for it without them."""
    model = nnx.merge(graphdef, params)
    order = _context_order(model.cfg, layout, batch)
    if order is not None:  # every [B, T] field in the order the context axis deals tokens; the sums do not change
        batch = permute_rows(batch, order)
    if layout is not None and layout.pipeline > 1:
        objective, aux = _pipelined_objective(model, batch, layout, order, router_losses)
        # the pipeline's gradients are its objective's: without router losses that is the cross-entropy itself
        return objective, (aux.head_loss if router_losses else objective, aux.count, aux.stats)
    logits_BTV, stats = model.forward(batch["inputs"], segment_ids_BT=batch.get("segment_ids"), positions_BT=order)
    ce_sum, count = cross_entropy_sums(logits_BTV, batch["targets"], batch["loss_mask"])
    objective = ce_sum
    if stats and router_losses:
        router = model.cfg.moe_aux_loss * stats["aux"].mean() + model.cfg.moe_z_loss * stats["z"].mean()
        objective = ce_sum + jax.lax.stop_gradient(count) * router
    return objective, (ce_sum, count, stats)


def _context_balance(model_cfg, layout: MeshLayout, batch: Batch) -> dict:
    """{"context_balance": max / mean score pairs kept per device of the context axis} for the step's batch, when
    the mask is one `sharding.context_order.visible_keys` counts."""
    mask = parse_mask(model_cfg.attention_mask)
    order = _context_order(model_cfg, layout, batch)
    figure = balance(mask, batch["inputs"].shape[1], order, layout.context, batch.get("segment_ids"))
    return {} if figure is None else {"context_balance": figure}


def _context_order(model_cfg, layout: MeshLayout | None, batch: Batch):
    """The positions a context-parallel layout deals each row's tokens in (sharding.context_order): numpy [T], an
    array [B, T] (documents, from the batch's segment ids), or None (as they come)."""
    if layout is None or layout.context == 1:
        return None
    mask, seq_len = parse_mask(model_cfg.attention_mask), batch["inputs"].shape[1]
    how, block = model_cfg.context_order, model_cfg.attention_block_q
    return sequence_order(mask, seq_len, layout.context, how, batch.get("segment_ids"), block)


def cross_entropy_sums(logits_BTV, targets_BT, loss_mask_BT) -> tuple[jax.Array, jax.Array]:
    """The target's logit is picked with a one-hot product, not a gather: with the vocabulary split over `tensor`
    that is a local product and a sum (vocab-parallel cross-entropy), and XLA's partitioner cannot split a gather
    inside the pipeline's shard_map."""
    target_logit_BT = jnp.sum(
        logits_BTV * jax.nn.one_hot(targets_BT, logits_BTV.shape[-1], dtype=logits_BTV.dtype), axis=-1
    )
    losses_BT = jax.nn.logsumexp(logits_BTV, axis=-1) - target_logit_BT
    mask_BT = loss_mask_BT.astype(jnp.float32)
    return jnp.sum(losses_BT * mask_BT), jnp.sum(mask_BT)


def _pipelined_objective(
    model: Transformer, batch: Batch, layout: MeshLayout, order, router_losses: bool = True
) -> tuple[jax.Array, PipelineAux]:
    """Embedding before the pipeline, the layers split over stages, the head and loss at the last stage; MoE
    stages add their routers' losses to the objective and return their statistics (`sharding.pipeline.StageOut`).
    `order`: the positions the batch's tokens stand at (a context axis' order: numpy [T] or per row [B, T]), None
    for as they come."""
    cfg, stages, M = model.cfg, layout.pipeline, layout.num_microbatches
    block_graphdef, layers = nnx.split(model.blocks)
    moe_graphdef = None
    if model.moe_blocks is not None:  # groups of moe_every layers (k - 1 dense, one MoE) are what stages split
        moe_graphdef, moe_layers = nnx.split(model.moe_blocks)
        groups = cfg.num_moe_layers
        dense = jax.tree.map(lambda a: a.reshape(groups, cfg.moe_every - 1, *a.shape[1:]), layers)
        layers = {"dense": dense, "moe": _bias_averaged(moe_layers, M)}
    elif cfg.num_experts:
        layers = _bias_averaged(layers, M)
    per_row = order is not None and not isinstance(order, np.ndarray)  # then positions travel with the microbatches
    rows = {**batch, "x": model.embed_tokens(batch["inputs"])} | ({"positions": order} if per_row else {})
    micro = split_microbatches(rows, M)

    def stage_fn(stage_layers, x_BTD, side):
        positions_BT = side["positions"] if per_row else order
        moe = None
        if moe_graphdef is not None:
            moe = (moe_graphdef, stage_layers["moe"])
            stage_layers = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), stage_layers["dense"])
        y, stats = apply_layers(cfg, block_graphdef, stage_layers, x_BTD, side["segment_ids"], positions_BT, moe=moe)
        if not stats:
            return y
        if not router_losses:
            return StageOut(y, jnp.zeros((), jnp.float32), stats)
        # this stage's share of count x (the routers' weighted losses, averaged over the model's MoE layers)
        router = cfg.moe_aux_loss * stats["aux"].sum() + cfg.moe_z_loss * stats["z"].sum()
        return StageOut(y, side["count"] * router / cfg.num_moe_layers, stats)

    def head_fn(head, y_BTD, side):
        return cross_entropy_sums(head_logits(cfg, head, y_BTD), side["targets"], side["loss_mask"])

    head_side = {"targets": micro["targets"], "loss_mask": micro["loss_mask"]}
    head = model.head_params()
    if layer_recipe(cfg, "lm_head") is None:
        # a constant of the schedule's loop, gathered once before it: in the dtype `project` casts it to inside, so
        # the gathered copy is half a float32 one's size (70B on 256 H100s, tensor 2, 1F1B: 0.6 GiB less per GPU)
        head = {**head, "head_DV": head["head_DV"].astype(cfg.dtype)}
    virtual = layout.pipeline_virtual_stages or None
    in_lockstep = runs_in_lockstep(layout, cfg.context_parallel)
    table = cached_schedule(layout.pipeline_schedule, stages, M, virtual, in_lockstep)
    chunks = split_chunks(layers, table)
    stage_side = {
        "segment_ids": micro.get("segment_ids"),
        "positions": micro.get("positions"),
        "count": jnp.sum(micro["loss_mask"].astype(jnp.float32), axis=(1, 2)),  # each microbatch's, as data
    }
    return pipeline_loss(table, stage_fn, head_fn, chunks, head, micro["x"], stage_side, head_side)


def _bias_averaged(layers: nnx.State, microbatches: int) -> nnx.State:
    """The MoE layers with their router biases passed through `_mean_over_microbatches`: the pipeline sums each
    microbatch's gradient, and a bias's "gradient" is its new value (jaxlm.moe.steer), which microbatches average."""
    biases, rest = nnx.split_state(layers, RouterBias, ...)
    return nnx.merge_state(jax.tree.map(lambda b: _mean_over_microbatches(b, microbatches), biases), rest)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _mean_over_microbatches(x, microbatches: int):
    return x


def _mean_fwd(x, microbatches):
    return x, None


def _mean_bwd(microbatches, _, g):
    return (g / microbatches,)


_mean_over_microbatches.defvjp(_mean_fwd, _mean_bwd)


def split_microbatches(batch: Batch, k: int) -> Batch:
    """[B, ...] -> [k, B/k, ...], microbatch j = rows j, j+k, ... so every data shard holds rows of every microbatch."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)


def train_step(
    state: TrainState, batch: Batch, *, graphdef, tx, schedule, microbatches: int, layout: MeshLayout | None = None
):
    grad_fn = jax.value_and_grad(objective_sums, has_aux=True)
    if microbatches == 1:
        (_, (loss_sum, count, stats)), grads = grad_fn(state.params, graphdef, batch, layout)
    else:

        def accumulate(carry, microbatch):
            g_acc, l_acc, n_acc = carry
            (_, (l, n, s)), g = grad_fn(state.params, graphdef, microbatch, layout)
            return (combine_microbatch_grads(g_acc, g, microbatches), l_acc + l, n_acc + n), s

        # the routing statistics (small) come out per microbatch and are averaged after: a carry would need their
        # shapes before the scan, one more trace of the whole model
        zeros = (jax.tree.map(jnp.zeros_like, state.params), jnp.zeros(()), jnp.zeros(()))
        (grads, loss_sum, count), stats = jax.lax.scan(accumulate, zeros, split_microbatches(batch, microbatches))
        stats = jax.tree.map(lambda a: jnp.mean(a.astype(jnp.float32), axis=0), stats)
    count = jnp.maximum(count, 1.0)
    grads, new_histories = split_trainable(grads)
    params, _ = split_trainable(state.params)
    grads = jax.tree.map(lambda g: g / count, grads)
    updates, opt_state = tx.update(grads, state.opt_state, params)
    new_params = nnx.merge_state(optax.apply_updates(params, updates), new_histories)
    loss, grad_norm = loss_sum / count, optax.tree.norm(grads)
    # A non-finite loss or gradient (a bad batch, an overflow) must not reach the weights: the step is skipped,
    # params and optimizer state stay as they were, and the step counter still advances with the data.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = partial(jax.tree.map, lambda new, old: jnp.where(finite, new, old))
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": schedule(state.step),
        "skipped": (~finite).astype(jnp.float32),
    }
    context = layout is not None and layout.context > 1
    model_cfg = nnx.merge(graphdef, state.params).cfg if context or stats else None  # at trace time, once
    if context:
        metrics |= _context_balance(model_cfg, layout, batch)
    if stats:
        metrics |= moe_metrics(stats, new_params, model_cfg.moe_every)
    return TrainState(state.step + 1, keep(new_params, state.params), keep(opt_state, state.opt_state)), metrics


def moe_metrics(stats: dict, params: nnx.State, moe_every: int = 1) -> dict:
    """Step metrics of the MoE layers from their routing statistics [L, ...]: the routers' aux and z losses (means
    over layers), per layer (named by its index in the model: MoE layer i is layer (i + 1) * moe_every - 1) the
    load of the busiest expert over the mean, the load's entropy over its maximum (1: uniform) and the copies
    dropped over capacity, and the spread of the load-steering biases."""
    load_LX = stats["load"]
    X = load_LX.shape[-1]
    entropy_L = -jnp.sum(load_LX * jnp.log(jnp.where(load_LX > 0, load_LX, 1.0)), axis=-1) / jnp.log(X)
    out = {"moe_aux_loss": stats["aux"].mean(), "moe_z_loss": stats["z"].mean()}
    for i in range(load_LX.shape[0]):
        layer = (i + 1) * moe_every - 1
        out[f"moe_load_max_over_mean/{layer}"] = load_LX[i].max() * X
        out[f"moe_load_entropy/{layer}"] = entropy_L[i]
        out[f"moe_dropped/{layer}"] = stats["dropped"][i].astype(jnp.float32)
    biases = jax.tree.leaves(nnx.split_state(params, RouterBias, ...)[0])
    if biases:
        out["moe_bias_range"] = jnp.max(jnp.stack([jnp.max(b.max(-1) - b.min(-1)) for b in biases]))
    return out


def combine_microbatch_grads(acc: nnx.State, g: nnx.State, microbatches: int = 1) -> nnx.State:
    """Param gradients add up. Amax histories take the max: every microbatch returns the same shifted history
    with its own amaxes in front, so the max is the history the whole batch would have written. A router bias's
    new values (jaxlm.moe.steer) average: each microbatch moves it by its own load."""
    acc_p, acc_bias, acc_h = nnx.split_state(acc, nnx.Param, RouterBias, ...)
    g_p, g_bias, g_h = nnx.split_state(g, nnx.Param, RouterBias, ...)
    return nnx.merge_state(
        jax.tree.map(jnp.add, acc_p, g_p),
        jax.tree.map(lambda a, b: a + b / microbatches, acc_bias, g_bias),
        jax.tree.map(jnp.maximum, acc_h, g_h),
    )


def eval_step(params: nnx.State, batch: Batch, *, graphdef, layout: MeshLayout | None = None):
    return loss_sums(params, graphdef, batch, layout)


# ----------------------------------------------------------------------------- the compiled program


def step_microbatches(
    cfg: TrainConfig, layout: MeshLayout, platform: str, rows: int | None = None, shards: int | None = None
) -> int:
    """Gradient-accumulation microbatches of one step: data.microbatches, or the platform's fastest for 0 (auto;
    1 under a pipeline, which splits the batch itself). `rows` / `shards`: the batch rows one step splits and the
    data-parallel shards they spread over (default: the whole batch, over replica x data x fsdp x expert)."""
    if layout.pipeline > 1 and not cfg.data.microbatches:
        return 1
    shards = layout.batch_shards if shards is None else shards
    return cfg.data.resolved_microbatches(platform, rows, shards)


def check_splits(cfg: TrainConfig, layout: MeshLayout, platform: str) -> None:
    """LayoutError unless the model and the step's (micro)batches split evenly over the axes they are sharded on:
    a pipeline microbatch whose rows do not split over the batch axes, say, XLA would compile by giving every device
    every row (a 70B step at 32 rows over fsdp 64: 30 GiB per GPU where 11 do, and 64x the work)."""
    m, d = cfg.model, cfg.data
    layout.check_divisibility(
        batch_size=d.batch_size,
        microbatches=step_microbatches(cfg, layout, platform),
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        mlp_dim=m.mlp_dim,
        num_layers=m.num_layers,
        seq_len=d.seq_len,
        num_experts=m.num_experts,
        moe_every=m.moe_every,
    )


def step_model_config(model_cfg, layout: MeshLayout, microbatches: int):
    """The model config a train step runs: unrolled layers (the default) scan instead where unrolling costs memory.
    In a pipeline stage each tick of the schedule's scan would slice every layer's weights out of the stage's stack
    anew (copies XLA keeps per tick: +12-21% step memory); under FSDP with gradient accumulation XLA hoists every
    layer's all-gathered weights out of the accumulation loop (a whole unsharded copy of the layers, live for the
    step: +27-46%). Same params either way."""
    costly = layout.pipeline > 1 or (layout.fsdp > 1 and microbatches > 1)
    if model_cfg.scan_layers or not costly:
        return model_cfg
    return dataclasses.replace(model_cfg, scan_layers=True)


class Program:
    """Model graph, optimizer, shardings and the jitted init / train / eval functions for one config and mesh."""

    def __init__(self, cfg: TrainConfig, mesh: Mesh, layout: MeshLayout | None = None):
        """`layout` supplies the logical-axis rules and the pipeline schedule; None: defaults for the mesh's shape."""
        layout = layout or MeshLayout(**{axis: mesh.shape.get(axis, 1) for axis in MESH_AXES})
        if layout.pipeline > 1 and cfg.model.keeps_amax_history:
            # A pipeline sums each microbatch's gradient; an amax history must be combined by max (see train_step).
            raise config_lib.ConfigError(
                "delayed-scaling quantization (model.quant_scaling=delayed) does not run in "
                "a pipeline layout; set model.quant_scaling=current"
            )
        if layout.pipeline > 1 and cfg.model.num_experts:  # stages split groups of moe_every layers
            layout.check_layers(cfg.model.num_layers, cfg.model.moe_every)
        layout.check_experts(cfg.model.num_experts)
        rules = layout.rules
        self.cfg, self.mesh, self.layout = cfg, mesh, layout
        self.microbatches = step_microbatches(cfg, layout, mesh.devices.flat[0].platform)
        self.model_cfg = step_model_config(cfg.model, layout, self.microbatches)
        self.tx, self.schedule = make_optimizer(cfg.optim, cfg.steps)
        abstract_model = nnx.eval_shape(lambda: Transformer(self.model_cfg, rngs=nnx.Rngs(0)))
        self.graphdef, _ = nnx.split(abstract_model)
        self.abstract_state = jax.eval_shape(self._init)
        self.state_shardings = tree_shardings(self.abstract_state, mesh, rules)
        self.batch_sharding = batch_sharding(mesh, rules)
        replicated = NamedSharding(mesh, P())
        self.init = jax.jit(self._init, out_shardings=self.state_shardings)

        def step(state, batch):
            # a batch whose microbatches do not split over the batch axes would compile, every device given every
            # row: refused when the step is traced, whatever built this Program (export and eval ones never train)
            layout.check_batch(batch["inputs"].shape[0], self.microbatches)
            return train_step(
                state,
                batch,
                graphdef=self.graphdef,
                tx=self.tx,
                schedule=self.schedule,
                microbatches=self.microbatches,
                layout=layout,
            )

        self.train_step = jax.jit(
            self._in_mesh(step),
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, replicated),
            donate_argnums=0,
        )
        self.eval_step = jax.jit(
            self._in_mesh(lambda params, batch: eval_step(params, batch, graphdef=self.graphdef, layout=layout)),
            in_shardings=(self.state_shardings.params, self.batch_sharding),
            out_shardings=replicated,
        )
        # ((loss sum, count), grads) of one batch under this layout: what the equivalence tests compare.
        self.loss_and_grads = jax.jit(
            self._in_mesh(jax.value_and_grad(lambda p, b: loss_sums(p, self.graphdef, b, layout), has_aux=True)),
            in_shardings=(self.state_shardings.params, self.batch_sharding),
        )

    def _in_mesh(self, fn, rules: dict | None = None):
        """Trace ``fn`` with the mesh and the layout's rules (or `rules`) in context, so code that must split work
        per device (attention kernels and pipeline stages under shard_map) sees the mesh axes, and activation
        constraints (`sharding.rules.constrain`) the rules."""
        abstract_mesh, rules = self.mesh.abstract_mesh, self.layout.rules if rules is None else rules

        def traced(*args):
            with jax.sharding.use_abstract_mesh(abstract_mesh), use_rules(rules):
                return fn(*args)

        return traced

    def _init(self) -> TrainState:
        model = Transformer(self.model_cfg, rngs=nnx.Rngs(self.cfg.seed))
        params = nnx.state(model)
        return TrainState(jnp.zeros((), jnp.int32), params, self.tx.init(split_trainable(params)[0]))

    @property
    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(split_trainable(self.abstract_state.params)[0]))

    def device_batch(self, batch: Batch, whole: bool = False) -> Batch:
        """Host batch -> global arrays under `batch_sharding`. With several processes each passes only the rows its
        devices hold (`sharding.distributed.process_rows`; a whole global batch is also accepted), or with `whole`
        every process passes the same batch of any row count (eval batches, read whole by every process)."""
        if jax.process_count() == 1:
            return {k: jax.device_put(np.asarray(v), self.batch_sharding) for k, v in batch.items()}
        return {
            k: put_process_rows(np.asarray(v), self.batch_sharding, len(v) if whole else self.cfg.data.batch_size)
            for k, v in batch.items()
        }

    def evaluate(self, params, batches: list[Batch]) -> float:
        """Mean next-token loss over host batches (token-weighted: the sums of every batch, then one division)."""
        total, count = 0.0, 0.0
        for batch in batches:
            loss_sum, n = jax.device_get(self.eval_step(params, self.device_batch(batch, whole=True)))
            total, count = total + float(loss_sum), count + float(n)
        return total / max(count, 1.0)

    def abstract_with_shardings(self):
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), self.abstract_state, self.state_shardings
        )

    # What the Trainer calls besides init / evaluate: a plain program is one compiled step; DiLoCo (jaxlm.diloco)
    # subclasses these to pick among several compiled programs by step number and to sync its replicas.

    def compile_step(self, state, batch) -> Callable[[Any, Batch, int], tuple[Any, dict]]:
        """Compiles for these arguments; returns step_fn(state, batch, step) -> (state, metrics) producing `step`.
        The metrics hold device scalars (`loss`, `grad_norm`, `lr`, `skipped`) and any host figures the program
        adds; the Trainer logs every one but `skipped`."""
        compiled = self.train_step.lower(state, batch).compile()
        return lambda state, batch, step: compiled(state, batch)

    def eval_params(self, state):
        """The parameters evaluation and export use."""
        return state.params

    def rows_to_read(self) -> tuple[int, int] | None:
        """The rows [lo, hi) of every global batch this process reads (the rows its devices hold, when the run spans
        processes); None: all of them."""
        if jax.process_count() == 1:
            return None
        d = self.cfg.data
        return process_rows(self.batch_sharding, (d.batch_size, d.seq_len))

    def start(self, state, train_iter, log: Callable[[str], None]) -> tuple[Any, dict | None]:
        """Called once, after restore or init and before compiling: the state to train from and, when the program
        moved it (a replica catching up with its peers), the data position that goes with it. `log` takes lines for
        the run log, now and while stepping."""
        return state, None

    def close(self) -> None:
        """Stops what the program runs beside the steps; the Trainer calls it last."""
