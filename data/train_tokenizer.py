"""Trains a byte-level BPE tokenizer on your text: `python -m data.train_tokenizer --input DIR --pattern GLOB
--vocab-size N --output PATH/tokenizer.json`.

Reads the formats `data.prepare` reads (`data.text_sources`), in the same order, and trains the `tokenizers`
library's BpeTrainer over a ByteLevel pre-tokenizer (GPT-2's scheme: any bytes encode, nothing is unknown). The
special tokens are `<|endoftext|>` (EOS, always), then `<|startoftext|>` (`--bos`) and `<|pad|>` (`--pad`).
The same input and flags give the same tokenizer.json, byte for byte.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from data.atomic_dir import no_space, remove_abandoned, rust_os_error, scratch_path
from data.command_signals import run_stoppable
from data.fault_points import pause_point
from data.ownership import OwnershipError, check_target
from data.text_sources import Counts, ReadOptions, TextSourceError, documents, find_inputs, plan_pieces
from data.text_tokenizer import TOKENIZER_JSON, TokenizerError, load_tokenizer

PROG = "data.train_tokenizer"
EOS, BOS, PAD = "<|endoftext|>", "<|startoftext|>", "<|pad|>"
BYTES = 256  # a byte-level vocabulary starts with every byte


class TrainError(Exception):
    """A user error: one line, exit code 2."""


def special_tokens(bos: bool, pad: bool) -> list[str]:
    return [EOS] + [BOS] * bos + [PAD] * pad


def train(texts, *, vocab_size: int, specials: list[str], min_frequency: int = 2):
    """A byte-level BPE `tokenizers.Tokenizer` trained on the iterable `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def read_texts(files: list[Path], options: ReadOptions, *, max_bytes: int | None, seen: list[int], bar=None):
    """The non-empty documents of `files` in order, up to about `max_bytes` of text; counts characters in `seen`."""
    counts = Counts()
    for path in files:
        for piece in plan_pieces(path, options, 1 << 62):
            for text in documents(piece, options, counts):
                if text:
                    yield text
                    pause_point("train_tokenizer.read")
                    seen[0] += len(text)
                    if bar is not None:
                        bar.update(len(text))
                    if max_bytes is not None and seen[0] >= max_bytes:
                        return


def output_path(raw: str) -> Path:
    path = Path(raw)
    return path if path.suffix == ".json" else path / TOKENIZER_JSON


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 written, 2 bad input, 4 the disk filled, 130 / 143 stopped by SIGINT / SIGTERM (nothing is
    written; a rerun starts again)."""
    # BPE training in Rust never returns to Python's handler: a short grace period
    return run_stoppable(
        PROG, lambda _: _main(argv), after=": nothing was written; rerun the same command", grace_s=2.0
    )


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage + error
        raise TrainError(message)


def _main(argv: list[str] | None) -> int:
    parser = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files or directories")
    parser.add_argument("--pattern", action="append", metavar="GLOB", help="file glob, repeatable (default *.txt)")
    parser.add_argument("--output", required=True, metavar="PATH", help="tokenizer.json to write (or its directory)")
    parser.add_argument("--vocab-size", type=int, required=True, help="tokens in the vocabulary, specials included")
    parser.add_argument("--bos", action="store_true", help=f"add a BOS token {BOS}")
    parser.add_argument("--pad", action="store_true", help=f"add a padding token {PAD}")
    parser.add_argument("--min-frequency", type=int, default=2, help="a merge's least pair count (default 2)")
    parser.add_argument("--max-mb", type=float, help="train on the first this many MB of text only")
    parser.add_argument("--text-field", default="text", help="jsonl / json / parquet field of the text (text)")
    parser.add_argument("--separator", help="split .txt files into documents at this string")
    parser.add_argument("--utf8-errors", choices=("strict", "replace"), default="strict", help="undecodable bytes")
    parser.add_argument("--skip-bad", action="store_true", help="skip jsonl/json records that are bad")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing tokenizer.json")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    try:
        args = parser.parse_args(argv)
        out = output_path(args.output)
        check_target(out, "a tokenizer", "--output")  # never a dataset's, an export's or a run's tokenizer.json
        specials = special_tokens(args.bos, args.pad)
        if args.vocab_size < BYTES + len(specials) + 1:
            raise TrainError(f"--vocab-size {args.vocab_size} leaves no merge: need > {BYTES} bytes + {specials}")
        if args.min_frequency < 0:  # the Rust trainer's OverflowError otherwise
            raise TrainError(f"--min-frequency must be >= 0 (a merge's least pair count), got {args.min_frequency}")
        if args.max_mb is not None and not 0 < args.max_mb < math.inf:  # <= 0 read one document, inf raised
            raise TrainError(
                f"--max-mb must be a finite number > 0 (MB of text to train on; leave it out for all), "
                f"got {args.max_mb}"
            )
        if out.exists() and not args.overwrite:
            raise TrainError(f"{out} already exists (pass --overwrite to replace it)")
        options = ReadOptions(args.text_field, args.separator, args.utf8_errors, args.skip_bad)
        files = find_inputs(args.input, args.pattern or ["*.txt"])
        max_bytes = None if args.max_mb is None else int(args.max_mb * 2**20)
        tok, chars = _train_with_progress(files, options, args, specials, max_bytes)
        if not chars:
            raise TrainError(f"no text: the {len(files)} input files hold no non-empty document")
        _save(tok, out)
    except (TrainError, TextSourceError, TokenizerError, OwnershipError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        full = no_space(e, out.parent, name=out)
        if full is None:
            raise
        print(f"{PROG}: error: {full}; free space and rerun (nothing was written)", file=sys.stderr)
        return 4
    print(f"trained a {tok.get_vocab_size()}-token byte-level BPE on {chars:,} characters -> {out}")
    return 0


def _save(tok, out: Path) -> None:
    """Writes `out` whole or not at all, after checking it loads as prepare will load it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(out, "tmp")
    tmp = scratch_path(out, "tmp")
    try:
        try:
            tok.save(str(tmp))
        except Exception as e:  # tokenizers' own error for I/O: an OSError again, so a full disk reads as one
            os_error = rust_os_error(e, tmp)
            if os_error is None:
                raise
            raise os_error from None
        load_tokenizer(tmp)  # it must load and have its EOS
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _train_with_progress(files, options, args, specials, max_bytes):
    from tqdm import tqdm

    total = sum(f.stat().st_size for f in files)
    total = min(total, max_bytes) if max_bytes else total
    show = not args.no_progress and sys.stderr.isatty()
    with tqdm(total=total, unit="B", unit_scale=True, desc="reading", disable=not show) as bar:
        seen = [0]
        texts = read_texts(files, options, max_bytes=max_bytes, seen=seen, bar=bar)
        tok = train(texts, vocab_size=args.vocab_size, specials=specials, min_frequency=args.min_frequency)
        return tok, seen[0]


if __name__ == "__main__":
    sys.exit(main())
