"""data.ownership: which command a directory belongs to, and the writers' refusals that rest on it; the
scratch copies writers build beside their outputs (data.atomic_dir), removed by a later run once their writer is
gone; and small files replaced whole or not at all (data.atomic_file)."""

import json
import os
import subprocess
import sys

import pytest

from data import atomic_dir
from data.atomic_file import write_atomic
from data.ownership import (
    DATASET,
    HF_MODEL,
    QUANTIZED,
    WORKDIR,
    OwnershipError,
    check_target,
    claim_workdir,
    kind_of,
    mark_workdir,
)
from data.text_sources import TextSourceError, find_inputs


@pytest.fixture
def dirs(tmp_path):
    """One directory of each kind, as their commands write them."""
    run = tmp_path / "run"
    (run / "checkpoints" / "2").mkdir(parents=True)
    mark_workdir(run)
    legacy = tmp_path / "legacy"  # a workdir written before the marker: its config.json is jaxlm's
    legacy.mkdir()
    (legacy / "config.json").write_text(json.dumps({"model": {"d_model": 8}, "data": {}, "steps": 2}))
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    (tokens / "manifest.json").write_text(json.dumps({"format": "jaxlm-token-shards", "version": 1}))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    int8 = tmp_path / "int8"
    int8.mkdir()
    (int8 / "manifest.json").write_text(json.dumps({"quantized_tensors": ["a"], "step": 2}))
    plain = tmp_path / "notes"
    plain.mkdir()
    (plain / "a.md").write_text("mine\n")
    return dict(run=run, legacy=legacy, tokens=tokens, hf=hf, int8=int8, plain=plain, root=tmp_path)


def test_each_kind_is_recognised_by_its_own_files(dirs):
    got = {name: kind_of(dirs[name]) for name in ("run", "legacy", "tokens", "hf", "int8", "plain")}
    assert got == dict(run=WORKDIR, legacy=WORKDIR, tokens=DATASET, hf=HF_MODEL, int8=QUANTIZED, plain=None)
    assert kind_of(dirs["root"] / "missing") is None and kind_of(dirs["plain"] / "a.md") is None


@pytest.mark.parametrize(
    "target, writes, refused",
    [
        ("run/checkpoints/hf", HF_MODEL, "is inside {run}/checkpoints, which belongs to a training workdir"),
        ("run/checkpoints/2/x.py", "a mesh layout file", "inside {run}/checkpoints"),
        ("run/tokenizer.json", "a tokenizer", "is {run}'s own tokenizer.json, part of a training workdir"),
        ("run/hf", HF_MODEL, None),  # an export beside the run's own files
        ("run/replica_0", WORKDIR, None),  # a DiLoCo replica's workdir
        ("tokens/run", WORKDIR, "is inside {tokens}, which belongs to a token dataset"),
        ("hf/tokens", DATASET, "is inside {hf}, which belongs to a Hugging Face model"),
        ("int8/x", HF_MODEL, "belongs to a quantized checkpoint"),
        ("tokens", WORKDIR, "is a token dataset (python -m data.prepare), not a training workdir"),
        ("hf", WORKDIR, "import it with python -m experiments.import_hf --hf {hf}"),
        ("tokens", DATASET, None),  # its own kind: the writer's --overwrite rules decide
        ("notes/new", DATASET, None),
    ],
)
def test_a_target_inside_or_of_another_kind_is_refused_in_one_line(dirs, target, writes, refused):
    path = dirs["root"] / target
    if refused is None:
        check_target(path, writes, "--out")
        return
    with pytest.raises(OwnershipError) as e:
        check_target(path, writes, "--out")
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"--out {path} ")
    assert refused.format(**dirs) in message


def test_training_claims_only_a_new_empty_or_training_workdir(dirs):
    for name in ("run", "legacy"):
        claim_workdir(dirs[name])
    claim_workdir(dirs["root"] / "new")
    (dirs["root"] / "empty").mkdir()
    claim_workdir(dirs["root"] / "empty")
    (dirs["root"] / "crashed").mkdir()  # a run killed between taking its lock and writing its marker
    (dirs["root"] / "crashed" / "run.lock").write_text("{}")
    claim_workdir(dirs["root"] / "crashed")
    with pytest.raises(OwnershipError, match=r"is not empty \(a.md\) and is not a training workdir"):
        claim_workdir(dirs["plain"])
    assert sorted(p.name for p in dirs["plain"].iterdir()) == ["a.md"]  # nothing written
    mark_workdir(dirs["legacy"])
    assert kind_of(dirs["legacy"]) == WORKDIR and (dirs["legacy"] / ".jaxlm-workdir").is_file()


def test_a_walk_for_text_never_reads_what_a_command_wrote(dirs):
    text = dirs["root"] / "text"
    text.mkdir()
    (text / "a.json").write_text("[]")
    for d in ("tokens", "hf"):  # outputs kept beside the text
        os.rename(dirs[d], text / d)
    (text / ".out.partial").mkdir()
    (text / ".out.partial" / "job.json").write_text("{}")
    assert find_inputs([str(text)], ["*.json"]) == [text / "a.json"]
    with pytest.raises(TextSourceError, match="is a token dataset"):
        find_inputs([str(text / "tokens")], ["*"])


def test_scratch_copies_of_a_gone_writer_are_removed_and_a_live_ones_kept(tmp_path):
    out = tmp_path / "hf"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = atomic_dir.scratch_path(out, "export-tmp").name.rsplit("-", 1)[0]
    gone = tmp_path / f"{host}-{int(dead.stdout)}"
    gone.mkdir()
    (gone / "shard").write_bytes(b"x" * 10)
    live = atomic_dir.scratch_path(out, "export-tmp")  # this process's
    live.mkdir()
    other = tmp_path / ".hf.import-tmp-elsewhere-1"  # another tag, another host: not ours to judge
    other.mkdir()
    assert atomic_dir.remove_abandoned(out, "export-tmp") == [gone]
    assert live.is_dir() and other.is_dir() and not gone.exists()


def test_a_file_is_replaced_whole_or_left_as_it_was(tmp_path):
    """A write that fails part way (here the writer raises after half its bytes) leaves the old file and no
    temporary beside it; text, bytes and writer functions all land whole."""
    path = tmp_path / "config.json"
    write_atomic(path, '{"old": 1}\n')

    def half_then_fail(f):
        f.write(b'{"new": ')
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_atomic(path, half_then_fail, durable=True)
    assert path.read_text() == '{"old": 1}\n'
    assert os.listdir(tmp_path) == ["config.json"]
    write_atomic(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    write_atomic(path, lambda f: f.write(b"whole"), durable=True)
    assert path.read_bytes() == b"whole" and os.listdir(tmp_path) == ["config.json"]
