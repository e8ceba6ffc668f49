"""Benchmarks keep their contract: a readable table, then one JSON object with the key figures as the last line."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = ["--set", "model.vocab_size=512", "--set", "model.d_model=64", "--set", "model.num_heads=2",
        "--set", "model.num_kv_heads=2", "--set", "model.mlp_dim=128", "--set", "model.num_layers=2",
        "--set", "data.seq_len=32", "--set", "data.batch_size=4"]


def run(module, *args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_bench_train_prints_table_then_json():
    proc = run("experiments.bench_train", *TINY, "--steps", "1", "--windows", "1")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert any("MFU" in line for line in lines[:-1])
    summary = json.loads(lines[-1])
    assert summary["tokens_per_s"] > 0 and summary["peak_gflops_per_s"] > 0
    assert 0 < summary["mfu"] < 1.5
    assert summary["params"] > 0


def test_bench_train_rejects_bad_override():
    proc = run("experiments.bench_train", "--set", "model.d_model=abc")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["bench_train: error: bad value for model.d_model: 'abc' is not a valid int"]


def test_torch_reference_without_torch_says_so():
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed: the module would run the real (slow) benchmark")
    proc = run("experiments.bench_torch_reference")
    assert proc.returncode == 2
    assert "torch is not installed" in proc.stderr


def test_bench_attention_prints_table_then_json():
    proc = run("experiments.bench_attention", "--seq-lens", "256", "--head-dims", "16", "--block", "32",
               "--window", "64", "--docs", "4", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert any("blocksparse ms" in line for line in lines[:-1])
    results = json.loads(lines[-1])["results"]
    assert set(results) == {"causal_T256_D16", "sliding_T256_D16", "document_T256_D16", "prefix-LM_T256_D16"}
    assert results["causal_T256_D16"]["blocks"] == 36 / 64  # 8 x 8 blocks, 8 * 9 / 2 non-empty
    assert all(r["speedup"] > 0 and 0 < r["blocks"] <= 1 for r in results.values())
