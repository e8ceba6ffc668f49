"""Expert parallelism: an MoE layer's experts split over the `expert` mesh axis, each token copy sent to the device
that holds its expert and its output sent back, with all-to-all inside ``shard_map``. The model routes (jaxlm.moe)
and hands its per-device expert computation to ``dispatch``; it never learns where the experts are.

Tokens split over the batch axes (the default rules put `expert` among them, so each device of the expert axis
routes its own tokens, as data parallelism does) and over the context axis. A device sorts its copies by expert,
which is by destination, and one ragged all-to-all sends each destination exactly its copies (`ragged_all_to_all`;
XLA:CPU has none, so on CPU a dense all-to-all of worst-case slices stands in). The destination receives into a
buffer of E x a device's copies (all of every source's copies may be for it, so nothing is dropped), runs its own
experts over the rows that arrived (the rest are routed nowhere: jaxlm.grouped_matmul computes no tile for them on
CPU and GPU, and zeroes them on TPU), and a second ragged all-to-all
brings each source its outputs back, where they are unsorted and mixed as on one device. Capacity-limited
dispatch bounds the buffers instead: each expert takes Q copies per source device, so a device sends [W, Q] slots
to each destination (``_exchange_slots``).

Shape letters: those of jaxlm.moe (U tokens, Z experts per token, A copies, X experts) and E devices of the
expert axis (S: the same devices as sources), W = X / E experts per device, R = E x A rows a device may receive.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from pallas_kernels.kernel_inputs import target_platform
from sharding.rules import active_mesh_axes, dividing_axes


def expert_axes() -> tuple[str, ...]:
    """The mesh axes the active rules split experts over (empty: every device holds every expert)."""
    return active_mesh_axes("expert")


def capacity(num_tokens: int, k: int, num_experts: int, factor: float) -> int:
    """Slots per expert for ``num_tokens`` tokens: ceil(factor * tokens * k / experts)."""
    return max(1, math.ceil(factor * num_tokens * k / num_experts))


def expert_ranks(experts_A, num_experts: int):
    """(order [A]: copies sorted by expert, stably (token order within one); their experts; each sorted copy's rank
    among its expert's copies): what capacity dispatch keeps the first Q of."""
    order_A = jnp.argsort(experts_A, stable=True)
    sorted_A = experts_A[order_A]
    counts_X = jnp.bincount(sorted_A, length=num_experts)
    return order_A, sorted_A, jnp.arange(experts_A.shape[0]) - (jnp.cumsum(counts_X) - counts_X)[sorted_A]


def dispatch(
    local: Callable,
    x_UD,
    weights_UZ,
    experts_UZ,
    w_in_XDCF,
    w_out_XFD,
    capacity_factor: float = 0.0,
    per_expert: Callable | None = None,
):
    """(y_UD, copies dropped over capacity) of ``local(x_UD, weights_UZ, experts_UZ, w_in, w_out) -> (y_UD,
    dropped)`` over the experts the weights hold, run per device on its own tokens: with the copies exchanged over
    an expert axis, else as it is. Per device, because routing sorts the copies by expert: over tokens split across
    devices that sort (and each grouped-matmul step) would be a global one, all-gathers inside every layer
    (Qwen3-30B-A3B on 64 H100s: 1.2 TB of them per step). The tokens split over the batch and context axes; the
    ranks of a tensor axis route the same tokens and each computes its slice of the experts' hidden width, the
    slices' outputs summed; weights are gathered as FSDP gathers them. ``capacity_factor > 0``: ``local`` is
    capacity dispatch, so each device's experts take capacity_factor x their fair share of that device's copies;
    over an expert axis the exchange then sends those slots only, and ``per_expert(x_WRD, w_in, w_out) -> y_WRD``
    (each expert's MLP over its rows) computes what arrives."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return local(x_UD, weights_UZ, experts_UZ, w_in_XDCF, w_out_XFD)
    axes = expert_axes()
    # U = B * T tokens, B split over the batch axes and T over the context axis (seq): the rows split as both do.
    # Not over the tensor axes: each tensor rank routes the same tokens (splitting them over tensor too made XLA
    # replicate the whole batch's activations and logits: Qwen3-30B-A3B at FSDP 32 x tensor 2 on v5p, 52.5 GiB per
    # chip against 17.3).
    batch = dividing_axes(mesh.shape, active_mesh_axes("batch") + active_mesh_axes("seq"), x_UD.shape[0])
    if not axes and not batch:
        return local(x_UD, weights_UZ, experts_UZ, w_in_XDCF, w_out_XFD)
    E, X = math.prod(mesh.shape[a] for a in axes), w_in_XDCF.shape[0]
    if X % E:
        raise ValueError(f"model.num_experts = {X} does not split over the expert axis of {E} devices")
    free = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual}
    # the experts' hidden width split as the rules split `mlp` (tensor): each rank computes its slice of every
    # expert's SwiGLU for the same tokens, and the slices' outputs are summed (Megatron's tensor-parallel MLP)
    hidden = tuple(a for a in active_mesh_axes("mlp") if a in free and a not in axes + batch)
    hidden = dividing_axes(mesh.shape, hidden, w_out_XFD.shape[1])
    rows = P(batch or None, None)
    w_in_spec, w_out_spec = P(axes or None, None, None, hidden or None), P(axes or None, hidden or None, None)

    def shard(x_UD, weights_UZ, experts_UZ, w_in_WDCF, w_out_WFD):
        args = (x_UD, weights_UZ, experts_UZ, w_in_WDCF, w_out_WFD)
        if not axes:
            y_UD, dropped = local(*args)
        elif capacity_factor > 0:
            y_UD, dropped = _exchange_slots(per_expert, axes, E, capacity_factor, *args)
        else:
            y_UD, dropped = _exchange(local, axes, E, *args), jnp.zeros((), jnp.int32)
        if hidden:  # the slices' partial outputs (the tokens' gradients sum over the slices the same way)
            y_UD = jax.lax.psum(y_UD, hidden)
        return y_UD, jax.lax.psum(dropped, batch) if batch else dropped

    return jax.shard_map(
        shard,
        mesh=mesh,
        in_specs=(rows, rows, rows, w_in_spec, w_out_spec),
        out_specs=(rows, P()),
        axis_names=free,
        check_vma=False,
    )(x_UD, weights_UZ, experts_UZ, w_in_XDCF, w_out_XFD)


def _exchange(local, axes, E: int, x_UD, weights_UZ, experts_UZ, w_in_WDCF, w_out_WFD):
    """One device's part, dropless: each destination gets exactly the copies for its experts (`ragged_all_to_all`),
    this device receives up to E x A of them (any source's copies may all be for it), computes them, and sends
    each source its outputs back into that source's A rows."""
    U, Z = experts_UZ.shape
    D, W = x_UD.shape[-1], w_in_WDCF.shape[0]
    A = U * Z
    experts_A = experts_UZ.reshape(-1)
    order_A = jnp.argsort(experts_A, stable=True)  # by expert, so by destination device
    sorted_A = experts_A[order_A]
    dest_A = sorted_A // W
    send_E = jnp.bincount(dest_A, length=E).astype(jnp.int32)
    counts_SE = jax.lax.all_gather(send_E, axes)  # copies from each source to each destination, on every device
    me = jax.lax.axis_index(axes)
    recv_S = counts_SE[:, me]
    before_S = jnp.arange(E) < me
    land_E = jnp.sum(jnp.where(before_S[:, None], counts_SE, 0), axis=0)  # after earlier sources' copies, there
    home_S = jnp.sum(jnp.where(before_S[None, :], counts_SE, 0), axis=1)  # where each source's copies for me sat
    out, back = (_starts(send_E), send_E, land_E, recv_S), (_starts(recv_S), recv_S, home_S, send_E)
    recv_RD = ragged_all_to_all(x_UD[order_A // Z], jnp.zeros((E * A, D), x_UD.dtype), *out, axes=axes)
    # the expert each received row is for; W (none: routed nowhere, computed by no tile) past what arrived
    recv_R = ragged_all_to_all(sorted_A - dest_A * W, jnp.full((E * A,), W, jnp.int32), *out, axes=axes)
    out_RD = local(recv_RD, jnp.ones((E * A, 1), jnp.float32), recv_R[:, None], w_in_WDCF, w_out_WFD)[0]
    y_AD = ragged_all_to_all(out_RD, jnp.zeros((A, D), out_RD.dtype), *back, axes=axes)  # in sorted order
    y_UZD = y_AD[jnp.argsort(order_A)].reshape(U, Z, D)
    return jnp.einsum("uzd,uz->ud", y_UZD, weights_UZ.astype(y_UZD.dtype))


def _starts(sizes_E):
    return jnp.cumsum(sizes_E) - sizes_E


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axes):
    """`jax.lax.ragged_all_to_all` over `axes`: slice e of the operand (rows input_offsets[e], send_sizes[e] of
    them) goes to device e, which writes it at the output_offsets[e] this device names; recv_sizes: the rows each
    source sends here. XLA:CPU has no ragged all-to-all, so on CPU the same exchange runs as a dense all-to-all of
    slices padded to the operand's rows (the worst case, the shapes the GPU and TPU programs avoid)."""
    if target_platform() != "cpu":
        return jax.lax.ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axes
        )
    N = operand.shape[0]
    j_N = jnp.arange(N)
    rows_EN = jnp.clip(input_offsets[:, None] + j_N, 0, N - 1)
    sent_EN = j_N < send_sizes[:, None]
    mask = sent_EN.reshape(sent_EN.shape + (1,) * (operand.ndim - 1))
    blocks = jnp.where(mask, operand[rows_EN], jnp.zeros((), operand.dtype))
    got = jax.lax.all_to_all(blocks, axes, 0, 0)  # [source, N, ...]
    at_S = jax.lax.all_to_all(output_offsets, axes, 0, 0, tiled=True)  # where each source's slice goes here
    to_SN = jnp.where(j_N < recv_sizes[:, None], at_S[:, None] + j_N, output.shape[0])  # past the end: dropped
    return output.at[to_SN].set(got, mode="drop")


def _exchange_slots(per_expert, axes, E: int, factor: float, x_UD, weights_UZ, experts_UZ, w_in_WDCF, w_out_WFD):
    """Capacity dispatch over the expert axis: each of the device's experts keeps its first Q copies, and the
    device sends destination e a [W, Q] block of slots (W experts there), not the worst case. What arrives is
    [W experts, E sources x Q, D]: one batched product per projection, and the outputs go back the same way."""
    U, Z = experts_UZ.shape
    D, W = x_UD.shape[-1], w_in_WDCF.shape[0]
    Q = capacity(U, Z, W * E, factor)
    order_A, sorted_A, rank_A = expert_ranks(experts_UZ.reshape(-1), W * E)
    kept_A = rank_A < Q
    dest_A = sorted_A // W
    slot_A = jnp.where(kept_A, (sorted_A - dest_A * W) * Q + rank_A, W * Q)  # dropped copies: a scratch slot
    send_ESD = jnp.zeros((E, W * Q + 1, D), x_UD.dtype).at[dest_A, slot_A].set(x_UD[order_A // Z])[:, :-1]
    recv_ESD = jax.lax.all_to_all(send_ESD, axes, 0, 0)
    recv_WRD = recv_ESD.reshape(E, W, Q, D).transpose(1, 0, 2, 3).reshape(W, E * Q, D)  # R = E * Q rows
    out_WRD = per_expert(recv_WRD, w_in_WDCF, w_out_WFD)
    out_ESD = out_WRD.reshape(W, E, Q, D).transpose(1, 0, 2, 3).reshape(E, W * Q, D)
    back_ESD = jnp.concatenate([jax.lax.all_to_all(out_ESD, axes, 0, 0), jnp.zeros((E, 1, D), x_UD.dtype)], axis=1)
    y_UZD = back_ESD[dest_A, slot_A][jnp.argsort(order_A)].reshape(U, Z, D)
    y_UD = jnp.einsum("uzd,uz->ud", y_UZD, weights_UZ.astype(y_UZD.dtype))
    return y_UD, jnp.sum(~kept_A).astype(jnp.int32)
