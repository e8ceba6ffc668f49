"""A fast subset of the fault-injection sweep (`python -m experiments.fault_sweep` runs the full one): tiny_lm
in a subprocess is SIGKILLed at a random step and in the middle of a save, SIGTERMed, has its newest checkpoint
damaged, and runs out of file space (a per-file limit, and a real full tmpfs when it may mount one) during a save;
every rerun must finish with the uninterrupted run's losses, bit for bit, no temporary directory left and no good
checkpoint set aside."""

import pytest

from experiments.fault_harness import TINY_FLAGS, Harness, can_mount_tmpfs, run_scenario

# (kind, seed): fixed seeds, so a failure reproduces with `python -m experiments.fault_sweep --kinds K --seeds S`.
# Slow (docs/testing.md): a second seed of a kind, and the kinds an in-process test or another kind covers.
slow = pytest.mark.slow
CASES = [
    ("sigkill", 0),
    pytest.param("sigkill", 1, marks=slow),
    pytest.param("sigkill_save", 0, marks=slow),
    pytest.param("sigkill_save", 1, marks=slow),
    pytest.param("sigterm", 0, marks=slow),
    pytest.param("corrupt", 0, marks=slow),
    ("disk_full", 0),
    pytest.param("tmpfs_full", 0, marks=slow),
]


@pytest.fixture(scope="session")  # session: kept while a worker runs other modules in between
def harness(tmp_path_factory):
    # The sweep's model on batches of 4 x 64 tokens, not 8 x 128: its 12 steps take 1.3 s, not 3.4 (at the suite's
    # optimization level 0); a checkpoint's array files still outgrow the disk_full case's 64 KiB.
    small = (*TINY_FLAGS, "--set", "data.seq_len=64", "--set", "data.batch_size=4")
    harness = Harness(tmp_path_factory.mktemp("faults"), steps=12, checkpoint_every=3, flags=small)
    harness.reference()
    return harness


@pytest.mark.parametrize("kind, seed", CASES)
def test_fault_then_rerun_continues_exactly(harness, kind, seed):
    if kind == "tmpfs_full" and not can_mount_tmpfs():
        pytest.skip("mounting a tmpfs needs root with CAP_SYS_ADMIN; disk_full covers the same path")
    out = run_scenario(harness, kind, seed)
    assert out.completed, out
    assert out.loss_match, out
    assert not out.leftover_tmp and not out.good_lost, out
    if kind == "sigterm":
        assert out.exit_code == 75 and out.steps_lost == 0, out
        assert "checkpoint written in" in out.message
    elif kind.startswith("sigkill"):
        assert out.exit_code == -9, out
    elif kind == "disk_full":
        assert out.exit_code == 4 and out.tracebacks == 0 and out.absl_errors == 0, out
        assert out.message.startswith("tiny_lm: error: checkpoint save of step "), out.message
        assert "File too large" in out.message and "the last complete checkpoint is step" in out.message
    elif kind == "tmpfs_full":
        assert out.exit_code == 4 and out.tracebacks == 0 and out.absl_errors == 0, out
        assert "No space left on device" in out.message, out
    if kind == "sigkill_save":
        assert out.in_save, f"the kill did not land inside a save: {out}"


def test_sweep_report_prints_a_table_targets_and_a_json_last_line(capsys):
    import json

    from experiments.fault_harness import Outcome
    from experiments.fault_sweep import report, summarize

    good = dict(completed=True, loss_match=True)
    outcomes = [
        Outcome("sigkill", 0, steps_done=7, resumed_from=4, **good),
        Outcome("sigkill_save", 0, in_save=True, steps_done=8, resumed_from=4, **good),
        Outcome("sigterm", 0, steps_done=5, resumed_from=5, **good),
        Outcome("corrupt", 0, steps_done=8, resumed_from=4, completed=True, loss_match=False),
    ]
    timing = {
        "cold_first_step_s": 10.0,
        "restart_first_step_s": 4.0,
        "restart_ratio": 0.4,
        "sync_save_s": 0.2,
        "preemption_save_s": 0.3,
    }
    report(summarize(outcomes), timing, outcomes, 60.0)
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["fault", "injected", "mid-save"]
    assert any(line.startswith("corrupt") and line.split()[5] == "1" for line in out)  # one loss mismatch
    assert any("every run completes" in line and line.endswith("NOT met") for line in out)
    assert any("2 kills, 1 mid-save: NOT met" in line for line in out)
    assert any("steps lost on SIGTERM: 0 (target 0): met" in line for line in out)
    assert any("= 1.50x (target < 2x): met" in line for line in out)
    summary = json.loads(out[-1])
    assert summary["faults"] == 4 and summary["ok"] == 3 and summary["steps_lost"] == 3 + 4 + 0 + 4
    assert summary["restart_ratio"] == 0.4 and summary["preemption_save_ratio"] == 1.5
