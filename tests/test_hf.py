"""Hugging Face Llama export / import, proven against transformers' own LlamaForCausalLM on random tiny models:
logits in both directions, export -> import bit for bit, the tokenizer, the CLIs, their one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx, traverse_util
from helpers import one_device_mesh, pure, rel
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from data import write_token_file
from data.text_tokenizer import byte_tokenizer
from experiments import export_hf, import_hf
from jaxlm import config as config_lib
from jaxlm import hf
from jaxlm.checkpoint import Checkpointer
from jaxlm.config import DataConfig, ModelConfig, TrainConfig
from jaxlm.model import Transformer
from jaxlm.train import Program

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


# ----------------------------------------------------------------------------- export and import through the CLIs


def byte_token_file(path, seed: int = 0, num_tokens: int = 4000):
    """Byte-level token data (the byte tokenizer's ids, EOS 256)."""
    rng = np.random.default_rng(seed)
    return write_token_file(path, [rng.integers(0, 256, num_tokens)], vocab_size=257, tokenizer="bytes", eos_id=256)


def jaxlm_workdir(tmp_path, **model) -> tuple[Path, TrainConfig, dict]:
    """A workdir holding a random step-0 checkpoint of a tiny model over byte-level data (vocabulary 384 > 257)."""
    data = byte_token_file(tmp_path / "bytes")
    cfg = TrainConfig(
        model=ModelConfig(
            vocab_size=384,
            d_model=32,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            mlp_dim=48,
            max_seq_len=64,
            tie_embeddings=False,
            **model,
        ),
        data=DataConfig(path=str(data), seq_len=32, batch_size=4),
    )
    program = Program(cfg, one_device_mesh())
    state = program.init()
    workdir = tmp_path / "run"
    checkpointer = Checkpointer(workdir / "checkpoints", async_save=False)
    checkpointer.save(0, state, {}, config_lib.to_dict(cfg))
    checkpointer.close()
    return workdir, cfg, pure(state.params)


def safetensors_of(directory: Path) -> dict[str, np.ndarray]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:
            out |= {name: f.get_tensor(name) for name in f.keys()}
    return out


def test_export_loads_in_transformers_and_imports_back_bit_for_bit(tmp_path, capsys):
    """Export (sharded: 8 devices, several safetensors files) -> AutoModelForCausalLM computes the model's logits,
    AutoTokenizer encodes like ours; import -> the same params bit for bit; export again -> the same files."""
    workdir, cfg, params = jaxlm_workdir(tmp_path, rope_scaling="llama3", rope_original_max_seq_len=16)
    out = tmp_path / "hf"
    assert export_hf.main(["--workdir", str(workdir), "--out", str(out), "--max-shard-mb", "0.02"]) == 0
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("*.safetensors"))) > 2
    assert not list(tmp_path.glob(".*tmp*"))

    theirs = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert theirs.config.vocab_size == 257 and theirs.config.rope_parameters["rope_type"] == "llama3"
    x = np.random.default_rng(0).integers(0, 257, (2, T)).astype(np.int32)
    ours = jax_logits(jax_model(cfg.model, params), x)
    assert rel(hf_logits(theirs, x), ours[..., :257]) < 1e-5

    text = "def f(x):\n    return x  # héllo 🙂"
    assert AutoTokenizer.from_pretrained(out).encode(text) == byte_tokenizer().encode(text).tolist()

    imported = tmp_path / "imported"
    assert import_hf.main(["--hf", str(out), "--workdir", str(imported)]) == 0
    checkpointer = Checkpointer(imported / "checkpoints", async_save=False, primary=False)
    saved = checkpointer.restore_config(0)
    assert saved[hf.TOKENIZER_KEY] == byte_tokenizer().describe()
    new_cfg = config_lib.from_dict({k: v for k, v in saved.items() if k != hf.TOKENIZER_KEY})
    assert new_cfg.model == cfg.model and config_lib.load_config(imported / "config.json") == new_cfg
    program = Program(new_cfg, one_device_mesh())
    state, _, _ = checkpointer.restore(0, program.abstract_with_shardings())
    checkpointer.close()
    back = pure(state.params)
    flat_a, flat_b = traverse_util.flatten_dict(params), traverse_util.flatten_dict(back)
    assert flat_a.keys() == flat_b.keys()
    for key in flat_a:
        a, b = flat_a[key], flat_b[key]
        if key[0] in ("embed", "lm_head"):  # the padded ids: zero after import
            a, b = (a[:257], b[:257]) if key[0] == "embed" else (a[:, :257], b[:, :257])
        np.testing.assert_array_equal(a, b, err_msg=str(key))
    assert not back["embed"][257:].any() and not back["lm_head"][:, 257:].any()

    again = tmp_path / "hf_again"
    assert export_hf.main(["--workdir", str(imported), "--out", str(again), "--max-shard-mb", "0.02"]) == 0
    first, second = safetensors_of(out), safetensors_of(again)
    assert first.keys() == second.keys()
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)
    assert "->" in capsys.readouterr().err


def test_bfloat16_export_is_the_rounded_float32_export(tmp_path):
    workdir, cfg, params = jaxlm_workdir(tmp_path)
    out = tmp_path / "hf"
    assert export_hf.main(["--workdir", str(workdir), "--out", str(out), "--dtype", "bfloat16"]) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    tensors = safetensors_of(out)
    assert {str(a.dtype) for a in tensors.values()} == {"bfloat16"} and not (
        out / "model.safetensors.index.json"
    ).exists()
    expected = params["blocks"]["mlp"]["w_out"][1].T.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(tensors["model.layers.1.mlp.down_proj.weight"], expected)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
