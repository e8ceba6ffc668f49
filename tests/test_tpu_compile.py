"""Every Pallas kernel compiles for a TPU on this CPU-only machine (Mosaic for v5p, VMEM and SMEM checked), through
jax's own libtpu installed beside the project; the TPU targets' names and refusals.

The compiles run in subprocesses: libtpu must be found before JAX starts its backends, and the test process has
started them. The first run installs libtpu (~300 MB from the package index) into ~/.cache/jaxlm."""

import json
import subprocess
import sys

import pytest
from helpers import compile_env

from pallas_kernels import targets


def _python(args, timeout):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=compile_env())


def _compile_rows(tmp_path, *flags, timeout=1200):
    out = tmp_path / "rows.json"
    proc = _python(["-m", "experiments.tpu_compile", "--json", str(out), *flags], timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert all(r["ok"] for r in rows)
    return rows


@pytest.mark.parametrize("seqs", ["32768", pytest.param("8192", marks=pytest.mark.slow)])
def test_every_attention_kernel_and_matmul_compiles_for_v5p_at_8k_and_32k(tmp_path, seqs):
    """Head dim 128, bf16, forward + dQ + dK/dV in one program, at the lengths where the kernels that held whole
    sequences in VMEM overflowed it; every scaled matmul. At 32k (`--core`) the masks whose kernels load different
    operands: causal (as the masks that load nothing more), document ids on the host and traced, a T5 bias table as
    an input (8 buckets: the lookup's compile time grows with them; the slow run's table has 32). 8k (slow; its
    tiles are 32k's, and what once held a whole sequence now streams it): every mask kind."""
    core = ("--generations", "v5p", "--head-dims", "128", "--dtypes", "bfloat16")
    rows = _compile_rows(tmp_path, *(("--core",) if seqs == "32768" else core), "--seqs", seqs)
    attention = [r for r in rows if r["group"] == "attention"]
    cases = [r for r in attention if f"v5p, T {seqs}," in r["case"]]
    want = ["causal", "document", "document, ids traced", "causal, relative_bias (T5 table of 8 buckets as an input)"]
    if seqs == "32768":
        assert [r["case"].split(f"T {seqs}, ")[1].split(", head dim")[0] for r in cases] == want
    assert len(cases) == len(attention) == (4 if seqs == "32768" else 8), cases
    assert all(r["detail"].startswith("3 Mosaic kernels") for r in cases), cases
    assert sum(r["group"] == "matmul" for r in rows) == 6


@pytest.mark.slow
def test_every_kernel_compiles_for_every_generation_up_to_128k(tmp_path):
    rows = _compile_rows(tmp_path, timeout=3600)
    for generation in ("v5e", "v5p", "v6e"):
        for T in (8192, 32768, 131072):
            assert sum(f"{generation}, T {T}," in r["case"] for r in rows) == 7 * 3 * 2 + 1, (generation, T)


@pytest.mark.slow  # fast cover: the 32k test's "3 Mosaic kernels" per case (Mosaic compiled them, VMEM check and all)
def test_a_kernel_too_big_for_vmem_fails_the_compile():
    """The check bites: a 2048 x 2048 float32 tile's scores and probabilities alone are 32 MiB, past the VMEM a
    kernel may scope."""
    script = """
from pallas_kernels import targets
targets.enable(targets.libtpu(), targets.install(targets.libtpu()))
import jax, jax.numpy as jnp
import pallas_kernels as pk
from pallas_kernels.tpu_attention import block_sparse_attention_tpu
bm = pk.make_block_mask(pk.full(), 2048, 2048, pk.BlockSizes(128, 128))
fwd = lambda q, k, v: block_sparse_attention_tpu(q, k, v, bm, tiles=(2048, 2048))
q = jax.ShapeDtypeStruct((1, 1, 2048, 256), jnp.float32)
try:
    targets.compile_for_tpu(fwd, q, q, q, generation="v5p")
except Exception as e:
    print(targets.first_line(e))
else:
    print("compiled")
"""
    proc = _python(["-c", script], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert "RESOURCE_EXHAUSTED" in last and "Vmem" in last, last


@pytest.mark.parametrize(
    "generation, chips, name",
    [("v5p", 4, "v5p:2x2x1"), ("v5p", 64, "v5p:4x4x4"), ("v5p", 1024, "v5p:16x8x8"), ("v5e", 256, "v5e:16x16"),
     ("v6e", 8, "v6e:4x2"), ("v4", 32, "v4:4x4x2")],
)  # fmt: skip
def test_tpu_slices_are_named_as_libtpu_describes_them(generation, chips, name):
    assert targets.tpu_generation(generation).topology(chips) == name


def test_unknown_generations_and_slices_are_refused_by_name():
    with pytest.raises(targets.TargetError, match="unknown TPU generation 'v9'; choose one of v4, v5e, v5p, v6e"):
        targets.tpu_generation("v9")
    with pytest.raises(targets.TargetError, match="TPU v5e: 512 chips is not a slice libtpu describes"):
        targets.tpu_generation("v5e").topology(512)
    with pytest.raises(targets.TargetError, match="TPU v5p: 48 chips"):
        targets.tpu_generation("v5p").topology(48)


def test_libtpu_is_jax_s_own_pin_in_a_directory_of_its_own(monkeypatch, tmp_path):
    toolchain = targets.libtpu()
    assert toolchain.packages[0].startswith("libtpu==")  # from jax's 'tpu' extra, e.g. libtpu==0.0.42.*
    monkeypatch.setenv("JAXLM_LIBTPU_DIR", str(tmp_path / "t"))
    assert targets.toolchain_dir(toolchain) == tmp_path / "t"
    with pytest.raises(targets.TargetError, match=f"no libtpu in {tmp_path / 't'}"):
        targets.enable(toolchain)
