"""Text + a tokenizer -> token shards: `python -m data.prepare --input PATH... --output DIR [--tokenizer PATH]`.

Inputs are `.txt` (a file is a document, or `--separator` splits it), `.jsonl`, `.jsonl.gz`, `.json` arrays and
`.parquet` (the `--text-field` column), mixed freely; directories are walked for files matching any `--pattern`.
Documents are tokenized in parallel worker processes, one shard per work unit, and joined by the tokenizer's EOS
(BOS first with `--add-bos`); empty documents are skipped and counted. The shards are built in `.DIR.partial`
beside the output and moved into place whole with the manifest and a copy of the tokenizer, so readers never see
half a dataset; a killed run, rerun with the same command, keeps the shards it completed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import queue
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np

from data.atomic_dir import no_space
from data.command_signals import run_stoppable
from data.ownership import DATASET, OwnershipError, check_target
from data.shard_worker import Unit, completed_stats, init_worker, tokenize_unit
from data.text_sources import ReadOptions, TextSourceError, find_inputs, plan_pieces
from data.text_tokenizer import TextTokenizer, TokenizerError, load_tokenizer
from data.token_file import TokenFileError, dtype_for_vocab
from data.token_shards import FORMAT, KIND, MANIFEST_NAME, SHARD_PATTERN, VERSION, TokenShards

PROG = "data.prepare"
JOB_NAME = "job.json"
_PARTIAL_FILES = rf"{JOB_NAME}|{SHARD_PATTERN}|tokens-\d{{5}}\.(bin|json)\.tmp|tokens-\d{{5}}\.json"
_LISTED_SOURCES = 20  # the manifest names this many input files, then counts the rest


class PrepareError(Exception):
    """A user error: reported as one line, exit code 2."""

    code = 2


class NoSpaceError(PrepareError):
    """The disk (or a quota, or a file-size limit) filled while shards were written: one line, exit code 4."""

    code = 4


@dataclasses.dataclass(frozen=True)
class Job:
    """Everything the shards depend on; its hash tells a resumable partial build from another run's."""

    files: list[Path]
    tokenizer: TextTokenizer
    options: ReadOptions
    shard_bytes: int

    def identity(self) -> dict:
        inputs = [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in self.files]
        return {
            "format": [FORMAT, VERSION],
            "tokenizer": self.tokenizer.describe(),
            "options": dataclasses.asdict(self.options),
            "shard_bytes": self.shard_bytes,
            "inputs": inputs,
        }

    def units(self) -> list[Unit]:
        """Consecutive pieces grouped into units of about `shard_bytes` of input: one shard each."""
        units, group, size = [], [], 0
        for f in self.files:
            for piece in plan_pieces(f, self.options, self.shard_bytes):
                group.append(piece)
                size += piece.size
                if size >= self.shard_bytes:
                    units.append(Unit(len(units), tuple(group)))
                    group, size = [], 0
        if group:
            units.append(Unit(len(units), tuple(group)))
        return units


def partial_dir(output: Path) -> Path:
    return output.parent / f".{output.name}.partial"


def prepare(job: Job, output: Path, *, workers: int = 1, overwrite: bool = False, progress: bool = False):
    """Writes the token shards of `job` at `output`, resuming a killed run of the same job; returns TokenShards."""
    KIND.check_writable(output, overwrite)
    units = job.units()
    dtype = dtype_for_vocab(job.tokenizer.vocab_size)
    build = _resumable_build_dir(output, job)
    done = {u.index: s for u in units if (s := completed_stats(build, u.index, dtype)) is not None}
    pending = [u for u in units if u.index not in done]
    if done:
        print(f"{PROG}: resuming: {len(done)} of {len(units)} shards already done in {build}", file=sys.stderr)
    try:
        sizes = (sum(u.size for u in units), sum(u.size for u in units if u.index in done))
        done |= _run_units(job, pending, build, dtype, workers, progress, sizes)
    except (TextSourceError, TokenizerError):
        shutil.rmtree(build, ignore_errors=True)  # bad input: the fixed input is another job anyway
        raise
    except OSError as e:
        # At most a token per input byte (byte-level; BPE writes fewer), plus the finished shards' copy on publish.
        full = no_space(e, build, sum(u.size for u in pending) * np.dtype(dtype).itemsize)
        if full is None:
            raise
        kept = sum(completed_stats(build, u.index, dtype) is not None for u in units)
        raise NoSpaceError(
            f"{full}; free space and rerun the same command: the {kept} finished shards in {build} are kept and "
            f"nothing was written to {output}"
        ) from None
    stats = [done[u.index] for u in units]
    if not sum(s["num_tokens"] for s in stats):
        shutil.rmtree(build, ignore_errors=True)
        empty = sum(s["skipped_empty"] for s in stats)
        raise PrepareError(f"no text: the {len(job.files)} input files hold no non-empty document ({empty} empty)")
    _finish(job, build, stats, dtype)
    KIND.publish(build, output, overwrite)
    return TokenShards.open(output)


def _resumable_build_dir(output: Path, job: Job) -> Path:
    """`.NAME.partial` beside the output, holding this job's shards so far; another job's are discarded."""
    build, identity = partial_dir(output), job.identity()
    job_hash = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    if build.exists():
        try:
            same = json.loads((build / JOB_NAME).read_text()).get("job_hash") == job_hash
        except (OSError, ValueError):
            same = False
        if not same:
            foreign = [p.name for p in build.iterdir() if not re.fullmatch(_PARTIAL_FILES, p.name)]
            if foreign:
                raise PrepareError(f"{build}: holds files prepare did not write ({', '.join(foreign[:5])}); move them")
            print(f"{PROG}: discarding unfinished shards of another input or options in {build}", file=sys.stderr)
            shutil.rmtree(build)
    build.mkdir(parents=True, exist_ok=True)
    for leftover in build.glob("*.tmp"):  # a shard being written when the last run was killed
        leftover.unlink()
    (build / JOB_NAME).write_text(json.dumps({"job_hash": job_hash, **identity}) + "\n")
    return build


def _run_units(job: Job, units: list[Unit], build: Path, dtype: str, workers: int, show: bool, sizes) -> dict:
    """Tokenizes `units` (in worker processes when workers > 1); returns {index: stats}. The bar counts input bytes
    (`sizes`: all, already done) and shows tokens/s."""
    from tqdm import tqdm

    bar = tqdm(total=sizes[0], initial=sizes[1], unit="B", unit_scale=True, desc="tokenizing", disable=not show)
    tokens = [0, time.monotonic()]

    def advance(item):
        chars, n = item
        bar.update(chars)
        tokens[0] += n
        bar.set_postfix_str(f"{tokens[0] / max(time.monotonic() - tokens[1], 1e-9) / 1e6:.2f}M tok/s", refresh=False)

    try:
        if workers <= 1 or len(units) <= 1:
            init_worker(job.tokenizer, job.options, dtype, advance)
            return {u.index: tokenize_unit(u, str(build)) for u in units}
        return _run_pool(job, units, build, dtype, min(workers, len(units)), advance)
    finally:
        bar.close()


def _run_pool(job: Job, units: list[Unit], build: Path, dtype: str, workers: int, advance) -> dict:
    """W processes, each tokenizing whole units single-threaded (reading, parsing and writing run in parallel too).

    Measured on the 2-core VM, shared with other jobs (experiments.bench_prepare, 8,192-token BPE, tokens/s over
    raw encode_batch_fast on the same text): 1 GB, 2 processes 1.06x (CPU time 1.06x); 64 MB, 2 processes 0.86x
    and one process on encode_batch's threads 0.96x. A worker's start (imports, tokenizer) is ~1 s, a visible share
    of a small corpus only; processes are what parallelise the Python side, and a corpus under one --shard-mb is
    one work unit, tokenized in this process anyway. All submitted units are small descriptors and results are a
    shard's statistics, so memory stays each worker's one batch, whatever the corpus size."""
    ctx = multiprocessing.get_context("spawn")  # a fork after the tokenizer's threads started could deadlock
    sink = ctx.Queue()
    results = {}
    with _ignoring_ctrl_c():  # inherited through exec: a Ctrl-C while a worker still starts is not its traceback
        pool = ctx.Pool(workers, initializer=init_worker, initargs=(job.tokenizer, job.options, dtype, sink))
    with pool:
        pending = {u.index: pool.apply_async(tokenize_unit, (u, str(build))) for u in units}
        while pending:
            try:
                while True:
                    advance(sink.get(timeout=0.1))
            except queue.Empty:
                pass
            for index, result in list(pending.items()):
                if result.ready():
                    results[index] = result.get()  # re-raises a worker's error here
                    del pending[index]
    return results


@contextlib.contextmanager
def _ignoring_ctrl_c():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _finish(job: Job, build: Path, stats: list[dict], dtype: str) -> None:
    """Writes the tokenizer copy and the manifest (last), and drops the build's bookkeeping files."""
    tok = job.tokenizer
    shards = [{k: s[k] for k in ("name", "num_tokens", "sha256", "num_documents")} for s in stats if s["num_tokens"]]
    for s in stats:
        (build / s["name"]).with_suffix(".json").unlink()
        if not s["num_tokens"]:
            (build / s["name"]).unlink()
    (build / JOB_NAME).unlink()
    tok.save(build)
    files = [str(f) for f in job.files]
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "bos_id": tok.bos_id,
        "add_bos": tok.add_bos,
        "tokenizer": tok.describe(),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "num_documents": sum(s["num_documents"] for s in stats),
        "skipped_empty": sum(s["skipped_empty"] for s in stats),
        "skipped_bad": sum(s["bad_records"] for s in stats),
        "replaced_utf8_documents": sum(s["replaced_documents"] for s in stats),
        "max_token_id": max(max(s["max_token_id"] for s in stats), tok.eos_id),
        "options": dataclasses.asdict(job.options),
        "num_sources": len(files),
        "sources": files[:_LISTED_SOURCES] + ([f"... {len(files) - _LISTED_SOURCES} more"] if len(files) > 20 else []),
        "shards": shards,
    }
    (build / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage + error
        raise PrepareError(message)


def parse_args(argv):
    parser = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files or directories")
    parser.add_argument("--output", required=True, metavar="DIR", help="token data directory to write")
    parser.add_argument(
        "--pattern", action="append", metavar="GLOB", help="file glob for directory inputs, repeatable (default *.txt)"
    )
    parser.add_argument("--tokenizer", default="byte", help="'byte' (default), a tokenizer.json or its directory")
    parser.add_argument("--eos-token", help="the token ending a document (default: found among the special tokens)")
    parser.add_argument("--bos-token", help="the token beginning a document (with --add-bos)")
    parser.add_argument("--add-bos", action="store_true", help="write BOS before each document")
    parser.add_argument("--text-field", default="text", help="jsonl / json / parquet field of the text (text)")
    parser.add_argument("--separator", help="split .txt files into documents at this string (bash: $'\\n\\n')")
    parser.add_argument("--utf8-errors", choices=("strict", "replace"), default="strict", help="undecodable bytes")
    parser.add_argument("--skip-bad", action="store_true", help="count and skip jsonl/json records that are bad")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: all cores)")
    parser.add_argument("--shard-mb", type=float, default=64, help="input MB per shard (default 64)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing token data at --output")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 written, 2 bad input, 4 the disk filled, 130 / 143 stopped by SIGINT / SIGTERM (the finished
    shards are kept for the rerun)."""
    after = ": nothing was written to the output; rerun the same command to continue from the finished shards"
    return run_stoppable(PROG, lambda _: _main(argv), after=after)


def _main(argv: list[str] | None) -> int:
    try:
        args = parse_args(argv)
        if args.workers < 1:
            raise PrepareError(f"--workers must be >= 1, got {args.workers}")
        if not 0 < args.shard_mb < math.inf:  # inf: int(inf) raised OverflowError
            raise PrepareError(f"--shard-mb must be a finite number > 0 (input MB per shard), got {args.shard_mb}")
        tok = load_tokenizer(args.tokenizer, eos_token=args.eos_token, bos_token=args.bos_token, add_bos=args.add_bos)
        options = ReadOptions(args.text_field, args.separator, args.utf8_errors, args.skip_bad)
        files = find_inputs(args.input, args.pattern or ["*.txt"])
        output = Path(args.output)
        check_target(output, DATASET, "--output")
        job = Job(files, tok, options, int(args.shard_mb * 2**20))
        show = not args.no_progress and sys.stderr.isatty()
        data = prepare(job, output, workers=args.workers, overwrite=args.overwrite, progress=show)
    except (PrepareError, TextSourceError, TokenizerError, TokenFileError, OwnershipError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return getattr(e, "code", 2)
    m = data.meta
    print(
        f"wrote {m['num_documents']} documents, {m['num_tokens']} tokens in {len(m['shards'])} shards to {data.path}"
        f" (skipped {m['skipped_empty']} empty, {m['skipped_bad']} bad)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
