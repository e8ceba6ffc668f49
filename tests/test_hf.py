"""Hugging Face Llama export / import, proven against transformers' own LlamaForCausalLM on random tiny models:
logits in both directions, export -> import bit for bit, the tokenizer, the CLIs, their one-line errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flax import nnx
from helpers import rel
from transformers import LlamaConfig, LlamaForCausalLM

from jaxlm import hf
from jaxlm.config import ModelConfig
from jaxlm.model import Transformer

V = 100  # the HF models' (tokenizer's) vocabulary: jaxlm pads it to 128
T = 32
CASES = {
    # GQA (2 query heads per kv head), untied head
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    # tied embeddings, one kv head for all queries
    "tied_mqa": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    # head_dim 16 with d_model 32 and 4 heads (32 / 4 = 8)
    "head_dim": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    # Llama 3.1's RoPE scaling, its ramp between 4 and 16 positions: the frequencies fall in all three regions
    "llama3": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=500.0,
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
}


def hf_model(case: str, seed: int = 0) -> LlamaForCausalLM:
    """A random float32 LlamaForCausalLM with eager attention; norms random too, so their mapping is tested."""
    config = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=V - 1,
        pad_token_id=None,
        attn_implementation="eager",
        **CASES[case],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
    return model


def hf_logits(model: LlamaForCausalLM, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


def jax_model(cfg: ModelConfig, params: dict) -> Transformer:
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return model


def jax_logits(model: Transformer, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(model(tokens))


def hf_state(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def tokens(seed: int = 1, batch: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, (batch, T)).astype(np.int32)


def read_checked(state: dict, cfg: ModelConfig):
    shapes = hf.hf_shapes(cfg, V)

    def read(name):
        assert state[name].shape == shapes[name], name
        return state[name]

    return read


@pytest.mark.parametrize("case", CASES)
def test_hf_to_jaxlm_logits_match_transformers(case):
    model = hf_model(case)
    cfg = hf.model_config_from_hf(model.config.to_dict())
    assert cfg.vocab_size == 128 and cfg.tie_embeddings == CASES[case]["tie_word_embeddings"]
    params = hf.params_from_hf(cfg, V, read_checked(hf_state(model), cfg))
    x = tokens()
    ours = jax_logits(jax_model(cfg, params), x)
    theirs = hf_logits(model, x)
    assert rel(ours[..., :V], theirs) < 1e-5
    assert not ours[..., V:].any()  # zero rows for the padded ids: logit 0, never the argmax of a trained model


@pytest.mark.parametrize("case", ["gqa", "llama3"])
def test_jaxlm_to_hf_logits_match_transformers(case):
    """A random jaxlm model's tensors loaded into transformers' model compute its logits."""
    template = hf_model(case)
    cfg = hf.model_config_from_hf(template.config.to_dict())
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    pure = nnx.to_pure_dict(nnx.state(model))

    def fetch(path, layer):
        value = pure
        for key in path:
            value = value[key]
        value = np.asarray(value)
        return value if layer is None else value[layer]

    tensors = dict(hf.hf_tensors(cfg, V, fetch))
    assert {k: v.shape for k, v in tensors.items()} == hf.hf_shapes(cfg, V)
    missing, unexpected = template.load_state_dict({k: torch.tensor(v) for k, v in tensors.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: transformers ties it to the embedding
    x = tokens(seed=2)
    assert rel(hf_logits(template, x), jax_logits(model, x)[..., :V]) < 1e-5
