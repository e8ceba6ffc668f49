"""Import a Hugging Face Llama model (Llama 2 / 3 / 3.1) as a jaxlm workdir at step 0, to generate with or fine-tune.

    python -m experiments.import_hf --hf DIR --workdir runs/llama [--data TOKENS] [--set data.seq_len=512 ...]
    python -m experiments.tiny_lm --config runs/llama/config.json --workdir runs/llama --steps 100   # fine-tune

DIR holds config.json, safetensors (one file or shards with an index) and tokenizer.json. --data is the token data
fine-tuning reads (written with DIR's tokenizer: checked); --set overrides any config field but the model's shape.
Bad input (another architecture, biases, an unknown RoPE type, a missing or mis-shaped tensor): one line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments.cli import exit_with

PROG = "experiments.import_hf"


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def parse_args(argv):
    p = _Parser(prog=f"python -m {PROG}", description=__doc__.split("\n")[0])
    p.add_argument("--hf", required=True, help="a Hugging Face model directory (save_pretrained / a hub snapshot)")
    p.add_argument("--workdir", required=True, help="the jaxlm workdir to create (new or empty)")
    p.add_argument("--data", help="token data to fine-tune on, written with the model's tokenizer (default: none)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 written, 2 bad input, 4 the disk filled, 130 / 143 stopped by SIGINT / SIGTERM (nothing is
    left at --workdir; its scratch copy is removed, or by the next run if the process was cut short)."""
    from data.command_signals import run_stoppable

    return run_stoppable(
        PROG, lambda signals: _main(argv, signals), after=": nothing written to --workdir; rerun the same command"
    )


def _main(argv: list[str] | None, signals) -> int:
    from data.atomic_dir import NO_SPACE_TEXT, no_space, space_line
    from jaxlm.checkpoint import CheckpointSaveError

    try:
        args = parse_args(argv)
        if not args.hf.strip() or not args.workdir.strip() or (args.data is not None and not args.data.strip()):
            raise ValueError("--hf, --workdir and --data must not be empty")
        from jaxlm import hf_import

        workdir = Path(args.workdir)
        hf_import.check_workdir(workdir)
        signals.cleanup = lambda: hf_import.remove_scratch(workdir)  # if stopping takes past its grace period
        plan = hf_import.plan(Path(args.hf), data=args.data, overrides=args.set)
        params = hf_import.read_params(plan)
    except (ValueError, OSError) as e:  # HFError, ConfigError, TokenFileError, a flag, an unreadable file
        print(f"{PROG}: error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2
    try:
        hf_import.write_workdir(plan, params, workdir)
    except (OSError, CheckpointSaveError) as e:
        needed = sum(a.nbytes for a in _leaves(params)) * 3  # the params and the optimizer's two moments
        if isinstance(e, CheckpointSaveError):
            full = space_line(workdir, e.cause, workdir.absolute().parent, needed) if e.cause in NO_SPACE_TEXT else None
        else:
            full = no_space(e, workdir.absolute().parent, needed, name=workdir)
        if full is None:
            raise
        print(f"{PROG}: error: {full}; free space and rerun (nothing was written to --workdir)", file=sys.stderr)
        return 4
    m = plan.cfg.model
    if not args.data and not plan.tokenizer.is_byte:
        print(
            f"{PROG}: note: no --data, so the config reads the default (byte-level) corpus; to fine-tune, import "
            f"again with --data TOKENS written with {args.hf}/tokenizer.json",
            file=sys.stderr,
        )
    print(
        f"{PROG}: {m.num_layers} layers, d_model {m.d_model}, {m.num_heads}/{m.num_kv_heads} heads, vocabulary "
        f"{plan.vocab_size} (padded to {m.vocab_size}) -> {workdir}/checkpoints/0; fine-tune: python -m "
        f"experiments.tiny_lm --config {workdir}/config.json --workdir {workdir} --steps N",
        file=sys.stderr,
    )
    return 0


def _leaves(tree):
    """The arrays of a nested dict."""
    for value in tree.values():
        yield from _leaves(value) if isinstance(value, dict) else (value,)


if __name__ == "__main__":
    exit_with(main())
