"""data.prepare: every input format round-trips through tokens, shards resume byte-identically, bad input is one
line with exit 2, and training opens token shards like a token file (data.setup, data.sources)."""

import gzip
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data import prepare as prepare_mod
from data.iterator import split_train_val
from data.prepare import main, partial_dir
from data.sources import open_source
from data.text_tokenizer import load_tokenizer, tokenizer_of_data
from data.token_shards import ShardedTokens, TokenShards, open_tokens
from data.train_tokenizer import special_tokens, train

REPO = Path(__file__).resolve().parents[1]
DOCS = ["hello world", "héllo ünïcode ✓ 日本語", "tabs\tand\nnewlines\n", "  leading spaces", "x"]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A small trained byte-level BPE with BOS, saved as a tokenizer.json."""
    text = " ".join(DOCS) * 20 + " the quick brown fox jumps over the lazy dog" * 50
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train([text], vocab_size=300, specials=special_tokens(bos=True, pad=False)).save(str(path))
    return path


def run(capsys, *args):
    """main(args) -> (exit code, stdout, stderr lines); one worker (in this process) unless args say otherwise."""
    code = main(["--workers", "1", "--no-progress"] + [str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()


def decoded_documents(path) -> list[str]:
    """The documents of token data, split at EOS and decoded with its own tokenizer (BOS dropped)."""
    data, tok = open_tokens(path), tokenizer_of_data(path)
    ids = np.asarray(data.tokens[0 : data.num_tokens])
    assert ids[-1] == tok.eos_id
    docs = np.split(ids, np.flatnonzero(ids == tok.eos_id) + 1)[:-1]
    if tok.add_bos:
        assert all(d[0] == tok.bos_id for d in docs)
        docs = [d[1:] for d in docs]
    return [tok.decode(d[:-1]) for d in docs]


def write_inputs(src: Path, docs: list[str]) -> None:
    """The same documents in every format: txt files, separated txt, jsonl, jsonl.gz, json, parquet (2 row groups)."""
    src.mkdir(parents=True, exist_ok=True)
    for i, d in enumerate(docs):
        (src / f"a{i:02d}.txt").write_text(d, encoding="utf-8")
    (src / "b.sep").write_text("<DOC>".join(docs), encoding="utf-8")
    lines = "".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs))
    (src / "c.jsonl").write_text(lines, encoding="utf-8")
    with gzip.open(src / "d.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(lines)
    (src / "e.json").write_text(json.dumps([{"text": d} for d in docs]), encoding="utf-8")
    pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), src / "f.parquet", row_group_size=2)


FORMAT_PATTERNS = {"txt": "a*.txt", "sep": "b.sep", "jsonl": "c.jsonl", "gz": "d.jsonl.gz", "json": "e.json"}
FORMAT_PATTERNS["parquet"] = "f.parquet"


@pytest.mark.parametrize("fmt", FORMAT_PATTERNS)
@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_round_trip_each_format(tmp_path, capsys, bpe, fmt, tokenizer):
    write_inputs(tmp_path / "src", DOCS)
    out = tmp_path / "out"
    tok_args = ["--tokenizer", bpe, "--add-bos"] if tokenizer == "bpe" else []
    code, stdout, err = run(
        capsys, "--input", tmp_path / "src", "--pattern", FORMAT_PATTERNS[fmt], "--separator", "<DOC>",
        "--output", out, *tok_args,
    )  # fmt: skip
    assert code == 0, err
    assert decoded_documents(out) == DOCS
    meta = TokenShards.open(out).meta
    assert meta["num_documents"] == len(DOCS) and meta["skipped_empty"] == 0
    assert meta["tokenizer"]["name"] == ("byte" if tokenizer == "byte" else str(bpe))
    assert meta["dtype"] == "uint16" and f"{len(DOCS)} documents" in stdout


def test_mixed_formats_several_patterns_one_call(tmp_path, capsys, bpe):
    write_inputs(tmp_path / "src", DOCS)
    (tmp_path / "src" / "c.jsonl").write_text('{"text": ""}\n\n{"text": null}\n{"text": "last"}\n')
    code, stdout, err = run(
        capsys, "--input", tmp_path / "src", "--pattern", "*.parquet", "--pattern", "a0*.txt", "--pattern", "*.jsonl",
        "--output", tmp_path / "out", "--tokenizer", bpe, "--shard-mb", 0.00001,
    )  # fmt: skip
    assert code == 0, err
    # sorted by path: a00..a04.txt, c.jsonl, f.parquet; one shard per file or row group at this tiny --shard-mb
    assert decoded_documents(tmp_path / "out") == DOCS + ["last"] + DOCS
    meta = TokenShards.open(tmp_path / "out").meta
    assert meta["skipped_empty"] == 3 and len(meta["shards"]) == len(DOCS) + 1 + 3
    assert "skipped 3 empty" in stdout


@settings(max_examples=25, deadline=None)
@given(
    docs=st.lists(st.text(st.characters(exclude_categories=["Cs"]), min_size=1), min_size=1, max_size=8),
    shard_bytes=st.integers(8, 400),
)
def test_round_trip_property_jsonl_cut_into_ranges(docs, shard_bytes):
    """Any documents survive jsonl -> byte ranges of any size -> tokens -> decode, in order."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in.jsonl"
        src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
        args = ["--input", str(src), "--output", f"{tmp}/out", "--shard-mb", str(shard_bytes / 2**20), "--workers", "1"]
        assert main(args) == 0
        assert decoded_documents(f"{tmp}/out") == docs


def test_uint32_for_a_large_vocabulary(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2} | {f"w{i}": i for i in range(3, 70_000)}, "w3"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.add_special_tokens(["<|endoftext|>"])
    tok_path = tmp_path / "big.json"
    words.save(str(tok_path))
    (tmp_path / "a.txt").write_text("a b c")
    assert run(capsys, "--input", tmp_path / "a.txt", "--output", tmp_path / "out", "--tokenizer", tok_path)[0] == 0
    assert TokenShards.open(tmp_path / "out").meta["dtype"] == "uint32"
    assert decoded_documents(tmp_path / "out") == ["a b c"]


def test_records_its_tokenizer(tmp_path, capsys, bpe):
    write_inputs(tmp_path / "src", DOCS)
    out = tmp_path / "out"
    assert run(capsys, "--input", tmp_path / "src", "--output", out, "--tokenizer", bpe.parent, "--add-bos")[0] == 0
    meta, tok = TokenShards.open(out).meta, load_tokenizer(bpe, add_bos=True)
    assert meta["tokenizer"] == tok.describe() and (out / "tokenizer.json").read_text() == tok.json
    assert (meta["eos_id"], meta["bos_id"], meta["add_bos"]) == (tok.eos_id, tok.bos_id, True)
    assert tokenizer_of_data(out).sha256 == tok.sha256
    assert open_tokens(out).fingerprint()["tokenizer"] == tok.sha256
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "tokenizer.json", "tokens-00000.bin"]


def test_end_to_end_in_a_real_process(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "b.txt").write_text("bravo")
    (src / "sub" / "a.txt").write_text("alpha")
    (src / "skip.md").write_text("not matched")
    (src / "latin1.txt").write_bytes(b"caf\xe9")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "data.prepare", "--input", str(src), "--output", str(out), "--utf8-errors", "replace"]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "3 documents" in result.stdout and str(out) in result.stdout
    assert decoded_documents(out) == ["bravo", "caf\ufffd", "alpha"]  # sorted: b.txt, latin1.txt, sub/a.txt


# --- shards, workers, resume ----------------------------------------------------------------------------------


def big_inputs(src: Path, files: int = 6, docs_per_file: int = 40) -> None:
    src.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "eta", "θeta", "\n"]
    for f in range(files):
        with open(src / f"part{f}.jsonl", "w", encoding="utf-8") as out:
            for _ in range(docs_per_file):
                out.write(json.dumps({"text": " ".join(rng.choice(words, rng.integers(1, 200)))}) + "\n")


def shard_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_workers_give_identical_shards(tmp_path, capsys, bpe):
    big_inputs(tmp_path / "src")
    common = ["--input", tmp_path / "src", "--pattern", "*.jsonl", "--tokenizer", bpe, "--shard-mb", 0.01]
    assert run(capsys, *common, "--output", tmp_path / "one", "--workers", 1)[0] == 0
    assert run(capsys, *common, "--output", tmp_path / "two", "--workers", 2)[0] == 0
    assert len(TokenShards.open(tmp_path / "one").meta["shards"]) > 4
    assert shard_bytes(tmp_path / "one") == shard_bytes(tmp_path / "two")


def test_interrupted_prepare_resumes_byte_identical(tmp_path, capsys, bpe, monkeypatch):
    big_inputs(tmp_path / "src")
    common = ["--input", tmp_path / "src", "--pattern", "*.jsonl", "--tokenizer", bpe, "--shard-mb", 0.01]
    assert run(capsys, *common, "--output", tmp_path / "clean")[0] == 0
    clean = shard_bytes(tmp_path / "clean")

    real, calls = prepare_mod.tokenize_unit, []

    def killed_at_unit_3(unit, directory):
        calls.append(unit.index)
        if unit.index == 3:
            (Path(directory) / "tokens-00003.bin.tmp").write_bytes(b"half a shard")
            raise KeyboardInterrupt
        return real(unit, directory)

    out = tmp_path / "out"
    monkeypatch.setattr(prepare_mod, "tokenize_unit", killed_at_unit_3)
    code, _, err = run(capsys, *common, "--output", out)
    assert code == 130 and "rerun the same command" in err[-1] and not out.exists()
    assert (partial_dir(out) / "tokens-00002.json").exists() and not (partial_dir(out) / "manifest.json").exists()
    (partial_dir(out) / "tokens-00001.bin").write_bytes(b"damaged")  # a shard that no longer matches its stats

    monkeypatch.setattr(prepare_mod, "tokenize_unit", lambda u, d: calls.append(u.index) or real(u, d))
    calls.clear()
    code, _, err = run(capsys, *common, "--output", out)
    assert code == 0 and "resuming: 2 of" in err[0]  # units 0 and 2 kept; 1 (damaged) and 3 (half written) redone
    assert calls[:2] == [1, 3] and 0 not in calls and 2 not in calls
    assert shard_bytes(out) == clean and not partial_dir(out).exists()


def test_rerun_with_other_options_does_not_mix(tmp_path, capsys, bpe, monkeypatch):
    big_inputs(tmp_path / "src")
    common = ["--input", tmp_path / "src", "--pattern", "*.jsonl", "--shard-mb", 0.01]

    def interrupted(unit, directory):
        if unit.index == 2:
            raise KeyboardInterrupt
        return real(unit, directory)

    real = prepare_mod.tokenize_unit
    monkeypatch.setattr(prepare_mod, "tokenize_unit", interrupted)
    assert run(capsys, *common, "--output", tmp_path / "out")[0] == 130  # byte tokenizer, shards 0-1 done
    monkeypatch.setattr(prepare_mod, "tokenize_unit", real)
    code, _, err = run(capsys, *common, "--output", tmp_path / "out", "--tokenizer", bpe)
    assert code == 0 and "discarding unfinished shards" in err[0]
    assert run(capsys, *common, "--output", tmp_path / "clean", "--tokenizer", bpe)[0] == 0
    assert shard_bytes(tmp_path / "out") == shard_bytes(tmp_path / "clean")


def test_killed_process_resumes_byte_identical(tmp_path, capsys, bpe):
    """A real SIGKILL mid-run (after its first shard completed), then the same command again."""
    big_inputs(tmp_path / "src", files=12, docs_per_file=80)
    args = ["--input", tmp_path / "src", "--pattern", "*.jsonl", "--tokenizer", bpe, "--shard-mb", 0.01]
    args = [str(a) for a in args] + ["--workers", "1"]
    cmd = [sys.executable, "-m", "data.prepare", *args, "--output", str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = partial_dir(tmp_path / "out") / "tokens-00000.json"
    deadline = time.monotonic() + 60
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "prepare finished before it could be killed"
    assert not (tmp_path / "out").exists()
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "resuming:" in again.stderr, again.stderr
    assert run(capsys, *args, "--output", tmp_path / "clean")[0] == 0
    assert shard_bytes(tmp_path / "out") == shard_bytes(tmp_path / "clean")


# --- bad input: one line, exit 2, nothing half-written --------------------------------------------------------


def nothing_left(tmp_path, out):
    assert not out.exists() and not partial_dir(out).exists(), list(tmp_path.iterdir())


def one_error(err, *needles):
    assert len(err) == 1 and err[0].startswith("data.prepare: error: "), err
    for needle in needles:
        assert str(needle) in err[0], err[0]


def test_jsonl_line_not_json_or_without_field(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "ok"}\n{"text": "fine"}\nnot json\n{"body": "x"}\n{"text": 3}\n["a list"]\n')
    out = tmp_path / "out"
    code, _, err = run(capsys, "--input", src, "--output", out)
    assert code == 2
    one_error(err, f"{src}: line 3: not JSON", "--skip-bad")
    nothing_left(tmp_path, out)
    src.write_text('{"text": "ok"}\n{"body": "x"}\n')
    code, _, err = run(capsys, "--input", src, "--output", out)
    one_error(err, f"{src}: line 2: has no field 'text'")
    code, _, err = run(capsys, "--input", src, "--output", out, "--text-field", "body")
    one_error(err, f"{src}: line 1: has no field 'body'")
    src.write_text('{"text": "ok"}\nnot json\n{"body": "x"}\n{"text": 3}\n["a list"]\n{"text": "end"}\n')
    code, stdout, err = run(capsys, "--input", src, "--output", out, "--skip-bad")
    assert code == 0 and "4 bad" in stdout and decoded_documents(out) == ["ok", "end"]
    assert TokenShards.open(out).meta["skipped_bad"] == 4


def test_error_line_numbers_in_a_jsonl_cut_into_ranges(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(500)) + "{oops\n")
    code, _, err = run(capsys, "--input", src, "--output", tmp_path / "out", "--shard-mb", 0.001)
    assert code == 2
    one_error(err, f"{src}: line 501: not JSON")


def test_json_array_and_gzip_errors(tmp_path, capsys):
    (tmp_path / "a.json").write_text('[{"text": "a"}, {"txt": "b"}]')
    code, _, err = run(capsys, "--input", tmp_path / "a.json", "--output", tmp_path / "out")
    one_error(err, f"{tmp_path / 'a.json'}: element 1: has no field 'text'")
    (tmp_path / "b.json").write_text('{"text": "not an array"}')
    code, _, err = run(capsys, "--input", tmp_path / "b.json", "--output", tmp_path / "out")
    one_error(err, "must be an array")
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n{"text": "b"}\n')[:-12])
    code, _, err = run(capsys, "--input", tmp_path / "c.jsonl.gz", "--output", tmp_path / "out")
    assert code == 2
    one_error(err, tmp_path / "c.jsonl.gz")
    nothing_left(tmp_path, tmp_path / "out")


def test_undecodable_bytes_named_or_replaced(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("fine")
    (tmp_path / "b.txt").write_bytes(b"caf\xe9 au lait")
    out = tmp_path / "out"
    code, _, err = run(capsys, "--input", tmp_path, "--output", out)
    assert code == 2
    one_error(err, f"{tmp_path / 'b.txt'}: byte offset 3", "--utf8-errors replace")
    nothing_left(tmp_path, out)
    (tmp_path / "c.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "bad \xff"}\n')
    code, _, err = run(capsys, "--input", tmp_path / "c.jsonl", "--output", out)
    one_error(err, f"{tmp_path / 'c.jsonl'}: line 2 (byte 14 of the line)")
    code, _, err = run(capsys, "--input", tmp_path, "--pattern", "*.txt", "--output", out, "--utf8-errors", "replace")
    assert code == 0 and decoded_documents(out) == ["fine", "caf\ufffd au lait"]
    assert TokenShards.open(out).meta["replaced_utf8_documents"] == 1


def test_tokenizer_that_does_not_load(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("text")
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    for spec, needle in ((tmp_path, "does not load"), (tmp_path / "nope.json", "no such file")):
        code, _, err = run(capsys, "--input", tmp_path / "a.txt", "--output", tmp_path / "out", "--tokenizer", spec)
        assert code == 2
        one_error(err, needle)
    nothing_left(tmp_path, tmp_path / "out")


def test_parquet_without_the_column_or_damaged(tmp_path, capsys):
    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "a.parquet")
    code, _, err = run(capsys, "--input", tmp_path / "a.parquet", "--output", tmp_path / "out")
    assert code == 2
    one_error(err, f"{tmp_path / 'a.parquet'}: parquet file has no column 'text'", "body")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "b.parquet")
    one_error(run(capsys, "--input", tmp_path / "b.parquet", "--output", tmp_path / "out")[2], "not text")
    pq.write_table(pa.table({"text": [f"hello {i}" * 50 for i in range(2000)]}), tmp_path / "c.parquet")
    damaged = bytearray((tmp_path / "c.parquet").read_bytes())
    damaged[200:2000] = bytes(b ^ 0x5A for b in damaged[200:2000])  # a data page; the footer intact
    (tmp_path / "c.parquet").write_bytes(damaged)
    one_error(
        run(capsys, "--input", tmp_path / "c.parquet", "--output", tmp_path / "out")[2], "row group 0 does not read"
    )
    (tmp_path / "d.parquet").write_bytes(damaged[:100])
    one_error(run(capsys, "--input", tmp_path / "d.parquet", "--output", tmp_path / "out")[2], "not a readable parquet")
    nothing_left(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("problem", ["all_empty", "empty_dir", "missing", "no_match"])
def test_empty_input(tmp_path, capsys, problem):
    src = tmp_path / "src"
    src.mkdir()
    if problem == "all_empty":
        (src / "a.txt").write_text("")
        (src / "b.jsonl").write_text('{"text": ""}\n\n')
    if problem == "no_match":
        (src / "a.md").write_text("not matched by *.txt")
    target = src / "nothing" if problem == "missing" else src
    code, _, err = run(capsys, "--input", target, "--pattern", "*.txt", "--pattern", "*.jsonl", "--output", src / "o")
    assert code == 2
    one_error(err, "no non-empty document (3 empty)" if problem == "all_empty" else target)
    nothing_left(tmp_path, src / "o")


def test_output_rules(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("alpha")
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    code, _, err = run(capsys, "--input", tmp_path / "a.txt", "--output", out, "--overwrite")
    one_error(err, out, "not empty and is not a token dataset")
    assert [p.name for p in out.iterdir()] == ["precious.txt"] and not partial_dir(out).exists()
    out = tmp_path / "data"
    assert run(capsys, "--input", tmp_path / "a.txt", "--output", out)[0] == 0
    one_error(run(capsys, "--input", tmp_path / "a.txt", "--output", out)[2], "already exists", "--overwrite")
    (tmp_path / "a.txt").write_text("beta")
    assert run(capsys, "--input", tmp_path / "a.txt", "--output", out, "--overwrite")[0] == 0
    assert decoded_documents(out) == ["beta"]
    (out / "notes.txt").write_text("mine")
    code, _, err = run(capsys, "--input", tmp_path / "a.txt", "--output", out, "--overwrite")
    one_error(err, "holds files that are not part of the token dataset (notes.txt)")
    assert (out / "notes.txt").read_text() == "mine" and decoded_documents(out) == ["beta"]


def test_shard_size_must_be_finite(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("alpha")
    code, _, err = run(capsys, "--input", tmp_path / "a.txt", "--output", tmp_path / "o", "--shard-mb", "inf")
    assert code == 2  # int(inf) raised OverflowError
    one_error(err, "--shard-mb must be a finite number > 0 (input MB per shard), got inf")


def test_a_data_path_of_text_says_how_to_prepare_it(tmp_path):
    """data.path at the text itself (not what data.prepare made of it): the command that prepares it, writing
    beside it (never inside, where the next prepare would read the dataset as text)."""
    from data.setup import data_vocab_size
    from data.token_file import TokenFileError
    from jaxlm.config import DataConfig

    (tmp_path / "text" / "sub").mkdir(parents=True)
    (tmp_path / "text" / "a.txt").write_text("alpha")
    with pytest.raises(TokenFileError) as caught:
        data_vocab_size(DataConfig(path=str(tmp_path / "text")))
    out = tmp_path / "text-tokens"
    assert str(caught.value) == (
        f"data.path {tmp_path}/text holds text files (*.txt), not a token dataset; prepare it first: python -m "
        f"data.prepare --input {tmp_path}/text --output {out}, then --set data.path={out}"
    )
    (tmp_path / "text" / "sub" / "b.jsonl").write_text('{"text": "beta"}\n')
    with pytest.raises(TokenFileError, match=r"\(\*.txt, \*.jsonl\).* --pattern '\*.txt' --pattern '\*.jsonl', then"):
        data_vocab_size(DataConfig(path=str(tmp_path / "text")))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "tokens.bin").write_bytes(b"")  # no text: the token file's own complaint stays
    with pytest.raises(TokenFileError, match=r"^token file .*other: missing meta.json$"):
        data_vocab_size(DataConfig(path=str(tmp_path / "other")))


def test_bad_input_in_a_real_process(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "a"}\n{"text": "b"\n')
    result = subprocess.run(
        [sys.executable, "-m", "data.prepare", "--input", str(src), "--output", str(tmp_path / "out")],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"data.prepare: error: {src}: line 2: not JSON (Expecting ',' delimiter); pass --skip-bad to skip such lines"
    ]
    nothing_left(tmp_path, tmp_path / "out")


# --- reading token shards -------------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=6), data=st.data())
def test_sharded_tokens_index_like_their_concatenation(lengths, data):
    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(len(lengths))
        parts = [rng.integers(0, 1000, n).astype(np.uint16) for n in lengths]
        maps = []
        for i, part in enumerate(parts):
            part.tofile(f"{tmp}/{i}.bin")
            maps.append(np.memmap(f"{tmp}/{i}.bin", np.uint16, "r", shape=(len(part),)))
        whole, sharded = np.concatenate(parts), ShardedTokens(maps)
        n = len(whole)
        assert len(sharded) == n and sharded.dtype == whole.dtype and sharded.ndim == 1
        a = data.draw(st.integers(-n - 2, n + 2))
        b = data.draw(st.integers(-n - 2, n + 2))
        np.testing.assert_array_equal(sharded[a:b], whole[a:b])
        index = np.asarray(data.draw(st.lists(st.integers(0, n - 1), min_size=0, max_size=12)), np.int64)
        np.testing.assert_array_equal(sharded[index.reshape(-1, 1)], whole[index.reshape(-1, 1)])
        i = data.draw(st.integers(-n, n - 1))
        assert sharded[i] == whole[i]
        with pytest.raises(IndexError):
            sharded[np.array([n])]


def test_training_reads_token_shards(tmp_path, capsys, bpe):
    from data.setup import data_fingerprint, open_data
    from jaxlm.config import DataConfig

    big_inputs(tmp_path / "src")
    out = tmp_path / "out"
    args = ["--input", tmp_path / "src", "--pattern", "*.jsonl", "--tokenizer", bpe, "--shard-mb", 0.01]
    assert run(capsys, *args, "--output", out)[0] == 0
    data = open_tokens(out)
    whole = np.concatenate([np.fromfile(out / s["name"], np.uint16) for s in data.meta["shards"]])
    assert isinstance(data.tokens, ShardedTokens) and len(data.meta["shards"]) > 3
    seq_len = 64
    for loader in ("simple", "clairvoyant"):
        d = DataConfig(path=str(out), seq_len=seq_len, batch_size=4, val_fraction=0.1, eval_batches=2, loader=loader)
        train_iter, evals = open_data(d, vocab_size=300, seed=0, document_mask="document")
        (_, val_lo), _ = split_train_val(len(whole), 0.1, seq_len)
        for batches, first in (([next(train_iter) for _ in range(3)], 0), (evals, val_lo)):
            windows = {tuple(whole[s : s + seq_len + 1]) for s in range(first, len(whole) - seq_len, seq_len)}
            for batch in batches:  # windows of the shards' concatenation, as cut from a single token file
                for row_in, row_out in zip(batch["inputs"], batch["targets"]):
                    assert (*row_in, row_out[-1]) in windows
        if hasattr(train_iter, "close"):
            train_iter.close()
    assert data_fingerprint(d) == data.fingerprint()
    assert open_source(out, seq_len).read([0])[0].tolist() == whole[: seq_len + 1].tolist()
    with pytest.raises(ValueError, match="raise model.vocab_size"):
        open_data(d, vocab_size=100, seed=0)


def test_token_shards_checked_at_open(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("alpha beta")
    out = tmp_path / "out"
    assert run(capsys, "--input", tmp_path / "a.txt", "--output", out)[0] == 0
    shard = out / "tokens-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ValueError, match="shard tokens-00000.bin truncated"):
        open_tokens(out)
    shard.unlink()
    with pytest.raises(ValueError, match="missing shard tokens-00000.bin"):
        open_tokens(out)
