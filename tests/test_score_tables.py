"""Score mods that capture arrays (pallas_kernels.score_tables): T5's buckets against transformers' own, the Pallas
kernels (Triton's code, in the interpreter) taking a bias table and learnable slopes as inputs with gradients to
them, against the float32 reference, and the cases that are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.score_tables import relative_bucket, split_arrays


@pytest.mark.parametrize("bidirectional", [False, True])
def test_relative_buckets_equal_t5s(bidirectional):
    torch = pytest.importorskip("torch")
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    relative = np.arange(-700, 700)
    for num_buckets, max_distance in ((32, 128), (16, 40)):
        want = t5.T5Attention._relative_position_bucket(
            torch.tensor(relative), bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
        ).numpy()
        got = np.asarray(relative_bucket(relative, num_buckets, bidirectional, max_distance))
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow  # 16 s in a full run; docs/testing.md names its cover
def test_pallas_kernels_take_a_bias_table_and_slopes_with_their_gradients():
    """T5's bias table [H, 32] and learnable ALiBi slopes [H] chained, causal, two query heads on one kv head, T = 40
    in one block of 64 (padded: its padding rows and keys must add nothing to the arrays' gradients): output, lse
    and the gradients to q, k, v, the table and the slopes equal the float32 reference's."""
    B, H, K, T, E = 1, 2, 1, 40, 16
    r = np.random.default_rng(0)
    q = jnp.asarray(r.normal(size=(B, H, T, E)), jnp.float32)
    k, v = (jnp.asarray(r.normal(size=(B, K, T, E)), jnp.float32) for _ in range(2))
    table = jnp.asarray(r.normal(size=(H, 8)), jnp.float32)  # 8 buckets: the interpreted lookup's cost grows with them
    slopes = jnp.asarray(pk.alibi_slopes(H), jnp.float32)
    d_out = jnp.asarray(r.normal(size=q.shape), jnp.float32)
    bm = pk.make_block_mask(pk.causal(), T, T, pk.BlockSizes(64, 64))

    def mod(table, slopes):
        return pk.chain(pk.relative_bias(table), pk.learned_alibi(slopes))

    def pallas(q, k, v, table, slopes):
        return pk.block_sparse_attention(q, k, v, bm, score_mod=mod(table, slopes))

    def reference(q, k, v, table, slopes):
        return pk.reference_attention(q, k, v, pk.causal(), score_mod=mod(table, slopes))

    args = (q, k, v, table, slopes)
    for got, want in zip(pallas(*args), reference(*args)):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a)[0] * d_out) + jnp.sum(fn(*a)[1])

    got = jax.grad(loss(pallas), argnums=range(5))(*args)
    want = jax.grad(loss(reference), argnums=range(5))(*args)
    for name, g, w in zip(("dq", "dk", "dv", "d table", "d slopes"), got, want):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(g, w, atol=5e-5 * float(jnp.abs(w).max()), err_msg=name)


def _inputs(H=2, T=128, E=64, dtype=jnp.bfloat16):
    q = jnp.zeros((1, H, T, E), dtype)
    return q, pk.make_block_mask(pk.causal(), T, T, pk.BlockSizes(128, 128))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: pk.relative_bias(jnp.zeros(32)), r"table must be \[heads, num_buckets >= 2\], got shape \[32\]"),
        (lambda: pk.relative_bias(jnp.zeros((2, 32), jnp.int32)), "must be floating"),
        (lambda: pk.relative_bias(jnp.zeros((2, 32)), max_distance=16), "max_distance must be an int above"),
        (lambda: pk.learned_alibi(jnp.zeros((2, 2))), r"slopes must be \[heads\]"),
        (lambda: split_arrays("f", pk.relative_bias(jnp.zeros((3, 32))), 2), r"one row per query head \(2\)"),
        (lambda: split_arrays("f", pk.relative_bias(jnp.zeros((2, 128))), 2), "at most 64 entries"),
    ],
)
def test_bad_tables_are_refused_in_one_line(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("bidirectional", [False, True])
def test_a_tile_shortcut_equals_the_mod_on_every_score_of_the_tile(bidirectional):
    """Random tiles of 48 queries by 80 keys (and 80 by 48) at offsets up to 600 apart, T5 tables of 32 and 16
    buckets: where ``tile_shortcut`` holds, its one-entry mod gives every score of the tile what the bias table
    gives (and chained with a soft-cap, the chain's does); it holds on the far tiles (both sides when
    bidirectional, keys at or after every query when not) and on no tile that comes within ``max_distance`` of its
    queries on the past side."""
    r = np.random.default_rng(3)
    holds_seen = 0
    for num_buckets, max_distance in ((32, 128), (16, 40)):
        table = jnp.asarray(r.normal(size=(3, num_buckets)), jnp.float32)
        mod = pk.relative_bias(table, bidirectional=bidirectional, max_distance=max_distance)
        for nq, nk in ((48, 80), (80, 48)):
            for m in (mod, pk.chain(mod, pk.soft_cap(4.0))):

                @jax.jit
                def both(q0, kv0, score, head, m=m, nq=nq, nk=nk):
                    q_idx, kv_idx = q0 + jnp.arange(nq)[:, None], kv0 + jnp.arange(nk)[None, :]
                    holds, cheaper = m.tile_shortcut(q0, q0 + nq - 1, kv0, kv0 + nk - 1)
                    return holds, cheaper(score, q_idx, kv_idx, head), m(score, q_idx, kv_idx, head)

                for _ in range(30):
                    q0, kv0 = (int(x) for x in r.integers(0, 600, 2))
                    score = jnp.asarray(r.normal(size=(nq, nk)), jnp.float32)
                    holds, got, want = both(q0, kv0, score, int(r.integers(3)))
                    if holds:
                        np.testing.assert_allclose(got, want)
                    far_past = q0 - (kv0 + nk - 1) >= max_distance
                    other_side = (kv0 - (q0 + nq - 1)) >= (max_distance if bidirectional else 0)
                    assert bool(holds) == (far_past or other_side)
                    holds_seen += bool(holds)
    assert holds_seen > 40
    assert pk.soft_cap(4.0).tile_shortcut(0, 63, 512, 575) is None


@pytest.mark.parametrize("mask", [pytest.param("full", marks=pytest.mark.slow), "causal"])  # full: 15 s
def test_kernels_take_the_shortcut_on_far_tiles_with_the_same_gradients(mask):
    """A T5 table (8 buckets, max distance 40) and learned slopes chained, T = 128 in blocks of 32 (the Triton
    kernels' code in the interpreter): tiles far in the past (and, with the full mask, after the queries) take one
    entry of the table per tile, the rest the lookup. Output and the gradients to q, k, v, the table and the slopes
    equal the float32 reference's."""
    B, H, T, E = 1, 2, 128, 16
    r = np.random.default_rng(1)
    q, k, v = (jnp.asarray(r.normal(size=(B, H, T, E)), jnp.float32) for _ in range(3))
    table = jnp.asarray(r.normal(size=(H, 8)), jnp.float32)  # 8 buckets: the interpreted lookup's cost grows with them
    slopes = jnp.asarray(pk.alibi_slopes(H), jnp.float32)
    d_out = jnp.asarray(r.normal(size=q.shape), jnp.float32)
    the_mask = pk.full() if mask == "full" else pk.causal()
    bm = pk.make_block_mask(the_mask, T, T, pk.BlockSizes(32, 32))

    def mod(table, slopes):
        return pk.chain(pk.relative_bias(table, max_distance=40), pk.learned_alibi(slopes))

    def loss(attention):
        return lambda q, k, v, table, slopes: jnp.sum(attention(q, k, v, mod(table, slopes))[0] * d_out)

    pallas = loss(lambda q, k, v, m: pk.block_sparse_attention(q, k, v, bm, score_mod=m))
    reference = loss(lambda q, k, v, m: pk.reference_attention(q, k, v, the_mask, score_mod=m))
    args = (q, k, v, table, slopes)
    got, want = jax.grad(pallas, argnums=range(5))(*args), jax.grad(reference, argnums=range(5))(*args)
    for name, g, w in zip(("dq", "dk", "dv", "d table", "d slopes"), got, want):
        np.testing.assert_allclose(g, w, atol=5e-5 * float(jnp.abs(w).max()), err_msg=name)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_per_row_gradients_to_the_rows_equal_the_vjps_row_by_row(bidirectional):
    """``add_row_grads_per_row`` (what the Mosaic GPU dQ kernel accumulates: per query row, each entry's share of
    dS summed over the tile's keys) on random 32 x 48 tiles near and far from the diagonal, with the tile shortcut:
    the accumulator [entries, rows] plus, per row, the vjp of that row's modded scores in the table and slopes, for
    the table chained with slopes, and then soft-capped."""
    from pallas_kernels.score_tables import HeadRow, add_row_grads_per_row

    r = np.random.default_rng(4)
    nq, nk, H = 32, 48, 2
    table = jnp.asarray(r.normal(size=(H, 16)), jnp.float32)
    slopes = jnp.asarray(r.uniform(0, 0.2, H), jnp.float32)
    table_mod = pk.relative_bias(table, bidirectional=bidirectional, max_distance=40)
    chained = pk.chain(table_mod, pk.learned_alibi(slopes))
    for mod in (chained, pk.chain(*chained.mods, pk.soft_cap(3.0))):

        @jax.jit
        def both(q0, kv0, s, ds, head, acc, mod=mod):
            q_idx, kv_idx = q0 + jnp.arange(nq)[:, None], kv0 + jnp.arange(nk)[None, :]
            rows = tuple(HeadRow(tuple(jnp.reshape(a[head], -1)), a.shape[1:]) for a in mod.arrays())
            tile = (q0, q0 + nq - 1, kv0, kv0 + nk - 1)
            add = lambda acc, i, vector: acc.at[i].add(vector)  # noqa: E731
            got = add_row_grads_per_row(mod, rows, s, q_idx, kv_idx, head, ds, acc, add, tile)

            def row_grad(one_row):
                _, vjp = jax.vjp(lambda arrays: mod.with_arrays(arrays)(s, q_idx, kv_idx, head), mod.arrays())
                return [jnp.reshape(g[head], -1) for g in vjp(ds * one_row[:, None])[0]]

            want = jax.vmap(row_grad)(jnp.eye(nq))  # per array [nq rows, entries]
            return got, jnp.concatenate(want, axis=1).T + acc

        n = sum(a[0].size for a in mod.arrays())
        for q0, kv0 in ((300, 0), (0, 300), (100, 90), (60, 100)):
            s, ds = (jnp.asarray(r.normal(size=(nq, nk)), jnp.float32) for _ in range(2))
            acc = jnp.asarray(r.normal(size=(n, nq)), jnp.float32)
            got, want = both(q0, kv0, s, ds, int(r.integers(H)), acc)
            # the slopes' entry (the last) sums ~50 terms of ds * (kv - q) ~ 1e2 each: float32 rounding ~1e-4
            tol = np.where(np.arange(n) == n - 1, 1e-3 if n > 16 else 1e-5, 1e-5)[:, None]
            np.testing.assert_array_less(np.abs(np.asarray(got) - np.asarray(want)), np.broadcast_to(tol, got.shape))


def test_the_added_part_of_a_mod_holds_its_arrays_before_anything_else_acts():
    """``added_part``: where a mod's arrays only add terms to the score before the rest of it acts elementwise, the
    Mosaic dQ takes their gradients through that part alone, at dS times the mod's derivative."""
    from pallas_kernels.score_tables import added_part

    table, slopes = pk.relative_bias(jnp.zeros((2, 8))), pk.learned_alibi(jnp.zeros(2))
    cap = pk.soft_cap(3.0)
    assert added_part(table) is table and added_part(pk.chain(table, slopes)) == pk.chain(table, slopes)
    assert added_part(pk.chain(table, slopes, cap)) == pk.chain(table, slopes)
    assert added_part(pk.chain(table, cap)) is table
    for acting_first in (cap, pk.chain(cap, table), pk.chain(table, cap, slopes)):
        assert added_part(acting_first) is None


def test_a_chain_adds_table_lookups_after_the_other_adding_mods_next_to_them():
    """``Chain.order``: within a run of adding mods a table lookup (``adds_late``) comes last, so that the
    positions the others read are free before its select chain; terms commute, so the chain's value is the one in
    the order given (up to float32 rounding); mods that act on the score keep their place."""
    table, slopes = pk.relative_bias(jnp.arange(16.0).reshape(2, 8)), pk.learned_alibi(jnp.asarray([0.5, 0.25]))
    cap = pk.soft_cap(3.0)
    assert pk.chain(table, slopes, cap).order() == [1, 0, 2]
    assert pk.chain(table, cap, slopes, table).order() == [0, 1, 2, 3]
    assert pk.chain(cap, table, slopes).order() == [0, 2, 1]
    score = jnp.asarray(np.random.default_rng(0).normal(size=(6, 9)), jnp.float32)
    q, kv = jnp.arange(6)[:, None] + 3, jnp.arange(9)[None, :]
    for mods in ((table, slopes, cap), (cap, table, slopes)):
        given = score
        for m in mods:
            given = m(given, q, kv, 1)
        np.testing.assert_allclose(pk.chain(*mods)(score, q, kv, 1), given, rtol=1e-6)
