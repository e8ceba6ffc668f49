"""Run N copies of a command as the processes of one JAX distributed run on this machine.

    python -m sharding.launch --processes 2 --cpu-devices 2 -- python -m experiments.tiny_lm --workdir runs/mp

Each copy gets JAXLM_COORDINATOR=127.0.0.1:PORT, JAXLM_NUM_PROCESSES=N and JAXLM_PROCESS_ID=i (read by
`sharding.distributed.initialize`), so multi-host code paths (per-process data, cross-process collectives,
multi-process checkpoints) can be exercised without a cluster. Output is streamed line by line, prefixed
`[p0] `, `[p1] `, ...; if one process fails the others are stopped and its exit code is returned; Ctrl-C is
forwarded to every process. On a real cluster, start one process per host with the same flags instead (or let
SLURM / Open MPI do it: the CLI then detects the cluster by itself).

With --independent the copies are not one JAX run but N separate ones, each with JAXLM_REPLICA_ID=i: DiLoCo
replicas that sync through a shared directory (`diloco.exchange`, `jaxlm.diloco.processes`). One that fails does
not stop the others, and --restart K starts a failed copy again, up to K times, so it rejoins the run:

    python -m sharding.launch --processes 4 --independent --restart 1 -- python -m experiments.tiny_lm \
        --workdir runs/ft --set diloco.replicas=4 --set diloco.exchange=runs/ft/exchange

With --processes-per-replica K as well, each replica is itself a JAX distributed run of K processes (its own
coordinator; JAXLM_REPLICA_ID=i in all of them), output prefixed `[r1p0] `: a replica spanning several hosts. When
one process of a replica fails, the rest of that replica is killed (its collectives cannot go on without it) and,
with restarts left, the whole replica is started again.
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
EXIT_PREEMPTED = 75  # jaxlm.preemption.EXIT_PREEMPTED (sharding imports nothing of jaxlm)
ENV_REPLICA_ID = "JAXLM_REPLICA_ID"
GRACE_S = 10.0  # after a failure or Ctrl-C: how long processes get to exit before they are killed


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage + error
        raise UsageError(message)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    cut = argv.index("--") if "--" in argv else len(argv)
    p = _Parser(
        prog="python -m sharding.launch",
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s --processes N [--port P] [--cpu-devices K] [--independent [--restart R] "
        "[--processes-per-replica K]] -- "
        "COMMAND [ARG ...]",
    )
    p.add_argument("--processes", type=int, required=True, help="number of processes N (>= 1)")
    p.add_argument(
        "--port",
        type=int,
        default=0,
        help="coordinator port on 127.0.0.1 (default: a free one; with --independent every replica run "
        "takes a free one)",
    )
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=0,
        help="simulated CPU devices per process (sets JAX_NUM_CPU_DEVICES); 0 keeps JAX's default",
    )
    p.add_argument(
        "--independent",
        action="store_true",
        help="N separate runs with JAXLM_REPLICA_ID=i (DiLoCo replica processes) instead of one JAX "
        "distributed run; a failure does not stop the others",
    )
    p.add_argument(
        "--restart",
        type=int,
        default=0,
        metavar="R",
        help="with --independent: start a replica that fails again, up to R times each (default 0)",
    )
    p.add_argument(
        "--processes-per-replica",
        type=int,
        default=1,
        metavar="K",
        help="with --independent: each of the N replicas is a JAX distributed run of K processes",
    )
    args = p.parse_args(argv[:cut])
    command = argv[cut + 1 :]
    if cut == len(argv):
        raise UsageError(
            "no command: put it after `--`, e.g. "
            "`python -m sharding.launch --processes 2 -- python -m experiments.tiny_lm`"
        )
    if not command:
        raise UsageError("no command after `--`")
    if args.processes < 1:
        raise UsageError(f"--processes must be >= 1, got {args.processes}")
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in [1, 65535] (0: a free one), got {args.port}")
    if args.port and not port_is_free(args.port):
        raise UsageError(f"--port {args.port} is in use on 127.0.0.1; pick another, or leave --port out for a free one")
    if args.cpu_devices < 0:
        raise UsageError(f"--cpu-devices must be >= 0, got {args.cpu_devices}")
    if args.restart < 0:
        raise UsageError(f"--restart must be >= 0, got {args.restart}")
    if args.restart and not args.independent:
        raise UsageError("--restart needs --independent: one process of a JAX distributed run cannot rejoin it")
    if args.processes_per_replica < 1:
        raise UsageError(f"--processes-per-replica must be >= 1, got {args.processes_per_replica}")
    if args.processes_per_replica > 1 and not args.independent:
        raise UsageError("--processes-per-replica needs --independent (replicas that are separate runs)")
    return args, command


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(rank: int, n: int, port: int, cpu_devices: int, replica: int | None = None) -> dict[str, str]:
    """Process `rank` of a JAX distributed run of `n` (no coordinator when n == 1), in DiLoCo replica `replica`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if replica is not None:
        env[ENV_REPLICA_ID] = str(replica)
    if n > 1 or replica is None:
        env.update(
            {"JAXLM_COORDINATOR": f"127.0.0.1:{port}", "JAXLM_NUM_PROCESSES": str(n), "JAXLM_PROCESS_ID": str(rank)}
        )
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
                out.write(prefix + pending[: cut + 1])
                out.flush()
            pending = pending[cut + 1 :]
    if pending:
        with lock:
            out.write(prefix + pending + b"\n")
            out.flush()


def run(
    command: list[str],
    processes: int,
    port: int = 0,
    cpu_devices: int = 0,
    independent: bool = False,
    restart: int = 0,
    processes_per_replica: int = 1,
) -> int:
    """Runs the processes; with `independent`, `processes` replicas of `processes_per_replica` processes each."""
    received = []  # signals to forward: Ctrl-C (SIGINT) or SIGTERM; caught from before the first child starts
    previous = {
        sig: signal.signal(sig, lambda signum, _: received.append(signum)) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    out, lock = sys.stdout.buffer, threading.Lock()
    last_words: list[str] = []
    children, pumps = [], []  # children: one list of processes per unit (the whole run, or one replica)

    def start_unit(i: int) -> list[subprocess.Popen]:
        if not independent:
            n, prefixes, replica = processes, [f"[p{j}] " for j in range(processes)], None
        else:
            n, replica = processes_per_replica, i
            prefixes = [f"[p{i}] "] if n == 1 else [f"[r{i}p{j}] " for j in range(n)]
        unit_port = port if port and not independent else free_port()  # each replica run has its own coordinator
        unit = []
        for j in range(n):
            # Own session: a terminal's Ctrl-C reaches only the launcher, which forwards it exactly once.
            try:
                child = subprocess.Popen(
                    command,
                    env=process_env(j, n, unit_port, cpu_devices, replica),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as e:
                _stop([c for u in children for c in u] + unit, signal.SIGTERM)
                raise UsageError(f"cannot start {command[0]!r}: {e}") from None
            unit.append(child)
            pumps.append(
                threading.Thread(target=_pump, args=(child.stdout, prefixes[j].encode(), out, lock), daemon=True)
            )
            pumps[-1].start()
        return unit

    def note(line: str) -> None:
        with lock:
            out.write(f"[launch] {line}\n".encode())
            out.flush()

    try:
        for i in range(processes if independent else 1):
            children.append(start_unit(i))
        if independent:
            code = _wait_independent(children, received, restart, start_unit, note)
        else:
            code = _wait(children[0], received, last_words)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for t in pumps:
        t.join(timeout=5)
    for line in last_words:  # after the processes' own output: the cause, as the last line a user reads
        note(line)
    return code


def _forwarded(processes: list[subprocess.Popen], received: list[int]) -> int | None:
    """After Ctrl-C or SIGTERM: forwards it, waits, and returns the exit code to report; None if none came."""
    if not received:
        return None
    _stop(processes, received[0])
    return _verdict([c.returncode for c in processes]) or 128 + received[0]


def _wait(children: list[subprocess.Popen], received: list[int], last_words: list[str]) -> int:
    """0 if every process succeeds. When one fails, the others are stopped (their collectives cannot go on without
    it) and the run's code is the one that process ended with: its own exit code (e.g. 75: preempted, after its
    checkpoint), or 128 + the signal that killed it, named in one line (a host dying prints nothing itself, and
    the survivors' errors about a lost peer are consequences, not the cause)."""
    while True:
        if (code := _forwarded(children, received)) is not None:
            return code
        codes = [c.poll() for c in children]
        failed = [(j, code) for j, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            j, code = failed[0]
            if code < 0 or code not in (EXIT_USAGE, EXIT_PREEMPTED):
                how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
                last_words.append(
                    f"process {j} {how}; stopped the other {len(children) - 1}. Rerun the same command to resume "
                    "from the last complete checkpoint"
                )
            _stop(children, signal.SIGTERM)
            return code if code > 0 else 128 - code
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.05)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _wait_independent(units: list[list[subprocess.Popen]], received: list[int], restart: int, start_unit, note) -> int:
    """Independent replicas: one whose process fails loses the rest of its processes (killed: their collectives
    would hang without it) and is started again while it has restarts left, else left failed while the others go
    on. 0 if every process finally succeeds, else the first failure's code (as `_wait`)."""
    left = [restart] * len(units)
    while True:
        if (code := _forwarded([c for unit in units for c in unit], received)) is not None:
            return code
        for i, unit in enumerate(units):
            failed = [(j, code) for j, c in enumerate(unit) if (code := c.poll()) not in (None, 0)]
            if not failed:
                continue
            j, code = failed[0]
            _stop(unit, signal.SIGKILL)  # only those still running
            if code != EXIT_USAGE and left[i]:  # bad input would fail again
                left[i] -= 1
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                who = f"process {i}" if len(unit) == 1 else f"process {j} of replica {i}"
                note(
                    f"{who} ended with {how}; starting {'it' if len(unit) == 1 else 'the replica'} again "
                    f"({restart - left[i]} of {restart})"
                )
                units[i] = start_unit(i)
        codes = [c.poll() for unit in units for c in unit]
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
        return run(
            command,
            args.processes,
            args.port,
            args.cpu_devices,
            args.independent,
            args.restart,
            args.processes_per_replica,
        )
    except UsageError as e:
        print(f"sharding.launch: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
