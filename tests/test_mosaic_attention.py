"""The Mosaic GPU attention forward (``block_sparse_attention(..., lowering="mosaic")``): right in the Mosaic GPU
interpreter on CPU against the float32 reference, and compiled for an H100 (sm_90a) to PTX with TMA, wgmma and
register reallocation and no spills.

Each interpreter run costs seconds (the interpreter simulates every copy, barrier and warpgroup of every program), so
the cases are few, small (block 128x128, the smallest the kernel takes: 64 rows per compute warpgroup; head dim 64)
and each combines features. The compile runs in a subprocess, as tests/test_gpu_compile.py's do: the CUDA plugin
must be found before JAX starts its backends, and this process has started them."""

import functools
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compile_env

import pallas_kernels as pk
from pallas_kernels import targets
from pallas_kernels.kernel_inputs import AttentionStatic
from pallas_kernels.masks import at_positions
from pallas_kernels.mosaic_attention import MosaicTiles
from pallas_kernels.mosaic_backward_tiles import BackwardTiles

BLOCKS = pk.BlockSizes(128, 128)


@pytest.fixture(autouse=True, scope="module")
def _interpreted_kernels_compile_once():
    """The Mosaic GPU interpreter (jax 0.10) runs each warpgroup of each grid point as a program it traces, lowers and
    compiles anew (``thread_map._run_jaxpr``; programs with host callbacks miss the persistent cache): a kernel of 4
    programs x 3 warpgroups compiled 12 times, about 2 s each on a loaded 2-core machine. Every one of those programs
    is the same jaxpr (grid point and warpgroup are its arguments), so here it is compiled once per kernel and
    reused. Without the private hook (another jax) the tests run as they are, only slower."""
    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:
        yield
        return
    original = getattr(thread_map, "_run_jaxpr", None)
    if original is None:
        yield
        return
    compiled, lock = {}, threading.Lock()

    def run_jaxpr(jaxpr, consts, *args):
        avals = tuple(jax.typeof(a) for a in (*jax.tree.leaves(consts), *args))
        key = (id(jaxpr), avals)
        with lock:
            hit = compiled.get(key)
        if hit is None:

            def run(jaxpr, consts, *args):
                jax.core.eval_jaxpr(jaxpr, consts, *args)

            program = jax.jit(run, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()
            with lock:  # the jaxpr is kept with its program, so its id is not reused while the entry lives
                hit = compiled.setdefault(key, (jaxpr, program))
        hit[1](consts, *args)

    thread_map._run_jaxpr = run_jaxpr
    try:
        yield
    finally:
        thread_map._run_jaxpr = original


def _qkv(B, H, K, T, S, E=64, seed=0):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(B, H, T, E)), jnp.bfloat16)
    k, v = (jnp.asarray(r.normal(size=(B, K, S, E)), jnp.bfloat16) for _ in range(2))
    return q, k, v


def _close(got, want, tol, what):
    """Relative L2 error (a bfloat16 attention against the float32 reference of the same bfloat16 inputs)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < tol, f"{what}: relative error {err:.3g}"


def _check_forward(q, k, v, mask, score_mod=None):
    out, lse = pk.block_sparse_attention(
        q, k, v, pk.make_block_mask(mask, q.shape[2], k.shape[2], BLOCKS), score_mod=score_mod, lowering="mosaic"
    )
    f32 = (x.astype(jnp.float32) for x in (q, k, v))
    ref_out, ref_lse = pk.reference_attention(*f32, mask, score_mod=score_mod)
    assert out.dtype == q.dtype and lse.shape == ref_lse.shape
    _close(out, ref_out, 1e-2, "out")
    np.testing.assert_allclose(lse, ref_lse, atol=1e-3)


@pytest.mark.slow  # covered by the document-slot and ring tests' gradients and the device check at T = 1000
def test_causal_with_grouped_query_heads_at_a_ragged_length_forward_and_mosaic_backward():
    """Two query heads on one kv head, T = 200 padded to 256: two rows of the block mask, three PARTIAL tiles (the
    diagonal ones, and the second row's first, for its padding rows and keys). Then dQ, dK, dV from the Mosaic
    backward kernels (dK/dV sums the two query heads of the kv head in one program), with an lse cotangent too."""
    q, k, v = _qkv(1, 2, 1, 200, 200)
    _check_forward(q, k, v, pk.causal())
    bm = pk.make_block_mask(pk.causal(), 200, 200, BLOCKS)
    r = np.random.default_rng(4)
    d_out = jnp.asarray(r.normal(size=q.shape), jnp.bfloat16)
    d_lse = jnp.asarray(r.normal(size=q.shape[:3]), jnp.float32)
    _, vjp = jax.vjp(lambda q, k, v: pk.block_sparse_attention(q, k, v, bm, lowering="mosaic"), q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    _, ref_vjp = jax.vjp(lambda q, k, v: pk.reference_attention(q, k, v, pk.causal()), *f32[:3])
    for name, got, want in zip(("dq", "dk", "dv"), vjp((d_out, d_lse)), ref_vjp((f32[3], d_lse))):
        assert got.dtype == jnp.bfloat16
        _close(got, want, 2e-2, name)


def test_head_dim_256_backward_with_one_consumer_warpgroup_and_parts_of_the_head_dim():
    """At head dim 256 the Mosaic backward runs one consumer warpgroup of 64 rows per program, two programs per
    block, and dK/dV as two launches, each accumulating one half of the head dim's columns (the scores and dP^T
    contract over all of it in both); with a T5 bias table chained with learned slopes (33 entries a head) dQ too,
    its first launch forming the arrays' gradients (five Mosaic kernels). Two query heads on one kv head, T = 100
    padded to 128, causal: dQ, dK, dV and the table's and slopes' gradients equal the reference's."""
    q, k, v = _qkv(1, 2, 1, 100, 100, E=256)
    bm = pk.make_block_mask(pk.causal(), 100, 100, BLOCKS)
    d_out = jnp.asarray(np.random.default_rng(6).normal(size=q.shape), jnp.bfloat16)
    r = np.random.default_rng(8)
    arrays = (jnp.asarray(r.normal(size=(2, 32)), jnp.float32), jnp.asarray(r.uniform(0, 0.2, 2), jnp.float32))

    def mod(arrays):
        return pk.chain(pk.relative_bias(arrays[0]), pk.learned_alibi(arrays[1]))

    def loss(attend):
        return lambda q, k, v, arrays: (attend(q, k, v, mod(arrays)).astype(jnp.float32) * d_out).sum()

    mosaic = loss(lambda q, k, v, m: pk.block_sparse_attention(q, k, v, bm, score_mod=m, lowering="mosaic")[0])
    assert str(jax.make_jaxpr(jax.grad(mosaic, argnums=(0, 1, 2, 3)))(q, k, v, arrays)).count("axis_name=wg") == 5
    got = jax.grad(mosaic, argnums=(0, 1, 2, 3))(q, k, v, arrays)
    ref = loss(lambda q, k, v, m: pk.reference_attention(q, k, v, pk.causal(), score_mod=m)[0])
    want = jax.grad(ref, argnums=(0, 1, 2, 3))(*(x.astype(jnp.float32) for x in (q, k, v)), arrays)
    for name, g, w in zip(("dq", "dk", "dv", "d table", "d slopes"), (*got[:3], *got[3]), (*want[:3], *want[3])):
        _close(g, w, 2e-2, name)
    assert [g.dtype for g in got[:3]] == [jnp.bfloat16] * 3


@pytest.mark.parametrize("E", [64, 128])
def test_the_fused_backward_sums_dq_across_programs_and_equals_the_reference(E, monkeypatch):
    """deterministic=False: the dK/dV kernel also forms dQ, adding each step's dS K to a float32 dQ (a TMA
    reduce-add on the device) and no dQ kernel runs. The two consumer warpgroups share their dS^T, so dS K is made
    over both warpgroups' keys (and one must not overwrite its K with dK before the other's last step has read it):
    at head dim 128 each makes 64 of dQ's columns, at 64 one makes all of them, the two taking turns. Two query
    heads on one kv head, T = 200 (ragged, two block rows), an lse cotangent; at 64 causal documents, at 128 causal
    with a soft-cap: dQ, dK, dV equal the reference's. At 64 in the model's layout ([B, T, H, E]: the kernels' TMA
    copies a head's rows strided; the dQ sums land there too)."""
    monkeypatch.setattr("pallas_kernels.pallas_attention.mosaic_dq", lambda *a, **k: pytest.fail("dQ kernel ran"))
    T = 200
    q, k, v = _qkv(1, 2, 1, T, T, E=E)
    mask, mod, layout = pk.causal(), pk.soft_cap(4.0), "BHTE"
    if E == 64:
        document = pk.document(jnp.asarray(np.repeat([0, 1], [70, T - 70])[None], jnp.int32))
        mask, mod, layout = mask & document, None, "BTHE"
    bm = pk.make_block_mask(mask, T, T, BLOCKS)
    r = np.random.default_rng(7)
    d_out = jnp.asarray(r.normal(size=q.shape), jnp.bfloat16)
    d_lse = jnp.asarray(r.normal(size=q.shape[:3]), jnp.float32)
    as_layout = (lambda x: x) if layout == "BHTE" else (lambda x: x.swapaxes(1, 2))  # noqa: E731

    def fused(q, k, v):
        q, k, v = (as_layout(x) for x in (q, k, v))
        kw = dict(score_mod=mod, lowering="mosaic", deterministic=False, layout=layout)
        out, lse = pk.block_sparse_attention(q, k, v, bm, **kw)
        return as_layout(out), lse

    _, vjp = jax.vjp(fused, q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    _, ref_vjp = jax.vjp(lambda q, k, v: pk.reference_attention(q, k, v, mask, score_mod=mod), *f32[:3])
    for name, got, want in zip(("dq", "dk", "dv"), vjp((d_out, d_lse)), ref_vjp((f32[3], d_lse))):
        assert got.dtype == jnp.bfloat16
        _close(got, want, 2e-2, name)


def _captured_mod(H: int, seed: int = 5, buckets: int = 32, max_distance: int = 128):
    """T5's bias table and learned ALiBi slopes (arrays the kernels take as inputs), then a soft-cap."""
    r = np.random.default_rng(seed)
    table = jnp.asarray(r.normal(size=(H, buckets)), jnp.float32)
    slopes = jnp.asarray(r.uniform(0, 0.2, H), jnp.float32)
    return pk.chain(pk.relative_bias(table, max_distance=max_distance), pk.learned_alibi(slopes), pk.soft_cap(5.0))


@pytest.mark.slow  # covered by the document test's forward with the same mod (FULL tiles, more keys than queries)
def test_prefix_lm_with_captured_arrays_and_soft_cap_and_more_keys_than_queries():
    """T = 128 queries against S = 256 keys: the kv tile past the prefix is PARTIAL, the first FULL, and the score
    mod runs on both (the FULL tile takes the path that applies only the mod). The mod reads a bias table and
    slopes, one row per head (two heads: each program reads its own head's), from its warpgroup's shared memory."""
    _check_forward(*_qkv(1, 2, 1, 128, 256), pk.prefix_lm(200), _captured_mod(2))


def test_the_model_s_attention_runs_the_mosaic_kernels_in_its_layout_without_transposes():
    """Traced only, for an H100: jaxlm's attention (q [B, T, H, E]) with impl="pallas" calls the Mosaic GPU forward,
    dQ and dK/dV on q, k, v, out and dO as the model holds them; the one transpose outside the kernels is of the
    [B, T, H, 1] row sums of dO * out (delta, which the kernels read per head). Through [B, H, T, E] it was 8."""
    from jax._src import core

    from jaxlm.attention import attention
    from pallas_kernels.kernel_inputs import compile_target

    def outside_kernels(jaxpr, found):
        for eqn in jaxpr.eqns:
            found.append(eqn)
            if eqn.primitive.name != "mpmd_map":  # not a Mosaic GPU kernel, whose body is not looked into
                for sub in core.jaxprs_in_params(eqn.params):
                    outside_kernels(sub, found)
        return found

    q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    loss = lambda q, k, v: attention(q, k, v, mask="causal", impl="pallas").astype(jnp.float32).sum()  # noqa: E731
    with compile_target("gpu"):
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv).jaxpr
    eqns = outside_kernels(jaxpr, [])
    assert sum(e.primitive.name == "mpmd_map" for e in eqns) == 3
    transposed = [e.invars[0].aval.shape for e in eqns if e.primitive.name == "transpose"]
    assert transposed == [(1, 256, 4, 1)], transposed


def test_captured_arrays_take_the_mosaic_backward_whose_dq_kernel_returns_their_gradients():
    """Traced only: with a mod that captures arrays the forward, dQ (which forms the arrays' gradients) and dK/dV are
    the three Mosaic kernels, as without one; with lowering="triton" none is."""
    q = jnp.zeros((1, 2, 128, 64), jnp.bfloat16)
    bm = pk.make_block_mask(pk.causal(), 128, 128, BLOCKS)

    def traced(mod, lowering="mosaic"):
        loss = lambda q: pk.block_sparse_attention(q, q, q, bm, score_mod=mod, lowering=lowering)[0].sum()  # noqa: E731
        return str(jax.make_jaxpr(jax.grad(loss))(q))

    with_arrays, plain, triton = traced(_captured_mod(2)), traced(pk.soft_cap(5.0)), traced(_captured_mod(2), "triton")
    for jaxpr in (with_arrays, plain):
        assert jaxpr.count("axis_name=wg") == 3 and "name=block_sparse_attention_d" not in jaxpr
    assert "axis_name=wg" not in triton and "name=block_sparse_attention_dq" in triton


@pytest.mark.slow  # covered by the document test's gradients with the same mod
def test_gradients_to_captured_arrays_through_the_mosaic_forward():
    """The forward above on Mosaic, then the Mosaic backward from its out and lse (dQ forms the arrays' gradients;
    dK/dV reads both query heads' rows of the arrays: GQA, two query heads on one kv head): dQ, dK, dV and the
    gradients to the table and slopes against the float32 reference's."""
    q, k, v = _qkv(1, 2, 1, 128, 256)
    mask, mod = pk.prefix_lm(200), _captured_mod(2)
    bm = pk.make_block_mask(mask, 128, 256, BLOCKS)
    d_out = jnp.asarray(np.random.default_rng(6).normal(size=q.shape), jnp.bfloat16)

    def loss(attention, *inputs):
        q, k, v, arrays = inputs
        return (attention(q, k, v, mod.with_arrays(arrays))[0].astype(jnp.float32) * d_out).sum()

    kernel = functools.partial(
        loss, lambda q, k, v, m: pk.block_sparse_attention(q, k, v, bm, score_mod=m, lowering="mosaic")
    )
    ref = functools.partial(loss, lambda q, k, v, m: pk.reference_attention(q, k, v, mask, score_mod=m))
    got = jax.grad(kernel, argnums=(0, 1, 2, 3))(q, k, v, mod.arrays())
    want = jax.grad(ref, argnums=(0, 1, 2, 3))(*(x.astype(jnp.float32) for x in (q, k, v)), mod.arrays())
    for name, g, w in zip(("dq", "dk", "dv", "d table", "d slopes"), (*got[:3], *got[3]), (*want[:3], *want[3])):
        _close(g, w, 2e-2, name)


def test_document_and_position_slots_per_batch_row_with_captured_arrays_forward_and_gradients():
    """causal & document with different segment ids per batch row (3 documents, then 1), at token positions shuffled
    within each half of the sequence: a document slot and a position slot, both loaded as ids. The queries are the
    last 128 of 256 tokens, so each program walks two kv tiles: both PARTIAL in the first batch row (through the
    ids' ring), PARTIAL then FULL (no ids) in the second. The score mod reads a T5 table and learned slopes, one row
    per query head (two query heads on one kv head), then soft-caps; its tile shortcut takes the kv tiles 64 or more
    before a program's queries. Then the gradients of out and lse through that
    forward from the Mosaic backward kernels, which load the ids too: dQ as the forward does (its rows' q ids once,
    each PARTIAL kv tile's ids beside K), dK/dV transposed (its kv rows' ids once, each PARTIAL q tile's ids beside
    Q); dQ also forms the gradients to the table and slopes, per query row, summed outside. All in the model's
    layout ([B, T, H, E]): every kernel's TMA copies a head's rows strided."""
    T, S = 128, 256
    r = np.random.default_rng(2)
    ids = np.stack([np.repeat(np.arange(3), [100, 90, 66]), np.zeros(S, int)]).astype(np.int32)
    order = np.concatenate([r.permutation(T), T + r.permutation(S - T)]).astype(np.int32)
    mask = at_positions(pk.causal() & pk.document(ids[:, S - T :], ids), order[S - T :], order)
    q, k, v = _qkv(2, 2, 1, T, S, seed=3)
    mod = _captured_mod(2, buckets=4, max_distance=64)  # 4 entries: each costs the interpreter seconds
    bm = pk.make_block_mask(mask, T, S, BLOCKS)
    d_out = jnp.asarray(r.normal(size=q.shape), jnp.bfloat16)
    d_lse = jnp.asarray(r.normal(size=q.shape[:3]), jnp.float32)

    def kernel(q, k, v, arrays):
        q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))
        kw = dict(score_mod=mod.with_arrays(arrays), lowering="mosaic", layout="BTHE")
        out, lse = pk.block_sparse_attention(q, k, v, bm, **kw)
        return out.swapaxes(1, 2), lse

    def reference(q, k, v, arrays):
        return pk.reference_attention(q, k, v, mask, score_mod=mod.with_arrays(arrays))

    (out, lse), vjp = jax.vjp(kernel, q, k, v, mod.arrays())
    grads = vjp((d_out, d_lse))
    f32 = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    (ref_out, ref_lse), ref_vjp = jax.vjp(reference, *f32[:3], mod.arrays())
    ref_grads = ref_vjp((f32[3], d_lse))

    _close(out, ref_out, 1e-2, "out")
    np.testing.assert_allclose(lse, ref_lse, atol=1e-3)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert got.dtype == jnp.bfloat16
        _close(got, want, 2e-2, name)
    for name, got, want in zip(("d table", "d slopes"), grads[3], ref_grads[3]):
        _close(got, want, 2e-2, name)


def test_a_mask_without_partial_blocks_builds_its_kernels_without_the_masked_path():
    """Traced only: a block mask with no PARTIAL block (full() over lengths that fill their blocks, documents that
    start on block boundaries) builds the forward, dQ and dK/dV without their masked loop
    (``AttentionStatic.masks_nothing``: the loop's code alone, never run, spilled registers in dK/dV at head dim
    64); with a document boundary inside a block each keeps it. Padding alone (T = 120) needs the mask in the forward
    only (padded keys must take no probability): in dK/dV a padded query's lse is inf and a padded key's rows are
    cut off, in dQ a padded key's K row is zeros, unless a mod's captured arrays take gradients there. The
    numbers: the slow test below, and the ring test above for the padded full mask."""

    def loops(mask, T, mod=None):
        q, k, v = _qkv(1, 1, 1, T, T)
        bm = pk.make_block_mask(mask, T, T, BLOCKS)
        attend = functools.partial(pk.block_sparse_attention, score_mod=mod, lowering="mosaic")
        loss = lambda q, k, v: attend(q, k, v, bm)[0].astype(jnp.float32).sum()  # noqa: E731
        return str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)).count("while[")

    aligned, inside = (pk.document(np.repeat([0, 1], [n, 256 - n]).astype(np.int32)) for n in (128, 100))
    assert loops(pk.full(), 120) - loops(pk.full(), 128) == 1  # the forward's masked loop
    table = pk.relative_bias(jnp.zeros((1, 8), jnp.float32))  # captured arrays: dQ forms their gradient
    assert loops(pk.full(), 120, table) - loops(pk.full(), 128, table) == 2
    assert loops(inside, 256) - loops(aligned, 256) == 3

    def static(mask, T):
        return AttentionStatic.shared(mask, None, 1.0, pk.make_block_mask(mask, T, T, BLOCKS), 64)["masks_nothing"]

    assert static(pk.full(), 128) and static(aligned, 256)
    assert not (static(pk.full(), 120) or static(inside, 256) or static(pk.causal(), 128))


@pytest.mark.slow  # 11 s; the fast cover: the traced test above (the masked loop is left out only where it never runs)
@pytest.mark.parametrize("mask_name", ["full", "documents on block boundaries"])
def test_a_mask_without_partial_blocks_equals_the_reference(mask_name):
    """full() at T = 128, and two documents of 128 at T = 256, in the Mosaic GPU interpreter, kernels without
    their masked path: forward and gradients equal the reference's."""
    T = 128 if mask_name == "full" else 256
    mask = pk.full() if mask_name == "full" else pk.document(np.repeat([0, 1], 128).astype(np.int32))
    q, k, v = _qkv(1, 1, 1, T, T, seed=7)
    bm = pk.make_block_mask(mask, T, T, BLOCKS)
    (out, lse), vjp = jax.vjp(lambda q, k, v: pk.block_sparse_attention(q, k, v, bm, lowering="mosaic"), q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    (ref_out, ref_lse), ref_vjp = jax.vjp(lambda q, k, v: pk.reference_attention(q, k, v, mask), *f32)
    _close(out, ref_out, 1e-2, "out")
    np.testing.assert_allclose(lse, ref_lse, atol=1e-3)
    d_out = jnp.asarray(np.random.default_rng(8).normal(size=q.shape), jnp.bfloat16)
    d_lse = jnp.zeros(q.shape[:3], jnp.float32)
    for name, got, want in zip(("dq", "dk", "dv"), vjp((d_out, d_lse)), ref_vjp((d_out.astype(jnp.float32), d_lse))):
        _close(got, want, 2e-2, name)


@pytest.mark.slow  # 10 s; the fast cover: the traced loop counts above, and the ring test (padding, no arrays)
def test_a_padded_full_mask_with_a_table_equals_the_reference():
    """full() at T = 200 (padded to 256) with a T5 table: dK/dV without a mask (padding alone), dQ with it (the
    table's gradient must not take the padded keys): every gradient equals the reference's."""
    q, k, v = _qkv(1, 2, 1, 200, 200, seed=5)
    table = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8)), jnp.float32)
    bm = pk.make_block_mask(pk.full(), 200, 200, BLOCKS)
    d_out = np.random.default_rng(2).normal(size=q.shape).astype(np.float32)

    def grads(attend, *args):
        return jax.grad(lambda *a: jnp.sum(attend(*a)[0].astype(jnp.float32) * d_out), argnums=(0, 1, 2, 3))(*args)

    def mosaic(q, k, v, t):
        return pk.block_sparse_attention(q, k, v, bm, score_mod=pk.relative_bias(t), lowering="mosaic")

    def reference(q, k, v, t):
        return pk.reference_attention(q, k, v, pk.full(), score_mod=pk.relative_bias(t))

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    got, want = grads(mosaic, q, k, v, table), grads(reference, *f32, table)
    for name, g, w in zip(("dq", "dk", "dv", "d table"), got, want):
        _close(g, w, 2e-2, name)


@pytest.mark.parametrize("turns", [True, False])
def test_rows_longer_than_the_ring_with_given_tiles_forward_and_backward(turns):
    """The tile sweep's override, and rows of more tiles than ring slots (the producer reuses each slot; every other
    case here fits its ring): 64-wide tiles in two-slot rings, so the forward, dQ and dK/dV kernels each walk four
    tiles per row (or column) of T = S = 200, padded to 256. A soft-cap, whose derivative the backward rebuilds from
    the probabilities: 0 on the padding rows, whose lse is inf. Equal to the reference, forward and gradients,
    without asking for lowering="mosaic"; the forward's warpgroups with and without turns on the tensor cores."""
    q, k, v = _qkv(1, 1, 1, 200, 200, seed=3)
    bm = pk.make_block_mask(pk.full(), 200, 200, BLOCKS)
    tiles = (MosaicTiles(64, 64, 2, turns=turns), BackwardTiles(64, 64, 2, 64, 64, 2))
    mod = pk.soft_cap(2.0)

    def kernel(q, k, v):
        return pk.block_sparse_attention(q, k, v, bm, tiles=tiles, score_mod=mod)

    _check_against_reference(kernel, q, k, v, pk.full(), mod, seed=5)


def _check_against_reference(kernels, q, k, v, mask, score_mod=None, seed=0):
    """``kernels(q, k, v)`` -> (out, lse) against the float32 reference: out, lse, and dQ / dK / dV for a seeded
    output cotangent."""
    (out, lse), vjp = jax.vjp(kernels, q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    (ref_out, ref_lse), ref_vjp = jax.vjp(
        lambda q, k, v: pk.reference_attention(q, k, v, mask, score_mod=score_mod), *f32
    )
    _close(out, ref_out, 1e-2, "out")
    np.testing.assert_allclose(lse, ref_lse, atol=1e-3)
    d_out = jnp.asarray(np.random.default_rng(seed).normal(size=q.shape), jnp.bfloat16)
    zero_lse = jnp.zeros(q.shape[:3], jnp.float32)
    for name, got, want in zip(
        ("dq", "dk", "dv"), vjp((d_out, zero_lse)), ref_vjp((d_out.astype(jnp.float32), zero_lse))
    ):
        _close(got, want, 2e-2, name)


@pytest.mark.parametrize("deterministic", [True, False])
def test_resident_ctas_take_every_nth_program_of_the_grid(deterministic):
    """Persistent kernels (``ctas=3``): the forward's and dQ's 8 programs (2 batch rows x 2 heads x 2 block rows)
    and dK/dV's 4 (1 kv head) over 3 resident CTAs each, in the model's layout, GQA 2 on 1 and causal documents
    that differ by batch row, rings of 3 that each program enters at a different slot: each CTA walks its programs
    in turn, its rings running on from one into the next (counted from each program's start instead, the
    interpreter deadlocks). Output, lse and gradients equal the reference's, with the two-kernel backward and with
    dQ summed across programs."""
    B, H, K, T = 2, 2, 1, 256
    q, k, v = _qkv(B, H, K, T, T, seed=4)
    ids = jnp.asarray(np.stack([np.repeat([0, 1, 2], [60, 120, 76]), np.repeat([0, 1], [150, 106])]), jnp.int32)
    mask = pk.causal() & pk.document(ids)
    bm = pk.make_block_mask(mask, T, T, BLOCKS)
    tiles = (MosaicTiles(64, 64, 3, ctas=3), BackwardTiles(64, 64, 3, 64, 64, 3, fused_dq=not deterministic, ctas=3))

    def kernels(q, k, v):
        bthe = (x.swapaxes(1, 2) for x in (q, k, v))
        out, lse = pk.block_sparse_attention(*bthe, bm, tiles=tiles, layout="BTHE", deterministic=deterministic)
        return out.swapaxes(1, 2), lse

    _check_against_reference(kernels, q, k, v, mask, seed=6)


def test_the_device_benchmark_refuses_a_machine_without_a_gpu(capsys):
    from experiments import hopper_attention

    assert hopper_attention.main([]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "hopper_attention: error: no GPU here (the default device is cpu); the Mosaic kernels' CPU checks are "
        "tests/test_mosaic_attention.py"
    ]
    assert hopper_attention.main(["--impls", "mosaic,fused"]) == 2  # before it looks for a GPU
    assert capsys.readouterr().err.splitlines() == [
        "hopper_attention: error: --impls 'fused': choose from mosaic, mosaic_fused, triton, cudnn"
    ]
    with pytest.raises(SystemExit) as bad_pass:
        hopper_attention.main(["--only", "sweep", "--passes", "forward,dkv"])
    assert bad_pass.value.code == 2 and "'forward,dkv': choose from forward, backward, fused" in capsys.readouterr().err
    assert hopper_attention.main(["--group", "3"]) == 2  # 3 divides neither 32 nor 16 heads
    assert capsys.readouterr().err.splitlines() == [
        "hopper_attention: error: --group 3 must divide the head count of every head dim (32, 16) and --seqs be "
        "positive"
    ]


@pytest.mark.parametrize("scale, ok", [(1.0, True), (1.1, False)])
def test_the_device_check_passes_right_kernels_and_fails_wrong_ones(monkeypatch, scale, ok):
    """hopper_attention's check on CPU with the kernels swapped for the bfloat16-rounded reference (scaled by
    ``scale``): outputs and every gradient, a T5 table's included, against the compiled float32 reference."""
    from experiments import hopper_attention

    def kernels(bm, layout="BHTE", **options):
        def attend(q, k, v, mod=None):
            out, lse = pk.reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)), bm.mask, score_mod=mod)
            return (out * scale).astype(q.dtype), lse

        return attend

    table = pk.relative_bias(hopper_attention._table(2, 8))
    monkeypatch.setattr(hopper_attention, "_mosaic", kernels)
    monkeypatch.setattr(hopper_attention, "check_cases", lambda: {"t5": (pk.causal(), 256, 256, 2, 1, 64, table)})
    (row,) = hopper_attention.run_check(layout="BTHE", log=lambda line: None)
    assert row["ok"] is ok and len(row["grad_rel_errors"]) == len(row["fused_grad_rel_errors"]) == 4, row
    assert (max(row["rel_error"], *row["grad_rel_errors"]) < 0.01) is ok


def test_the_device_benchmark_says_how_the_backward_compares_per_product():
    """The backward alone against cuDNN's, and per product: the Mosaic backward makes 7 products a pair (9 at head
    dim 256: dK/dV in two parts), cuDNN's 5, as the Mosaic backward summing dQ across programs does."""
    from experiments import hopper_attention

    def row(impl, E, fwd, train):
        return {"T": 8192, "E": E, "mask": "full", "impl": impl, "forward_ms": fwd, "train_ms": train,
                "forward_tflops": 1 / fwd, "train_tflops": 1 / train}  # fmt: skip

    rows = [row("mosaic", 128, 1.0, 4.5), row("cudnn", 128, 1.0, 3.5), row("mosaic", 256, 1.0, 5.0)]
    rows += [row("cudnn", 256, 1.0, 3.0), row("mosaic_fused", 128, 1.0, 3.0), row("mosaic_fused", 256, 1.0, 5.0)]
    by_e = {r["E"]: r for r in hopper_attention.ratios(rows)}
    assert by_e[128]["backward_vs_cudnn"] == pytest.approx(2.5 / 3.5)
    assert by_e[128]["backward_products_vs_cudnn"] == pytest.approx(2.5 / 3.5 * 7 / 5)
    assert by_e[256]["backward_products_vs_cudnn"] == pytest.approx(2 / 4 * 9 / 5)
    # summing dQ across programs (5 products a pair; at 256 the two kernels run)
    assert by_e[128]["fused_train_vs_cudnn"] == pytest.approx(3.5 / 3.0)
    assert by_e[128]["fused_backward_products_vs_cudnn"] == pytest.approx(2.5 / 2.0)
    assert by_e[256]["fused_backward_products_vs_cudnn"] == pytest.approx(2 / 4 * 9 / 5)


def test_programs_take_the_lines_with_the_most_tiles_first():
    """The order the Mosaic kernels' programs walk a block mask in: a causal mask's rows last to first (the longest
    first), its columns first to last; ties in index order; a traced (document) mask's order, sorted on the device,
    equals the host's."""
    from pallas_kernels.kernel_inputs import heavy_first, line_orders

    rows, cols = line_orders(pk.make_block_mask(pk.causal(), 512, 512, pk.BlockSizes(128, 128)))
    assert rows.tolist() == [[3, 2, 1, 0]] and cols.tolist() == [[0, 1, 2, 3]]
    counts = np.array([[2, 5, 5, 1, 5], [1, 1, 3, 0, 2]], np.int32)
    assert heavy_first(counts).tolist() == [[1, 2, 4, 0, 3], [2, 4, 0, 1, 3]]
    assert jax.jit(heavy_first)(jnp.asarray(counts)).tolist() == heavy_first(counts).tolist()
    # and why: started heavy first on 132 SMs, a causal kernel's programs end sooner (experiments.program_order)
    from experiments.program_order import causal_programs, end_time

    index_order, heaviest_first = (end_time(causal_programs(8, 16, 16, 1.0, h), 132) for h in (False, True))
    assert heaviest_first < index_order / 1.03


def test_interpret_mode_picks_triton_unless_told():
    """Traced only: lowering=None in interpret mode is the Triton forward (a pallas_call), "mosaic" the Mosaic kernel
    (three warpgroups on the "wg" axis)."""
    q = jnp.zeros((1, 1, 128, 64), jnp.bfloat16)
    bm = pk.make_block_mask(pk.causal(), 128, 128, BLOCKS)

    def traced(lowering):
        return str(jax.make_jaxpr(lambda q: pk.block_sparse_attention(q, q, q, bm, lowering=lowering))(q))

    default, mosaic = traced(None), traced("mosaic")
    assert "name=block_sparse_attention_fwd" in default and "axis_name=wg" not in default
    assert "axis_name=wg" in mosaic and "name=block_sparse_attention_fwd" not in mosaic


_COMPILE = """
import glob, os, sys
from pallas_kernels import targets
from pallas_kernels.kernel_inputs import AttentionStatic
targets.enable_plugin(targets.plugin_dir())
import jax, jax.numpy as jnp, numpy as np
import pallas_kernels as pk
B, H, T, E = 2, 4, 1024, 128
ids = np.repeat(np.arange(4), T // 4)

def forward(lowering):
    def fn(q, k, v, ids):
        bm = pk.make_block_mask(pk.causal() & pk.document(ids), T, T, pk.BlockSizes(128, 128))
        return pk.block_sparse_attention(q, k, v, bm, lowering=lowering)
    fn.__name__ = f"{lowering}_forward"  # names the XLA module, hence its dumped PTX files
    return fn

S = jax.ShapeDtypeStruct((B, H, T, E), jnp.bfloat16)
if "--forwards" in sys.argv:  # the slow test's: both forwards at head dim 128, nothing else
    for lowering in ("mosaic", "triton"):
        targets.compile_for_gpu(forward(lowering), S, S, S, jax.ShapeDtypeStruct((B, T), jnp.int32))
        sys.stdout.flush()
        print("COMPILED", lowering, file=sys.stderr, flush=True)
    sys.exit(0)

# the Mosaic forward, dQ and dK/dV kernels at head dim 64 of causal & document (ids loaded by all three; a plain
# causal mask loads less; head dims 128 and 256 are tests/test_gpu_compile.py's, spills checked there too)
S64 = jax.ShapeDtypeStruct((B, H, T, 64), jnp.bfloat16)

def loss(q, k, v, ids, deterministic=True):
    bm = pk.make_block_mask(pk.causal() & pk.document(ids), T, T, pk.BlockSizes(128, 128))
    out = pk.block_sparse_attention(q, k, v, bm, lowering="mosaic", deterministic=deterministic)[0]
    return out.astype(jnp.float32).sum()

targets.compile_for_gpu(jax.grad(loss, argnums=(0, 1, 2)), S64, S64, S64, jax.ShapeDtypeStruct((B, T), jnp.int32))
sys.stdout.flush()
print("COMPILED backward", file=sys.stderr, flush=True)

# the same, dQ summed across the dK/dV kernel's programs (TMA reduce-adds): that one kernel (the forward compiled)
fused = jax.grad(lambda q, k, v, ids: loss(q, k, v, ids, deterministic=False), argnums=(0, 1, 2))
targets.compile_for_gpu(fused, S64, S64, S64, jax.ShapeDtypeStruct((B, T), jnp.int32))
sys.stdout.flush()
print("COMPILED fused backward", file=sys.stderr, flush=True)

# the Mosaic forward, dQ (forming the table's gradient) and dK/dV reading a T5 bias table [H, 8] from shared memory
# (head dim 64; 8 buckets compile in 12 s, 32 in 38: the slow every-mask compile has 32 at head dim 128)
def biased(q, k, v, table):
    bm = pk.make_block_mask(pk.causal(), T, T, pk.BlockSizes(128, 128))
    out, _ = pk.block_sparse_attention(q, k, v, bm, score_mod=pk.relative_bias(table), lowering="mosaic")
    return out.astype(jnp.float32).sum()

TABLE = jax.ShapeDtypeStruct((H, 8), jnp.float32)
targets.compile_for_gpu(jax.grad(biased, argnums=(0, 1, 2, 3)), S64, S64, S64, TABLE)
sys.stdout.flush()
print("COMPILED table", file=sys.stderr, flush=True)
"""

MARKERS = ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg")
REDUCE_ADD = "cp.reduce.async.bulk.tensor"  # a TMA reduce-add: the fused backward's dQ


def _compile_in_subprocess(tmp_path, *flags) -> tuple[str, str]:
    """(the Mosaic kernels' PTX and ptxas' report: the subprocess's output, the Triton kernels' PTX: XLA's dump)."""
    if not targets.installed(targets.CUDA_PLUGIN, targets.plugin_dir()):
        pytest.skip(f"no CUDA plugin in {targets.plugin_dir()} (pallas_kernels.targets.install_plugin installs it)")
    env = compile_env(
        MOSAIC_GPU_DUMP_PTX="1",
        MOSAIC_GPU_DUMP_PTXAS="1",
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={tmp_path} --xla_dump_hlo_module_re=triton".strip(),
    )
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE, *flags], capture_output=True, text=True, timeout=300, env=env, cwd=os.getcwd()
    )
    mosaic = proc.stdout + proc.stderr
    done = "COMPILED triton" if flags else "COMPILED table"
    assert proc.returncode == 0 and done in proc.stderr, mosaic[-3000:]
    return mosaic, "".join(p.read_text() for p in sorted(tmp_path.glob("*triton_forward*.ptx")))


def test_compiles_for_h100_with_tma_wgmma_register_reallocation_and_no_spills(tmp_path):
    """The Mosaic forward and backward at head dim 64, B=2, T=1024, of causal & document (a document slot), the
    same with dQ summed across dK/dV's programs (``deterministic=False``: one more kernel, the forward being the
    same), and causal with a T5 bias table (seven Mosaic kernels in all): their PTX (MOSAIC_GPU_DUMP_PTX: the
    subprocess's output) has TMA bulk-tensor copies, wgmma and setmaxnreg, the fused backward TMA reduce-adds, and
    ptxas reports no spills. Head dims 128 and 256: tests/test_gpu_compile.py (spills checked); the markers failing
    on the Triton kernels: the slow test below."""
    mosaic, _ = _compile_in_subprocess(tmp_path)
    assert [m for m in (*MARKERS, REDUCE_ADD) if m not in mosaic] == []
    spills = [line.strip() for line in mosaic.splitlines() if "spill stores" in line]
    assert len(spills) == 7 and all("0 bytes spill stores, 0 bytes spill loads" in x for x in spills), spills


@pytest.mark.slow  # the fast test's markers on the Mosaic kernels; this shows once that the Triton ones lack them
def test_the_ptx_markers_tell_the_mosaic_forward_from_the_triton_one(tmp_path):
    """causal & document at head dim 128, both forwards in one subprocess: the Mosaic forward's PTX has TMA, wgmma
    and setmaxnreg; the Triton forward's (XLA's dump) neither TMA nor setmaxnreg (Triton issues wgmma on sm_90 too,
    so that marker is in both)."""
    mosaic, triton = _compile_in_subprocess(tmp_path, "--forwards")
    assert ".entry block_sparse_attention_fwd" in triton
    assert [m for m in MARKERS if m not in mosaic] == []
    assert [m for m in MARKERS if m in triton] == ["wgmma.mma_async"]


def test_the_tile_sweep_times_each_tiling_against_cudnn_and_keeps_its_rows_as_it_goes(monkeypatch):
    """hopper_attention's sweep on CPU with the kernels and cuDNN swapped for the reference: each (head dim, mask)
    starts with cuDNN's row, each tiling's row carries its ratio to it and its error against cuDNN's output or
    gradients, in the layout asked for, and every row is handed on as soon as it is timed (a lease's timeout keeps
    them). A tiling whose output is 10% off is marked wrong, in either layout."""
    from experiments import hopper_attention

    def reference(q, k, v, layout):
        if layout == "BTHE":
            q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))
        out = pk.reference_attention(q, k, v, pk.causal())[0]
        return out.swapaxes(1, 2) if layout == "BTHE" else out

    layouts = []

    def attend_with(bm, tiles, q, k, v, deterministic=True, layout="BHTE"):
        layouts.append(layout)
        return reference(q, k, v, layout) * (1.1 if tiles == "wrong" else 1.0)

    monkeypatch.setattr(hopper_attention, "_attend_with", attend_with)
    monkeypatch.setattr(hopper_attention, "_peer", lambda *a: lambda q, k, v: reference(q, k, v, "BTHE"))
    monkeypatch.setattr(hopper_attention, "forward_candidates", lambda *a: ["f0", "f1"])
    monkeypatch.setattr(hopper_attention, "backward_candidates", lambda *a, fused=False: ["b0", "b1", "b2"])
    seen = []
    rows = hopper_attention.run_sweep(
        T=128, head_dims=(32,), width=64, tokens=256, backward_top=2, repeats=1, layout="BTHE",
        log=lambda line: None, on_row=lambda rows: seen.append(len(rows)),
    )  # fmt: skip
    assert seen == list(range(1, len(rows) + 1)) and len(rows) == 2 * (1 + 2 + 2 + 2)
    assert [(r["mask"], r["pass"]) for r in rows[:2]] == [("full", "cudnn"), ("full", "forward")]
    assert set(layouts) == {"BTHE"} and all("error" not in r for r in rows)
    for r in rows:
        if r["pass"] != "cudnn":
            peer = next(p for p in rows if p["pass"] == "cudnn" and p["mask"] == r["mask"])
            base = peer["forward_ms"] if r["pass"] == "forward" else peer["train_ms"]
            assert r["vs_cudnn"] == pytest.approx(base / r["ms"]) and r["layout"] == "BTHE"
            assert r["ok"] and r["err_vs_cudnn"] < 0.01
    monkeypatch.setattr(hopper_attention, "forward_candidates", lambda *a: ["f0", "wrong"])
    forward_only = hopper_attention.run_sweep(
        T=128, head_dims=(32,), width=64, tokens=256, repeats=1, log=lambda line: None, passes=("forward",)
    )  # the kernels' own layout, [B, H, T, E], against cuDNN's
    assert [r["pass"] for r in forward_only] == ["cudnn", "forward", "forward"] * 2
    assert [r["ok"] for r in forward_only if r["pass"] == "forward"] == [True, False] * 2
