"""Fault injection for `python -m experiments.tiny_lm`: run it in a subprocess, hurt it, rerun it, and compare.

Each scenario starts a fresh workdir, injects one fault, reruns the same command until the run finishes, and
checks what a user relies on: the run completes; its metrics.jsonl holds every step exactly once with losses
equal, bit for bit, to an uninterrupted reference run; no temporary checkpoint directory is left; and no
checkpoint was set aside as corrupt unless the scenario corrupted it. Faults:

    sigkill       SIGKILL once the run has logged a random step
    sigkill_save  SIGKILL a random moment after a checkpoint's temporary directory appears (mid-save)
    sigterm       SIGTERM at a random step: expects exit 75 and a checkpoint of that very step (0 steps lost)
    corrupt       after a finished run to a random point, damage the newest checkpoint (flip a byte,
                  truncate or delete a file, garbage metadata): the rerun must fall back to the one before
    disk_full     rerun with a file-size limit (RLIMIT_FSIZE) so a save fails: expects exit 4 and the last
                  checkpoint intact; then a rerun without the limit
    tmpfs_full    the workdir on a tmpfs with room for two checkpoints (needs root: `mount`): the third save
                  fails with ENOSPC, exit 4; the workdir is copied to a real disk and the rerun continues there

With `Harness(processes=2)` every run is one JAX distributed run of two processes under `sharding.launch`, as on
two hosts: a SIGKILL hits one process chosen by the seed (a host dying; the launcher then stops the other), a
SIGTERM either the launcher (a scheduler signalling the job) or one process (one host preempted).

Used by tests/fault_injection (a few seeds) and `python -m experiments.fault_sweep` (the full sweep).
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from jaxlm.checkpoint import TMP_MARKER
from jaxlm.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
# A small model whose steps and saves take tens of milliseconds, so a sweep of ~100 runs takes minutes.
TINY_FLAGS = [
    "--set",
    "model.d_model=128",
    "--set",
    "model.num_layers=2",
    "--set",
    "model.mlp_dim=512",
    "--set",
    "model.max_seq_len=128",
    "--set",
    "data.seq_len=128",
    "--set",
    "data.batch_size=8",
    "--set",
    "data.microbatches=1",
    "--set",
    "eval_every=0",
    "--set",
    "eval_prompts=",
    "--set",
    "tensorboard=false",
]
EXIT_PREEMPTED, EXIT_CHECKPOINT_FAILED = 75, 4
KINDS = ("sigkill", "sigkill_save", "sigterm", "corrupt", "disk_full", "tmpfs_full")
DAMAGES = ("flip_byte", "truncate", "delete_file", "garbage_metadata")


@dataclasses.dataclass
class Harness:
    """The command every run of a sweep shares: `steps`, a checkpoint every `checkpoint_every` steps, and one
    compilation cache (a restart loads compiled programs, as it would in production)."""

    root: Path
    steps: int = 24
    checkpoint_every: int = 4
    cache_dir: Path | None = None  # None: JAX's default ($JAX_COMPILATION_CACHE_DIR, as the tests set it)
    flags: tuple[str, ...] = tuple(TINY_FLAGS)  # () runs tiny_lm's own config
    processes: int = 1  # > 1: one distributed run of that many local processes (`sharding.launch`), one CPU each

    def command(self, workdir: Path, *extra: str) -> list[str]:
        cache = ["--compilation-cache", str(self.cache_dir)] if self.cache_dir else []
        launcher = []
        if self.processes > 1:
            launcher = [sys.executable, "-m", "sharding.launch", "--processes", str(self.processes), "--"]
        return [
            *launcher,
            sys.executable,
            "-m",
            "experiments.tiny_lm",
            "--workdir",
            str(workdir),
            "--steps",
            str(self.steps),
            "--log-every",
            "1",
            "--checkpoint-every",
            str(self.checkpoint_every),
            "--no-progress",
            *cache,
            *self.flags,
            *extra,
        ]

    def launch(self, workdir: Path, *extra: str, file_size_limit: int | None = None) -> subprocess.Popen:
        def limit():  # runs in the child: a full disk, as far as files larger than the limit are concerned
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        return subprocess.Popen(
            self.command(workdir, *extra),
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if self.processes == 1 else subprocess.STDOUT,  # the launcher merges them anyway
            text=True,
            preexec_fn=limit if file_size_limit else None,
        )

    def run(self, workdir: Path, *extra: str, **kw) -> tuple[int, str]:
        proc = self.launch(workdir, *extra, **kw)
        output = self.finish(proc)
        return proc.returncode, output

    def finish(self, proc: subprocess.Popen) -> str:
        """Waits for a launched run; returns what it printed on stderr (everything, from the launcher)."""
        out, err = proc.communicate(timeout=600)
        return err if self.processes == 1 else out

    def reference(self) -> list[tuple[int, float]]:
        """The uninterrupted run's loss sequence (computed once per harness)."""
        workdir = self.root / "reference"
        if not (workdir / "metrics.jsonl").exists() or last_step(workdir) < self.steps:
            code, err = self.run(workdir)
            if code != 0:
                raise RuntimeError(f"reference run failed ({code}): {err.strip().splitlines()[-1:]}")
        return losses(workdir)


# ----------------------------------------------------------------------------- reading a workdir


def losses(workdir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(workdir / "metrics.jsonl") if "loss" in r]


def last_step(workdir: Path) -> int:
    try:
        return max((s for s, _ in losses(workdir)), default=0)
    except (OSError, ValueError):
        return 0


def checkpoint_steps(workdir: Path) -> list[int]:
    directory = workdir / "checkpoints"
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []


def leftovers(workdir: Path) -> list[str]:
    directory = workdir / "checkpoints"
    return [p.name for p in directory.iterdir() if TMP_MARKER in p.name] if directory.is_dir() else []


def quarantined(workdir: Path) -> list[str]:
    directory = workdir / "checkpoints.corrupt"
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


def process_pid(workdir: Path, **environment) -> int | None:
    """The pid of the process working in `workdir` whose environment has every VARIABLE=value given (read from
    /proc): one process of a launched run (JAXLM_PROCESS_ID, JAXLM_REPLICA_ID), to signal it alone."""
    wanted = {f"{k}={v}".encode() for k, v in environment.items()}
    for proc in Path("/proc").iterdir():
        try:
            if (
                proc.name.isdigit()
                and str(workdir).encode() in (proc / "cmdline").read_bytes()
                and wanted <= set((proc / "environ").read_bytes().split(b"\0"))
            ):
                return int(proc.name)
        except OSError:
            continue
    return None


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 300, poll: float = 0.002) -> bool:
    """Polls until `predicate()` or the process exits; True if the predicate held first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(poll)
    return False


def first_step_seconds(harness: Harness, workdir: Path, *extra: str) -> tuple[float, int]:
    """(seconds from launch until the run logs its first step, exit code): what a start or a restart costs
    before any work is done. The first step is the one after the newest checkpoint; a resumed run truncates
    metrics.jsonl to its checkpoint first, so the record counts only when written after the launch."""
    first = (checkpoint_steps(workdir) or [0])[-1] + 1
    metrics = workdir / "metrics.jsonl"
    t0, launched = time.perf_counter(), time.time()
    proc = harness.launch(workdir, *extra)
    _wait_for(
        lambda: (
            metrics.exists()
            and metrics.stat().st_mtime >= launched
            and last_step(workdir) == first
            and losses(workdir)[-1][0] == first
        ),
        proc,
        poll=0.005,
    )
    seconds = time.perf_counter() - t0
    proc.communicate(timeout=600)
    return seconds, proc.returncode


# ----------------------------------------------------------------------------- one scenario


@dataclasses.dataclass
class Outcome:
    kind: str
    seed: int
    detail: str = ""  # where / how the fault was injected
    exit_code: int | None = None  # of the run the fault hit
    in_save: bool = False  # the fault left a temporary checkpoint directory: it landed mid-save
    steps_done: int = 0  # steps logged before the fault
    resumed_from: int = 0  # the step the rerun continued from
    completed: bool = False
    loss_match: bool = False
    leftover_tmp: bool = False
    good_lost: bool = False  # a checkpoint was quarantined that the scenario did not damage
    message: str = ""  # the faulted run's last stderr line
    tracebacks: int = 0  # printed by the faulted run: a fault it reports should read as one line, not a dump
    absl_errors: int = 0  # ERROR lines of absl (Orbax's logger) printed by the faulted run: folded into the one line

    @property
    def steps_lost(self) -> int:
        return max(self.steps_done - self.resumed_from, 0)

    @property
    def ok(self) -> bool:
        return self.completed and self.loss_match and not self.leftover_tmp and not self.good_lost


def run_scenario(harness: Harness, kind: str, seed: int) -> Outcome:
    if kind not in KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; one of {', '.join(KINDS)}")
    rng = random.Random(seed)
    workdir = harness.root / f"{kind}-{seed}"
    out = Outcome(kind, seed)
    damaged: set[str] = set()
    if kind in ("sigkill", "sigterm"):
        target = rng.randint(1, harness.steps - 1)
        sig = signal.SIGKILL if kind == "sigkill" else signal.SIGTERM
        proc = harness.launch(workdir)
        _wait_for(lambda: last_step(workdir) >= target, proc)
        time.sleep(rng.uniform(0, 0.03))  # somewhere inside the following step
        who = _signal(harness, proc, workdir, sig, rng)
        err = harness.finish(proc)
        out.detail, out.exit_code = f"{who}after step {target}", proc.returncode
        out.in_save = bool(leftovers(workdir))  # a random kill may land mid-save too
    elif kind == "sigkill_save":
        first = rng.randint(1, harness.steps // harness.checkpoint_every - 1) * harness.checkpoint_every
        tmp = workdir / "checkpoints" / f"{first}{TMP_MARKER}"
        proc = harness.launch(workdir)
        _wait_for(tmp.exists, proc, poll=0.0005)
        time.sleep(rng.uniform(0, 0.01))
        who = _signal(harness, proc, workdir, signal.SIGKILL, rng)
        err = harness.finish(proc)
        # Mid-save: the step's checkpoint never completed (with two processes the survivor may tidy the temporary away)
        out.in_save = bool(leftovers(workdir)) or first not in checkpoint_steps(workdir)
        out.detail, out.exit_code = f"{who}saving step {first}", proc.returncode
    elif kind == "corrupt":
        stop = rng.randint(2, harness.steps // harness.checkpoint_every - 1) * harness.checkpoint_every
        code, err = harness.run(workdir, "--steps", str(stop))
        how = rng.choice(DAMAGES)
        damage(workdir / "checkpoints" / str(stop), how, rng)
        damaged.add(str(stop))
        out.detail, out.exit_code = f"{how} in step {stop}", code
    elif kind == "disk_full":
        stop = rng.randint(1, harness.steps // harness.checkpoint_every - 2) * harness.checkpoint_every
        harness.run(workdir, "--steps", str(stop))
        code, err = harness.run(workdir, file_size_limit=64 * 1024)
        out.detail, out.exit_code = f"files over 64 KiB refused after step {stop}", code
    else:  # tmpfs_full
        size = int(2.5 * checkpoint_bytes(harness.root / "reference")) + (1 << 20)
        with small_tmpfs(workdir, size):
            code, err = harness.run(workdir)
            rescued = workdir.with_name(workdir.name + "-rescued")
            shutil.copytree(workdir, rescued)  # what a user does with a full disk: move the run elsewhere
        shutil.rmtree(workdir)
        workdir = rescued
        out.detail, out.exit_code = f"tmpfs of {size / 2**20:.1f} MiB", code
    out.message = (err.strip().splitlines() or [""])[-1]
    out.tracebacks = err.count("Traceback (most recent call last)")
    out.absl_errors = sum(line.startswith("ERROR:absl") for line in err.splitlines())
    out.steps_done = last_step(workdir)
    # where the rerun continues: the newest checkpoint the fault left intact
    out.resumed_from = max((s for s in checkpoint_steps(workdir) if str(s) not in damaged), default=0)
    code, err = harness.run(workdir)  # the user's rerun
    out.completed = code == 0 and last_step(workdir) == harness.steps
    if not out.completed:
        out.message += f" | rerun exit {code}: {(err.strip().splitlines() or [''])[-1]}"
    out.loss_match = losses(workdir) == harness.reference()
    out.leftover_tmp = bool(leftovers(workdir))
    out.good_lost = bool({name.split(".")[0] for name in quarantined(workdir)} - damaged)
    return out


def _signal(harness: Harness, proc: subprocess.Popen, workdir: Path, sig: int, rng: random.Random) -> str:
    """Sends `sig` to the run; with several processes to one of them (a SIGTERM may instead go to the launcher,
    which forwards it to all). Returns who got it, for the report ("" for a single-process run)."""
    if harness.processes == 1:
        proc.send_signal(sig)
        return ""
    rank = rng.randrange(harness.processes + (sig == signal.SIGTERM))
    pid = process_pid(workdir, JAXLM_PROCESS_ID=rank) if rank < harness.processes else None
    if pid is None:  # the launcher (chosen, or the process already gone)
        proc.send_signal(sig)
        return "launcher: "
    os.kill(pid, sig)
    return f"p{rank}: "


def checkpoint_bytes(workdir: Path) -> int:
    """The size of a run's newest checkpoint."""
    newest = workdir / "checkpoints" / str(checkpoint_steps(workdir)[-1])
    return sum(p.stat().st_size for p in newest.rglob("*") if p.is_file())


def can_mount_tmpfs() -> bool:
    """Root with the right to mount (not every container grants it)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    import tempfile

    probe = Path(tempfile.mkdtemp(prefix="tmpfs-probe-"))
    try:
        return (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)], capture_output=True
            ).returncode
            == 0
            and subprocess.run(["umount", str(probe)], capture_output=True).returncode == 0
        )
    finally:
        probe.rmdir()


class small_tmpfs:
    """Context manager: a tmpfs of `size` bytes mounted at `path` (created), unmounted on exit."""

    def __init__(self, path: Path, size: int):
        self.path, self.size = path, size

    def __enter__(self):
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", str(self.path)], check=True)
        return self.path

    def __exit__(self, *exc):
        subprocess.run(["umount", str(self.path)], check=True)


def damage(step_dir: Path, how: str, rng: random.Random) -> None:
    """Damages a complete checkpoint the way a bad disk or a careless user would."""
    files = sorted((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    biggest = files[-1]
    if how == "flip_byte":
        data = bytearray(biggest.read_bytes())
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        biggest.write_bytes(bytes(data))
    elif how == "truncate":
        biggest.write_bytes(biggest.read_bytes()[: rng.randrange(biggest.stat().st_size)])
    elif how == "delete_file":
        rng.choice(files).unlink()
    elif how == "garbage_metadata":
        target = rng.choice(
            [step_dir / "data" / "metadata", step_dir / "config" / "metadata", step_dir / "state" / "_METADATA"]
        )
        target.write_text("{not json")
    else:
        raise ValueError(f"unknown damage {how!r}; one of {', '.join(DAMAGES)}")


def preemption_save_seconds(message: str) -> float | None:
    match = re.search(r"checkpoint written in ([\d.]+)s", message)
    return float(match.group(1)) if match else None
