"""pallas_kernels.masks and pallas_kernels.block_mask: mask constructors, & / |, score mods, block classification."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import (
    EMPTY,
    FULL,
    PARTIAL,
    BlockSizes,
    alibi,
    alibi_slopes,
    at_positions,
    causal,
    chain,
    chunked_causal,
    document,
    full,
    global_tokens,
    make_block_mask,
    prefix_lm,
    sliding_window,
    soft_cap,
)

T, S = 24, 32
Q, K = np.arange(T)[:, None], np.arange(S)[None, :]

REFERENCES = [
    (full(), np.ones((T, S), bool)),
    (causal(), Q >= K),
    (sliding_window(1), Q == K),
    (sliding_window(5), (Q >= K) & (Q - K < 5)),
    (chunked_causal(4), (Q >= K) & (Q // 4 == K // 4)),
    (chunked_causal(7), (Q >= K) & (Q // 7 == K // 7)),
    (prefix_lm(0), Q >= K),
    (prefix_lm(6), (K < 6) | (Q >= K)),
    (global_tokens(0), np.zeros((T, S), bool)),
    (global_tokens(3), (K < 3) | (Q < 3)),
]


# ----------------------------------------------------------------------------- masks


@pytest.mark.parametrize("mask,expected", REFERENCES, ids=[repr(m) for m, _ in REFERENCES])
def test_constructor_matches_reference_formula(mask, expected):
    np.testing.assert_array_equal(mask(Q, K), expected)
    # the same object works on jax arrays, also under jit
    got = jax.jit(lambda q, k: mask(q, k))(jnp.asarray(Q), jnp.asarray(K))
    np.testing.assert_array_equal(np.asarray(got), expected)


def test_and_or_match_logical_ops():
    a, b, c = sliding_window(4), prefix_lm(5), global_tokens(2)
    np.testing.assert_array_equal((a & b)(Q, K), a(Q, K) & b(Q, K))
    np.testing.assert_array_equal((a | b)(Q, K), a(Q, K) | b(Q, K))
    np.testing.assert_array_equal((causal() & (a | c))(Q, K), causal()(Q, K) & (a(Q, K) | c(Q, K)))
    np.testing.assert_array_equal((a & b | c)(Q, K), (a(Q, K) & b(Q, K)) | c(Q, K))


def test_repr_equality_and_hash():
    m = causal() & (sliding_window(128) | global_tokens(4))
    assert repr(m) == "causal() & (sliding_window(128) | global_tokens(4))"
    assert repr(prefix_lm(3) & chunked_causal(8) | full()) == "prefix_lm(3) & chunked_causal(8) | full()"
    same = causal() & (sliding_window(128) | global_tokens(4))
    assert m == same and hash(m) == hash(same) and m.is_static
    assert m != causal() & (sliding_window(64) | global_tokens(4))
    assert (causal() & sliding_window(2)) & chunked_causal(4) == causal() & (sliding_window(2) & chunked_causal(4))


@pytest.mark.parametrize(
    "bad",
    [
        lambda: sliding_window(0),
        lambda: chunked_causal(0),
        lambda: prefix_lm(-1),
        lambda: global_tokens(1.5),
        lambda: soft_cap(0.0),
        lambda: BlockSizes(0, 8),
        lambda: BlockSizes(8, True),
    ],
)
def test_bad_arguments_raise(bad):
    with pytest.raises(ValueError):
        bad()


def test_document_mask_batched_and_separate_kv_ids():
    rng = np.random.default_rng(0)
    seg = np.sort(rng.integers(0, 4, size=(2, T)), axis=-1)
    m = document(seg)
    assert not m.is_static and not (causal() & m).is_static
    np.testing.assert_array_equal(m(Q, np.arange(T)[None, :]), seg[:, :, None] == seg[:, None, :])
    kv_seg = np.sort(rng.integers(0, 4, size=(2, S)), axis=-1)
    got = (causal() & document(seg, kv_seg))(Q, K)
    assert got.shape == (2, T, S)
    np.testing.assert_array_equal(got, (seg[:, :, None] == kv_seg[:, None, :]) & (Q >= K))
    # jax segment ids, traced under jit
    f = jax.jit(lambda s: (causal() & document(s))(jnp.arange(T)[:, None], jnp.arange(T)[None, :]))
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(seg))), (seg[:, :, None] == seg[:, None, :]) & (Q >= Q.T))
    # value semantics: a copy is taken, equality/hash by content
    seg2 = seg.copy()
    d = document(seg2)
    seg2[:] = 99
    assert d == document(seg) and hash(d) == hash(document(seg)) and d != document(seg + 1)
    with pytest.raises(ValueError, match="batch dims"):
        document(seg, kv_seg[:1])


# ----------------------------------------------------------------------------- score mods


def test_soft_cap_values():
    s = np.array([-100.0, -1.0, 0.0, 0.5, 30.0])
    np.testing.assert_allclose(soft_cap(30.0)(s, 0, 0), 30.0 * np.tanh(s / 30.0))
    got = soft_cap(30.0)(jnp.asarray(s, jnp.float32), 0, 0)
    np.testing.assert_allclose(np.asarray(got), 30.0 * np.tanh(s / 30.0), rtol=1e-6)
    assert np.all(np.abs(soft_cap(5.0)(np.array([1e6, -1e6]), 0, 0)) <= 5.0)


def test_alibi_values_per_head():
    slopes = alibi_slopes(4)
    np.testing.assert_allclose(slopes, [2**-2, 2**-4, 2**-6, 2**-8])
    assert len(alibi_slopes(6)) == 6 and alibi_slopes(6)[:4] == alibi_slopes(4)
    mod = alibi(slopes)
    H = len(slopes)
    score = np.zeros((H, T, T), np.float32)
    head = np.arange(H)[:, None, None]
    want = -np.asarray(slopes, np.float32)[:, None, None] * (Q - Q.T)
    np.testing.assert_allclose(mod(score, Q, Q.T, head), want)
    # inside a kernel: one head at a time, as a traced scalar
    one = jax.jit(lambda s, h: mod(s, jnp.arange(T)[:, None], jnp.arange(T)[None, :], h))
    np.testing.assert_allclose(np.asarray(one(jnp.zeros((T, T)), 2)), want[2], rtol=1e-6)
    # composed with soft-capping, applied in order
    both = chain(mod, soft_cap(1.0))
    np.testing.assert_allclose(both(score, Q, Q.T, head), np.tanh(want), rtol=1e-6)


# ----------------------------------------------------------------------------- block masks


def check_block_mask(bm, dense):
    """The block mask's kinds and index lists agree with the dense element mask [..., T, S] (padded with False)."""
    bq, bkv = bm.block_sizes.block_q, bm.block_sizes.block_kv
    nq, nkv = -(-bm.q_len // bq), -(-bm.kv_len // bkv)
    np.testing.assert_array_equal(bm.dense(), dense)
    assert (bm.num_q_blocks, bm.num_kv_blocks, bm.padded_q_len, bm.padded_kv_len) == (nq, nkv, nq * bq, nkv * bkv)
    pad = [(0, 0)] * (dense.ndim - 2) + [(0, nq * bq - bm.q_len), (0, nkv * bkv - bm.kv_len)]
    tiles = np.pad(dense, pad).reshape(*dense.shape[:-2], nq, bq, nkv, bkv)
    any_, all_ = tiles.any(axis=(-3, -1)), tiles.all(axis=(-3, -1))
    want_kind = np.where(all_, FULL, np.where(any_, PARTIAL, EMPTY))
    assert bm.kind.dtype == np.int8 and bm.kind.shape == want_kind.shape
    np.testing.assert_array_equal(bm.kind, want_kind)
    assert bm.density == pytest.approx(any_.mean())
    kind = np.asarray(bm.kind)

    def check_lists(idx, npart, cnt, kinds_rows):
        for b in np.ndindex(*bm.batch_shape):
            for r, kinds in enumerate(kinds_rows[b]):
                n, p = int(cnt[b + (r,)]), int(npart[b + (r,)])
                row = list(np.asarray(idx[b + (r,)]))
                # PARTIAL blocks first, then FULL ones, each increasing; padded with the last real entry (or 0)
                assert row[:p] == list(np.flatnonzero(kinds == PARTIAL))
                assert row[p:n] == list(np.flatnonzero(kinds == FULL))
                assert all(x == (row[n - 1] if n else 0) for x in row[n:])

    check_lists(bm.kv_block_indices, bm.kv_partial_counts, bm.kv_block_counts, kind)
    check_lists(bm.q_block_indices, bm.q_partial_counts, bm.q_block_counts, np.swapaxes(kind, -1, -2))
    for a in (
        bm.kv_block_indices,
        bm.kv_partial_counts,
        bm.kv_block_counts,
        bm.q_block_indices,
        bm.q_partial_counts,
        bm.q_block_counts,
    ):
        assert a.dtype == np.int32
        if not bm.is_traced:
            assert not a.flags.writeable


leaves = st.one_of(
    st.just(causal()),
    st.just(full()),
    st.integers(1, 12).map(sliding_window),
    st.integers(1, 12).map(chunked_causal),
    st.integers(0, 12).map(prefix_lm),
    st.integers(0, 4).map(global_tokens),
)
masks = st.recursive(
    leaves,
    lambda kids: st.one_of(
        st.tuples(kids, kids).map(lambda ab: ab[0] & ab[1]), st.tuples(kids, kids).map(lambda ab: ab[0] | ab[1])
    ),
    max_leaves=4,
)


def dense_of(mask, q_len, kv_len):
    return np.asarray(mask(np.arange(q_len)[:, None], np.arange(kv_len)[None, :]))


def assert_block_mask_or_empty_row_error(mask, q_len, kv_len, bs):
    dense = dense_of(mask, q_len, kv_len)
    empty_rows = ~dense.any(axis=-1)  # [..., T]
    if empty_rows.any():
        first = int(np.flatnonzero(empty_rows.any(axis=tuple(range(empty_rows.ndim - 1))))[0])
        with pytest.raises(ValueError, match=rf"query {first}\b.*attends to no key"):
            make_block_mask(mask, q_len, kv_len, bs)
    else:
        check_block_mask(make_block_mask(mask, q_len, kv_len, bs), dense)


@settings(max_examples=150, deadline=None)
@given(
    mask=masks,
    bq=st.sampled_from([1, 2, 4, 8]),
    bkv=st.sampled_from([1, 2, 4, 8]),
    q_len=st.integers(1, 40),
    kv_len=st.integers(1, 40),
)
def test_block_mask_agrees_with_dense_mask(mask, bq, bkv, q_len, kv_len):
    """Any lengths: the grid is padded up to whole blocks and the padding counts as masked."""
    assert_block_mask_or_empty_row_error(mask, q_len, kv_len, BlockSizes(bq, bkv))


@settings(max_examples=60, deadline=None)
@given(
    mask=masks, data=st.data(), bq=st.sampled_from([1, 2, 4, 8]), bkv=st.sampled_from([1, 2, 4, 8]), n=st.integers(1, 5)
)
def test_block_mask_document_batch_of_two(mask, data, bq, bkv, n):
    length = n * bq * bkv
    # sorted random segment ids: packed documents of random lengths, different in each batch row
    seg = np.sort(
        np.array(data.draw(st.lists(st.integers(0, 3), min_size=2 * length, max_size=2 * length)), np.int32).reshape(
            2, length
        ),
        axis=-1,
    )
    m = mask & document(seg)
    assert_block_mask_or_empty_row_error(m, length, length, BlockSizes(bq, bkv))
    if not dense_of(m, length, length).any(-1).all():
        return
    bm = make_block_mask(m, length, length, BlockSizes(bq, bkv))
    assert bm.batch_shape == (2,)


def test_document_causal_block_mask_example():
    seg = np.array([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 2, 2]])
    bm = make_block_mask(causal() & document(seg), 8, 8, BlockSizes(2, 2))
    np.testing.assert_array_equal(bm.kind[1], [[1, 0, 0, 0], [2, 1, 0, 0], [2, 2, 1, 0], [0, 0, 0, 1]])
    # partial blocks first (the diagonal), then full ones
    np.testing.assert_array_equal(bm.kv_block_indices[1], [[0, 0, 0], [1, 0, 0], [2, 0, 1], [3, 3, 3]])
    np.testing.assert_array_equal(bm.kv_partial_counts[1], [1, 1, 1, 1])
    np.testing.assert_array_equal(bm.kv_block_counts, [[1, 2, 2, 3], [1, 2, 3, 1]])
    # not cached by identity: a new call computes afresh (the arrays may have changed)
    assert make_block_mask(causal() & document(seg), 8, 8, BlockSizes(2, 2)) is not bm


@settings(max_examples=12, deadline=None)  # each example compiles the traced block mask anew
@given(
    mask=masks, data=st.data(), bq=st.sampled_from([1, 2, 4]), bkv=st.sampled_from([1, 2, 4]), length=st.integers(1, 24)
)
def test_traced_block_mask_equals_host_block_mask(mask, data, bq, bkv, length):
    """Segment ids traced under jit (they come from the batch): the device-built lists hold the same blocks."""
    seg = np.sort(
        np.array(data.draw(st.lists(st.integers(0, 3), min_size=2 * length, max_size=2 * length)), np.int32).reshape(
            2, length
        ),
        axis=-1,
    )
    m = (mask | causal()) & document(seg)  # every query sees itself: no empty rows
    host = make_block_mask(m, length, length, BlockSizes(bq, bkv))
    fields = (
        "kind",
        "kv_block_indices",
        "kv_partial_counts",
        "kv_block_counts",
        "q_block_indices",
        "q_partial_counts",
        "q_block_counts",
    )

    @jax.jit
    def traced(ids):
        bm = make_block_mask((mask | causal()) & document(ids), length, length, BlockSizes(bq, bkv))
        assert bm.is_traced
        return {f: getattr(bm, f) for f in fields}

    dev = jax.tree.map(np.asarray, traced(jnp.asarray(seg)))
    for f in ("kind", "kv_partial_counts", "kv_block_counts", "q_partial_counts", "q_block_counts"):
        np.testing.assert_array_equal(dev[f], getattr(host, f), err_msg=f)
    for f, cnt in (("kv_block_indices", host.kv_block_counts), ("q_block_indices", host.q_block_counts)):
        for b in range(2):
            for r, n in enumerate(cnt[b]):
                np.testing.assert_array_equal(dev[f][b, r, :n], getattr(host, f)[b, r, :n], err_msg=f)


def test_causal_block_mask_and_density():
    bm = make_block_mask(causal(), 16, 16, BlockSizes(4, 4))
    # full below the diagonal, partial on it, empty above
    np.testing.assert_array_equal(bm.kind, 2 * np.tril(np.ones((4, 4)), -1) + np.eye(4))
    assert bm.density == pytest.approx(10 / 16)
    # keys no query sees (q_len < kv_len): zero-count kv-block columns padded with 0
    bm = make_block_mask(causal(), 4, 16, BlockSizes(4, 4))
    np.testing.assert_array_equal(bm.q_block_counts, [1, 0, 0, 0])
    np.testing.assert_array_equal(bm.q_block_indices, [[0], [0], [0], [0]])


def test_static_block_mask_is_cached():
    a = make_block_mask(causal() & sliding_window(8), 64, 64, BlockSizes(16, 16))
    b = make_block_mask(causal() & sliding_window(8), 64, 64, BlockSizes(16, 16))
    assert a is b
    assert make_block_mask(causal() & sliding_window(8), 64, 64, BlockSizes(16, 8)) is not a
    with pytest.raises(ValueError):
        a.kind[0, 0] = 0  # shared between layers: read-only


def test_empty_row_error_names_first_query():
    with pytest.raises(ValueError, match=r"query 5 attends to no key under mask sliding_window\(2\)"):
        make_block_mask(sliding_window(2), 8, 4, BlockSizes(2, 2))
    seg = np.array([[0, 0, 0, 0], [0, 0, 1, 1]])
    with pytest.raises(ValueError, match=r"query 2 \(batch 1\) attends to no key"):
        make_block_mask(document(seg, np.array([[0, 0, 0, 0], [0, 0, 0, 0]])), 4, 4, BlockSizes(2, 2))
    with pytest.raises(ValueError, match="query 0 attends to no key"):
        make_block_mask(global_tokens(0), 4, 4, BlockSizes(2, 2))


def test_lengths_need_not_divide_block_sizes():
    bm = make_block_mask(causal(), 10, 16, BlockSizes(4, 4))
    assert (bm.num_q_blocks, bm.padded_q_len) == (3, 12)
    # the last q block holds 2 real rows and 2 padding rows: never FULL
    np.testing.assert_array_equal(bm.kind[2], [PARTIAL, PARTIAL, PARTIAL, EMPTY])
    with pytest.raises(ValueError, match="q_len must be a positive integer"):
        make_block_mask(causal(), 0, 16, BlockSizes(4, 4))


@settings(max_examples=15, deadline=None)
@given(mask=masks, seed=st.integers(0, 2**16), bq=st.sampled_from([2, 4]), bkv=st.sampled_from([2, 4]))
def test_a_mask_at_positions_is_the_mask_of_the_reordered_sequence(mask, seed, bq, bkv):
    """Context parallelism holds slices of a reordered sequence: at_positions evaluates static terms at the
    tokens' positions and document terms on their (reordered) segment ids, host-built and traced alike."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(T).astype(np.int32)
    seg = np.sort(rng.integers(0, 3, T)).astype(np.int32)
    full_mask = (mask | causal()) & document(seg)
    want = dense_of(full_mask, T, T)[np.ix_(order, order)]
    local = at_positions((mask | causal()) & document(seg[order]), order)
    host = make_block_mask(local, T, T, BlockSizes(bq, bkv))
    np.testing.assert_array_equal(host.dense(), want)

    @jax.jit
    def traced(positions, ids):
        bm = make_block_mask(at_positions((mask | causal()) & document(ids), positions), T, T, BlockSizes(bq, bkv))
        return bm.kind

    np.testing.assert_array_equal(np.asarray(traced(jnp.asarray(order), jnp.asarray(seg[order]))), host.kind)
    # one query slice against one key slice: q positions of one part, kv of another
    part = at_positions(mask | causal(), order[:8], order[8:])
    want_part = dense_of(mask | causal(), T, T)[np.ix_(order[:8], order[8:])]
    np.testing.assert_array_equal(dense_of(part, 8, T - 8), want_part)
