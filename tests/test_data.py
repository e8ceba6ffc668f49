"""Tests for data/: token files, default corpus, prepare CLI, seeded iterator."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data import (
    BYTE_TOKENIZER_VOCAB_SIZE,
    EOS_ID,
    BatchIterator,
    SeededBatchIterator,
    TokenFile,
    TokenFileError,
    decode,
    default_corpus,
    encode,
    eval_batches,
    segment_ids,
    split_train_val,
    write_token_file,
)

REPO = Path(__file__).resolve().parents[1]
DOCS = ["hello world", "héllo ünïcode ✓", ""]


def make_file(tmp_path, docs=DOCS, name="tf"):
    return write_token_file(tmp_path / name, (encode(d) for d in docs), vocab_size=BYTE_TOKENIZER_VOCAB_SIZE)


# --- tokenizer and token file ---------------------------------------------------------------


def test_tokenizer_roundtrip():
    ids = encode("abc é")
    assert ids.dtype == np.uint16 and EOS_ID not in ids
    assert decode(ids) == "abc é"
    assert decode(np.concatenate([encode("a"), [EOS_ID], encode("b"), [300]])) == "a\n\nb"
    assert decode([0xFF]) == "\ufffd"


def test_token_file_roundtrip(tmp_path):
    tf = TokenFile.open(make_file(tmp_path))
    expected = np.concatenate([np.append(encode(d), EOS_ID) for d in DOCS])
    np.testing.assert_array_equal(tf.tokens, expected)
    assert tf.num_tokens == len(expected) and tf.vocab_size == BYTE_TOKENIZER_VOCAB_SIZE
    assert tf.meta["num_documents"] == 3 and tf.meta["dtype"] == "uint16" and tf.meta["max_token_id"] == EOS_ID
    assert not tf.tokens.flags.writeable
    assert TokenFile.open(tf.path / "meta.json").num_tokens == tf.num_tokens
    assert decode(tf.tokens) == "\n\n".join(DOCS) + "\n\n"


def test_large_vocab_uses_uint32(tmp_path):
    path = write_token_file(tmp_path / "big", [np.array([70_000, 1])], vocab_size=100_000, eos_id=0)
    tf = TokenFile.open(path)
    assert tf.meta["dtype"] == "uint32" and list(tf.tokens) == [70_000, 1, 0]


def test_truncated_tokens_bin(tmp_path):
    path = make_file(tmp_path)
    data = (path / "tokens.bin").read_bytes()
    (path / "tokens.bin").write_bytes(data[:-4])
    with pytest.raises(TokenFileError, match="truncated: meta.json says .* tokens .* but tokens.bin has"):
        TokenFile.open(path)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: (p / "meta.json").unlink(), "missing meta.json"),
        (lambda p: (p / "meta.json").write_text("{not json"), "not valid JSON"),
        (lambda p: (p / "tokens.bin").unlink(), "missing tokens.bin"),
        (lambda p: _edit_meta(p, format="other"), "format is 'other'"),
        (lambda p: _edit_meta(p, dtype="float32"), "unknown dtype 'float32'"),
        (lambda p: _edit_meta(p, max_token_id=900), "max_token_id 900 >= vocab_size"),
        (lambda p: (_edit_meta(p, num_tokens=0), (p / "tokens.bin").write_bytes(b"")), r"empty \(0 tokens\)"),
        (lambda p: [f.unlink() for f in p.iterdir()], "empty directory: a token file is a directory with tokens.bin"),
        (lambda p: ((p / "tokens.bin").unlink(), (p / "tokens.bin").mkdir()), "tokens.bin is not a file"),
    ],
)
def test_open_reports_problems(tmp_path, damage, message):
    path = make_file(tmp_path)
    damage(path)
    with pytest.raises(TokenFileError, match=message) as err:
        TokenFile.open(path)
    assert str(err.value).startswith(f"token file {path}: ") and "\n" not in str(err.value)


def test_open_missing_dir(tmp_path):
    with pytest.raises(TokenFileError, match="does not exist"):
        TokenFile.open(tmp_path / "nope")


def _edit_meta(path, **changes):
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, **changes}))


def test_ids_beyond_vocab_rejected(tmp_path):
    with pytest.raises(TokenFileError, match="token id 300 outside"):
        write_token_file(tmp_path / "bad", [np.array([1, 300])], vocab_size=BYTE_TOKENIZER_VOCAB_SIZE)
    assert not (tmp_path / "bad").exists()
    tf = TokenFile.open(make_file(tmp_path))
    assert tf.validate_ids(257, deep=True) == EOS_ID
    with pytest.raises(TokenFileError, match="does not fit model vocab_size 200"):
        tf.validate_ids(200)
    # a meta.json that understates the ids is caught only by the deep scan
    _edit_meta(tf.path, max_token_id=10)
    tf = TokenFile.open(tf.path)
    tf.validate_ids(200)
    with pytest.raises(TokenFileError, match="holds token id 256"):
        tf.validate_ids(200, deep=True, chunk_size=4)


def test_deep_id_scan_can_be_bounded_to_a_sample(tmp_path):
    """max_chunks scans that many chunks spread over the file: a lie everywhere is caught, one bad id may not be."""
    path = write_token_file(tmp_path / "tf", [np.arange(99) % 50], vocab_size=64, eos_id=63)  # 100 tokens
    _edit_meta(path, max_token_id=10)
    with pytest.raises(TokenFileError, match="holds token id 39 but meta.json says max_token_id 10"):
        TokenFile.open(path).validate_ids(64, deep=True, chunk_size=10, max_chunks=3)  # chunks 0, 3, 6: ids <= 39
    tokens = np.zeros(100, np.uint16)
    tokens[95] = 60  # in chunk 9, which the 3-chunk sample skips
    tokens.tofile(path / "tokens.bin")
    assert TokenFile.open(path).validate_ids(64, deep=True, chunk_size=10, max_chunks=3) == 10
    with pytest.raises(TokenFileError, match="holds token id 60"):
        TokenFile.open(path).validate_ids(64, deep=True, chunk_size=10)


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    def documents():
        yield encode("first")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        write_token_file(tmp_path / "out", documents(), vocab_size=BYTE_TOKENIZER_VOCAB_SIZE)
    assert list(tmp_path.iterdir()) == []


def test_overwrite_rules(tmp_path):
    path = make_file(tmp_path)
    with pytest.raises(TokenFileError, match="already exists"):
        make_file(tmp_path)
    write_token_file(path, [encode("new")], vocab_size=257, overwrite=True)
    assert decode(TokenFile.open(path).tokens) == "new\n\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tf"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "precious.txt").write_text("keep me")
    with pytest.raises(TokenFileError, match="not a token file; refusing"):
        write_token_file(tmp_path / "other", [encode("x")], vocab_size=257, overwrite=True)
    assert (tmp_path / "other" / "precious.txt").read_text() == "keep me"


# --- default corpus (data.prepare: tests/test_prepare.py) ----------------------------------------


def test_default_corpus(tmp_path):
    path = default_corpus(cache_dir=tmp_path)
    tf = TokenFile.open(path)
    assert tf.num_tokens > 1_000_000 and tf.meta["num_documents"] > 100
    assert f"{sys.version_info[0]}.{sys.version_info[1]}" in path.name
    assert "def " in decode(tf.tokens[:200_000])
    assert default_corpus(cache_dir=tmp_path) == path  # cached: same file, no rebuild
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_default_corpus_concurrent_builds(tmp_path):
    code = "import sys; from data import default_corpus; print(default_corpus(sys.argv[1]))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(4)
    ]
    outputs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outputs]
    assert len({out for out, _ in outputs}) == 1
    assert TokenFile.open(outputs[0][0].strip()).num_tokens > 1_000_000
    assert [p.name for p in tmp_path.iterdir()] == [Path(outputs[0][0].strip()).name]  # no temp dirs left


# --- iterator --------------------------------------------------------------------------------


def take(it, n):
    return [next(it) for _ in range(n)]


def test_batches_shapes_and_shift():
    tokens = np.arange(1000, dtype=np.uint16)
    it = SeededBatchIterator(tokens, batch_size=4, seq_len=8, seed=0)
    assert isinstance(it, BatchIterator)
    batch = next(it)
    assert batch["inputs"].shape == batch["targets"].shape == (4, 8)
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32 and batch["loss_mask"].dtype == np.float32
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    np.testing.assert_array_equal(batch["targets"], batch["inputs"] + 1)  # arange: shift by one token
    assert (batch["inputs"][:, 0] % 8 == 0).all()  # window starts on the seq_len grid


def test_segment_ids_follow_eos():
    """An EOS ends its document: it shares the segment of the tokens before it; the next token starts a new one."""
    eos = 9
    tokens = np.array([1, 2, eos, 3, eos, eos, 4, 5, 6, eos, 7, 8, 1, 2, 3, 4, 5], np.uint16)
    it = SeededBatchIterator(tokens, batch_size=2, seq_len=8, seed=0, eos_id=eos)
    batch = next(it)
    for inputs, seg in zip(batch["inputs"], batch["segment_ids"]):
        assert seg.dtype == np.int32 and seg[0] == 0
        want = np.concatenate([[0], np.cumsum(inputs[:-1] == eos)])
        np.testing.assert_array_equal(seg, want)
    assert segment_ids(np.array([[1, eos, 2, eos, eos, 3]]), eos).tolist() == [[0, 0, 1, 1, 2, 3]]
    assert "segment_ids" not in next(SeededBatchIterator(tokens, batch_size=2, seq_len=8, seed=0))
    val = eval_batches(tokens, batch_size=2, seq_len=8, start=0, stop=len(tokens), max_batches=1, eos_id=eos)
    assert val[0]["segment_ids"].shape == (2, 8)


def test_determinism_and_seeds():
    tokens = np.arange(5000, dtype=np.uint16) % 257
    make = lambda seed: SeededBatchIterator(tokens, batch_size=4, seq_len=16, seed=seed)
    for a, b in zip(take(make(1), 20), take(make(1), 20)):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert any((a["inputs"] != b["inputs"]).any() for a, b in zip(take(make(1), 5), take(make(2), 5)))


def test_each_window_once_per_epoch():
    seq_len, batch_size = 4, 3
    tokens = np.arange(4 * 11 + 1)  # 11 windows -> 3 batches per epoch, 2 windows dropped
    it = SeededBatchIterator(tokens, batch_size=batch_size, seq_len=seq_len, seed=7, start=0)
    for epoch in range(3):
        starts = np.concatenate([b["inputs"][:, 0] for b in take(it, 3)]) // seq_len
        assert len(set(starts)) == 9 and set(starts) <= set(range(11))
        assert it.get_state() == {"seed": 7, "epoch": epoch + 1, "batch_in_epoch": 0}


def test_region_offsets():
    tokens = np.arange(100)
    it = SeededBatchIterator(tokens, batch_size=2, seq_len=5, seed=0, start=40, stop=61)
    for batch in take(it, 10):
        assert batch["inputs"].min() >= 40 and batch["targets"].max() <= 60
        assert ((batch["inputs"][:, 0] - 40) % 5 == 0).all()


@settings(max_examples=40, deadline=None)
@given(seq_len=st.integers(1, 9), batch_size=st.integers(1, 6), steps=st.integers(0, 30), seed=st.integers(0, 2**31))
def test_resume_matches_uninterrupted(seq_len, batch_size, steps, seed):
    tokens = (np.arange(300) * 7 % 257).astype(np.uint16)
    make = lambda: SeededBatchIterator(tokens, batch_size=batch_size, seq_len=seq_len, seed=seed)
    original = make()
    take(original, steps)
    state = json.loads(json.dumps(original.get_state()))  # survives a checkpoint as plain ints
    resumed = make()
    resumed.set_state(state)
    for a, b in zip(take(original, 5), take(resumed, 5)):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_set_state_rejects_other_seed():
    it = SeededBatchIterator(np.arange(200), batch_size=2, seq_len=4, seed=1)
    with pytest.raises(ValueError, match="seed 2"):
        it.set_state({"seed": 2, "epoch": 0, "batch_in_epoch": 0})
    with pytest.raises(ValueError, match="out of range"):
        it.set_state({"seed": 1, "epoch": 0, "batch_in_epoch": 10_000})


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_streams_concatenate_to_global(process_count):
    tokens = np.arange(2000)
    kwargs = dict(batch_size=8, seq_len=10, seed=3)
    full = take(SeededBatchIterator(tokens, **kwargs), 30)
    parts = [
        take(SeededBatchIterator(tokens, process_index=p, process_count=process_count, **kwargs), 30)
        for p in range(process_count)
    ]
    for step, batch in enumerate(full):
        np.testing.assert_array_equal(batch["inputs"], np.concatenate([part[step]["inputs"] for part in parts]))
    with pytest.raises(ValueError, match="not divisible by process_count=3"):
        SeededBatchIterator(tokens, process_count=3, **kwargs)


def test_iterator_too_small():
    with pytest.raises(ValueError, match="hold 2 windows of seq_len=10, fewer than batch_size=4"):
        SeededBatchIterator(np.arange(25), batch_size=4, seq_len=10, seed=0)


def test_split_train_val():
    (t0, t1), (v0, v1) = split_train_val(1000, 0.1, 16)
    assert (t0, t1, v0, v1) == (0, 900, 900, 1000)
    assert split_train_val(1000, 0.0, 16) == ((0, 1000), (1000, 1000))
    with pytest.raises(ValueError, match="10 validation tokens, fewer than one window of seq_len\\+1=65"):
        split_train_val(1000, 0.01, 64)
    with pytest.raises(ValueError, match="fewer than one window"):
        split_train_val(50, 0.0, 64)
    with pytest.raises(ValueError, match="val_fraction must be"):
        split_train_val(1000, 1.0, 16)


def test_eval_batches():
    tokens = np.arange(1000)
    batches = eval_batches(tokens, batch_size=2, seq_len=10, start=900, stop=1000, max_batches=100)
    assert len(batches) == 4  # 9 windows -> 4 full batches
    starts = np.concatenate([b["inputs"][:, 0] for b in batches])
    np.testing.assert_array_equal(starts, 900 + 10 * np.arange(8))
    assert len(eval_batches(tokens, batch_size=2, seq_len=10, start=900, stop=1000, max_batches=2)) == 2
    with pytest.raises(ValueError, match="fewer than batch_size"):
        eval_batches(tokens, batch_size=2, seq_len=10, start=990, stop=1000, max_batches=1)


def test_iterator_on_default_corpus(tmp_path):
    tf = TokenFile.open(default_corpus(cache_dir=tmp_path))
    train, val = split_train_val(tf.num_tokens, 0.01, 128)
    it = SeededBatchIterator(tf.tokens, batch_size=8, seq_len=128, seed=0, start=train[0], stop=train[1])
    batch = next(it)
    assert batch["inputs"].max() <= EOS_ID
    assert eval_batches(tf.tokens, batch_size=8, seq_len=128, start=val[0], stop=val[1], max_batches=3)
