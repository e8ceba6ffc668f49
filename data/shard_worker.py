"""One work unit's documents -> one token shard: what each `data.prepare` worker process runs.

A worker loads the tokenizer once (`init_worker`), then tokenizes whole units: it reads the unit's pieces
(`data.text_sources`), encodes ~1 MB batches of documents, writes [BOS] ids EOS per document into the shard and
reports progress. A unit's shard depends only on the unit, so shards are byte-identical whatever the worker count
and however often a run was killed and resumed. The unit's statistics are written beside the shard last
(`tokens-NNNNN.json`): a shard with them is complete.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np

from data.atomic_file import write_atomic
from data.fault_points import pause_point
from data.text_sources import Counts, Piece, ReadOptions, documents
from data.token_shards import ShardWriter, file_sha256, shard_name

BATCH_CHARS = 1 << 20  # characters per encode_batch call: large enough that per-call overhead vanishes


@dataclasses.dataclass(frozen=True)
class Unit:
    """The pieces whose documents make shard `index`, in order."""

    index: int
    pieces: tuple[Piece, ...]

    @property
    def size(self) -> int:
        return sum(p.size for p in self.pieces)


_state: dict = {}  # this process's tokenizer, options, dtype and progress sink (set by init_worker)


def init_worker(tokenizer, options: ReadOptions, dtype: str, progress=None) -> None:
    """Per process: one tokenizer; `progress` a queue (or callable) of (characters, tokens) increments.

    Worker processes encode single-threaded (TOKENIZERS_PARALLELISM=false): parallelism comes from the processes,
    which also parallelise reading and parsing, and W processes x 2 Rust threads would oversubscribe the cores."""
    if progress is not None and not callable(progress):  # a worker process
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        progress = progress.put
        _follow_parent()
    _state.update(tokenizer=tokenizer, options=options, dtype=dtype, progress=progress or (lambda item: None))


def _follow_parent() -> None:
    """A worker leaves the signals to its parent, which stops the pool (a Ctrl-C reaches the whole process group:
    a traceback per worker otherwise), and ends when the parent is gone (killed with SIGKILL, say) instead of
    writing on into a build nobody will finish."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="follow-parent", daemon=True).start()


def stats_path(directory: Path, index: int) -> Path:
    return Path(directory) / shard_name(index).replace(".bin", ".json")


def completed_stats(directory: Path, index: int, dtype: str) -> dict | None:
    """The statistics of shard `index` if a previous run completed it (its bytes re-hashed), else None."""
    try:
        stats = json.loads(stats_path(directory, index).read_text())
        shard = Path(directory) / stats["name"]
        itemsize = np.dtype(dtype).itemsize
        if shard.stat().st_size == stats["num_tokens"] * itemsize and file_sha256(shard) == stats["sha256"]:
            return stats
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def tokenize_unit(unit: Unit, directory: str) -> dict:
    """Writes shard `unit.index` into `directory`; returns (and records beside it) the shard's statistics."""
    tok, options, progress = _state["tokenizer"], _state["options"], _state["progress"]
    writer = ShardWriter(Path(directory) / shard_name(unit.index), _state["dtype"])
    counts, totals = Counts(), {"num_documents": 0, "skipped_empty": 0}
    try:
        if unit.index == 1:
            pause_point("prepare.shard")  # shard 0 done or under way, shard 1 begun
        for piece in unit.pieces:
            reported = 0  # characters reported for this piece, capped at its size in bytes
            batch, chars = [], 0
            for text in documents(piece, options, counts):
                if not text:
                    totals["skipped_empty"] += 1
                    continue
                batch.append(text)
                chars += len(text)
                if chars >= BATCH_CHARS:
                    tokens = _write_batch(tok, batch, writer)
                    totals["num_documents"] += len(batch)
                    step = min(chars, piece.size - reported)
                    progress((step, tokens))
                    reported, batch, chars = reported + step, [], 0
            tokens = _write_batch(tok, batch, writer) if batch else 0
            totals["num_documents"] += len(batch)
            progress((piece.size - reported, tokens))
        stats = writer.finish()
    except BaseException:
        writer.abandon()
        raise
    stats |= totals | {
        "max_token_id": writer.max_id,
        "bad_records": counts.bad_records,
        "replaced_documents": counts.replaced_documents,
    }
    write_atomic(stats_path(directory, unit.index), json.dumps(stats) + "\n")
    return stats


def _write_batch(tok, texts: list[str], writer: ShardWriter) -> int:
    """Encodes `texts` and writes each as [BOS] ids EOS; returns the tokens written."""
    ids = tok.encode_batch(texts)
    eos = np.array([tok.eos_id], np.int64)
    parts = []
    for doc in ids:
        if tok.add_bos:
            parts.append(np.array([tok.bos_id], np.int64))
        parts += (doc, eos)
    out = np.concatenate(parts)
    writer.write(out)
    return out.size
