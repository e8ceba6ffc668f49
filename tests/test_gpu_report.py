"""experiments.gpu_report: --quick runs every section's code path on CPU (kernels in interpret mode) and writes the
report; a failing item is recorded with its first line and the report goes on; bad usage is one line and exit 2."""

import json
import subprocess
import sys

import pytest

from experiments import gpu_report
from experiments.report_speed import kept_pairs


@pytest.mark.slow  # covered by each section's own tests and the report's failure / parts tests below (docs/testing.md)
def test_quick_report_on_cpu_covers_every_section(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.gpu_report", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (md,) = tmp_path.glob("gpu-cpu-*.md")
    data = json.loads(md.with_suffix(".json").read_text())
    assert data["failures"] == []
    kernels = [r["check"] for r in data["kernels"]]
    for what in ("causal", "sliding_window", "document", "global_tokens", "bfloat16", "T=20, S=40"):
        assert any(what in c for c in kernels), what
    assert any("matmul fp8 e5m2 x e4m3 per block" in c for c in kernels)
    assert any("quantized_dot fp8 (delayed scaling)" in c for c in kernels)
    assert {(r["mask"], r["impl"]) for r in data["attention"]} == {
        (m, i) for m in ("full", "causal", "sliding_window(16)") for i in ("pallas", "xla")
    }
    assert {r["impl"] for r in data["matmul"]} >= {
        "bf16 jnp.dot",
        "int8 pallas (per channel)",
        "fp8 pallas (per tensor)",
    }
    train = {r["variant"]: r for r in data["train"]}
    assert set(train) == set(gpu_report.QUICK_TRAIN_VARIANTS)
    assert all(r["loss"] < r["first_loss"] and 0 < r["mfu"] for r in train.values())
    assert all(data["ratios"][name] is not None for name in gpu_report.TARGETS)
    text = md.read_text()
    for heading in ("## Targets", "## Kernel checks", "## Attention speed", "## Matmul speed", "## Training step"):
        assert heading in text
    assert "global_tokens(4) \\| sliding_window" in text  # a mask union's | escaped inside its table cell


def test_a_failing_item_is_recorded_and_the_report_goes_on():
    lines = []
    report = gpu_report.Report(log=lines.append)

    def broken():
        raise RuntimeError("RESOURCE_EXHAUSTED: Shared memory size limit exceeded\n  long traceback text")

    assert report.item("attention", "T=32768", broken) is None
    report.rows("kernels", "checks", lambda: [{"check": "a", "ok": True, "detail": "1e-6"}])
    report.rows("kernels", "checks", lambda: [{"check": "b", "ok": False, "detail": "3e-1 (tol 1e-2)"}])
    assert report.failures == [
        {
            "section": "attention",
            "item": "T=32768",
            "error": "RuntimeError: RESOURCE_EXHAUSTED: Shared memory size limit exceeded",
        },
        {"section": "kernels", "item": "b", "error": "3e-1 (tol 1e-2)"},
    ]
    assert len(report.sections["kernels"]) == 2
    md = gpu_report.render_markdown(
        report,
        {
            "device": "x",
            "date": "d",
            "command": "c",
            "platform": "cpu",
            "jax": "0",
            "host": "h",
            "quick": True,
            "peak_tflops": None,
            "peer": "xla",
        },
        {},
    )
    assert "- attention: T=32768: `RuntimeError: RESOURCE_EXHAUSTED" in md


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "no GPU here (the default device is cpu)"),
        (
            ["--quick", "--only", "kernels,speed"],
            "--only 'kernels,speed': sections are kernels, attention, matmul, train",
        ),
        (["--quick", "--variant", "attention cudnn"], "--variant 'attention cudnn': variants are attention jax, "),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(capsys, argv, message):
    assert gpu_report.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_kept_pairs_count_the_mask():
    import numpy as np

    T, W = 37, 5
    q, k = np.arange(T)[:, None], np.arange(T)[None, :]
    assert kept_pairs("full", T, W) == T * T
    assert kept_pairs("causal", T, W) == int((k <= q).sum())
    assert kept_pairs("sliding_window(5)", T, W) == int(((q - k >= 0) & (q - k < W)).sum())


def test_a_report_run_in_parts_ends_as_one_file(tmp_path):
    """--only kernels then --only matmul on the same day: the second keeps the first's kernel rows and failure."""
    earlier = {
        "meta": {"quick": True},
        "kernels": [{"check": "attention causal", "ok": False, "detail": "3e-1"}],
        "matmul": [{"n": 1, "impl": "old"}],
        "failures": [{"section": "kernels", "item": "attention causal", "error": "3e-1"}],
    }
    path = tmp_path / "gpu-x-d.json"
    path.write_text(json.dumps(earlier))
    report = gpu_report.Report(log=lambda line: None)
    report.sections["matmul"] = [{"n": 2, "impl": "new"}]
    assert gpu_report.merge_earlier_sections(report, path, ["matmul"], quick=True) == ["kernels"]
    assert report.sections["kernels"] == earlier["kernels"] and report.sections["matmul"] == [{"n": 2, "impl": "new"}]
    assert report.failures == earlier["failures"]
    assert gpu_report.merge_earlier_sections(gpu_report.Report(), path, ["matmul"], quick=False) == []


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "no GPU here; the sweep times Triton kernels on a GPU"),
        (["--only", "matmul,warps"], "--only 'matmul,warps': parts are precision, matmul, attention"),
        (["--T", "1000"], "--T 1000: must be a positive multiple of 128"),
    ],
)
def test_tile_sweep_refuses_bad_usage_and_a_cpu_in_one_line(capsys, argv, message):
    from experiments import tune_gpu_tiles

    assert tune_gpu_tiles.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_report_stopped_mid_section_keeps_what_it_measured(tmp_path, monkeypatch):
    """The files are written after every item: a lease's timeout that kills the run in its third train variant
    leaves the first two in the .json and the .md."""

    def two_variants_then_killed(report, sizes, quick, names):
        row = {"ok": True, "mfu": 0.5, "params": 1e6, "tokens_per_s": 1e3, "step_s": 0.1, "compile_s": 1.0}
        for name in ("first", "second"):
            report.rows("train", name, lambda name=name: [{**row, "variant": name, "check": name, "detail": "loss"}])
        raise KeyboardInterrupt  # what the timeout's signal does to the third

    monkeypatch.setattr(gpu_report, "run_train", two_variants_then_killed)
    monkeypatch.setattr("experiments.report_speed.matmul_peak", lambda n: 1e12)
    with pytest.raises(KeyboardInterrupt):
        gpu_report.main(["--quick", "--only", "train", "--out", str(tmp_path)])
    (json_path,) = tmp_path.glob("gpu-cpu-*.json")
    data = json.loads(json_path.read_text())
    assert [r["variant"] for r in data["train"]] == ["first", "second"] and data["meta"]["peak_tflops"] == 1.0
    assert "first" in json_path.with_suffix(".md").read_text()


def test_variant_picks_the_train_variants_that_run(tmp_path, monkeypatch):
    ran = []

    def measure(cfg, steps, windows):
        ran.append((cfg.model.attention_impl, cfg.model.scan_layers))
        return {"model_gflops_per_s": 1.0, "loss": 1.0, "first_loss": 2.0, "params": 1e6, "tokens_per_s": 1.0}

    monkeypatch.setattr("experiments.bench_train.measure_train_step", measure)
    monkeypatch.setattr("experiments.report_speed.matmul_peak", lambda n: 1e12)
    monkeypatch.setattr(gpu_report, "render_markdown", lambda *a: "")
    argv = ["--quick", "--only", "train", "--out", str(tmp_path), "--variant"]
    assert gpu_report.main([*argv, "attention jax, matmuls default, layers scanned"]) == 0
    assert ran == [("jax", True)]  # that one alone, on the tiny model with its layers in a scan


def test_train_variants_run_in_parts_end_as_one_section(tmp_path):
    """--only train --variant A after a run of A and B the same day: B's row and failure stay, A's are the new."""
    earlier = {
        "meta": {"quick": True},
        "train": [{"variant": "A", "check": "train A", "mfu": 0.1}, {"variant": "B", "check": "train B", "mfu": 0.2}],
        "failures": [
            {"section": "train", "item": "train A", "error": "old"},
            {"section": "train", "item": "B", "error": "compile"},
        ],
    }
    path = tmp_path / "gpu-x-d.json"
    path.write_text(json.dumps(earlier))
    report = gpu_report.Report(log=lambda line: None)
    report.sections["train"] = [{"variant": "A", "check": "train A", "mfu": 0.3}]
    taken = gpu_report.merge_earlier_sections(report, path, ["train"], quick=True, variants=("A",))
    assert taken == ["train (1 other variants)"]
    assert [(r["variant"], r["mfu"]) for r in report.sections["train"]] == [("B", 0.2), ("A", 0.3)]
    assert report.failures == [{"section": "train", "item": "B", "error": "compile"}]


def test_the_targets_are_read_off_the_rows_they_name():
    """Issue 37's figures: the lowest Pallas / cuDNN row over full and causal at T >= 2k and both head dims, causal's
    speed-up at 8k, fp8 at 8192^3, the best Pallas step's MFU and the best bf16 Pallas step against cuDNN's."""
    report = gpu_report.Report(log=lambda _: None)
    sizes = gpu_report.full_sizes()
    for T in sizes.attention_seqs:
        for E in sizes.attention_head_dims:
            for mask, full_ms in (("full", 2.0), ("causal", 1.1), ("sliding_window(1024)", 0.1)):
                worst = T == 8192 and E == 64 and mask == "full"
                for impl, rate in (("pallas", 85.0 if worst else 95.0), ("cudnn", 100.0)):
                    row = {"T": T, "E": E, "mask": mask, "impl": impl, "train_tflops": rate, "train_ms": full_ms}
                    report.sections["attention"].append(row)
    report.sections["matmul"] += [
        {"n": 8192, "impl": "fp8 pallas (per tensor)", "tflops": 1080.0},
        {"n": 8192, "impl": "bf16 jnp.dot", "tflops": 660.0},
    ]
    for variant, mfu in (
        ("attention jax, matmuls default", 0.875),
        ("attention pallas, matmuls default", 0.870),
        ("attention pallas (dQ summed across programs), matmuls default", 0.873),
        ("attention pallas, matmuls fp8", 0.90),
        ("attention jax, matmuls fp8", 0.94),
    ):
        report.sections["train"].append({"variant": variant, "mfu": mfu})
    got = list(gpu_report.headline_ratios(report, sizes, "cudnn").values())
    assert got == pytest.approx([0.85, 2.0 / 1.1, 20.0, 1080 / 660, 0.90, 0.873 / 0.875])
    gone = {"T": 32768, "E": 128, "mask": "causal", "impl": "cudnn"}  # a target without its rows is not guessed
    report.sections["attention"] = [r for r in report.sections["attention"] if gone.items() - r.items()]
    assert gpu_report.headline_ratios(report, sizes, "cudnn")[list(gpu_report.TARGETS)[0]] is None
