"""Export a jaxlm checkpoint as a Hugging Face Llama model directory.

    python -m experiments.export_hf --workdir runs/tiny_lm --out runs/tiny_lm_hf [--step N] [--dtype bfloat16]

The directory (config.json, safetensors, generation_config.json, tokenizer.json, tokenizer_config.json) loads with
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` alone. A run
that spans hosts is exported by running this command in every process (`python -m sharding.launch ... --` or the
--coordinator flags); see docs/huggingface.md. Bad input: one line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments.cli import exit_with

PROG = "experiments.export_hf"


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def parse_args(argv):
    p = _Parser(prog=f"python -m {PROG}", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, help="a training (or imported) run's workdir")
    p.add_argument("--out", required=True, help="the HF directory to write (new or empty)")
    p.add_argument("--step", type=int, help="the checkpoint step (default: the latest)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="tensor dtype in the files")
    p.add_argument("--max-shard-mb", type=float, default=4096, help="safetensors shard size limit (default 4096)")
    p.add_argument("--coordinator", metavar="HOST:PORT", help="multi-process: process 0's coordination service")
    p.add_argument("--num-processes", type=int, metavar="N", help="multi-process: number of processes")
    p.add_argument("--process-id", type=int, metavar="I", help="multi-process: this process's index")
    p.add_argument(
        "--join-timeout", type=float, metavar="S", help="multi-process: give up if the others have not joined in S s"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 written, 2 bad input, 4 a write failed (a full disk), 130 / 143 stopped by SIGINT / SIGTERM
    (nothing is left at --out; its scratch copy is removed, or by the next run if the process was cut short)."""
    from data.command_signals import run_stoppable

    return run_stoppable(
        PROG, lambda signals: _main(argv, signals), after=": nothing written to --out; rerun the same command"
    )


def _main(argv: list[str] | None, signals) -> int:
    from data.atomic_dir import no_space

    try:
        args = parse_args(argv)
        if not args.workdir.strip() or not args.out.strip():
            raise ValueError("--workdir and --out must not be empty")
        if args.max_shard_mb <= 0:
            raise ValueError(f"--max-shard-mb must be positive, got {args.max_shard_mb}")
        from sharding.distributed import initialize

        initialize(args.coordinator, args.num_processes, args.process_id, args.join_timeout)
        from jaxlm import hf_export

        out = Path(args.out)
        hf_export.check_out(out)
        signals.cleanup = lambda: hf_export.remove_scratch(out)  # if stopping takes past its grace period
        source = hf_export.open_source(Path(args.workdir), args.step)
    except (ValueError, OSError) as e:  # HFError, DistributedError, a flag
        print(f"{PROG}: error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2
    try:
        summary = hf_export.export(source, out, dtype=args.dtype, max_shard_bytes=int(args.max_shard_mb * 2**20))
    except ValueError as e:  # HFError found reading the params (unreadable, checksum)
        print(f"{PROG}: error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk: nothing is left at --out, the scratch copy is removed
        full = no_space(e, out.absolute().parent, hf_export.export_bytes(source, args.dtype), name=out)
        if full is None:
            raise
        print(f"{PROG}: error: {full}; free space and rerun (nothing was written to --out)", file=sys.stderr)
        return 4
    if summary:
        print(
            f"{PROG}: step {summary['step']} of {args.workdir}: {summary['tensors']} tensors "
            f"({summary['bytes'] / 1e6:.1f} MB in float32) as {summary['dtype']} in {len(summary['files'])} "
            f"safetensors file(s) -> {out}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    exit_with(main())
