"""Low-precision matmuls in the model: `model.matmul_precision` per layer class -> a QuantRecipe, the delayed-scaling
state each quantized matmul keeps, and the projection the layers call instead of a plain einsum.

Spec: one precision for every class ("fp8") or a comma list ("attention=fp8,mlp=fp8,lm_head=default"); classes not
named stay "default" (the plain einsum). Precisions: default | int8 | fp8 | int8_weight_only.

Shape suffixes follow the legend in docs/architecture.md; A is the length of an amax history.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxlm.config import parse_matmul_precision
from pallas_kernels.kernel_inputs import target_platform
from pallas_kernels.quantized_training import QuantRecipe, new_amax_history, quantized_dot
from sharding.rules import LOGICAL_AXES_KEY

PROJECTION_NAME = "projection"  # checkpoint_name of every plain projection's output (jaxlm.model.REMAT_POLICIES)


class AmaxHistory(nnx.Variable):
    """Delayed-scaling state of one quantized matmul: [3, A] amaxes of x, w and dY over the last A steps.

    Not a Param: the optimizer never sees it. Its gradient is the updated history (pallas_kernels.
    quantized_training), which the train step writes back; it is checkpointed with the params."""


def layer_recipe(cfg, layer_class: str) -> QuantRecipe | None:
    """The recipe for one layer class of a ModelConfig, or None for the plain (unquantized) einsum."""
    precision = parse_matmul_precision(cfg.matmul_precision)[layer_class]
    if precision == "default":
        return None
    if precision == "int8_weight_only":
        return QuantRecipe.int8_weight_only(impl=cfg.matmul_impl)
    if precision == "int8":
        recipe = QuantRecipe.int8(impl=cfg.matmul_impl)
    elif cfg.quant_backward == "e4m3":
        recipe = QuantRecipe.fp8_e4m3(impl=cfg.matmul_impl)
    else:
        recipe = QuantRecipe.fp8(impl=cfg.matmul_impl)
    return dataclasses.replace(recipe, grad_dtype=None) if cfg.quant_backward == "high" else recipe


def _keeps_history(cfg, recipe: QuantRecipe | None) -> bool:
    """A quantized, not weight-only, matmul under delayed scaling keeps an amax history."""
    return recipe is not None and not recipe.weight_only and cfg.quant_scaling == "delayed"


def amax_history(cfg, recipe: QuantRecipe | None) -> AmaxHistory | None:
    """A fresh history for a matmul that scales by delay, else None."""
    if not _keeps_history(cfg, recipe):
        return None
    return AmaxHistory(new_amax_history(cfg.quant_amax_history), **{LOGICAL_AXES_KEY: (None, None)})


def project(
    spec: str, x: jax.Array, w: jax.Array, recipe: QuantRecipe | None, history: jax.Array | None = None, out_dtype=None
) -> jax.Array:
    """einsum(spec, x, w) for a projection whose contracted axes are x's last and w's first, e.g. 'btd,dkge->btkge'.

    recipe None: the plain einsum in x's dtype (accumulating in `out_dtype` if given). Otherwise both sides are
    flattened to 2-D and multiplied by `quantized_dot`. The result has `out_dtype`, default x's dtype.
    """
    if recipe is None:
        # named, so the remat policies that keep dots keep it too: they cannot see the dot inside a custom_vjp
        return checkpoint_name(plain_projection(spec, out_dtype, x, w.astype(x.dtype)), PROJECTION_NAME)
    x_axes, w_axes = spec.split("->")[0].split(",")
    n = sum(a in w_axes for a in x_axes)
    if x_axes[len(x_axes) - n :] != w_axes[:n]:
        raise ValueError(f"project: {spec!r} must contract x's last axes with w's first ones")
    lead, out = x.shape[: x.ndim - n], w.shape[n:]
    contracted = math.prod(w.shape[:n])
    y = quantized_dot(x.reshape(-1, contracted), w.reshape(contracted, -1), history, _placed(recipe))
    return y.reshape(*lead, *out).astype(out_dtype or x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def plain_projection(spec: str, out_dtype, x: jax.Array, w: jax.Array) -> jax.Array:
    """einsum(spec, x, w), with a backward written out so the weight gradient's matmul re-lays out its narrower input.

    Autodiff computes the weight gradient as dY^T x: XLA:CPU then re-lays out the wide dY (the [tokens, vocab] logit
    gradient, the [tokens, 2, mlp] gate/up gradient) before the matmul, and for the down projection x (the SwiGLU
    output, recomputed in transposed order). Here the narrower of x and dY goes first and is the one re-laid out
    (measured on the gpt-bench step: ~0.5 s of copies gone, 2.6 s -> 2.3 s). Same math and dtypes as autodiff: dX
    and dW are computed in x's dtype."""
    return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)


def _plain_projection_fwd(spec, out_dtype, x, w):
    return plain_projection(spec, out_dtype, x, w), (x, w)


def _plain_projection_bwd(spec, out_dtype, residuals, dy):
    x, w = residuals
    dy = dy.astype(x.dtype)
    if not _one_device():
        return _projection_grads(spec, x, w, dy)
    dx, dw = _projection_grads("nc,co->no", *_flattened(spec, x, w, dy))
    return dx.reshape(x.shape), dw.reshape(w.shape)


def _projection_grads(spec, x, w, dy):
    """(dX, dW) of einsum(spec, x, w) for the cotangent dy (in x's dtype)."""
    inputs, y_axes = spec.split("->")
    x_axes, w_axes = inputs.split(",")
    dx = jnp.einsum(f"{y_axes},{w_axes}->{x_axes}", dy, w)
    # The weight gradient contracts the tokens, the leading axes of both: XLA:CPU re-lays out the first operand of
    # the dot. Make that the narrower one (x for the wide QKV, gate/up and vocabulary outputs; dY for the down
    # projection), with lax.dot_general: jnp.einsum would reorder the operands to match the output's axis order.
    first, first_axes, second, second_axes = (x, x_axes, dy, y_axes) if x.size <= dy.size else (dy, y_axes, x, x_axes)
    tokens = [a for a in x_axes if a not in w_axes]
    dims = ((tuple(first_axes.index(a) for a in tokens), tuple(second_axes.index(a) for a in tokens)), ((), ()))
    dw = jax.lax.dot_general(first, second, dims)
    if target_platform() == "cpu":
        # XLA would fold the transpose below (the down projection's) or the tied head's embed.T outside into the
        # dot, and XLA:CPU computes the transposed product ([F, D], [V, D]) at 140-155 GFLOP/s against 185-210 for
        # the one written here: the barrier keeps the dot as written and the transpose becomes a copy (gpt-bench
        # shapes: the head's weight gradient 42 -> 34 ms with the copy, the down projection's 5.7 -> 4.6 ms).
        dw = jax.lax.optimization_barrier(dw)
    dw_axes = [a for a in first_axes if a not in tokens] + [a for a in second_axes if a not in tokens]
    dw = dw.transpose([dw_axes.index(a) for a in w_axes])
    return dx, dw.astype(w.dtype)


plain_projection.defvjp(_plain_projection_fwd, _plain_projection_bwd)


def _one_device() -> bool:
    """Traced for one device (no mesh, or a mesh of one): reshapes that merge axes cannot cost a resharding."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or mesh.size == 1


def _flattened(spec, x, w, dy):
    """x [N, C], w [C, O], dy [N, O]: the projection as 2-D operands (N tokens, C w's contracted axes, O the rest), so
    each backward product has one contracted axis. XLA:CPU lays out a dot's operands with all its contracted axes
    together, so with two of them (the gate/up projection's (2, F) in dX, the tokens' (B, T) in dW) it copied each
    layer's weight transposed in every microbatch; one contracted axis reads w as it lies (measured on the gpt-bench
    step: those copies gone, 1.6% faster). On one device only: merging a sharded axis with its neighbours (F split
    over `tensor`) would make GSPMD reshard."""
    x_axes, w_axes = spec.split("->")[0].split(",")
    contracted = sum(a in w_axes for a in x_axes)
    if dy.shape != x.shape[: x.ndim - contracted] + w.shape[contracted:]:
        raise ValueError(f"project: x {x.shape}, w {w.shape} -> {dy.shape} is not x's last axes against w's first")
    C = math.prod(w.shape[:contracted])
    w_CO = w.reshape(C, -1)
    return x.reshape(-1, C), w_CO, dy.reshape(-1, w_CO.shape[1])


def _placed(recipe: QuantRecipe) -> QuantRecipe:
    """'auto' under a multi-device mesh means XLA's implementation, which GSPMD partitions like any dot (and XLA:GPU
    lowers to fp8/int8 GEMMs); the Pallas kernel is a custom call it could only replicate."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or recipe.impl == "xla":
        return recipe
    if recipe.impl == "pallas":
        raise ValueError(
            f"model.matmul_impl='pallas' runs the kernel on whole operands and cannot be split over a "
            f"{mesh.size}-device mesh; use matmul_impl='auto' or 'xla' with this layout"
        )
    return dataclasses.replace(recipe, impl="xla")


# Post-training quantization: the axes each stored weight contracts over in jaxlm.model's einsums (after the
# stacked `layers` axis), so one int8 scale per output channel matches what `project` computes in the graph.
WEIGHT_CONTRACTIONS: dict[tuple[str, ...], tuple[int, ...]] = {
    ("blocks", "attn", "wqkv"): (1,),  # [L, D, K, G+2, E]
    ("blocks", "attn", "wo"): (1, 2),  # [L, H, E, D]
    ("blocks", "mlp", "w_in"): (1,),  # [L, D, 2, F]
    ("blocks", "mlp", "w_out"): (1,),  # [L, F, D]
    ("lm_head",): (0,),  # [D, V]
    ("embed",): (1,),  # [V, D]: the tied head multiplies by embed.T, one scale per vocab entry
}


def quantize_weights(params: dict, dtype: str = "int8") -> dict[tuple[str, ...], tuple[jax.Array, jax.Array]]:
    """{path: (q, scale)} for every matmul weight in a pure params dict (nnx.to_pure_dict), per output channel."""
    from pallas_kernels.quantize import quantize

    out = {}
    for path, axes in WEIGHT_CONTRACTIONS.items():
        node = params
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            out[path] = quantize(jnp.asarray(node), dtype, axis=axes)
    return out
