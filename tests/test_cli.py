"""The experiment CLI contract (experiments/cli.py), exercised as a user would: `python -m experiments.tiny_lm ...`."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from data import write_token_file
from data.text_tokenizer import load_tokenizer
from experiments.tiny_lm import main as tiny_lm_main
from jaxlm.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
TINY = ["--set", "model.d_model=64", "--set", "model.num_layers=2", "--set", "model.mlp_dim=128"]
# for runs whose losses are what a test reads: no eval programs to compile, no samples to generate
NO_EVAL = ["--set", "eval_every=0", "--set", "eval_prompts=", "--set", "data.eval_batches=0"]


def tiny_lm(*args, timeout=300):
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.tiny_lm", *map(str, args)],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.perf_counter() - t0


def loss_records(workdir):
    return [r for r in read_metrics(workdir / "metrics.jsonl") if "loss" in r]


def checkpoint_steps(workdir):
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def test_tiny_run_end_to_end_then_resume(tmp_path):
    workdir = tmp_path / "run"
    # optim.decay_steps: the same schedule for --steps 3 and 5, so the resumed run reuses the compiled programs;
    # batches of 8 x 64 tokens, not 16 x 256: what is checked does not depend on them
    tiny = [*TINY, "--set", "optim.decay_steps=5", "--set", "data.seq_len=64", "--set", "data.batch_size=8"]
    proc, _ = tiny_lm(
        *("--steps", 3, "--workdir", workdir, "--log-every", 1, *tiny),
        *("--set", "eval_prompts=def |x = ", "--set", "eval_sample_tokens=8"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "3/3" in proc.stderr  # the progress bar ran to the end

    records = loss_records(workdir)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert isinstance(r["step"], int)
        for key in ("loss", "lr", "tokens_per_s"):
            assert isinstance(r[key], float) and np.isfinite(r[key]) and r[key] > 0, (key, r)
    assert checkpoint_steps(workdir) == [3]
    events = list((workdir / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    assert (workdir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((workdir / "config.json").read_text())
    assert saved["model"]["d_model"] == 64 and saved["steps"] == 3
    # tiny_lm reads the default corpus with a 4096-token BPE trained on it: the vocabulary follows that tokenizer,
    # the untrained model's loss is ln 4096, the workdir keeps the tokenizer, and eval reports bits per byte.
    assert (saved["model"]["vocab_size"], saved["model"]["tokenizer_vocab_size"]) == (4096, 4096)
    assert abs(records[0]["loss"] - np.log(4096)) < 0.15, records[0]
    assert load_tokenizer(workdir).vocab_size == 4096
    evals = [r for r in read_metrics(workdir / "metrics.jsonl") if "eval_loss" in r]
    tokens_per_byte = evals[-1]["eval_bits_per_byte"] * np.log(2) / evals[-1]["eval_loss"]
    assert 0.2 < tokens_per_byte < 0.5  # a BPE token stands for several bytes of Python
    samples = evals[-1]["eval_samples"]  # greedy continuations of eval_prompts, also in the run log
    assert [s["prompt"] for s in samples] == ["def ", "x ="] and all(
        isinstance(s["continuation"], str) for s in samples
    )
    assert f"sample at step 3: 'def ' -> {samples[0]['continuation'][:120]!r}" in proc.stderr

    proc, _ = tiny_lm(  # the first run's eval and samples too: their programs come from the compilation cache
        *("--steps", 5, "--workdir", workdir, "--log-every", 1, *tiny),
        *("--set", "eval_prompts=def |x = ", "--set", "eval_sample_tokens=8", "--no-progress"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "resuming at step 3" in proc.stderr
    resumed = loss_records(workdir)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    assert resumed[:3] == records  # the first run's record is kept as it was
    assert checkpoint_steps(workdir)[-1] == 5

    # Same workdir, different model: refused in one line, before compiling, with the record untouched.
    before = (workdir / "metrics.jsonl").read_text()
    proc, seconds = tiny_lm("--steps", 6, "--workdir", workdir, *tiny, "--set", "model.d_model=32", "--no-progress")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tiny_lm: error: "), proc.stderr
    assert "model.d_model: 64 -> 32" in lines[0]
    assert seconds < 20
    assert (workdir / "metrics.jsonl").read_text() == before


@pytest.mark.slow  # covered by test_tiny_run_end_to_end_then_resume: the same command, smaller (docs/testing.md)
def test_no_flags_but_steps_and_workdir(tmp_path):
    """Exactly the command from the issue: the default config, the default corpus, one CPU device."""
    workdir = tmp_path / "tmp"
    proc, _ = tiny_lm("--steps", 3, "--workdir", workdir)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "3/3" in proc.stderr  # the progress bar ran to the end
    records = loss_records(workdir)
    assert records and records[-1]["step"] == 3
    assert all(k in records[-1] for k in ("loss", "lr", "tokens_per_s"))
    assert 0 < records[-1]["loss"] < np.log(384) + 0.5  # a few steps from a uniform guess, not diverging
    assert any("eval_loss" in r for r in read_metrics(workdir / "metrics.jsonl"))
    assert checkpoint_steps(workdir) == [3]
    assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))
    assert (workdir / "loss.png").is_file()


# ----------------------------------------------------------------------------- bad input: exit 2, one line, fast


def token_dir(tmp_path, damage=None, vocab=64):
    """A token file of 2001 tokens (fewer than one default batch), damaged as named."""
    path = write_token_file(tmp_path / "tokens", [np.arange(2000) % (vocab - 1)], vocab_size=vocab, eos_id=vocab - 1)
    tokens_bin, meta_json = path / "tokens.bin", path / "meta.json"
    meta = json.loads(meta_json.read_text())
    if damage == "truncate":
        tokens_bin.write_bytes(tokens_bin.read_bytes()[:-10])
    elif damage == "no_meta":
        meta_json.unlink()
    elif damage == "zero_tokens":
        tokens_bin.write_bytes(b"")
        meta_json.write_text(json.dumps({**meta, "num_tokens": 0}))
    elif damage == "meta_not_json":
        meta_json.write_text("{not json")
    elif damage == "meta_without_num_tokens":
        meta_json.write_text(json.dumps({k: v for k, v in meta.items() if k != "num_tokens"}))
    elif damage == "ids_beyond_meta":  # meta.json still says max_token_id 63: only reading tokens.bin tells
        tokens = np.fromfile(tokens_bin, "<u2")
        tokens[1234] = 1000
        tokens.tofile(tokens_bin)
    return path


def mesh_file(tmp_path, source):
    path = tmp_path / "mesh.py"
    path.write_text(source)
    return path


def config_file(tmp_path, body):
    """A config file whose `body` starts on line 2, after the import."""
    path = tmp_path / "bad_config.py"
    path.write_text("from jaxlm.config import ModelConfig, TrainConfig\n" + body)
    return path


def empty_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


def under_a_file(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    return tmp_path / "a_file" / "run"


def read_only_dir(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes through permission bits (the CLI's probe write is what catches it there)")
    (tmp_path / "read_only").mkdir(mode=0o555)
    return tmp_path / "read_only"


def data_path(path, *more):
    return ["--set", f"data.path={path}", *more]


BAD_INPUTS = {
    "negative_steps": (lambda tmp: ["--steps", -3], r"steps must be positive, got -3"),
    "unknown_key": (
        lambda tmp: ["--set", "model.nonexistent=1"],
        r"unknown config key 'model.nonexistent': ModelConfig has no field 'nonexistent'",
    ),
    "missing_config": (lambda tmp: ["--config", "missing.py"], r"config file not found: missing.py"),
    "bad_int": (lambda tmp: ["--set", "model.d_model=abc"], r"bad value for model.d_model: 'abc' is not a valid int"),
    "mesh_product": (
        lambda tmp: ["--mesh", mesh_file(tmp, "layout = {'data': 2, 'fsdp': 2}\n")],
        r"data=2 x fsdp=2 covers 4 devices but 1 are available",
    ),
    "mesh_unknown_axis": (
        lambda tmp: ["--mesh", mesh_file(tmp, "layout = {'data': 1, 'model': 1}\n")],
        r"unknown mesh axis 'model'",
    ),
    "truncated_tokens": (
        lambda tmp: ["--set", f"data.path={token_dir(tmp, 'truncate')}"],
        r"truncated: meta.json says 2001 tokens \(4002 bytes\) but tokens.bin has 3992 bytes",
    ),
    "missing_meta": (lambda tmp: ["--set", f"data.path={token_dir(tmp, 'no_meta')}"], r"missing meta.json"),
    "vocab_too_big": (
        lambda tmp: ["--set", f"data.path={token_dir(tmp, vocab=1000)}", "--set", "model.vocab_size=384"],
        r"model.vocab_size 384 is smaller than the data's tokenizer's 1000 ids",
    ),
    "unknown_flag": (lambda tmp: ["--stesp", 3], r"unrecognized arguments: --stesp"),
    "bad_mask_spec": (
        lambda tmp: ["--set", "model.attention_mask=causal & sliding(4)"],
        r"model.attention_mask: attention mask spec 'causal & sliding\(4\)': cannot read 'sliding\(4\)'",
    ),
    "bad_attention_impl": (
        lambda tmp: ["--set", "model.attention_impl=flash"],
        r"model.attention_impl must be one of \['auto', 'jax', 'pallas', 'reference', 'xla_blocksparse'\]",
    ),
    "heads_vs_kv_heads": (lambda tmp: ["--set", "model.num_kv_heads=3"], r"must be divisible by model.num_kv_heads"),
    "rules_clash": (
        lambda tmp: ["--mesh", mesh_file(tmp, "layout = {'data': 1, 'rules': {'mlp': 'fsdp'}}\n")],
        r"logical axes 'embed' and 'mlp' .* both map to mesh axis 'fsdp'",
    ),
    "indivisible_embed": (
        lambda tmp: [
            "--cpu-devices",
            8,
            "--mesh",
            mesh_file(tmp, "layout = {'fsdp': 8}\n"),
            "--set",
            "model.num_heads=2",
            "--set",
            "model.d_model=260",
            "--set",
            "data.microbatches=1",
        ],
        r"logical axis 'embed' of size 260 .* mesh axis 'fsdp' = 8",
    ),
    # config files
    "config_syntax_error": (
        lambda tmp: ["--config", config_file(tmp, "config = TrainConfig(\n")],
        r"config file .*bad_config.py: syntax error at line 2: '\(' was never closed",
    ),
    "config_undefined": (
        lambda tmp: ["--config", config_file(tmp, "cfg = TrainConfig()\n")],
        r"config file .*bad_config.py must define `config`",
    ),
    "config_str_for_int": (
        lambda tmp: ["--config", config_file(tmp, "config = TrainConfig(steps='ten')\n")],
        r"config file .*bad_config.py: steps must be int, got str 'ten'",
    ),  # despite --steps 3
    "config_float_for_int": (
        lambda tmp: ["--config", config_file(tmp, "config = TrainConfig(model=ModelConfig(d_model=1.5))\n")],
        r"config file .*bad_config.py: model.d_model must be int, got float 1.5",
    ),
    "config_unknown_keyword": (
        lambda tmp: ["--config", config_file(tmp, "config = TrainConfig(model=ModelConfig(d_modle=64))\n")],
        r"bad_config.py, line 2: ModelConfig has no field 'd_modle' \(did you mean 'd_model'",
    ),
    "config_raises": (
        lambda tmp: ["--config", config_file(tmp, "def config():\n    raise KeyError('LR')\n")],
        r"bad_config.py, line 3 raised KeyError: 'LR'",
    ),
    # mesh layout files
    "mesh_syntax_error": (
        lambda tmp: ["--mesh", mesh_file(tmp, "layout = {'data': 1\n")],
        r"mesh layout file .*mesh.py: syntax error at line 1",
    ),
    "mesh_undefined": (
        lambda tmp: ["--mesh", mesh_file(tmp, "lay_out = {'data': 1}\n")],
        r"mesh layout file .*mesh.py must define `layout`",
    ),
    "mesh_float_axis": (
        lambda tmp: ["--mesh", mesh_file(tmp, "layout = {'data': 1.5}\n")],
        r"mesh layout file .*mesh.py: mesh axis 'data' must be a positive int, got 1.5",
    ),
    "mesh_zero_axis": (
        lambda tmp: ["--mesh", mesh_file(tmp, "layout = {'data': 0}\n")],
        r"mesh axis 'data' must be a positive int, got 0",
    ),
    "mesh_negative_axis": (
        lambda tmp: ["--mesh", mesh_file(tmp, "layout = {'fsdp': -1}\n")],
        r"mesh axis 'fsdp' must be a positive int, got -1",
    ),
    "mesh_wrong_type": (
        lambda tmp: ["--mesh", mesh_file(tmp, "layout = [1, 1]\n")],
        r"mesh layout file .*mesh.py: `layout` is a list, expected MeshLayout or dict",
    ),
    "context_with_cudnn_attention": (
        lambda tmp: (
            ["--cpu-devices", 2, "--mesh", mesh_file(tmp, "layout = {'context': 2}\n")]
            + ["--set", "model.attention_impl=jax"]
        ),
        r"mesh axis 'context' splits the sequence, which attention_impl 'jax' .* cannot take",
    ),
    # data paths
    "data_missing": (lambda tmp: data_path(tmp / "nope"), r"token file .*nope: directory does not exist"),
    "data_empty_dir": (lambda tmp: data_path(empty_dir(tmp)), r"token file .*empty: empty directory"),
    "data_zero_tokens": (lambda tmp: data_path(token_dir(tmp, "zero_tokens")), r"token file .*: empty \(0 tokens\)"),
    "data_too_few_tokens": (
        lambda tmp: data_path(token_dir(tmp)),
        r"holds 2001 tokens, fewer than one batch of data.batch_size x data.seq_len \+ 1 = 4097",
    ),
    "data_val_split_too_small": (
        lambda tmp: data_path(
            token_dir(tmp), "--set", "data.seq_len=64", "--set", "data.batch_size=4", "--set", "data.microbatches=1"
        ),
        r"val_fraction=0.01 of 2001 tokens gives 20 validation tokens, fewer than one "
        r"window of seq_len\+1=65; adjust data.val_fraction",
    ),
    "meta_not_json": (lambda tmp: data_path(token_dir(tmp, "meta_not_json")), r"meta.json is not valid JSON"),
    "meta_without_num_tokens": (
        lambda tmp: data_path(token_dir(tmp, "meta_without_num_tokens")),
        r"meta.json field 'num_tokens' must be a non-negative integer, got None",
    ),
    "ids_beyond_meta": (
        lambda tmp: data_path(token_dir(tmp, "ids_beyond_meta")),
        r"tokens.bin holds token id 1000 but meta.json says max_token_id 63",
    ),
    # --workdir
    "workdir_under_a_file": (
        lambda tmp: ["--workdir", under_a_file(tmp)],
        r"--workdir .*a_file/run: .*a_file exists and is not a directory",
    ),
    "workdir_read_only": (lambda tmp: ["--workdir", read_only_dir(tmp)], r"--workdir .* is not writable"),
}


# As a process (exit status, stderr, no traceback) for one case of each kind and those that depend on the process's
# devices (one CPU device, or --cpu-devices); the rest call the command's main() in this process (8 simulated
# devices), the same code (a process each took ~1.2 s of the suite's time, 37 of them).
AS_A_PROCESS = (
    "negative_steps",
    "ids_beyond_meta",
    "workdir_read_only",
    "mesh_product",
    "rules_clash",
    "context_with_cudnn_attention",
    "data_val_split_too_small",
)


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_fails_fast_with_one_line(tmp_path, case, capsys):
    make_args, message = BAD_INPUTS[case]
    workdir = tmp_path / "run"
    args = make_args(tmp_path)
    if "--steps" not in args:
        args += ["--steps", 3]
    argv = ["--workdir", workdir, "--no-progress", *args]
    if case in AS_A_PROCESS:
        proc, seconds = tiny_lm(*argv, timeout=60)
        code, err = proc.returncode, proc.stderr
    else:
        t0 = time.perf_counter()
        code = tiny_lm_main([str(a) for a in argv])
        seconds, err = time.perf_counter() - t0, capsys.readouterr().err
    assert code == 2, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tiny_lm: error: ")
    assert "Traceback" not in err
    assert re.search(message, lines[0]), lines[0]
    assert seconds < 20, f"took {seconds:.1f}s: bad input must fail before compilation"
    assert not (workdir / "checkpoints").exists() and not (workdir / "metrics.jsonl").exists()


# pallas is slow: test_model and test_sharding show it computes what xla_blocksparse does (docs/testing.md)
@pytest.mark.slow  # the masks through Program: test_context.py and test_model.py; the CLI: test_tiny_run_end_to_end
@pytest.mark.parametrize("impl", ["xla_blocksparse", "pallas"])
def test_training_with_sliding_window_and_document_masks(tmp_path, impl):
    """The block-sparse implementations train tiny_lm through the CLI with a sliding window over packed documents
    (segment ids from the corpus's EOS tokens), on a 4-device data x fsdp mesh; the loss falls."""
    workdir = tmp_path / impl
    mesh = mesh_file(tmp_path, "layout = {'data': 2, 'fsdp': 2}\n")
    proc, _ = tiny_lm(
        "--steps",
        12,
        "--workdir",
        workdir,
        "--log-every",
        1,
        "--cpu-devices",
        4,
        "--mesh",
        mesh,
        *TINY,
        "--set",
        f"model.attention_impl={impl}",
        "--set",
        "model.attention_mask=causal & sliding_window(48) & document",
        "--set",
        "model.attention_block_q=32",
        "--set",
        "model.attention_block_kv=32",
        "--set",
        "data.seq_len=96",
        "--set",
        "data.batch_size=8",
        "--set",
        "data.microbatches=1",
        "--set",
        "optim.warmup_steps=2",
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [r["loss"] for r in loss_records(workdir)]
    assert len(losses) == 12 and all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < losses[0] - 0.5
    saved = json.loads((workdir / "config.json").read_text())
    assert saved["model"]["attention_mask"] == "causal & sliding_window(48) & document"


def test_pipeline_layout_end_to_end_and_resume_under_another_layout(tmp_path):
    """Train with the FSDP x TP x PP layout file, lose the last checkpoint, resume under DP x FSDP x TP: the resumed
    step's loss equals the one the pipelined run computed."""
    meshes = REPO / "experiments" / "meshes"
    workdir = tmp_path / "run"
    common = [
        "--workdir",
        workdir,
        "--cpu-devices",
        8,
        "--log-every",
        1,
        "--checkpoint-every",
        2,
        *TINY,
        "--set",
        "data.seq_len=64",
        "--set",
        "data.microbatches=1",
        *NO_EVAL,
        "--no-progress",
    ]
    proc, _ = tiny_lm("--steps", 3, "--mesh", meshes / "fsdp2_tp2_pp2.py", *common)
    assert proc.returncode == 0, proc.stderr
    assert "pipeline: 2 stages, 1f1b, 4 microbatches per step: bubble 20.0%" in proc.stderr
    pipelined = loss_records(workdir)
    assert [r["step"] for r in pipelined] == [1, 2, 3] and pipelined[2]["loss"] < pipelined[0]["loss"]

    shutil.rmtree(workdir / "checkpoints" / "3")  # as if the run had died after step 2's checkpoint
    proc, _ = tiny_lm("--steps", 3, "--mesh", meshes / "dp2_fsdp2_tp2.py", *common)
    assert proc.returncode == 0, proc.stderr
    assert "resuming at step 2" in proc.stderr
    resumed = loss_records(workdir)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    np.testing.assert_allclose(resumed[2]["loss"], pipelined[2]["loss"], rtol=1e-5)


@pytest.mark.slow
def test_context_parallel_run_resumes_under_another_layout_and_its_checkpoint_generates(tmp_path):
    """Train with the sequence split over 4 devices (ring attention, zigzag order), lose the last checkpoint, resume
    under DP x FSDP x TP: the resumed step's loss equals the context-parallel run's; the checkpoint then generates
    under no layout at all, and a generation layout with a context axis is refused in one line. (35 s; fast cover:
    test_context.py's equivalence to one device, test_pipeline_layout_end_to_end_and_resume_under_another_layout
    for resuming under another layout, test_context.py's generation refusal.)"""
    meshes = REPO / "experiments" / "meshes"
    workdir = tmp_path / "run"
    common = ["--workdir", workdir, "--cpu-devices", 8, "--log-every", 1, "--checkpoint-every", 2, *TINY]
    common += ["--set", "data.seq_len=64", "--set", "data.microbatches=1", "--set", "model.attention_impl=pallas"]
    proc, _ = tiny_lm("--steps", 3, "--mesh", meshes / "context4_dp2.py", *common, "--no-progress")
    assert proc.returncode == 0, proc.stderr
    split = loss_records(workdir)
    assert [r["step"] for r in split] == [1, 2, 3] and split[2]["loss"] < split[0]["loss"]
    assert all(r["context_balance"] == 1.0 for r in split)  # causal, zigzag: every device keeps as many pairs

    shutil.rmtree(workdir / "checkpoints" / "3")
    proc, _ = tiny_lm("--steps", 3, "--mesh", meshes / "dp2_fsdp2_tp2.py", *common, "--no-progress")
    assert proc.returncode == 0 and "resuming at step 2" in proc.stderr, proc.stderr
    np.testing.assert_allclose(loss_records(workdir)[2]["loss"], split[2]["loss"], rtol=1e-5)

    generate = [sys.executable, "-m", "experiments.generate", "--workdir", str(workdir), "--prompt", "def "]
    generate += ["--max-new-tokens", "4"]
    ok = subprocess.run(generate, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.strip() and "step 3 of" in ok.stderr, ok.stderr
    refused = subprocess.run(
        [*generate, "--cpu-devices", "8", "--mesh", str(meshes / "context4_dp2.py")],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2 and "the layout has context=4" in refused.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("code", [0, 4])
def test_a_thread_left_behind_does_not_hang_the_command(code):
    """exit_with: a non-daemon thread that never ends (as a failed Orbax save can leave) would keep a plain
    sys.exit waiting forever; the process ends after the grace period with its own code and a line naming it."""
    script = (
        "import threading, time; from experiments.cli import exit_with; "
        "threading.Thread(target=time.sleep, args=(600,), name='stuck-save').start(); "
        f"print('done', flush=True); exit_with({code}, grace_s=1)"
    )
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == code and time.perf_counter() - t0 < 30
    assert proc.stdout == "done\n"
    assert (
        proc.stderr.strip()
        == f"note: background threads stuck-save still running 1s after the end; exiting with {code}"
    )


def test_every_experiment_module_ends_through_exit_with():
    """No command hangs after an error: every runnable experiment ends with exit_with(main())."""
    modules = [p for p in (REPO / "experiments").glob("*.py") if 'if __name__ == "__main__":' in p.read_text()]
    assert len(modules) > 10
    missing = [
        p.name for p in modules if "exit_with(main())" not in p.read_text().split('if __name__ == "__main__":')[1]
    ]
    assert not missing, missing


def test_a_compilation_cache_that_cannot_be_used_is_refused_before_anything_starts(tmp_path, capsys, monkeypatch):
    """JAX itself only warns (a raw UserWarning) and compiles everything again, uncached: the CLI refuses first."""
    import tempfile

    from experiments import tiny_lm as command

    a_file = tmp_path / "cache"
    a_file.write_text("")
    fix = "give a directory (made if missing), or none to run without the cache"
    cases = [
        (a_file, f"--compilation-cache {a_file} is a file, not a directory; {fix}"),
        (a_file / "sub", f"--compilation-cache {a_file}/sub is under {a_file}, a file, not a directory; {fix}"),
    ]
    for path, message in cases:
        assert command.main(["--workdir", str(tmp_path / "run"), "--compilation-cache", str(path)]) == 2
        assert capsys.readouterr().err.splitlines() == [f"tiny_lm: error: {message}"]

    def denied(*args, **kwargs):  # what a read-only directory does, even to root
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryFile", denied)
    assert command.main(["--workdir", str(tmp_path / "run"), "--compilation-cache", str(tmp_path / "c")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"tiny_lm: error: --compilation-cache {tmp_path}/c is not writable ({tmp_path}: Permission denied); give a "
        f"writable directory, or none to run without the cache"
    ]
    assert not (tmp_path / "run").exists() and not (tmp_path / "c").exists()


def test_an_evaluation_that_cannot_happen_is_refused_before_compiling(tmp_path, capsys):
    """The CLI validates what only training needs too (config_lib.validate_training): --set eval_every=1 with no
    validation split would otherwise train without ever evaluating."""
    from experiments import tiny_lm as command

    argv = ["--workdir", str(tmp_path / "run"), "--set", "eval_every=1", "--set", "data.val_fraction=0"]
    assert command.main([*argv, "--set", "eval_prompts="]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "tiny_lm: error: eval_every 1 asks for evaluation, but data.val_fraction is 0: nothing would be evaluated; "
        "set data.val_fraction above 0 (e.g. 0.01), or eval_every=0 to train without evaluating"
    ]
    assert not (tmp_path / "run").exists()
