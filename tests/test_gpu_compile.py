"""Every Pallas kernel and a whole training step compile for an H100 on this CPU-only machine (Triton and Mosaic GPU
for sm_90, shared memory checked against the device's 227 KiB per block), through jax's CUDA plugin installed beside
the project.

The compiles run in subprocesses: the plugin must be found before JAX starts its backends, and the test process
has started them. The first run installs the plugin (~130 MB from the package index) into ~/.cache/jaxlm."""

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import compile_env

from pallas_kernels import targets


def _python(args, timeout, **env):
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=compile_env(**env),
        cwd=os.getcwd(),
    )


def _compile_rows(tmp_path, *flags, spills: list | None = None):
    """gpu_compile's rows; ``spills``, when given, gets ptxas' spill line of every Mosaic GPU kernel compiled."""
    out = tmp_path / "rows.json"
    env = {"MOSAIC_GPU_DUMP_PTXAS": "1"} if spills is not None else {}
    proc = _python(["-m", "experiments.gpu_compile", "--json", str(out), *flags], timeout=1200, **env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert all(r["ok"] for r in rows)
    if spills is not None:
        spills += [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if "spill stores" in line]
    return rows


def _attention_cases(rows, E, dtype):
    return [r["case"] for r in rows if r["group"] == "attention" and f"head dim {E}, {dtype}" in r["case"]]


@pytest.mark.slow
def test_every_mask_at_every_head_dim_compiles_for_h100(tmp_path):
    """Every mask kind (documents with one id slot, and with two: documents at positions), head dim and dtype; no
    Mosaic GPU kernel spills registers (ptxas) but dQ with a T5 table chained with learned slopes at head dim 128:
    8 bytes, stored once a program outside its loops (a thread's row offset held for the epilogue)."""
    spills = []
    rows = _compile_rows(tmp_path, spills=spills)
    spilled = [x for x in spills if "0 bytes spill stores, 0 bytes spill loads" not in x]
    # that kernel's two lines (ptxas' warning and its function properties); the forward and dK/dV beside it none
    assert len(spills) >= 20 and len(spilled) <= 2, spills
    assert all("8 bytes spill stores, 4 bytes spill loads" in x for x in spilled), spills
    for E in (64, 128, 256):
        for dtype in ("float32", "bfloat16"):
            # and a T5 bias table as an input, alone and chained with learned slopes
            extra = 2 * (E > 64 and dtype == "bfloat16")
            fused = 7 * ((E, dtype) in ((64, "bfloat16"), (128, "bfloat16")))  # and dQ summed across programs
            assert len(_attention_cases(rows, E, dtype)) == 7 + extra + fused, (E, dtype)  # every mask kind
    tables = {r["case"]: r["detail"] for r in rows if "relative_bias" in r["case"]}
    # dQ too, which forms the arrays' gradients; at 256 dQ and dK/dV in head-dim halves
    assert sorted(tables.values()) == ["0 Triton + 3 Mosaic GPU kernels"] * 2 + ["0 Triton + 5 Mosaic GPU kernels"] * 2
    cudnn = [r["detail"] for r in rows if r["group"] == "attention" and "cuDNN" in r["case"]]
    assert cudnn == ["2 cuDNN attention kernels"]
    small, e4m3, *report_model = [r for r in rows if r["group"] == "train step"]
    assert len(report_model) == 4 and all("of 84.9 GB" in r["detail"] for r in report_model)  # fits the H100
    (peer,) = [r for r in report_model if "cuDNN" in r["case"]]
    assert peer["detail"].startswith("0 Triton + 0 Mosaic GPU kernels + 40 cuDNN attention")
    (fused,) = [r for r in report_model if "dQ summed across programs" in r["case"]]
    assert fused["detail"].startswith("0 Triton + 40 Mosaic GPU kernels")  # 20 layers' forward, dK/dV summing dQ
    # the small step's scanned layer body once: 3 attention kernels + 4 fp8 matmuls x (forward, dX, dW), and the
    # lm_head's 3; the attention forward and the fp8 forwards on Mosaic GPU, dX and dW (mixed e5m2 x e4m3) on Triton,
    # attention's dQ and dK/dV on either
    triton, mosaic = (
        int(n) for n in re.fullmatch(r"(\d+) Triton \+ (\d+) Mosaic GPU kernels", small["detail"]).groups()
    )
    assert triton + mosaic == 18 and triton >= 10 and mosaic >= 6, small["detail"]
    # with fp8's dY in e4m3 every matmul product is Mosaic GPU's: Triton at most for attention's dQ and dK/dV
    triton, mosaic = (
        int(n) for n in re.fullmatch(r"(\d+) Triton \+ (\d+) Mosaic GPU kernels", e4m3["detail"]).groups()
    )
    assert triton + mosaic == 18 and triton <= 2, e4m3["detail"]


def test_every_kernel_compiles_for_h100(tmp_path):
    """Causal documents at head dims 128 and 256 in bfloat16 (a kernel takes every static mask down one path, a full
    mask over whole blocks without the masked loop; causal documents are causal's kernels loading ids too), causal
    at 256 in float32 (its largest tiles); every matmul.
    Head dim 64 in bfloat16 is test_mosaic_attention.py's compile. The slow test above compiles every mask
    everywhere and the train steps that hold the kernels. And causal documents at 128 with dQ summed across dK/dV's
    programs (``deterministic=False``): the forward and one backward kernel; and causal at 256 with a T5 bias
    table, whose dQ runs in head-dim halves too; cuDNN's fused attention, the report's peer, traced for the H100
    without one (its forward and backward custom calls). No Mosaic GPU kernel spills registers (ptxas): the attention
    kernels at head dim 128 with GQA and a document slot, the fused backward's two warpgroups sharing dS^T, at 256
    the backward's one consumer warpgroup and dK/dV's (with the table also dQ's) two head-dim halves, the
    matmuls."""
    spills = []
    rows = _compile_rows(tmp_path, "--core", spills=spills)
    assert len(spills) >= 19 and all("0 bytes spill stores, 0 bytes spill loads" in x for x in spills), spills
    assert [c.split(",")[0] for c in _attention_cases(rows, 128, "bfloat16")] == ["document", "document"]
    (fused,) = [r for r in rows if "dQ summed across programs" in r["case"]]
    assert fused["detail"] == "0 Triton + 2 Mosaic GPU kernels"
    assert [c.split(",")[0] for c in _attention_cases(rows, 256, "bfloat16")] == ["document", "causal"]
    (table,) = [r for r in rows if "relative_bias" in r["case"]]
    (cudnn,) = [r for r in rows if "cuDNN" in r["case"]]
    assert cudnn["detail"] == "2 cuDNN attention kernels"
    assert table["detail"] == "0 Triton + 5 Mosaic GPU kernels"  # forward, dQ and dK/dV in halves
    assert [c.split(",")[0] for c in _attention_cases(rows, 256, "float32")] == ["causal"]
    assert not [
        c for E, d in ((64, "bfloat16"), (64, "float32"), (128, "float32")) for c in _attention_cases(rows, E, d)
    ]
    matmuls = {r["case"]: r["detail"] for r in rows if r["group"] == "matmul"}
    assert len(matmuls) == 11
    # on sm_90 the same-dtype 8-bit products with per-tensor / per-channel scales run on Mosaic GPU, the rest on Triton
    assert matmuls["int8 x int8, per channel"] == matmuls["fp8 x fp8, per tensor"] == "0 Triton + 1 Mosaic GPU kernels"
    assert matmuls["fp8 e5m2 x e4m3 (mixed), per block of 128"] == "1 Triton + 0 Mosaic GPU kernels"
    assert matmuls["quantized_dot int8 forward + backward, current scaling"] == "0 Triton + 3 Mosaic GPU kernels"
    assert matmuls["quantized_dot fp8 forward + backward, delayed scaling"] == "2 Triton + 1 Mosaic GPU kernels"
    # with dY in e4m3 too, the backward's products share one dtype: all three on Mosaic GPU
    e4m3 = matmuls["quantized_dot fp8 (dY in e4m3) forward + backward, delayed scaling"]
    assert e4m3 == "0 Triton + 3 Mosaic GPU kernels"
    for r in rows:  # bfloat16 attention runs on Mosaic GPU where its kernels take the case, on Triton elsewhere
        if r["group"] == "attention" and "float32" in r["case"]:
            assert r["detail"] == "3 Triton + 0 Mosaic GPU kernels", r
        if r["group"] == "attention" and "head dim 256, bfloat16" in r["case"]:  # dK/dV in two head-dim halves
            halves = 2 if "relative_bias" in r["case"] else 1  # with the table's gradient dQ too
            assert r["detail"] == f"0 Triton + {3 + halves} Mosaic GPU kernels", r
    assert not [r for r in rows if r["group"] == "train step"]


def test_a_kernel_too_big_for_shared_memory_fails_the_compile():
    """The check bites: 128x128 dK/dV tiles at head dim 128 ask for more than an H100's shared memory (what the
    kernels did before their tiles followed head dim and dtype)."""
    script = """
from pallas_kernels import targets
targets.enable_plugin(targets.install_plugin())
import jax, jax.numpy as jnp
import pallas_kernels as pk
from pallas_kernels.gpu_tiles import KernelTiles, PassTiles
bm = pk.make_block_mask(pk.causal(), 384, 384, pk.BlockSizes(128, 128))
big = PassTiles(128, 128, 8, 2)
tiles = KernelTiles(big, big, big)
loss = lambda q, k, v: pk.block_sparse_attention(q, k, v, bm, tiles=tiles)[0].astype(jnp.float32).sum()
q = jax.ShapeDtypeStruct((1, 4, 384, 128), jnp.bfloat16)
kv = jax.ShapeDtypeStruct((1, 2, 384, 128), jnp.bfloat16)
try:
    targets.compile_for_gpu(jax.grad(loss, argnums=(1, 2)), q, kv, kv)
except Exception as e:
    print(targets.first_line(e))
else:
    print("compiled")
"""
    proc = _python(["-c", script], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert "RESOURCE_EXHAUSTED: Shared memory size limit exceeded" in last and "available: 232448" in last, last


def test_enable_plugin_says_what_is_missing(tmp_path):
    with pytest.raises(targets.TargetError, match=f"no CUDA plugin in {tmp_path}"):
        targets.enable_plugin(tmp_path)


def test_plugin_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXLM_CUDA_PLUGIN_DIR", str(tmp_path / "p"))
    assert targets.plugin_dir() == tmp_path / "p"
    monkeypatch.delenv("JAXLM_CUDA_PLUGIN_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert targets.plugin_dir().parent == tmp_path / "jaxlm"
