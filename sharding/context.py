"""Attention over a sequence split along the `context` mesh axis (context parallelism).

The rules map the logical `seq` axis of activations to `context`: each device holds T / C tokens of every row, in
the order the batch gives them (a balancing reorder, `balanced_order`, moves tokens and their positions together).
Everything but attention works token by token, so XLA's partitioner splits it; attention needs every key a query
may see, and this module brings them, per shard, under the same `jax.shard_map` the block-sparse kernels run in:

  all_gather  gather K and V once (kv heads, not query heads) and attend the local queries to the whole sequence;
              the backward reduce-scatters dK / dV. Holds the whole sequence's K and V on every device.
  ring        C steps: attend the local queries to the K/V shard in hand, merge the partial results by their
              log-sum-exp, pass the shard on with `ppermute`; autodiff sends dK / dV back around the ring. Holds
              two shards; XLA can overlap each pass with the step's compute.

The mask is evaluated at the tokens' positions (`pallas_kernels.at_positions`), so the kernels skip the tiles it
empties on remote shards as on the local one. Shape suffixes follow the legend in docs/architecture.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from pallas_kernels.kernel_mask import DocumentSlot
from pallas_kernels.masks import And, Or

VARIANTS = ("all_gather", "ring")


def bind(template: pk.Mask, q_segment_ids, kv_segment_ids, q_positions, kv_positions) -> pk.Mask:
    """The mask of local queries against one stretch of keys: document slots read the two sides' segment ids,
    every static term the two sides' positions."""

    def fill(m):
        if isinstance(m, DocumentSlot):
            return pk.document(q_segment_ids, kv_segment_ids)
        if isinstance(m, (And, Or)):
            return type(m)(tuple(fill(c) for c in m.masks))
        return m

    return pk.at_positions(fill(template), q_positions, kv_positions)


def context_attention(
    attend, q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, positions_BT, *, template, axis, variant, order=None
):
    """Per shard (inside a shard_map whose `axis` splits T): the local queries' attention over every shard's keys.

    ``attend(q_BTHE, k_BSKE, v_BSKE, mask) -> (out_BTHE, lse_BHT)`` runs one block-sparse product; ``template`` is
    the config's mask with document slots; ``positions_BT`` are the local tokens' positions in their sequence, or
    None with ``order`` (numpy [T], the same for every row, known when tracing): shard c holds positions
    order[c * T / C: (c + 1) * T / C]. Known positions let the ring skip what the mask empties: a shard no later
    device's queries can see is not passed on, and a step whose shard the local queries cannot see computes
    nothing (`ring_plan`)."""
    C = jax.lax.axis_size(axis)
    me = jax.lax.axis_index(axis)
    plan = table_CT = None
    if order is not None:
        shards_CT = np.asarray(order, np.int32).reshape(C, -1)
        table_CT = jnp.asarray(shards_CT)
        positions_BT = jnp.broadcast_to(table_CT[me], q_BTHE.shape[:2])
        plan = ring_plan(template, shards_CT)
    if variant == "all_gather":
        gather = lambda x: None if x is None else jax.lax.all_gather(x, axis, axis=1, tiled=True)  # noqa: E731
        k_BSKE, v_BSKE, kv_segments, kv_positions = (gather(x) for x in (k_BTKE, v_BTKE, segment_ids_BT, positions_BT))
        mask = bind(template, segment_ids_BT, kv_segments, positions_BT, kv_positions)
        return attend(q_BTHE, k_BSKE, v_BSKE, mask)[0]
    if variant != "ring":
        raise ValueError(f"model.context_parallel {variant!r} is unknown; choose one of {', '.join(VARIANTS)}")
    sees, sends = plan if plan is not None else (np.ones((C, C), bool), [[(i, (i + 1) % C) for i in range(C)]] * C)
    # known positions are looked up, not sent
    shard = (k_BTKE, v_BTKE, segment_ids_BT, positions_BT if table_CT is None else None)
    out_BTHE = lse_BTH = None
    for step in range(C):
        k_BSKE, v_BSKE, kv_segments, kv_positions = shard
        if table_CT is not None:
            kv_positions = jnp.broadcast_to(table_CT[(me - step) % C], q_BTHE.shape[:2])

        def compute(q, k, v, kv_segments, kv_positions):
            mask = bind(template, segment_ids_BT, kv_segments, positions_BT, kv_positions)
            part_BTHE, part_BHT = attend(q, k, v, mask)
            return part_BTHE.astype(jnp.float32), part_BHT.transpose(0, 2, 1)

        def nothing(q, *_):
            return jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:3], -jnp.inf, jnp.float32)

        held = [(i - step) % C for i in range(C)]  # the shard device i holds at this step
        visible = sees[np.arange(C), held]
        args = (q_BTHE, k_BSKE, v_BSKE, kv_segments, kv_positions)
        if visible.all():
            part = compute(*args)
        else:  # some device's queries cannot see the shard it holds: it skips the products
            part = jax.lax.cond(jnp.asarray(visible)[me], compute, nothing, *args)
        out_BTHE, lse_BTH = merge(out_BTHE, lse_BTH, *part)
        if step < C - 1 and sends[step]:
            shard = tuple(None if x is None else jax.lax.ppermute(x, axis, sends[step]) for x in shard)
    return out_BTHE.astype(q_BTHE.dtype)


def ring_plan(template: pk.Mask, shards_CT: np.ndarray) -> tuple[np.ndarray, list[list[tuple[int, int]]]]:
    """(sees [C, C]: may device c's queries see shard j's keys, the ring's sends per step: [(from, to)]).

    A shard moves one device on per step: after step s device i holds shard (i - s) % C. It is passed on only while
    a device further along its way may see it. `sees` is conservative (`may_see`: documents count as seeing), so
    nothing needed is ever skipped."""
    C = len(shards_CT)
    runs = [_runs(shard) for shard in shards_CT]
    sees = np.array(
        [[any(may_see(template, q, k) for q in runs[c] for k in runs[j]) for j in range(C)] for c in range(C)]
    )
    sends = []
    for step in range(C - 1):
        pairs = []
        for i in range(C):
            j = (i - step) % C  # the shard device i holds now, passed to i + 1
            if any(sees[(j + t) % C, j] for t in range(step + 1, C)):
                pairs.append((i, (i + 1) % C))
        sends.append(pairs)
    return sees, sends


def _runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """Sorted positions -> maximal runs of consecutive ones, as half-open ranges."""
    p = np.sort(positions)
    cuts = np.flatnonzero(np.diff(p) != 1) + 1
    return [(int(r[0]), int(r[-1]) + 1) for r in np.split(p, cuts)]


def may_see(mask: pk.Mask, q: tuple[int, int], kv: tuple[int, int]) -> bool:
    """May some query at positions [q0, q1) see some key at [k0, k1) under ``mask``? Exact for each static term;
    And is the conjunction of its terms' answers (an upper bound), Or the disjunction; anything else (documents,
    unknown masks) may."""
    m = pk.masks
    (q0, q1), (k0, k1) = q, kv
    if isinstance(mask, m.Causal):
        return q1 - 1 >= k0
    if isinstance(mask, m.SlidingWindow):  # some q - kv in [0, window)
        return max(q0 - (k1 - 1), 0) <= min(q1 - 1 - k0, mask.window - 1)
    if isinstance(mask, m.ChunkedCausal):
        c = mask.chunk  # causal, and the two ranges' chunks overlap
        return q1 - 1 >= k0 and q0 // c <= (k1 - 1) // c and k0 // c <= (q1 - 1) // c
    if isinstance(mask, m.PrefixLM):
        return k0 < mask.prefix_len or q1 - 1 >= k0
    if isinstance(mask, m.GlobalTokens):
        return k0 < mask.n or q0 < mask.n
    if isinstance(mask, And):
        return all(may_see(c, q, kv) for c in mask.masks)
    if isinstance(mask, Or):
        return any(may_see(c, q, kv) for c in mask.masks)
    return True


def merge(out_BTHE, lse_BTH, part_BTHE, part_BTH):
    """Two softmax results over disjoint keys -> theirs over the union, weighted by their log-sum-exps (float32).
    A row that saw no key in a part (its lse not finite: the kernels write +inf there) weighs 0; every `where`
    keeps the unselected branch finite, so no NaN reaches the gradient."""
    seen = jnp.isfinite(part_BTH)
    part_BTH = jnp.where(seen, part_BTH, -jnp.inf)
    part_BTHE = jnp.where(seen[..., None], part_BTHE.astype(jnp.float32), 0.0)
    if out_BTHE is None:
        return part_BTHE, part_BTH
    top = jnp.maximum(lse_BTH, part_BTH)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    a, b = jnp.exp(lse_BTH - top), jnp.exp(part_BTH - top)
    total = a + b
    some = total > 0
    safe = jnp.where(some, total, 1.0)
    new_BTH = jnp.where(some, top + jnp.log(safe), -jnp.inf)
    out_BTHE = (a / safe)[..., None] * out_BTHE + (b / safe)[..., None] * part_BTHE
    return out_BTHE, new_BTH


ORDERS = ("auto", "zigzag", "contiguous")


def sequence_order(mask: pk.Mask, seq_len: int, shards: int, how: str = "auto") -> np.ndarray | None:
    """The order a row's tokens are split over the context axis in (positions [T]), or None for as they come.

    zigzag (`balanced_order`) evens out a causal mask's work; contiguous keeps local masks (sliding windows,
    chunks) local, so the ring passes a shard only as far as the window reaches. auto: contiguous for a mask with
    a local term, zigzag otherwise."""
    if shards == 1 or how == "contiguous":
        return None
    if how == "auto" and _is_local(mask):
        return None
    return balanced_order(seq_len, shards)


def _is_local(mask: pk.Mask) -> bool:
    if isinstance(mask, (pk.masks.SlidingWindow, pk.masks.ChunkedCausal)):
        return True
    return isinstance(mask, And) and any(_is_local(c) for c in mask.masks)


def balanced_order(seq_len: int, shards: int) -> np.ndarray:
    """A permutation of positions [T] for `shards` devices under a causal mask: the sequence cut into 2 x shards
    chunks, device c holding chunks c and 2 x shards - 1 - c (zigzag), so every device's queries see about as many
    keys. Device c's tokens are order[c * T / shards: (c + 1) * T / shards]."""
    chunks = np.arange(seq_len).reshape(2 * shards, -1)
    return np.concatenate([np.concatenate([chunks[c], chunks[2 * shards - 1 - c]]) for c in range(shards)])
