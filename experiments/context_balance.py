"""How evenly each order deals packed documents' attention work over a context axis.

python -m experiments.context_balance [--seq 8192] [--context 8] [--median 600] [--rows 64]

Rows of documents with log-normal lengths (median --median tokens, sigma 1.2: many short documents and a long
tail, as packed web text), a causal document mask, and per order (contiguous, zigzag, documents) the max / mean
score pairs kept per device (`sharding.context_order.balance`, the figure each step logs as context_balance): the
mean over rows and the worst row. On hardware the step waits for the device with the most work, so a balance
of 1.5 is a third of the attention's time spent idle on the others.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from experiments.cli import exit_with
from pallas_kernels.mask_spec import parse_mask
from sharding.context_order import balance, sequence_order

ORDERS = ("contiguous", "zigzag", "documents")


def packed_rows(seed: int, rows: int, seq_len: int, median: float) -> np.ndarray:
    """Segment ids [rows, seq_len] of documents with log-normal lengths (sigma 1.2), cut at the row's end."""
    rng = np.random.default_rng(seed)
    doc_ends = np.cumsum(np.clip(rng.lognormal(np.log(median), 1.2, size=(rows, seq_len)), 1, seq_len).astype(int), 1)
    return np.stack([np.searchsorted(ends, np.arange(seq_len), side="right") for ends in doc_ends]).astype(np.int32)


def measure(seq_len: int, context: int, median: float, rows: int, block: int, seed: int = 0) -> dict:
    mask = parse_mask("causal & document")
    segments_BT = packed_rows(seed, rows, seq_len, median)
    figures = {}
    for how in ORDERS:
        order = sequence_order(mask, seq_len, context, how, segments_BT, block)
        if order is not None and order.ndim == 1:
            order = np.broadcast_to(order, segments_BT.shape)
        per_row = [
            float(balance(mask, seq_len, None if order is None else order[i : i + 1], context, segments_BT[i : i + 1]))
            for i in range(rows)
        ]
        figures[how] = {"mean": round(float(np.mean(per_row)), 4), "worst": round(max(per_row), 4)}
    return figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.context_balance", description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=8192, help="tokens per row (default 8192)")
    parser.add_argument("--context", type=int, default=8, help="context axis size (default 8)")
    parser.add_argument("--median", type=float, default=600, help="median document length in tokens (default 600)")
    parser.add_argument("--rows", type=int, default=64, help="rows measured (default 64)")
    parser.add_argument("--block", type=int, default=128, help="attention query tile (default 128)")
    args = parser.parse_args(argv)
    if args.seq % (2 * args.context) or args.context < 2:
        parser.error(f"--seq ({args.seq}) must divide into 2 x --context ({args.context}) chunks, context >= 2")
    figures = measure(args.seq, args.context, args.median, args.rows, args.block)
    print(f"T={args.seq} C={args.context} median document {args.median:g} tokens, {args.rows} rows")
    print(f"{'order':<12}{'mean':>8}{'worst':>8}   (max / mean score pairs per device)")
    for how, f in figures.items():
        print(f"{how:<12}{f['mean']:>8.3f}{f['worst']:>8.3f}")
    print(json.dumps({"seq": args.seq, "context": args.context, "median": args.median, **figures}))
    return 0


if __name__ == "__main__":
    exit_with(main())
