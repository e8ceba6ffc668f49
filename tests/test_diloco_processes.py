"""DiLoCo with one replica per independent process (`jaxlm.diloco.processes`, `sharding.launch --independent`):

- without failures, two replica processes train exactly like the two replicas inside one program;
- a replica process killed mid-run is started again by the launcher, replays the decided syncs since its
  checkpoint while the other waits, and the run ends as if nothing had happened;
- a replica that is gone for good is left out after the sync timeout (or, once it had a heartbeat, as soon as that
  stands still) and the other trains on alone; when it comes back later it rejoins from the newest snapshot of the
  global params and both finish with the same params.
"""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import one_device_mesh, pid_of_process, random_batch, tiny_config

from experiments.tiny_lm import main as tiny_lm_main
from jaxlm.config import DiLoCoConfig, validate
from jaxlm.diloco.exchange import ExchangeError
from jaxlm.diloco.processes import ProcessDiLoCoProgram
from jaxlm.metrics import read_metrics

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
    "optim.decay_steps=4",
    "--log-every",
    "1",
    "--no-progress",
    "--set",
    "diloco.replicas=2",
    "--set",
    "diloco.inner_steps=2",
    "--set",
    "diloco.compression=int8",
]
FSDP = ["--mesh", str(REPO / "experiments/meshes/fsdp.py")]  # inside each replica process: FSDP over its 2 devices
STEPS = 12
CHECKPOINT_EVERY = 2  # with keep_checkpoints 3 and H = 2, the exchange tidies the syncs before step 4


def run(cmd, timeout=300):
    return subprocess.run(
        [sys.executable, *map(str, cmd)], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def launch_cmd(workdir, *args, restart=0):
    return [
        sys.executable,
        "-m",
        "sharding.launch",
        "--processes",
        "2",
        "--cpu-devices",
        "2",
        "--independent",
        "--restart",
        str(restart),
        "--",
        sys.executable,
        "-m",
        "experiments.tiny_lm",
        "--workdir",
        str(workdir),
        *TINY,
        *FSDP,
        "--set",
        f"diloco.exchange={workdir}/exchange",
        *map(str, args),
    ]


def records(workdir, key):
    return {r["step"]: r[key] for r in read_metrics(Path(workdir) / "metrics.jsonl") if key in r}


def members(workdir, step):
    return json.loads((Path(workdir) / "exchange" / f"sync_{step:09d}_f0" / "members.json").read_text())["members"]


def kept_decisions(workdir) -> dict[int, list[int]]:
    """{sync step: members} of the syncs the exchange still keeps (older ones are tidied away)."""
    return {
        int(d.name.split("_")[1]): members(workdir, int(d.name.split("_")[1]))
        for d in (Path(workdir) / "exchange").glob("sync_*")
    }


@pytest.fixture(scope="session")  # session: kept while a worker runs other modules in between
def uninterrupted(tmp_path_factory):
    """Two replica processes, no failure."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    proc = subprocess.run(
        launch_cmd(workdir, "--steps", STEPS, "--checkpoint-every", CHECKPOINT_EVERY),
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return workdir


def test_two_replica_processes_train_like_two_replicas_in_one_program(tmp_path, uninterrupted):
    one = run(
        [
            "-m",
            "experiments.tiny_lm",
            "--cpu-devices",
            4,
            "--workdir",
            tmp_path,
            *TINY,
            "--steps",
            STEPS,
            "--mesh",
            REPO / "experiments/meshes/replicas2_fsdp.py",
        ]
    )
    assert one.returncode == 0, one.stderr
    replica = [records(uninterrupted / f"replica_{i}", "loss") for i in (0, 1)]
    mean = [(replica[0][s] + replica[1][s]) / 2 for s in range(1, STEPS + 1)]  # one program logs the replicas' mean
    np.testing.assert_allclose(mean, [records(tmp_path, "loss")[s] for s in range(1, STEPS + 1)], rtol=1e-6)
    want = records(tmp_path, "eval_loss")
    for i in (0, 1):
        got = records(uninterrupted / f"replica_{i}", "eval_loss")
        assert sorted(got) == sorted(want)
        # the eval's loss sums a whole split: its rounding differs between the two programs a little more
        np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=1e-5)
        assert records(uninterrupted / f"replica_{i}", "diloco_bytes") == records(tmp_path, "diloco_bytes")
    kept = kept_decisions(uninterrupted)  # checkpoint_every x keep_checkpoints + H steps: all a restore replays
    assert sorted(kept) == list(range(4, STEPS + 1, 2)) and all(m == [0, 1] for m in kept.values())


@pytest.mark.slow  # covered by the fast tests that cover the kill-and-restart test below (docs/testing.md)
def test_a_killed_replica_process_is_restarted_and_the_run_ends_as_if_uninterrupted(tmp_path, uninterrupted):
    launcher = subprocess.Popen(
        launch_cmd(tmp_path, "--steps", STEPS, "--checkpoint-every", CHECKPOINT_EVERY, restart=1),
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = tmp_path / "replica_1" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and max(records(tmp_path / "replica_1", "loss"), default=0) >= 5):
        assert launcher.poll() is None and time.monotonic() < deadline, "replica 1 never reached step 5"
        time.sleep(0.01)
    os.kill(pid_of_process(tmp_path, JAXLM_REPLICA_ID=1), signal.SIGKILL)
    out, _ = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, out
    assert "[launch] process 1 ended with signal 9; starting it again (1 of 1)" in out
    assert "[p1] replica 1 of 2: replaying" in out or "resuming at step" in out, out
    for i in (0, 1):
        for key in ("loss", "eval_loss"):
            assert records(tmp_path / f"replica_{i}", key) == records(uninterrupted / f"replica_{i}", key), (i, key)
    assert kept_decisions(tmp_path) == kept_decisions(uninterrupted)


@pytest.mark.slow  # 41 s; covered by its parts (docs/testing.md): the launcher restarting a replica of two processes
# as a whole (test_multihost), two processes training as one, replica processes training as one program, the replay
# and rejoin of a restarted replica (below), and a killed run's rerun continuing exactly (fault injection)
def test_replicas_of_two_processes_each_survive_a_killed_process_and_train_like_one_process_each(
    tmp_path, uninterrupted
):
    """Each replica a JAX distributed run of its own: 2 processes x 1 device, FSDP across them, process 0 speaking
    for it in the exchange. Process 1 of replica 1 is SIGKILLed after step 5; the launcher kills its partner and
    starts the replica again, which resumes from its newest checkpoint. Every replica's losses equal those of the
    same replica as one process with 2 devices (the lr schedule does not depend on --steps), and both replicas end
    with the same eval loss."""
    steps = 12
    cmd = [
        sys.executable,
        "-m",
        "sharding.launch",
        "--processes",
        "2",
        "--cpu-devices",
        "1",
        "--independent",
        "--processes-per-replica",
        "2",
        "--restart",
        "1",
        "--",
        sys.executable,
        "-m",
        "experiments.tiny_lm",
        "--workdir",
        str(tmp_path),
        *TINY,
        *FSDP,
        "--set",
        f"diloco.exchange={tmp_path}/exchange",
        "--steps",
        str(steps),
        "--checkpoint-every",
        "4",
    ]
    launcher = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics, deadline = tmp_path / "replica_1" / "metrics.jsonl", time.monotonic() + 240
    saved = tmp_path / "replica_1" / "checkpoints" / "4"  # renamed into place once complete
    while not (metrics.exists() and max(records(tmp_path / "replica_1", "loss"), default=0) >= 5 and saved.exists()):
        assert launcher.poll() is None and time.monotonic() < deadline, (
            "replica 1 never passed step 5 with step 4 saved"
        )
        time.sleep(0.01)
    os.kill(pid_of_process(tmp_path, JAXLM_REPLICA_ID=1, JAXLM_PROCESS_ID=1), signal.SIGKILL)
    out, _ = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, out
    assert "[launch] process 1 of replica 1 ended with signal 9; starting the replica again (1 of 1)" in out
    assert re.search(r"\[r1p0\] params .*, resuming at step [48]\n", out) and "in its own 2 processes" in out, out
    for i in (0, 1):
        got, want = records(tmp_path / f"replica_{i}", "loss"), records(uninterrupted / f"replica_{i}", "loss")
        np.testing.assert_allclose(
            [got[s] for s in range(1, steps + 1)],
            [want[s] for s in range(1, steps + 1)],
            rtol=1e-6,
            err_msg=f"replica {i}",
        )
    evals = [records(tmp_path / f"replica_{i}", "eval_loss") for i in (0, 1)]
    assert sorted(evals[0]) == [steps] and evals[0] == evals[1]


@pytest.mark.slow  # covered by the restarted replica's rejoin from a snapshot and the heartbeat tests
def test_a_replica_gone_for_good_is_left_out_and_rejoins_from_a_snapshot_when_it_comes_back(tmp_path):
    """Replica 0 trains 8 steps alone. Replica 1, started after it finished, rejoins at the final step and records
    the run's final eval and params as its own; both then continue to step 12 together."""
    alone = run(
        [
            "-m",
            "experiments.tiny_lm",
            "--cpu-devices",
            2,
            "--workdir",
            tmp_path,
            *TINY,
            *FSDP,
            "--steps",
            8,
            "--set",
            f"diloco.exchange={tmp_path}/exchange",
            "--set",
            "diloco.sync_timeout_s=1",
            "--replica-id",
            0,
        ]
    )
    assert alone.returncode == 0, alone.stderr
    assert [members(tmp_path, s) for s in (2, 4, 6, 8)] == [[0]] * 4  # waited 1 s for replica 1 once, then not
    assert records(tmp_path / "replica_0", "diloco_alive")[8] == 1

    late = run(
        [
            "-m",
            "experiments.tiny_lm",
            "--cpu-devices",
            2,
            "--workdir",
            tmp_path,
            *TINY,
            *FSDP,
            "--steps",
            8,
            "--set",
            f"diloco.exchange={tmp_path}/exchange",
            "--replica-id",
            1,
        ]
    )  # after replica 0 finished
    assert late.returncode == 0, late.stderr
    assert "replica 1 of 2 missed 4 syncs since step 0 (first at step 2); rejoining at step 8" in late.stderr
    assert records(tmp_path / "replica_1", "eval_loss") == {8: records(tmp_path / "replica_0", "eval_loss")[8]}
    assert (tmp_path / "replica_1" / "checkpoints" / "8").is_dir()  # the final global params, as its own result

    both = subprocess.run(
        launch_cmd(tmp_path, "--steps", 12), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert both.returncode == 0, both.stdout + both.stderr
    assert "[p0] params" in both.stdout and "[p1] params" in both.stdout
    assert both.stdout.count("resuming at step 8") == 2, both.stdout
    assert [members(tmp_path, s) for s in (10, 12)] == [[0, 1]] * 2
    final = [records(tmp_path / f"replica_{i}", "eval_loss") for i in (0, 1)]
    assert sorted(final[1]) == [8, 12] and final[0][12] == final[1][12]  # the same global params, bit for bit
    assert records(tmp_path / "replica_1", "loss").keys() == set(range(9, 13))


def test_bad_replica_settings_exit_2_with_one_line(tmp_path, capsys):
    """Through the command's main() in this process; the layout case, which asks for 4 CPU devices where this
    process has 8, as a process of its own."""
    base = ["--workdir", tmp_path, *TINY, "--steps", 2]
    cases = [
        (
            ["--set", f"diloco.exchange={tmp_path}/ex", "--replica-id", 2],
            "diloco.replica must be in [0, diloco.replicas = 2), got 2",
        ),
        (["--set", f"diloco.exchange={tmp_path}/ex", "--set", "diloco.drop=1@1-2"], "leave diloco.drop empty"),
        (["--replica-id", 1], "--replica-id needs DiLoCo replicas in their own processes"),
    ]
    for extra, message in cases:
        code, err = tiny_lm_main([str(a) for a in (*base, *extra)]), capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (extra, err)
    layout = ["--mesh", REPO / "experiments/meshes/replicas2_fsdp.py", "--cpu-devices", 4]
    proc = run(["-m", "experiments.tiny_lm", *base, "--set", f"diloco.exchange={tmp_path}/ex", *layout], timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "the mesh layout's replica axis must be 1, got 2" in proc.stderr


@pytest.mark.slow  # covered by the killed-replica, left-out and heartbeat tests (docs/testing.md)
def test_process_failure_experiment_end_to_end(tmp_path, capsys):
    """The experiment's three runs on a tiny config: the lost replica's run finishes, its survivor did not wait for
    the dead replica beyond its heartbeat, and the last line is the JSON summary."""
    from experiments import diloco_process_failure

    tiny = [
        "model.d_model=32",
        "model.num_layers=2",
        "model.mlp_dim=64",
        "model.num_heads=2",
        "model.num_kv_heads=1",
        "data.seq_len=16",
        "data.batch_size=4",
        "data.eval_batches=1",
        "diloco.inner_steps=2",
        "optim.warmup_steps=1",
        "log_every=1",
    ]
    code = diloco_process_failure.main(
        [
            "--workdir",
            str(tmp_path),
            "--steps",
            "12",
            "--kill-at",
            "6",
            "--replicas",
            "2",
            "--timeout",
            "60",
            "--heartbeat",
            "3",
            *[a for kv in tiny for a in ("--set", kv)],
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    summary = json.loads(out.strip().splitlines()[-1])
    assert set(summary) == {
        "no_failure_eval_loss",
        "lost_vs_no_failure_pct",
        "restarted_vs_no_failure_pct",
        "lost_eval_loss",
        "restarted_eval_loss",
    }
    lost = json.loads((tmp_path / "lost" / "result.json").read_text())
    assert lost["killed_after_step"] >= 6 and lost["kept_syncs_by_members"].get("1", 0) >= 1  # it went on alone
    assert lost["survivor_wait_s"] < 30  # its heartbeat stood still for 3 s: the 60 s timeout did not matter
    assert "went on without replica 1 (no heartbeat for" in (tmp_path / "lost" / "replica_0.log").read_text()
    assert "| no_failure | " in out and "| lost | " in out


# ----------------------------------------------------------------------------- catching up, in process


def test_a_restarted_replica_replays_rejoins_from_a_snapshot_or_refuses_a_tidied_exchange(tmp_path):
    """Replica 0 trains 6 steps alone (replica 1 never posts: syncs 2, 4, 6 are decided without it). Replica 1,
    starting at step 0, missed them: it rejoins at the newest snapshot with replica 0's global params and step.
    Replica 0 took part in all of them: from step 0 it would replay. With a sync tidied away and no snapshot left,
    replaying is impossible and deciding it anew would fork the params: refused, naming the step."""

    def program(replica):
        diloco = DiLoCoConfig(
            replicas=2, inner_steps=2, exchange=str(tmp_path / "ex"), replica=replica, sync_timeout_s=0.3
        )
        return ProcessDiLoCoProgram(
            validate(dataclasses.replace(tiny_config(steps=8), diloco=diloco)), one_device_mesh()
        )

    first, notes = program(0), []
    state = first.init()
    step_fn = first.compile_step(state, first.device_batch(random_batch(0, batch=4)))
    for t in range(1, 7):
        state, _ = step_fn(state, first.device_batch(random_batch(t, batch=4)), t)
    assert first.members == (0,) and first.exchange.snapshots() == [4, 6]

    second = program(1)
    rejoined, data_state = second.catch_up(second.init(), log=notes.append)
    assert int(rejoined.step) == 6 and data_state == {}
    assert "replica 1 of 2 missed 3 syncs since step 0 (first at step 2); rejoining at step 6" in notes[-1]
    for got, want in zip(jax.tree.leaves(rejoined.global_params), jax.tree.leaves(state.global_params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for got, want in zip(jax.tree.leaves(rejoined.replicas.params), jax.tree.leaves(state.global_params)):
        np.testing.assert_array_equal(np.asarray(got)[0], np.asarray(want))  # it continues from the global params

    _, moved = first.catch_up(first.init(), log=notes.append)
    assert moved is None and "replica 0 of 2: replaying 3 decided syncs after step 0" in notes[-1]

    shutil.rmtree(first.exchange.sync_dir(2, 0))
    for step in first.exchange.snapshots():
        (tmp_path / "ex" / f"snapshot_{step:09d}.npz").unlink()
    with pytest.raises(ExchangeError, match="no longer holds the sync at step 2 and has no newer snapshot"):
        first.catch_up(first.init(), log=notes.append)
