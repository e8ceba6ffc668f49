"""Preparation benchmark: `data.prepare` against the raw `Tokenizer.encode_batch` of the same tokenizer on the same
text, in one run.

    python -m experiments.bench_prepare                    # 64 MB corpus, an 8,192-token BPE, all cores
    python -m experiments.bench_prepare --corpus-mb 1024 --skip-raw --skip-single   # peak RSS on 1 GB
    python -m experiments.bench_prepare --quick            # 2 MB, a 512-token BPE (the test)

The corpus is this Python's standard library source (real, varied text, no download), copied until --corpus-mb
and written as 3/4 jsonl files, 1/4 parquet (row groups of 8 MB). The tokenizer is trained on its first 8 MB
(`data.train_tokenizer`) unless --tokenizer names one. Then, on the same documents:

  raw        `Tokenizer.encode_batch` and `encode_batch_fast` over the documents in the batches prepare encodes
             (1 MB), timed inside the calls only (the library on every core, nothing else); the faster is the yardstick
  prepare    `python -m data.prepare` as a subprocess, --workers processes (default all cores): reading,
             parsing, tokenizing, writing shards and the manifest; and once more with --workers 1 (one process,
             encode_batch's own threads), the design not taken
  memory     peak RSS of prepare's process tree: the sum over its processes sampled every 0.1 s, and the sum of
             each process's own peak (VmHWM, exact per process; an upper bound for the tree)
  CPU        the CPU seconds of the raw calls (every thread) and of prepare's processes: "x raw CPU" is the raw
             CPU time over prepare's, the pipeline's cost over the tokenizer's, robust to a shared machine

The ratio ("x raw") is prepare's tokens/s over the best raw tokens/s (both counting the tokens of the text, not the
EOS prepare adds): the goal is >= 0.8. The last line is a JSON summary.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from data.shard_worker import BATCH_CHARS
from data.text_sources import Counts, ReadOptions, documents, find_inputs, plan_pieces
from data.text_tokenizer import load_tokenizer
from data.token_shards import TokenShards
from data.train_tokenizer import special_tokens, train
from experiments.cli import exit_with

GOAL = 0.8
RAW_METHODS = ("encode_batch", "encode_batch_fast")
TRAIN_MB = 8
FILE_MB = 64


def stdlib_documents():
    """This Python's standard library source files (tests excluded), as text, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if not {"test", "tests", "site-packages", "idle_test"} & set(path.relative_to(root).parts):
            text = path.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                yield text


def write_corpus(directory: Path, corpus_mb: float) -> int:
    """Writes about `corpus_mb` MB of documents as jsonl files and parquet files (every 4th file); returns bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    target, written, copy, file_index = int(corpus_mb * 2**20), 0, 0, 0
    batch, batch_bytes = [], 0
    file_bytes = min(FILE_MB << 20, max(target // 8, 1 << 16))

    def flush():
        nonlocal file_index, batch, batch_bytes
        if file_index % 4 == 3:
            pq.write_table(pa.table({"text": batch}), directory / f"part-{file_index:04d}.parquet", row_group_size=2000)
        else:
            with open(directory / f"part-{file_index:04d}.jsonl", "w", encoding="utf-8") as f:
                f.writelines(json.dumps({"text": t}) + "\n" for t in batch)
        file_index, batch, batch_bytes = file_index + 1, [], 0

    while written < target:
        for text in stdlib_documents():
            text = f"# copy {copy}\n{text}"  # copies differ a little, as real documents do
            batch.append(text)
            size = len(text.encode())
            written, batch_bytes = written + size, batch_bytes + size
            if batch_bytes >= file_bytes:
                flush()
            if written >= target:
                break
        copy += 1
    if batch:
        flush()
    return written


def corpus_texts(directory: Path):
    options, counts = ReadOptions(), Counts()
    for path in find_inputs([str(directory)], ["*.jsonl", "*.parquet"]):
        for piece in plan_pieces(path, options, 1 << 62):
            yield from (t for t in documents(piece, options, counts) if t)


def raw_rate(tok, directory: Path, methods) -> dict:
    """Tokens/s (wall and CPU) of each encode method over the corpus, in batches read between the calls: the batches
    prepare encodes (BATCH_CHARS; measured on the 2-core VM, 8 MB batches cost ~25% more CPU per token)."""
    rates = {}
    for method in methods:
        encode, seconds, cpu, tokens, chars = getattr(tok.hf, method), 0.0, 0.0, 0, 0
        batch, batch_chars = [], 0
        for text in itertools.chain(corpus_texts(directory), [None]):  # read lazily; the clock runs only in encode
            if text is not None:
                batch.append(text)
                batch_chars += len(text)
            if batch and (text is None or batch_chars >= BATCH_CHARS):
                start, cpu_start = time.perf_counter(), time.process_time()  # process time: every thread
                encodings = encode(batch, add_special_tokens=False)
                seconds, cpu = seconds + time.perf_counter() - start, cpu + time.process_time() - cpu_start
                tokens += sum(len(e) for e in encodings)
                chars += batch_chars
                batch, batch_chars = [], 0
        rates[method] = {"tokens": tokens, "seconds": seconds, "cpu_s": cpu, "tokens_per_s": tokens / seconds}
    return rates


def process_tree(pid: int) -> dict[int, dict[str, int]]:
    """{pid: {"VmRSS": bytes, "VmHWM": bytes}} of process `pid` and its descendants (Linux /proc). VmHWM is a
    process's own peak RSS, kept by the kernel: exact where sampling could miss a short peak."""
    found, stack = {}, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
            found[p] = {k: int(v.split()[0]) * 1024 for k, v in fields.items()}
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return found


def run_prepare(corpus: Path, tokenizer: Path, out: Path, workers: int, shard_mb: float) -> dict:
    """Times `python -m data.prepare` and samples its process tree's RSS."""
    cmd = [sys.executable, "-m", "data.prepare", "--input", str(corpus), "--pattern", "*.jsonl", "--pattern"]
    cmd += ["*.parquet", "--tokenizer", str(tokenizer), "--output", str(out), "--workers", str(workers)]
    cmd += ["--no-progress", "--overwrite", "--shard-mb", str(shard_mb)]
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tree_peak, process_peaks = [0], {}

    def sample():
        while proc.poll() is None:
            tree = process_tree(proc.pid)
            tree_peak[0] = max(tree_peak[0], sum(t.get("VmRSS", 0) for t in tree.values()))
            process_peaks.update({p: max(process_peaks.get(p, 0), t.get("VmHWM", 0)) for p, t in tree.items()})
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    seconds = time.perf_counter() - start
    sampler.join()
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)  # prepare and its workers, all waited for
    cpu = sum(getattr(cpu_after, k) - getattr(cpu_before, k) for k in ("ru_utime", "ru_stime"))
    if proc.returncode:
        raise SystemExit(f"bench_prepare: data.prepare failed ({proc.returncode}): {stderr.strip()[-500:]}")
    meta = TokenShards.open(out).meta
    text_tokens = meta["num_tokens"] - meta["num_documents"] * (1 + meta["add_bos"])  # without EOS / BOS
    return {
        "seconds": seconds,
        "cpu_s": cpu,
        "tokens": meta["num_tokens"],
        "text_tokens": text_tokens,
        "documents": meta["num_documents"],
        "shards": len(meta["shards"]),
        "tokens_per_s": text_tokens / seconds,
        "peak_rss_tree_mb": tree_peak[0] / 2**20,  # the sum over the tree, sampled
        "peak_rss_sum_mb": sum(process_peaks.values()) / 2**20,  # each process's own peak, summed: an upper bound
        "processes": len(process_peaks),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="experiments.bench_prepare", description=__doc__.splitlines()[0])
    parser.add_argument("--corpus-mb", type=float, default=64, help="size of the generated corpus (default 64)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="BPE trained when no --tokenizer (8192)")
    parser.add_argument("--tokenizer", help="a tokenizer.json to use instead of training one")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="prepare's --workers (all cores)")
    parser.add_argument("--workdir", help="where the corpus and token data go (default: a temp dir, removed)")
    parser.add_argument("--raw", nargs="+", default=list(RAW_METHODS), choices=RAW_METHODS, help="raw calls to time")
    parser.add_argument("--skip-raw", action="store_true", help="no raw timing (the memory run)")
    parser.add_argument("--skip-single", action="store_true", help="skip the --workers 1 prepare run")
    parser.add_argument("--quick", action="store_true", help="2 MB corpus, a 512-token BPE (the test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.corpus_mb, args.vocab_size = 2, 512
    shard_mb = min(64.0, max(0.25, args.corpus_mb / 16))  # >= 16 shards: work for every worker to the end
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        corpus_bytes = write_corpus(work / "corpus", args.corpus_mb)
        tok_path = Path(args.tokenizer) if args.tokenizer else work / "tokenizer.json"
        if not args.tokenizer:
            texts = _first_chars(corpus_texts(work / "corpus"), TRAIN_MB << 20)
            train(texts, vocab_size=args.vocab_size, specials=special_tokens(False, False)).save(str(tok_path))
        tok = load_tokenizer(tok_path)
        raw = {} if args.skip_raw else raw_rate(tok, work / "corpus", args.raw)
        runs = {
            f"prepare, {args.workers} processes": run_prepare(
                work / "corpus", tok_path, work / "p", args.workers, shard_mb
            )
        }
        if not args.skip_single and args.workers != 1:
            runs["prepare, 1 process"] = run_prepare(work / "corpus", tok_path, work / "p1", 1, shard_mb)
    report(raw, runs, corpus_bytes / 2**20, tok.vocab_size, args.workers)
    return 0


def report(raw: dict, runs: dict, corpus_mb: float, vocab_size: int, workers: int) -> dict:
    """Prints the table and the JSON summary line; returns the summary."""
    pipeline = next(iter(runs.values()))
    best = max(raw.values(), key=lambda r: r["tokens_per_s"]) if raw else None
    if best and pipeline["text_tokens"] != best["tokens"]:
        raise SystemExit(f"bench_prepare: prepare wrote {pipeline['text_tokens']} text tokens, raw {best['tokens']}")
    print(f"corpus: {corpus_mb:.0f} MB, {pipeline['documents']:,} documents, {pipeline['text_tokens']:,} tokens;")
    print(f"tokenizer: {vocab_size:,}-token byte-level BPE; cores: {os.cpu_count()}; x raw: tokens/s over the best raw")
    print(
        f"\n{'':<26}{'wall s':>8}{'CPU s':>8}{'MB/s':>7}{'Mtok/s':>8}{'x raw':>7}{'x raw CPU':>10}{'peak RSS MB':>13}"
    )
    for name, r in raw.items():
        row = f"{'raw ' + name:<26}{r['seconds']:>8.1f}{r['cpu_s']:>8.1f}{corpus_mb / r['seconds']:>7.2f}"
        print(f"{row}{r['tokens_per_s'] / 1e6:>8.3f}")
    for name, r in runs.items():
        ratio = f"{r['tokens_per_s'] / best['tokens_per_s']:.2f}" if best else "-"
        cpu_ratio = f"{best['cpu_s'] / r['cpu_s']:.2f}" if best else "-"
        rss = f"{r['peak_rss_tree_mb']:.0f} / {r['peak_rss_sum_mb']:.0f}"
        row = f"{name:<26}{r['seconds']:>8.1f}{r['cpu_s']:>8.1f}{corpus_mb / r['seconds']:>7.2f}"
        print(f"{row}{r['tokens_per_s'] / 1e6:>8.3f}{ratio:>7}{cpu_ratio:>10}{rss:>13}")
    print("peak RSS: the process tree's sampled sum / the sum of each process's own peak (VmHWM), an upper bound")
    single = runs.get("prepare, 1 process")
    summary = {
        "corpus_mb": round(corpus_mb, 1),
        "documents": pipeline["documents"],
        "text_tokens": pipeline["text_tokens"],
        "vocab_size": vocab_size,
        "workers": workers,
        "shards": pipeline["shards"],
        "raw_method": max(raw, key=lambda k: raw[k]["tokens_per_s"]) if raw else None,
        "raw_tokens_per_s": round(best["tokens_per_s"]) if best else None,
        "prepare_tokens_per_s": round(pipeline["tokens_per_s"]),
        "prepare_mb_per_s": round(corpus_mb / pipeline["seconds"], 3),
        "ratio": round(pipeline["tokens_per_s"] / best["tokens_per_s"], 3) if best else None,
        "cpu_ratio": round(best["cpu_s"] / pipeline["cpu_s"], 3) if best else None,
        "single_process_ratio": round(single["tokens_per_s"] / best["tokens_per_s"], 3) if best and single else None,
        "goal": GOAL,
        "meets_goal": pipeline["tokens_per_s"] / best["tokens_per_s"] >= GOAL if best else None,
        "peak_rss_tree_mb": round(pipeline["peak_rss_tree_mb"]),
        "peak_rss_sum_mb": round(pipeline["peak_rss_sum_mb"]),
        "processes": pipeline["processes"],
    }
    print(json.dumps(summary))
    return summary


def _first_chars(texts, limit: int):
    seen = 0
    for text in texts:
        yield text
        seen += len(text)
        if seen >= limit:
            return


if __name__ == "__main__":
    exit_with(main())
