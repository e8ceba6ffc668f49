"""lm-eval loglikelihood speed: the jaxlm adapter against lm-eval's own Hugging Face backend (HFLM, torch, CPU) on the
same model, exported by export_hf, in one run.

    python -m experiments.bench_lm_eval --workdir runs/tiny_lm
    python -m experiments.bench_lm_eval --workdir runs/tiny_lm --requests 2000 --batch-size 32

The requests are multiple-choice shaped, as hellaswag's or arc's: --requests / 4 contexts of Python source from
this interpreter's standard library (20-240 tokens: under the model's max length, so neither side truncates), each
with four continuations of 1-20 tokens, the true one and three taken from elsewhere. Both sides get the same lm-eval
Instances through `loglikelihood` (tokenizing included) at the same batch size, float32. Each is timed warm, best
of --repeats after a first pass over the same requests (timed apart: the adapter compiles in it); the figure is
seconds per 1,000 requests and the ratio, with how far the two sides' loglikelihoods differ. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments.cli import exit_with


def requests_of(tokenizer, count: int, seed: int = 0) -> list[tuple[str, str]]:
    """`count` (context, continuation) pairs, four per context, from the standard library's source."""
    from data.corpus import stdlib_sources

    root, files = stdlib_sources()
    rng = np.random.default_rng(seed)
    texts = [t for t in ((root / f).read_text(errors="replace") for f in sorted(files)[:200]) if len(t) > 4000]
    pairs = []
    while len(pairs) < count:
        text = texts[rng.integers(len(texts))]
        ids = tokenizer.encode(text)
        start = int(rng.integers(0, len(ids) - 300))
        context_len, true_len = int(rng.integers(20, 240)), int(rng.integers(1, 21))
        context = tokenizer.decode(ids[start : start + context_len])
        choices = [tokenizer.decode(ids[start + context_len : start + context_len + true_len])]
        for _ in range(3):
            other = int(rng.integers(0, len(ids) - 21))
            choices.append(tokenizer.decode(ids[other : other + int(rng.integers(1, 21))]))
        pairs += [(context, c) for c in choices if c]
    return pairs[:count]


def timed(lm, instances, repeats: int) -> tuple[float, float, list]:
    """(seconds of the first pass: the adapter compiles in it, best seconds of `repeats` more, the results)."""
    t0 = time.perf_counter()
    out = lm.loglikelihood(instances, disable_tqdm=True)
    first, best = time.perf_counter() - t0, float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = lm.loglikelihood(instances, disable_tqdm=True)
        best = min(best, time.perf_counter() - t0)
    return first, best, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench_lm_eval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workdir", default="runs/tiny_lm", help="a trained workdir (default runs/tiny_lm)")
    p.add_argument("--requests", type=int, default=1000, help="loglikelihood requests (default 1000)")
    p.add_argument("--batch-size", type=int, default=16, help="requests per batch, both sides (default 16)")
    p.add_argument("--repeats", type=int, default=2, help="timed passes per side, best kept (default 2)")
    args = p.parse_args(argv)
    try:
        if args.requests < 4 or args.batch_size < 1 or args.repeats < 1:
            raise ValueError("--requests must be >= 4, --batch-size and --repeats >= 1")
        from jaxlm import harness, hf_export

        lm = harness.load_adapter(args.workdir, batch_size=args.batch_size)
        source = hf_export.open_source(Path(args.workdir), lm.info["step"])
    except ValueError as e:
        print(f"bench_lm_eval: error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2
    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    pairs = requests_of(lm.tok, args.requests)
    instances = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "hf"
        hf_export.export(source, out, dtype="float32", max_shard_bytes=4 << 30)
        hf = HFLM(pretrained=str(out), device="cpu", batch_size=args.batch_size, dtype="float32")
        ours_first, ours_s, ours = timed(lm, instances, args.repeats)
        theirs_first, theirs_s, theirs = timed(hf, instances, args.repeats)
    diff = float(np.max(np.abs(np.array([a for a, _ in ours]) - np.array([a for a, _ in theirs]))))
    greedy_same = sum(a[1] == b[1] for a, b in zip(ours, theirs, strict=True))
    cfg = lm.model.cfg
    lengths = [len(lm.tok_encode(c + x)) for c, x in pairs]
    print(
        f"lm-eval loglikelihood, {len(pairs)} requests ({np.mean(lengths):.0f} tokens each on average), batch "
        f"{args.batch_size}, float32: {args.workdir} step {lm.info['step']} ({cfg.num_layers} layers, d "
        f"{cfg.d_model}, vocab {cfg.vocab_size}, max length {cfg.max_seq_len}); torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'backend':<28} {'s / 1000 requests':>18} {'first pass s':>13}")
    per_1000 = {
        "jaxlm adapter": ours_s * 1000 / len(pairs),
        "lm-eval HFLM (transformers)": theirs_s * 1000 / len(pairs),
    }
    for (name, seconds), first in zip(per_1000.items(), (ours_first, theirs_first), strict=True):
        print(f"{name:<28} {seconds:>18.2f} {first:>13.2f}")
    ratio = theirs_s / ours_s
    print(f"jaxlm {ratio:.2f}x HFLM's speed; loglikelihoods differ by at most {diff:.2g}, is-greedy agrees on "
          f"{greedy_same} of {len(pairs)}")  # fmt: skip
    summary = {
        "requests": len(pairs),
        "batch_size": args.batch_size,
        "mean_tokens": float(np.mean(lengths)),
        "jaxlm_s_per_1000": per_1000["jaxlm adapter"],
        "hflm_s_per_1000": per_1000["lm-eval HFLM (transformers)"],
        "speedup": ratio,
        "jaxlm_first_pass_s": ours_first,
        "hflm_first_pass_s": theirs_first,
        "max_abs_diff": diff,
        "greedy_agree": greedy_same,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    exit_with(main())
