"""How long a kernel's tail is when its programs start in index order against heavy first, simulated: the figure
behind ``pallas_kernels.kernel_inputs.heavy_first``.

    python -m experiments.program_order              # causal rows of 128 at the ~1B step's and hopper_attention's sizes
    python -m experiments.program_order --sms 114    # another GPU (an H100 PCIe has 114 SMs)

A GPU starts a kernel's programs in grid order (heads fastest, then the mask's lines, then batch) as SMs free up,
one program per SM for these kernels (their shared memory). A program's time is taken as its tiles plus ``--fixed``
tiles' worth of prologue and epilogue. Printed: each order's end time over the work divided evenly across the SMs.
A model of the scheduler, not a timing: ``experiments.hopper_attention`` times the kernels on a GPU.
"""

from __future__ import annotations

import argparse
import heapq

from experiments.cli import exit_with

SHAPES = ((8, 16, 16), (2, 16, 64), (1, 16, 128))  # (batch, heads, block rows): 2k x 8, 8k x 2, 16k x 1


def end_time(works, sms: int) -> float:
    """When the last of ``works`` (program times, in start order) ends, each started on the first free SM."""
    free = [0.0] * sms
    for work in works:
        heapq.heappush(free, heapq.heappop(free) + work)
    return max(free)


def causal_programs(batch: int, heads: int, lines: int, fixed: float, heavy_first: bool) -> list[float]:
    """Program times of a causal forward (or dQ) in start order: row r has r + 1 tiles."""
    rows = range(lines - 1, -1, -1) if heavy_first else range(lines)
    return [r + 1 + fixed for _ in range(batch) for r in rows for _ in range(heads)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.program_order", description=__doc__.split("\n")[0])
    p.add_argument("--sms", type=int, default=132, help="streaming multiprocessors (an H100 SXM's: 132)")
    p.add_argument("--fixed", type=float, default=1.0, help="a program's prologue and epilogue, in tiles (1)")
    args = p.parse_args(argv)
    if args.sms < 1 or args.fixed < 0:
        p.error("--sms must be >= 1 and --fixed >= 0")
    print(f"{'batch x heads x rows':>22s} {'index order':>12s} {'heavy first':>12s}  (end / work evenly divided)")
    for batch, heads, lines in SHAPES:
        ends = []
        for heavy in (False, True):
            works = causal_programs(batch, heads, lines, args.fixed, heavy)
            ends.append(end_time(works, args.sms) / (sum(works) / args.sms))
        print(f"{f'{batch} x {heads} x {lines}':>22s} {ends[0]:12.3f} {ends[1]:12.3f}")
    return 0


if __name__ == "__main__":
    exit_with(main())
