"""data.train_tokenizer: a deterministic byte-level BPE from the formats prepare reads, usable by prepare."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from data.text_tokenizer import BOS_CANDIDATES, load_tokenizer
from data.train_tokenizer import BOS, EOS, PAD, main

REPO = Path(__file__).resolve().parents[1]
WORDS = "the quick brown fox jumps over the lazy dog while the lazy cat sleeps in the warm sun".split()


def corpus(src: Path) -> Path:
    """Mixed formats: jsonl, parquet and txt with a little non-ASCII text."""
    src.mkdir(parents=True, exist_ok=True)
    lines = [" ".join(WORDS[i % 7 :] + WORDS[: i % 5]) + f" naïve café {i}" for i in range(200)]
    (src / "a.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in lines[:100]))
    pq.write_table(pa.table({"body": lines[100:150]}), src / "b.parquet", row_group_size=10)
    (src / "c.txt").write_text("\n".join(lines[150:]))
    return src


def train(capsys, *args):
    code = main([str(a) for a in args] + ["--no-progress"])
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()


def test_same_input_gives_the_same_tokenizer(tmp_path, capsys):
    src = corpus(tmp_path / "src")
    common = ["--input", src, "--pattern", "*.jsonl", "--pattern", "*.parquet", "--pattern", "*.txt"]
    common += ["--text-field", "body", "--vocab-size", 300]
    assert train(capsys, *common, "--output", tmp_path / "one")[0] == 0
    assert train(capsys, *common, "--output", tmp_path / "two/tokenizer.json")[0] == 0
    one, two = (tmp_path / "one/tokenizer.json").read_text(), (tmp_path / "two/tokenizer.json").read_text()
    assert one == two
    tok = load_tokenizer(tmp_path / "one")
    assert tok.vocab_size == 300 and tok.eos_token == EOS and tok.bos_id is None
    assert len(json.loads(one)["model"]["merges"]) == 300 - 256 - 1
    text = "the lazy café sleeps 日本 \x00 \U0001f600"  # unseen characters still encode: byte-level
    assert tok.decode(tok.encode(text)) == text and len(tok.encode("the quick brown fox")) < 19  # merges learned
    assert train(capsys, *common[:-1], 320, "--output", tmp_path / "three")[0] == 0
    assert (tmp_path / "three/tokenizer.json").read_text() != one


def test_bos_and_pad_and_prepare_uses_it(tmp_path, capsys):
    src = corpus(tmp_path / "src")
    out = tmp_path / "tok.json"
    code, stdout, _ = train(capsys, "--input", src / "c.txt", "--vocab-size", 300, "--bos", "--pad", "--output", out)
    assert code == 0 and str(out) in stdout
    tok = load_tokenizer(out, add_bos=True)
    assert (tok.eos_token, tok.bos_token, tok.hf.token_to_id(PAD)) == (EOS, BOS, 2) and BOS in BOS_CANDIDATES
    from data.prepare import main as prepare

    assert prepare(["--input", str(src / "c.txt"), "--output", str(tmp_path / "data"), "--tokenizer", str(out)]) == 0


def test_bad_input_is_one_line(tmp_path, capsys):
    src = corpus(tmp_path / "src")
    (src / "bad.jsonl").write_text('{"body": "fine"}\n{"body": 1}\n')
    cases = [
        (["--input", src / "bad.jsonl", "--text-field", "body"], f"{src / 'bad.jsonl'}: line 2: field 'body'"),
        (["--input", src / "a.jsonl"], "line 1: has no field 'text'"),
        (["--input", src / "b.parquet"], "no column 'text'"),
        (["--input", src / "nothing"], "input not found"),
        (["--input", src, "--pattern", "*.md"], "no files matching"),
        (["--input", src / "c.txt", "--vocab-size", 100], "--vocab-size 100 leaves no merge"),
        (["--input", src / "c.txt", "--min-frequency", -1], "--min-frequency must be >= 0 (a merge's least pair"),
        (["--input", src / "c.txt", "--max-mb", "inf"], "--max-mb must be a finite number > 0 (MB of text to train"),
        (["--input", src / "c.txt", "--max-mb", 0], "--max-mb must be a finite number > 0"),  # read one document
    ]
    for args, needle in cases:
        args = ["--vocab-size", 300, *args] if "--vocab-size" not in args else args
        code, _, err = train(capsys, *args, "--output", tmp_path / "out.json")
        assert code == 2 and len(err) == 1 and err[0].startswith("data.train_tokenizer: error: "), err
        assert needle in err[0], err[0]
    (src / "empty.txt").write_text("")
    code, _, err = train(capsys, "--input", src / "empty.txt", "--vocab-size", 300, "--output", tmp_path / "out.json")
    assert code == 2 and "no text" in err[0]
    assert list(tmp_path.glob("*.json*")) == []  # nothing written, not even a temp file
    (tmp_path / "out.json").write_text("mine")
    code, _, err = train(capsys, "--input", src / "c.txt", "--vocab-size", 300, "--output", tmp_path / "out.json")
    assert code == 2 and "already exists" in err[0] and (tmp_path / "out.json").read_text() == "mine"


def test_real_process(tmp_path):
    src = corpus(tmp_path / "src")
    cmd = [sys.executable, "-m", "data.train_tokenizer", "--input", str(src / "a.jsonl"), "--vocab-size", "300"]
    bad = subprocess.run([*cmd, "--output", str(tmp_path / "t.json")], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    ok = subprocess.run([*cmd, "--text-field", "body", "--output", str(tmp_path / "t.json")], cwd=REPO, text=True)
    assert ok.returncode == 0 and load_tokenizer(tmp_path / "t.json").vocab_size == 300


def test_max_mb_reads_only_the_start(tmp_path, capsys):
    src = corpus(tmp_path / "src")
    args = ["--input", src / "a.jsonl", "--text-field", "body", "--vocab-size", 300, "--output", tmp_path / "t.json"]
    code, stdout, _ = train(capsys, *args, "--max-mb", 0.001)
    assert code == 0
    chars = int(stdout.split(" on ")[1].split(" characters")[0].replace(",", ""))
    assert 1048 <= chars < 1200
