"""Hugging Face Llama export / import, proven against transformers' own LlamaForCausalLM on random tiny models:
logits in both directions, export -> import bit for bit, the tokenizer, the CLIs, their one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx, traverse_util
from helpers import one_device_mesh, pure, rel
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from data import prepare, write_token_file
from data.text_tokenizer import byte_tokenizer, load_tokenizer
from experiments import evaluate, export_hf, import_hf
from jaxlm import config as config_lib
from jaxlm import hf
from jaxlm.checkpoint import Checkpointer
from jaxlm.config import DataConfig, ModelConfig, TrainConfig
from jaxlm.generate import generate
from jaxlm.model import Transformer
from jaxlm.train import Program

REPO = Path(__file__).resolve().parents[1]
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


# What every tiny HF model of these tests shares (test_hf_families.py's too): float32-friendly init, eager attention.
TINY_HF = dict(
    hidden_size=32,
    num_hidden_layers=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    initializer_range=0.2,
    bos_token_id=None,
    pad_token_id=None,
    attn_implementation="eager",
)


def hf_model(case: str, seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A random float32 LlamaForCausalLM with eager attention; norms random too, so their mapping is tested."""
    config = LlamaConfig(
        vocab_size=overrides.pop("vocab_size", V),
        intermediate_size=48,
        eos_token_id=overrides.pop("eos_token_id", V - 1),
        **TINY_HF,
        **CASES[case],
        **overrides,
    )
    torch.manual_seed(seed)
    return random_norms(LlamaForCausalLM(config).float().eval())


def random_norms(model):
    """``model`` with its RMSNorm scales drawn around 1 (init makes them 1, which would hide a mapping's errors)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
    return model


def hf_logits(model: LlamaForCausalLM, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


def jax_model(cfg: ModelConfig, params: dict) -> Transformer:
    """The model holding `params` (built abstractly: a random init of it takes seconds of op-by-op dispatch)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    return nnx.merge(graphdef, state)


def random_params(cfg: ModelConfig, seed: int) -> dict:
    """Random params of a jaxlm model of `cfg` (norm scales around 1)."""
    shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))))
    rng = np.random.default_rng(seed)

    def draw(path, a):
        noise = rng.standard_normal(a.shape).astype(np.float32)
        return 1 + 0.5 * noise if path[-1].key == "scale" else 0.2 * noise

    return jax.tree_util.tree_map_with_path(draw, shapes)


def fetcher(pure: dict):
    """`hf.hf_tensors`' fetch over a nested dict of params: one param, or one layer of a stacked one."""

    def fetch(path, layer):
        value = pure
        for key in path:
            value = value[key]
        value = np.asarray(value)
        return value if layer is None else value[layer]

    return fetch


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
    assert (cfg.vocab_size, cfg.tokenizer_vocab_size) == (128, V) and cfg.tie_embeddings == CASES[case][
        "tie_word_embeddings"
    ]
    params = hf.params_from_hf(cfg, V, read_checked(hf_state(model), cfg))
    x = tokens()
    ours = jax_logits(jax_model(cfg, params), x)
    theirs = hf_logits(model, x)
    assert rel(ours[..., :V], theirs) < 1e-5
    assert (ours[..., V:] <= -1e29).all()  # the padded ids (model.tokenizer_vocab_size = V): never predicted


@pytest.mark.parametrize("case", ["gqa", "llama3"])
def test_jaxlm_to_hf_logits_match_transformers(case):
    """A random jaxlm model's tensors loaded into transformers' model compute its logits."""
    template = hf_model(case)
    cfg = hf.model_config_from_hf(template.config.to_dict())
    pure = random_params(cfg, seed=3)
    model = jax_model(cfg, pure)
    tensors = dict(hf.hf_tensors(cfg, V, fetcher(pure)))
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
            tokenizer_vocab_size=257,
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
    saved, new_cfg, back = restore_imported(imported)
    assert saved[config_lib.TOKENIZER_KEY] == byte_tokenizer().describe()
    assert new_cfg.model == cfg.model and config_lib.load_config(imported / "config.json") == new_cfg
    assert_same_params_but_the_padding(params, back, 257)

    again = tmp_path / "hf_again"
    assert export_hf.main(["--workdir", str(imported), "--out", str(again), "--max-shard-mb", "0.02"]) == 0
    assert_same_tensors(out, again)
    assert "->" in capsys.readouterr().err


def restore_imported(workdir: Path) -> tuple[dict, TrainConfig, dict]:
    """(the saved config, as a dict and as a TrainConfig, and the params) of an imported workdir's step 0."""
    checkpointer = Checkpointer(workdir / "checkpoints", async_save=False, primary=False)
    saved = checkpointer.restore_config(0)
    cfg = config_lib.from_dict({k: v for k, v in saved.items() if k != config_lib.TOKENIZER_KEY})
    state, _, _ = checkpointer.restore(0, Program(cfg, one_device_mesh()).abstract_with_shardings())
    checkpointer.close()
    return saved, cfg, pure(state.params)


def assert_same_params_but_the_padding(params: dict, back: dict, vocab_size: int) -> None:
    """Every param bit for bit, the vocabulary's padding ids (past `vocab_size`) zero after an import."""
    flat_a, flat_b = traverse_util.flatten_dict(params), traverse_util.flatten_dict(back)
    assert flat_a.keys() == flat_b.keys()
    for key in flat_a:
        a, b = flat_a[key], flat_b[key]
        if key[0] in ("embed", "lm_head"):
            a, b = (a[:vocab_size], b[:vocab_size]) if key[0] == "embed" else (a[:, :vocab_size], b[:, :vocab_size])
        np.testing.assert_array_equal(a, b, err_msg=str(key))
    assert not back["embed"][vocab_size:].any()
    assert "lm_head" not in back or not back["lm_head"][:, vocab_size:].any()


def assert_same_tensors(first_dir: Path, second_dir: Path) -> None:
    """Two exports hold the same tensors, bit for bit."""
    first, second = safetensors_of(first_dir), safetensors_of(second_dir)
    assert first.keys() == second.keys()
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)


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


def bpe_tokenizer_json(path: Path, texts: list[str]) -> Path:
    """A small byte-level BPE (not the byte tokenizer: it has merges) with <|endoftext|>, as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


def test_imported_model_matches_transformers_and_fine_tunes_with_the_documented_command(tmp_path, capsys):
    """save_pretrained + a BPE tokenizer.json -> import_hf --data (token data prepared with that tokenizer) ->
    the step-0 checkpoint computes transformers' logits, `experiments.evaluate` its loss on held-out text, and
    `tiny_lm --config W/config.json --workdir W` trains it."""
    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 3 for i in range(120)]
    hf_dir = tmp_path / "hf"
    bpe_tokenizer_json(hf_dir, texts)
    tok = load_tokenizer(hf_dir)
    model = hf_model("gqa", vocab_size=tok.vocab_size, eos_token_id=tok.eos_id)
    model.save_pretrained(hf_dir)
    (tmp_path / "text").mkdir()
    for i, text in enumerate(texts):
        (tmp_path / "text" / f"{i}.txt").write_text(text)
    tokens_dir = tmp_path / "tokens"
    prepare_args = ["--input", str(tmp_path / "text"), "--output", str(tokens_dir), "--tokenizer", str(hf_dir)]
    assert prepare.main([*prepare_args, "--workers", "1", "--no-progress"]) == 0

    workdir = tmp_path / "run"
    overrides = ["data.seq_len=16", "data.batch_size=4", "data.val_fraction=0", "eval_every=0", "checkpoint_every=0"]
    argv = ["--hf", str(hf_dir), "--workdir", str(workdir), "--data", str(tokens_dir)]
    assert import_hf.main([*argv, *(a for o in overrides for a in ("--set", o))]) == 0
    assert load_tokenizer(workdir).sha256 == tok.sha256
    cfg = config_lib.load_config(workdir / "config.json")
    assert cfg.data.path == str(tokens_dir) and cfg.model.vocab_size == 384
    checkpointer = Checkpointer(workdir / "checkpoints", async_save=False, primary=False)
    assert checkpointer.restore_config(0)[config_lib.TOKENIZER_KEY] == tok.describe()
    state, _, _ = checkpointer.restore(0, Program(cfg, one_device_mesh()).abstract_with_shardings())
    checkpointer.close()
    x = np.random.default_rng(0).integers(0, tok.vocab_size, (2, T)).astype(np.int32)
    ours = jax_logits(jax_model(cfg.model, pure(state.params)), x)
    assert rel(ours[..., : tok.vocab_size], hf_logits(model, x)) < 1e-5
    _evaluate_matches_transformers_loss(workdir, model, tok, tmp_path, capsys)

    command = ["-m", "experiments.tiny_lm", "--config", workdir / "config.json", "--workdir", workdir, "--steps", 3]
    result = subprocess.run(
        [sys.executable, *map(str, command), "--no-progress"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert [r["step"] for r in records if "loss" in r][-1] == 3 and all(np.isfinite(losses))
    assert abs(losses[0] - np.log(tok.vocab_size)) < 2  # a random model over the tokenizer's ids, not over bytes
    assert (workdir / "checkpoints" / "3").is_dir()


def _evaluate_matches_transformers_loss(workdir, model, tok, tmp_path, capsys, seq_len=16):
    """`experiments.evaluate` on held-out text: the loss and bits per byte transformers gives the same windows."""
    text = "class Point:\n    def norm(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n"
    (tmp_path / "held_out.txt").write_text(text)
    argv = ["--workdir", str(workdir), "--text", str(tmp_path / "held_out.txt"), "--seq-len", str(seq_len)]
    capsys.readouterr()
    assert evaluate.main(argv) == 0
    figures = json.loads(capsys.readouterr().out.splitlines()[-1])
    stream = np.r_[tok.eos_id, tok.encode(text), tok.eos_id]
    nats = 0.0
    with torch.no_grad():
        for start in range(0, len(stream) - 1, seq_len):
            window = torch.tensor(stream[start : start + seq_len + 1])[None]
            logits = model(window[:, :-1]).logits.double()
            nats += torch.nn.functional.cross_entropy(logits[0], window[0, 1:], reduction="sum").item()
    assert figures["tokens"] == len(stream) - 1 and figures["bytes"] == len(text.encode())
    assert figures["loss"] == pytest.approx(nats / (len(stream) - 1), rel=1e-5)
    assert figures["bits_per_byte"] == pytest.approx(nats / np.log(2) / len(text.encode()), rel=1e-5)


def test_greedy_generation_equals_transformers_generate():
    """jaxlm.generate on the converted model picks transformers' greedy tokens, 40 of them, for two prompts."""
    model = hf_model("llama3", seed=5)
    cfg = hf.model_config_from_hf(model.config.to_dict())
    assert_greedy_tokens_match(model, jax_model(cfg, hf.params_from_hf(cfg, V, read_checked(hf_state(model), cfg))), 40)


def assert_greedy_tokens_match(theirs, ours, new_tokens: int) -> None:
    """jaxlm.generate (one padded batch of two prompts) picks what transformers' greedy `generate` picks."""
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43]]
    new = generate(ours, prompts, max_new_tokens=new_tokens, vocab_limit=V)
    for prompt, ids in zip(prompts, new):
        with torch.no_grad():
            out = theirs.generate(
                torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert ids.tolist() == out[0, len(prompt) :].tolist()


# ----------------------------------------------------------------------------- bad input: one line, exit 2


@pytest.fixture(scope="module")
def saved_hf(tmp_path_factory) -> Path:
    """A tiny HF model directory with the byte tokenizer, as save_pretrained + export write it."""
    directory = tmp_path_factory.mktemp("hf") / "model"
    hf_model("gqa", vocab_size=257, eos_token_id=256).save_pretrained(directory)
    byte_tokenizer().save(directory)
    return directory


def edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (directory / "config.json").write_text(json.dumps(config))


def edit_tensors(directory: Path, change) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


IMPORT_ERRORS = {
    "architecture": (
        lambda d: edit_config(d, architectures=["MistralForCausalLM"], model_type="mistral"),
        "architectures is ['MistralForCausalLM']; supported: LlamaForCausalLM, MixtralForCausalLM, Qwen3ForCausalLM, "
        "Qwen3MoeForCausalLM",
    ),
    "attention_bias": (lambda d: edit_config(d, attention_bias=True), "attention_bias is true"),
    "mlp_bias": (lambda d: edit_config(d, mlp_bias=True), "mlp_bias is true"),
    "rope_type": (
        lambda d: edit_config(d, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
        "rope_parameters.rope_type is 'yarn'; supported: 'default', 'llama3'",
    ),
    "legacy_rope_type": (
        lambda d: edit_config(d, rope_parameters=None, rope_scaling={"type": "dynamic", "factor": 2.0}),
        "rope_scaling.rope_type is 'dynamic'",
    ),
    "llama3_field": (
        lambda d: edit_config(d, rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}),
        "config.json has no rope_parameters.low_freq_factor",
    ),
    "no_config_field": (lambda d: edit_config(d, hidden_size=None), "config.json has no hidden_size"),
    "no_tokenizer": (lambda d: (d / "tokenizer.json").unlink(), "has no tokenizer.json"),
    "missing_tensor": (
        lambda d: edit_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
        "tensor model.layers.1.mlp.up_proj.weight is missing",
    ),
    "misshaped_tensor": (
        lambda d: edit_tensors(d, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((8, 32))})),
        "tensor model.layers.0.self_attn.k_proj.weight has shape [8, 32], expected [16, 32]",
    ),
    "bias_tensor": (
        lambda d: edit_tensors(d, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(32)})),
        "tensor model.layers.0.self_attn.q_proj.bias is not part of a Llama model",
    ),
    "no_weights": (lambda d: (d / "model.safetensors").unlink(), "holds no model.safetensors"),
    "jaxlm_workdir": (  # a training run's config.json: sections, not Hugging Face's hidden_size
        lambda d: (d / "config.json").write_text(json.dumps(config_lib.to_dict(TrainConfig()))) and None,
        "is a jaxlm training workdir, not a Hugging Face model: it needs no import; python -m experiments.generate",
    ),
    "jaxlm_checkpoints": (
        lambda d: ((d / "config.json").unlink(), (d / "checkpoints").mkdir()) and None,
        "is a jaxlm training workdir, not a Hugging Face model",
    ),
    "no_validation_split": (
        lambda d: ["--set", "data.val_fraction=0"],
        "eval_every 50 asks for evaluation, but data.val_fraction is 0: nothing would be evaluated",
    ),
    "shape_override": (lambda d: ["--set", "model.d_model=64"], "model.d_model comes from"),
    "other_tokenizer_data": (
        lambda d: ["--data", str(bpe_data(d.parent / "bpe_data"))],
        "was written with tokenizer",
    ),
}


def bpe_data(directory: Path) -> Path:
    """Token data written with a BPE tokenizer (not the model's byte tokenizer)."""
    texts = ["hello world, hello tokens\n" * 20] * 4
    bpe_tokenizer_json(directory / "tok", texts)
    (directory / "text.txt").parent.mkdir(exist_ok=True)
    (directory / "text.txt").write_text("".join(texts))
    out = directory / "tokens"
    argv = ["--input", str(directory / "text.txt"), "--output", str(out), "--tokenizer", str(directory / "tok")]
    assert prepare.main([*argv, "--workers", "1", "--no-progress"]) == 0
    return out


@pytest.mark.parametrize("case", IMPORT_ERRORS)
def test_import_bad_input_is_one_line_naming_it(case, saved_hf, tmp_path, capsys):
    directory = tmp_path / "model"
    shutil.copytree(saved_hf, directory)
    damage, expected = IMPORT_ERRORS[case]
    extra = damage(directory) or []
    capsys.readouterr()
    workdir = tmp_path / "run"
    assert import_hf.main(["--hf", str(directory), "--workdir", str(workdir), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("experiments.import_hf: error: "), err
    assert expected in err, err
    assert not workdir.exists() and not list(tmp_path.glob(".*"))  # nothing half-written


def test_import_refuses_a_workdir_that_is_not_empty(saved_hf, tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    assert import_hf.main(["--hf", str(saved_hf), "--workdir", str(tmp_path / "run")]) == 2
    assert "--workdir" in capsys.readouterr().err and (tmp_path / "run" / "notes.txt").read_text() == "mine"


def test_export_bad_input_is_one_line(tmp_path, capsys):
    """No checkpoint, a step that is not there, an --out that holds files: one line each, nothing written."""
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    cases = [
        (["--workdir", str(tmp_path / "nowhere")], "is not a directory"),
        (["--workdir", str(tmp_path)], "has no checkpoints/"),
        (["--workdir", str(tmp_path / "empty")], "holds no complete checkpoint"),
        (["--workdir", str(tmp_path), "--dtype", "float16"], "invalid choice: 'float16'"),
    ]
    for argv, expected in cases:
        assert export_hf.main([*argv, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("experiments.export_hf: error: ") and expected in err, err
    assert not (tmp_path / "out").exists()
    workdir, _, _ = jaxlm_workdir(tmp_path)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    for argv, expected in [(["--step", "7"], "has no step 7 (it has 0)"), (["--out", str(tmp_path / "taken")], "")]:
        assert export_hf.main(["--workdir", str(workdir), "--out", str(tmp_path / "out"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "out").exists() and (tmp_path / "taken" / "x").read_text() == "x"


def test_import_cli_bad_input_is_one_line_on_stderr_exit_2(saved_hf, tmp_path):
    """The real command, as a user runs it: one line, exit 2, no traceback or library noise."""
    directory = tmp_path / "model"
    shutil.copytree(saved_hf, directory)
    edit_config(directory, attention_bias=True)
    result = subprocess.run(
        [sys.executable, "-m", "experiments.import_hf", "--hf", str(directory), "--workdir", str(tmp_path / "w")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr == "experiments.import_hf: error: attention_bias is true; jaxlm's Llama has no biases\n"


@pytest.mark.slow
def test_two_process_export_writes_the_same_files(tmp_path):
    """Two processes x 2 devices (params FSDP-sharded over both, gathered one layer at a time, process 0 writing)
    export byte for byte what one process does. Fast cover: the 8-device export above."""
    workdir, _, _ = jaxlm_workdir(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXLM_", "SLURM_", "OMPI_"))}
    export = ["-m", "experiments.export_hf", "--workdir", workdir, "--max-shard-mb", "0.02"]
    launch = ["-m", "sharding.launch", "--processes", "2", "--cpu-devices", "2", "--", sys.executable]
    for argv in ([*launch, *export, "--out", tmp_path / "two"], [*export, "--out", tmp_path / "one"]):
        result = subprocess.run(
            [sys.executable, *map(str, argv)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr[-2000:]
    one, two = sorted((tmp_path / "one").iterdir()), sorted((tmp_path / "two").iterdir())
    assert [p.name for p in one] == [p.name for p in two] and len(one) > 5
    for a, b in zip(one, two):
        assert a.read_bytes() == b.read_bytes(), a.name
