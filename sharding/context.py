"""Attention over a sequence split along the `context` mesh axis (context parallelism).

The rules map the logical `seq` axis of activations to `context`: each device holds T / C tokens of every row, in
the order the batch gives them (a balancing reorder, `sharding.context_order`, moves tokens and positions together).
Everything but attention works token by token, so XLA's partitioner splits it; attention needs every key a query
may see, and this module brings them, per shard, under the same `jax.shard_map` the block-sparse kernels run in:

  all_gather  gather K and V once (kv heads, not query heads) and attend the local queries to the whole sequence;
              the backward reduce-scatters dK / dV. Holds the whole sequence's K and V on every device.
  ring        C steps: attend the local queries to the K/V shard in hand, merge the partial results by their
              log-sum-exp, pass the shard on with `ppermute`. Its backward (a custom VJP) is a second ring pass
              whose dK / dV sums go home from where each shard's way ends. Holds one shard at a time.

The mask is evaluated at the tokens' positions (`pallas_kernels.at_positions`), so the kernels skip the tiles it
empties on remote shards as on the local one. Shape suffixes follow the legend in docs/architecture.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from pallas_kernels.mask_spec import bind_segments
from pallas_kernels.masks import And, Or

VARIANTS = ("all_gather", "ring")


def bind(template: pk.Mask, q_segment_ids, kv_segment_ids, q_positions, kv_positions) -> pk.Mask:
    """The mask of local queries against one stretch of keys: document slots read the two sides' segment ids,
    every static term the two sides' positions."""
    return pk.at_positions(bind_segments(template, q_segment_ids, kv_segment_ids), q_positions, kv_positions)


def context_attention(
    attend, q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, positions_BT, *, template, axis, variant, order=None
):
    """Per shard (inside a shard_map whose `axis` splits T): the local queries' attention over every shard's keys.

    ``attend(q_BTHE, k_BSKE, v_BSKE, mask) -> (out_BTHE, lse_BHT)`` runs one block-sparse product; ``template`` is
    the config's mask with document slots; ``positions_BT`` are the local tokens' positions in their sequence, or
    None with ``order`` (numpy [T], the same for every row, known when tracing): shard c holds positions
    order[c * T / C: (c + 1) * T / C]. Known positions let the ring skip what the mask empties: a shard no later
    device's queries can see is not passed on, and a step whose shard the local queries cannot see computes
    nothing (`ring_sees`, `_Ring`)."""
    C = jax.lax.axis_size(axis)
    me = jax.lax.axis_index(axis)
    plan = table_CT = None
    if order is not None:
        shards_CT = np.asarray(order, np.int32).reshape(C, -1)
        table_CT = jnp.asarray(shards_CT)
        positions_BT = jnp.broadcast_to(table_CT[me], q_BTHE.shape[:2])
        plan = ring_sees(template, shards_CT)
    if variant == "all_gather":
        gather = lambda x: None if x is None else jax.lax.all_gather(x, axis, axis=1, tiled=True)  # noqa: E731
        k_BSKE, v_BSKE, kv_segments, kv_positions = (gather(x) for x in (k_BTKE, v_BTKE, segment_ids_BT, positions_BT))
        mask = bind(template, segment_ids_BT, kv_segments, positions_BT, kv_positions)
        return attend(q_BTHE, k_BSKE, v_BSKE, mask)[0]
    if variant != "ring":
        raise ValueError(f"model.context_parallel {variant!r} is unknown; choose one of {', '.join(VARIANTS)}")
    sees = np.ones((C, C), bool) if plan is None else plan  # traced positions: every shard may be seen everywhere
    ring = _Ring(attend, template, axis, C, sees, table_CT is not None)
    kv_positions = None if table_CT is not None else positions_BT  # known positions are looked up, not sent
    return _ring(ring, q_BTHE, k_BTKE, v_BTKE, segment_ids_BT, positions_BT, kv_positions, table_CT)


class _Ring:
    """What one ring attention is specialised on (a custom_vjp's static argument; hashed by identity).

    A shard moves one device on per step: at step s device i holds shard (i - s) % C. `sees[c, j]`: may device c's
    queries see shard j (conservative, `ring_sees`); `last[j]`: the last step a device other than its owner may see
    shard j (0: none). A shard is passed on only until that step, and its gradient sums go home from there."""

    def __init__(self, attend, template, axis, C, sees, known):
        self.attend, self.template, self.axis, self.C = attend, template, axis, C
        self.sees, self.known = sees, known
        self.last = [max([t for t in range(1, C) if sees[(j + t) % C, j]], default=0) for j in range(C)]

    def visible(self, step):
        """Per device, whether its queries may see the shard it holds at `step`."""
        return self.sees[np.arange(self.C), (np.arange(self.C) - step) % self.C]

    def partial(self, step, q, k, v, q_seg, q_pos, kv_seg, kv_pos, table_CT):
        """The local queries over the shard held at `step`: (out f32 [B, T, H, E], lse [B, T, H]), -inf where
        nothing is seen; a device whose queries cannot see its shard computes nothing."""
        me = jax.lax.axis_index(self.axis)
        if self.known:
            kv_pos = jnp.broadcast_to(table_CT[(me - step) % self.C], q.shape[:2])

        def compute(q, k, v, kv_seg, kv_pos):
            mask = bind(self.template, q_seg, kv_seg, q_pos, kv_pos)
            out_BTHE, lse_BHT = self.attend(q, k, v, mask)
            lse_BTH = lse_BHT.transpose(0, 2, 1)
            seen = jnp.isfinite(lse_BTH)  # the kernels write +inf on rows that see nothing
            return jnp.where(seen[..., None], out_BTHE.astype(jnp.float32), 0.0), jnp.where(seen, lse_BTH, -jnp.inf)

        def nothing(q, *_):
            return jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:3], -jnp.inf, jnp.float32)

        visible = self.visible(step)
        if visible.all():
            return compute(q, k, v, kv_seg, kv_pos)
        return jax.lax.cond(jnp.asarray(visible)[me], compute, nothing, q, k, v, kv_seg, kv_pos)

    def send(self, step, arrays):
        """Pass each held shard on while a device further along may see it (devices that receive nothing get
        zeros: they need nothing)."""
        pairs = [(i, (i + 1) % self.C) for i in range(self.C) if self.last[(i - step) % self.C] > step]
        if not pairs:
            return arrays
        return tuple(None if x is None else jax.lax.ppermute(x, self.axis, pairs) for x in arrays)


def _ring_forward(ring, q, k, v, q_seg, q_pos, kv_pos, table_CT):
    shard = (k, v, q_seg, kv_pos)
    out_BTHE = lse_BTH = None
    for step in range(ring.C):
        if step:  # the shard in hand is used only once the step before is merged (`_in_turn`)
            shard, (out_BTHE, lse_BTH) = _in_turn(shard, (out_BTHE, lse_BTH))
        part = ring.partial(step, q, *shard[:2], q_seg, q_pos, shard[2], shard[3], table_CT)
        out_BTHE, lse_BTH = merge(out_BTHE, lse_BTH, *part)
        shard = ring.send(step, shard)
    return out_BTHE.astype(q.dtype), lse_BTH


def _in_turn(shard, done):
    """(shard, done), tied: the shard a step computes on and passes on becomes available with what the step before
    produced. The passes form a chain of ppermutes that depend on no computation, so XLA would otherwise issue them
    all up front and hold every step's shard at once (Llama 3 8B, 1M tokens on 64 H100s: 30.7 GiB per GPU, more
    than the all-gather variant's 22.7); tied, a pass still overlaps the step's computation, about two shards are
    in hand, and the same step needs 18.9 GiB."""
    return jax.lax.optimization_barrier((shard, done))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring, q, k, v, q_seg, q_pos, kv_pos, table_CT):
    return _ring_forward(ring, q, k, v, q_seg, q_pos, kv_pos, table_CT)[0]


def _ring_fwd(ring, q, k, v, q_seg, q_pos, kv_pos, table_CT):
    out, lse = _ring_forward(ring, q, k, v, q_seg, q_pos, kv_pos, table_CT)
    return out, (q, k, v, q_seg, q_pos, kv_pos, table_CT, out, lse)


def _ring_bwd(ring, residuals, d_out):
    """A second pass of the ring: each step recomputes the partial product of the shard in hand and pulls the
    step's share of d_out through it (its weight exp(lse_j - lse) and the merge's lse term), dQ summed here, dK / dV
    summed along the shard's way and sent home from where its way ends. Holds one shard at a time, as the forward."""
    q, k, v, q_seg, q_pos, kv_pos, table_CT, out, lse = residuals
    out32, d_out32 = out.astype(jnp.float32), d_out.astype(jnp.float32)
    last = ring.last
    dq = jnp.zeros(q.shape, jnp.float32)
    dk_home, dv_home = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    shard = (k, v, q_seg, kv_pos, jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    for step in range(ring.C):
        if step:
            shard, (dq, dk_home, dv_home) = _in_turn(shard, (dq, dk_home, dv_home))
        k_s, v_s, kv_seg, kv_p, dk_acc, dv_acc = shard
        (out_j, lse_j), pull = jax.vjp(
            lambda q, k, v: ring.partial(step, q, k, v, q_seg, q_pos, kv_seg, kv_p, table_CT), q, k_s, v_s
        )
        w = jnp.where(jnp.isfinite(lse_j), jnp.exp(lse_j - jnp.where(jnp.isfinite(lse), lse, 0.0)), 0.0)
        d_lse = w * jnp.sum((out_j - out32) * d_out32, axis=-1)
        dq_j, dk_j, dv_j = pull((w[..., None] * d_out32, d_lse))
        dq = dq + dq_j
        if step == 0:  # the own shard's gradients stay
            dk_home, dv_home = dk_home + dk_j, dv_home + dv_j
            dk_acc, dv_acc = jnp.zeros_like(dk_home), jnp.zeros_like(dv_home)
        else:
            dk_acc, dv_acc = dk_acc + dk_j, dv_acc + dv_j
        home = [((j + step) % ring.C, j) for j in range(ring.C) if step >= 1 and last[j] == step]
        if home:  # shards whose way ends here: their gradients go back to their owners
            dk_back, dv_back = (jax.lax.ppermute(x, ring.axis, home) for x in (dk_acc, dv_acc))
            dk_home, dv_home = dk_home + dk_back, dv_home + dv_back
        shard = ring.send(step, (k_s, v_s, kv_seg, kv_p, dk_acc, dv_acc))
    zero = lambda x: None if x is None else np.zeros(x.shape, jax.dtypes.float0)  # noqa: E731  # integer inputs
    return (
        dq.astype(q.dtype),
        dk_home.astype(k.dtype),
        dv_home.astype(v.dtype),
        zero(q_seg),
        zero(q_pos),
        zero(kv_pos),
        zero(table_CT),
    )


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_sees(template: pk.Mask, shards_CT: np.ndarray) -> np.ndarray:
    """sees [C, C]: may device c's queries (positions shards_CT[c]) see shard j's keys? Conservative (`may_see`:
    documents count as seeing), so nothing needed is ever skipped."""
    C = len(shards_CT)
    runs = [_runs(shard) for shard in shards_CT]
    return np.array(
        [[any(may_see(template, q, k) for q in runs[c] for k in runs[j]) for j in range(C)] for c in range(C)]
    )


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
