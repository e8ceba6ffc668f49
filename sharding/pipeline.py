"""Pipeline parallelism over the `pipeline` mesh axis: GPipe and 1F1B schedules as one SPMD program (the other
schedules run from their tables: sharding.table_runner).

The layers' stacked params [L, ...] are viewed as [P, L/P, ...], one block of layers per stage. Inside a
`jax.shard_map` that is manual over `pipeline` only (data / fsdp / tensor stay automatic, so FSDP and tensor
parallelism keep working inside a stage), every stage runs the same `lax.scan` over clock ticks and passes
activations to its neighbour with `lax.ppermute`. Microbatch m reaches stage s at tick m + s.

GPipe: all forwards, then all backwards. The forward scan is differentiated by JAX, so each stage keeps the
residuals of every microbatch it ran: activation memory grows with the number of microbatches M.

1F1B: after a warm-up, each stage alternates one forward and one backward. Stage s runs the backward of
microbatch m at tick m + 2(P-1) - s, so it holds at most 2(P-1-s) + 1 microbatch inputs: memory scales with the
stages, not with M. The backward is written out (`jax.vjp` per tick, recomputing the stage's forward from its
stashed input) and the loss head runs on the last stage inside the loop, so the schedule computes the gradients
itself; a `jax.custom_vjp` hands them to the surrounding autodiff.

Both schedules idle (P-1) of every (M+P-1) stage-slots: `bubble_fraction`.

Shape suffixes follow the legend in docs/architecture.md (B: the rows of one microbatch; a `_M` suffix is a leading
[M] axis), plus P pipeline stages.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

AXIS = "pipeline"
SCHEDULES = ("gpipe", "1f1b")

StageFn = Callable[[Any, jax.Array, Any], jax.Array]  # (stage params [L/P, ...], x_BTD, side inputs) -> x_BTD
HeadFn = Callable[[Any, jax.Array, Any], tuple[jax.Array, jax.Array]]  # (head params, y_BTD, side) -> (sum, count)


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle share of a GPipe or 1F1B step: (P - 1) / (M + P - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def stash_slots(stages: int) -> int:
    """Microbatch inputs a 1F1B stage keeps alive at once (stage 0 holds the most): 2P - 1, whatever M is."""
    return 2 * stages - 1


def split_stages(stacked, stages: int):
    """[L, ...] -> [P, L/P, ...] on every leaf: stage s gets layers s*L/P ... (s+1)*L/P - 1."""
    return jax.tree.map(lambda a: a.reshape(stages, a.shape[0] // stages, *a.shape[1:]), stacked)


def pipeline_loss(
    schedule: str,
    stage_fn: StageFn,
    head_fn: HeadFn,
    stage_params,
    head_params,
    x_MBTD: jax.Array,
    stage_side_M,
    head_side_M,
    *,
    stages: int,
) -> tuple[jax.Array, jax.Array]:
    """(loss sum, count) of `head_fn(stage_fn_P(...stage_fn_1(x)))` summed over microbatches, pipelined.

    stage_params: [P, L/P, ...] leaves (`split_stages`); x_MBTD: the first stage's inputs; *_side_M: pytrees with a
    leading [M] axis (e.g. segment ids for the stages, targets for the head). Differentiable in stage_params,
    head_params and x_MBTD with either schedule.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    fns = _Fns(stage_fn, head_fn, stages)
    if schedule == "gpipe":
        return _gpipe_loss(fns, stage_params, head_params, x_MBTD, stage_side_M, head_side_M)
    return _one_f_one_b(fns, stage_params, head_params, x_MBTD, stage_side_M, head_side_M)


class _Fns:
    """The user's functions and the stage count: static arguments of the custom_vjp (hashable by identity)."""

    def __init__(self, stage_fn: StageFn, head_fn: HeadFn, stages: int):
        self.stage_fn, self.head_fn, self.stages = stage_fn, head_fn, stages


def _shard_map(body, stage_params, *args, out_specs):
    """Manual over `pipeline` only: stage params split on their leading axis, everything else replicated."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.axis_names:
        raise ValueError("pipelining needs a mesh with a 'pipeline' axis in context (jax.sharding.use_abstract_mesh)")
    in_specs = (jax.tree.map(lambda _: P(AXIS), stage_params),) + tuple(jax.tree.map(lambda _: P(), a) for a in args)
    # check_vma=False: the block-sparse attention inside a stage runs its own shard_map over the other axes (also
    # unchecked: the Pallas interpreter cannot be), whose cotangents would not carry this map's `pipeline` typing.
    # Unchecked, the values a stage receives or writes must be combined explicitly: every psum below is deliberate.
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={AXIS}, check_vma=False)
    return mapped(stage_params, *args)


def _local(stage_params):
    """This stage's [1, L/P, ...] block -> [L/P, ...]."""
    return jax.tree.map(lambda a: a[0], stage_params)


def _at(tree_M, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree_M)


def _shift(x, stages: int, direction: int):
    """Sends x from every stage s to s + direction (the ends receive zeros)."""
    pairs = [(s, s + direction) for s in range(stages) if 0 <= s + direction < stages]
    return jax.lax.ppermute(x, AXIS, pairs)


# ----------------------------------------------------------------------------- GPipe


def _gpipe_outputs(fns: _Fns, stage_params, x_MBTD, stage_side_M):
    """Last-stage outputs y_MBTD of every microbatch (replicated over stages). Plain JAX: autodiff gives GPipe."""
    stages = fns.stages
    M = x_MBTD.shape[0]

    def body(stage_params, x_MBTD, stage_side_M):
        params, s = _local(stage_params), jax.lax.axis_index(AXIS)

        def tick(carry, t):
            received, out_MBTD = carry
            m = jnp.clip(t - s, 0, M - 1)  # the microbatch this stage works on (garbage while idle, discarded)
            x = jnp.where(s == 0, _at(x_MBTD, jnp.minimum(t, M - 1)), received)
            y = fns.stage_fn(params, x, _at(stage_side_M, m))
            done = (s == stages - 1) & (t >= stages - 1)
            out_MBTD = jnp.where(done, jax.lax.dynamic_update_index_in_dim(out_MBTD, y, m, 0), out_MBTD)
            return (_shift(y, stages, +1), out_MBTD), None

        zeros = jnp.zeros_like(x_MBTD[0])
        (_, out_MBTD), _ = jax.lax.scan(tick, (zeros, jnp.zeros_like(x_MBTD)), jnp.arange(M + stages - 1))
        return jax.lax.psum(jnp.where(s == stages - 1, out_MBTD, 0), AXIS)  # only the last stage's buffer is filled

    return _shard_map(body, stage_params, x_MBTD, stage_side_M, out_specs=P())


def _head_sums(fns: _Fns, head_params, y_MBTD, head_side_M):
    sums, counts = jax.lax.map(lambda a: fns.head_fn(head_params, *a), (y_MBTD, head_side_M))
    return jnp.sum(sums), jnp.sum(counts)


def _gpipe_loss(fns, stage_params, head_params, x_MBTD, stage_side_M, head_side_M):
    y_MBTD = _gpipe_outputs(fns, stage_params, x_MBTD, stage_side_M)
    return _head_sums(fns, head_params, y_MBTD, head_side_M)


# ----------------------------------------------------------------------------- 1F1B


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _one_f_one_b(fns, stage_params, head_params, x_MBTD, stage_side_M, head_side_M):
    # Without differentiation (eval) only the forward is needed, and that is GPipe's forward.
    return _gpipe_loss(fns, stage_params, head_params, x_MBTD, stage_side_M, head_side_M)


def _one_f_one_b_fwd(fns, stage_params, head_params, x_MBTD, stage_side_M, head_side_M):
    loss, count, grads = _one_f_one_b_grads(fns, stage_params, head_params, x_MBTD, stage_side_M, head_side_M)
    return (loss, count), (grads, stage_side_M, head_side_M)


def _one_f_one_b_bwd(fns, residuals, cotangents):
    (g_stage, g_head, g_x), stage_side_M, head_side_M = residuals
    ct_loss, _ = cotangents  # the count does not depend on the params
    scale = lambda tree: jax.tree.map(lambda g: (g * ct_loss).astype(g.dtype), tree)
    no_grad = lambda tree: jax.tree.map(_zero_cotangent, tree)
    return scale(g_stage), scale(g_head), scale(g_x), no_grad(stage_side_M), no_grad(head_side_M)


def _zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return jnp.zeros(x.shape, jax.dtypes.float0)


_one_f_one_b.defvjp(_one_f_one_b_fwd, _one_f_one_b_bwd)


def _one_f_one_b_grads(fns: _Fns, stage_params, head_params, x_MBTD, stage_side_M, head_side_M):
    """Runs the 1F1B schedule: (loss sum, count, (d stage_params, d head_params, d x_MBTD))."""
    stages = fns.stages
    M = x_MBTD.shape[0]
    slots = stash_slots(stages)

    def body(stage_params, head_params, x_MBTD, stage_side_M, head_side_M):
        params, s = _local(stage_params), jax.lax.axis_index(AXIS)
        last = s == stages - 1

        def tick(carry, t):
            recv_x, recv_g, stash, g_params, g_head, g_x_MBTD, loss, count = carry
            # Forward of microbatch f, stashing its input for the backward.
            f = t - s
            f_ok = (f >= 0) & (f < M)
            f_i = jnp.clip(f, 0, M - 1)
            x = jnp.where(s == 0, _at(x_MBTD, f_i), recv_x)
            y = fns.stage_fn(params, x, _at(stage_side_M, f_i))
            stash = jnp.where(f_ok, jax.lax.dynamic_update_index_in_dim(stash, x, f_i % slots, 0), stash)
            # The last stage turns its output into a loss and the loss's gradient at once (its f is its b).
            (l, n), (g_h, g_y) = _head_value_and_grad(fns.head_fn, head_params, y, _at(head_side_M, f_i))
            head_ok = last & f_ok
            loss, count = loss + jnp.where(head_ok, l, 0.0), count + jnp.where(head_ok, n, 0.0)
            g_head = jax.tree.map(lambda a, g: a + jnp.where(head_ok, g, 0), g_head, g_h)
            # Backward of microbatch b from its stashed input (the stage forward is recomputed inside the vjp).
            b = t - (2 * (stages - 1) - s)
            b_ok = (b >= 0) & (b < M)
            b_i = jnp.clip(b, 0, M - 1)
            g_out = jnp.where(last, g_y, recv_g)
            x_b = _at(stash, b_i % slots)
            _, vjp = jax.vjp(lambda p, xb: fns.stage_fn(p, xb, _at(stage_side_M, b_i)), params, x_b)
            g_p, g_xb = vjp(g_out)
            g_params = jax.tree.map(lambda a, g: a + jnp.where(b_ok, g, 0), g_params, g_p)
            g_x_MBTD = jnp.where((s == 0) & b_ok, jax.lax.dynamic_update_index_in_dim(g_x_MBTD, g_xb, b_i, 0), g_x_MBTD)
            carry = (
                _shift(y, stages, +1),
                _shift(jnp.where(b_ok, g_xb, 0), stages, -1),
                stash,
                g_params,
                g_head,
                g_x_MBTD,
                loss,
                count,
            )
            return carry, None

        x0 = jnp.zeros_like(x_MBTD[0])
        init = (
            x0,
            x0,
            jnp.zeros((slots,) + x0.shape, x0.dtype),
            jax.tree.map(jnp.zeros_like, params),
            jax.tree.map(jnp.zeros_like, head_params),
            jnp.zeros_like(x_MBTD),
            jnp.zeros((), jnp.float32),
            jnp.zeros((), jnp.float32),
        )
        carry, _ = jax.lax.scan(tick, init, jnp.arange(M + 2 * (stages - 1)))
        _, _, _, g_params, g_head, g_x_MBTD, loss, count = carry
        # Stage params' gradients stay on their stage; the rest lives on one stage and is summed to all.
        g_params = jax.tree.map(lambda g: g[None], g_params)
        total = lambda tree: jax.tree.map(lambda a: jax.lax.psum(a, AXIS), tree)
        return total(loss), total(count), g_params, total(g_head), total(g_x_MBTD)

    out_specs = (P(), P(), jax.tree.map(lambda _: P(AXIS), stage_params), jax.tree.map(lambda _: P(), head_params), P())
    loss, count, g_stage, g_head, g_x = _shard_map(
        body, stage_params, head_params, x_MBTD, stage_side_M, head_side_M, out_specs=out_specs
    )
    return loss, count, (g_stage, g_head, g_x)


def _head_value_and_grad(head_fn: HeadFn, head_params, y_BTD, side):
    """((loss sum, count), (d head_params, d y)) of the head on one microbatch."""
    (l, n), vjp = jax.vjp(lambda h, y: head_fn(h, y, side), head_params, y_BTD)
    g_h, g_y = vjp((jnp.ones_like(l), jnp.zeros_like(n)))
    return (l, n), (g_h, g_y)
