"""Byte-level vs a trained BPE on tiny_lm, at equal training FLOPs, by eval bits per byte.

    python -m experiments.compare_tokenizers                 # tiny_lm's config, 160 byte-level steps, BPE 4096
    python -m experiments.compare_tokenizers --quick         # a tiny model and a few steps (the test's)

Both runs read the default corpus (this Python's standard library, tests excluded), set by
`data.corpus_tokenizer`: `byte`, and `bpe<N>`, a BPE trained on the whole corpus and the corpus prepared with it
into token shards (`data.corpus.default_corpus`, built once). Each run is `python -m experiments.tiny_lm` as a
user runs it. A BPE token costs more FLOPs (its
larger embedding and head) but stands for several bytes, so the BPE run gets the steps that make its training
FLOPs equal the byte-level run's. Eval bits per byte compares them whatever the tokenizer: both runs hold out the
last 1% of their tokens, the same tail of the corpus. Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from experiments.cli import exit_with

REPO = Path(__file__).resolve().parents[1]
QUICK = [
    *("--set", "model.d_model=64", "--set", "model.num_layers=2", "--set", "model.mlp_dim=128"),
    *("--set", "model.max_seq_len=64", "--set", "data.seq_len=64", "--set", "data.batch_size=8"),
    *("--set", "data.microbatches=1", "--set", "data.eval_batches=2", "--set", "tensorboard=false"),
]


def flops_per_token(flags: list[str]) -> float:
    """Training FLOPs per token of tiny_lm's config with `flags` (its vocabulary: the data's tokenizer's)."""
    from flax import nnx

    from jaxlm.config import apply_overrides, load_config
    from jaxlm.model import Transformer, count_params, model_flops_per_token
    from jaxlm.run_data import resolve_vocab

    sets = [flags[i + 1] for i in range(len(flags) - 1) if flags[i] == "--set"]
    cfg = resolve_vocab(apply_overrides(load_config(REPO / "experiments" / "configs" / "tiny_lm.py"), sets))
    model = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    return model_flops_per_token(cfg.model, count_params(model), cfg.data.seq_len)


def train_run(workdir: Path, steps: int, flags: list[str]) -> dict:
    """Runs tiny_lm to `steps`; its last eval record, wall seconds and mean tokens/s."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "experiments.tiny_lm", "--workdir", str(workdir), "--steps", str(steps)]
    proc = subprocess.run([*cmd, "--no-progress", *flags], cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{workdir.name} run failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_bits_per_byte" in r]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]  # the first includes compiling
    return {
        "steps": steps,
        "eval_loss": evals[-1]["eval_loss"],
        "eval_bits_per_byte": evals[-1]["eval_bits_per_byte"],
        "wall_s": time.perf_counter() - t0,
        "tokens_per_s": sum(speeds) / max(len(speeds), 1),
        "samples": evals[-1].get("eval_samples", []),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.compare_tokenizers", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", default="runs/compare_tokenizers", help="the two runs")
    p.add_argument("--steps", type=int, default=160, help="byte-level steps (the BPE run gets equal FLOPs)")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary")
    p.add_argument("--quick", action="store_true", help="a tiny model, 8 steps, a 512-token BPE")
    args = p.parse_args(argv)
    root = Path(args.workdir)
    flags = QUICK if args.quick else []
    steps, vocab = (8, 512) if args.quick else (args.steps, args.vocab_size)

    flags = {
        "byte": [*flags, "--set", "data.corpus_tokenizer=byte"],  # explicit: tiny_lm's own default is a BPE
        "bpe": [*flags, "--set", f"data.corpus_tokenizer=bpe{vocab}"],
    }
    per_token = {name: flops_per_token(f) for name, f in flags.items()}  # builds the BPE corpus if it is new
    bpe_steps = max(1, round(steps * per_token["byte"] / per_token["bpe"]))
    runs = {
        "byte": train_run(root / "byte", steps, flags["byte"]),
        "bpe": train_run(root / f"bpe{vocab}", bpe_steps, flags["bpe"]),
    }
    print(
        f"{'tokenizer':<12}{'steps':>7}{'MFLOP/token':>13}{'eval loss':>11}{'bits/byte':>11}{'tok/s':>9}{'wall s':>8}"
    )
    for name, r in runs.items():
        label = "byte" if name == "byte" else f"BPE {vocab}"
        print(
            f"{label:<12}{r['steps']:>7}{per_token[name] / 1e6:>13.1f}{r['eval_loss']:>11.4f}"
            f"{r['eval_bits_per_byte']:>11.4f}{r['tokens_per_s']:>9.0f}{r['wall_s']:>8.1f}"
        )
    for name, r in runs.items():
        for sample in r["samples"][:2]:
            print(f"  {name} sample: {sample['prompt']!r} -> {sample['continuation'][:80]!r}")
    better = min(runs, key=lambda n: runs[n]["eval_bits_per_byte"])
    ratio = runs["bpe"]["eval_bits_per_byte"] / runs["byte"]["eval_bits_per_byte"]
    print(f"at equal training FLOPs, {better} is better: BPE / byte bits per byte = {ratio:.3f}")
    summary = {
        "byte_bits_per_byte": round(runs["byte"]["eval_bits_per_byte"], 4),
        "bpe_bits_per_byte": round(runs["bpe"]["eval_bits_per_byte"], 4),
        "bpe_over_byte": round(ratio, 4),
        "byte_steps": steps,
        "bpe_steps": bpe_steps,
        "bpe_vocab": vocab,
        "byte_wall_s": round(runs["byte"]["wall_s"], 1),
        "bpe_wall_s": round(runs["bpe"]["wall_s"], 1),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    exit_with(main())
