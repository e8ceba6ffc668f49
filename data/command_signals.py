"""SIGTERM / SIGINT for the commands that are not training (prepare, train_tokenizer, export, import, quantize).

Without a handler SIGTERM ends a command silently with 143 and leaves its temporaries behind, and Ctrl-C prints a
traceback from wherever it lands (one per worker process). Inside `CommandSignals` the first signal raises
`Stopped` in the main thread, so the command's own `finally` blocks remove what it was writing and it reports one
line. Python runs handlers only between bytecodes of the main thread; when that thread is inside C code that does
not return (a Rust tokenizer training, an XLA compile), a watcher thread, woken through the wakeup fd, runs the
command's `cleanup` and exits after `grace_s`. A second Ctrl-C exits at once, from any state, with one line.
Training has its own, step-aware version (jaxlm.preemption).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from typing import Callable

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code(signal_name: str) -> int:
    """The shell's convention: 128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + signal.Signals[signal_name].value


class Stopped(KeyboardInterrupt):
    """A command stopped by a signal (a KeyboardInterrupt, so no `except Exception` swallows it)."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name
        self.code = exit_code(signal_name)


_deferring = [0, None]  # open `signals_deferred` blocks, and the stop they hold back


@contextlib.contextmanager
def signals_deferred():
    """A stop that arrives inside the block (two renames that must both happen, say) is raised when it ends."""
    _deferring[0] += 1
    try:
        yield
    finally:
        _deferring[0] -= 1
        held, _deferring[1] = _deferring[1], None
        if held is not None and _deferring[0] == 0:
            raise Stopped(held)


def run_stoppable(prog: str, body: Callable[["CommandSignals"], int], *, after: str = "", grace_s: float = 10.0) -> int:
    """`body(signals)` inside CommandSignals: a stop (or a KeyboardInterrupt raised in-process) becomes one line,
    "PROG: stopped by SIGNAL" + `after`, and the shell's exit code. Every command but training ends this way."""
    try:
        with CommandSignals(prog, grace_s=grace_s) as signals:
            return body(signals)
    except KeyboardInterrupt as e:
        name = e.signal_name if isinstance(e, Stopped) else "SIGINT"
        print(f"{prog}: stopped by {name}{after}", file=sys.stderr)
        return exit_code(name)


class CommandSignals:
    """While active: the first SIGTERM / SIGINT raises Stopped in the main thread; if the command has not ended
    `grace_s` later, or on a second Ctrl-C, `cleanup()` runs and the process exits with one line. Inert outside
    the main thread."""

    def __init__(self, prog: str, cleanup: Callable[[], None] | None = None, grace_s: float = 10.0):
        self.prog, self.cleanup, self.grace_s = prog, cleanup, grace_s
        self.received: str | None = None
        self._previous: dict = {}
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._previous_fd = -1
        self._done = threading.Event()

    def __enter__(self) -> "CommandSignals":
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._wakeup = (reader, writer)
        threading.Thread(target=self._watch, args=(reader,), name="command-signals", daemon=True).start()
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is None:  # later signals are the watcher's: a second Ctrl-C exits from there
            self.received = signal.Signals(signum).name
            if _deferring[0]:
                _deferring[1] = self.received
            else:
                raise Stopped(self.received)

    def _watch(self, reader: socket.socket) -> None:
        seen = 0
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum not in SIGNALS:
                    continue
                seen += 1
                name = signal.Signals(signum).name
                if seen == 1:
                    threading.Thread(target=self._deadline, args=(name,), daemon=True).start()
                elif signum == signal.SIGINT:
                    self._exit(f"second Ctrl-C: exiting now; {self._rerun}", exit_code("SIGINT"))

    def _deadline(self, name: str) -> None:
        if not self._done.wait(self.grace_s):
            self._exit(f"{name}: still busy {self.grace_s:.0f}s later; exiting now; {self._rerun}", exit_code(name))

    def _quit(self, signum, frame) -> None:
        self._exit(f"{signal.Signals(signum).name}: exiting now", exit_code(self.received))

    _rerun = "rerun the same command to start again (nothing half-written is kept under the output's name)"

    def _exit(self, line: str, code: int) -> None:
        try:
            if self.cleanup is not None:
                self.cleanup()
        except Exception:
            pass  # a rerun removes what is left (data.atomic_dir.remove_abandoned)
        try:
            sys.stderr.write(f"\n{self.prog}: {line}\n")
            sys.stderr.flush()
        finally:
            os._exit(code)

    def __exit__(self, *exc) -> None:
        self._done.set()
        for sig, handler in self._previous.items():
            # Stopping already: a signal while the command reports and exits ends it at once, in one line.
            signal.signal(sig, self._quit if self.received else handler)
        self._previous.clear()
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_fd)
            for sock in reversed(self._wakeup):
                sock.close()
            self._wakeup = None
