"""Scoring held-out text (jaxlm.evaluate, python -m experiments.evaluate): every target scored once, the loss equal
to a plain per-window computation, bits per byte over the text's own UTF-8 bytes, and careless input refused."""

import json
import math
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import VOCAB, tiny_model, tiny_run_sets
from hypothesis import given, settings
from hypothesis import strategies as st

from data import prepare, train_tokenizer
from data.iterator import segment_ids
from experiments import evaluate as evaluate_cli
from experiments import tiny_lm
from jaxlm.evaluate import batches, score, text_stream
from jaxlm.inference import load_model
from jaxlm.model import Transformer

HELD_OUT = Path(json.__file__).read_text()[:3000]  # text the model below never trained on (63 windows of 48)


@settings(max_examples=60, deadline=None)
@given(num_tokens=st.integers(0, 80), seq_len=st.integers(1, 12), batch_size=st.integers(1, 5))
def test_every_target_is_scored_once_in_order(num_tokens, seq_len, batch_size):
    stream = np.arange(num_tokens) + 1000
    rows = list(batches(stream, seq_len, batch_size, pad_id=-1))
    targets = np.concatenate([b["targets"][b["loss_mask"] > 0] for b in rows]) if rows else np.zeros(0)
    assert targets.tolist() == stream[1:].tolist()
    for b in rows:
        assert b["inputs"].shape == b["targets"].shape == b["loss_mask"].shape == (batch_size, seq_len)
        scored = b["loss_mask"] > 0
        assert (b["targets"][scored] - b["inputs"][scored] == 1).all()  # each target after its own context


def _plain_nats(model, stream, seq_len, eos_id=None):
    """The summed loss window by window, each unpadded on its own, in float64."""
    nats, count = 0.0, 0
    for start in range(0, len(stream) - 1, seq_len):
        window = np.asarray(stream[start : start + seq_len + 1])
        inputs = window[None, :-1]
        seg = None if eos_id is None else segment_ids(inputs, eos_id)
        logits = np.asarray(model(inputs, segment_ids_BT=seg), np.float64)[0]
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        nats -= logp[np.arange(len(window) - 1), window[1:]].sum()
        count += len(window) - 1
    return nats, count


@pytest.mark.parametrize("mask", ["causal", "causal & document"])
def test_the_loss_equals_a_plain_sum_over_windows(mask):
    model = Transformer(tiny_model(attention_mask=mask), rngs=nnx.Rngs(0))
    eos = VOCAB - 1
    stream = np.random.default_rng(0).integers(0, VOCAB - 1, 61)
    stream[[0, 9, 25, 26, 40]] = eos  # documents shorter and longer than a window
    token_bytes = np.r_[np.arange(VOCAB - 1) % 3 + 1, 0]  # made-up byte counts; EOS stands for none
    got = score(model, stream, token_bytes, seq_len=16, batch_size=3, pad_id=eos)
    nats, count = _plain_nats(model, stream, 16, eos if mask != "causal" else None)
    assert got.tokens == count == 60
    assert got.nats == pytest.approx(nats, rel=1e-5)
    assert got.bytes == token_bytes[stream[1:]].sum()
    assert got.bits_per_byte == pytest.approx(nats / math.log(2) / got.bytes, rel=1e-5)
    assert got.perplexity == pytest.approx(math.exp(nats / 60), rel=1e-5)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A two-step tiny_lm run on byte-level token data, trained in this process as a user would from the CLI."""
    root = tmp_path_factory.mktemp("evaluate")
    (root / "text").mkdir()
    (root / "text" / "train.txt").write_text(Path(textwrap.__file__).read_text())
    assert prepare.main(["--input", str(root / "text"), "--output", str(root / "tokens"), "--no-progress"]) == 0
    sets = tiny_run_sets(
        data__path=root / "tokens",
        data__batch_size=8,  # one row per simulated device: this process trains on 8
        data__val_fraction=0.05,
        tensorboard="false",
    )
    assert tiny_lm.main(["--workdir", str(root / "run"), "--steps", "2", "--no-progress", *sets]) == 0
    return root


def cli(capsys, *args):
    code = evaluate_cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_text_is_scored_with_the_models_tokenizer_and_bytes(run, tmp_path, capsys):
    held_out = tmp_path / "held_out.txt"
    held_out.write_text(HELD_OUT)
    code, out, err = cli(capsys, "--workdir", run / "run", "--text", held_out, "--seq-len", 48)
    assert code == 0, err
    line, record = out.splitlines()
    assert line.startswith("experiments.evaluate: checkpoint step 2 of ")
    figures = json.loads(record)
    assert figures["tokens"] == len(HELD_OUT.encode()) + 1  # byte-level: every byte, then the document's EOS
    assert figures["bytes"] == len(HELD_OUT.encode())
    loaded = load_model(run / "run")
    stream = text_stream(loaded.tokenizer, [HELD_OUT])
    nats, count = _plain_nats(loaded.model, stream, 48)
    assert figures["loss"] == pytest.approx(nats / count, rel=1e-5)
    assert figures["bits_per_byte"] == pytest.approx(nats / math.log(2) / figures["bytes"], rel=1e-5)


def test_token_data_of_the_models_tokenizer_is_scored_and_another_is_refused(run, tmp_path, capsys):
    code, out, err = cli(capsys, "--workdir", run / "run", "--data", run / "tokens", "--max-tokens", 500)
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["tokens"] == 499
    bpe = tmp_path / "bpe.json"
    args = ["--input", run / "text", "--output", bpe, "--vocab-size", 300, "--no-progress"]
    assert train_tokenizer.main([str(a) for a in args]) == 0
    args = ["--input", str(run / "text"), "--output", str(tmp_path / "bpe_tokens"), "--tokenizer", str(bpe)]
    assert prepare.main([*args, "--no-progress"]) == 0
    capsys.readouterr()
    code, out, err = cli(capsys, "--workdir", run / "run", "--data", tmp_path / "bpe_tokens")
    assert code == 2 and not out
    assert err.count("\n") == 1 and "was written with tokenizer" in err and "data.prepare --tokenizer" in err


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "one of the arguments --text --data is required"),
        (["--text", "T", "--data", "T"], "not allowed with argument"),
        (["--text", "NOPE"], "input not found: "),
        (["--text", "EMPTY"], "--text holds no text to score"),
        (["--text", "T", "--seq-len", "65"], "--seq-len 65 is longer than the model's max_seq_len 64"),
        (["--text", "T", "--max-tokens", "1"], "--max-tokens 1 leaves nothing to score"),
        (["--text", "T", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--text", "T", "--step", "7"], "has no checkpoint at step 7; its steps: 2"),
        (["--text", "T", "--mesh", "TENSOR8"], "model.num_heads = 4 is not divisible by mesh axis 'tensor' = 8"),
        (["--data", "TEXT_DIR"], "holds text files (*.txt), not token data; score them with --text "),
    ],
)
def test_careless_input_is_one_line_and_exit_2(run, tmp_path, capsys, args, message):
    (tmp_path / "T.txt").write_text("def f():\n    return 1\n")
    (tmp_path / "EMPTY.txt").write_text("")
    (tmp_path / "tensor8.py").write_text("layout = dict(tensor=8)\n")
    (tmp_path / "text_dir").mkdir()
    (tmp_path / "text_dir" / "a.txt").write_text("def f():\n    return 1\n")
    names = {"T": "T.txt", "EMPTY": "EMPTY.txt", "NOPE": "NOPE", "TENSOR8": "tensor8.py", "TEXT_DIR": "text_dir"}
    paths = {key: tmp_path / name for key, name in names.items()}
    code, out, err = cli(capsys, "--workdir", run / "run", *[paths.get(a, a) for a in args])
    assert code == 2 and not out
    assert err.count("\n") == 1 and err.startswith("experiments.evaluate: error: ") and message in err, err


def test_a_sharded_model_scores_as_one_device(run, tmp_path, capsys):
    """Params placed on a data x tensor mesh by the layout's rules: the same figures as on one device."""
    held_out = tmp_path / "held_out.txt"
    held_out.write_text(HELD_OUT)
    mesh = tmp_path / "mesh.py"
    mesh.write_text("layout = dict(data=4, tensor=2)\n")
    figures = []
    for extra in ([], ["--mesh", mesh]):
        code, out, err = cli(capsys, "--workdir", run / "run", "--text", held_out, *extra)
        assert code == 0, err
        figures.append(json.loads(out.splitlines()[-1]))
    assert figures[1]["tokens"] == figures[0]["tokens"]
    assert figures[1]["loss"] == pytest.approx(figures[0]["loss"], rel=1e-5)
    assert jax.device_count() == 8
