"""Run lm-evaluation-harness tasks on a trained model: lm-eval's results JSON written into the workdir.

    python -m experiments.lm_eval --workdir runs/tiny_lm --tasks hellaswag,arc_easy --limit 200
    python -m experiments.lm_eval --workdir runs/tiny_lm --tasks my_task --include-path my_tasks/ --num-fewshot 5

--workdir is a training run's workdir (its latest checkpoint, or --step N), an import_hf workdir or a
quantize_checkpoint output; the model's own tokenizer encodes every request. --tasks names lm-eval tasks or groups
(comma-separated); --include-path adds a directory of task YAML files (a local `dataset_path: json` task runs
offline). Needs the eval extra (pip install -e ".[eval]"). Writes lm-eval's results JSON to
WORKDIR/lm_eval/results_stepN_TIME.json (--output DIR elsewhere; never over an existing file), prints lm-eval's
table, then the figures as one JSON object. Bad input (an unknown task, a workdir without a checkpoint, the extra
missing) exits 2 with one line naming it, before anything compiles.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from experiments.cli import exit_with, load_trained_model, trained_model_parser, use_compilation_cache

PROG = "experiments.lm_eval"
EXIT_BAD_INPUT = 2
EXIT_WRITE_FAILED = 4


def parse_args(argv):
    p = trained_model_parser(PROG, __doc__.split("\n")[0])
    p.add_argument("--tasks", required=True, help="lm-eval tasks or groups, comma-separated (hellaswag,arc_easy)")
    p.add_argument("--include-path", metavar="DIR", help="a directory of your own lm-eval task YAML files")
    p.add_argument("--limit", type=float, help="examples per task at most (a fraction of each task if < 1)")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples per prompt (default: each task's own)")
    p.add_argument("--batch-size", type=int, default=16, help="requests per compiled batch (default 16)")
    p.add_argument("--bootstrap-iters", type=int, default=100_000, help="resamples for stderrs; 0: none (100000)")
    p.add_argument("--output", metavar="DIR", help="where the results JSON goes (default: WORKDIR/lm_eval)")
    return p.parse_args(argv)


def check_args(args) -> list[str]:
    """The task names; ValueError naming the first bad flag (all before anything loads)."""
    for flag in ("workdir", "include_path", "output", "mesh"):
        value = getattr(args, flag)
        if value is not None and not value.strip():
            raise ValueError(f"--{flag.replace('_', '-')} is empty; give a path (or leave the flag out)")
    tasks = [t.strip() for t in args.tasks.split(",")]
    if not any(tasks) or not all(tasks):
        raise ValueError(f"--tasks {args.tasks!r} names an empty task; give names separated by commas")
    if args.limit is not None and not args.limit > 0:
        raise ValueError(f"--limit must be > 0 (a count, or a fraction below 1), got {args.limit:g}")
    if args.limit is not None and args.limit >= 1:
        if args.limit != int(args.limit):
            raise ValueError(f"--limit {args.limit:g} is neither a whole count nor a fraction below 1")
        args.limit = int(args.limit)
    for flag, least in (("num_fewshot", 0), ("batch_size", 1), ("bootstrap_iters", 0), ("cpu_devices", 0)):
        value = getattr(args, flag)
        if value is not None and value < least:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= {least}, got {value}")
    return tasks


def output_dir(args) -> Path:
    """--output, or WORKDIR/lm_eval; refused inside another command's directory (a quantize_checkpoint output, an
    HF export) or where a file stands."""
    from data.ownership import check_target
    from jaxlm.harness import RESULTS_DIR

    out = Path(args.output) if args.output else Path(args.workdir) / RESULTS_DIR
    flag = "--output" if args.output else f"--output (default {out})"
    check_target(out, "lm-eval results", flag)
    blocker = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ValueError(f"{flag}: {blocker} is a file, not a directory; give --output DIR")
    return out


def main(argv: list[str] | None = None) -> int:
    """SIGTERM / Ctrl-C: one line and exit 143 / 130, also while XLA compiles (the results file appears whole or not
    at all; a second Ctrl-C exits at once)."""
    from data.command_signals import run_stoppable

    return run_stoppable(PROG, lambda _: _main(argv), grace_s=2.0)


def _main(argv: list[str] | None) -> int:
    try:
        args = parse_args(argv)
        tasks = check_args(args)
        if not Path(args.workdir).is_dir():
            raise ValueError(f"--workdir {args.workdir} is not a directory")
        from jaxlm import harness

        harness.task_manager(tasks, args.include_path)  # unknown names fail here, before the model loads
        loaded = load_trained_model(args)
        out = output_dir(args)
        lm = harness.adapter_for(loaded, args.workdir, batch_size=args.batch_size)
        use_compilation_cache(None)  # a task compiles a program per length (~1 s each for tiny_lm): a rerun loads them
        t0 = time.perf_counter()
        results = harness.run_tasks(
            lm,
            tasks,
            include_path=args.include_path,
            limit=args.limit,
            num_fewshot=args.num_fewshot,
            bootstrap_iters=args.bootstrap_iters,
        )
        seconds = time.perf_counter() - t0
    except (ValueError, OSError) as e:  # a flag, a task, the workdir, a task's data files
        return _fail(str(e))
    from data.atomic_dir import no_space

    try:
        path = harness.save_results(results, out, loaded.step)
    except OSError as e:
        return _fail(no_space(e, out, name=out) or f"cannot write the results to {out}: {e}", EXIT_WRITE_FAILED)
    from lm_eval.utils import make_table

    print(make_table(results))
    kind = "int8 weight-only" if loaded.int8 else "checkpoint"
    print(
        f"{PROG}: {kind} step {loaded.step} of {args.workdir}: {', '.join(tasks)} in {seconds:.1f} s (compiling "
        f"included) -> {path}",
        file=sys.stderr,
    )
    record = {"workdir": args.workdir, "step": loaded.step, "tasks": tasks, "results": str(path), "seconds": seconds}
    print(json.dumps({**record, **harness.flat_metrics(results, prefix="")}))
    return 0


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> int:
    print(f"{PROG}: error: {' '.join(message.splitlines())}", file=sys.stderr)
    return code


if __name__ == "__main__":
    exit_with(main())
