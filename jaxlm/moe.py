"""Mixture-of-experts feed-forward: a router sends each token to ``experts_per_token`` of ``num_experts`` SwiGLU
experts and mixes their outputs by its weights. Routing lives here; how tokens reach experts on other devices is
sharding's business (expert parallelism), not the model's.

Routers: ``softmax`` (Mixtral, Qwen3-MoE: softmax over every expert, the top k kept, renormalized when
``router_norm_topk``) and ``sigmoid_bias`` (DeepSeek-V3: sigmoid scores; the top k of score + a per-expert bias
are chosen, their scores normalized as weights; the bias only steers selection and is moved after every step
toward uniform load, so no auxiliary loss has to be tuned). Router math is float32.

Dispatch is dropless by default: the token copies are sorted by expert and go through their experts' SwiGLU
(``jaxlm.expert_swiglu`` on ``jaxlm.grouped_matmul``'s layout: ``lax.ragged_dot`` on TPU, tiles elsewhere), so no
token is dropped.
``capacity_factor > 0`` gives each expert Q = ceil(capacity_factor * U * k / X) slots instead and drops the copies
past them (in token order), the fixed shapes an all-to-all wants; the dropped count is a metric. Under a mesh both
run per device on its U tokens (sharding.experts), so capacity is per device, as every sharded MoE counts it.

Shape letters beyond the legend (docs/architecture.md): U tokens (B * T), X experts, Z experts per token,
A = U * Z token copies, Q slots per expert (capacity); C is the fused gate / up projection's two halves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.config import ModelConfig
from jaxlm.expert_swiglu import grouped_swiglu
from jaxlm.grouped_matmul import Groups
from sharding import experts
from sharding.experts import capacity, expert_ranks
from sharding.rules import LOGICAL_AXES_KEY


class RouterBias(nnx.Variable):
    """DeepSeek-V3's load-steering bias [X] of one MoE layer. Not a Param: the optimizer never sees it. Its
    "gradient" is the updated bias (``steer``), which the train step writes back, as amax histories do."""


def _param(key, shape, axes, std):
    return nnx.Param(std * jax.random.normal(key, shape, jnp.float32), **{LOGICAL_AXES_KEY: axes})


class MoE(nnx.Module):
    """Router, stacked experts and optional shared experts of one layer."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, X, F = cfg.d_model, cfg.num_experts, cfg.expert_mlp_dim
        self.cfg = cfg
        self.router = _param(rngs.params(), (D, X), ("embed", None), D**-0.5)
        self.w_in = _param(rngs.params(), (X, D, 2, F), ("expert", "embed", None, "mlp"), D**-0.5)
        self.w_out = _param(rngs.params(), (X, F, D), ("expert", "mlp", "embed"), F**-0.5 / (2 * cfg.num_layers) ** 0.5)
        if cfg.router == "sigmoid_bias":
            self.bias = RouterBias(jnp.zeros((X,), jnp.float32), **{LOGICAL_AXES_KEY: (None,)})
        if cfg.num_shared_experts:
            S = cfg.num_shared_experts * F
            self.shared_in = _param(rngs.params(), (D, 2, S), ("embed", None, "mlp"), D**-0.5)
            self.shared_out = _param(rngs.params(), (S, D), ("mlp", "embed"), S**-0.5 / (2 * cfg.num_layers) ** 0.5)

    def __call__(self, x_BTD: jax.Array, dropless: bool = False) -> tuple[jax.Array, dict]:
        """(output [B, T, D], this layer's routing statistics: ``routing_stats``). ``dropless`` overrides the
        capacity factor (inference never drops a token's experts)."""
        cfg = self.cfg
        B, T, D = x_BTD.shape
        x_UD = x_BTD.reshape(B * T, D)
        logits_UX = x_UD.astype(jnp.float32) @ self.router[...]
        bias_X = self.bias[...] if cfg.router == "sigmoid_bias" else None
        weights_UZ, experts_UZ, probs_UX = route(
            logits_UX, cfg.experts_per_token, cfg.router, cfg.router_norm_topk, bias_X
        )
        w_in, w_out = self.w_in[...].astype(x_UD.dtype), self.w_out[...].astype(x_UD.dtype)
        factor = 0.0 if dropless else cfg.capacity_factor
        # where the experts live is sharding's business: per device, or exchanged over the expert axis
        local = functools.partial(capacity_experts, factor=factor) if factor > 0 else _dropless
        y_UD, dropped = experts.dispatch(local, x_UD, weights_UZ, experts_UZ, w_in, w_out, factor, expert_swiglu)
        if cfg.num_shared_experts:
            y_UD = y_UD + swiglu_mlp(
                x_UD, self.shared_in[...].astype(x_UD.dtype), self.shared_out[...].astype(x_UD.dtype)
            )
        stats = routing_stats(logits_UX, probs_UX, experts_UZ, dropped)
        if bias_X is not None:  # the bias's new value rides back as its gradient; 0 * keeps steer on the path
            y_UD = y_UD + 0 * steer(bias_X, stats["load"], cfg.router_bias_rate).sum().astype(y_UD.dtype)
        return y_UD.reshape(B, T, D), stats


def route(logits_UX, k: int, router: str, norm_topk: bool, bias_X=None):
    """(weights [U, Z] float32, chosen experts [U, Z] int32, router probabilities [U, X] for the aux loss)."""
    if router == "softmax":
        probs_UX = jax.nn.softmax(logits_UX, axis=-1)
        weights_UZ, experts_UZ = jax.lax.top_k(probs_UX, k)
        if norm_topk:
            weights_UZ = weights_UZ / weights_UZ.sum(-1, keepdims=True)
        return weights_UZ, experts_UZ, probs_UX
    scores_UX = jax.nn.sigmoid(logits_UX)
    _, experts_UZ = jax.lax.top_k(scores_UX + jax.lax.stop_gradient(bias_X), k)
    weights_UZ = jnp.take_along_axis(scores_UX, experts_UZ, axis=-1)
    weights_UZ = weights_UZ / weights_UZ.sum(-1, keepdims=True)
    return weights_UZ, experts_UZ, scores_UX / scores_UX.sum(-1, keepdims=True)


def swiglu_mlp(x_UD, w_in_DCF, w_out_FD):
    h_UCF = jnp.einsum("nd,dcf->ncf", x_UD, w_in_DCF)
    return (jax.nn.silu(h_UCF[:, 0]) * h_UCF[:, 1]) @ w_out_FD


def dropless_experts(x_UD, weights_UZ, experts_UZ, w_in_XDCF, w_out_XFD, tiled: bool | None = None):
    """Every token copy through its expert: laid out by expert (``grouped_matmul.Groups``; ``tiled`` None: tiles
    except on TPU, which takes ragged_dot), each expert's SwiGLU (``expert_swiglu``), and back to its token, mixed
    by the router's weights."""
    X, D, _, F = w_in_XDCF.shape
    groups = Groups.of(experts_UZ, X, tiled)
    y_UZD = groups.outputs(grouped_swiglu(groups, groups.gather(x_UD), w_in_XDCF.reshape(X, D, 2 * F), w_out_XFD))
    return jnp.einsum("uzd,uz->ud", y_UZD, weights_UZ.astype(y_UZD.dtype))


def _dropless(x_UD, weights_UZ, experts_UZ, w_in_XDCF, w_out_XFD):
    return dropless_experts(x_UD, weights_UZ, experts_UZ, w_in_XDCF, w_out_XFD), jnp.zeros((), jnp.int32)


def expert_swiglu(x_XRD, w_in_XDCF, w_out_XFD):
    """Each expert's SwiGLU over its own R rows: one batched product per projection (capacity buffers)."""
    h_XRCF = jnp.einsum("xrd,xdcf->xrcf", x_XRD, w_in_XDCF)
    return jnp.einsum("xrf,xfd->xrd", jax.nn.silu(h_XRCF[:, :, 0]) * h_XRCF[:, :, 1], w_out_XFD)


def capacity_experts(x_UD, weights_UZ, experts_UZ, w_in_XDCF, w_out_XFD, factor: float):
    """(output [U, D], copies dropped): each expert's first Q copies (in token order) go to its buffer, the rest
    contribute nothing. Under a mesh this runs per device on its tokens (sharding.experts.dispatch), Q of each."""
    U, Z = experts_UZ.shape
    X, D, _, F = w_in_XDCF.shape
    Q = capacity(U, Z, X, factor)
    order_A, sorted_experts_A, rank_A = expert_ranks(experts_UZ.reshape(-1), X)
    kept_A = rank_A < Q
    slot_A = jnp.where(kept_A, sorted_experts_A * Q + rank_A, X * Q)  # dropped copies go to a scratch row
    buffer_XQD = jnp.zeros((X * Q + 1, D), x_UD.dtype).at[slot_A].set(x_UD[order_A // Z])[:-1].reshape(X, Q, D)
    out_XQD = expert_swiglu(buffer_XQD, w_in_XDCF, w_out_XFD)
    out_AD = jnp.concatenate([out_XQD.reshape(X * Q, D), jnp.zeros((1, D), out_XQD.dtype)])[slot_A]
    y_UZD = out_AD[jnp.argsort(order_A)].reshape(U, Z, D)
    return jnp.einsum("uzd,uz->ud", y_UZD, weights_UZ.astype(y_UZD.dtype)), jnp.sum(~kept_A).astype(jnp.int32)


def routing_stats(logits_UX, probs_UX, experts_UZ, dropped) -> dict:
    """aux: the Switch / Mixtral load-balancing loss X * sum_e f_e P_e (f_e: share of copies routed to e, P_e: mean
    router probability of e; 1 when balanced); z: the router z-loss mean(logsumexp(logits)^2); load [X]: f_e;
    dropped: copies over capacity."""
    X = logits_UX.shape[-1]
    load_X = jnp.bincount(experts_UZ.reshape(-1), length=X) / experts_UZ.size
    aux = X * jnp.sum(jax.lax.stop_gradient(load_X) * probs_UX.mean(0))
    z = jnp.mean(jax.nn.logsumexp(logits_UX, axis=-1) ** 2)
    return {"aux": aux, "z": z, "load": load_X, "dropped": dropped}


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def steer(bias_X, load_X, rate: float):
    """The router bias, unchanged; its gradient is the bias moved by ``rate`` toward experts below the mean load
    and away from those above it (DeepSeek-V3's update: sign of the load error)."""
    return bias_X


def _steer_fwd(bias_X, load_X, rate):
    return bias_X, (bias_X, load_X)


def _steer_bwd(rate, residuals, _):
    bias_X, load_X = residuals
    return bias_X + rate * jnp.sign(load_X.mean() - load_X), jnp.zeros_like(load_X)


steer.defvjp(_steer_fwd, _steer_bwd)
