"""A quantized matmul that trains: ``quantized_dot(x, w, history, recipe)`` with a ``jax.custom_vjp``.

Forward: x and w in int8 or float8_e4m3fn. Backward (Transformer Engine's recipe): dX = dY·Wᵀ and dW = Xᵀ·dY with
dY in float8_e5m2 (or int8), or unquantized in the compute dtype (``grad_dtype=None``). ``QuantRecipe.fp8_e4m3``
puts dY in float8_e4m3fn as well (a mantissa bit more, 2^7 less range than e5m2; its scale tracks dY's amax like
the others'), so that every product multiplies one dtype.

Scaling:
- delayed (``history`` given): one scale per tensor from the largest amax of the last A steps, rows x / w / dY of
  a [3, A] history (no history yet: the current amax). The step's own amaxes are recorded in the new history,
  which the backward pass returns as the history's "gradient": the caller overwrites the state with it instead of
  handing it to the optimizer (dY's amax only exists in the backward pass, so it cannot be a forward output).
  Quantized tensors are kept from the forward for the transposed backward products, as TE does.
- current (``history=None``): scales from the tensor itself, per row of x and per column of w (and along the
  contraction of every backward product), re-quantizing x and w for the transposed products.

Kernels: with ``impl="pallas"`` on a Hopper-or-newer GPU, the products whose two operands share one 8-bit dtype run
as the Mosaic GPU kernel (all three for int8 and for fp8 with e4m3 gradients; for fp8 the forward only, its backward
multiplying e5m2 by e4m3, which Mosaic's wgmma refuses), the others as the Triton kernel (``scaled_matmul``
picks). The Mosaic kernel reads its second operand K-major, so where a product quantizes that operand itself the
quantization writes it K-major in the same pass, and the delayed-scaling weight is kept in the layout that needs the
fewest transposes (``_forward``); the 8-bit operands dW's product needs transposed are transposed by
``byte_transpose`` on a GPU. dX leaves its product in dY's bfloat16.

Weight-only (``recipe.weight_only``): int8 per-channel weights, float activations; dX is the exact derivative of
the quantized forward, dW the straight-through estimate (Xᵀ·dY), so a weight-only model can also be fine-tuned.

Shape suffixes follow the legend in docs/architecture.md, plus x [X, C] @ w [C, Y] -> [X, Y] (rows, contraction,
output columns, as in quantized_matmul) and A, the length of an amax history.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from .byte_transpose import byte_transpose
from .kernel_inputs import resolve_backend
from .quantize import amax, quant_dtype, quantize, scale_from_amax
from .quantized_matmul import LOWERINGS, MatmulBlocks, resolve_impl, scaled_matmul

HISTORY_ROWS = ("x", "w", "dy")


@dataclasses.dataclass(frozen=True)
class QuantRecipe:
    """How one matmul is quantized (hashable: the custom_vjp's static argument)."""

    dtype: str = "float8_e4m3fn"  # forward operands: int8 | float8_e4m3fn
    grad_dtype: str | None = "float8_e5m2"  # dY in the backward products; None: unquantized backward
    weight_only: bool = False  # int8 weights x float activations; dtype must be int8
    margin: float = 0.0  # scale headroom: amax * 2**margin maps to the type's max
    stochastic_grads: bool = False  # round dY stochastically (needs a key)
    impl: str = "auto"  # scaled_matmul impl: auto | pallas | xla
    blocks: MatmulBlocks | None = None  # None: default_blocks; a MatmulBlocks picks Triton, a MosaicTiles Mosaic GPU
    # scaled_matmul's GPU lowering for every product: None (Mosaic GPU on sm_90 where it can, else Triton), "triton",
    # or "mosaic" (a ValueError for a product it cannot take, such as fp8's mixed e5m2 x e4m3 backward)
    lowering: str | None = None

    def __post_init__(self):
        quant_dtype(self.dtype)
        if self.grad_dtype is not None:
            quant_dtype(self.grad_dtype)
        if self.weight_only and quant_dtype(self.dtype) != jnp.int8:
            raise ValueError(f"weight-only quantization is int8; got dtype {self.dtype!r}")
        if self.lowering not in (None, *LOWERINGS):
            raise ValueError(f"unknown quantized matmul lowering {self.lowering!r}; choose one of {LOWERINGS}")

    @classmethod
    def fp8(cls, **kw) -> "QuantRecipe":
        return cls("float8_e4m3fn", "float8_e5m2", **kw)

    @classmethod
    def fp8_e4m3(cls, **kw) -> "QuantRecipe":
        """fp8 with dY in e4m3 too: on Hopper every product, the backward's included, is the Mosaic GPU kernel's."""
        return cls("float8_e4m3fn", "float8_e4m3fn", **kw)

    @classmethod
    def int8(cls, **kw) -> "QuantRecipe":
        return cls("int8", "int8", **kw)

    @classmethod
    def int8_weight_only(cls, **kw) -> "QuantRecipe":
        return cls("int8", None, weight_only=True, **kw)


def new_amax_history(length: int) -> jax.Array:
    """An empty [3, length] history (rows x, w, dY); zeros mean 'not seen yet'."""
    if length <= 0:
        raise ValueError(f"amax history length must be positive, got {length}")
    return jnp.zeros((len(HISTORY_ROWS), length), jnp.float32)


def updated_history(history: jax.Array, amaxes_3: jax.Array) -> jax.Array:
    """The history one step later: every row shifted by one, this step's amaxes in column 0."""
    return jnp.roll(history, 1, axis=1).at[:, 0].set(amaxes_3.astype(jnp.float32))


def delayed_amax(history_row: jax.Array, current: jax.Array) -> jax.Array:
    """The amax a delayed scale uses: the history's largest, or the current one while the history is empty."""
    past = jnp.max(history_row)
    return jnp.where(past > 0, past, current)


def quantized_dot(
    x_XC: jax.Array, w_CY: jax.Array, history: jax.Array | None, recipe: QuantRecipe, key: jax.Array | None = None
) -> jax.Array:
    """x [X, C] @ w [C, Y] -> [X, Y] in x's dtype, forward and backward quantized by `recipe`.

    history: a [3, A] amax history for delayed scaling, or None for current scaling. Its cotangent is the updated
    history (see the module docstring). key: for stochastic rounding of dY (``recipe.stochastic_grads``).
    """
    if x_XC.ndim != 2 or w_CY.ndim != 2 or x_XC.shape[1] != w_CY.shape[0]:
        raise ValueError(
            f"quantized_dot: expected x [X, C] and w [C, Y], got {list(x_XC.shape)} and {list(w_CY.shape)}"
        )
    if history is not None and (history.ndim != 2 or history.shape[0] != len(HISTORY_ROWS)):
        raise ValueError(f"quantized_dot: amax history must be [3, A], got {list(history.shape)}")
    if recipe.weight_only and history is not None:
        raise ValueError("quantized_dot: weight-only quantization uses per-channel current scales; pass history=None")
    if recipe.stochastic_grads and key is None:
        raise ValueError("quantized_dot: recipe.stochastic_grads needs a key")
    return _quantized_dot(x_XC, w_CY, history, key, recipe)


def _matmul(recipe, xq, xs, wq, ws, out_dtype, w_layout="CY"):
    return scaled_matmul(
        xq,
        xs,
        wq,
        ws,
        out_dtype=out_dtype,
        impl=recipe.impl,
        blocks=recipe.blocks,
        lowering=recipe.lowering,
        w_layout=w_layout,
    )


def _quantize_kmajor(t_CY, dtype, key=None):
    """t [C, Y] quantized per column, written K-major: ([Y, C], scales [1, Y]). The same values as
    ``quantize(t, dtype, axis=0)``, transposed within the quantization's own pass."""
    q_YC, s_Y1 = quantize(t_CY.T, dtype, axis=1, key=key)
    return q_YC, s_Y1.T


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _quantized_dot(x, w, history, key, recipe):
    return _forward(x, w, history, recipe)[0]


def _forward(x, w, history, recipe):
    if recipe.weight_only:
        wq, ws = quantize(w, recipe.dtype, axis=0)
        return _matmul(recipe, x, None, wq, ws, x.dtype), (x, wq, ws)
    if history is None:
        xq, xs = quantize(x, recipe.dtype, axis=1)  # per row
        wq_YC, ws = _quantize_kmajor(w, recipe.dtype)  # per output column
        return _matmul(recipe, xq, xs, wq_YC, ws, x.dtype, "YC"), (x, w)
    amax_x, amax_w = amax(x).reshape(()), amax(w).reshape(())
    xs = scale_from_amax(delayed_amax(history[0], amax_x), recipe.dtype, recipe.margin).reshape(1, 1)
    ws = scale_from_amax(delayed_amax(history[1], amax_w), recipe.dtype, recipe.margin).reshape(1, 1)
    xq, _ = quantize(x, recipe.dtype, scale=xs)
    # The weight is kept [Y, C]: K-major for the forward (the Mosaic kernel reads it as is), and the [C, Y] of dX's
    # product (the Triton kernel reads it as is: fp8's dX is mixed e5m2 x e4m3). Where dX runs on Mosaic (int8, fp8
    # with e4m3 gradients) it transposes the 8-bit weight once.
    wq_YC, _ = quantize(w.T, recipe.dtype, scale=ws)
    y = _matmul(recipe, xq, xs, wq_YC, ws, x.dtype, "YC")
    keep = (xq, xs, wq_YC, ws) if recipe.grad_dtype is not None else (x, w)
    return y, (keep, amax_x, amax_w, jnp.zeros((0,), w.dtype))


def _fwd(x, w, history, key, recipe):
    y, res = _forward(x, w, history, recipe)
    return y, (res, history, key)


def _bwd(recipe, saved, g):
    """Cotangents for (x, w, history, key); g [X, Y] has x's dtype."""
    res, history, key = saved
    if recipe.weight_only:
        x, wq, ws = res
        dx = jnp.dot(g, (wq.astype(jnp.float32) * ws).T.astype(g.dtype), preferred_element_type=jnp.float32)
        dw = jnp.dot(x.T, g, preferred_element_type=jnp.float32)  # straight-through
        return dx.astype(x.dtype), dw, None, None
    if history is None:
        x, w = res
        dx, dw = _current_backward(recipe, x, w, g, key)
        return dx.astype(x.dtype), dw.astype(w.dtype), None, None
    keep, amax_x, amax_w, w_like = res
    amax_g = amax(g).reshape(())
    new_history = updated_history(history, jnp.stack([amax_x, amax_w, amax_g]))
    if recipe.grad_dtype is None:
        x, w = keep
        dx, dw = _unquantized_backward(x, w, g)
    else:
        xq, xs, wq_YC, ws = keep
        gs = scale_from_amax(delayed_amax(history[2], amax_g), recipe.grad_dtype, recipe.margin).reshape(1, 1)
        gq, _ = quantize(g, recipe.grad_dtype, scale=gs, key=key)
        # per-tensor scales survive the transposes. dW contracts over the rows of both residuals, so a K-major
        # kernel transposes both (xq.T here, gq in scaled_matmul on the Mosaic path): unavoidable for dW.
        dx = _matmul(recipe, gq, gs, wq_YC, ws, _dx_dtype(g))
        dw = _matmul(recipe, _transposed(recipe, xq), xs, gq, gs, jnp.float32)
    return dx.astype(g.dtype), dw.astype(w_like.dtype), new_history, None


def _transposed(recipe, q):
    """An 8-bit operand's transpose: by a kernel of its own where the Pallas kernels run on a GPU (``byte_transpose``
    says why), else a layout XLA picks."""
    if resolve_impl(recipe.impl) != "pallas":
        return q.T
    return byte_transpose(q, resolve_backend("quantized_dot", None, None))


def _dx_dtype(g):
    """dX's dtype out of its product: bfloat16 where dY is (the float32 product rounded once in the kernel's
    epilogue, the value rounding it after gives, in half the bytes: on the 1B step 6.5 GB a step), else float32."""
    return jnp.bfloat16 if g.dtype == jnp.bfloat16 else jnp.float32


def _unquantized_backward(x, w, g):
    dx = jnp.dot(g, w.T.astype(g.dtype), preferred_element_type=jnp.float32)
    dw = jnp.dot(x.T.astype(g.dtype), g, preferred_element_type=jnp.float32)
    return dx, dw


def _current_backward(recipe, x, w, g, key):
    """Each backward product quantizes its operands along its own contraction: rows of dY and of Wᵀ for dX,
    rows of Xᵀ and columns of dY for dW. Every second operand is written K-major by its quantization (W as it is
    for dX, dYᵀ for dW), what the Mosaic kernel reads; the Triton kernel's transposes back fuse into the same pass."""
    if recipe.grad_dtype is None:
        return _unquantized_backward(x, w, g)
    k_rows, k_cols = (None, None) if key is None else jax.random.split(key)
    g_rows, gs_rows = quantize(g, recipe.grad_dtype, axis=1, key=k_rows)  # [X, 1]
    wt_CY, wts = _quantize_kmajor(w.T, recipe.dtype)  # Wᵀ [Y, C] K-major is W [C, Y]; [1, C]: per column of Wᵀ
    dx = _matmul(recipe, g_rows, gs_rows, wt_CY, wts, _dx_dtype(g), "YC")
    xt, xts = quantize(x.T, recipe.dtype, axis=1)  # [C, 1]
    g_YX, gs_cols = _quantize_kmajor(g, recipe.grad_dtype, key=k_cols)  # dY [X, Y] K-major: [Y, X]; [1, Y]
    dw = _matmul(recipe, xt, xts, g_YX, gs_cols, jnp.float32, "YC")
    return dx, dw


_quantized_dot.defvjp(_fwd, _bwd)
