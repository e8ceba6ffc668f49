"""Mixtral <-> jaxlm MoE, proven against transformers' own MixtralForCausalLM on random tiny models: logits in both
directions (through the Hub's tensor names, which transformers 5 fuses on load), and a Mixtral export that loads."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from helpers import rel
from safetensors.numpy import load_file, save_file
from test_hf import fetcher, hf_logits, jax_logits, jax_model, random_norms, random_params, tokens
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

from jaxlm import hf

V = 100


def mixtral(seed: int = 0) -> MixtralForCausalLM:
    """A random float32 Mixtral: 4 experts, 2 per token, GQA; norms random too."""
    config = MixtralConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        sliding_window=None,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=V - 1,
        pad_token_id=None,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return random_norms(MixtralForCausalLM(config).float().eval())


@pytest.fixture(scope="module")
def saved_mixtral(tmp_path_factory):
    """(the model, its directory as save_pretrained writes it, its tensors by file name)."""
    model = mixtral()
    directory = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(directory)
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors |= load_file(str(file))
    return model, directory, tensors


def test_mixtral_to_jaxlm_logits_match_transformers(saved_mixtral):
    model, _, tensors = saved_mixtral
    cfg = hf.model_config_from_hf(model.config.to_dict())
    assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_mlp_dim, cfg.router) == (4, 2, 24, "softmax")
    assert {k: v.shape for k, v in tensors.items()} == hf.hf_shapes(cfg, V)  # the Hub's names, as saved
    params = hf.params_from_hf(cfg, V, lambda name: tensors[name])
    x = tokens()
    ours = jax_logits(jax_model(cfg, params), x)
    assert rel(ours[..., :V], hf_logits(model, x)) < 1e-5


def test_jaxlm_moe_to_mixtral_logits_match_transformers(saved_mixtral, tmp_path):
    """A random jaxlm MoE's tensors, written under the Hub's names with the exported config.json, load in
    transformers (AutoModelForCausalLM: its fusing converters) and compute the model's logits."""
    template, _, _ = saved_mixtral
    cfg = hf.model_config_from_hf(template.config.to_dict())
    pure = random_params(cfg, seed=3)
    tensors = dict(hf.hf_tensors(cfg, V, fetcher(pure)))
    assert {k: v.shape for k, v in tensors.items()} == hf.hf_shapes(cfg, V)
    config = hf.hf_config(cfg, vocab_size=V, eos_id=V - 1, bos_id=None, dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
    assert type(loaded).__name__ == "MixtralForCausalLM"
    x = tokens(seed=2)
    assert rel(hf_logits(loaded, x), jax_logits(jax_model(cfg, pure), x)[..., :V]) < 1e-5


def test_a_router_mixtral_does_not_have_is_refused_on_export():
    cfg = hf.model_config_from_hf(mixtral().config.to_dict())
    with pytest.raises(hf.HFError, match="model.router 'sigmoid_bias' .* is not Mixtral's"):
        hf.check_exportable(dataclasses.replace(cfg, router="sigmoid_bias"))
