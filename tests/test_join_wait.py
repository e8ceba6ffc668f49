"""A multi-process start whose other processes never arrive (issue 43, "waiting is visible").

Without a bound, JAX waits silently for 5 minutes and then aborts with a C++ stack trace. `sharding.distributed`
says who is missing after 10 s (or half the timeout), gives up after --join-timeout / $JAXLM_JOIN_TIMEOUT_S with
one line, and stays interruptible while it waits. Each test starts one real process of a 2-process run and no peer.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sharding import distributed, launch

REPO = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("JAXLM_", "SLURM_", "OMPI_"))}
ENV["JAX_PLATFORMS"] = "cpu"


def _tiny_lm(tmp_path, port: int, process_id: int, timeout_s: float) -> list[str]:
    return [
        sys.executable,
        "-m",
        "experiments.tiny_lm",
        "--workdir",
        str(tmp_path / "run"),
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        "2",
        "--process-id",
        str(process_id),
        "--join-timeout",
        str(timeout_s),
    ]


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_process_0_names_the_missing_process_and_gives_up_with_one_line(tmp_path):
    port = launch.free_port()
    start = time.monotonic()
    done = subprocess.run(_tiny_lm(tmp_path, port, 0, 3), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    lines = _lines(done.stderr)
    assert done.returncode == 2, done.stderr
    assert lines[0] == (
        f"tiny_lm: note: waiting for process 1 of 2 to join at 127.0.0.1:{port} (this is process 0); "
        f"giving up after 3 s"
    )
    assert lines[1].startswith(f"tiny_lm: error: process 1 of 2 did not join at 127.0.0.1:{port} within 3 s")
    assert "--join-timeout" in lines[1]
    assert len(lines) == 2, done.stderr  # no traceback, no C++ abort, no coordination-service log lines
    assert elapsed < 20, elapsed  # 3 s of waiting + start-up; no 5 s service shutdown at exit


def test_a_process_whose_coordinator_is_not_reachable_says_so(tmp_path):
    port = launch.free_port()
    env = {**ENV, "JAXLM_COORDINATOR": f"127.0.0.1:{port}", "JAXLM_NUM_PROCESSES": "2", "JAXLM_PROCESS_ID": "1"}
    env["JAXLM_JOIN_TIMEOUT_S"] = "2"
    code = (
        "import sys\nfrom sharding.distributed import DistributedError, initialize\n"
        "try:\n    initialize()\nexcept DistributedError as e:\n    sys.exit(f'error: {e}')"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    lines = _lines(done.stderr)
    assert done.returncode == 1, done.stderr
    assert lines[0] == (
        f"note: waiting for the coordinator (process 0) at 127.0.0.1:{port}: not reachable yet "
        f"(this is process 1 of 2); giving up after 2 s"
    )
    assert lines[1].startswith(f"error: the coordinator (process 0) at 127.0.0.1:{port} is not reachable after 2 s")
    assert len(lines) == 2, done.stderr


@pytest.mark.slow  # signals before training are covered by test_interrupts; this one waits for the note
def test_sigterm_while_waiting_ends_the_run_at_once(tmp_path):
    port = launch.free_port()
    proc = subprocess.Popen(
        _tiny_lm(tmp_path, port, 0, 8), cwd=REPO, env=ENV, stderr=subprocess.PIPE, text=True
    )  # the note comes after 4 s (half the timeout)
    try:
        first = proc.stderr.readline()
        assert "note: waiting for process 1 of 2" in first, first
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM, rest
    finally:
        proc.kill()
    assert time.monotonic() - sent < 3
    assert _lines(rest) == ["tiny_lm: stopped: SIGTERM before training started; nothing to save"]


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv(distributed.ENV_JOIN_TIMEOUT, raising=False)
    return monkeypatch


def test_the_join_timeout_is_checked(clean_env):
    assert distributed.join_timeout() == distributed.DEFAULT_JOIN_TIMEOUT_S
    assert distributed.join_timeout(2.5) == 2.5
    for bad in (0, -1, float("nan"), 4000):
        with pytest.raises(distributed.DistributedError, match=r"^--join-timeout must be a number of seconds"):
            distributed.join_timeout(bad)
    clean_env.setenv(distributed.ENV_JOIN_TIMEOUT, "soon")
    with pytest.raises(distributed.DistributedError, match=r"^\$JAXLM_JOIN_TIMEOUT_S .* got soon$"):
        distributed.join_timeout()
    assert distributed.join_timeout(7) == 7  # the flag wins over the variable


def test_missing_processes_are_named_compactly():
    assert distributed._plural([1]) == "process 1"
    assert distributed._plural([0, 2, 3, 5]) == "processes 0, 2-3, 5"
