"""Time per compiled HLO instruction, read from a ``jax.profiler`` trace: what ``bench_train --profile`` and
``step_profile`` print.

Why our own reader: xprof's views need TensorBoard, while jax's ``ProfileData`` reads the trace's XSpace as it is.
On a GPU, kernels are events on the device plane's stream lines; on a CPU, thunks are events on the host's XLA
threads. Either way each event names the instruction it ran (its ``hlo_op`` stat) and its program (``hlo_module``).
"""

from __future__ import annotations

import glob
import os
from collections import Counter
from dataclasses import dataclass, field

import jax


@dataclass
class OpTimes:
    """Nanoseconds per HLO instruction over a trace (per kernel name where ``source`` is ``device kernels``), where
    they were read (``device``, ``device kernels`` or ``host``), and each one's longest event's name (on a GPU, the
    CUDA kernel's)."""

    ns: Counter = field(default_factory=Counter)
    source: str = "host"
    kernel_names: dict[str, str] = field(default_factory=dict)


#: XLA_FLAGS that keep XLA's GPU compiler from gathering kernels into CUDA graphs (its command buffers)
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="


def trace_kernels_one_by_one() -> None:
    """No CUDA graphs in this process's GPU programs, unless XLA_FLAGS already says otherwise. Why: a kernel traced
    inside a graph names the graph's call, not its own instruction. Takes effect only before JAX starts its backend,
    which reads XLA_FLAGS once; a program then runs a little apart from one with graphs."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_command_buffer" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {NO_COMMAND_BUFFERS}".strip()


def trace(run, trace_dir: str) -> str:
    """Runs ``run()`` (which must block until its work is done) under the profiler; the trace file's path."""
    jax.profiler.start_trace(trace_dir)
    try:
        run()
    finally:
        jax.profiler.stop_trace()
    found = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not found:
        raise RuntimeError(f"the profiler wrote no trace under {trace_dir}")
    return max(found, key=os.path.getmtime)


def op_times(xplane_path: str, module: str | None = None, known=None) -> OpTimes:
    """The time of each HLO instruction in the trace, from the device planes where any has events naming one, else
    from the host's. ``module``: only events of that program (the name after ``HloModule`` in its HLO text), where
    the device's events say their program at all. A device whose events name no instruction gives its kernels'
    times by kernel name instead (source ``device kernels``): the host's launch times would say nothing of them.
    ``known``: the instructions the caller can place; device events naming none of them count as naming none. (A
    kernel run inside a CUDA graph names the graph's call, not its own instruction.)"""
    from jax._src.lib import _profile_data

    return times_from_planes(list(_profile_data.ProfileData.from_file(xplane_path).planes), module, known)


def times_from_planes(planes, module: str | None = None, known=None) -> OpTimes:
    """``op_times`` of a trace's planes (objects with ``name`` and ``lines``, each line ``name`` and ``events``,
    each event ``name``, ``duration_ns`` and ``stats`` pairs, as jax's ``ProfileData`` gives them)."""
    device = [p for p in planes if p.name.startswith("/device:")]
    host = [p for p in planes if p.name.startswith("/host:")]
    for source, chosen, program in (("device", device, module), ("device", device, None)):
        times = _collect(source, chosen, program)
        if times.ns and (known is None or not known.isdisjoint(times.ns)):
            return times
    if (times := _collect("device kernels", device, None, by_kernel=True)).ns:
        return times
    return _collect("host", host, module)


def _collect(source: str, planes, program: str | None, by_kernel: bool = False) -> OpTimes:
    """Nanoseconds per instruction (``by_kernel``: per event name) over ``planes``' events of ``program``."""
    times = OpTimes(source=source)
    longest: Counter = Counter()
    for plane in planes:
        for line in plane.lines:
            if line.name.startswith("python") or line.name in {"XLA Ops", "XLA Modules", "Steps"}:
                continue  # the Python stack, and lines derived from the streams (they would count twice)
            for event in line.events:
                stats = dict(event.stats)
                op = event.name if by_kernel else stats.get("hlo_op")
                if not op or (program and stats.get("hlo_module", program) != program):
                    continue
                times.ns[op] += event.duration_ns
                if event.duration_ns >= longest[op]:
                    longest[op] = event.duration_ns
                    times.kernel_names[op] = event.name
    return times
