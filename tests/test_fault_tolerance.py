"""In-process failure handling: non-finite steps, preemption signals, corrupt and incomplete checkpoints,
time-based saves, goodput records and torn metrics lines. The subprocess kill/corrupt sweep is in
tests/fault_injection/."""

import dataclasses
import os
import re
import signal

import jax
import numpy as np
import pytest
from helpers import one_device_mesh, random_batch, random_token_file, tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from data import SeededBatchIterator, TokenFile
from jaxlm.checkpoint import TMP_MARKER, Checkpointer, integrity
from jaxlm.goodput import append_record, read_goodput
from jaxlm.metrics import read_metrics
from jaxlm.preemption import Preempted
from jaxlm.train import Program
from jaxlm.trainer import Trainer, TrainingDiverged

STEPS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tokens = TokenFile.open(random_token_file(tmp_path_factory.mktemp("data") / "tokens")).tokens
    cfg = tiny_config(
        steps=STEPS, checkpoint_every=2, optim=dict(learning_rate=1e-2, warmup_steps=2, decay_steps=STEPS)
    )
    return tokens, cfg, one_device_mesh()


class Faulty:
    """A real batch iterator with faults on chosen batches (1-based): a NaN loss mask (what a corrupt sample
    does to the loss), or a signal sent to this process while the batch is fetched."""

    def __init__(self, inner, nan_at=(), signal_at=None):
        self.inner, self.nan_at, self.signal_at, self.n = inner, set(nan_at), signal_at, 0

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.inner)
        self.n += 1
        if self.n in self.nan_at:
            batch = {**batch, "loss_mask": np.full_like(batch["loss_mask"], np.nan)}
        if self.signal_at and self.n == self.signal_at[0]:
            os.kill(os.getpid(), self.signal_at[1])
        return batch

    def get_state(self):
        return self.inner.get_state()

    def set_state(self, state):
        self.inner.set_state(state)


def train(setup, workdir, *, faults=None, **overrides):
    tokens, cfg, mesh = setup
    cfg = dataclasses.replace(cfg, **overrides)
    batches = SeededBatchIterator(tokens, batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len, seed=cfg.seed)
    trainer = Trainer(cfg, mesh, workdir, Faulty(batches, **(faults or {})), [], progress=False)
    return trainer.run()


def losses(workdir):
    return [(r["step"], r["loss"]) for r in read_metrics(workdir / "metrics.jsonl") if "loss" in r]


@pytest.fixture(scope="module")
def straight(setup, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("straight")
    train(setup, workdir)
    return losses(workdir)


# ----------------------------------------------------------------------------- numerical faults


def test_a_non_finite_step_leaves_params_and_optimizer_state_alone(setup):
    _, cfg, mesh = setup
    program = Program(cfg, mesh)
    state = program.init()
    before = jax.device_get(state)
    bad = random_batch(0)
    bad["loss_mask"] = np.full_like(bad["loss_mask"], np.nan)
    state, metrics = program.train_step(state, program.device_batch(bad))
    assert float(metrics["skipped"]) == 1.0 and not np.isfinite(float(metrics["loss"]))
    after = jax.device_get(state)
    assert int(after.step) == 1  # the step counter moves on with the data
    for a, b in zip(
        jax.tree.leaves(before.params) + jax.tree.leaves(before.opt_state),
        jax.tree.leaves(after.params) + jax.tree.leaves(after.opt_state),
    ):
        np.testing.assert_array_equal(a, b)
    state, metrics = program.train_step(state, program.device_batch(random_batch(1)))
    assert float(metrics["skipped"]) == 0.0 and np.isfinite(float(metrics["loss"]))


def test_skipped_steps_are_counted_and_training_goes_on(setup, tmp_path):
    last = train(setup, tmp_path, faults=dict(nan_at={3}))
    assert last["step"] == STEPS and last["skipped_steps"] == 1
    assert np.isfinite(last["loss"])


def test_consecutive_bad_steps_stop_with_a_checkpoint_of_the_last_good_weights(setup, tmp_path):
    with pytest.raises(TrainingDiverged, match=r"3 consecutive steps up to step 5 .* checkpointed at step 5"):
        train(setup, tmp_path, max_bad_steps=3, faults=dict(nan_at={3, 4, 5, 6}))
    ckpt = Checkpointer(tmp_path / "checkpoints")
    assert ckpt.all_steps() == [2, 4, 5]
    _, cfg, mesh = setup
    program = Program(cfg, mesh)
    good, _, _ = ckpt.restore(2, program.abstract_with_shardings())
    stopped, _, _ = ckpt.restore(5, program.abstract_with_shardings())
    ckpt.close()
    # steps 3-5 were all skipped: the weights written at the stop are those of step 2, the last good step
    for a, b in zip(jax.tree.leaves(jax.device_get(good.params)), jax.tree.leaves(jax.device_get(stopped.params))):
        np.testing.assert_array_equal(a, b)


def test_a_state_with_non_finite_values_is_never_saved(setup, tmp_path):
    from jaxlm.checkpoint import CheckpointSaveError

    _, cfg, mesh = setup
    good = Program(cfg, mesh).init()
    state = dataclasses.replace(good, params=jax.tree.map(lambda x: x * np.nan, good.params))
    ckpt = Checkpointer(tmp_path / "checkpoints", async_save=False)
    with pytest.raises(
        CheckpointSaveError, match="refusing to checkpoint step 1: .* non-finite .*; there is no earlier"
    ):
        ckpt.save(1, state, {}, {})
    assert ckpt.all_steps() == []
    ckpt.save(1, good, {}, {})
    with pytest.raises(
        CheckpointSaveError, match=r"refusing to checkpoint step 2: .*; the last checkpoint, step 1, is"
    ):
        ckpt.save(2, state, {}, {})
    assert ckpt.all_steps() == [1]
    ckpt.close()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 1e300 as float32: the point
def test_weights_an_update_made_non_finite_are_refused_naming_the_learning_rate(setup, tmp_path):
    """A learning rate past float32 (config validation refuses one; the trainer does not validate) turns step 1's
    finite update into inf weights: step 2's loss is non-finite and skipped, and the save at step 2 is refused with
    the true state of the checkpoints and the likely cause."""
    from jaxlm.checkpoint import NonFiniteState

    _, cfg, _ = setup
    with pytest.raises(NonFiniteState) as caught:
        train(setup, tmp_path, optim=dataclasses.replace(cfg.optim, learning_rate=1e300), steps=2)
    assert re.fullmatch(
        r"refusing to checkpoint step 2: \d+ leaves hold non-finite values \(first: params\..*\); there is no "
        r"earlier checkpoint; an optimizer update made the weights non-finite \(step 2 was the first with a "
        r"non-finite loss or gradient\): lower optim.learning_rate \(now 1e\+300\) and rerun",
        str(caught.value),
    ), caught.value
    assert read_goodput(tmp_path)[-1]["outcome"] == "checkpoint_failed"


# ----------------------------------------------------------------------------- preemption


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_after_the_step_with_a_checkpoint_and_the_rerun_matches(setup, straight, tmp_path, sig):
    # the signal arrives while batch 4 is fetched, i.e. during step 3: step 3 completes and is saved
    before = signal.getsignal(sig)  # the default, or SIG_IGN when pytest runs as a background job of a shell
    with pytest.raises(Preempted, match=rf"{sig.name} after step 3: checkpoint written in"):
        train(setup, tmp_path, checkpoint_every=0, faults=dict(signal_at=(4, sig)))
    assert Checkpointer(tmp_path / "checkpoints").all_steps() == [3]  # 0 steps lost
    assert signal.getsignal(sig) == before  # handlers restored
    train(setup, tmp_path, checkpoint_every=0)
    assert losses(tmp_path) == straight
    records = read_goodput(tmp_path)
    assert [r["outcome"] for r in records] == ["preempted", "finished"]
    assert records[1]["lost_steps"] == 0


# ----------------------------------------------------------------------------- checkpoint corruption


def _damage(step_dir, how):
    files = sorted((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    biggest = files[-1]
    if how == "flip_byte":  # read back without complaint by Orbax: caught by the integrity digest
        data = bytearray(biggest.read_bytes())
        data[len(data) // 2] ^= 0x01
        biggest.write_bytes(bytes(data))
    elif how == "truncate":
        biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    elif how == "delete_file":
        biggest.unlink()
    elif how == "garbage_config":
        (step_dir / "config" / "metadata").write_text("{not json")


@pytest.mark.parametrize("how", ["flip_byte", "truncate", "delete_file", "garbage_config"])
def test_a_corrupt_latest_checkpoint_is_moved_aside_and_the_previous_one_resumes_exactly(
    setup, straight, tmp_path, how
):
    train(setup, tmp_path, steps=4)  # checkpoints 2 and 4
    _damage(tmp_path / "checkpoints" / "4", how)
    train(setup, tmp_path)
    assert losses(tmp_path) == straight  # resumed from 2, bit for bit
    assert (tmp_path / "checkpoints.corrupt" / "4").is_dir()  # kept for inspection, never deleted
    assert Checkpointer(tmp_path / "checkpoints").all_steps() == [2, 4, 6]
    records = read_goodput(tmp_path)
    assert records[-1]["lost_steps"] == 2  # steps 3 and 4 were computed twice


def test_when_no_checkpoint_verifies_nothing_is_moved_and_the_run_does_not_start_over(setup, tmp_path):
    from jaxlm.checkpoint import CheckpointCorrupt

    train(setup, tmp_path, steps=4)
    for step in (2, 4):
        _damage(tmp_path / "checkpoints" / str(step), "flip_byte")
    before = (tmp_path / "metrics.jsonl").read_text()
    # A flipped byte reads back as other values (a checksum mismatch) or, where it lands in a zstd frame's header
    # (the chunk layout varies run to run), as TensorStore's read error: either names what is wrong with step 4.
    with pytest.raises(
        CheckpointCorrupt, match=r"no checkpoint in .* is usable: step 4: [^;]*(checksum|Error reading \").*; step 2: "
    ):
        train(setup, tmp_path)
    assert Checkpointer(tmp_path / "checkpoints").all_steps() == [2, 4]
    assert not (tmp_path / "checkpoints.corrupt").exists()
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_bits_that_read_back_as_nan_are_reported_as_a_checksum_mismatch(tmp_path):
    """A flipped bit can turn a value into NaN; the message names the cause (the file changed), not only the NaN."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from jaxlm.checkpoint import CheckpointCorrupt

    ckpt = Checkpointer(tmp_path, async_save=False)
    good = {"w": jnp.arange(8, dtype=jnp.float32)}
    damaged = {"w": good["w"].at[3].set(jnp.nan)}  # what a flipped exponent bit reads back as
    ckpt.manager.save(
        1,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(damaged),
            data=ocp.args.JsonSave({}),
            config=ocp.args.JsonSave({}),
            integrity=ocp.args.JsonSave(integrity(good)),
        ),
    )
    ckpt.wait()
    with pytest.raises(CheckpointCorrupt, match=r"^w does not match its saved checksum \(it now holds 1 non-finite"):
        ckpt.restore(1, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), good))
    ckpt.close()


_TRUNCATED_RESTORE = """
import gc, sys, jax, numpy as np
from jaxlm.checkpoint import Checkpointer
ckpt = Checkpointer(sys.argv[1], async_save=False)
state = {f"w{i}": jax.numpy.asarray(np.random.default_rng(i).normal(size=4096), "float32") for i in range(8)}
for step in (1, 2):
    ckpt.save(step, state, {}, {})
files = [p for p in ckpt.directory.joinpath("2", "state").rglob("*") if p.is_file()]
biggest = max(files, key=lambda p: p.stat().st_size)
biggest.write_bytes(biggest.read_bytes()[:100])
abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
step, restored, _, _ = ckpt.restore_latest(abstract)
assert step == 1 and all((restored[k] == state[k]).all() for k in state)
for _ in range(3):  # the reads Orbax abandoned are collected here (in a training run: whenever the collector runs)
    gc.collect()
"""


def test_a_truncated_checkpoint_names_the_array_and_leaves_no_tracebacks(tmp_path):
    """Orbax wraps the read error in a line of slice indices and a TensorStore spec, and leaves the restore's other
    reads unawaited; each raises when collected. The log line gives the cause; nothing else reaches stderr."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _TRUNCATED_RESTORE, str(tmp_path / "checkpoints")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip()
    assert re.fullmatch(
        r'checkpoint step 2 is unusable \(ValueError: \w+: Error reading "w\d/[^"]*": .*\); '
        r"moved it to .*checkpoints.corrupt/2; resuming from step 1",
        line,
    ), line
    assert "TensorStore" not in line and "Exception ignored" not in proc.stderr, proc.stderr[-2000:]


def test_an_incomplete_save_left_by_a_crash_is_removed_and_logged(setup, tmp_path, capsys):
    train(setup, tmp_path, steps=2)
    leftover = tmp_path / "checkpoints" / f"4{TMP_MARKER}"
    (leftover / "state").mkdir(parents=True)
    (leftover / "state" / "partial").write_bytes(b"\0" * 100)
    train(setup, tmp_path, steps=4)
    assert not leftover.exists()
    assert f"removed incomplete checkpoint 4{TMP_MARKER}" in capsys.readouterr().err
    assert Checkpointer(tmp_path / "checkpoints").all_steps() == [2, 4]


# ----------------------------------------------------------------------------- time policy, records


def test_time_based_policy_saves_between_step_checkpoints(setup, tmp_path):
    train(setup, tmp_path, checkpoint_every=0, checkpoint_minutes=1e-9, keep_checkpoints=10)  # due every step
    assert Checkpointer(tmp_path / "checkpoints").all_steps() == list(range(1, STEPS + 1))


def test_goodput_record_splits_the_wall_time(setup, tmp_path):
    train(setup, tmp_path)
    (record,) = read_goodput(tmp_path)
    parts = sum(
        record[k] for k in ("startup_s", "restore_s", "compile_s", "data_s", "eval_s", "checkpoint_s", "step_s")
    )
    assert parts == pytest.approx(record["wall_s"], rel=1e-6)
    assert record["steps"] == STEPS and record["saves"] == STEPS // 2 and record["outcome"] == "finished"
    assert 0 < record["goodput"] < 1 and record["compile_s"] > 0


def test_a_metrics_line_torn_by_a_kill_is_ignored(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}]
    path.write_text('{"step": 1, "loss": 2.0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2 is not a JSON record"):
        read_metrics(path)
    (tmp_path / "goodput.jsonl").write_text('{"wall_s": 1.0}\n{"wall_')  # a run killed while appending
    assert append_record(tmp_path, {"wall_s": 2.0}) == [{"wall_s": 1.0}, {"wall_s": 2.0}]
    assert read_goodput(tmp_path) == [{"wall_s": 1.0}, {"wall_s": 2.0}]  # not glued to the torn line


# ----------------------------------------------------------------------------- the integrity digest


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(0, 32 * 4 * 8 - 1), st.sampled_from(["float32", "bfloat16", "int32"]))
def test_digest_sees_any_bit_flip_and_any_swap(seed, bit, dtype):
    x = np.random.default_rng(seed).normal(size=(4, 8)).astype(np.float32)
    x = np.asarray(jax.numpy.asarray(x * 100).astype(dtype))
    base = integrity({"x": x})["x"]["digest"]
    raw = x.reshape(-1).view(np.uint8).copy()
    raw[(bit // 8) % raw.size] ^= np.uint8(1 << (bit % 8))
    assert integrity({"x": raw.view(x.dtype).reshape(x.shape)})["x"]["digest"] != base
    swapped = x.copy().reshape(-1)
    if swapped[0] != swapped[1]:
        swapped[[0, 1]] = swapped[[1, 0]]
        assert integrity({"x": swapped.reshape(x.shape)})["x"]["digest"] != base


def test_digest_does_not_depend_on_the_sharding():
    x = np.random.default_rng(0).normal(size=(16, 24)).astype(np.float32)
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharded = jax.device_put(x, NamedSharding(mesh, P("a", "b")))
    assert integrity({"x": sharded}) == integrity({"x": x})


def test_an_abandoned_writes_error_collected_after_the_failure_line_is_not_printed(caplog):
    """A disk-full exit once ended with a bare "ValueError: OUT_OF_RANGE ... File too large" line after the run's
    own one: asyncio's "Future exception was never retrieved" for one of TensorStore's abandoned writes, collected
    late, its error raised in C++ (no traceback to tell it Orbax's). Before any failure is reported it is held (and
    printed at exit if nothing reports it); once one is, it is dropped."""
    import asyncio
    import gc
    import logging

    from jaxlm.checkpoint import _OneLineOrbaxFailures

    quiet, log = _OneLineOrbaxFailures(), logging.getLogger("asyncio")

    def abandon_a_failed_write():
        loop = asyncio.new_event_loop()
        future = loop.create_future()
        future.set_exception(ValueError("OUT_OF_RANGE: Failed to write 56678 bytes: File too large"))
        del future
        gc.collect()
        loop.close()

    gc.collect()  # futures earlier tests in this worker abandoned go to the process's filter, not this one (once 4)
    kept, log.filters = log.filters, [quiet]  # a Checkpointer of an earlier test installed the process's one
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            abandon_a_failed_write()
            assert caplog.records == [] and quiet.held and all("File too large" in h for h in quiet.held)
            quiet.held_back()  # a failed save reports its line
            abandon_a_failed_write()
            assert caplog.records == [] and quiet.held == []
    finally:
        log.filters = kept
