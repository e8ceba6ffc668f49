"""The low-precision matmul benchmark keeps its contract (a table, then one JSON line) and its accuracy targets."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

INT8_MAX_REL_ERR = 0.015  # int8 per channel, Gaussian inputs
FP8_MAX_REL_ERR = 0.05  # fp8 e4m3 per channel
KERNEL_VS_REFERENCE = 1e-5  # the implementation against the exactly dequantized float32 product


def run_quick(*args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench_matmul", "--quick", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    return lines[:-1], json.loads(lines[-1])


def check_accuracy(summary):
    assert 0 < summary["max_rel_err_int8"] <= INT8_MAX_REL_ERR
    assert 0 < summary["max_rel_err_int8_block128"] <= INT8_MAX_REL_ERR
    assert 0 < summary["max_rel_err_fp8"] <= FP8_MAX_REL_ERR
    assert 0 < summary["max_rel_err_fp8_block128"] <= FP8_MAX_REL_ERR
    assert 0 < summary["max_rel_err_int8_weight_only"] <= INT8_MAX_REL_ERR
    assert 0 < summary["max_rel_err_bf16"] < 0.01
    assert summary["max_kernel_vs_reference"] <= KERNEL_VS_REFERENCE


def test_bench_matmul_xla_accuracy_and_timing():
    table, summary = run_quick()
    assert any("TFLOP/s" in line for line in table)
    assert summary["impl"] == "xla" and summary["timed"] is True  # auto -> XLA on CPU
    check_accuracy(summary)
    assert summary["speedup_int8_vs_bf16"] > 0 and summary["speedup_fp8_vs_bf16"] > 0
    assert summary["tflops"]["bf16 jnp.dot"] > 0 and summary["tflops"]["int8 channel"] > 0


@pytest.mark.slow  # fast cover: the xla run's table and accuracy here, the kernels = XLA in test_quantized_matmul.py
def test_bench_matmul_pallas_interpret_skips_timing():
    table, summary = run_quick("--impl", "pallas", "--block-m", "64", "--block-n", "128", "--block-k", "64")
    assert any("interpret mode" in line for line in table)
    assert summary["impl"] == "pallas" and summary["timed"] is False
    assert summary["speedup_int8_vs_bf16"] is None and summary["tflops"] is None
    check_accuracy(summary)
