"""The model's vocabulary follows the data's tokenizer: model.vocab_size 0 -> the tokenizer's ids padded to a
multiple of 128, padded ids never predicted, and eval losses turned into bits per byte."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import random_token_file, tiny_config

from jaxlm.config import ConfigError, DataConfig, ModelConfig, TrainConfig
from jaxlm.data_metrics import bits_per_nat
from jaxlm.model import Transformer, head_logits
from jaxlm.run_data import resolve_vocab


def config_on(path, **model) -> TrainConfig:
    return TrainConfig(model=ModelConfig(**model), data=DataConfig(path=str(path)))


@pytest.mark.parametrize("ids, want", [(257, 384), (128, 128), (129, 256), (50_257, 50_304)])
def test_vocab_size_zero_follows_the_tokenizer_padded_to_128(tmp_path, ids, want):
    cfg = resolve_vocab(config_on(random_token_file(tmp_path / "t", num_tokens=300, vocab=ids)))
    assert (cfg.model.vocab_size, cfg.model.tokenizer_vocab_size) == (want, ids)
    assert resolve_vocab(cfg) == cfg  # a resolved config (a run's config.json) resolves to itself


def test_an_explicit_vocab_size_is_kept_unless_smaller_than_the_tokenizer(tmp_path):
    path = random_token_file(tmp_path / "t", num_tokens=300, vocab=300)
    assert resolve_vocab(config_on(path, vocab_size=512)).model.vocab_size == 512
    with pytest.raises(ConfigError, match="model.vocab_size 256 is smaller than the data's tokenizer's 300 ids"):
        resolve_vocab(config_on(path, vocab_size=256))


def test_a_model_of_another_tokenizer_is_refused_with_how_to_write_its_data(tmp_path):
    """An imported model's config (tokenizer_vocab_size fixed) fine-tuned on data of another tokenizer."""
    path = random_token_file(tmp_path / "t", num_tokens=300, vocab=257)
    with pytest.raises(
        ConfigError,
        match=rf"^model.tokenizer_vocab_size 4096 but the tokenizer of data.path {path} "
        r"has 257 ids: .*--tokenizer WORKDIR/tokenizer.json .*--set data.path=DIR$",
    ):
        resolve_vocab(config_on(path, tokenizer_vocab_size=4096))
    with pytest.raises(ConfigError, match=r"the tokenizer of the default corpus \(byte\) has 257 ids"):
        resolve_vocab(TrainConfig(model=ModelConfig(tokenizer_vocab_size=4096)))


def test_an_unresolved_vocabulary_cannot_build_a_model():
    with pytest.raises(ValueError, match="resolve_vocab"):
        Transformer(ModelConfig(), rngs=nnx.Rngs(0))


def test_padded_ids_get_probability_zero_and_no_gradient():
    """Uniform logits over the tokenizer's ids (a zero head): the loss is ln(tokenizer vocab), the padded ids'
    probabilities are exactly 0, and the padded rows of the head get no gradient."""
    cfg = dataclasses.replace(tiny_config().model, vocab_size=384, tokenizer_vocab_size=257, tie_embeddings=False)
    x_BTD = jax.random.normal(jax.random.key(0), (2, 5, cfg.d_model))

    def loss(head_DV):
        logits_BTV = head_logits(cfg, {"norm_scale": jnp.ones(cfg.d_model), "head_DV": head_DV}, x_BTD)
        return -jax.nn.log_softmax(logits_BTV)[..., 7].mean(), logits_BTV

    (value, logits_BTV), grad_DV = jax.value_and_grad(loss, has_aux=True)(jnp.zeros((cfg.d_model, 384)))
    np.testing.assert_allclose(value, math.log(257), rtol=1e-6)
    assert float(jax.nn.softmax(logits_BTV)[..., 257:].max()) == 0.0
    assert np.all(np.isfinite(grad_DV)) and not np.any(grad_DV[:, 257:])


def test_bits_per_byte_of_a_uniform_model_is_log2_vocab_times_tokens_per_byte():
    """A model that is uniform over V ids has eval loss ln V nats a token: log2(V) x tokens / bytes bits a byte."""
    rng = np.random.default_rng(0)
    token_bytes = rng.integers(0, 6, 300).astype(np.int32)  # special tokens stand for 0 bytes
    batches = [
        {"targets": rng.integers(0, 300, (4, 16)), "loss_mask": (rng.random((4, 16)) > 0.2).astype(np.float32)}
        for _ in range(3)
    ]
    tokens = sum(b["loss_mask"].sum() for b in batches)
    num_bytes = sum((token_bytes[b["targets"]] * b["loss_mask"]).sum() for b in batches)
    np.testing.assert_allclose(math.log(300) * bits_per_nat(batches, token_bytes), math.log2(300) * tokens / num_bytes)
    assert bits_per_nat(batches, token_bytes[:100]) is None  # ids the tokenizer lacks: no figure, not a wrong one


@pytest.mark.parametrize(
    "data, message",
    [
        (dict(corpus_tokenizer="bpe100"), "use 'byte' or 'bpe<N>' with N in \\[512, 65536\\]"),
        (dict(corpus_tokenizer="wordpiece"), "corpus tokenizer 'wordpiece'"),
        (dict(corpus_tokenizer="bpe40", path="some/tokens"), "N in"),  # unused with a path, still checked
    ],
)
def test_the_default_corpus_tokenizer_is_checked(data, message):
    from jaxlm.config import validate

    with pytest.raises(ConfigError, match=message):
        validate(TrainConfig(data=DataConfig(**data)))
