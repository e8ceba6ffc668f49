"""Tests for data/sources.py: window sources, shard datasets, the throttled store, open_source."""

import json
import os
import pickle
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data.iterator import _gather, num_windows
from data.sources import (
    SampleIndexError,
    SampleSource,
    ShardedSource,
    SourceError,
    ThrottledSource,
    TokenWindowSource,
    open_source,
    write_shards,
)
from data.token_file import TokenFile, write_token_file


def random_tokens(n, dtype=np.uint16, seed=0):
    return np.random.default_rng(seed).integers(0, np.iinfo(dtype).max, n).astype(dtype)


def window_source(num_samples, sample_len, dtype=np.uint16, seed=0):
    seq_len = sample_len - 1
    return TokenWindowSource(random_tokens(num_samples * seq_len + 1, dtype, seed), seq_len=seq_len)


class ArraySource:
    """Samples straight from a [N, S] array: lets sample_len be 1, which windows cannot."""

    def __init__(self, samples_NS):
        self.samples_NS = samples_NS
        self.num_samples, self.sample_len = samples_NS.shape
        self.dtype = samples_NS.dtype

    @property
    def sample_nbytes(self):
        return self.sample_len * self.dtype.itemsize

    def read(self, indices):
        return self.samples_NS[np.asarray(indices, np.int64)]


def make_shards(tmp_path, num_samples=23, samples_per_shard=5, sample_len=9, dtype=np.uint16, name="shards"):
    source = window_source(num_samples, sample_len, dtype)
    return source, write_shards(tmp_path / name, source, samples_per_shard=samples_per_shard)


# --- TokenWindowSource -----------------------------------------------------------------------


def test_windows_match_iterator():
    tokens = random_tokens(1000)
    seq_len, start, stop = 7, 13, 900
    src = TokenWindowSource(tokens, seq_len=seq_len, start=start, stop=stop)
    assert isinstance(src, SampleSource)
    assert src.num_samples == num_windows(start, stop, seq_len) == 126
    assert src.sample_len == 8 and src.dtype == np.uint16 and src.sample_nbytes == 16
    ids = np.random.default_rng(1).integers(0, src.num_samples, 50)
    got = src.read(ids)
    batch = _gather(tokens, ids, start, seq_len, eos_id=None)
    np.testing.assert_array_equal(got[:, :-1], batch["inputs"])
    np.testing.assert_array_equal(got[:, 1:], batch["targets"])
    for i, row in zip(ids, got):
        np.testing.assert_array_equal(row, tokens[start + i * seq_len : start + i * seq_len + seq_len + 1])
    assert got.dtype == np.uint16 and src.read([]).shape == (0, 8)


def test_windows_over_token_file_are_fresh_arrays(tmp_path):
    path = write_token_file(tmp_path / "tf", [random_tokens(100) % 257], vocab_size=257)
    tokens = TokenFile.open(path).tokens
    src = TokenWindowSource(tokens, seq_len=10)
    out = src.read([0, 9, 0])
    assert type(out) is np.ndarray and out.flags.writeable and not np.shares_memory(out, tokens)
    np.testing.assert_array_equal(out[0], tokens[:11])
    np.testing.assert_array_equal(out[1], tokens[90:101])
    np.testing.assert_array_equal(out[2], out[0])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(seq_len=0), "seq_len must be an integer >= 1"),
        (dict(seq_len=4, start=5, stop=3), "need 0 <= start <= stop"),
        (dict(seq_len=4, stop=11), "need 0 <= start <= stop"),
        (dict(seq_len=10), "hold no window"),
        (dict(seq_len=2, start=8), "hold no window"),
    ],
)
def test_window_source_validation(kwargs, message):
    with pytest.raises(SourceError, match=message):
        TokenWindowSource(np.arange(10, dtype=np.uint16), **kwargs)
    with pytest.raises(SourceError, match="1-D integer"):
        TokenWindowSource(np.zeros((3, 3), np.uint16), seq_len=1)


def test_out_of_range_indices(tmp_path):
    window, path = make_shards(tmp_path)
    for src in (window, ShardedSource.open(path)):
        for bad in (-1, 23, 1000):
            with pytest.raises(SampleIndexError, match=rf"index {bad}\b.*num_samples=23") as err:
                src.read([0, bad])
            assert isinstance(err.value, IndexError) and isinstance(err.value, SourceError)
        with pytest.raises(SourceError, match="1-D integer"):
            src.read([[0, 1]])
        with pytest.raises(SourceError, match="1-D integer"):
            src.read([0.5])


# --- write_shards / ShardedSource ------------------------------------------------------------


def test_shard_round_trip(tmp_path):
    source, path = make_shards(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest == {
        "format": "jaxlm-shards",
        "version": 1,
        "num_samples": 23,
        "sample_len": 9,
        "dtype": "uint16",
        "samples_per_shard": 5,
        "shards": [
            {"name": f"shard-{i:05d}.bin", "num_samples": n, "bytes": n * 18} for i, n in enumerate([5, 5, 5, 5, 3])
        ],
    }
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json"] + [f"shard-{i:05d}.bin" for i in range(5)]
    assert [p.name for p in tmp_path.iterdir()] == ["shards"]  # no temp dirs left
    with ShardedSource.open(path) as src:
        assert isinstance(src, SampleSource) and src.path == path
        assert (src.num_samples, src.sample_len, src.dtype, src.sample_nbytes) == (23, 9, np.uint16, 18)
        every = np.arange(23)
        np.testing.assert_array_equal(src.read(every), source.read(every))
        ids = [22, 4, 5, 5, 4, 0, 22, 21, 20, 9, 10, 14, 15, 3]  # duplicates, boundaries, last partial shard
        out = src.read(ids)
        assert out.shape == (14, 9) and out.dtype == np.uint16
        np.testing.assert_array_equal(out, source.read(ids))
        assert src.read(np.array([], np.int64)).shape == (0, 9)
        assert not np.shares_memory(src.read([1, 1])[0], src.read([1, 1])[1])
        np.testing.assert_array_equal(pickle.loads(pickle.dumps(src)).read(ids), out)


def test_uint32_and_unit_samples(tmp_path):
    samples_NS = np.random.default_rng(0).integers(0, 2**32, (7, 1), dtype=np.uint64).astype(np.uint32)
    path = write_shards(tmp_path / "u32", ArraySource(samples_NS), samples_per_shard=3)
    src = ShardedSource(path)
    assert src.dtype == np.uint32 and json.loads((path / "manifest.json").read_text())["dtype"] == "uint32"
    np.testing.assert_array_equal(src.read([6, 0, 3, 6]), samples_NS[[6, 0, 3, 6]])


@settings(max_examples=25, deadline=None)
@given(
    num_samples=st.integers(1, 40),
    samples_per_shard=st.integers(1, 12),
    sample_len=st.integers(2, 9),
    seed=st.integers(0, 2**16),
)
def test_shard_round_trip_property(num_samples, samples_per_shard, sample_len, seed):
    source = window_source(num_samples, sample_len, seed=seed)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, num_samples, rng.integers(0, 3 * num_samples))
    with tempfile.TemporaryDirectory() as tmp:
        path = write_shards(Path(tmp) / "ds", source, samples_per_shard=samples_per_shard)
        with ShardedSource(path) as src:
            assert src.num_samples == num_samples and src.sample_len == sample_len
            assert len(src.manifest["shards"]) == -(-num_samples // samples_per_shard)
            np.testing.assert_array_equal(src.read(ids), source.read(ids))
            np.testing.assert_array_equal(src.read(np.arange(num_samples)), source.read(np.arange(num_samples)))


def test_shards_read_concurrently(tmp_path):
    source, path = make_shards(tmp_path, num_samples=200, samples_per_shard=7, sample_len=17)
    expected = source.read(np.arange(200))
    src = ShardedSource(path)  # fresh: the threads race to open the shard files lazily
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(40):
                ids = rng.integers(0, 200, rng.integers(1, 30))
                np.testing.assert_array_equal(src.read(ids), expected[ids])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def _rewrite_manifest(path, **changes):
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, **changes}))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: (p / "shard-00002.bin").unlink(), r"shard-00002\.bin: shard is missing"),
        (
            lambda p: (p / "shard-00004.bin").write_bytes(b"\0" * 50),
            r"shard-00004\.bin: shard truncated: expected 54 bytes, found 50 bytes",
        ),
        (lambda p: (p / "shard-00000.bin").write_bytes(b"\0" * 100), r"shard-00000\.bin: shard size mismatch"),
        (lambda p: (p / "manifest.json").write_text("{not json"), "manifest.json is not valid JSON"),
        (lambda p: (p / "manifest.json").unlink(), "missing manifest.json"),
        (lambda p: _rewrite_manifest(p, format="jaxlm-tokens"), "format is 'jaxlm-tokens'"),
        (lambda p: _rewrite_manifest(p, version=2), "unsupported version 2"),
        (lambda p: _rewrite_manifest(p, dtype="float32"), "unknown dtype 'float32'"),
        (lambda p: _rewrite_manifest(p, sample_len=0), "'sample_len' must be an integer >= 1"),
        (lambda p: _rewrite_manifest(p, num_samples=24), "shard 4 is .*num_samples=4"),
        (lambda p: _rewrite_manifest(p, num_samples=30), "lists 5 shards, expected 6"),
        (
            lambda p: _rewrite_manifest(p, shards=[{"name": "../x.bin", "num_samples": 5, "bytes": 90}] * 5),
            "shard 0 is .* plain file name",
        ),
        (lambda p: _rewrite_manifest(p, num_samples=0, shards=[]), "empty shard dataset"),
    ],
)
def test_open_reports_problems(tmp_path, damage, message):
    _, path = make_shards(tmp_path)
    damage(path)
    with pytest.raises(SourceError, match=message) as err:
        ShardedSource.open(path)
    assert str(path) in str(err.value)


def test_open_missing_path(tmp_path):
    with pytest.raises(SourceError, match="does not exist"):
        ShardedSource.open(tmp_path / "nope")


@pytest.mark.parametrize("opened_first", [False, True])
def test_shard_damaged_after_open(tmp_path, opened_first):
    _, path = make_shards(tmp_path)
    src = ShardedSource.open(path)
    if opened_first:
        src.read([0, 5, 22])  # shard files now held open
    shard = path / "shard-00001.bin"
    os.truncate(shard, 20)
    for ids in ([9], [5]):  # past the new end, and a sample that still fits: the shard is bad either way
        with pytest.raises(SourceError, match=rf"{shard}: shard truncated: expected 90 bytes, found 20 bytes"):
            src.read(ids)
    src.read([0, 22])  # other shards are still fine
    (path / "shard-00004.bin").unlink()
    with pytest.raises(SourceError, match=r"shard-00004\.bin: shard is missing"):
        src.read([21])


def test_failed_write_leaves_nothing(tmp_path):
    class Broken(ArraySource):
        def read(self, indices):
            if np.max(indices) >= 10:
                raise RuntimeError("killed mid-write")
            return super().read(indices)

    with pytest.raises(RuntimeError):
        write_shards(tmp_path / "out", Broken(np.zeros((20, 3), np.uint16)), samples_per_shard=4)
    assert list(tmp_path.iterdir()) == []


def test_write_validation(tmp_path):
    source = ArraySource(np.zeros((4, 3), np.uint16))
    with pytest.raises(SourceError, match="samples_per_shard must be"):
        write_shards(tmp_path / "a", source, samples_per_shard=0)
    with pytest.raises(SourceError, match="uint16 or uint32"):
        write_shards(tmp_path / "a", ArraySource(np.zeros((4, 3), np.int64)), samples_per_shard=2)
    with pytest.raises(SourceError, match="nothing to write"):
        write_shards(tmp_path / "a", ArraySource(np.zeros((0, 3), np.uint16)), samples_per_shard=2)
    (tmp_path / "file").write_text("x")
    with pytest.raises(SourceError, match="not a directory"):
        write_shards(tmp_path / "file", source, samples_per_shard=2)
    (tmp_path / "empty").mkdir()
    assert ShardedSource(write_shards(tmp_path / "empty", source, samples_per_shard=2)).num_samples == 4


def test_overwrite_rules(tmp_path):
    _, path = make_shards(tmp_path)
    with pytest.raises(SourceError, match="already exists"):
        make_shards(tmp_path)
    new = ArraySource(np.arange(12, dtype=np.uint16).reshape(4, 3))
    write_shards(path, new, samples_per_shard=3, overwrite=True)
    np.testing.assert_array_equal(ShardedSource(path).read(np.arange(4)), new.samples_NS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "precious.txt").write_text("keep me")
    with pytest.raises(SourceError, match="not a shard dataset; refusing"):
        write_shards(tmp_path / "other", new, samples_per_shard=3, overwrite=True)
    assert (tmp_path / "other" / "precious.txt").read_text() == "keep me"


# --- open_source -----------------------------------------------------------------------------


def test_open_source(tmp_path):
    source, shards = make_shards(tmp_path)
    for where in (shards, shards / "manifest.json"):
        assert isinstance(open_source(where), ShardedSource)
    assert open_source(shards, seq_len=8).sample_len == 9
    with pytest.raises(SourceError, match="sample_len=9 .*seq_len=8.* but seq_len=16"):
        open_source(shards, seq_len=16)

    tokens = random_tokens(100) % 257
    tf = write_token_file(tmp_path / "tf", [tokens], vocab_size=257)
    src = open_source(tf, seq_len=10)
    assert isinstance(src, TokenWindowSource) and src.num_samples == 10  # 101 tokens with the EOS
    np.testing.assert_array_equal(src.read([0])[0], tokens[:11])
    with pytest.raises(SourceError, match="is a token file; pass seq_len"):
        open_source(tf)

    with pytest.raises(SourceError, match=f"{tmp_path / 'nope'}: dataset path does not exist"):
        open_source(tmp_path / "nope", seq_len=8)
    (tmp_path / "junk").mkdir()
    with pytest.raises(SourceError, match="neither a shard dataset"):
        open_source(tmp_path / "junk")
    (tf / "tokens.bin").write_bytes(b"")
    with pytest.raises(SourceError, match="truncated"):
        open_source(tf, seq_len=10)


# --- ThrottledSource -------------------------------------------------------------------------


def timed(fn, *args):
    t0 = time.monotonic()
    fn(*args)
    return time.monotonic() - t0


def concurrently(n, fn):
    """Wall time for n threads each calling fn() once, started together."""
    barrier = threading.Barrier(n + 1)

    def run():
        barrier.wait()
        fn()

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.monotonic()
    for t in threads:
        t.join()
    return time.monotonic() - t0


def test_throttled_stats_and_attributes():
    inner = window_source(50, 9)
    src = ThrottledSource(inner, latency_s=0, bandwidth_bytes_per_s=None)
    assert isinstance(src, SampleSource)
    assert (src.num_samples, src.sample_len, src.dtype, src.sample_nbytes) == (50, 9, np.uint16, 18)
    np.testing.assert_array_equal(src.read([3, 3, 7]), inner.read([3, 3, 7]))
    src.read([])
    stats = src.stats()
    assert {k: stats[k] for k in ("requests", "samples", "bytes")} == {"requests": 2, "samples": 3, "bytes": 54}
    assert stats["busy_s"] >= 0
    src.reset_stats()
    assert src.stats() == {"requests": 0, "samples": 0, "bytes": 0, "busy_s": 0.0}


def test_throttled_single_read_cost():
    src = ThrottledSource(window_source(50, 501), latency_s=0.01, bandwidth_bytes_per_s=1e6)
    elapsed = timed(src.read, np.arange(10))  # 10 * 1002 bytes = 10 ms at 1 MB/s
    assert elapsed >= 0.01 + 10_020 / 1e6 - 1e-3
    assert src.stats()["busy_s"] >= 0.02 - 1e-3 and src.stats()["bytes"] == 10_020


def test_throttled_latency_overlaps():
    n, latency = 10, 0.02
    src = ThrottledSource(window_source(50, 9), latency_s=latency, bandwidth_bytes_per_s=1e9)
    elapsed = concurrently(n, lambda: src.read([1]))
    assert latency - 1e-3 <= elapsed < n * latency / 2
    assert src.stats()["requests"] == n and src.stats()["busy_s"] >= n * (latency - 1e-3)


def test_throttled_bandwidth_is_shared():
    src = ThrottledSource(window_source(50, 1001), latency_s=0, bandwidth_bytes_per_s=1e6)
    nbytes = 10 * 2002  # 20 ms each through the pipe
    elapsed = concurrently(2, lambda: src.read(np.arange(10)))
    assert elapsed >= 2 * nbytes / 1e6 - 1e-3


def test_throttled_max_concurrency():
    n, latency = 4, 0.01
    src = ThrottledSource(window_source(50, 9), latency_s=latency, bandwidth_bytes_per_s=None, max_concurrency=1)
    assert concurrently(n, lambda: src.read([1])) >= n * latency - 1e-3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(latency_s=-1), "latency_s must be"),
        (dict(latency_s=float("nan")), "latency_s must be"),
        (dict(bandwidth_bytes_per_s=0), "bandwidth_bytes_per_s must be > 0"),
        (dict(max_concurrency=0), "max_concurrency must be"),
    ],
)
def test_throttled_validation(kwargs, message):
    with pytest.raises(SourceError, match=message):
        ThrottledSource(window_source(5, 3), **kwargs)
    ThrottledSource(window_source(5, 3), bandwidth_bytes_per_s=float("inf"))  # unlimited is fine
