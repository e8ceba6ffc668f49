"""Benchmarks keep their contract: a readable table, then one JSON object with the key figures as the last line."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxlm.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "--set",
    "model.vocab_size=512",
    "--set",
    "model.d_model=64",
    "--set",
    "model.num_heads=2",
    "--set",
    "model.num_kv_heads=2",
    "--set",
    "model.mlp_dim=128",
    "--set",
    "model.num_layers=2",
    "--set",
    "data.seq_len=32",
    "--set",
    "data.batch_size=4",
]


def run(module, *args, env=None):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def test_bench_train_prints_table_then_json():
    proc = run("experiments.bench_train", *TINY, "--steps", "1", "--windows", "1", "--products")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert any("MFU" in line for line in lines[:-1])
    assert any("products timed alone" in line for line in lines[:-1])
    summary = json.loads(lines[-1])
    assert summary["tokens_per_s"] > 0 and summary["peak_gflops_per_s"] > 0
    assert 0 < summary["mfu"] < 1.5
    assert summary["params"] > 0
    # --products: the step's dots timed alone, the layers' projections unbatched and attention's batched
    products = summary["products"]
    assert products["unbatched_ms"] > 0 and products["batched_ms"] > 0
    assert products["products_ms"] == pytest.approx(products["unbatched_ms"] + products["batched_ms"], abs=0.11)


def test_compare_moe_step_time_times_every_variant_against_dense(capsys):
    """`compare_moe --step-time` (in-process, tiny shapes): a row per variant, the MoE one over dense, then JSON;
    a bad --set is one line and exit 2."""
    from experiments.compare_moe import main

    tiny = [*TINY, "--set", "model.expert_mlp_dim=64", "--set", "data.corpus_tokenizer=byte"]
    assert main(["--step-time", "--variants", "dense,moe_aux", "--rounds", "2", "--window", "1", *tiny]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])["step_time"]
    assert list(summary) == ["dense", "moe_aux"] and summary["dense"]["step_time_vs_dense"] == 1.0
    assert all(row["step_ms"] > 0 and row["step_time_vs_dense"] > 0 for row in summary.values())
    assert summary["moe_aux"]["params"] > summary["dense"]["params"]  # 8 experts of 64 against one MLP of 128
    assert main(["--step-time", "--set", "model.num_experts=-1"]) == 2
    assert "model.num_experts" in capsys.readouterr().err


def test_bench_train_rejects_bad_override():
    proc = run("experiments.bench_train", "--set", "model.d_model=abc")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "bench_train: error: bad value for model.d_model: 'abc' is not a valid int"
    ]


def test_torch_reference_without_torch_says_so():
    """torch hidden (sys.modules["torch"] = None makes `import torch` raise ImportError): one line, exit 2."""
    script = (
        "import sys, runpy; sys.modules['torch'] = None; sys.argv = ['bench_torch_reference']; "
        "runpy.run_module('experiments.bench_torch_reference', run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "bench_torch_reference: error: torch is not installed (pip install torch)"
    ]


def test_the_torch_yardstick_starts_at_chance_and_makes_no_denormals():
    """Initialised as nanoGPT is, the peer's first loss is about ln(V) (uniform predictions) and its activations and
    gradients hold no float32 denormal once training moves the weights (PyTorch's default init, an N(0, 1) embedding
    tied to the head, made tens of thousands per step: half the speed on an Intel x86, issue 38)."""
    torch = pytest.importorskip("torch")
    from experiments import bench_torch_reference as ref

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # beside the other test workers: 2 threads would only contend
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    idx, tgt = (torch.randint(0, ref.V, (1, ref.T), generator=gen) for _ in range(2))  # one row: the same values
    found = ref.denormals_in_training(torch, ref.build_model(torch), idx, tgt)
    assert found["loss"] == pytest.approx(math.log(ref.V), abs=0.15)
    assert found["activations"] == 0 and found["gradients"] == 0, found
    slow = ref.denormals_in_training(torch, ref.build_model(torch, nanogpt_init=False), idx, tgt)
    torch.set_num_threads(threads)
    assert slow["gradients"] > 0 and slow["loss"] > 5 * math.log(ref.V)  # what the check guards against


@pytest.mark.slow  # ~3 min: PyTorch's gpt-bench steps, eager and compiled; the ratio is arithmetic on their JSON
def test_bench_train_peer_reports_the_ratio_to_the_faster_torch():
    proc = run("experiments.bench_train", "--peer", "--steps", "1", "--windows", "1")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    peer = summary["peer"]
    assert set(peer["tokens_per_s"]) == {"torch eager", "torch.compile"}
    faster = max(peer["tokens_per_s"].values())
    assert peer["ratio"] == pytest.approx(summary["tokens_per_s"] / faster, rel=1e-3)


def test_bench_attention_prints_table_then_json():
    proc = run(
        "experiments.bench_attention",
        "--seq-lens",
        "256",
        "--head-dims",
        "16",
        "--block",
        "32",
        "--window",
        "64",
        "--docs",
        "4",
        "--repeats",
        "1",
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert any("blocksparse ms" in line for line in lines[:-1])
    results = json.loads(lines[-1])["results"]
    assert set(results) == {"causal_T256_D16", "sliding_T256_D16", "document_T256_D16", "prefix-LM_T256_D16"}
    assert results["causal_T256_D16"]["blocks"] == 36 / 64  # 8 x 8 blocks, 8 * 9 / 2 non-empty
    assert all(r["speedup"] > 0 and 0 < r["blocks"] <= 1 for r in results.values())


@pytest.mark.slow  # the DiLoCo programs it runs: test_diloco.py, test_outer_compression.py (docs/testing.md)
def test_diloco_vs_sync_runs_its_grid_and_continues_where_it_stopped(tmp_path):
    """A two-cell grid: data parallel, M=2 x H=2 x two outer lrs, then 4-bit, streaming and a lost replica at the
    best lr; a table, a plot and the JSON line. A rerun skips every finished run and prints the same results.
    (The runs share their inner-step program: a persistent compilation cache compiles it once.)"""
    cache = {
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    args = [
        "--workdir",
        tmp_path / "runs",
        "--steps",
        "4",
        "--replicas",
        "2",
        "--inner-steps",
        "2",
        "--outer-lrs",
        "0.4,1.0",
        "--set",
        "model.d_model=32",
        "--set",
        "model.num_layers=2",
        "--set",
        "model.mlp_dim=64",
        "--set",
        "data.seq_len=16",
        "--set",
        "data.batch_size=4",
        "--set",
        "data.eval_batches=1",
        "--set",
        "eval_every=2",
    ]
    proc = run("experiments.diloco_vs_sync", *map(str, args), env=cache)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    names = ("data_parallel", "M2_H2_lr0.4", "M2_H2_lr1.0", "M2_H2_int4", "M2_H2_stream2", "M2_H2_drop1")
    for name in names:
        assert any(line.startswith(name) for line in lines), name
    summary = json.loads(lines[-1])
    assert summary["best"]["M2_H2"]["outer_lr"] in (0.4, 1.0)
    assert summary["M2_H2_int4"]["bytes"] * 7 < summary["M2_H2_drop1"]["bytes"]  # 4-bit payload + scales < 1/7
    assert summary["M2_H2_stream2"]["peak_sync_bytes"] < summary["M2_H2_drop1"]["peak_sync_bytes"]
    assert (tmp_path / "runs" / "eval_loss.png").stat().st_size > 0
    again = run("experiments.diloco_vs_sync", *map(str, args), env=cache)
    assert again.returncode == 0 and "starting from scratch" not in again.stderr
    assert again.stdout.strip().splitlines()[-1] == lines[-1]


@pytest.mark.slow  # covered by test_diloco's warm-start and one-replica identities (docs/testing.md)
def test_diloco_vs_sync_warm_start_continues_the_data_parallel_run(tmp_path):
    """--warm-start: every run continues the same data-parallel run. With one replica, outer SGD lr 1 and no
    momentum, DiLoCo is plain training, so from the warm start it must end at data parallelism's eval loss."""
    cache = {
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    args = [
        "--workdir",
        tmp_path / "runs",
        "--steps",
        "4",
        "--warm-start",
        "2",
        "--replicas",
        "1",
        "--inner-steps",
        "2",
        "--outer-lrs",
        "1.0",
        "--outer-momentum",
        "0",
        "--set",
        "model.d_model=32",
        "--set",
        "model.num_layers=2",
        "--set",
        "model.mlp_dim=64",
        "--set",
        "data.seq_len=16",
        "--set",
        "data.batch_size=4",
        "--set",
        "data.eval_batches=1",
        "--set",
        "eval_every=2",
    ]
    proc = run("experiments.diloco_vs_sync", *map(str, args), env=cache)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["best"]["M1_H2_mom0.0"]["eval_loss"] == pytest.approx(summary["data_parallel_eval_loss"], rel=1e-6)
    assert "all continuing a 2-step data-parallel run" in proc.stdout
    table = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.startswith(("data_", "M1"))}
    assert table["data_parallel"][3] == "2" and table["M1_H2_lr1.0_mom0.0"][3] == "1"  # the 2 steps after it
    run_dir = tmp_path / "runs" / "warm_start_2"
    for name in ("pretrain", "data_parallel", "M1_H2_lr1.0_mom0.0"):
        steps = [r["step"] for r in read_metrics(run_dir / name / "metrics.jsonl") if "loss" in r]
        assert steps == list(range(1, 5 if name != "pretrain" else 3)), (name, steps)


def test_diloco_vs_sync_rejects_a_bad_grid(tmp_path):
    proc = run("experiments.diloco_vs_sync", "--workdir", str(tmp_path), "--replicas", "two")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "diloco_vs_sync: error: --replicas expects comma-separated integers, got 'two'"


@pytest.mark.slow  # ~20 s: two pipelined train steps compiled; test_sharding and test_schedules cover the schedules
def test_bench_pipeline_prints_each_schedule_then_json():
    proc = run("experiments.bench_pipeline", "--schedules", "1f1b,zbv", "--steps", "1")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    assert rows["1f1b"]["vs_1f1b"] == 1.0 and rows["zbv"]["idle"] == pytest.approx(3 / 51, abs=1e-4)
