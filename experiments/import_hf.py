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
    try:
        args = parse_args(argv)
        if not args.hf.strip() or not args.workdir.strip() or (args.data is not None and not args.data.strip()):
            raise ValueError("--hf, --workdir and --data must not be empty")
        from jaxlm import hf_import

        workdir = Path(args.workdir)
        hf_import.check_workdir(workdir)
        plan = hf_import.plan(Path(args.hf), data=args.data, overrides=args.set)
        params = hf_import.read_params(plan)
        hf_import.write_workdir(plan, params, workdir)
    except (ValueError, OSError) as e:  # HFError, ConfigError, TokenFileError, a flag, an unreadable file
        print(f"{PROG}: error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2
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


if __name__ == "__main__":
    exit_with(main())
