"""One run per workdir: the lock names its holder, refuses a second run, and is taken over (with a note) only from
a run that is provably gone: a dead pid on this host, or a heartbeat older than the timeout from another host."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from jaxlm.workdir_lock import LOCK_NAME, WorkdirBusy, WorkdirLock

TINY = ["--set", "model.d_model=64", "--set", "model.num_layers=2", "--set", "model.mlp_dim=128"]


def _write_lock(workdir, host, pid, command="python -m experiments.tiny_lm --workdir w", age_s=0.0):
    path = workdir / LOCK_NAME
    path.write_text(json.dumps({"host": host, "pid": pid, "started": "2026-11-24T06:00:00+00:00", "command": command}))
    if age_s:
        t = time.time() - age_s
        os.utime(path, (t, t))
    return path


def test_a_lock_is_released_and_can_be_taken_again(tmp_path):
    with WorkdirLock(tmp_path) as lock:
        holder = json.loads((tmp_path / LOCK_NAME).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        assert lock.acquire() is None  # re-entrant in one process
    assert not (tmp_path / LOCK_NAME).exists()
    with WorkdirLock(tmp_path):
        pass


def test_a_live_holder_refuses_with_its_name(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(tmp_path, socket.gethostname(), sleeper.pid, command="python -m experiments.tiny_lm --steps 9")
        with pytest.raises(WorkdirBusy, match=rf"in use by another run \(pid {sleeper.pid} on .*--steps 9\)"):
            WorkdirLock(tmp_path).acquire()
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == sleeper.pid  # untouched
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_dead_holder_on_this_host_is_taken_over_with_a_note(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _write_lock(tmp_path, socket.gethostname(), gone.pid)
    lock = WorkdirLock(tmp_path)
    note = lock.acquire()
    assert note and f"pid {gone.pid}" in note and "no longer running" in note
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_zombie_holder_counts_as_gone(tmp_path):
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    time.sleep(1.0)  # exited, not yet reaped: still in the process table
    try:
        _write_lock(tmp_path, socket.gethostname(), zombie.pid)
        assert "no longer running" in WorkdirLock(tmp_path).acquire()
    finally:
        zombie.wait()


def test_another_host_is_trusted_until_its_heartbeat_is_stale(tmp_path):
    _write_lock(tmp_path, "other-host", 12345, age_s=10)
    with pytest.raises(WorkdirBusy, match="pid 12345 on other-host"):
        WorkdirLock(tmp_path, stale_after_s=300).acquire()
    _write_lock(tmp_path, "other-host", 12345, age_s=600)
    assert "no heartbeat for 600 s" in WorkdirLock(tmp_path, stale_after_s=300).acquire()


def test_the_holder_beats(tmp_path):
    lock = WorkdirLock(tmp_path, heartbeat_s=0.05)
    lock.acquire()
    path = tmp_path / LOCK_NAME
    old = time.time() - 100
    os.utime(path, (old, old))
    time.sleep(0.3)
    assert time.time() - path.stat().st_mtime < 5
    lock.release()


def test_an_unreadable_lock_is_taken_over(tmp_path):
    (tmp_path / LOCK_NAME).write_text("{not json")
    assert "unreadable" in WorkdirLock(tmp_path).acquire()


def test_a_second_run_on_a_busy_workdir_exits_2_naming_the_holder_and_writes_nothing(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        _write_lock(tmp_path, socket.gethostname(), sleeper.pid, command="python -m experiments.tiny_lm --steps 7")
        proc = subprocess.run(
            [sys.executable, "-m", "experiments.tiny_lm", "--workdir", str(tmp_path), "--steps", "2", *TINY],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        sleeper.kill()
        sleeper.wait()
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tiny_lm: error: --workdir") and f"pid {sleeper.pid}" in last and "--steps 7" in last
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]  # no checkpoint, config or metrics written
