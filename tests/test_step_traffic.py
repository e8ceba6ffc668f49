"""experiments.step_traffic: its report of bytes per kind (fast, on made-up counts), its refusals, and (slow) the 1B
step compiled for an H100, whose all-Mosaic fp8 program moves more bytes than XLA's fp8 one."""

import subprocess
import sys
from collections import Counter

import pytest
from helpers import compile_env

from experiments import step_traffic
from pallas_kernels import targets


def test_the_report_lists_each_variant_and_its_difference_from_the_first():
    results = {"a": Counter(products=10e9, loop_convert_fusion=2e9), "b": Counter(products=4e9, transpose=9e9)}
    lines = step_traffic.report(results, top=2, bandwidth=1e12)
    assert lines[0] == "a: 12.0 GB a step, 12.0 ms at 1 TB/s"
    assert lines[3] == "b: 13.0 GB a step, 13.0 ms at 1 TB/s"
    assert lines[6:] == ["b - a: +1.0 GB (+1.0 ms at 1 TB/s)", "      +9.0 GB  transpose", "      -6.0 GB  products"]


def test_bad_arguments_get_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:  # argparse's own refusal
        step_traffic.main(["--variants", "fp9"])
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .endswith("--variants: 'fp9': choose from " + ", ".join(step_traffic.VARIANTS))
    )
    assert step_traffic.main(["--top", "0"]) == 2
    assert capsys.readouterr().err.strip() == "step_traffic: error: --top and --bandwidth must be positive"


@pytest.mark.slow  # ~120 s: two compiles of the unrolled 1B step; the fast cover is tests/test_hlo.py's traffic test
def test_the_all_mosaic_fp8_step_moves_about_what_xla_s_fp8_step_moves():
    """Compiled for an H100, the 1B step with every fp8 product on the Mosaic GPU kernel moves at most 10% more
    bytes than with XLA's fp8 products (with its 8-bit operands transposed by XLA, 1.28x on 2026-11-27; with
    ``byte_transpose``, 1.04x)."""
    if not targets.installed(targets.CUDA_PLUGIN, targets.plugin_dir()):
        pytest.skip(f"no CUDA plugin in {targets.plugin_dir()}")
    env = compile_env()
    argv = ["--variants", "fp8-xla-e4m3,fp8-pallas-e4m3", "--no-install"]
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.step_traffic", *argv], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    totals = {
        line.split(":")[0]: float(line.split(": ")[1].split(" GB")[0])
        for line in proc.stdout.splitlines()
        if " GB a step" in line
    }
    assert totals["fp8-pallas-e4m3"] < 1.1 * totals["fp8-xla-e4m3"], totals
