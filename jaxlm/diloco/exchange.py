"""A shared directory through which independent DiLoCo replica processes average their outer gradients and
survive each other's death.

Replicas inside one JAX program (`jaxlm.diloco.program`) average over the `replica` mesh axis; a collective across
processes hangs or fails when one of them dies. Here each replica is its own JAX process and a sync is a small agreement
protocol on a directory all of them can write (a shared filesystem on a cluster, a local one on one machine):

  sync_<step>_f<fragment>/r<i>.npz    replica i's encoded outer gradient, renamed into place when complete
  sync_<step>_f<fragment>/join_r<i>   replica i (re)joins at this sync: wait for it
  sync_<step>_f<fragment>/members.json the decision: which replicas' gradients this sync averages
  snapshot_<step>.npz                 the global state after a sync, for a replica that comes back
  alive_r<i>                          replica i's heartbeat: rewritten every heartbeat_s / 4 while its process lives

A replica posts its gradient, then waits until every replica it expects has posted, is dead, or `timeout_s` has
passed, and then decides. Dead is a replica whose heartbeat has not changed for `heartbeat_s` as this process saw
it (on its own clock, so hosts need not agree on the time): a process that died is not waited for, while one that
is restarting (beating again) or merely slow is, up to the timeout. The first to create members.json (an atomic
hard link, so exactly one creation wins) fixes the members and records whom it went on without; everyone reads
that file, so every survivor averages the same gradients in the same order and their global params stay bit for
bit equal. Expected are the previous sync's members plus the replicas that announced a join; a replica that missed
the decision is not a member and takes the new global params instead of its own. Decisions are durable, so a
process that restarts from a checkpoint replays them and reaches the same state.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.atomic_file import write_atomic

_SYNC = re.compile(r"sync_(\d+)_f(\d+)$")
_SNAPSHOT = re.compile(r"snapshot_(\d+)\.npz$")
LISTENER_GRACE_S = 300.0  # beyond the poster's own wait: how far behind a replica's process 0 may reach a sync


class ExchangeError(RuntimeError):
    """The exchange directory is unusable (e.g. unreadable) or inconsistent with this run."""


@dataclass(frozen=True)
class SyncResult:
    members: tuple[int, ...]  # the replicas whose gradients this sync averages, ascending
    payloads: dict[int, dict[str, np.ndarray]]  # each member's posted arrays
    waited_s: float  # time spent waiting for the others (0 for a replayed decision)
    left_out: dict[int, str]  # expected replicas the decision went on without, and why (decisions since heartbeats)


def save_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
    write_atomic(path, lambda f: np.savez(f, **arrays), durable=True)


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


class Heartbeat:
    """Rewrites `path` with a new count every `period_s` from a daemon thread while this process lives, so that
    the others can tell a dead replica (its file stands still) from a slow one. Content, not mtime, is what changes:
    readers compare it on their own clocks."""

    def __init__(self, path: Path, period_s: float):
        self.path, self.period_s = path, period_s
        self.token, self.count = uuid.uuid4().hex, 0  # a restarted process writes a new token: it beats again
        self._stop = threading.Event()
        self.beat()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat {path.name}", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self.count += 1
        write_atomic(self.path, f"{self.token} {self.count}")

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.beat()
            except OSError:  # a filesystem hiccup: the next beat tries again (a long one reads as death)
                pass

    def stop(self) -> None:
        """Stops beating; the file stays and stands still, as after a death (a restart beats it again)."""
        self._stop.set()
        self._thread.join()


class ReplicaExchange:
    """Replica `index` of `replicas`' view of the exchange directory `root`. `heartbeat_s` > 0: replicas whose
    heartbeat stood still that long are not waited for (see `beat`)."""

    def __init__(
        self,
        root: str | Path,
        replicas: int,
        index: int,
        timeout_s: float,
        poll_s: float = 0.01,
        heartbeat_s: float = 0.0,
    ):
        if not 0 <= index < replicas:
            raise ExchangeError(f"replica index {index} is not in [0, {replicas})")
        self.root, self.replicas, self.index = Path(root), replicas, index
        self.timeout_s, self.poll_s, self.heartbeat_s = timeout_s, poll_s, heartbeat_s
        self._seen: dict[int, tuple[str, float]] = {}  # replica -> (its heartbeat, when this process first saw it)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ExchangeError(f"cannot create the exchange directory {self.root}: {e.strerror}") from None

    # ------------------------------------------------------------------------- layout

    def sync_dir(self, step: int, fragment: int) -> Path:
        return self.root / f"sync_{step:09d}_f{fragment}"

    def syncs(self) -> list[tuple[int, int]]:
        """(step, fragment) of every sync directory present, in order."""
        found = (_SYNC.match(p.name) for p in self.root.iterdir())
        return sorted((int(m[1]), int(m[2])) for m in found if m)

    def _decision(self, step: int, fragment: int) -> dict | None:
        try:
            return json.loads((self.sync_dir(step, fragment) / "members.json").read_text())
        except FileNotFoundError:
            return None

    def members(self, step: int, fragment: int) -> tuple[int, ...] | None:
        """The decided members of a sync, or None if it is undecided (or gone)."""
        decision = self._decision(step, fragment)
        return None if decision is None else tuple(decision["members"])

    def left_out(self, step: int, fragment: int) -> dict[int, str]:
        """The expected replicas a decided sync went on without, and why."""
        decision = self._decision(step, fragment) or {}
        return {int(r): why for r, why in decision.get("left_out", {}).items()}

    def _expected(self, step: int, fragment: int) -> set[int]:
        """Whom to wait for: the last decided sync's members (everyone, before the first) plus announced joins."""
        earlier = [key for key in self.syncs() if key < (step, fragment)]
        previous = next((m for m in (self.members(*k) for k in reversed(earlier)) if m is not None), None)
        expected = set(range(self.replicas)) if previous is None else set(previous)
        joins = (re.fullmatch(r"join_r(\d+)", p.name) for p in self.sync_dir(step, fragment).iterdir())
        return expected | {int(m[1]) for m in joins if m} | {self.index}

    def _posted(self, directory: Path) -> set[int]:
        found = (re.fullmatch(r"r(\d+)\.npz", p.name) for p in directory.iterdir())
        return {int(m[1]) for m in found if m}

    # ------------------------------------------------------------------------- liveness

    def beat(self) -> Heartbeat:
        """Starts this replica's heartbeat (its speaking process calls it once, as early as it can: a restarted
        replica that beats again is waited for). Stop it with `.stop()`."""
        if self.heartbeat_s <= 0:
            raise ValueError(f"heartbeats need heartbeat_s > 0, got {self.heartbeat_s}")
        return Heartbeat(self.root / f"alive_r{self.index}", self.heartbeat_s / 4)

    def silent_s(self, replica: int) -> float | None:
        """How long `replica`'s heartbeat has stood still as this process saw it (remembered across syncs: one
        unchanged since the last sync's look stood still all along); None without a heartbeat file (not started
        yet, or heartbeats off): nothing is known, so the sync waits up to the timeout."""
        try:
            beat = (self.root / f"alive_r{replica}").read_text()
        except FileNotFoundError:
            return None
        now = time.monotonic()
        seen = self._seen.get(replica)
        if seen is None or seen[0] != beat:
            self._seen[replica] = (beat, now)
            return 0.0
        return now - seen[1]

    def _dead(self, replicas: set[int]) -> dict[int, str]:
        """Which of `replicas` have been silent for `heartbeat_s` or longer, and for how long."""
        if self.heartbeat_s <= 0:
            return {}
        silent = {r: self.silent_s(r) for r in sorted(replicas)}
        return {r: f"no heartbeat for {s:.1f}s" for r, s in silent.items() if s is not None and s >= self.heartbeat_s}

    # ------------------------------------------------------------------------- the sync

    def announce(self, step: int, fragment: int) -> None:
        """Tells the others to wait for this replica at that sync (a restart or a replica that fell behind)."""
        directory = self.sync_dir(step, fragment)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"join_r{self.index}").touch()

    def allreduce(self, step: int, fragment: int, payload: dict[str, np.ndarray] | None) -> SyncResult:
        """Posts this replica's payload and returns the sync's decided members and their payloads.

        A sync decided earlier (a replay after a restart) returns at once with the recorded payloads; this replica's
        own payload is not rewritten. If this replica is not among the members, `payloads` holds only theirs.
        `payload=None`: a process of a replica that another process of it speaks for; it only reads the decision."""
        directory = self.sync_dir(step, fragment)
        directory.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        members = self.members(step, fragment)
        if members is None and payload is None:
            members = self._await_decision(step, fragment)
        elif members is None:
            save_arrays(directory / f"r{self.index}.npz", payload)
            expected, deadline = self._expected(step, fragment), t0 + self.timeout_s
            while (members := self.members(step, fragment)) is None:
                posted = self._posted(directory)
                missing = expected - posted
                dead = self._dead(missing)
                if missing <= dead.keys() or time.monotonic() >= deadline:
                    late = {r: f"did not post within {self.timeout_s:g}s" for r in missing - dead.keys()}
                    self._decide(directory, sorted(posted), {**dead, **late})
                else:
                    time.sleep(self.poll_s)
        payloads = {m: load_arrays(directory / f"r{m}.npz") for m in members}
        return SyncResult(members, payloads, time.monotonic() - t0, self.left_out(step, fragment))

    def _await_decision(self, step: int, fragment: int) -> tuple[int, ...]:
        wait_s = 2 * self.timeout_s + LISTENER_GRACE_S
        deadline = time.monotonic() + wait_s
        while (members := self.members(step, fragment)) is None:
            if time.monotonic() >= deadline:
                raise ExchangeError(
                    f"the sync at step {step} (fragment {fragment}) in {self.root} was not decided in "
                    f"{wait_s:g}s: did process 0 of replica {self.index}, which posts for it, stop?"
                )
            time.sleep(self.poll_s)
        return members

    def _decide(self, directory: Path, members: list[int], left_out: dict[int, str]) -> None:
        """Proposes `members`; the first proposal to land is the decision (link() fails if the file exists)."""
        tmp = directory / f".members.{uuid.uuid4().hex}.tmp"
        tmp.write_text(
            json.dumps(
                {
                    "members": members,
                    "left_out": {str(r): why for r, why in sorted(left_out.items())},
                    "decided_by": self.index,
                    "time": time.time(),
                }
            )
        )
        try:
            os.link(tmp, directory / "members.json")
        except FileExistsError:
            pass
        finally:
            tmp.unlink()

    # ------------------------------------------------------------------------- snapshots and tidying

    def snapshots(self) -> list[int]:
        found = (_SNAPSHOT.match(p.name) for p in self.root.iterdir())
        return sorted(int(m[1]) for m in found if m)

    def publish(self, step: int, arrays: dict[str, np.ndarray]) -> None:
        save_arrays(self.root / f"snapshot_{step:09d}.npz", arrays)

    def latest_snapshot(self) -> tuple[int, dict[str, np.ndarray]] | None:
        """The newest snapshot (step, arrays); one deleted while it is read gives way to the next newest."""
        for step in reversed(self.snapshots()):
            try:
                return step, load_arrays(self.root / f"snapshot_{step:09d}.npz")
            except FileNotFoundError:
                continue
        return None

    def tidy(self, step: int, keep_steps: int | None, keep_snapshots: int = 2) -> None:
        """Removes syncs decided more than `keep_steps` steps before `step` (None: keep all) and all but the newest
        `keep_snapshots` snapshots. Called by the leader after a sync."""
        for old in self.snapshots()[:-keep_snapshots]:
            (self.root / f"snapshot_{old:09d}.npz").unlink(missing_ok=True)
        if keep_steps is None:
            return
        for s, f in self.syncs():
            if s < step - keep_steps and self.members(s, f) is not None:
                shutil.rmtree(self.sync_dir(s, f), ignore_errors=True)
