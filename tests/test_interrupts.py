"""Ctrl-C as a user presses it, on a real tiny_lm process: the first is acknowledged at once, even while XLA
compiles, and the run stops after the step with its checkpoint (exit 75); a second exits at once with 130 and one
line, never a traceback or a segfault; before training starts, one line and 130."""

import os
import signal
import subprocess
import sys
import time

from jaxlm.checkpoint import Checkpointer

TINY = ["--set", "model.d_model=64", "--set", "model.num_layers=2", "--set", "model.mlp_dim=128"]


# As from a terminal: xdist workers (and shells' background jobs) ignore SIGINT, which a child inherits; Python then
# leaves it ignored. This starts tiny_lm with Python's own Ctrl-C handler, as an interactive shell would have.
AS_FROM_A_TERMINAL = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'tiny_lm'; runpy.run_module('experiments.tiny_lm', run_name='__main__', alter_sys=True)"
)


def _start(workdir, *extra):
    args = ["--workdir", str(workdir), "--no-progress", *TINY, *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-c", AS_FROM_A_TERMINAL, *args]
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)


def _read_until(proc, needle, timeout=120):
    """stderr lines up to and including the first that holds `needle`."""
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"{needle!r} not seen; stderr so far: {''.join(lines)[-2000:]}")


def test_ctrl_c_during_compile_is_acknowledged_at_once_and_stops_after_the_step_with_a_checkpoint(tmp_path):
    proc = _start(tmp_path, "--steps", "30")
    _read_until(proc, "starting from scratch")  # the next thing the run does is compile the train step
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    lines = _read_until(proc, "SIGINT: stopping after the current step with a checkpoint")
    assert time.monotonic() - sent < 2.0
    assert not any("compiled train step" in line for line in lines)  # acknowledged while XLA was compiling
    rest = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 75
    assert "Traceback" not in rest and "rerun the same command to continue" in rest
    assert Checkpointer(tmp_path / "checkpoints").all_steps() == [1]  # the first step, saved


def test_a_second_ctrl_c_exits_at_once_with_130_and_one_line(tmp_path):
    proc = _start(tmp_path, "--steps", "100000", "--checkpoint-every", "5")
    _read_until(proc, "compiled train step")
    time.sleep(2)  # some steps and a checkpoint or more
    proc.send_signal(signal.SIGINT)
    _read_until(proc, "Ctrl-C again to exit at once")
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    code = proc.wait(timeout=30)
    rest = proc.stderr.read()
    proc.stderr.close()
    assert code == 130 and time.monotonic() - sent < 5
    assert "second Ctrl-C: exiting now" in rest
    assert "Traceback" not in rest and "Segmentation" not in rest


def test_ctrl_c_before_training_starts_is_one_line(tmp_path):
    proc = _start(tmp_path, "--steps", "5", "--cpu-devices", "1")
    time.sleep(0.5)  # still importing and checking its inputs
    proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=60)
    err = proc.stderr.read()
    proc.stderr.close()
    assert code == 130, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "tiny_lm: stopped: SIGINT before training started; nothing to save", err
