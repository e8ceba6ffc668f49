"""The bad-input catalogue: every careless input the docs list, run for real, with its exit code and its one line.

    python -m experiments.bad_input_catalogue            # run every case; print the table and a JSON last line
    python -m experiments.bad_input_catalogue --write    # ... and write it into docs/fault_tolerance.md

Each case runs the real command in a subprocess, in a scratch directory, and records the exit code and what it
printed on stderr. A case passes when the command exits with the code the contract names and says so in one line
(no traceback, no absl ERROR lines). The table in docs/fault_tolerance.md is this module's output, and
tests/test_bad_input_catalogue.py fails when the two differ, so the docs show real outputs and cannot drift.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from experiments.cli import exit_with

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "fault_tolerance.md"
BEGIN, END = "<!-- catalogue:begin -->", "<!-- catalogue:end -->"
# A model whose one training step and save take a second or two: the cases that need a trained workdir.
TINY = [
    *("--set", "model.d_model=32", "--set", "model.num_layers=1", "--set", "model.mlp_dim=64"),
    *("--set", "model.max_seq_len=32", "--set", "data.seq_len=32", "--set", "data.batch_size=4"),
    *("--set", "data.microbatches=1", "--set", "eval_every=0", "--set", "tensorboard=false", "--no-progress"),
]


@dataclasses.dataclass(frozen=True)
class Case:
    """One careless input: `argv` after `python -m`, with {dir} (the case's scratch directory) and {trained} (a
    workdir with a finished 2-step run) filled in; `setup(dir)` prepares the scratch directory first."""

    what: str
    argv: tuple[str, ...]
    expect: int = 2
    setup: Callable[[Path], None] | None = None
    needs_trained: bool = False


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
    subprocess.run([sys.executable, *train, "--set", f"data.path={d / 'tokens'}"], cwd=REPO, check=True, env=_env())
    (d / "text" / "a.txt").write_text("other documents, the same file name\n" * 2000)
    subprocess.run([*prepare, "--overwrite"], cwd=REPO, check=True, capture_output=True)


def _user_files(d: Path) -> None:
    (d / "text").mkdir()
    (d / "text" / "a.txt").write_text("some text\n")
    (d / "out").mkdir()
    (d / "out" / "notes.md").write_text("the user's own file\n")


CASES = (
    Case("the workdir is held by a live run", ("experiments.tiny_lm", "--workdir", "{dir}/held", *TINY)),
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
    Case("a misspelt `--set` key", ("experiments.tiny_lm", "--workdir", "{dir}/w", "--set", "model.d_modle=512")),
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
        "`data.prepare`: an input that does not exist", ("data.prepare", "--input", "{dir}/no", "--output", "{dir}/o")
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


@dataclasses.dataclass
class Result:
    what: str
    command: str
    expect: int
    code: int
    line: str  # the last line on stderr, with scratch paths, pids and times made stable
    lines: int  # stderr lines (1 for a clean report)
    traceback: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.code == self.expect and self.lines == 1 and not self.traceback


def run_catalogue(cases=CASES, *, root: Path | None = None) -> list[Result]:
    """Runs every case in its own scratch directory under `root` (a temporary one by default)."""
    own_root = root is None
    root = Path(tempfile.mkdtemp(prefix="catalogue-")) if own_root else root
    try:
        trained = _trained_workdir(root / "trained") if any(c.needs_trained for c in cases) else None
        with _busy_port() as port:
            return [_run_case(case, root / f"case{i:02d}", trained, port) for i, case in enumerate(cases)]
    finally:
        if own_root:
            shutil.rmtree(root, ignore_errors=True)


def _trained_workdir(workdir: Path) -> Path:
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.tiny_lm", "--workdir", str(workdir), "--steps", "2", *TINY],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise RuntimeError(f"the trained workdir's run failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return workdir


def _run_case(case: Case, scratch: Path, trained: Path | None, port: int) -> Result:
    from jaxlm.workdir_lock import WorkdirLock

    scratch.mkdir(parents=True)
    if case.setup:
        case.setup(scratch)
    argv = [a.format(dir=scratch, trained=trained, busy_port=port) for a in case.argv]
    held = "{dir}/held" in case.argv
    if held:
        (scratch / "held").mkdir()
    lock = WorkdirLock(scratch / "held") if held else contextlib.nullcontext()
    if held:  # as if the same command were already running
        lock.holder = dataclasses.replace(lock.holder, command=f"python -m {' '.join(argv)}")
    t0 = time.perf_counter()
    with lock:  # this process is the live run that holds it
        proc = subprocess.run(
            [sys.executable, "-m", *argv], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300
        )
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    stable = lambda text: _stable(text, scratch, trained)
    return Result(
        what=case.what,
        command=stable(_shown(argv)),
        expect=case.expect,
        code=proc.returncode,
        line=stable(err[-1] if err else ""),
        lines=len(err),
        traceback="Traceback (most recent call last)" in proc.stderr or any(e.startswith("ERROR:") for e in err),
        seconds=time.perf_counter() - t0,
    )


def _shown(argv: list[str]) -> str:
    """The command as the docs show it: quoted where a shell needs it, tiny_lm's small-model flags as TINY."""
    text = " ".join(["python -m", *(a if a and " " not in a else repr(a) for a in argv)])
    return text.replace(" ".join(TINY), "TINY")


def _env() -> dict:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONWARNINGS": "ignore"}


@contextlib.contextmanager
def _busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _stable(text: str, scratch: Path, trained: Path | None) -> str:
    """Outputs that read the same on every machine and run: scratch paths, pids, hosts, times, ports replaced."""
    if trained is not None:
        text = text.replace(str(trained), "RUN")
    text = text.replace(str(scratch), "DIR").replace(str(Path.home()), "~")
    text = re.sub(
        r"pid \d+ on \S+, started \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d([+\-]\d\d:\d\d|Z)?",
        "pid PID on HOST, started TIME",
        text,
    )
    text = text.replace(" ".join(TINY), "TINY")
    text = re.sub(r"--port \d+", "--port PORT", text)
    return text


def comparable(table_text: str) -> str:
    """A table with the figures that depend on the machine masked (the memory check names this host's free RAM)."""
    return re.sub(r"\d+(\.\d+)? GiB", "N GiB", table_text)


def table(results: list[Result]) -> str:
    rows = ["| careless input | command | exit | the one line |", "|---|---|---|---|"]
    for r in results:
        cell = lambda s: s.replace("|", "\\|")
        rows.append(f"| {r.what} | `{cell(r.command)}` | {r.code} | {cell(r.line)} |")
    return "\n".join(rows)


def write_doc(results: list[Result], doc: Path = DOC) -> None:
    """Replaces the table between the catalogue markers of `doc`."""
    text = doc.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    doc.write_text(text[:start] + "\n" + table(results) + "\n" + text[stop:])


def doc_table(doc: Path = DOC) -> str:
    text = doc.read_text()
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bad_input_catalogue", description=__doc__.split("\n")[0])
    p.add_argument("--write", action="store_true", help=f"write the table into {DOC.relative_to(REPO)}")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    results = run_catalogue()
    print(table(results))
    bad = [r for r in results if not r.ok]
    for r in bad:
        print(f"NOT one clean line: {r.what}: exit {r.code} (want {r.expect}), {r.lines} stderr lines", file=sys.stderr)
    if args.write:
        write_doc(results)
    print(
        json.dumps(
            {"cases": len(results), "clean": len(results) - len(bad), "seconds": round(time.perf_counter() - t0, 1)}
        )
    )
    return 1 if bad else 0


if __name__ == "__main__":
    exit_with(main())
