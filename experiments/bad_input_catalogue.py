"""The bad-input catalogue: every careless input the docs list, run for real, with its exit code and its one line.

    python -m experiments.bad_input_catalogue            # run every case; print the table and a JSON last line
    python -m experiments.bad_input_catalogue --write    # ... and write it into docs/fault_tolerance.md

Each case (experiments.bad_input_cases) runs the real command in a subprocess, in a scratch directory, and records
the exit code and what it printed on stderr; a signal case pauses the command at a named point first and signals it
there, a full-disk case runs it under a file-size limit. A case passes when the command exits with the code the
contract names, says so in one line (no traceback, no absl ERROR lines), changed nothing in the scratch directory
or the trained run it read but what the case allows, left no scratch copy behind, and, where the case says so, the
same command run again undisturbed succeeds. The table in docs/fault_tolerance.md is this module's output, and
tests/test_bad_input_catalogue.py fails when the two differ, so the docs show real outputs and cannot drift.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fnmatch
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.bad_input_cases import CASES, REPO, TINY, Case, env
from experiments.cli import exit_with

DOC = REPO / "docs" / "fault_tolerance.md"
BEGIN, END = "<!-- catalogue:begin -->", "<!-- catalogue:end -->"
SCRATCH = re.compile(r"\.[^/]*(-tmp-|\.tmp-|\.old-)[^/]*$")  # what writers build beside their output


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
    max_lines: int | None = 1
    touched: list[str] = dataclasses.field(default_factory=list)  # files changed that the case does not allow
    left: list[str] = dataclasses.field(default_factory=list)  # scratch copies left behind
    rerun: int | None = None  # the undisturbed rerun's exit code, where the case asks for one
    rerun_line: str = ""

    @property
    def ok(self) -> bool:
        lines_ok = self.max_lines is None or self.lines <= self.max_lines
        clean = self.code == self.expect and lines_ok and not self.traceback and not self.touched and not self.left
        return clean and self.rerun in (None, 0)


def run_catalogue(cases=CASES, *, root: Path | None = None) -> list[Result]:
    """Runs every case in its own scratch directory under `root` (a temporary one by default)."""
    own_root = root is None
    root = Path(tempfile.mkdtemp(prefix="catalogue-")) if own_root else root
    try:
        trained = _trained_workdir(root / "trained") if any(c.needs_trained for c in cases) else None
        trained_hf = None
        if any("{trained_hf}" in c.argv for c in cases):
            trained_hf = _exported(trained, root / "trained_hf")
        with _busy_port() as port:
            return [_run_case(case, root / f"case{i:02d}", trained, trained_hf, port) for i, case in enumerate(cases)]
    finally:
        if own_root:
            shutil.rmtree(root, ignore_errors=True)


def _trained_workdir(workdir: Path) -> Path:
    _run_checked(["experiments.tiny_lm", "--workdir", str(workdir), "--steps", "2", *TINY], "the trained workdir")
    return workdir


def _exported(trained: Path, out: Path) -> Path:
    _run_checked(["experiments.export_hf", "--workdir", str(trained), "--out", str(out)], "the trained run's export")
    return out


def _run_checked(argv: list[str], what: str) -> None:
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=REPO, env=env(), capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{what}: the command failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")


def _run_case(case: Case, scratch: Path, trained: Path | None, trained_hf: Path | None, port: int) -> Result:
    from jaxlm.workdir_lock import WorkdirLock

    scratch.mkdir(parents=True)
    if case.setup:
        case.setup(scratch)
    fill = dict(dir=scratch, trained=trained, trained_hf=trained_hf, busy_port=port, free_port=_free_port())
    argv = [a.format(**fill) for a in case.argv]
    held = "{dir}/held" in case.argv
    if held:
        (scratch / "held").mkdir()
    lock = WorkdirLock(scratch / "held") if held else contextlib.nullcontext()
    if held:  # as if the same command were already running
        lock.holder = dataclasses.replace(lock.holder, command=f"python -m {' '.join(argv)}")
    watched = [scratch] + [p for p in (trained, trained_hf) if p is not None and case.needs_trained]
    before = {root: _snapshot(root) for root in watched}
    t0 = time.perf_counter()
    with lock:  # this process is the live run that holds it
        code, stderr = _execute(case, argv)
    seconds = time.perf_counter() - t0
    touched = [
        f"{root.name}/{path}"
        for root in watched
        for path in _changes(before[root], _snapshot(root))
        if not (root == scratch and any(fnmatch.fnmatch(path, glob) for glob in case.may_change))
    ]
    left = [str(p.relative_to(root)) for root in watched for p in root.rglob(".*") if SCRATCH.search(p.name)]
    rerun, rerun_line = None, ""
    if case.rerun:
        rerun, rerun_stderr = _execute(dataclasses.replace(case, pause_at=None, signals=(), file_limit=None), argv)
        rerun_line = (rerun_stderr.strip().splitlines() or [""])[-1]
    err = [line for line in stderr.splitlines() if line.strip()]
    stable = lambda text: _stable(text, scratch, trained, trained_hf)
    return Result(
        what=case.what,
        command=stable(_shown(argv)),
        expect=case.expect,
        code=code,
        line=stable(err[-1] if err else ""),
        lines=len(err),
        traceback="Traceback (most recent call last)" in stderr or any(e.startswith("ERROR:") for e in err),
        seconds=seconds,
        max_lines=case.max_lines,
        touched=touched,
        left=left,
        rerun=rerun,
        rerun_line=stable(rerun_line),
    )


def _execute(case: Case, argv: list[str]) -> tuple[int, str]:
    """Runs the command as the case says (paused and signalled, or under a file-size limit); (exit code, stderr)."""
    command = [sys.executable, "-m", *argv]
    environ = {**env(), **({"JAXLM_PAUSE_AT": case.pause_at} if case.pause_at else {})}
    limit = case.file_limit

    def preexec():  # in the child: a full disk for any file that grows past the limit
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    if not case.pause_at:
        proc = subprocess.run(  # preexec only where needed: it makes subprocess fork instead of spawning
            command, cwd=REPO, env=environ, capture_output=True, text=True, timeout=300, preexec_fn=limit and preexec
        )
        return proc.returncode, proc.stderr
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        for line in proc.stdout:
            if line.startswith(f"paused at {case.pause_at}"):
                break
        else:
            raise RuntimeError(f"{argv[0]} never reached the pause point {case.pause_at}")
        for name in case.signals:
            sig = signal.Signals[name]
            if sig == signal.SIGINT:
                os.killpg(proc.pid, sig)  # Ctrl-C reaches every process of the foreground job
            else:
                os.kill(proc.pid, sig)  # a scheduler or `kill` signals the command
            time.sleep(1.0)
        _, stderr = proc.communicate(timeout=120)
        return proc.returncode, stderr
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _snapshot(root: Path) -> dict[str, str]:
    """{relative path: content digest} of every file under `root` (directories as 'dir')."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_dir():
            out[rel] = "dir"
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))


def _shown(argv: list[str]) -> str:
    """The command as the docs show it: quoted where a shell needs it, tiny_lm's small-model flags as TINY."""
    text = " ".join(["python -m", *(a if a and " " not in a else repr(a) for a in argv)])
    return text.replace(" ".join(TINY), "TINY")


@contextlib.contextmanager
def _busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stable(text: str, scratch: Path, trained: Path | None, trained_hf: Path | None = None) -> str:
    """Outputs that read the same on every machine and run: scratch paths, pids, hosts, times, ports replaced."""
    if trained_hf is not None:
        text = text.replace(str(trained_hf), "RUN_HF")
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
    text = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", text)
    return text


def problems(r: Result) -> str:
    """What makes a result not clean, in one line."""
    found = [f"exit {r.code} (want {r.expect})"] if r.code != r.expect else []
    if r.max_lines is not None and r.lines > r.max_lines:
        found.append(f"{r.lines} stderr lines")
    found += ["a traceback"] * r.traceback
    found += [f"changed {', '.join(r.touched[:5])}"] * bool(r.touched)
    found += [f"left {', '.join(r.left[:5])}"] * bool(r.left)
    found += [f"the rerun exited {r.rerun}: {r.rerun_line}"] * (r.rerun not in (None, 0))
    return f"{r.what}: {'; '.join(found)}"


def comparable(table_text: str) -> str:
    """A table with the figures that depend on the machine masked (the memory check names this host's free RAM, a
    full disk its free space, a preemption its checkpoint's time)."""
    table_text = re.sub(r"\d+(\.\d+)? GiB", "N GiB", re.sub(r"\d+(\.\d+)? (GiB|MiB) free", "N free", table_text))
    table_text = re.sub(r"Orbax logged \d+ error lines", "Orbax logged N error lines", table_text)
    return re.sub(r"written in \d+\.\d+s", "written in Ns", table_text)


def table(results: list[Result]) -> str:
    rows = ["| careless input | command | exit | the one line |", "|---|---|---|---|"]
    for r in results:
        cell = lambda s: s.replace("|", "\\|")
        then = f" — then the same command: exit {r.rerun}" if r.rerun is not None else ""
        rows.append(f"| {r.what} | `{cell(r.command)}` | {r.code} | {cell(r.line)}{then} |")
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
    p.add_argument("--fast", action="store_true", help="only the cases the default test suite runs")
    args = p.parse_args(argv)
    if args.write and args.fast:
        p.error("--write needs every case; leave out --fast")
    t0 = time.perf_counter()
    results = run_catalogue([c for c in CASES if c.fast or not args.fast])
    print(table(results))
    bad = [r for r in results if not r.ok]
    for r in bad:
        print(f"NOT clean: {problems(r)}", file=sys.stderr)
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
