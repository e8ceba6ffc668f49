"""Every expert's SwiGLU over its expert-sorted rows (``grouped_matmul.Groups``): the MLP of a dropless MoE layer.

On TPU and GPU it is two grouped matmuls with the activation between. On CPU one loop over the experts does the
whole MLP chunk by chunk (``_in_chunks``): each expert's weights are read once, a chunk's [rows, 2F] projection and
activation stay in the cache (two loops would write them to memory and read them back), and the backward takes
both weight gradients and the input gradient in one pass. On tiny_lm's shapes (1024 tokens, 8 experts of 512, top
2) that took the MoE train step from 1.50x to 1.42x the dense one (``python -m experiments.compare_moe
--step-time``).

Shape letters beyond the legend (docs/architecture.md): R rows of the expert-sorted layout, X experts, H = 2F the
fused gate / up projection's width, C a chunk's rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxlm.grouped_matmul import Groups

CPU_CHUNK = 512  # rows per chunk while an expert has them: XLA:CPU's products run at full speed from ~512 rows


def grouped_swiglu(groups: Groups, rows, w_in_XDH, w_out_XFD):
    """silu(gate) * up of each row's expert, projected back: [R, D] (or [N, tile, D]) rows in, the same out;
    ``w_in_XDH``'s last axis is [gate | up]."""
    if groups.kernel == "expert_loop":
        return _expert_loop(rows, w_in_XDH, w_out_XFD, groups.first_X, groups.padded_X, groups.tile)
    return groups.matmul(swiglu_halves(groups.matmul(rows, w_in_XDH)), w_out_XFD)


def _in_chunks(first, rows, tile: int, total: int, fn, carry):
    """``carry = fn(carry, row, size)`` over rows [first, first + rows) (a whole number of tiles, within ``total``):
    chunks of ``CPU_CHUNK`` rows (or of the largest half of it ``total`` holds) while they last, then at most one
    of each half of that down to a tile: few products, each as large as the rows allow (XLA:CPU's run 1.1-1.4x
    slower per row at 128-256 rows than at 1024), and no padding past a tile."""
    chunk = CPU_CHUNK
    while chunk > max(total, tile):
        chunk //= 2
    whole = rows // chunk
    carry = jax.lax.fori_loop(0, whole, lambda k, c: fn(c, first + k * chunk, chunk), carry)
    at, size = first + whole * chunk, chunk // 2
    while size >= tile:
        take = first + rows - at >= size
        carry = jax.lax.cond(take, lambda c, at=at, size=size: fn(c, at, size), lambda c: c, carry)
        at, size = at + jnp.where(take, size, 0), size // 2
    return carry


def _activation(h_CH):
    gate, up = jnp.split(h_CH, 2, axis=-1)
    return jax.nn.silu(gate) * up


def gate_up_grads(gate, up, da):
    """(d gate, d up) of silu(gate) * up given its cotangent ``da``: silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g)))."""
    sig = jax.nn.sigmoid(gate)
    return da * up * sig * (1 + gate * (1 - sig)), da * gate * sig


def _activation_grad(h_CH, da_CF):
    return jnp.concatenate(gate_up_grads(*jnp.split(h_CH, 2, axis=-1), da_CF), axis=-1)


@jax.custom_vjp
def swiglu_halves(h):
    """silu(gate) * up of a fused projection whose last axis is [gate | up] (2F). Written out like
    jaxlm.model.swiglu: autodiff's pads-and-add of the two halves' gradients cost XLA:CPU more than the products
    around them (measured on an MoE layer's rows: 10 of its 33 ms forward + backward)."""
    return _activation(h)


swiglu_halves.defvjp(lambda h: (_activation(h), h), lambda h, da: (_activation_grad(h, da),))


def _forward(x_RD, w_in_XDH, w_out_XFD, first_X, padded_X, tile: int, keep_h: bool):
    """(output [R, D], the projections [R, H] when ``keep_h``: the backward's residual). Rows past the groups
    stay zero."""
    R, D = x_RD.shape

    def expert(e, carry):
        w_in_DH, w_out_FD = w_in_XDH[e], w_out_XFD[e]

        def chunk(carry, row, size):
            y_RD, h_RH = carry
            h_CH = jax.lax.dynamic_slice_in_dim(x_RD, row, size) @ w_in_DH
            y_RD = jax.lax.dynamic_update_slice_in_dim(y_RD, _activation(h_CH) @ w_out_FD, row, 0)
            return y_RD, (jax.lax.dynamic_update_slice_in_dim(h_RH, h_CH, row, 0) if keep_h else h_RH)

        return _in_chunks(first_X[e], padded_X[e], tile, R, chunk, carry)

    h_RH = jnp.zeros((R, w_in_XDH.shape[-1]) if keep_h else (1, 1), x_RD.dtype)
    return jax.lax.fori_loop(0, w_in_XDH.shape[0], expert, (jnp.zeros((R, D), x_RD.dtype), h_RH))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _expert_loop(x_RD, w_in_XDH, w_out_XFD, first_X, padded_X, tile):
    return _forward(x_RD, w_in_XDH, w_out_XFD, first_X, padded_X, tile, keep_h=False)[0]


def _expert_loop_fwd(x_RD, w_in_XDH, w_out_XFD, first_X, padded_X, tile):
    y_RD, h_RH = _forward(x_RD, w_in_XDH, w_out_XFD, first_X, padded_X, tile, keep_h=True)
    return y_RD, (x_RD, h_RH, w_in_XDH, w_out_XFD, first_X, padded_X)


def _expert_loop_bwd(tile, residuals, dy_RD):
    """Per expert and chunk: both weight gradients (summed in float32 over the expert's chunks) and the rows'."""
    x_RD, h_RH, w_in_XDH, w_out_XFD, first_X, padded_X = residuals

    def expert(dx_RD, e):
        w_in_DH, w_out_FD = w_in_XDH[e], w_out_XFD[e]

        def chunk(carry, row, size):
            dx_RD, dw_in_DH, dw_out_FD = carry
            x_CD, h_CH, dy_CD = (jax.lax.dynamic_slice_in_dim(a, row, size) for a in (x_RD, h_RH, dy_RD))
            dw_out_FD += jnp.einsum("cf,cd->fd", _activation(h_CH), dy_CD, preferred_element_type=jnp.float32)
            dh_CH = _activation_grad(h_CH, jnp.einsum("cd,fd->cf", dy_CD, w_out_FD))
            dw_in_DH += jnp.einsum("cd,ch->dh", x_CD, dh_CH, preferred_element_type=jnp.float32)
            dx_RD = jax.lax.dynamic_update_slice_in_dim(dx_RD, jnp.einsum("ch,dh->cd", dh_CH, w_in_DH), row, 0)
            return dx_RD, dw_in_DH, dw_out_FD

        zeros = (jnp.zeros(w_in_DH.shape, jnp.float32), jnp.zeros(w_out_FD.shape, jnp.float32))
        dx_RD, dw_in_DH, dw_out_FD = _in_chunks(first_X[e], padded_X[e], tile, x_RD.shape[0], chunk, (dx_RD, *zeros))
        return dx_RD, (dw_in_DH, dw_out_FD)

    dx_RD, (dw_in_XDH, dw_out_XFD) = jax.lax.scan(expert, jnp.zeros_like(x_RD), jnp.arange(w_in_XDH.shape[0]))
    return dx_RD, dw_in_XDH.astype(w_in_XDH.dtype), dw_out_XFD.astype(w_out_XFD.dtype), None, None


_expert_loop.defvjp(_expert_loop_fwd, _expert_loop_bwd)
