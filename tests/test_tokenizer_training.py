"""Training on your own tokenizer through the CLI: BPE token shards as data.path, the vocabulary following the
tokenizer, bits per byte, and a resumed run refusing data written with another tokenizer."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data.text_tokenizer import load_tokenizer
from data.train_tokenizer import special_tokens, train

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
TINY = [
    *("--set", "model.d_model=32", "--set", "model.num_layers=1", "--set", "model.mlp_dim=64"),
    *("--set", "model.max_seq_len=32", "--set", "data.seq_len=32", "--set", "data.batch_size=4"),
    *("--set", "data.microbatches=1", "--set", "eval_every=0", "--set", "data.eval_batches=2"),
    *("--set", "eval_prompts="),  # the final eval's loss, no samples
    *("--set", "tensorboard=false", "--no-progress"),
]


def python(*args):
    return subprocess.run([sys.executable, "-m", *map(str, args)], cwd=REPO, env=ENV, capture_output=True, text=True)


def test_bpe_shards_end_to_end_and_another_tokenizer_refused_on_resume(tmp_path):
    stdlib = Path(json.__file__).parent  # real text: the json package's source
    text = "\n".join(p.read_text() for p in sorted(stdlib.glob("*.py")))
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text(text * 3)
    for name, corpus in (("tok_a", [text]), ("tok_b", [text[::-1]])):  # same size, other merges
        train(corpus, vocab_size=300, specials=special_tokens(bos=False, pad=False)).save(
            str(tmp_path / f"{name}.json")
        )
    prepare = ["data.prepare", "--input", tmp_path / "text", "--output", tmp_path / "tokens", "--no-progress"]
    assert python(*prepare, "--tokenizer", tmp_path / "tok_a.json").returncode == 0

    run = ["experiments.tiny_lm", "--workdir", tmp_path / "run", *TINY, "--set", f"data.path={tmp_path / 'tokens'}"]
    proc = python(*run, "--steps", 2)
    assert proc.returncode == 0, proc.stderr
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (saved["model"]["vocab_size"], saved["model"]["tokenizer_vocab_size"]) == (384, 300)
    tok = load_tokenizer(tmp_path / "tok_a.json")
    assert load_tokenizer(tmp_path / "run").sha256 == tok.sha256  # the workdir keeps the run's tokenizer
    record = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    tokens_per_byte = record["eval_bits_per_byte"] * np.log(2) / record["eval_loss"]
    assert 0.2 < tokens_per_byte < 0.95  # BPE merges bytes: fewer tokens than bytes

    # The same text prepared again, same path, with another tokenizer of the same size: the ids mean other text.
    assert python(*prepare, "--tokenizer", tmp_path / "tok_b.json", "--overwrite").returncode == 0
    for extra in ((), ("--set", "data.allow_other_data=true")):  # allowing other data does not allow this
        proc = python(*run, "--steps", 3, *extra)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert (
            "was trained with tokenizer" in lines[0] and "prepare the data with the checkpoint's tokenizer" in lines[0]
        )


@pytest.mark.slow  # ~50 s; test_bpe_shards_end_to_end... covers the same path through the CLI
def test_compare_tokenizers_quick(tmp_path, capsys):
    from experiments import compare_tokenizers

    assert compare_tokenizers.main(["--quick", "--workdir", str(tmp_path)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["bpe_vocab"] == 512 and summary["byte_steps"] == 8 and 1 <= summary["bpe_steps"] <= 8
    assert 0 < summary["bpe_bits_per_byte"] < summary["byte_bits_per_byte"] <= 8.1  # uniform bytes: log2 257
