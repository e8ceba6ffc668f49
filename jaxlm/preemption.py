"""Preemption: SIGTERM / SIGINT ask the training loop to stop after the current step, not in the middle of it.

Schedulers (SLURM, Kubernetes, Cloud TPU maintenance) send SIGTERM and wait a grace period before SIGKILL. The
handler only records the signal; the Trainer finishes the step it is on, writes a checkpoint synchronously and
exits with EXIT_PREEMPTED, and rerunning the same command continues with no step lost. A second SIGINT (Ctrl-C
pressed twice) interrupts at once, for a user who does not want to wait for the checkpoint.
"""

from __future__ import annotations

import signal
import threading

EXIT_PREEMPTED = 75  # sysexits EX_TEMPFAIL: a temporary failure; rerun the command to continue

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """Training stopped at `step` on a signal, after writing a checkpoint of that step."""

    def __init__(self, step: int, signal_name: str, save_s: float):
        self.step, self.signal_name, self.save_s = step, signal_name, save_s
        super().__init__(
            f"{signal_name} after step {step}: checkpoint written in {save_s:.2f}s; rerun the same command to continue"
        )


class StopSignals:
    """Context manager: while active, SIGTERM / SIGINT set `received` instead of killing the process.

    Handlers can only be installed from the main thread; elsewhere (a Trainer run in a worker thread) the
    guard is inert and signals keep their default behaviour."""

    def __init__(self):
        self.received: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.received == "SIGINT":
            raise KeyboardInterrupt  # the second Ctrl-C
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
