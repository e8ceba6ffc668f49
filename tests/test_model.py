"""jaxlm.model and jaxlm.attention against plain references: shapes, dtypes, causality, GQA, scan/remat, metadata."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import VOCAB, random_batch, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlm.attention import IMPLEMENTATIONS, attention, parse_mask
from jaxlm.model import LOGICAL_AXES, Transformer
from jaxlm.train import loss_sums
from pallas_kernels import BlockSizes, soft_cap

T = 16


def build(cfg, seed=0):
    return Transformer(cfg, rngs=nnx.Rngs(seed))


def jitted_forward(model):
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
    return lambda tokens: np.asarray(fwd(state, jnp.asarray(tokens)))


def tokens(seed, batch=2, seq=T, vocab=VOCAB):
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq)).astype(np.int32)


# ----------------------------------------------------------------------------- shapes and dtypes


@pytest.mark.parametrize("tie", [True, False])
def test_logits_shape_and_dtype(tie):
    cfg = tiny_model(tie_embeddings=tie)
    model = build(cfg)
    assert hasattr(model, "lm_head") != tie
    logits = jitted_forward(model)(tokens(0, batch=3, seq=T))
    assert logits.shape == (3, T, VOCAB) and logits.dtype == np.float32
    assert np.all(np.isfinite(np.asarray(logits)))


def test_bfloat16_activations_close_to_float32():
    toks = tokens(1, batch=4)
    f32 = build(tiny_model())
    bf16 = build(tiny_model(dtype="bfloat16"))
    # Params are float32 in both and identical (same seed); only the compute dtype differs.
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(f32)), nnx.to_pure_dict(nnx.state(bf16)))
    jaxpr = str(jax.make_jaxpr(lambda t: bf16(t))(toks))
    assert "bf16" in jaxpr, "bfloat16 config should compute in bfloat16"
    ref, low = jitted_forward(f32)(toks), jitted_forward(bf16)(toks)
    assert low.dtype == np.float32
    assert not np.array_equal(ref, low)
    scale = np.abs(ref).max()
    assert np.abs(ref - low).max() < 0.05 * scale, (np.abs(ref - low).max(), scale)
    # Agreement well beyond chance: the per-position argmax mostly matches.
    assert (ref.argmax(-1) == low.argmax(-1)).mean() > 0.8


# ----------------------------------------------------------------------------- causality


_causal_forward = None


def _causal_setup():
    global _causal_forward
    if _causal_forward is None:
        _causal_forward = jitted_forward(build(tiny_model(), seed=3))
    return _causal_forward


@settings(max_examples=25, deadline=None)
@given(t=st.integers(0, T - 1), delta=st.integers(1, VOCAB - 1), seed=st.integers(0, 2**16))
def test_causal_masking(t, delta, seed):
    fwd = _causal_setup()
    toks = tokens(seed)
    changed = toks.copy()
    changed[:, t] = (changed[:, t] + delta) % VOCAB
    a, b = fwd(toks), fwd(changed)
    np.testing.assert_array_equal(a[:, :t], b[:, :t])  # the past never sees the future
    assert not np.allclose(a[:, t], b[:, t])  # ...while position t itself does see the change


# ----------------------------------------------------------------------------- attention


def reference_attention(q, k, v, *, allowed, scale=None, softcap=0.0):
    """Per-head float64 softmax attention; query head h uses kv head h // G. allowed: bool [B, T, S]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, Tq, H, D = q.shape
    K = k.shape[2]
    G = H // K
    scale = D**-0.5 if scale is None else scale
    out = np.zeros((B, Tq, H, D))
    for h in range(H):
        scores = np.einsum("btd,bsd->bts", q[:, :, h], k[:, :, h // G]) * scale
        if softcap:
            scores = softcap * np.tanh(scores / softcap)
        scores = np.where(allowed, scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[:, :, h] = np.einsum("bts,bsd->btd", p, v[:, :, h // G])
    return out


def allowed_by(spec, segment_ids, B, T):
    """The spec's element mask, written out by hand in numpy (independent of pallas_kernels)."""
    q, kv = np.arange(T)[:, None], np.arange(T)[None, :]
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
    table = {
        "causal": q >= kv,
        "full": np.ones((T, T), bool),
        "causal & document": (q >= kv) & same_doc,
        "sliding_window(5)": (q - kv >= 0) & (q - kv < 5),
        "causal & sliding_window(4)": (q - kv >= 0) & (q - kv < 4),
        "prefix_lm(4) & document": ((kv < 4) | (q >= kv)) & same_doc,
        "causal & (sliding_window(3) | global_tokens(2))": (q >= kv)
        & (((q - kv >= 0) & (q - kv < 3)) | (kv < 2) | (q < 2)),
    }
    return np.broadcast_to(table[spec], (B, T, T))


MASK_SPECS = [
    "causal",
    "full",
    "causal & document",
    "sliding_window(5)",
    "causal & sliding_window(4)",
    "prefix_lm(4) & document",
    "causal & (sliding_window(3) | global_tokens(2))",
]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("spec", MASK_SPECS)
def test_attention_matches_reference(impl, spec):
    B, S, K, G, D = 2, 12, 2, 3, 8
    rng = np.random.default_rng(MASK_SPECS.index(spec))
    q = rng.normal(size=(B, S, K * G, D)).astype(np.float32)
    k = rng.normal(size=(B, S, K, D)).astype(np.float32)
    v = rng.normal(size=(B, S, K, D)).astype(np.float32)
    segment_ids = np.sort(rng.integers(0, 3, (B, S)), axis=1).astype(np.int32)
    out = attention(
        jnp.asarray(q),
        jnp.asarray(k),
        jnp.asarray(v),
        mask=spec,
        impl=impl,
        segment_ids_BT=jnp.asarray(segment_ids),
        block_sizes=BlockSizes(8, 8),
    )
    assert out.shape == (B, S, K * G, D)
    ref = reference_attention(q, k, v, allowed=allowed_by(spec, segment_ids, B, S))
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_attention_explicit_scale_softcap_and_bad_heads(impl):
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in ((1, 6, 4, 8), (1, 6, 2, 8), (1, 6, 2, 8)))
    allowed = allowed_by("causal", np.zeros((1, 6), np.int32), 1, 6)
    out = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale=0.3, impl=impl)
    np.testing.assert_allclose(
        np.asarray(out), reference_attention(q, k, v, allowed=allowed, scale=0.3), rtol=1e-5, atol=1e-5
    )
    if impl != "jax":
        out = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), impl=impl, score_mod=soft_cap(0.5))
        np.testing.assert_allclose(
            np.asarray(out), reference_attention(q, k, v, allowed=allowed, softcap=0.5), rtol=1e-5, atol=1e-5
        )
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attention(jnp.asarray(q[:, :, :3]), jnp.asarray(k), jnp.asarray(v), impl=impl)
    with pytest.raises(ValueError, match="uses document.. but no segment ids"):
        attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), impl=impl, mask="causal & document")


def test_auto_attention_picks_by_platform_mask_and_length():
    """impl="auto": on CPU the block-sparse XLA path once the sequence spans more than one query block, the dense
    reference below; on a GPU cuDNN for causal (or causal in a sliding window) bf16 and the Pallas kernels for other
    masks or float32."""
    from jaxlm.attention import auto_block_sizes, auto_impl
    from pallas_kernels import causal, prefix_lm, sliding_window
    from pallas_kernels.kernel_inputs import compile_target
    from pallas_kernels.mask_spec import parse_mask

    def q(T, dtype=jnp.float32):
        return jax.ShapeDtypeStruct((1, T, 4, 64), dtype)

    assert jax.default_backend() == "cpu"
    assert auto_impl(causal(), q(256)) == "xla_blocksparse"
    assert auto_impl(causal(), q(128)) == "reference"
    assert auto_impl(causal(), q(256), block_sizes=BlockSizes(256, 256)) == "reference"
    # up to STRIPS_MAX_LEN the tiled path runs strips of CPU_STRIP_BLOCK: from 65 positions on, more than one
    for T, want in ((64, BlockSizes(64, 64)), (256, BlockSizes(64, 64)), (257, BlockSizes(128, 128))):
        assert auto_block_sizes(causal(), q(T), BlockSizes(128, 128)) == want
    traced = parse_mask("causal & document")  # its tiles are known on device only: no strips
    assert auto_block_sizes(traced, q(256), BlockSizes(128, 128)) == BlockSizes(128, 128)
    with compile_target("gpu"):
        assert auto_impl(causal(), q(4096, jnp.bfloat16)) == "jax"
        assert auto_impl(causal(), q(4096, jnp.float32)) == "pallas"
        assert auto_impl(causal() & sliding_window(1024), q(4096, jnp.bfloat16)) == "jax"  # local_window_size
        assert auto_impl(sliding_window(1024), q(4096, jnp.bfloat16)) == "jax"
        assert auto_impl(causal() | sliding_window(1024), q(4096, jnp.bfloat16)) == "pallas"
        assert auto_impl(sliding_window(1024) & prefix_lm(8), q(4096, jnp.bfloat16)) == "pallas"
        assert auto_impl(causal(), q(4096, jnp.bfloat16), score_mod=soft_cap(30.0)) == "pallas"
    with compile_target("tpu"):
        assert auto_impl(causal(), q(4096, jnp.bfloat16)) == "pallas"


def test_unknown_attention_impl_and_bad_mask_specs():
    x = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match="unknown attention impl"):
        attention(x, x, x, impl="nope")
    for spec, problem in [
        ("causal &", "not a valid expression"),
        ("sliding_window(w)", "cannot read"),
        ("causal + full", "cannot read"),
        ("__import__('os')", "cannot read"),
        ("sliding_window(0)", "window must be an integer >= 1"),
    ]:
        with pytest.raises(ValueError, match=problem):
            parse_mask(spec)
    assert parse_mask("causal & document()") == parse_mask("causal&document")


def test_block_sparse_attention_under_mesh_and_shard_map():
    """In a mesh context the kernels run per shard (batch over data, heads over tensor); inside a user's shard_map
    they run on the local shard as they are. Both equal the unsharded result."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    B, T, H, K, D = 4, 40, 4, 2, 8
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, T, K, D)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1), jnp.int32)
    spec = "causal & document"
    want = reference_attention(q, k, v, allowed=allowed_by(spec, np.asarray(seg), B, T))
    for impl in ("xla_blocksparse", "pallas"):

        def f(q, k, v, seg):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return attention(q, k, v, mask=spec, segment_ids_BT=seg, impl=impl, block_sizes=BlockSizes(16, 16))

        x_sh = NamedSharding(mesh, P(("data", "fsdp"), None, "tensor"))
        args = [jax.device_put(a, x_sh) for a in (q, k, v)] + [
            jax.device_put(seg, NamedSharding(mesh, P(("data", "fsdp"))))
        ]
        hlo = jax.jit(f).lower(*args).as_text()
        assert "shard_map" in hlo or "manual" in hlo.lower()
        np.testing.assert_allclose(np.asarray(jax.jit(f)(*args)), want, rtol=1e-5, atol=1e-5)

        # the Pallas interpreter cannot track varying mesh axes through its slices: check_vma=False for it
        inner = jax.shard_map(
            lambda q, k, v, s: attention(q, k, v, mask=spec, segment_ids_BT=s, impl=impl),
            mesh=mesh,
            in_specs=(P("data", None, "tensor"),) * 3 + (P("data"),),
            out_specs=P("data", None, "tensor"),
            check_vma=impl != "pallas",
        )
        np.testing.assert_allclose(np.asarray(jax.jit(inner)(q, k, v, seg)), want, rtol=1e-5, atol=1e-5)


def test_attention_deterministic_reaches_the_pallas_kernels(monkeypatch):
    """``model.attention_deterministic=false`` asks the Pallas kernels for their backward that sums dQ across
    programs (Mosaic GPU on Hopper; pallas_kernels' tests check it); the default asks for the deterministic one."""
    import pallas_kernels as pk

    original, asked = pk.block_sparse_attention, []

    def spy(*args, deterministic=True, **kwargs):
        asked.append(deterministic)
        return original(*args, deterministic=deterministic, **kwargs)

    monkeypatch.setattr(pk, "block_sparse_attention", spy)
    for deterministic in (True, False):
        cfg = tiny_model(attention_impl="pallas", attention_deterministic=deterministic)
        jitted_forward(build(cfg))(tokens(0, seq=T))
        assert asked and set(asked) == {deterministic}
        asked.clear()


def test_gqa_equals_mha_with_expanded_kv_heads():
    gqa_cfg = tiny_model(num_heads=4, num_kv_heads=2)
    mha_cfg = dataclasses.replace(gqa_cfg, num_kv_heads=4)
    gqa, mha = build(gqa_cfg, seed=5), build(mha_cfg, seed=9)
    G = gqa_cfg.num_heads // gqa_cfg.num_kv_heads

    params = nnx.to_pure_dict(nnx.state(gqa, nnx.Param))
    w = params["blocks"]["attn"]["wqkv"]  # [L, D, K, G+2, E]: per kv head, its G query heads, then key, value
    L, D, K, _, E = w.shape
    q = w[:, :, :, :G].reshape(L, D, K * G, E)  # query head h = k * G + g
    k = jnp.repeat(w[:, :, :, G], G, axis=2)  # query head h uses kv head h // G
    v = jnp.repeat(w[:, :, :, G + 1], G, axis=2)
    params["blocks"]["attn"]["wqkv"] = jnp.stack([q, k, v], axis=3)  # [L, D, H, 1+2, E]

    mha_state = nnx.state(mha, nnx.Param)
    assert mha_state["blocks"]["attn"]["wqkv"].shape == (L, D, K * G, 3, E)
    nnx.replace_by_pure_dict(mha_state, params)
    nnx.update(mha, mha_state)

    toks = tokens(2, batch=2)
    np.testing.assert_allclose(jitted_forward(mha)(toks), jitted_forward(gqa)(toks), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- loss at init


def test_untrained_loss_is_log_vocab():
    cfg = tiny_model(vocab_size=384, d_model=64, max_seq_len=32)
    graphdef, params = nnx.split(build(cfg))
    batch = random_batch(7, batch=8, seq=32, vocab=384)
    loss_sum, count = jax.jit(lambda p, b: loss_sums(p, graphdef, b))(params, batch)
    loss = float(loss_sum / count)
    assert count == 8 * 32
    assert abs(loss - math.log(384)) < 0.1, loss


# ----------------------------------------------------------------------------- scan / unroll / remat


def test_scan_unrolled_and_remat_agree():
    batch = random_batch(11)
    variants = {
        "scan": dict(scan_layers=True),
        "unrolled": dict(scan_layers=False),
        "scan_remat": dict(scan_layers=True, remat="full"),
        "unrolled_remat": dict(scan_layers=False, remat="dots_no_batch"),
        "scan_unroll2": dict(scan_layers=True, scan_unroll=2),
    }
    results = {}
    for name, overrides in variants.items():
        graphdef, params = nnx.split(build(tiny_model(**overrides), seed=1))

        @jax.jit
        def logits_and_grads(params):
            logits = nnx.merge(graphdef, params)(batch["inputs"])
            return logits, jax.grad(lambda p: loss_sums(p, graphdef, batch)[0])(params)

        logits, grads = logits_and_grads(params)
        results[name] = (
            np.asarray(logits),
            jax.tree.map(np.asarray, nnx.to_pure_dict(params)),
            jax.tree.map(np.asarray, nnx.to_pure_dict(grads)),
        )
    ref_logits, ref_params, ref_grads = results.pop("scan")
    for name, (logits, params, grads) in results.items():
        jax.tree.map(np.testing.assert_array_equal, params, ref_params)  # same init regardless of execution
        np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-6, err_msg=name)
        # Summation order differs between the variants: compare each gradient at float32 precision of its scale.
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max(), err_msg=name),
            grads,
            ref_grads,
        )
    assert any(np.abs(g).max() > 0 for g in jax.tree.leaves(ref_grads))


@pytest.mark.parametrize(
    "spec, x_shape, w_shape, dtype, out_dtype",
    [
        ("btd,dkge->btkge", (2, 5, 8), (8, 2, 3, 4), jnp.float32, None),
        ("btd,dcf->btcf", (2, 5, 8), (8, 2, 6), jnp.float32, None),
        ("bthe,hed->btd", (2, 5, 3, 4), (3, 4, 8), jnp.float32, None),
        ("btd,dv->btv", (2, 5, 8), (8, 11), jnp.bfloat16, jnp.float32),
    ],
)
@pytest.mark.parametrize("devices", [1, 2], ids=["one device: 2-D products", "a mesh: einsums"])
def test_plain_projection_gradients_equal_autodiff(spec, x_shape, w_shape, dtype, out_dtype, devices):
    """The projection's written-out backward is autodiff's, dtypes included: on one device as 2-D products, under a
    mesh of several as einsums (that do not merge axes a rule may shard)."""
    from jaxlm import quantized
    from jaxlm.quantized import plain_projection

    kx, kw, ky = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, x_shape, dtype)
    w = jax.random.normal(kw, w_shape, dtype)
    out_shape = jax.eval_shape(lambda: jnp.einsum(spec, x, w)).shape
    cot = jax.random.normal(ky, out_shape, jnp.float32)

    def loss(f):
        return lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * cot)

    def autodiff(x, w):
        return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)

    def custom(x, w):
        return plain_projection(spec, out_dtype, x, w)

    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    with jax.set_mesh(mesh):
        assert quantized._one_device() == (devices == 1)
        ours = jax.jit(jax.grad(loss(custom), argnums=(0, 1)))(x, w)
    reference = jax.jit(jax.grad(loss(autodiff), argnums=(0, 1)))(x, w)
    for a, b in zip(ours, reference):
        assert a.dtype == b.dtype and a.shape == b.shape
        tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol)


def test_weight_gradient_products_keep_their_written_layout_on_cpu():
    """On CPU the weight gradient's product is compiled as written ([D, F] for the down projection), not with the
    transpose to w's [F, D] folded into it: XLA:CPU ran that folded product 1.2-1.3x slower (jaxlm.quantized)."""
    from jaxlm.quantized import plain_projection

    F, D = 48, 16
    x = jax.random.normal(jax.random.key(0), (2, 8, F))
    w = jax.random.normal(jax.random.key(1), (F, D))
    grad_w = jax.jit(jax.grad(lambda w: jnp.sum(plain_projection("btf,fd->btd", None, x, w) ** 2)))
    hlo = grad_w.lower(w).compile().as_text()
    dot_shapes = re.findall(r"= (f32\[[\d,]+\])\S* dot\(", hlo)
    assert f"f32[{D},{F}]" in dot_shapes and f"f32[{F},{D}]" not in dot_shapes, dot_shapes


def test_swiglu_backward_equals_autodiff():
    """The written-out SwiGLU gradient (one stack of the gate and up halves) is autodiff's of silu(gate) * up."""
    from jaxlm.model import swiglu

    kh, kw = jax.random.split(jax.random.key(3))
    h = 3 * jax.random.normal(kh, (2, 5, 2, 7), jnp.float32)
    w = jax.random.normal(kw, (2, 5, 7), jnp.float32)
    ours = jax.grad(lambda h: jnp.sum(swiglu(h) * w))(h)
    reference = jax.grad(lambda h: jnp.sum(jax.nn.silu(h[:, :, 0]) * h[:, :, 1] * w))(h)
    np.testing.assert_allclose(swiglu(h), jax.nn.silu(h[:, :, 0]) * h[:, :, 1], rtol=1e-6)
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-6)
    assert np.abs(ours[:, :, 0]).max() > 0 and np.abs(ours[:, :, 1]).max() > 0


def test_dot_remat_policies_keep_the_plain_projections():
    """`remat=dots` keeps the projections' outputs although their dot sits inside a custom_vjp: the backward
    recomputes no projection (as many dots as without remat), where `full` recomputes them."""
    from jaxlm.model import REMAT_POLICIES
    from jaxlm.quantized import project

    x, w1, w2 = jnp.ones((16, 8)), jnp.ones((8, 32)), jnp.ones((32, 8))

    def f(x, w1, w2):
        return jnp.sum(project("td,df->tf", jax.nn.silu(project("td,df->tf", x, w1, None)), w2, None))

    def dots(policy):
        fn = f if policy is None else jax.checkpoint(f, policy=policy)
        return jax.jit(jax.value_and_grad(fn, argnums=(1, 2))).lower(x, w1, w2).as_text().count("dot_general")

    assert dots(REMAT_POLICIES["dots"]) == dots(REMAT_POLICIES["dots_no_batch"]) == dots(None)
    assert dots(REMAT_POLICIES["full"]) > dots(None)


# ----------------------------------------------------------------------------- logical-axis metadata


def test_every_param_has_logical_axes():
    cfg = tiny_model(tie_embeddings=False)
    model = build(cfg)
    flat = list(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert len(flat) >= 8
    for path, param in flat:
        axes = param.get_metadata(LOGICAL_AXES, None)
        assert axes is not None, path
        assert len(axes) == param.ndim, (path, axes, param.shape)
        stacked = path[0] == "blocks"
        assert (axes[0] == "layers") == stacked, (path, axes)
        if stacked:
            assert param.shape[0] == cfg.num_layers, (path, param.shape)
    axes = {path: p.get_metadata(LOGICAL_AXES) for path, p in flat}
    assert axes[("embed",)] == ("vocab", "embed")
    assert axes[("lm_head",)] == ("embed", "vocab")
    assert axes[("blocks", "attn", "wqkv")] == ("layers", "embed", "kv_heads", None, "head_dim")
