"""Run N copies of a command as the processes of one JAX distributed run on this machine.

    python -m sharding.launch --processes 2 --cpu-devices 2 -- python -m experiments.tiny_lm --workdir runs/mp

Each copy gets JAXLM_COORDINATOR=127.0.0.1:PORT, JAXLM_NUM_PROCESSES=N and JAXLM_PROCESS_ID=i (read by
`sharding.distributed.initialize`), so multi-host code paths (per-process data, cross-process collectives,
multi-process checkpoints) can be exercised without a cluster. Output is streamed line by line, prefixed
`[p0] `, `[p1] `, ...; if one process fails the others are stopped and its exit code is returned; Ctrl-C is
forwarded to every process. On a real cluster, start one process per host with the same flags instead (or let
SLURM / Open MPI do it: the CLI then detects the cluster by itself).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

EXIT_USAGE = 2
GRACE_S = 10.0  # after a failure or Ctrl-C: how long processes get to exit before they are killed


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage + error
        raise UsageError(message)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    cut = argv.index("--") if "--" in argv else len(argv)
    p = _Parser(prog="python -m sharding.launch", description=__doc__.split("\n\n")[0],
                usage="%(prog)s --processes N [--port P] [--cpu-devices K] -- COMMAND [ARG ...]")
    p.add_argument("--processes", type=int, required=True, help="number of processes N (>= 1)")
    p.add_argument("--port", type=int, default=0, help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("--cpu-devices", type=int, default=0,
                   help="simulated CPU devices per process (sets JAX_NUM_CPU_DEVICES); 0 keeps JAX's default")
    args = p.parse_args(argv[:cut])
    command = argv[cut + 1:]
    if cut == len(argv):
        raise UsageError("no command: put it after `--`, e.g. "
                         "`python -m sharding.launch --processes 2 -- python -m experiments.tiny_lm`")
    if not command:
        raise UsageError("no command after `--`")
    if args.processes < 1:
        raise UsageError(f"--processes must be >= 1, got {args.processes}")
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in [1, 65535] (0: a free one), got {args.port}")
    if args.cpu_devices < 0:
        raise UsageError(f"--cpu-devices must be >= 0, got {args.cpu_devices}")
    return args, command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(i: int, n: int, port: int, cpu_devices: int) -> dict[str, str]:
    env = {**os.environ, "JAXLM_COORDINATOR": f"127.0.0.1:{port}", "JAXLM_NUM_PROCESSES": str(n),
           "JAXLM_PROCESS_ID": str(i), "PYTHONUNBUFFERED": "1"}
    if cpu_devices:
        env["JAX_NUM_CPU_DEVICES"] = str(cpu_devices)
    return env


def _pump(stream, prefix: bytes, out, lock: threading.Lock) -> None:
    """Copies a child's output, prefixing every line (and every \\r-redrawn progress-bar line)."""
    pending = b""
    for chunk in iter(lambda: stream.read1(65536), b""):
        pending += chunk
        while True:
            cut = min((i for i in (pending.find(b"\n"), pending.find(b"\r")) if i >= 0), default=-1)
            if cut < 0:
                break
            with lock:
                out.write(prefix + pending[:cut + 1])
                out.flush()
            pending = pending[cut + 1:]
    if pending:
        with lock:
            out.write(prefix + pending + b"\n")
            out.flush()


def run(command: list[str], processes: int, port: int = 0, cpu_devices: int = 0) -> int:
    port = port or free_port()
    received = []  # signals to forward: Ctrl-C (SIGINT) or SIGTERM; caught from before the first child starts
    previous = {sig: signal.signal(sig, lambda signum, _: received.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    out, lock = sys.stdout.buffer, threading.Lock()
    children, pumps = [], []
    try:
        for i in range(processes):
            # Own session: a terminal's Ctrl-C reaches only the launcher, which forwards it exactly once.
            try:
                child = subprocess.Popen(command, env=process_env(i, processes, port, cpu_devices),
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as e:
                _stop(children, signal.SIGTERM)
                raise UsageError(f"cannot start {command[0]!r}: {e}") from None
            children.append(child)
            pumps.append(threading.Thread(target=_pump, args=(child.stdout, f"[p{i}] ".encode(), out, lock),
                                          daemon=True))
            pumps[-1].start()
        code = _wait(children, received)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for t in pumps:
        t.join(timeout=5)
    return code


def _wait(children: list[subprocess.Popen], received: list[int]) -> int:
    """0 if every process succeeds; else, after stopping the rest, the code a process exited with by itself (e.g.
    75: preempted, after its checkpoint) rather than a death by signal (the shell's 128 + s)."""
    while True:
        if received:
            _stop(children, received[0])
            return _verdict([c.returncode for c in children]) or 128 + received[0]
        codes = [c.poll() for c in children]
        if any(code not in (None, 0) for code in codes):
            _stop(children, signal.SIGTERM)
            return _verdict([c.returncode for c in children])
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.05)


def _verdict(codes: list[int]) -> int:
    """The first positive exit code, else 128 + the signal that killed the first process killed, else 0."""
    own = [code for code in codes if code > 0]
    killed = [code for code in codes if code < 0]
    return own[0] if own else 128 - killed[0] if killed else 0


def _stop(children: list[subprocess.Popen], sig: int) -> None:
    for c in children:
        if c.poll() is None:
            c.send_signal(sig)
    deadline = time.monotonic() + GRACE_S
    for c in children:
        try:
            c.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()


def main(argv: list[str] | None = None) -> int:
    try:
        args, command = parse(sys.argv[1:] if argv is None else argv)
        return run(command, args.processes, args.port, args.cpu_devices)
    except UsageError as e:
        print(f"sharding.launch: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
