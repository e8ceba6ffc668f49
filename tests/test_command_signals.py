"""data.command_signals: a command that is not training ends on SIGTERM / Ctrl-C with one line and the shell's exit
code, runs its cleanup when its main thread does not return in time, exits at once on a second Ctrl-C, and holds a
stop back across a step that must not be cut in two. Each case is a small Python process (no JAX) signalled for
real."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from data.command_signals import Stopped, exit_code, signals_deferred

PROGRAM = """
import sys, time
from pathlib import Path
from data.command_signals import CommandSignals, Stopped

mode = sys.argv[1]
marker = Path(sys.argv[2])
try:
    with CommandSignals("demo", cleanup=lambda: marker.write_text("cleaned"), grace_s=1.0):
        try:
            print("ready", flush=True)
            time.sleep(30)
        except Stopped:
            if mode == "stuck":  # a main thread that does not return (C code that never reaches the handler)
                time.sleep(30)
            raise
except Stopped as e:
    print(f"demo: stopped by {e.signal_name}", file=sys.stderr)
    sys.exit(e.code)
"""


def run(tmp_path, mode, *signals, group=False):
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PROGRAM), mode, str(tmp_path / "marker")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    for sig in signals:
        (os.killpg if group else os.kill)(proc.pid, sig)
        time.sleep(0.2)
    _, err = proc.communicate(timeout=20)
    return proc.returncode, [line for line in err.splitlines() if line.strip()], time.monotonic() - t0


def test_sigterm_stops_the_command_through_its_own_code_with_one_line(tmp_path):
    code, err, _ = run(tmp_path, "plain", signal.SIGTERM)
    assert (code, err) == (143, ["demo: stopped by SIGTERM"])
    assert not (tmp_path / "marker").exists()  # its own finally blocks ran; no forced cleanup was needed


def test_a_main_thread_that_does_not_return_is_ended_after_the_grace_period_with_cleanup(tmp_path):
    code, err, seconds = run(tmp_path, "stuck", signal.SIGTERM)
    assert code == 143 and len(err) == 1 and "SIGTERM: still busy 1s later; exiting now" in err[0]
    assert (tmp_path / "marker").read_text() == "cleaned" and seconds < 10


def test_a_second_ctrl_c_exits_at_once_in_one_line(tmp_path):
    code, err, seconds = run(tmp_path, "stuck", signal.SIGINT, signal.SIGINT, group=True)
    assert code == 130 and len(err) == 1 and "second Ctrl-C: exiting now" in err[0] and seconds < 1.0
    assert (tmp_path / "marker").read_text() == "cleaned"


def test_a_stop_inside_a_deferred_block_is_raised_when_the_block_ends():
    from data import command_signals

    steps = []
    try:
        with signals_deferred():
            command_signals._deferring[1] = "SIGTERM"  # as the handler records a signal that arrives in the block
            steps.append("first rename")
            steps.append("second rename")
        steps.append("after")
    except Stopped as e:
        assert e.code == exit_code("SIGTERM") == 143
    assert steps == ["first rename", "second rename"]
