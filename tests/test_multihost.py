"""Multi-process training, simulated with local processes on CPU (`python -m sharding.launch`, gloo collectives).

Two processes x 2 CPU devices must train exactly like one process x 4 devices: each process feeds only its own
batch rows, and the global batch is the same. Losses are compared to a relative 1e-6, not bit for bit: the 4
devices' gradient and loss partials are summed by gloo across processes and by XLA in one process, and nothing
promises the same order, so a step may differ by float32 rounding (observed: bitwise equal, or 1 ulp at step 2
with an earlier model revision). One reference run (one process, data parallel) serves both layouts: the FSDP
layout computes the same sums (bitwise equal to it in one process), so its two-process, resumed run must match it too.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import pid_of_process

from jaxlm.metrics import read_metrics
from sharding import distributed, launch

REPO = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("JAXLM_", "SLURM_", "OMPI_"))}
ENV["JAX_PLATFORMS"] = "cpu"
TINY = [
    "--set",
    "model.d_model=64",
    "--set",
    "model.num_layers=2",
    "--set",
    "model.mlp_dim=128",
    "--set",
    "data.seq_len=32",
    "--set",
    "data.batch_size=8",
    "--set",
    "data.microbatches=1",
    "--set",
    "data.eval_batches=1",
    "--set",
    "eval_prompts=",  # no samples: what these tests compare is losses
    "--set",
    "optim.decay_steps=4",  # the schedule must not depend on --steps
    "--log-every",
    "1",
    "--no-progress",
]
FSDP = ["--mesh", str(REPO / "experiments/meshes/fsdp.py")]  # params and batch rows sharded over both processes


def run(cmd, timeout=180, env=ENV):
    return subprocess.run(
        [sys.executable, *map(str, cmd)], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="session")  # session: kept while a worker runs other modules in between
def cached_env():
    """The session's persistent compilation cache (tests/conftest.py), shared by every xdist worker: a resumed run,
    and the same program in another test, reuse the first run's programs."""
    return {
        **ENV,
        "JAX_COMPILATION_CACHE_DIR": os.environ["JAX_COMPILATION_CACHE_DIR"],
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def one_process(env, workdir, *args):
    proc = run(["-m", "experiments.tiny_lm", "--cpu-devices", 4, "--workdir", workdir, *TINY, *args], env=env)
    assert proc.returncode == 0, proc.stderr
    return proc


def two_processes(env, workdir, *args):
    proc = run(
        [
            "-m",
            "sharding.launch",
            "--processes",
            2,
            "--cpu-devices",
            2,
            "--",
            sys.executable,
            "-m",
            "experiments.tiny_lm",
            "--workdir",
            workdir,
            *TINY,
            *args,
        ],
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def losses(workdir, key="loss"):
    return {r["step"]: r[key] for r in read_metrics(workdir / "metrics.jsonl") if key in r}


def assert_same_run(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=1e-6, atol=0)


@pytest.fixture(scope="session")  # session: kept while a worker runs other modules in between
def reference(tmp_path_factory, cached_env):
    """One process, 4 devices, data parallel, 12 uninterrupted steps, evaluated every 4 (the schedule does not
    depend on --steps, and evaluating changes nothing: its first 4 steps are a 4-step run's)."""
    workdir = tmp_path_factory.mktemp("one_process")
    one_process(cached_env, workdir, "--steps", 12, "--set", "eval_every=4")
    return workdir


def first(records: dict, steps: int) -> dict:
    return {s: v for s, v in records.items() if s <= steps}


@pytest.mark.slow  # covered by the SIGTERM test below: its two processes' 12 steps and evals equal this reference
def test_data_parallel_two_processes_match_one(tmp_path, cached_env, reference):
    proc = two_processes(cached_env, tmp_path / "two", "--steps", 4)
    assert_same_run(losses(tmp_path / "two"), first(losses(reference), 4))
    assert_same_run(losses(tmp_path / "two", "eval_loss"), first(losses(reference, "eval_loss"), 4))
    # Only process 0 logs and writes files; every process took part (both connected to the collectives).
    assert "[p0] params" in proc.stdout and "[p1] params" not in proc.stdout
    assert "[p0] tiny_lm: step 4" in proc.stdout and "[p1] tiny_lm: step" not in proc.stdout
    for name in ("config.json", "loss.png", "tensorboard"):
        assert (tmp_path / "two" / name).exists(), name


@pytest.mark.slow  # covered by test_diloco_processes' replicas of two processes each (docs/testing.md)
def test_fsdp_two_processes_resume_matches_one_uninterrupted(tmp_path, cached_env, reference):
    two_processes(cached_env, tmp_path / "two", "--steps", 2, *FSDP)
    proc = two_processes(cached_env, tmp_path / "two", "--steps", 4, *FSDP)  # each process restores its shards
    assert re.search(r"\[p0\] params .* resuming at step 2", proc.stdout), proc.stdout
    assert sorted(int(p.name) for p in (tmp_path / "two" / "checkpoints").iterdir()) == [2, 4]
    assert_same_run(losses(tmp_path / "two"), first(losses(reference), 4))


@pytest.mark.slow  # covered by test_diloco_processes and test_diloco (docs/testing.md)
def test_diloco_one_replica_per_process_matches_one_process(tmp_path, cached_env):
    """DiLoCo with the replica axis across the two processes (each process trains one replica, FSDP over its own
    devices; only the outer syncs cross processes), replica 1 down for steps 2..3 and back at step 4: the same
    losses and bytes as the same layout in one process."""
    diloco = [
        "--mesh",
        REPO / "experiments/meshes/replicas2_fsdp.py",
        "--steps",
        6,
        "--set",
        "diloco.replicas=2",
        "--set",
        "diloco.inner_steps=2",
        "--set",
        "diloco.drop=1@2-3",
        "--set",
        "diloco.compression=int8",
    ]
    one_process(cached_env, tmp_path / "one", *diloco)
    proc = two_processes(cached_env, tmp_path / "two", *diloco)
    assert "[p0] DiLoCo: 2 replicas, H=2" in proc.stdout
    assert_same_run(losses(tmp_path / "two"), losses(tmp_path / "one"))
    assert_same_run(losses(tmp_path / "two", "eval_loss"), losses(tmp_path / "one", "eval_loss"))
    assert losses(tmp_path / "two", "diloco_bytes") == losses(tmp_path / "one", "diloco_bytes")
    assert [losses(tmp_path / "two", "diloco_alive")[s] for s in range(1, 7)] == [2, 1, 1, 2, 2, 2]


def test_sigterm_to_one_process_stops_both_at_the_same_step_with_a_checkpoint(tmp_path, cached_env, reference):
    """A signal that reaches only process 1 (a preempted host): the processes agree at the next log step, both
    write the checkpoint of that step and exit 75; the rerun continues with nothing lost, as one uninterrupted
    process would have trained: two processes x 2 devices, data parallel, give one process x 4 devices' losses and
    eval losses, and only process 0 logs and writes the run's files."""
    workdir, steps = tmp_path / "two", 12
    every = ["--checkpoint-every", "0", "--set", "eval_every=4"]
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sharding.launch",
            "--processes",
            "2",
            "--cpu-devices",
            "2",
            "--",
            sys.executable,
            "-m",
            "experiments.tiny_lm",
            "--workdir",
            str(workdir),
            *map(str, TINY),
            "--steps",
            str(steps),
            *every,
        ],
        cwd=REPO,
        env=cached_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (losses(workdir) if (workdir / "metrics.jsonl").exists() else {}):
        time.sleep(0.01)
    pid = pid_of_process(workdir, JAXLM_PROCESS_ID=1)
    if pid is None:  # the run ended (or never logged) before the signal: say how
        launcher.kill()
        pytest.fail(
            f"process 1 was not running {time.monotonic() - deadline + 120:.0f} s after the launch:\n"
            + launcher.communicate()[0][-3000:]
        )
    os.kill(pid, signal.SIGTERM)
    out, _ = launcher.communicate(timeout=180)
    assert launcher.returncode == 75, out
    stopped = re.search(r"\[p0\] tiny_lm: stopped: SIGTERM / SIGINT to another process after step (\d+)", out)
    assert stopped and f"[p1] tiny_lm: stopped: SIGTERM after step {stopped[1]}" in out, out
    step = int(stopped[1])
    assert step < steps and sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [step]
    assert max(losses(workdir)) == step  # 0 steps lost
    proc = two_processes(cached_env, workdir, "--steps", steps, *every)
    assert_same_run(losses(workdir), losses(reference))  # one process's 12 uninterrupted steps
    assert_same_run(losses(workdir, "eval_loss"), losses(reference, "eval_loss"))
    # Only process 0 logs and writes files; every process took part (both connected to the collectives).
    for output in (out, proc.stdout):
        assert "[p0] params" in output and "[p1] params" not in output, output
    assert f"[p0] tiny_lm: step {steps}" in proc.stdout and "[p1] tiny_lm: step" not in proc.stdout
    for name in ("config.json", "loss.png", "tensorboard"):
        assert (workdir / name).exists(), name


# ----------------------------------------------------------------------------- the launcher


@pytest.mark.parametrize(
    "args, message",
    [
        (["--processes", "2"], "no command"),
        (["--processes", "2", "--"], "no command after `--`"),
        (["--processes", "0", "--", "true"], "--processes must be >= 1"),
        (["--", "true"], "--processes"),
        (["--processes", "2", "--restart", "1", "--", "true"], "--restart needs --independent"),
        (["--processes", "2", "--independent", "--restart", "-1", "--", "true"], "--restart must be >= 0"),
        (
            ["--processes", "2", "--processes-per-replica", "2", "--", "true"],
            "--processes-per-replica needs --independent",
        ),
        (
            ["--processes", "2", "--independent", "--processes-per-replica", "0", "--", "true"],
            "--processes-per-replica must be >= 1",
        ),
    ],
)
def test_launcher_bad_usage(args, message, capsys):
    assert launch.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_launcher_on_a_busy_port_is_one_line(capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert launch.main(["--processes", "2", "--port", str(port), "--", "true"]) == 2
    err = capsys.readouterr().err
    assert f"--port {port} is in use on 127.0.0.1" in err and len(err.strip().splitlines()) == 1, err


def test_launcher_bad_usage_exits_2():
    proc = run(["-m", "sharding.launch", "--processes", "2"], timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("sharding.launch: error: no command"), proc.stderr


def test_launcher_stops_the_others_and_returns_the_failure():
    child = (
        "import os, sys, time; i = os.environ['JAXLM_PROCESS_ID']; print('hello from', i, "
        "os.environ['JAXLM_NUM_PROCESSES'], os.environ['JAX_NUM_CPU_DEVICES'], flush=True); "
        "sys.exit(3) if i == '1' else time.sleep(60)"
    )
    t0 = time.perf_counter()
    proc = run(["-m", "sharding.launch", "--processes", 2, "--cpu-devices", 3, "--", sys.executable, "-c", child])
    assert proc.returncode == 3 and time.perf_counter() - t0 < 30
    assert "[p0] hello from 0 2 3" in proc.stdout and "[p1] hello from 1 2 3" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("[launch] process 1 exited with code 3; stopped the other 1")


def test_a_process_killed_by_a_signal_is_named_in_the_last_line():
    """A host dying prints nothing itself; the survivors print errors about a lost peer. The launcher's last line
    names the cause and the run's code is the shell's 128 + signal of the process that died."""
    child = "import os, time; os.kill(os.getpid(), 9) if os.environ['JAXLM_PROCESS_ID'] == '1' else time.sleep(60)"
    proc = run(["-m", "sharding.launch", "--processes", 2, "--", sys.executable, "-c", child], timeout=60)
    assert proc.returncode == 137, proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == (
        "[launch] process 1 was killed by SIGKILL; stopped the other 1. Rerun the same command to resume from the "
        "last complete checkpoint"
    )


def test_independent_processes_outlive_a_failure_and_a_failed_one_is_restarted(tmp_path):
    """--independent: no coordinator, JAXLM_REPLICA_ID per process; process 1 fails on its first start and is
    started again (--restart 1); process 0 fails for good without stopping process 1."""
    child = (
        f"import os, sys, time; i = os.environ['JAXLM_REPLICA_ID']; first = not os.path.exists(r'{tmp_path}/' + i); "
        f"open(r'{tmp_path}/' + i, 'a').close(); print('start', i, 'JAXLM_COORDINATOR' in os.environ, flush=True); "
        "time.sleep(0.5 if i == '1' else 0); sys.exit(5 if first and i == '1' else 3 if i == '0' else 0)"
    )
    proc = run(
        ["-m", "sharding.launch", "--processes", 2, "--independent", "--restart", 1, "--", sys.executable, "-c", child],
        timeout=60,
    )
    assert "[p0] start 0 False" in proc.stdout and proc.stdout.count("[p1] start 1 False") == 2, proc.stdout
    assert "[launch] process 0 ended with exit code 3; starting it again (1 of 1)" in proc.stdout
    assert "[launch] process 1 ended with exit code 5; starting it again (1 of 1)" in proc.stdout
    assert proc.returncode == 3  # process 0 failed again with no restart left; process 1 finished


def test_a_replica_of_several_processes_is_one_distributed_run_and_restarts_as_a_whole(tmp_path):
    """--independent --processes-per-replica 2: each replica's processes share a coordinator of their own and the
    replica id. Process 1 of replica 1 fails on its first start: its partner is killed and both start again."""
    child = (
        f"import os, sys, time; r, p = os.environ['JAXLM_REPLICA_ID'], os.environ['JAXLM_PROCESS_ID']; "
        f"mark = r'{tmp_path}/' + r + p; first = not os.path.exists(mark); open(mark, 'a').close(); "
        "print('start', r, p, os.environ['JAXLM_NUM_PROCESSES'], os.environ['JAXLM_COORDINATOR'], flush=True); "
        "time.sleep(60 if first and (r, p) == ('1', '0') else 0.5); "
        "sys.exit(5 if first and (r, p) == ('1', '1') else 0)"
    )
    t0 = time.perf_counter()
    proc = run(
        [
            "-m",
            "sharding.launch",
            "--processes",
            2,
            "--independent",
            "--processes-per-replica",
            2,
            "--restart",
            1,
            "--",
            sys.executable,
            "-c",
            child,
        ],
        timeout=60,
    )
    assert proc.returncode == 0 and time.perf_counter() - t0 < 30, proc.stdout  # the sleeping partner was killed
    starts = re.findall(r"\[r(\d)p(\d)\] start (\d) (\d) 2 (\S+)", proc.stdout)
    assert all((r, p) == (r2, p2) for r, p, r2, p2, _ in starts), starts
    assert sorted((r, p) for r, p, *_ in starts) == [
        ("0", "0"),
        ("0", "1"),
        ("1", "0"),
        ("1", "0"),
        ("1", "1"),
        ("1", "1"),
    ]
    coordinators = {r: {c for r2, _, _, _, c in starts if r2 == r} for r in "01"}
    assert len(coordinators["0"]) == 1 and not coordinators["0"] & coordinators["1"]  # one per replica run
    assert "[launch] process 1 of replica 1 ended with exit code 5; starting the replica again (1 of 1)" in proc.stdout


def test_launcher_forwards_ctrl_c():
    child = "import time; print('ready', flush=True); time.sleep(60)"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "sharding.launch", "--processes", "2", "--", sys.executable, "-c", child],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        text=True,
    )
    ready = 0
    while ready < 2:
        line = launcher.stdout.readline()
        assert line, "launcher ended early"
        ready += "ready" in line
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=30) == 128 + signal.SIGINT


# ----------------------------------------------------------------------------- initialize / rows, in process


@pytest.fixture
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("JAXLM_", "SLURM_", "OMPI_")):
            monkeypatch.delenv(k)
    return monkeypatch


@pytest.mark.parametrize(
    "kwargs, missing",
    [
        ({"process_id": 1}, "--coordinator, --num-processes"),
        ({"coordinator": "localhost:1234", "num_processes": 2}, "--process-id"),
    ],
)
def test_partial_flags_are_refused(clean_env, kwargs, missing):
    with pytest.raises(distributed.DistributedError, match=f"missing {missing}"):
        distributed.initialize(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"coordinator": "localhost", "num_processes": 2, "process_id": 0}, "HOST:PORT"),
        ({"coordinator": "localhost:1234", "num_processes": 2, "process_id": 2}, r"\[0, 2\)"),
    ],
)
def test_bad_flags_are_refused(clean_env, kwargs, message):
    with pytest.raises(distributed.DistributedError, match=message):
        distributed.initialize(**kwargs)


def test_single_process_does_nothing(clean_env):
    assert distributed.initialize() is False
    assert distributed.initialize(num_processes=1) is False
    clean_env.setenv("JAXLM_NUM_PROCESSES", "x")
    with pytest.raises(distributed.DistributedError, match="JAXLM_NUM_PROCESSES must be an integer"):
        distributed.initialize()


def test_detects_multi_task_slurm_only(clean_env):
    for k, v in {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
    }.items():
        clean_env.setenv(k, v)
    assert distributed.detect_cluster() is None
    clean_env.setenv("SLURM_NTASKS", "2")
    assert distributed.detect_cluster() == "slurm"


class _FakeSharding:
    """A process holding rows [0, 2) and [4, 6) of 8: the loader cannot read that as one block."""

    def addressable_devices_indices_map(self, shape):
        return {0: (slice(0, 2), slice(None)), 1: (slice(4, 6), slice(None))}


def test_rows_are_derived_from_the_sharding():
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from sharding import MeshLayout, batch_sharding, build_mesh

    mesh = build_mesh(MeshLayout(data=2, tensor=4))
    assert distributed.process_rows(batch_sharding(mesh), (8, 16)) == (0, 8)  # one process holds every row
    batch = np.arange(8 * 16).reshape(8, 16)
    arr = distributed.put_process_rows(batch, batch_sharding(mesh), 8)
    np.testing.assert_array_equal(np.asarray(arr), batch)
    assert distributed.process_rows(NamedSharding(mesh, P()), (8, 16)) == (0, 8)
    with pytest.raises(distributed.DistributedError, match=r"\[0, 2\), \[4, 6\) of 8: not one contiguous block"):
        distributed.process_rows(_FakeSharding(), (8, 16))
    assert jax.process_count() == 1
