"""Preemption: SIGTERM / SIGINT ask the training loop to stop after the current step, not in the middle of it.

Schedulers (SLURM, Kubernetes, Cloud TPU maintenance) send SIGTERM and wait a grace period before SIGKILL. The
handler only records the signal; the Trainer finishes the step it is on, writes a checkpoint synchronously and
exits with EXIT_PREEMPTED, and rerunning the same command continues with no step lost.

A signal is acknowledged at once, with one line, even while the main thread is inside XLA (a compile, a restore,
a step): Python runs its handlers only between bytecodes of the main thread, so a watcher thread reads the signal
numbers the C-level handler writes to a wakeup socket. A second Ctrl-C exits from there at once with
EXIT_INTERRUPTED and one line, never a traceback through XLA; the last complete checkpoint stays the one to resume
from (a save cut short leaves only temporaries, which the next run removes).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from pathlib import Path

EXIT_PREEMPTED = 75  # sysexits EX_TEMPFAIL: a temporary failure; rerun the command to continue
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """Training stopped at `step` on a signal, after writing a checkpoint of that step."""

    def __init__(self, step: int, signal_name: str, save_s: float):
        self.step, self.signal_name, self.save_s = step, signal_name, save_s
        super().__init__(
            f"{signal_name} after step {step}: checkpoint written in {save_s:.2f}s; rerun the same command to continue"
        )


class StopSignals:
    """Context manager: while active, SIGTERM / SIGINT set `received` instead of killing the process, the first
    one is acknowledged on stderr at once, and a second SIGINT exits the process with EXIT_INTERRUPTED.

    Handlers can only be installed from the main thread; elsewhere (a Trainer run in a worker thread) the
    guard is inert and signals keep their default behaviour."""

    def __init__(self, prog: str | None = None, nothing_to_save: bool = False):
        """``nothing_to_save``: before training starts the first signal ends the process at once, with one line."""
        self.prog = prog or Path(sys.argv[0]).stem or "jaxlm"  # `python -m experiments.tiny_lm` -> tiny_lm
        self.nothing_to_save = nothing_to_save
        self.received: str | None = None
        self.closing = False  # set once the run only closes its logs: no step, no checkpoint is left to cut short
        self._previous: dict = {}
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._previous_fd = -1
        self._seen: list[int] = []

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            self._wakeup = (reader, writer)
            threading.Thread(target=self._watch, args=(reader,), name="stop-signals", daemon=True).start()
        return self

    def _handle(self, signum, frame) -> None:
        self.received = self.received or signal.Signals(signum).name

    def _watch(self, reader: socket.socket) -> None:
        """Runs beside the main thread: acknowledges the first signal, ends the process on a second Ctrl-C."""
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:  # closed by __exit__
                return
            for signum in data:
                self._seen.append(signum)
                if self.nothing_to_save and signum in SIGNALS:
                    name = signal.Signals(signum).name
                    self._say(f"stopped: {name} before training started; nothing to save")
                    os._exit(128 + signum)
                if signum == signal.SIGINT and self._seen.count(signal.SIGINT) >= 2:
                    if self.closing:
                        self._say("second Ctrl-C: exiting now; the checkpoints are complete, the logs may miss a line")
                    else:
                        self._say("second Ctrl-C: exiting now, without a checkpoint of this step; the last one is kept")
                    os._exit(EXIT_INTERRUPTED)
                if len(self._seen) == 1 and self.closing:
                    name = signal.Signals(signum).name
                    self._say(f"{name}: the run is closing its logs and ends in a moment; Ctrl-C again to exit now")
                elif len(self._seen) == 1:
                    name = signal.Signals(signum).name
                    again = "; Ctrl-C again to exit at once without it" if signum == signal.SIGINT else ""
                    self._say(f"{name}: stopping after the current step with a checkpoint{again}")

    def _say(self, line: str) -> None:
        try:
            sys.stderr.write(f"\n{self.prog}: {line}\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_fd)
            for sock in reversed(self._wakeup):  # the writer first: the watcher's recv then returns b""
                sock.close()
            self._wakeup = None
