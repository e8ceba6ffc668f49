"""A fast subset of the fault-injection sweep (`python -m experiments.fault_sweep` runs the full one): tiny_lm
in a subprocess is SIGKILLed at a random step and in the middle of a save, SIGTERMed, has its newest checkpoint
damaged, and runs out of file space (a per-file limit, and a real full tmpfs when it may mount one) during a save; every rerun must finish with the uninterrupted run's losses,
bit for bit, no temporary directory left and no good checkpoint set aside."""

import pytest

from experiments.fault_harness import Harness, can_mount_tmpfs, run_scenario

# (kind, seed): fixed seeds, so a failure reproduces with `python -m experiments.fault_sweep --kinds K --seeds S`
CASES = [("sigkill", 0), ("sigkill", 1), ("sigkill_save", 0), ("sigkill_save", 1), ("sigterm", 0), ("corrupt", 0),
         ("disk_full", 0), ("tmpfs_full", 0)]


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    harness = Harness(tmp_path_factory.mktemp("faults"), steps=12, checkpoint_every=3)
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
        assert out.exit_code == 4, out
        assert out.message.startswith("tiny_lm: error: checkpoint save of step "), out.message
        assert "File too large" in out.message and "the last complete checkpoint is step" in out.message
    elif kind == "tmpfs_full":
        assert out.exit_code == 4 and "No space left on device" in out.message, out
    if kind == "sigkill_save":
        assert out.in_save, f"the kill did not land inside a save: {out}"
