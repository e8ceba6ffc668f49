"""experiments.bench_prepare --quick: a table, then its JSON summary as the last line (figures not timed here)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from experiments.bench_prepare import process_tree, write_corpus

REPO = Path(__file__).resolve().parents[1]


def test_quick_run_prints_table_and_json_last(tmp_path):
    cmd = [sys.executable, "-m", "experiments.bench_prepare", "--quick", "--workers", "2", "--workdir", str(tmp_path)]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    table = "\n".join(lines[:-1])
    for row in ("raw encode_batch ", "raw encode_batch_fast", "prepare, 2 processes", "prepare, 1 process"):
        assert row in table
    assert summary["corpus_mb"] >= 2 and summary["documents"] > 50 and summary["vocab_size"] == 512
    assert summary["text_tokens"] > summary["corpus_mb"] * 2**20 / 8  # a 512-token BPE: a few bytes per token
    assert summary["raw_method"] in ("encode_batch", "encode_batch_fast") and summary["workers"] == 2
    assert summary["raw_tokens_per_s"] > 0 and summary["prepare_tokens_per_s"] > 0 and summary["shards"] >= 8
    ratio = summary["prepare_tokens_per_s"] / summary["raw_tokens_per_s"]
    assert abs(summary["ratio"] - ratio) < 1e-3 and summary["meets_goal"] == (ratio >= 0.8)
    assert summary["single_process_ratio"] > 0 and summary["cpu_ratio"] > 0
    assert 0 < summary["peak_rss_tree_mb"] <= summary["peak_rss_sum_mb"] + 1 < 2048
    assert summary["processes"] >= 3  # prepare and its two workers
    assert list(tmp_path.iterdir()) == []  # the corpus and token data are removed


def test_corpus_size_and_formats(tmp_path):
    written = write_corpus(tmp_path, 1)
    suffixes = [p.suffix for p in sorted(tmp_path.iterdir())]
    assert 2**20 <= written < 2**21  # stops after the document that reaches the size
    assert suffixes == [".parquet" if i % 4 == 3 else ".jsonl" for i in range(len(suffixes))] and len(suffixes) > 4


def test_process_tree_sees_children():
    proc = subprocess.Popen([sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '30'])"])
    tree = {}
    try:
        for _ in range(100):
            tree = process_tree(proc.pid)
            if len(tree) == 2:
                break
            subprocess.run(["sleep", "0.05"])
        assert len(tree) == 2 and all(t["VmHWM"] >= t["VmRSS"] > 0 for t in tree.values())
    finally:
        for pid in set(tree) - {proc.pid}:  # the sleep this test started
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
