"""Train tiny_lm on a mixture of Python source and Markdown docs, annealed to Python at the end, against runs on
one source each, at equal steps; compare each source's bits per byte.

    python -m experiments.compare_mixture                     # 3 runs of tiny_lm's default steps on 2 cores
    python -m experiments.compare_mixture --steps 200 --variants python,mixture

The sources: `python`, tiny_lm's own corpus (this Python's standard library, its BPE-4096 tokenizer), and `markdown`,
the *.md files under --docs (default: the installed packages' READMEs and docs in site-packages) prepared with the
same tokenizer into ROOT/data/markdown. Variants: `python` and `markdown` (one source each: the other has weight 0, so
both are evaluated), and `mixture`, 0.7 Python + 0.3 Markdown, then Python only for the last --anneal share of the
steps. Each variant trains in ROOT/NAME (a rerun resumes or skips a finished run). Prints each source's final eval
bits per byte and the realized share of Markdown before and during the annealing; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
from pathlib import Path

from experiments.cli import exit_with
from experiments.tiny_lm import main as tiny_lm

VARIANTS = ("python", "markdown", "mixture")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.compare_mixture", description=__doc__.split("\n")[0])
    p.add_argument("--root", default="runs/compare_mixture", help="the Markdown dataset and one workdir per variant")
    p.add_argument("--docs", default=sysconfig.get_paths()["purelib"], help="a directory of *.md files")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list from {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=400, help="steps per run")
    p.add_argument("--anneal", type=float, default=0.2, help="share of the steps at the end on Python only")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override for every run")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    if not names or set(names) - set(VARIANTS):
        p.error(f"--variants: unknown {sorted(set(names) - set(VARIANTS)) or 'empty list'}; choose from {VARIANTS}")
    if args.steps < 10 or not 0 <= args.anneal < 1:
        p.error(f"need --steps >= 10 and 0 <= --anneal < 1, got {args.steps} and {args.anneal}")
    return args, names


def sources(root: Path, docs: str) -> tuple[Path, Path]:
    """(Python dataset, Markdown dataset): tiny_lm's corpus, and --docs' *.md prepared with its tokenizer."""
    from data.corpus import default_corpus
    from data.prepare import main as prepare

    python = default_corpus(tokenizer="bpe4096")
    markdown = root / "data" / "markdown"
    if not markdown.exists():
        code = prepare(["--input", docs, "--pattern", "*.md", "--tokenizer", str(python), "--output", str(markdown)])
        if code:
            raise SystemExit(code)
    return python, markdown


def main(argv: list[str] | None = None) -> int:
    from jaxlm.metrics import read_metrics

    args, names = parse_args(argv)
    root = Path(args.root)
    python, markdown = sources(root, args.docs)
    anneal_at = int(round(args.steps * (1 - args.anneal)))
    mixes = {
        "python": [f"data.mixture={python}:1,{markdown}:0"],
        "markdown": [f"data.mixture={python}:0,{markdown}:1"],
        "mixture": [f"data.mixture={python}:0.7,{markdown}:0.3", f"data.mixture_stages={anneal_at}:1,0"],
    }
    py, md = python.name, markdown.name
    final = {}
    for name in names:
        # a record's data_mix covers the steps since the last one: the annealing starts at a record's boundary
        sets = mixes[name] + [f"eval_every={max(1, args.steps // 4)}", f"log_every={math.gcd(anneal_at, 10)}"]
        sets += args.set
        flags = ["--workdir", str(root / name), "--steps", str(args.steps)] + [a for s in sets for a in ("--set", s)]
        print(f"== {name}: tiny_lm {' '.join(flags)}", file=sys.stderr)
        code = tiny_lm(flags + (["--no-progress"] if args.no_progress else []))
        if code:
            return code
        records = read_metrics(root / name / "metrics.jsonl")
        last = [r for r in records if "eval_loss" in r][-1]
        share = {
            phase: _mean([r[f"data_mix/{md}"] for r in records if f"data_mix/{md}" in r and inside(r["step"])])
            for phase, inside in (("before", lambda s: s <= anneal_at), ("annealing", lambda s: s > anneal_at))
        }
        final[name] = {
            "bpb_python": last[f"eval_bits_per_byte/{py}"],
            "bpb_markdown": last[f"eval_bits_per_byte/{md}"],
            "markdown_share_before": share["before"],
            "markdown_share_annealing": share["annealing"],
        }
    print(f"\n{args.steps} steps each; the mixture anneals to Python from step {anneal_at}")
    print(f"{'variant':<10}{'bpb python':>12}{'bpb markdown':>14}{'md share before':>17}{'md share after':>16}")
    for name, f in final.items():
        print(
            f"{name:<10}{f['bpb_python']:>12.4f}{f['bpb_markdown']:>14.4f}{f['markdown_share_before']:>17.3f}"
            f"{f['markdown_share_annealing']:>16.3f}"
        )
    print(json.dumps({n: {k: round(v, 4) for k, v in f.items()} for n, f in final.items()}))
    return 0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


if __name__ == "__main__":
    exit_with(main())
