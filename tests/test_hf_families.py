"""Mixtral, Qwen3 and Qwen3-MoE <-> jaxlm, proven against transformers' own models on random tiny ones: logits in
both directions (through the Hub's tensor names, which transformers 5 fuses on load), greedy generation, and an MoE
checkpoint through the CLIs: export, transformers' logits, import back bit for bit, evaluate, generate."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from helpers import rel
from safetensors.numpy import load_file, save_file
from test_hf import (
    TINY_HF,
    _evaluate_matches_transformers_loss,
    assert_greedy_tokens_match,
    assert_same_params_but_the_padding,
    assert_same_tensors,
    fetcher,
    hf_logits,
    jax_logits,
    jax_model,
    jaxlm_workdir,
    random_norms,
    random_params,
    restore_imported,
    tokens,
)
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from data.text_tokenizer import byte_tokenizer
from experiments import export_hf, import_hf
from experiments import generate as generate_cli
from jaxlm import hf

V = 100
SHARED = dict(
    **TINY_HF, vocab_size=V, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, eos_token_id=V - 1
)
EXPERTS = dict(num_experts_per_tok=2)
FAMILIES = {  # 4 experts, 2 per token; Qwen3's head dim 16 (not 32 / 4) as its real models' 128 is not D / H
    "mixtral": lambda: MixtralForCausalLM(
        MixtralConfig(**SHARED, **EXPERTS, intermediate_size=24, num_local_experts=4, sliding_window=None)
    ),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SHARED, intermediate_size=48, head_dim=16)),
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(
        Qwen3MoeConfig(  # experts in every second layer (model.moe_every); the top-k weights not renormalized
            **SHARED,
            **EXPERTS,
            intermediate_size=48,
            head_dim=16,
            num_experts=4,
            moe_intermediate_size=24,
            decoder_sparse_step=2,
        )
    ),
}


def hf_model(family: str, seed: int = 0):
    """A random float32 model of `family`; norms (QK-norms too) random as well."""
    torch.manual_seed(seed)
    return random_norms(FAMILIES[family]().float().eval())


def hub_tensors(model, directory) -> dict[str, np.ndarray]:
    """The model's tensors as save_pretrained writes them: under the Hub's names (its state_dict fuses experts)."""
    model.save_pretrained(directory)
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors |= load_file(str(file))
    return tensors


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    """(family, the model, its tensors as save_pretrained writes them)."""
    model = hf_model(request.param)
    return request.param, model, hub_tensors(model, tmp_path_factory.mktemp(request.param))


def test_hf_to_jaxlm_logits_match_transformers(saved):
    family, model, tensors = saved
    cfg = hf.model_config_from_hf(model.config.to_dict())
    assert hf.family_of(cfg).model_type == family and cfg.qk_norm == family.startswith("qwen3")
    if family != "qwen3":
        assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_mlp_dim) == (4, 2, 24)
        assert (cfg.router_norm_topk, cfg.moe_every) == ((True, 1) if family == "mixtral" else (False, 2))
    assert {k: v.shape for k, v in tensors.items()} == hf.hf_shapes(cfg, V)  # the Hub's names, as saved
    params = hf.params_from_hf(cfg, V, lambda name: tensors[name])
    x = tokens()
    assert rel(jax_logits(jax_model(cfg, params), x)[..., :V], hf_logits(model, x)) < 1e-5


def test_jaxlm_to_hf_logits_match_transformers(saved, tmp_path):
    """A random jaxlm model's tensors, written under the Hub's names with the exported config.json, load in
    transformers (AutoModelForCausalLM: its fusing converters) as the family's class and compute its logits."""
    family, template, _ = saved
    cfg = hf.model_config_from_hf(template.config.to_dict())
    params = random_params(cfg, seed=3)
    tensors = dict(hf.hf_tensors(cfg, V, fetcher(params)))
    assert {k: v.shape for k, v in tensors.items()} == hf.hf_shapes(cfg, V)
    config = hf.hf_config(cfg, vocab_size=V, eos_id=V - 1, bos_id=None, dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
    assert type(loaded) is type(template)
    x = tokens(seed=2)
    assert rel(hf_logits(loaded, x), jax_logits(jax_model(cfg, params), x)[..., :V]) < 1e-5


def test_greedy_generation_on_qwen3_moe_equals_transformers_generate(tmp_path):
    """jaxlm.generate's decode step routes one token at a time through the experts: the converted Qwen3-MoE picks
    transformers' greedy tokens, 24 of them, for two prompts of different lengths (a padded batch)."""
    model = hf_model("qwen3_moe", seed=5)
    cfg = hf.model_config_from_hf(model.config.to_dict())
    assert_greedy_tokens_match(
        model, jax_model(cfg, hf.params_from_hf(cfg, V, hub_tensors(model, tmp_path).__getitem__)), 24
    )


def test_refused_exports_name_the_setting():
    cfg = hf.model_config_from_hf(hf_model("mixtral").config.to_dict())
    with pytest.raises(hf.HFError, match="model.router 'sigmoid_bias' .* is not MixtralForCausalLM's"):
        hf.check_exportable(dataclasses.replace(cfg, router="sigmoid_bias"))
    with pytest.raises(hf.HFError, match="router_norm_topk is false, and Mixtral always renormalizes"):
        hf.check_exportable(dataclasses.replace(cfg, router_norm_topk=False))
    qwen = hf_model("qwen3_moe").config.to_dict()
    with pytest.raises(hf.HFError, match=r"mlp_only_layers is \[0\]: jaxlm's Qwen3-MoE places its dense layers"):
        hf.model_config_from_hf({**qwen, "mlp_only_layers": [0]})
    with pytest.raises(hf.HFError, match="model.moe_every is 2, and Mixtral has experts in every layer"):
        hf.check_exportable(dataclasses.replace(cfg, moe_every=2))
    with pytest.raises(hf.HFError, match="sliding_window is 16; jaxlm's Qwen3 attends over the whole row"):
        hf.model_config_from_hf(
            {**hf_model("qwen3").config.to_dict(), "use_sliding_window": True, "sliding_window": 16}
        )


def test_a_qwen3_moe_checkpoint_exports_imports_back_bit_for_bit_and_evaluates_and_generates(tmp_path, capsys):
    """A jaxlm MoE with QK-norm (sharded export over 8 devices) -> Qwen3MoeForCausalLM computes its logits; import
    -> the same params bit for bit; `experiments.evaluate` on the imported workdir gives transformers' loss, and
    `experiments.generate` (greedy) transformers' continuation."""
    moe = dict(num_experts=4, experts_per_token=2, expert_mlp_dim=24, qk_norm=True, router_norm_topk=False, moe_every=2)
    workdir, cfg, params = jaxlm_workdir(tmp_path, **moe)
    out = tmp_path / "hf"
    assert export_hf.main(["--workdir", str(workdir), "--out", str(out), "--max-shard-mb", "0.02"]) == 0
    theirs = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    assert type(theirs) is Qwen3MoeForCausalLM and theirs.config.norm_topk_prob is False
    assert theirs.config.decoder_sparse_step == 2 and "moe_blocks" in params  # layer 0 dense, layer 1 experts
    x = np.random.default_rng(0).integers(0, 257, (2, 32)).astype(np.int32)
    assert rel(hf_logits(theirs, x), jax_logits(jax_model(cfg.model, params), x)[..., :257]) < 1e-5

    imported = tmp_path / "imported"
    assert import_hf.main(["--hf", str(out), "--workdir", str(imported)]) == 0
    _, new_cfg, back = restore_imported(imported)
    assert new_cfg.model == cfg.model
    assert_same_params_but_the_padding(params, back, 257)
    again = tmp_path / "hf_again"
    assert export_hf.main(["--workdir", str(imported), "--out", str(again)]) == 0
    assert_same_tensors(out, again)

    tok = byte_tokenizer()
    _evaluate_matches_transformers_loss(imported, theirs, tok, tmp_path, capsys)
    prompt = "def "
    assert generate_cli.main(["--workdir", str(imported), "--prompt", prompt, "--max-new-tokens", "12",
                              "--temperature", "0"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    with torch.no_grad():
        ids = list(tok.document(prompt))
        hf_new = theirs.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_id, pad_token_id=0
        )[0, len(ids) :].tolist()
    assert text == tok.decode([t for t in hf_new if t != tok.eos_id], skip_special_tokens=True) + "\n"
