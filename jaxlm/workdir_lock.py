"""One run per workdir: a lock file that names its holder, taken before the run writes anything.

Two runs on one workdir would overwrite each other's checkpoints, config.json and metrics. The lock file
(``WORKDIR/run.lock``) holds the holder's host, pid, start time and command. It is created whole or not at all:
written to a temporary file, then hard-linked into place, which fails if the name exists. A second run reads it
and stops with one line naming the holder.

A run killed without releasing it (SIGKILL, a lost machine) leaves the file behind. Another run takes it over,
saying so, when its holder is provably gone:
- on the same host, when the holder's pid is no longer alive;
- across hosts (a shared filesystem), when the holder's heartbeat is older than ``stale_after_s``. The holder
  touches the file every ``heartbeat_s`` seconds from a daemon thread.

Takeover renames the stale file aside first. Only one of several racing runs wins that rename.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from data.atomic_dir import pid_alive

LOCK_NAME = "run.lock"


class WorkdirBusy(Exception):
    """Another live run holds the workdir; the message names it."""


@dataclasses.dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: str
    command: str

    @classmethod
    def me(cls) -> "Holder":
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        return cls(socket.gethostname(), os.getpid(), started, " ".join(sys.argv))

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}: {self.command}"


class WorkdirLock:
    """``acquire()`` takes the workdir or raises WorkdirBusy; ``release()`` (also at exit of a with-block) gives
    it back. ``acquire`` returns a line to log when it took over a dead run's lock, else None."""

    def __init__(self, workdir: str | Path, *, heartbeat_s: float = 30.0, stale_after_s: float = 300.0):
        self.path = Path(workdir) / LOCK_NAME
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.holder = Holder.me()
        self._stop = threading.Event()
        self._held = False

    def acquire(self) -> str | None:
        note = None
        for _ in range(5):  # a race lost to another run taking over the same stale lock: look again
            if self._create():
                self._held = True
                threading.Thread(target=self._beat, name="workdir-lock-heartbeat", daemon=True).start()
                return note
            holder, age = self._read()
            if holder is not None and holder.host == self.holder.host and holder.pid == self.holder.pid:
                self._held = True  # this process already holds it (a second Trainer in one process)
                return note
            gone = self._gone(holder, age)
            if gone is None:
                raise WorkdirBusy(
                    f"--workdir {self.path.parent} is in use by another run ({holder.describe()}); "
                    f"wait for it to finish, stop it, or use another --workdir"
                )
            aside = self.path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}")
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:
                continue  # another run took it over first
            aside.unlink(missing_ok=True)
            note = f"took over the workdir lock of a run that is gone ({gone})"
        raise WorkdirBusy(f"--workdir {self.path.parent}: could not take {self.path} (other runs keep taking it)")

    def _create(self) -> bool:
        tmp = self.path.with_name(f".{LOCK_NAME}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self.holder)) + "\n")
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def _read(self) -> tuple[Holder | None, float]:
        """The holder (None if the file is gone; pid -1 if unreadable) and seconds since its last heartbeat."""
        age = 0.0
        try:
            age = time.time() - self.path.stat().st_mtime
            return Holder(**json.loads(self.path.read_text())), age
        except FileNotFoundError:
            return None, 0.0
        except (OSError, ValueError, TypeError):
            return Holder("?", -1, "?", "an unreadable lock file"), age

    def _gone(self, holder: Holder | None, age: float) -> str | None:
        """Why the holder is provably gone, or None while it may be alive."""
        if holder is None:
            return "the lock file vanished"
        if holder.pid == -1:
            return "its lock file is unreadable"
        if holder.host == self.holder.host and holder.pid > 0 and not pid_alive(holder.pid):
            return f"{holder.describe()}; that pid is no longer running"
        if age > self.stale_after_s:
            return f"{holder.describe()}; no heartbeat for {age:.0f} s"
        return None

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self.path)
            except OSError:
                pass  # the next beat tries again; a lost lock file is taken over, never an error here

    def release(self) -> None:
        self._stop.set()
        if not self._held:
            return
        self._held = False
        holder, _ = self._read()
        if holder is not None and holder.host == self.holder.host and holder.pid == self.holder.pid:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "WorkdirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
