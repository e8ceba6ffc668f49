"""Run N copies of a command as the processes of one JAX distributed run on this machine.

    python -m sharding.launch --processes 2 --cpu-devices 2 -- python -m experiments.tiny_lm --workdir runs/mp

Each copy gets JAXLM_COORDINATOR=127.0.0.1:PORT, JAXLM_NUM_PROCESSES=N and JAXLM_PROCESS_ID=i (read by
`sharding.distributed.initialize`), so multi-host code paths (per-process data, cross-process collectives,
multi-process checkpoints) can be exercised without a cluster. Output is streamed line by line, prefixed
`[p0] `, `[p1] `, ...; if one process fails the others are stopped and its exit code is returned; Ctrl-C is
forwarded to every process. On a real cluster, start one process per host with the same flags instead (or let
SLURM / Open MPI do it: the CLI then detects the cluster by itself).

With --independent the copies are not one JAX run but N separate ones, each with JAXLM_REPLICA_ID=i: DiLoCo
replicas that sync through a shared directory (`diloco.exchange`, `jaxlm.diloco_processes`). One that fails does
not stop the others, and --restart K starts a failed copy again, up to K times, so it rejoins the run:

    python -m sharding.launch --processes 4 --independent --restart 1 -- python -m experiments.tiny_lm \
        --workdir runs/ft --set diloco.replicas=4 --set diloco.exchange=runs/ft/exchange
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
ENV_REPLICA_ID = "JAXLM_REPLICA_ID"
GRACE_S = 10.0  # after a failure or Ctrl-C: how long processes get to exit before they are killed


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage + error
        raise UsageError(message)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    cut = argv.index("--") if "--" in argv else len(argv)
    p = _Parser(prog="python -m sharding.launch", description=__doc__.split("\n\n")[0],
                usage="%(prog)s --processes N [--port P] [--cpu-devices K] [--independent [--restart K]] -- "
                      "COMMAND [ARG ...]")
    p.add_argument("--processes", type=int, required=True, help="number of processes N (>= 1)")
    p.add_argument("--port", type=int, default=0, help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("--cpu-devices", type=int, default=0,
                   help="simulated CPU devices per process (sets JAX_NUM_CPU_DEVICES); 0 keeps JAX's default")
    p.add_argument("--independent", action="store_true",
                   help="N separate runs with JAXLM_REPLICA_ID=i (DiLoCo replica processes) instead of one JAX "
                        "distributed run; a failure does not stop the others")
    p.add_argument("--restart", type=int, default=0, metavar="K",
                   help="with --independent: start a process that fails again, up to K times each (default 0)")
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
    if args.restart < 0:
        raise UsageError(f"--restart must be >= 0, got {args.restart}")
    if args.restart and not args.independent:
        raise UsageError("--restart needs --independent: one process of a JAX distributed run cannot rejoin it")
    return args, command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(i: int, n: int, port: int, cpu_devices: int, independent: bool = False) -> dict[str, str]:
    if independent:
        env = {**os.environ, ENV_REPLICA_ID: str(i), "PYTHONUNBUFFERED": "1"}
    else:
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


def run(command: list[str], processes: int, port: int = 0, cpu_devices: int = 0, independent: bool = False,
        restart: int = 0) -> int:
    port = port or free_port()
    received = []  # signals to forward: Ctrl-C (SIGINT) or SIGTERM; caught from before the first child starts
    previous = {sig: signal.signal(sig, lambda signum, _: received.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    out, lock = sys.stdout.buffer, threading.Lock()
    children, pumps = [], []

    def start(i: int) -> subprocess.Popen:
        # Own session: a terminal's Ctrl-C reaches only the launcher, which forwards it exactly once.
        try:
            child = subprocess.Popen(command, env=process_env(i, processes, port, cpu_devices, independent),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            _stop(children, signal.SIGTERM)
            raise UsageError(f"cannot start {command[0]!r}: {e}") from None
        pumps.append(threading.Thread(target=_pump, args=(child.stdout, f"[p{i}] ".encode(), out, lock),
                                      daemon=True))
        pumps[-1].start()
        return child

    def note(line: str) -> None:
        with lock:
            out.write(f"[launch] {line}\n".encode())
            out.flush()

    try:
        for i in range(processes):
            children.append(start(i))
        if independent:
            code = _wait_independent(children, received, restart, start, note)
        else:
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


def _wait_independent(children: list[subprocess.Popen], received: list[int], restart: int, start, note) -> int:
    """Independent runs: a failed process is started again while it has restarts left, and otherwise left failed
    while the others go on. 0 if every process finally succeeds, else the first failure's code (as `_wait`)."""
    left = [restart] * len(children)
    while True:
        if received:
            _stop(children, received[0])
            return _verdict([c.returncode for c in children]) or 128 + received[0]
        for i, child in enumerate(children):
            code = child.poll()
            if code not in (None, 0, EXIT_USAGE) and left[i]:  # bad input would fail again
                left[i] -= 1
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                note(f"process {i} ended with {how}; starting it again ({restart - left[i]} of {restart})")
                children[i] = start(i)
        codes = [c.poll() for c in children]
        if all(code is not None for code in codes):
            return _verdict(codes)
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
        return run(command, args.processes, args.port, args.cpu_devices, args.independent, args.restart)
    except UsageError as e:
        print(f"sharding.launch: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
