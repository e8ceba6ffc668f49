"""experiments.step_profile and experiments.trace_times: a trace's time lands on the instructions that ran, the
report lines variants up by kind, and the tiny model's step profiles end to end on a CPU."""

import json
import os
import re

import jax
import jax.numpy as jnp
import pytest

from experiments import step_profile
from experiments.trace_times import NO_COMMAND_BUFFERS, op_times, trace
from sharding.hlo import kernel_kinds


def test_a_trace_puts_a_program_s_time_on_the_instruction_that_did_the_work(tmp_path):
    """A 768^3 product beside a 768-element add: nearly all the traced time is the product's instruction's."""
    a = jnp.ones((768, 768))
    compiled = jax.jit(lambda a: (a @ a, a[0] + 1)).lower(a).compile()
    jax.block_until_ready(compiled(a))
    hlo = compiled.as_text()
    module = re.search(r"^HloModule ([\w.\-]+)", hlo, re.M).group(1)
    times = op_times(trace(lambda: jax.block_until_ready(compiled(a)), str(tmp_path)), module)
    heaviest, ns = times.ns.most_common(1)[0]
    assert times.source == "host" and heaviest in kernel_kinds(hlo)
    assert ns > 0.8 * sum(times.ns.values())
    line = next(x for x in hlo.splitlines() if re.match(rf"\s*(ROOT )?%{re.escape(heaviest)} = ", x))
    called = re.search(r"calls=%([\w.\-]+)", line)
    body = re.search(rf"^%{re.escape(called.group(1))} .*?^}}$", hlo, re.M | re.S).group(0) if called else line
    assert " dot(" in body


def test_the_report_lines_variants_up_by_kind():
    def result(step, kinds):
        top = [{"op": "custom-call.7", "kind": "cuDNN attention", "kernel": "sdpa", "ms": 1.5}]
        return {
            "step_ms": step,
            "kernels_ms": sum(kinds.values()),
            "source": "device",
            "kinds_ms": kinds,
            "top_ops": top,
        }

    lines = step_profile.report(
        {
            "a": result(10.0, {"cuDNN attention": 2.0, "copy": 1.0}),
            "b": result(11.0, {"Mosaic GPU (Pallas)": 1.5, "copy": 3.0}),
        },
        top=2,
    )
    assert lines[0] == "a: step 10.0 ms, kernels 3.0 ms a step (device)"
    assert lines[6:9] == [
        "b - a: step +1.0 ms, kernels +1.5 ms",
        "      +2.00 ms  copy (1.00 -> 3.00)",
        "      -2.00 ms  cuDNN attention (2.00 -> 0.00)",
    ]
    assert lines[-1] == "       1.50 ms  custom-call.7 (cuDNN attention) sdpa"


def test_an_unknown_variant_gets_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        step_profile.main(["--variant", "attention cudnn"])
    assert exit_info.value.code == 2
    assert "unknown variant 'attention cudnn'" in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_tiny_step_profiles_end_to_end(tmp_path, capsys, monkeypatch):
    """Two variants of the tiny model on a CPU (Pallas in the interpreter): each variant's kinds sum to its kernels'
    time, its slowest instructions are the step's own, and the JSON holds what was printed, with the XLA_FLAGS that
    keep a GPU's kernels out of CUDA graphs."""
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main adds its flag; put it back after
    out = tmp_path / "profile.json"
    names = ["attention jax, matmuls default", "attention pallas, matmuls default"]
    assert step_profile.main(["--quick", "--steps", "1", "--json", str(out), *[f"--variant={n}" for n in names]]) == 0
    printed = capsys.readouterr().out
    written = json.loads(out.read_text())
    assert NO_COMMAND_BUFFERS in written["xla_flags"].split()
    results = written["variants"]
    assert list(results) == names
    for name, r in results.items():
        assert r["kernels_ms"] > 0 and r["kernels_ms"] == pytest.approx(sum(r["kinds_ms"].values()))
        assert r["top_ops"] and all(o["kind"] in r["kinds_ms"] for o in r["top_ops"])
        assert f"{name}: step {r['step_ms']:.1f} ms, kernels {r['kernels_ms']:.1f} ms a step (host)" in printed
        alone = r["alone"]  # one layer's attention traced by itself, times the model's 2 layers
        assert alone["layers"] == 2 and alone["source"] == "host" and sum(alone["kinds_ms"].values()) > 0
        assert f"{name}: its attention alone, x2 layers: {sum(alone['kinds_ms'].values()):.1f} ms a step" in printed
    assert f"{names[1]} - {names[0]}: step " in printed


def test_device_events_come_first_by_instruction_else_by_kernel_name():
    """A GPU trace: the device's stream events by the instruction they ran, not the host's launches, nor the lines
    derived from the streams; where the device's events name no instruction, by kernel name."""
    from types import SimpleNamespace as NS

    from experiments.trace_times import times_from_planes

    def event(name, ns, **stats):
        return NS(name=name, duration_ns=ns, stats=list(stats.items()))

    def planes(with_ops: bool, op: str = "fusion.3"):
        ops = {"hlo_op": op, "hlo_module": "jit_step"} if with_ops else {}
        stream = NS(name="Stream #7", events=[event("loop_fusion_kernel", 5.0, **ops), event("sm90_gemm", 7.0)])
        derived = NS(name="XLA Ops", events=[event("fusion.3", 5.0, hlo_op="fusion.3")])
        host = NS(name="tf_XLA", events=[event("launch", 1.0, hlo_op="fusion.3", hlo_module="jit_step")])
        return [NS(name="/device:GPU:0", lines=[stream, derived]), NS(name="/host:CPU", lines=[host])]

    by_op = times_from_planes(planes(True), "jit_step")
    assert (by_op.source, dict(by_op.ns), by_op.kernel_names) == (
        "device",
        {"fusion.3": 5.0},
        {"fusion.3": "loop_fusion_kernel"},
    )
    by_kernel = times_from_planes(planes(False), "jit_step")
    assert (by_kernel.source, dict(by_kernel.ns)) == ("device kernels", {"loop_fusion_kernel": 5.0, "sm90_gemm": 7.0})
    # in a CUDA graph a kernel names the graph's call, which launches nothing the caller can place: by kernel name
    in_graph = times_from_planes(planes(True, op="call.4"), "jit_step", known={"fusion.3"})
    assert (in_graph.source, dict(in_graph.ns)) == ("device kernels", {"loop_fusion_kernel": 5.0, "sm90_gemm": 7.0})
    assert times_from_planes(planes(True), "jit_step", known={"fusion.3"}).source == "device"
