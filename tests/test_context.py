"""Context parallelism (sharding.context): every row's sequence split over the `context` axis, ring and all-gather
attention through both block-sparse implementations, equal to one device in loss and gradients for every mask
kind; the kernels see only the local shard; the collectives are the ones each variant names."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import one_device_mesh, random_batch, tiny_config

import pallas_kernels as pk
from experiments.context_balance import packed_rows
from jaxlm.config import ConfigError, validate
from jaxlm.train import Program
from pallas_kernels.mask_spec import parse_mask
from sharding import MeshLayout, build_mesh
from sharding.context import merge
from sharding.context_order import balance, balanced_order, chunks_per_device, pick_order, sequence_order

MASKS = {
    "causal": "causal",
    "window": "causal & sliding_window(5)",
    "window2": "causal & sliding_window(2)",
    "document": "causal & document",
    "prefix": "prefix_lm(6) | causal",
    "full": "full",
}


def _cfg(mask, impl="xla_blocksparse", variant="ring", order="auto"):
    model = dict(
        context_order=order,
        num_layers=2,
        attention_mask=MASKS[mask],
        attention_impl=impl,
        attention_block_q=4,
        attention_block_kv=4,
        context_parallel=variant,
    )
    return tiny_config(model=model, data=dict(batch_size=8))


def _batch():
    batch = random_batch(0, batch=8)
    batch["segment_ids"] = (np.arange(16)[None, :] >= np.arange(8)[:, None] % 7 + 4).astype(np.int32)
    return batch


def _loss_and_grads(cfg, layout):
    program = Program(cfg, one_device_mesh() if layout is None else build_mesh(layout.validate(8)), layout)
    state = program.init()
    batch = {k: v for k, v in _batch().items() if k != "segment_ids" or "document" in cfg.model.attention_mask}
    (loss_sum, _), grads = program.loss_and_grads(state.params, program.device_batch(batch))
    return float(loss_sum), jax.tree.leaves(jax.device_get(nnx.to_pure_dict(grads)))


_REFERENCE = {}


def _reference(mask):
    if mask not in _REFERENCE:  # attention implementation and variant do not change the one-device figures
        _REFERENCE[mask] = _loss_and_grads(_cfg(mask, impl="reference"), None)
    return _REFERENCE[mask]


@pytest.mark.parametrize(
    "mask, impl, variant, layout, order",
    [
        ("causal", "pallas", "all_gather", MeshLayout(data=2, context=4), "auto"),
        ("window", "xla_blocksparse", "ring", MeshLayout(context=2, fsdp=2, tensor=2), "auto"),
        ("window", "xla_blocksparse", "all_gather", MeshLayout(context=8), "zigzag"),
        ("document", "xla_blocksparse", "ring", MeshLayout(data=2, context=4), "auto"),
        ("document", "pallas", "all_gather", MeshLayout(context=2, fsdp=2, tensor=2), "contiguous"),
        ("prefix", "pallas", "ring", MeshLayout(data=4, context=2), "auto"),
        ("full", "pallas", "all_gather", MeshLayout(data=4, context=2), "zigzag"),
        # inside pipeline stages (each row dealt by its documents' cost, the positions travelling with the
        # microbatches; the ring's passes make the table run in lockstep: sharding.pipeline.runs_in_lockstep)
        ("document", "xla_blocksparse", "ring", MeshLayout(pipeline=2, context=2, data=2), "documents"),
    ],
)
def test_context_parallel_training_equals_one_device(mask, impl, variant, layout, order):
    """Zigzag deals each device two chunks of the row (positions, targets, loss mask and segment ids move with
    the tokens); contiguous one; documents (auto's pick for a document mask) chunks dealt per row by their cost."""
    loss, grads = _loss_and_grads(_cfg(mask, impl, variant, order), layout)
    want_loss, want_grads = _reference(mask)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for g, w in zip(grads, want_grads, strict=True):
        assert np.linalg.norm(g - w) / np.linalg.norm(w) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(
    "mask, impl, variant, layout",
    [
        ("causal", "xla_blocksparse", "ring", MeshLayout(context=8)),
        ("prefix", "pallas", "ring", MeshLayout(context=8)),
        ("causal", "xla_blocksparse", "ring", MeshLayout(data=2, context=4)),
        ("prefix", "xla_blocksparse", "all_gather", MeshLayout(fsdp=2, context=4)),
        ("full", "xla_blocksparse", "ring", MeshLayout(context=2, fsdp=2, tensor=2)),
    ],
)
def test_more_layouts_equal_one_device(mask, impl, variant, layout):
    """Eight shards of two tokens each through the ring (15-18 s each), and three more combinations (3-7 s each);
    fast cover: the cases above (every mask, both variants and kernels, context 2, 4 and 8), and the eight-device
    ring's compiled program below."""
    loss, grads = _loss_and_grads(_cfg(mask, impl, variant, "contiguous"), layout)
    want_loss, want_grads = _reference(mask)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for g, w in zip(grads, want_grads, strict=True):
        assert np.linalg.norm(g - w) / np.linalg.norm(w) <= 1e-5


@pytest.mark.parametrize("variant, collective", [("all_gather", "all-gather")])
def test_each_shard_attends_its_own_queries_and_receives_the_others_keys(variant, collective, monkeypatch):
    """The kernels run on one device's slice ([B / data, H, T / context, E]); the all-gather variant gathers the
    others' K and V (the ring's permutes: test_the_ring_does_not_send_a_shard_no_query_further_on_can_see)."""
    seen, kernel = set(), pk.block_sparse_attention_xla

    def recording(q, *args, **kwargs):
        seen.add(tuple(q.shape))
        return kernel(q, *args, **kwargs)

    monkeypatch.setattr(pk, "block_sparse_attention_xla", recording)
    cfg, layout = _cfg("causal", variant=variant), MeshLayout(data=2, context=4)
    program = Program(cfg, build_mesh(layout.validate(8)), layout)
    batch = {k: v for k, v in _batch().items() if k != "segment_ids"}
    state = program.init()
    text = jax.jit(program.loss_and_grads).lower(state.params, program.device_batch(batch)).compile().as_text()
    E = cfg.model.d_model // cfg.model.num_heads
    assert seen == {(4, cfg.model.num_heads, 4, E)}, seen  # 8 rows / data 2, 16 tokens / context 4
    assert collective in text


def test_merging_partial_softmaxes_equals_the_whole_and_ignores_unseen_parts():
    rng = np.random.default_rng(0)
    s = rng.normal(size=(2, 3, 4, 10)).astype(np.float32)  # [B, T, H, S] scores
    v = rng.normal(size=(2, 10, 4, 5)).astype(np.float32)  # [B, S, H, E]

    def softmax_part(cols):
        part = s[..., cols]
        lse = np.log(np.exp(part).sum(-1))
        out = np.einsum("bths,bshe->bthe", np.exp(part - lse[..., None]), v[:, cols])
        return out, lse

    whole, _ = softmax_part(np.arange(10))
    out, lse = None, None
    for cols in (np.arange(0, 4), np.arange(4, 10)):
        o, l = softmax_part(cols)
        out, lse = merge(out, lse, o, l)
    np.testing.assert_allclose(out, whole, rtol=1e-5, atol=1e-6)
    # a part no query saw (the kernels write lse = +inf) changes nothing, and its gradient is finite
    unseen = np.full_like(lse, np.inf)
    got, _ = merge(out, lse, np.full_like(out, np.nan), unseen)
    np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-6)
    grad = jax.grad(lambda o: merge(out, lse, o, unseen)[0].sum())(np.ones_like(out))
    assert np.isfinite(grad).all()


def test_balanced_order_gives_each_device_the_same_causal_work():
    T, C = 64, 4
    order = balanced_order(T, C)
    assert sorted(order.tolist()) == list(range(T))
    work = [int(np.sum(order[c * T // C : (c + 1) * T // C] + 1)) for c in range(C)]  # keys each device's queries see
    assert max(work) == min(work)
    contiguous = [int(np.sum(np.arange(c * T // C, (c + 1) * T // C) + 1)) for c in range(C)]
    assert max(contiguous) / min(contiguous) > 5


def test_packed_documents_are_dealt_by_their_cost_not_their_tokens():
    """Zigzag evens out one causal row, not a row of packed documents (each short document's work sits where it
    does); dealing a few chunks per device by their cost keeps every device within a few percent. Every row is a
    permutation, each device gets T / C tokens in whole chunks, and one document spanning the row is as even as
    zigzag makes it."""
    mask, T, C = parse_mask("causal & document"), 2048, 8
    segments_BT = packed_rows(0, 16, T, median=150)
    order_BT = np.asarray(sequence_order(mask, T, C, "auto", segments_BT, block=32))
    assert order_BT.shape == (16, T) and (np.sort(order_BT, axis=1) == np.arange(T)).all()
    chunk = T // (C * chunks_per_device(T // C, 32))
    assert chunk == 32 and (order_BT.reshape(16, -1, chunk)[..., 0] % chunk == 0).all()  # whole chunks, in order
    zigzag = [float(balance(mask, T, balanced_order(T, C), C, row[None])) for row in segments_BT]
    dealt = [float(balance(mask, T, o[None], C, row[None])) for o, row in zip(order_BT, segments_BT)]
    assert max(dealt) <= 1.05 and np.mean(zigzag) > 1.3, (dealt, zigzag)
    one_document = np.zeros((1, T), np.int32)
    whole = sequence_order(mask, T, C, "documents", one_document, block=32)
    assert float(balance(mask, T, whole, C, one_document)) <= 1.001


def test_which_order_each_mask_gets():
    """auto: documents for a document mask it can count, contiguous for local masks, zigzag otherwise; documents
    on a mask it cannot count is refused in one line when the config loads."""
    masks = ("causal & document", "causal & sliding_window(8)", "causal & sliding_window(8) & document", "causal")
    picks = [pick_order(parse_mask(m), 4) for m in masks]
    assert picks == ["documents", "contiguous", "contiguous", "zigzag"]
    assert pick_order(parse_mask(masks[2]), 4, "documents") == "documents"  # asked for: balanced, the ring sends all
    assert pick_order(parse_mask("causal"), 4, "documents") == "zigzag"  # same cost every row: auto's choice
    assert pick_order(parse_mask("causal & document"), 1) == "contiguous"
    with pytest.raises(ConfigError, match="context_order=documents .* counts only"):
        validate(tiny_config(model=dict(attention_mask="prefix_lm(4) | document", context_order="documents")))


def test_generation_refuses_a_context_axis_in_one_line():
    """A checkpoint does not depend on its layout; generation keeps each row on one device."""
    from jaxlm.generate import check_layout

    with pytest.raises(ValueError, match=r"the layout has context=4 \(the checkpoint does not depend on it"):
        check_layout(MeshLayout(data=2, context=4))


def test_a_config_naming_an_unknown_variant_is_refused():
    from jaxlm.config import ConfigError, validate

    cfg = _cfg("causal")
    with pytest.raises(ConfigError, match=r"model.context_parallel must be one of ring, all_gather, got 'rings'"):
        validate(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, context_parallel="rings")))


def _compiled_text(cfg, layout):
    program = Program(cfg, build_mesh(layout.validate(8)), layout)
    batch = {k: v for k, v in _batch().items() if k != "segment_ids"}
    state = program.init()
    return jax.jit(program.loss_and_grads).lower(state.params, program.device_batch(batch)).compile().as_text()


def _permutes(text):
    return [line for line in text.splitlines() if "collective-permute" in line and "source_target_pairs" in line]


@pytest.mark.slow
def test_the_ring_does_not_send_a_shard_no_query_further_on_can_see():
    """A sliding window of 2 over shards of 2 tokens (contiguous): device c sees shards c and c - 1 only, so K and V
    travel one step and never wrap from the last device to the first; the full mask sends all the way around."""
    layout, C, layers = MeshLayout(context=8), 8, 2  # tiny model: 2 layers
    window = _permutes(_compiled_text(_cfg("window2", order="contiguous"), layout))
    assert window and all("{7,0}" not in line for line in window), window
    # per layer: K and V forward, K, V and their gradient sums backward, one step each, the sums' way home (9 ops
    # once XLA merges permutes of equal pairs); a ring over every step has C - 1 sends forward and backward at the
    # least (the full mask: 57)
    assert len(window) < 2 * layers * (C - 1), len(window)


def test_the_step_reports_how_evenly_the_context_axis_shares_the_work():
    """metrics' context_balance: max / mean score pairs kept per device; zigzag makes causal even, in order the
    last device does most; packed documents are counted from the batch's segment ids."""
    from jaxlm.train import _context_balance

    layout, batch = MeshLayout(context=4, data=2), _batch()
    even = _context_balance(_cfg("causal").model, layout, batch)["context_balance"]
    in_order = _context_balance(_cfg("causal", order="contiguous").model, layout, batch)["context_balance"]
    docs = _context_balance(_cfg("document").model, layout, batch)["context_balance"]
    assert float(even) == 1.0 and float(in_order) > 1.5 and 1.0 <= float(docs) <= float(in_order)
    assert _context_balance(_cfg("prefix").model, layout, batch) == {}  # a mask it cannot count: no figure
