"""Trainer + Checkpointer: an interrupted run continues exactly where an uninterrupted one would have been."""

import dataclasses
import re

import pytest
from helpers import one_device_mesh, random_token_file, tiny_config

from data import SeededBatchIterator, TokenFile
from jaxlm.config import ConfigError
from jaxlm.metrics import read_metrics
from jaxlm.trainer import Trainer

K = 3  # steps before the interruption; runs go to 2K


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tokens = TokenFile.open(random_token_file(tmp_path_factory.mktemp("data") / "tokens")).tokens
    # decay_steps is explicit, so the schedule (warmup 2, then cosine) is the same for --steps K and --steps 2K.
    cfg = tiny_config(steps=2 * K, optim=dict(learning_rate=1e-2, warmup_steps=2, decay_steps=2 * K))
    return tokens, cfg, one_device_mesh()


def train(setup, workdir, *, iterator=None, **overrides):
    tokens, cfg, mesh = setup
    cfg = dataclasses.replace(cfg, **overrides)
    d = cfg.data
    batches = iterator or SeededBatchIterator(tokens, batch_size=d.batch_size, seq_len=d.seq_len, seed=cfg.seed)
    return Trainer(cfg, mesh, workdir, batches, [], progress=False).run()


def losses(workdir):
    return {r["step"]: r["loss"] for r in read_metrics(workdir / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def straight(setup, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("straight")
    train(setup, workdir)
    return workdir


def test_stop_and_continue_matches_straight_run(setup, straight, tmp_path):
    straight = losses(straight)
    assert sorted(straight) == list(range(1, 2 * K + 1))
    last = train(setup, tmp_path, steps=K)
    assert last["step"] == K
    assert losses(tmp_path) == {s: straight[s] for s in range(1, K + 1)}
    train(setup, tmp_path)  # a fresh Trainer, same workdir: resumes at K
    assert losses(tmp_path) == straight  # bit for bit
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 2 * K + 1))  # each step exactly once, in order
    # Nothing to do once the run is complete, and the record is left alone.
    assert train(setup, tmp_path) == {}
    assert losses(tmp_path) == straight


class CrashingIterator:
    """Delegates to a real iterator, then raises when asked for batch number `crash_at` (1-based)."""

    def __init__(self, inner, crash_at):
        self.inner, self.left = inner, crash_at - 1

    def __iter__(self):
        return self

    def __next__(self):
        if self.left == 0:
            raise KeyboardInterrupt("simulated crash")
        self.left -= 1
        return next(self.inner)

    def get_state(self):
        return self.inner.get_state()

    def set_state(self, state):
        self.inner.set_state(state)


def test_crash_after_an_intermediate_checkpoint_resumes_exactly(setup, straight, tmp_path):
    """Checkpoint every K steps, crash during step K+2: the rerun restarts from checkpoint K (saved while the
    loop had already prefetched batch K+1) and must still reproduce the straight run."""
    tokens, cfg, _ = setup
    straight = losses(straight)
    inner = SeededBatchIterator(tokens, batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len, seed=cfg.seed)
    with pytest.raises(KeyboardInterrupt):
        train(setup, tmp_path, checkpoint_every=K, iterator=CrashingIterator(inner, crash_at=K + 2))
    assert max(losses(tmp_path)) >= K
    train(setup, tmp_path, checkpoint_every=K)
    assert losses(tmp_path) == straight
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 2 * K + 1))


@pytest.mark.parametrize("field, value", [("d_model", 64), ("rope_theta", 500.0)])
def test_resume_with_a_different_model_config_names_the_field(setup, straight, field, value):
    """A shape change (d_model) must be reported as a config change too, not as an Orbax shape mismatch."""
    tokens, cfg, mesh = setup
    before = (straight / "metrics.jsonl").read_text()
    changed = dataclasses.replace(cfg, steps=3 * K, model=dataclasses.replace(cfg.model, **{field: value}))
    batches = SeededBatchIterator(tokens, batch_size=8, seq_len=16, seed=0)
    trainer = Trainer(changed, mesh, straight, batches, [], progress=False)
    try:
        trainer.run()
    except ConfigError as e:
        assert re.search(rf"model\.{field}: .* -> {value}", str(e)), str(e)
        if field == "d_model":  # and the first parameters whose shapes differ
            assert re.search(r"parameters: params\.\S+: saved \([\d, ]+\) float32, now \([\d, ]+\)", str(e)), str(e)
    except Exception as e:  # reported flat: pytest cannot render Orbax's deep tracebacks on Python 3.11.7
        pytest.fail(f"expected ConfigError naming model.{field}, got {type(e).__name__}: {str(e)[:300]}", pytrace=False)
    else:
        pytest.fail("resuming with a different model config did not raise")
    assert (straight / "metrics.jsonl").read_text() == before


def test_clairvoyant_loader_resumes_exactly_with_other_workers_and_cache(setup, tmp_path):
    from data.loader import ClairvoyantLoader
    from data.sources import TokenWindowSource

    tokens, cfg, _ = setup
    d = cfg.data
    source = TokenWindowSource(tokens, seq_len=d.seq_len)

    def loader(workers, ram_bytes):
        return ClairvoyantLoader(source, batch_size=d.batch_size, seed=cfg.seed, workers=workers, ram_bytes=ram_bytes)

    train(setup, tmp_path / "straight", iterator=loader(4, 1 << 20))
    train(setup, tmp_path / "resumed", iterator=loader(4, 1 << 20), steps=K)
    train(setup, tmp_path / "resumed", iterator=loader(1, 0))  # another worker count, no cache
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    records = [r for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl") if "loss" in r]
    assert all("data_stall_frac" in r and "data_hit_rate" in r for r in records)


def test_resuming_on_other_data_names_both_fingerprints_unless_allowed(setup, tmp_path, capsys):
    tokens, cfg, mesh = setup

    def run(fingerprint, steps, **data):
        run_cfg = dataclasses.replace(cfg, steps=steps, data=dataclasses.replace(cfg.data, **data))
        d = run_cfg.data
        batches = SeededBatchIterator(tokens, batch_size=d.batch_size, seq_len=d.seq_len, seed=cfg.seed)
        trainer = Trainer(run_cfg, mesh, tmp_path, batches, [], progress=False, data_fingerprint=fingerprint)
        return trainer.run()

    ours = {"tokens": 1000, "tokenizer": "bytes", "vocab_size": 257, "sample_sha256": "aaaa"}
    theirs = {**ours, "sample_sha256": "bbbb"}  # same size, other content: a rewritten data directory
    run(ours, K)
    with pytest.raises(
        ConfigError,
        match=r"trained on other data: it saw 1000 tokens, tokenizer bytes, sample sha256 "
        r"aaaa, data.path now holds 1000 tokens, tokenizer bytes, sample sha256 bbbb; .*allow_other_data",
    ):
        run(theirs, 2 * K)
    run(ours, K + 1)  # the same data continues
    capsys.readouterr()
    run(theirs, 2 * K, allow_other_data=True)  # said explicitly: continues, and the run log says so
    assert "was trained on other data (1000 tokens, tokenizer bytes, sample sha256 aaaa)" in capsys.readouterr().err


def test_fingerprint_tells_token_files_apart(tmp_path):
    import numpy as np

    from data.token_file import write_token_file

    def token_file(name, tokens):
        write_token_file(tmp_path / name, [np.asarray(tokens, np.int32)], vocab_size=300, tokenizer="bytes")
        return TokenFile.open(tmp_path / name).fingerprint()

    r = np.random.default_rng(0)
    small = r.integers(0, 256, 5000)
    assert token_file("a", small) == token_file("a2", small)
    changed = small.copy()
    changed[2500] ^= 1
    assert token_file("b", changed)["sample_sha256"] != token_file("a3", small)["sample_sha256"]  # any token, if small
    assert token_file("c", small[:-1])["tokens"] == token_file("a4", small)["tokens"] - 1
    big = r.integers(0, 256, 64 * (1 << 14) * 2)  # sampled: 64 windows
    edited = big.copy()
    edited[0] ^= 1  # the first window is always sampled
    assert token_file("d", big) != token_file("e", edited)
