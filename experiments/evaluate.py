"""Score held-out text with a trained model: loss, perplexity and bits per byte.

    python -m experiments.evaluate --workdir runs/tiny_lm --text held_out.txt
    python -m experiments.evaluate --workdir runs/tiny_lm --text docs/ --pattern '*.md' --max-tokens 100000
    python -m experiments.evaluate --workdir runs/imported --data TOKENS   # token data written with its tokenizer

--workdir is a training run's workdir (its latest checkpoint, or --step N), an import_hf workdir or a
quantize_checkpoint output. --text reads txt / jsonl / parquet files (directories: files matching --pattern) with
the model's own tokenizer, each file or record one document as data.prepare reads them; --data reads token data
that data.prepare wrote with that tokenizer. Every token is scored once, in windows of --seq-len (default: the
run's training length). Prints one line, then the figures as one JSON object. Bad input exits 2 with one line
naming it, before anything compiles.
"""

from __future__ import annotations

import json
import sys
import time

from experiments.cli import exit_with, load_trained_model, trained_model_parser

PROG = "experiments.evaluate"
EXIT_BAD_INPUT = 2


def parse_args(argv):
    p = trained_model_parser(PROG, __doc__.split("\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", nargs="+", metavar="PATH", help="text files or directories (txt, jsonl, parquet)")
    source.add_argument("--data", metavar="DIR", help="token data written with the model's tokenizer (data.prepare)")
    p.add_argument("--pattern", action="append", metavar="GLOB", help="file glob under --text directories (*.txt)")
    p.add_argument("--text-field", default="text", help="jsonl / json / parquet field of the text (text)")
    p.add_argument("--separator", help="split .txt files into documents at this string (bash: $'\\n\\n')")
    p.add_argument("--max-tokens", type=int, default=0, help="score only the first N tokens (0: all)")
    p.add_argument("--seq-len", type=int, default=0, help="tokens per window (default: the run's data.seq_len)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per compiled batch (default 8)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def check_args(args) -> None:
    """ValueError naming the first bad flag (all before JAX starts)."""
    for flag in ("workdir", "data", "mesh"):
        value = getattr(args, flag)
        if value is not None and not value.strip():
            raise ValueError(f"--{flag} is empty; give a path (or leave the flag out)")
    for flag, least in (("max_tokens", 0), ("seq_len", 0), ("batch_size", 1), ("cpu_devices", 0)):
        if getattr(args, flag) < least:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= {least}, got {getattr(args, flag)}")
    if args.max_tokens == 1:
        raise ValueError("--max-tokens 1 leaves nothing to score: the first token is context only; give >= 2")
    if args.data:
        import shlex

        from data.setup import text_globs

        globs = text_globs(args.data)
        if globs:  # not token data but the text itself, which --text reads
            patterns = [] if globs == ["*.txt"] else [a for g in globs for a in ("--pattern", g)]
            raise ValueError(
                f"--data {args.data} holds text files ({', '.join(globs)}), not token data; score them with "
                f"{shlex.join(['--text', args.data, *patterns])}"
            )


def text_tokens(args, tokenizer):
    """The --text files' documents as one token stream (data.text_sources reads them as data.prepare does)."""
    from data.text_sources import Counts, ReadOptions, documents, find_inputs, plan_pieces
    from jaxlm.evaluate import text_stream

    options = ReadOptions(args.text_field, args.separator)
    files = find_inputs(args.text, args.pattern or ["*.txt"])
    texts = (
        text
        for path in files
        for piece in plan_pieces(path, options, 1 << 62)
        for text in documents(piece, options, Counts())
        if text
    )
    return text_stream(tokenizer, texts, limit=args.max_tokens), len(files)


def data_tokens(args, tokenizer):
    """--data's tokens, refused unless they were written with the model's tokenizer."""
    from data.text_tokenizer import check_data_tokenizer
    from data.token_shards import open_tokens

    prepare = f"python -m data.prepare --tokenizer {args.workdir}/tokenizer.json --input TEXT --output DIR"
    check_data_tokenizer(args.data, tokenizer, fix=f"write it with the model's: {prepare}")
    tokens = open_tokens(args.data).tokens
    return (tokens[: args.max_tokens] if args.max_tokens else tokens), 1


def main(argv: list[str] | None = None) -> int:
    """SIGTERM / Ctrl-C: one line and exit 143 / 130, also while XLA compiles (nothing is written; a second
    Ctrl-C exits at once)."""
    from data.command_signals import run_stoppable

    return run_stoppable(PROG, lambda _: _main(argv), grace_s=2.0)


def _main(argv: list[str] | None) -> int:
    try:
        args = parse_args(argv)
        check_args(args)
    except ValueError as e:
        return _fail(str(e))
    from tqdm import tqdm

    from data.text_sources import TextSourceError
    from data.text_tokenizer import TokenizerError
    from data.token_file import TokenFileError

    try:
        loaded = load_trained_model(args)  # first: --cpu-devices must be set before anything starts JAX's backends
        from jaxlm.evaluate import score

        tok, cfg = loaded.tokenizer, loaded.cfg
        seq_len = args.seq_len or cfg.data.seq_len  # validated: at most the model's max_seq_len
        if seq_len > cfg.model.max_seq_len:
            raise ValueError(f"--seq-len {seq_len} is longer than the model's max_seq_len {cfg.model.max_seq_len}")
        stream, files = data_tokens(args, tok) if args.data else text_tokens(args, tok)
        if len(stream) < 2:
            raise ValueError(f"{'--data' if args.data else '--text'} holds no text to score")
        show = not args.no_progress and sys.stderr.isatty()
        t0 = time.perf_counter()
        with tqdm(unit="batch", file=sys.stderr, leave=False, disable=not show) as bar:

            def advance(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)

            result = score(
                loaded.model,
                stream,
                tok.token_bytes,
                seq_len=seq_len,
                batch_size=args.batch_size,
                pad_id=tok.eos_id,
                rules=loaded.rules,
                progress=advance,
            )
        seconds = time.perf_counter() - t0
    except (ValueError, OSError, TextSourceError, TokenizerError, TokenFileError) as e:
        return _fail(str(e))
    kind = "int8 weight-only" if loaded.int8 else "checkpoint"
    bpb = result.bits_per_byte
    print(
        f"{PROG}: {kind} step {loaded.step} of {args.workdir} on {result.tokens:,} tokens ({result.bytes:,} bytes) "
        f"in windows of {seq_len}: loss {result.loss:.4f}, perplexity {result.perplexity:.3f}, bits per byte "
        f"{'n/a' if bpb is None else f'{bpb:.4f}'} ({seconds:.1f} s, compiling included)"
    )
    source = {"data": args.data} if args.data else {"text": args.text, "files": files}
    record = {"workdir": args.workdir, "step": loaded.step, **source, "seq_len": seq_len, **result.record()}
    print(json.dumps(record))
    return 0


def _fail(message: str) -> int:
    print(f"{PROG}: error: {' '.join(message.splitlines())}", file=sys.stderr)
    return EXIT_BAD_INPUT


if __name__ == "__main__":
    exit_with(main())
