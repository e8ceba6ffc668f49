"""Print a pipeline schedule's table: `python -m sharding.schedule --schedule zbv --stages 4 --microbatches 8`.

The chart has a row per stage and a column per tick (F / B / W; lower case for a stage's second chunk; a backward
that is not split shows as B then W; idle as `.`), then the idle share against its formula, the peak stash per stage
(microbatches whose activations a stage holds, in stage-sized units), and as the last line one JSON object
(`bubble_fraction`, `peak_stash`, `ticks`). `--lockstep` prints the table as a pipeline with ring attention over a
context axis runs it (sharding.schedules.lockstep). Tables come from sharding.schedules; bad input is one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from sharding.schedules import NAMES, ScheduleError, lockstep, make, theory


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage + error
        raise ScheduleError(message)


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m sharding.schedule", description=__doc__.split("\n")[0])
    p.add_argument("--schedule", required=True, help=f"one of {', '.join(NAMES)}")
    p.add_argument("--stages", type=int, required=True, help="pipeline stages P")
    p.add_argument("--microbatches", type=int, required=True, help="microbatches M per step")
    p.add_argument("--virtual-stages", type=int, help="chunks per stage for interleaved-1f1b (default 2)")
    p.add_argument("--lockstep", action="store_true", help="as run with ring attention over a context axis")
    try:
        args = p.parse_args(argv)
        schedule = make(args.schedule, args.stages, args.microbatches, args.virtual_stages)
        schedule = lockstep(schedule) if args.lockstep else schedule
    except ScheduleError as e:
        print(f"sharding.schedule: error: {e}", file=sys.stderr)
        return 2
    sc = schedule
    expected = theory(sc.name, sc.stages, sc.microbatches, sc.chunks)
    stash = sc.peak_stash()
    chunks = f", {sc.chunks} chunks per stage" if sc.chunks > 1 else ""
    chunks += ", in lockstep (each tick one kind of op, run by every stage)" if sc.lockstep else ""
    print(f"{sc.name}: {sc.stages} stages, {sc.microbatches} microbatches{chunks}; {sc.ticks} ticks (F = B = W = 1)")
    print(sc.chart())
    print(
        f"bubble {sc.bubble_fraction:.4f} (formula {expected:.4f}); peak stash per stage {', '.join(map(str, stash))}"
    )
    print(json.dumps({"bubble_fraction": round(sc.bubble_fraction, 6), "peak_stash": stash, "ticks": sc.ticks}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
