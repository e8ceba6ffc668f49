"""jaxlm.train: the compiled step (loss, accumulation, schedule, weight decay, masking) and its sharded equivalence."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import VOCAB, one_device_mesh, pure, random_batch, repetitive_token_file, tiny_config, tiny_model
from jax.sharding import PartitionSpec as P

from data import SeededBatchIterator, TokenFile
from jaxlm.config import OptimConfig
from jaxlm.model import Transformer
from jaxlm.train import Program, TrainState, loss_sums, make_optimizer, train_step
from sharding import MeshLayout, build_mesh


def run_steps(program, batches):
    """Runs train_step over `batches` from a fresh init; returns (final state, per-step host metrics)."""
    state = program.init()
    history = []
    for batch in batches:
        state, metrics = program.train_step(state, program.device_batch(batch))
        history.append(jax.device_get(metrics))
    return state, history


CFG = tiny_config(optim=dict(learning_rate=1e-2, warmup_steps=3, weight_decay=0.1))


@pytest.fixture(scope="module")
def program():
    return Program(CFG, one_device_mesh())


# ----------------------------------------------------------------------------- learning and compilation


def test_loss_falls_on_a_repetitive_corpus(tmp_path, program):
    tokens = TokenFile.open(repetitive_token_file(tmp_path / "tokens")).tokens
    batches = SeededBatchIterator(tokens, batch_size=8, seq_len=16, seed=0)
    _, history = run_steps(program, (next(batches) for _ in range(30)))
    losses = [float(m["loss"]) for m in history]
    assert all(np.isfinite(losses))
    assert abs(losses[0] - math.log(VOCAB)) < 0.15, losses[0]
    assert np.mean(losses[-5:]) < 0.5 * losses[0], losses
    assert program.train_step._cache_size() == 1


def test_train_step_compiles_once(program):
    state = program.init()
    for i in range(4):
        state, metrics = program.train_step(state, program.device_batch(random_batch(100 + i)))
        assert int(state.step) == i + 1
    assert program.train_step._cache_size() == 1


# ----------------------------------------------------------------------------- gradient accumulation


def one_step(microbatches):
    """(metrics, params after one AdamW step, the accumulated gradient) via train_step with k microbatches."""
    # eps well above float noise in g: Adam's first update lr * g / (|g| + eps) is then smooth in g (with eps=1e-8,
    # an element with g ~ 0 turns float noise into a full lr-sized step of either sign).
    cfg = tiny_config(data=dict(microbatches=microbatches), optim=dict(eps=1e-4))
    graphdef, params = nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(cfg.seed)))
    adamw, schedule = make_optimizer(cfg.optim, cfg.steps)
    # A pass-through transformation that keeps the incoming (accumulated, averaged) gradient as its state.
    keep = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), lambda g, state, p=None: (g, g))
    tx = optax.chain(keep, adamw)
    step = jax.jit(
        functools.partial(train_step, graphdef=graphdef, tx=tx, schedule=schedule, microbatches=microbatches)
    )
    batch = random_batch(3)
    # An uneven loss mask: microbatches hold different token counts, so averaging per-microbatch means would be wrong.
    batch["loss_mask"][:3, 5:] = 0.0
    batch["loss_mask"][6, :2] = 0.0
    state, metrics = step(TrainState(jnp.zeros((), jnp.int32), params, tx.init(params)), batch)
    return jax.device_get(metrics), pure(state.params), pure(state.opt_state[0])


@pytest.fixture(scope="module")
def full_batch_step():
    return one_step(1)


@pytest.mark.parametrize("k", [2, 4])
def test_gradient_accumulation_matches_one_big_batch(k, full_batch_step):
    m1, p1, g1 = full_batch_step
    mk, pk, gk = one_step(k)
    np.testing.assert_allclose(mk["loss"], m1["loss"], rtol=1e-5)
    np.testing.assert_allclose(mk["grad_norm"], m1["grad_norm"], rtol=1e-5)
    assert float(m1["grad_norm"]) > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max()), gk, g1)
    lr0 = float(m1["lr"])  # the step moved params by up to lr0; they agree to a thousandth of that
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-3 * lr0), pk, p1)


# ----------------------------------------------------------------------------- schedule and weight decay


@pytest.mark.parametrize("warmup, decay_steps, total", [(5, 0, 40), (0, 0, 10), (3, 20, 100)])
def test_lr_schedule_warmup_then_cosine(warmup, decay_steps, total):
    ocfg = OptimConfig(learning_rate=2e-3, warmup_steps=warmup, decay_steps=decay_steps, min_lr_ratio=0.1)
    _, schedule = make_optimizer(ocfg, total)
    end = decay_steps or total
    for step in range(total + 5):
        if step < warmup:
            expected = 2e-3 * (step + 1) / warmup
        else:
            progress = min((step - warmup) / (end - warmup), 1.0)
            expected = 2e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        np.testing.assert_allclose(float(schedule(step)), expected, rtol=1e-5, err_msg=f"step {step}")
    assert float(schedule(warmup)) == pytest.approx(2e-3)
    assert float(schedule(end + 3)) == pytest.approx(2e-4)


def test_weight_decay_skips_norm_scales_and_follows_the_schedule(program):
    """With every token masked the gradient is zero, so a step is pure decoupled weight decay:
    p <- p * (1 - lr_t * wd) for matrices and embeddings; norm scales (1-D per layer, even stacked) stay put."""
    wd = program.cfg.optim.weight_decay
    assert wd > 0
    before = pure(program.init().params)
    batch = random_batch(0)
    batch["loss_mask"][:] = 0.0
    state, history = run_steps(program, [batch] * 3)
    after = pure(state.params)
    lrs = [float(m["lr"]) for m in history]
    np.testing.assert_allclose(lrs, [float(program.schedule(s)) for s in range(3)], rtol=1e-6)
    assert all(float(m["grad_norm"]) == 0.0 for m in history)
    factor = math.prod(1 - lr * wd for lr in lrs)
    flat_before = dict(nnx.to_flat_state(nnx.State(before)))
    flat_after = dict(nnx.to_flat_state(nnx.State(after)))
    assert {path[-1] for path in flat_before} >= {"scale", "embed", "wqkv", "w_in"}
    for path, b in flat_before.items():
        a = flat_after[path]
        if path[-1] == "scale":
            np.testing.assert_array_equal(a, b, err_msg=f"{path}: norm scales must not be decayed")
        else:
            np.testing.assert_allclose(a, b * factor, rtol=1e-6, err_msg=str(path))


# ----------------------------------------------------------------------------- loss mask


def test_loss_mask_excludes_tokens():
    graphdef, params = nnx.split(Transformer(tiny_model(), rngs=nnx.Rngs(0)))
    batch = {k: jnp.asarray(v) for k, v in random_batch(4).items()}
    mask = np.zeros((8, 16), np.float32)
    mask[:, ::2] = 1.0  # keep even positions, drop odd ones
    mask[5] = 1 - mask[5]  # ...and the other half in one row
    batch["loss_mask"] = jnp.asarray(mask)

    loss_and_grads = jax.jit(jax.value_and_grad(lambda p, b: loss_sums(p, graphdef, b), has_aux=True))
    (loss_sum, count), grads = loss_and_grads(params, batch)

    # Reference: the mean cross-entropy over the kept positions only, from plain log-softmax.
    logits = np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, batch["inputs"]), np.float64)
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    nll = -np.take_along_axis(logp, np.asarray(batch["targets"])[..., None], -1)[..., 0]
    assert float(count) == mask.sum() == 64
    np.testing.assert_allclose(float(loss_sum / count), nll[mask == 1].mean(), rtol=1e-5)

    # Masked positions' targets are irrelevant: scramble them and nothing changes.
    scrambled = dict(batch)
    targets = np.asarray(batch["targets"]).copy()
    targets[mask == 0] = (targets[mask == 0] + 17) % VOCAB
    scrambled["targets"] = jnp.asarray(targets)
    (loss_sum2, count2), grads2 = loss_and_grads(params, scrambled)
    assert float(loss_sum2) == pytest.approx(float(loss_sum), rel=1e-6) and float(count2) == float(count)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8), pure(grads2), pure(grads))
    # ...whereas scrambling a kept target does change the loss.
    targets[0, 0] = (targets[0, 0] + 17) % VOCAB
    scrambled["targets"] = jnp.asarray(targets)
    (loss_sum3, _), _ = loss_and_grads(params, scrambled)
    assert float(loss_sum3) != pytest.approx(float(loss_sum), rel=1e-6)


# ----------------------------------------------------------------------------- sharded == single device


LAYOUTS = {  # layout, microbatches, expected param specs
    "data8": (MeshLayout(data=8), 1, {"embed": P("tensor", "fsdp")}),
    "fsdp8": (MeshLayout(fsdp=8), 1, {"embed": P("tensor", "fsdp")}),
    "data2_fsdp2_tensor2_micro2": (
        MeshLayout(data=2, fsdp=2, tensor=2),
        2,
        {"embed": P("tensor", "fsdp"), "final_norm": P("fsdp")},
    ),
}


@pytest.fixture(scope="module")
def single_device_losses(program):
    _, history = run_steps(program, [random_batch(20 + i) for i in range(3)])
    return [float(m["loss"]) for m in history]


# data8 and fsdp8 are slow: data2_fsdp2_tensor2_micro2 shards over data and fsdp (and tensor, with microbatches) in
# one case, and test_sharding checks the fsdp8 layout file (docs/testing.md)
@pytest.mark.parametrize(
    "name",
    [
        pytest.param("data8", marks=pytest.mark.slow),
        pytest.param("fsdp8", marks=pytest.mark.slow),
        "data2_fsdp2_tensor2_micro2",
    ],
)
def test_sharded_training_matches_single_device(name, single_device_losses):
    layout, microbatches, expected_specs = LAYOUTS[name]
    assert len(jax.devices()) == 8
    cfg = dataclasses.replace(CFG, data=dataclasses.replace(CFG.data, microbatches=microbatches))
    program = Program(cfg, build_mesh(layout))
    state, history = run_steps(program, [random_batch(20 + i) for i in range(3)])
    losses = [float(m["loss"]) for m in history]
    np.testing.assert_allclose(losses, single_device_losses, rtol=1e-4)
    assert losses[-1] != losses[0]
    embed = state.params["embed"]
    assert len(embed.sharding.device_set) == 8
    assert embed.sharding.spec == expected_specs["embed"]
    if "final_norm" in expected_specs:  # params really are sharded, not silently replicated
        assert state.params["final_norm"]["scale"].sharding.spec == expected_specs["final_norm"]
        assert not embed.sharding.is_fully_replicated
