"""The careless inputs of the bad-input catalogue (experiments.bad_input_catalogue runs them), one `Case` each.

Four classes: values and files a command refuses before it starts; directories that belong to another command
(a run into an HF export, an export into checkpoints/); signals in the middle of a write (SIGTERM, Ctrl-C once or
twice); a full disk (a file-size limit, RLIMIT_FSIZE, stands in for it: the same write error, on any machine).
`fast` cases run in the default test suite, one or more of each class; the rest run in the slow one.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
# A model whose one training step and save take a second or two: the cases that need a trained workdir.
TINY = [
    *("--set", "model.d_model=32", "--set", "model.num_layers=1", "--set", "model.mlp_dim=64"),
    *("--set", "model.max_seq_len=32", "--set", "data.seq_len=32", "--set", "data.batch_size=4"),
    *("--set", "data.microbatches=1", "--set", "eval_every=0", "--set", "tensorboard=false", "--no-progress"),
]


def env() -> dict:
    import os

    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONWARNINGS": "ignore"}


@dataclasses.dataclass(frozen=True)
class Case:
    """One careless input: `argv` after `python -m`, with {dir} (the case's scratch directory) and {trained} (a
    workdir with a finished 2-step run) filled in; `setup(dir)` prepares the scratch directory first."""

    what: str
    argv: tuple[str, ...]
    expect: int = 2
    setup: Callable[[Path], None] | None = None
    needs_trained: bool = False
    fast: bool = False  # also in the default test suite
    pause_at: str | None = None  # run with JAXLM_PAUSE_AT=this (data.fault_points), then send `signals`
    signals: tuple[str, ...] = ()  # SIGTERM to the command; SIGINT to its process group, as a terminal's Ctrl-C
    file_limit: int | None = None  # bytes: RLIMIT_FSIZE, a full disk for any file that grows past it
    may_change: tuple[str, ...] = ()  # globs (under the scratch dir) the command may write; nothing else may change
    max_lines: int | None = 1  # stderr lines allowed (None: a run's own progress lines too; never a traceback)
    rerun: bool = False  # then the same command, undisturbed, must succeed (it continues or starts over cleanly)


def _touch(name: str, text: str = "") -> Callable[[Path], None]:
    def setup(d: Path) -> None:
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)

    return setup


def _rewritten_data(d: Path) -> None:
    """A run trained 2 steps on DIR/tokens, whose text was then prepared again, with --overwrite, into DIR/tokens."""
    prepare = [sys.executable, "-m", "data.prepare", "--input", str(d / "text"), "--output", str(d / "tokens")]
    (d / "text").mkdir()
    (d / "text" / "a.txt").write_text("the documents a run trained on\n" * 2000)
    subprocess.run(prepare, cwd=REPO, check=True, capture_output=True)
    train = ["-m", "experiments.tiny_lm", "--workdir", str(d / "run"), "--steps", "2", *TINY]
    subprocess.run([sys.executable, *train, "--set", f"data.path={d / 'tokens'}"], cwd=REPO, check=True, env=env())
    (d / "text" / "a.txt").write_text("other documents, the same file name\n" * 2000)
    subprocess.run([*prepare, "--overwrite"], cwd=REPO, check=True, capture_output=True)


def _two_tokenizers(d: Path) -> None:
    """DIR/tokens (the byte tokenizer) and DIR/bpe, the same text through a BPE trained on it."""
    _dataset(d)
    train = ["-m", "data.train_tokenizer", "--input", str(d / "text"), "--vocab-size", "300"]
    subprocess.run([sys.executable, *train, "--output", str(d / "tok" / "tokenizer.json")], cwd=REPO, check=True,
                   capture_output=True, env=env())  # fmt: skip
    prepare = ["-m", "data.prepare", "--input", str(d / "text"), "--output", str(d / "bpe"), "--no-progress"]
    subprocess.run([sys.executable, *prepare, "--tokenizer", str(d / "tok")], cwd=REPO, check=True,
                   capture_output=True, env=env())  # fmt: skip


def _user_files(d: Path) -> None:
    (d / "text").mkdir()
    (d / "text" / "a.txt").write_text("some text\n")
    (d / "out").mkdir()
    (d / "out" / "notes.md").write_text("the user's own file\n")


def _text(d: Path) -> None:
    """DIR/text: about 60 KB of text in 3 files, several shards' worth at --shard-mb 0.01."""
    (d / "text").mkdir()
    for i in range(3):
        (d / "text" / f"part{i}.txt").write_text(
            "".join(f"line {n} of the user's text, part {i}\n" for n in range(600))
        )


def _dataset(d: Path) -> None:
    """DIR/text and DIR/tokens, a token dataset prepared from it."""
    _text(d)
    prepare = ["-m", "data.prepare", "--input", str(d / "text"), "--output", str(d / "tokens"), "--no-progress"]
    subprocess.run([sys.executable, *prepare], cwd=REPO, check=True, capture_output=True, env=env())


def _hf_model(d: Path) -> None:
    """DIR/hf: a Hugging Face model directory as save_pretrained writes one (its weights stand in as bytes)."""
    (d / "hf").mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32}
    (d / "hf" / "config.json").write_text(json.dumps(config) + "\n")
    (d / "hf" / "model.safetensors").write_bytes(b"the user's weights" * 100)
    _text(d)


def _marked_workdir(d: Path) -> None:
    """DIR/run: a training workdir (its marker) with a checkpoints/ directory."""
    (d / "run" / "checkpoints" / "2").mkdir(parents=True)
    (d / "run" / ".jaxlm-workdir").write_text('{"format": "jaxlm-workdir", "version": 1}\n')
    (d / "run" / "checkpoints" / "2" / "state").write_text("a checkpoint\n")


PREPARE = ("data.prepare", "--input", "{dir}/text", "--output", "{dir}/tokens", "--shard-mb", "0.01", "--no-progress")
PARTIAL = (".tokens.partial", ".tokens.partial/*")  # prepare's resumable build: kept for the rerun
EXPORT = ("experiments.export_hf", "--workdir", "{trained}", "--out", "{dir}/hf", "--max-shard-mb", "0.1")

VALUES = (
    Case(
        "a learning rate that overflows float32",
        ("experiments.tiny_lm", "--workdir", "{dir}/w", *TINY, "--set", "optim.learning_rate=1e300"),
    ),
    Case(
        "evaluation asked for with no validation split",
        ("experiments.tiny_lm", "--workdir", "{dir}/w", *TINY, "--set", "eval_every=1", "--set", "data.val_fraction=0")
        + ("--set", "eval_prompts="),
        fast=True,
    ),
    Case(
        "more experts per token than experts",
        ("experiments.tiny_lm", "--workdir", "{dir}/w", *TINY, "--set", "model.num_experts=4")
        + ("--set", "model.experts_per_token=5"),
    ),
    Case(
        "`eval_sample_tokens` beyond the model's length",
        ("experiments.tiny_lm", "--workdir", "{dir}/w", *TINY, "--set", "eval_sample_tokens=100"),
    ),
    Case(
        "`--compilation-cache` a file",
        ("experiments.tiny_lm", "--workdir", "{dir}/w", *TINY, "--compilation-cache", "{dir}/file"),
        setup=_touch("file", "keep me\n"),
    ),
    Case(
        "`data.path` a folder of raw text",
        ("experiments.tiny_lm", "--workdir", "{dir}/w", *TINY, "--set", "data.path={dir}/text"),
        setup=_touch("text/a.txt", "some text\n"),
    ),
    Case(
        "`data.path` a training workdir",
        ("experiments.tiny_lm", "--workdir", "{dir}/w", *TINY, "--set", "data.path={trained}"),
        needs_trained=True,
    ),
    Case("Adam's `b2` of 1", ("experiments.tiny_lm", "--workdir", "{dir}/w", *TINY, "--set", "optim.b2=1")),
    Case(
        "`import_hf --hf` a jaxlm training workdir",
        ("experiments.import_hf", "--hf", "{trained}", "--workdir", "{dir}/new"),
        needs_trained=True,
    ),
    Case(
        "`evaluate --data` a folder of raw text",
        ("experiments.evaluate", "--workdir", "{trained}", "--data", "{dir}/text"),
        setup=_touch("text/a.txt", "some text\n"),
        needs_trained=True,
    ),
    Case(
        "`data.prepare --shard-mb inf`",
        ("data.prepare", "--input", "{dir}/text", "--output", "{dir}/o", "--shard-mb", "inf"),
        setup=_touch("text/a.txt", "some text\n"),
    ),
    Case(
        "`data.train_tokenizer --min-frequency -1`",
        ("data.train_tokenizer", "--input", "{dir}/text", "--output", "{dir}/tok.json", "--vocab-size", "300")
        + ("--min-frequency", "-1"),
        setup=_touch("text/a.txt", "some text\n"),
    ),
    Case(
        "`sharding.plan --top 0`",
        (
            "sharding.plan",
            *("--model", "7b", "--devices", "8", "--global-batch-tokens", "1048576", "--seq", "4096"),
            *("--hardware", "h100-sxm", "--top", "0"),
        ),
    ),
)

MULTI_PROCESS = (
    Case(
        "a multi-process run whose other process never starts",
        (
            "experiments.tiny_lm",
            *("--coordinator", "127.0.0.1:{free_port}", "--num-processes", "2", "--process-id", "0"),
            *("--join-timeout", "3", "--workdir", "{dir}/w", *TINY),
        ),
        max_lines=2,  # the note naming who is missing while it waits, then the error
    ),
)

OWNERSHIP = (
    Case(
        "training into a Hugging Face model directory",
        ("experiments.tiny_lm", "--workdir", "{dir}/hf", *TINY),
        setup=_hf_model,
        fast=True,
    ),
    Case(
        "training into a token dataset",
        ("experiments.tiny_lm", "--workdir", "{dir}/tokens", *TINY),
        setup=_dataset,
    ),
    Case(
        "training into a folder of the user's files",
        ("experiments.tiny_lm", "--workdir", "{dir}/out", *TINY),
        setup=_user_files,
        fast=True,
    ),
    Case(
        "`export_hf --out` inside a run's checkpoints/ (rotation would delete it)",
        ("experiments.export_hf", "--workdir", "{dir}/run", "--out", "{dir}/run/checkpoints/hf"),
        setup=_marked_workdir,
        fast=True,
    ),
    Case(
        "`generate` on a token dataset",
        ("experiments.generate", "--workdir", "{dir}/tokens", "--prompt", "hello"),
        setup=_dataset,
    ),
    Case(
        "`data.train_tokenizer --output` a token dataset's directory",
        ("data.train_tokenizer", "--input", "{dir}/text", "--output", "{dir}/tokens", "--vocab-size", "300"),
        setup=_dataset,
        fast=True,
    ),
    Case(
        "`data.prepare --output` inside a Hugging Face model",
        ("data.prepare", "--input", "{dir}/text", "--output", "{dir}/hf/tokens"),
        setup=_hf_model,
    ),
    Case(
        "`data.prepare --input` a token dataset",
        ("data.prepare", "--input", "{dir}/tokens", "--output", "{dir}/tokens2"),
        setup=_dataset,
    ),
    Case(
        "`import_hf --workdir` a token dataset",
        ("experiments.import_hf", "--hf", "{dir}/hf", "--workdir", "{dir}/tokens"),
        setup=lambda d: (_dataset(d), _hf_model_only(d)),
    ),
    Case(
        "`quantize_checkpoint --out` inside a Hugging Face model",
        ("experiments.quantize_checkpoint", "--workdir", "{trained}", "--out", "{dir}/hf/int8"),
        setup=_hf_model,
        needs_trained=True,
    ),
)

SIGNALS = (
    Case(
        "SIGTERM to `data.prepare` while its workers write",
        (*PREPARE, "--workers", "2"),
        expect=143,
        setup=_text,
        pause_at="prepare.shard",
        signals=("SIGTERM",),
        may_change=PARTIAL,
        rerun=True,
        fast=True,
    ),
    Case(
        "Ctrl-C twice to `data.prepare`",
        (*PREPARE, "--workers", "2"),
        expect=130,
        setup=_text,
        pause_at="prepare.shard",
        signals=("SIGINT", "SIGINT"),
        may_change=PARTIAL,
        rerun=True,
    ),
    Case(
        "SIGTERM to `data.train_tokenizer` while it trains",
        ("data.train_tokenizer", "--input", "{dir}/text", "--output", "{dir}/tok.json", "--vocab-size", "300"),
        expect=143,
        setup=_text,
        pause_at="train_tokenizer.read",
        signals=("SIGTERM",),
        rerun=True,
    ),
    Case(
        "SIGTERM to `export_hf` while it writes",
        EXPORT,
        expect=143,
        needs_trained=True,
        pause_at="export.shard",
        signals=("SIGTERM",),
        rerun=True,
    ),
    Case(
        "Ctrl-C to `import_hf` while it writes",
        ("experiments.import_hf", "--hf", "{trained_hf}", "--workdir", "{dir}/imported"),
        expect=130,
        needs_trained=True,
        pause_at="import.checkpoint",
        signals=("SIGINT",),
        rerun=True,
    ),
    Case(
        "Ctrl-C to `quantize_checkpoint` while it writes",
        ("experiments.quantize_checkpoint", "--workdir", "{trained}", "--out", "{dir}/int8"),
        expect=130,
        needs_trained=True,
        pause_at="quantize.weights",
        signals=("SIGINT",),
        rerun=True,
    ),
    Case(
        "SIGTERM to a training run (preemption)",
        ("experiments.tiny_lm", "--workdir", "{dir}/run", "--steps", "3", *TINY),
        expect=75,
        pause_at="trainer.step",
        signals=("SIGTERM",),
        may_change=("run", "run/*"),
        max_lines=None,
        rerun=True,
    ),
    Case(
        "a second Ctrl-C while a run closes its logs",
        ("experiments.tiny_lm", "--workdir", "{dir}/run", "--steps", "2", *TINY),
        expect=130,
        pause_at="trainer.close",
        signals=("SIGINT", "SIGINT"),
        may_change=("run", "run/*"),
        max_lines=None,
        rerun=True,
    ),
)

FULL_DISK = (
    Case(
        "a full disk during `data.prepare`",
        (*PREPARE, "--workers", "1"),
        expect=4,
        setup=_text,
        file_limit=8000,
        may_change=PARTIAL,
        rerun=True,
        fast=True,
    ),
    Case(
        "a full disk during a training run's save",
        ("experiments.tiny_lm", "--workdir", "{dir}/run", "--steps", "2", *TINY),
        expect=4,
        file_limit=300_000,  # past the run's logs and plot, short of a checkpoint's arrays
        may_change=("run", "run/*"),
        max_lines=None,
        rerun=True,
    ),
    Case(
        "a full disk during `data.train_tokenizer`",
        ("data.train_tokenizer", "--input", "{dir}/text", "--output", "{dir}/tok.json", "--vocab-size", "300"),
        expect=4,
        setup=_text,
        file_limit=2000,
        rerun=True,
    ),
    Case("a full disk during `export_hf`", EXPORT, expect=4, needs_trained=True, file_limit=100_000, rerun=True),
    Case(
        "a full disk during `import_hf`",
        ("experiments.import_hf", "--hf", "{trained_hf}", "--workdir", "{dir}/imported"),
        expect=4,
        needs_trained=True,
        file_limit=100_000,
        rerun=True,
    ),
    Case(
        "a full disk during `quantize_checkpoint`",
        ("experiments.quantize_checkpoint", "--workdir", "{trained}", "--out", "{dir}/int8"),
        expect=4,
        needs_trained=True,
        file_limit=100_000,
        rerun=True,
    ),
)


def _hf_model_only(d: Path) -> None:
    (d / "hf").mkdir()
    (d / "hf" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}) + "\n")


BEFORE_START = (
    Case("the workdir is held by a live run", ("experiments.tiny_lm", "--workdir", "{dir}/held", *TINY), fast=True),
    Case("`--workdir` is empty", ("experiments.tiny_lm", "--workdir", "")),
    Case("`--workdir` is a file", ("experiments.tiny_lm", "--workdir", "{dir}/file"), setup=_touch("file")),
    Case("`--config` does not exist", ("experiments.tiny_lm", "--config", "{dir}/nope.py", "--workdir", "{dir}/w")),
    Case(
        "`--config` of an unsupported type",
        ("experiments.tiny_lm", "--config", "{dir}/c.yaml", "--workdir", "{dir}/w"),
        setup=_touch("c.yaml", "model: {}\n"),
    ),
    Case(
        "`--config` that raises",
        ("experiments.tiny_lm", "--config", "{dir}/c.py", "--workdir", "{dir}/w"),
        setup=_touch("c.py", "config = TrainConfig(\n"),
    ),
    Case("`--mesh` does not exist", ("experiments.tiny_lm", "--mesh", "{dir}/nope.py", "--workdir", "{dir}/w")),
    Case(
        "`--mesh` needs more devices than there are",
        ("experiments.tiny_lm", "--mesh", "{dir}/m.py", "--workdir", "{dir}/w", "--cpu-devices", "2"),
        setup=_touch("m.py", "layout = dict(data=2, tensor=4)\n"),
    ),
    Case(
        "a misspelt `--set` key",
        ("experiments.tiny_lm", "--workdir", "{dir}/w", "--set", "model.d_modle=512"),
    ),
    Case("a `--set` value of the wrong type", ("experiments.tiny_lm", "--workdir", "{dir}/w", "--set", "seed=abc")),
    Case("`--steps` negative", ("experiments.tiny_lm", "--workdir", "{dir}/w", "--steps", "-1")),
    Case(
        "`data.path` does not exist",
        ("experiments.tiny_lm", "--workdir", "{dir}/w", "--set", "data.path={dir}/no-tokens", *TINY),
    ),
    Case(
        "a step that cannot fit in memory",
        (
            "experiments.tiny_lm",
            "--workdir",
            "{dir}/w",
            *("--set", "model.max_seq_len=262144", "--set", "data.seq_len=262144", "--set", "data.batch_size=64"),
        ),
    ),
    Case(
        "resuming with another model",
        ("experiments.tiny_lm", "--workdir", "{trained}", *TINY, "--set", "model.d_model=64", "--steps", "3"),
        needs_trained=True,
    ),
    Case(
        "resuming after the token data was rewritten",
        ("experiments.tiny_lm", "--workdir", "{dir}/run", *TINY, "--set", "data.path={dir}/tokens", "--steps", "3"),
        setup=_rewritten_data,
    ),
    Case(
        "a data mixture with a negative weight",
        ("experiments.tiny_lm", "--workdir", "{dir}/w", *TINY, "--set", "data.mixture={dir}/a:0.5,{dir}/b:-1"),
    ),
    Case(
        "a data mixture of datasets written with two tokenizers",
        ("experiments.tiny_lm", "--workdir", "{dir}/w", *TINY, "--set", "data.mixture={dir}/tokens:1,{dir}/bpe:1"),
        setup=_two_tokenizers,
    ),
    Case(
        "`lm_eval`: an unknown task",
        ("experiments.lm_eval", "--workdir", "{trained}", "--tasks", "hellaswg"),
        needs_trained=True,
    ),
    Case(
        "`lm_eval`: a workdir without a checkpoint",
        (
            "experiments.lm_eval",
            "--workdir",
            "{dir}",
            "--tasks",
            "jaxlm_tiny_choice",
            "--include-path",
            "tests/lm_eval_tasks",
        ),
    ),
    Case(
        "`data.prepare`: an input that does not exist",
        ("data.prepare", "--input", "{dir}/no", "--output", "{dir}/o"),
        fast=True,
    ),
    Case(
        "`data.prepare --overwrite` into a directory with other files",
        ("data.prepare", "--input", "{dir}/text", "--output", "{dir}/out", "--overwrite"),
        setup=_user_files,
    ),
    Case(
        "`quantize_checkpoint`: a workdir without checkpoints",
        ("experiments.quantize_checkpoint", "--workdir", "{dir}"),
    ),
    Case(
        "`quantize_checkpoint --out` an existing file",
        ("experiments.quantize_checkpoint", "--workdir", "{trained}", "--out", "{dir}/file"),
        setup=_touch("file", "keep me\n"),
        needs_trained=True,
    ),
    Case(
        "`sharding.launch` on a busy port",
        ("sharding.launch", "--processes", "2", "--port", "{busy_port}", "--", "true"),
    ),
    Case(
        "`sharding.plan --out` a directory",
        (
            "sharding.plan",
            *("--model", "7b", "--devices", "8", "--global-batch-tokens", "1048576", "--seq", "4096"),
            *("--hardware", "h100-sxm", "--out", "{dir}"),
        ),
    ),
)

CASES = BEFORE_START + VALUES + MULTI_PROCESS + OWNERSHIP + SIGNALS + FULL_DISK
