"""jaxlm.moe: dropless and capacity dispatch against a per-token loop (forward and gradients, float32), the
DeepSeek-style bias moving load toward uniform, config refusals, and an MoE model training end to end."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import one_device_mesh, random_batch, tiny_config

from jaxlm import expert_swiglu, grouped_matmul
from jaxlm.config import ConfigError, ModelConfig
from jaxlm.moe import MoE, RouterBias, capacity, capacity_experts, dropless_experts, route
from jaxlm.train import Program, check_splits
from sharding import MeshLayout, build_mesh

N, D, X, K, F = 12, 8, 4, 2, 6


def _weights(seed=0):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.normal(size=(N, D)), jnp.float32)
    router = jnp.asarray(r.normal(size=(D, X)), jnp.float32)
    w_in = jnp.asarray(r.normal(size=(X, D, 2, F)) * 0.5, jnp.float32)
    w_out = jnp.asarray(r.normal(size=(X, F, D)) * 0.5, jnp.float32)
    return x, router, w_in, w_out


def _expert(x_D, w_in_D2F, w_out_FD):
    h = jnp.einsum("d,dcf->cf", x_D, w_in_D2F)
    return (jax.nn.silu(h[0]) * h[1]) @ w_out_FD


def chosen_experts(x, router):
    """Each token's top K experts, by its softmax (host numpy: the reference loops over them)."""
    probs = np.asarray(jax.nn.softmax(x @ router, axis=-1))
    return np.argsort(-probs, axis=-1, kind="stable")[:, :K]


def reference_moe(x, router, w_in, w_out, chosen, kept=None):
    """Token by token: the softmax's ``chosen`` top K renormalized, each chosen expert's SwiGLU weighted;
    ``kept[n][j]`` False drops token n's j-th choice."""
    out = []
    for n in range(N):
        probs = jax.nn.softmax(x[n] @ router)
        weights = probs[chosen[n]] / probs[chosen[n]].sum()
        terms = [
            weights[j] * _expert(x[n], w_in[e], w_out[e]) for j, e in enumerate(chosen[n]) if kept is None or kept[n][j]
        ]
        out.append(sum(terms) if terms else jnp.zeros(D))
    return jnp.stack(out)


def _moe(dispatch):
    def run(x, router, w_in, w_out):
        weights, experts, _ = route(x @ router, K, "softmax", True)
        return dispatch(x, weights, experts, w_in, w_out)

    return run


KERNELS = ["expert_loop", "tile_scan", "ragged_dot"]


def _small_tiles(monkeypatch, kernel: str):
    """Small tiles, so groups span several and pad: the CPU's loop takes tiles of 2 rows, chunks of 8 (then one of
    4 and of 2: every size); the GPU's scan tiles of 4, 3 a step (padding to whole steps). Returns ``tiled``."""
    monkeypatch.setattr(grouped_matmul, "CPU_TILE", 2)
    monkeypatch.setattr(expert_swiglu, "CPU_CHUNK", 8)
    monkeypatch.setattr(grouped_matmul, "GPU_TILE", 4)
    monkeypatch.setattr(grouped_matmul, "GPU_TILES_PER_STEP", 3)
    monkeypatch.setattr(grouped_matmul, "target_platform", lambda: "gpu" if kernel == "tile_scan" else "cpu")
    return kernel != "ragged_dot"


@pytest.mark.parametrize("kernel", KERNELS)
def test_dropless_dispatch_equals_a_per_token_loop_forward_and_gradients(kernel, monkeypatch):
    """Every grouped matmul (jaxlm.grouped_matmul) at small tiles, forward and gradients."""
    tiled = _small_tiles(monkeypatch, kernel)
    args = _weights()
    chosen = chosen_experts(*args[:2])
    dispatch = functools.partial(dropless_experts, tiled=tiled)
    got = _moe(dispatch)(*args)
    np.testing.assert_allclose(got, reference_moe(*args, chosen), atol=1e-5, rtol=1e-5)
    cotangent = jnp.asarray(np.random.default_rng(1).normal(size=(N, D)), jnp.float32)
    g = jax.grad(lambda *a: jnp.sum(_moe(dispatch)(*a) * cotangent), argnums=range(4))(*args)
    w = jax.jit(jax.grad(lambda *a: jnp.sum(reference_moe(*a, chosen) * cotangent), argnums=range(4)))(*args)
    for name, a, b in zip(("x", "router", "w_in", "w_out"), g, w):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("kernel", KERNELS)
def test_copies_routed_nowhere_add_nothing_and_take_no_tile(kernel, monkeypatch):
    """An expert exchange's receive buffer has rows past what arrived, given expert X (none, sharding.experts):
    they add nothing forward or backward, the rest is the per-token loop's, and no tile is computed for them."""
    tiled = _small_tiles(monkeypatch, kernel)
    x, router, w_in, w_out = _weights()
    weights, experts, _ = route(x @ router, K, "softmax", True)
    nowhere_N = np.arange(N) >= N - 5  # the last 5 tokens' copies
    experts = jnp.where(nowhere_N[:, None], X, experts)
    kept = [[not nowhere_N[n]] * K for n in range(N)]
    want = reference_moe(x, router, w_in, w_out, chosen_experts(x, router), kept)

    def moe(x, w_in, w_out):
        return dropless_experts(x, weights, experts, w_in, w_out, tiled=tiled)

    np.testing.assert_allclose(moe(x, w_in, w_out), want, atol=1e-5, rtol=1e-5)
    g_x, g_in, g_out = jax.grad(lambda *a: jnp.sum(moe(*a) ** 2), argnums=range(3))(x, w_in, w_out)
    w_in_out = jax.grad(
        lambda a, b: jnp.sum(reference_moe(x, router, a, b, chosen_experts(x, router), kept) ** 2), (0, 1)
    )
    for got, ref in zip((g_in, g_out), w_in_out(w_in, w_out)):
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4)
    assert not np.asarray(g_x)[nowhere_N].any()
    if tiled:  # the rows multiplied: each expert's arrived copies, padded to whole tiles
        sizes = np.bincount(np.asarray(experts)[~nowhere_N].ravel(), minlength=X)
        groups = grouped_matmul.Groups.of(experts, X, tiled)
        rows = groups.used * groups.tile if kernel == "tile_scan" else groups.padded_X.sum()
        assert int(rows) == int(np.sum(-(-sizes // groups.tile) * groups.tile))


@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_capacity_dispatch_drops_exactly_the_overflow(factor):
    """Each expert keeps its first C copies in token order (token n's choices in rank order); the rest add nothing."""
    args = _weights(2)
    x, router = args[:2]
    weights, experts, _ = route(x @ router, K, "softmax", True)
    C = capacity(N, K, X, factor)
    seen, kept = {}, []
    for n in range(N):
        row = []
        for e in np.asarray(experts[n]):
            seen[e] = seen.get(e, 0) + 1
            row.append(seen[e] <= C)
        kept.append(row)
    out, dropped = capacity_experts(x, weights, experts, *args[2:], factor)
    assert int(dropped) == sum(not k for row in kept for k in row) > 0
    np.testing.assert_allclose(out, reference_moe(*args, np.asarray(experts), kept=kept), atol=1e-5, rtol=1e-5)


def _skewed_layer(router: str):
    cfg = ModelConfig(d_model=D, num_layers=1, num_experts=X, experts_per_token=1, expert_mlp_dim=F, router=router)
    cfg = dataclasses.replace(cfg, router_bias_rate=0.02)
    layer = MoE(cfg, rngs=nnx.Rngs(0))
    layer.router[...] = layer.router[...].at[:, 0].add(1.0)  # with inputs of mean 0.5, expert 0 wins most tokens
    return layer


def test_the_router_bias_moves_load_toward_uniform():
    """The bias's gradient is its update (as the train step applies it): from a router that sends most tokens to
    one expert, 100 updates bring the busiest expert's load much nearer the mean."""
    layer = _skewed_layer("sigmoid_bias")
    x = jnp.asarray(np.random.default_rng(3).normal(0.5, 1.0, size=(2, 64, D)), jnp.float32)
    graphdef, state = nnx.split(layer)

    def output_sum(state):
        y, stats = nnx.merge(graphdef, state)(x)
        return y.sum(), stats["load"]

    grad = jax.jit(jax.grad(output_sum, has_aux=True))
    _, load0 = grad(state)
    for _ in range(100):
        g, load = grad(state)
        new_bias = nnx.split_state(g, RouterBias, ...)[0]
        state = nnx.merge_state(state, new_bias)
    assert float(load0.max()) * X > 2.0, load0
    assert float(load.max()) * X < 1.5, load


def test_bad_moe_configs_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"model.experts_per_token \(5\) must be at most model.num_experts \(4\)"):
        ModelConfig(num_experts=4, experts_per_token=5).validate()
    with pytest.raises(ConfigError, match="model.router must be one of softmax, sigmoid_bias, got 'top1'"):
        ModelConfig(num_experts=4, router="top1").validate()
    with pytest.raises(ConfigError, match="model.capacity_factor must be >= 0"):
        ModelConfig(num_experts=4, capacity_factor=-1.0).validate()
    with pytest.raises(ConfigError, match=r"model.moe_every \(3\) must divide model.num_layers \(4\)"):
        ModelConfig(num_experts=4, num_layers=4, moe_every=3).validate()
    layout = MeshLayout(expert=4, data=2)
    with pytest.raises(ValueError, match="model.num_experts = 6 is not divisible by mesh axis 'expert' = 4"):
        Program(tiny_config(model=dict(num_experts=6)), build_mesh(layout), layout)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(dict(router="softmax", microbatches=1), marks=pytest.mark.slow, id="softmax-dropless"),
        pytest.param(  # layer 0 dense, layer 1 MoE
            dict(router="sigmoid_bias", capacity_factor=1.0, num_shared_experts=1, moe_every=2, microbatches=2),
            id="bias-capacity-shared-every2-2micro",
        ),
    ],
)
def test_an_moe_model_trains_and_logs_its_routing(overrides):
    overrides = dict(overrides)
    micro = overrides.pop("microbatches")
    cfg = tiny_config(
        model=dict(num_experts=4, experts_per_token=2, expert_mlp_dim=32, **overrides),
        data=dict(microbatches=micro),
        optim=dict(learning_rate=1e-2, warmup_steps=2),
    )
    program = Program(cfg, one_device_mesh())
    state = program.init()
    batch = program.device_batch(random_batch(0))
    losses = []
    for _ in range(8):
        state, metrics = program.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.3, losses
    k = cfg.model.moe_every
    moe_layers = [i for i in range(cfg.model.num_layers) if (i + 1) % k == 0]  # named by their index in the model
    assert {m for m in metrics if m.startswith("moe_load_max")} == {f"moe_load_max_over_mean/{i}" for i in moe_layers}
    last = moe_layers[-1]
    assert 0 < float(metrics[f"moe_load_entropy/{last}"]) <= 1 and float(metrics["moe_aux_loss"]) >= 1 - 1e-3
    if overrides["router"] == "sigmoid_bias":
        assert float(metrics["moe_bias_range"]) > 0  # the biases moved
        assert all(math.isfinite(float(metrics[f"moe_dropped/{i}"])) for i in moe_layers)


# ----------------------------------------------------------------------------- expert parallelism == one device


def _moe_program(layout):
    cfg = tiny_config(
        model=dict(num_experts=8, experts_per_token=2, expert_mlp_dim=32),
        data=dict(microbatches=1),
        optim=dict(learning_rate=1e-2, warmup_steps=2),
    )
    return Program(cfg, build_mesh(layout), layout) if layout else Program(cfg, one_device_mesh())


def test_capacity_over_an_expert_axis_equals_capacity_per_device_without_one():
    """Capacity is per device: with experts over 4 devices (each sending [W, Q] slots to every other, not the
    worst case) the loss, every gradient, three steps and the dropped counts equal data parallelism over the same
    8 devices, where each device runs capacity dispatch on its own row."""

    def program(layout):
        model = dict(num_experts=8, experts_per_token=2, expert_mlp_dim=32, capacity_factor=0.75)
        cfg = tiny_config(model=model, data=dict(microbatches=1), optim=dict(learning_rate=1e-2, warmup_steps=2))
        return Program(cfg, build_mesh(layout), layout)

    want, got = _three_steps(program(MeshLayout(data=8))), _three_steps(program(MeshLayout(expert=4, data=2)))
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(want[1])):
        error = float(np.linalg.norm(np.asarray(g) - np.asarray(w)) / max(np.linalg.norm(np.asarray(w)), 1e-30))
        assert error < 1e-5, (jax.tree_util.keystr(path), error)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5)
    dropped = [{k: float(v) for k, v in m.items() if k.startswith("moe_dropped")} for m in (want[4], got[4])]
    assert dropped[0] == dropped[1] and sum(dropped[0].values()) > 0  # 0.75 of a fair share: copies were dropped


def _three_steps(program):
    """(loss and gradients of one batch at init, the losses of three training steps)."""
    state = program.init()
    (loss_sum, _), grads = program.loss_and_grads(state.params, program.device_batch(random_batch(20)))
    losses = []
    for i in range(3):
        state, metrics = program.train_step(state, program.device_batch(random_batch(20 + i)))
        losses.append(float(metrics["loss"]))
    return float(loss_sum), grads, losses, state, metrics


@pytest.fixture(scope="module")
def one_device_moe():
    return _three_steps(_moe_program(None))


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(MeshLayout(expert=8), marks=pytest.mark.slow, id="expert8"),
        pytest.param(MeshLayout(expert=4, data=2), marks=pytest.mark.slow, id="expert4_data2"),
        pytest.param(MeshLayout(expert=2, fsdp=2, tensor=2), marks=pytest.mark.slow, id="expert2_fsdp2_tensor2"),
        pytest.param(MeshLayout(data=2, fsdp=2, tensor=2), id="no_expert_axis"),  # per-device routing, tokens on tensor
        pytest.param(MeshLayout(context=2, expert=2, data=2), marks=pytest.mark.slow, id="context2_expert2_data2"),
    ],
)
def test_expert_parallel_training_equals_one_device(layout, one_device_moe):
    """One batch's loss and every gradient (experts split over the expert axis: all-to-all both ways; without one,
    each device routes its own tokens), then three training steps' losses, against one device."""
    assert len(jax.devices()) == 8
    want_loss, want_grads, want_losses, _, _ = one_device_moe
    loss, grads, losses, state, _ = _three_steps(_moe_program(layout))
    assert loss == pytest.approx(want_loss, rel=1e-6)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
        error = float(np.linalg.norm(np.asarray(g) - np.asarray(w)) / max(np.linalg.norm(np.asarray(w)), 1e-30))
        assert error < 1e-5, (jax.tree_util.keystr(path), error)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    if layout.expert > 1:
        assert state.params["blocks"]["mlp"]["w_in"].sharding.spec[1] == "expert"  # [L, X, D, C, F]: experts split


# ----------------------------------------------------------------------------- MoE inside pipeline stages


def _pipeline_moe_program(layout, **model):
    """The MoE tiny model with router losses on, in a pipeline layout (one the trainer accepts: each microbatch's
    rows split over the batch axes), or on one device accumulating as many microbatches as the layouts' pipelines
    split a batch into (the same rows: sharding splits microbatches as train_step does)."""
    model = dict(num_experts=8, experts_per_token=2, expert_mlp_dim=32, moe_aux_loss=0.01, moe_z_loss=1e-3, **model)
    micro = 1 if layout.pipeline > 1 else 2  # the layouts' pipeline_microbatches
    cfg = tiny_config(model=model, data=dict(microbatches=micro), optim=dict(learning_rate=1e-2, warmup_steps=2))
    if layout.pipeline == 1:
        return Program(cfg, one_device_mesh())
    check_splits(cfg, layout, "cpu")
    return Program(cfg, build_mesh(layout), layout)


@pytest.mark.parametrize(
    "layout, model",
    [
        (MeshLayout(pipeline=2, expert=2, data=2, pipeline_microbatches=2), dict(router="sigmoid_bias")),
        pytest.param(  # groups of a dense and an MoE layer split over stages; B and W apart
            MeshLayout(pipeline=2, expert=2, data=2, pipeline_schedule="zb-h1", pipeline_microbatches=2),
            dict(moe_every=2, num_layers=4),
            marks=pytest.mark.slow,
            id="zb-h1-every2",
        ),
        pytest.param(  # two chunks per stage moved by ppermute, experts gathered over tensor
            MeshLayout(pipeline=2, tensor=2, expert=2, pipeline_schedule="interleaved-1f1b", pipeline_microbatches=2),
            dict(num_layers=4),
            marks=pytest.mark.slow,
            id="interleaved-tensor",
        ),
    ],
)
def test_moe_stages_equal_one_device_accumulating_the_same_microbatches(layout, model):
    """Each stage adds its routers' aux and z losses to the objective and returns their statistics
    (sharding.pipeline.StageOut): the loss, every weight's gradient, three steps (router biases included: the
    pipeline averages their per-microbatch updates) and the routing metrics equal one device accumulating the same
    microbatches (10-16 s; fast cover of the slow cases: this one, and test_pipeline's schedules)."""
    want, got = (_three_steps(_pipeline_moe_program(lay, **model)) for lay in (MeshLayout(), layout))
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    weights = lambda grads: nnx.split_state(grads, nnx.Param, ...)[0]  # noqa: E731  # a bias's "gradient" is per batch
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(weights(got[1])), jax.tree.leaves(weights(want[1]))):
        error = float(np.linalg.norm(np.asarray(g) - np.asarray(w)) / max(np.linalg.norm(np.asarray(w)), 1e-30))
        assert error < 1e-5, (jax.tree_util.keystr(path), error)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5)
    routing = sorted(k for k in want[4] if k.startswith("moe_"))
    assert routing and routing == sorted(k for k in got[4] if k.startswith("moe_"))
    np.testing.assert_allclose([float(got[4][k]) for k in routing], [float(want[4][k]) for k in routing], rtol=1e-5)
    for g, w in zip(*(jax.tree.leaves(nnx.split_state(r[3].params, RouterBias, ...)[0]) for r in (got, want))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-7)


def test_the_cpu_ragged_all_to_all_follows_jax_s_documented_example():
    """XLA:CPU has no ragged all-to-all, so sharding.experts emulates it there; its results are those
    jax.lax.ragged_all_to_all's documentation gives for its two-device example (GPU and TPU run the real one)."""
    from sharding.experts import ragged_all_to_all

    mesh = jax.make_mesh((2,), ("expert",), devices=jax.devices()[:2])
    operand = np.array([[1, 2, 2], [3, 4, 0]], np.float32)
    sizes = {  # per device: input_offsets, send_sizes, output_offsets, recv_sizes
        "in": [[0, 1], [0, 1]],
        "send": [[1, 2], [1, 1]],
        "out": [[0, 0], [1, 2]],
        "recv": [[1, 1], [2, 1]],
    }
    per_device = jax.sharding.PartitionSpec("expert")

    def exchange(x, i, s, o, r):
        return ragged_all_to_all(x[0], jnp.zeros(4, x.dtype), i[0], s[0], o[0], r[0], axes=("expert",))[None]

    args = [operand] + [np.array(sizes[k], np.int32) for k in ("in", "send", "out", "recv")]
    args = jax.device_put(args, jax.sharding.NamedSharding(mesh, per_device))
    mapped = jax.shard_map(exchange, mesh=mesh, in_specs=(per_device,) * 5, out_specs=per_device, check_vma=False)
    np.testing.assert_array_equal(jax.jit(mapped)(*args), [[1, 3, 0, 0], [2, 2, 4, 0]])
