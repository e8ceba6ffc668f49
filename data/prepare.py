"""Turns text files into a token file: `python -m data.prepare --input PATH... --output DIR`.

Each input file is one document, tokenized byte-level (so any bytes work, UTF-8
or not). Directories are walked recursively for files matching --pattern.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import sys
from pathlib import Path

from data.token_file import TokenFile, TokenFileError, write_token_file
from data.tokenizer import BYTE_TOKENIZER_VOCAB_SIZE, encode

PROG = "data.prepare"


class PrepareError(Exception):
    """A user error: reported as one line, exit code 2."""


def find_inputs(paths: list[str], pattern: str) -> list[Path]:
    """Expands files and directories into a deduplicated, deterministic file list."""
    found: dict[Path, None] = {}
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            found[path] = None
        elif path.is_dir():
            matches = sorted(Path(d) / name for d, _, names in os.walk(path) for name in fnmatch.filter(names, pattern))
            if not matches:
                raise PrepareError(f"no files matching {pattern!r} under {path}")
            found.update(dict.fromkeys(matches))
        else:
            raise PrepareError(f"input not found: {path}")
    return list(found)


def prepare(inputs: list[Path], output: Path, *, overwrite: bool = False) -> TokenFile:
    def documents():
        for path in inputs:
            try:
                yield encode(path.read_bytes())
            except OSError as e:
                raise PrepareError(f"cannot read {path}: {e.strerror or e}") from e

    sources = [str(p) for p in inputs[:20]] + ([f"... {len(inputs) - 20} more"] if len(inputs) > 20 else [])
    write_token_file(
        output,
        documents(),
        vocab_size=BYTE_TOKENIZER_VOCAB_SIZE,
        tokenizer="bytes",
        sources=sources,
        overwrite=overwrite,
    )
    return TokenFile.open(output)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH", help="text files or directories")
    parser.add_argument("--output", required=True, metavar="DIR", help="token file directory to write")
    parser.add_argument("--pattern", default="*.txt", help="file glob for directory inputs (default: *.txt)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing token file at --output")
    args = parser.parse_args(argv)
    try:
        token_file = prepare(find_inputs(args.input, args.pattern), Path(args.output), overwrite=args.overwrite)
    except (PrepareError, TokenFileError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {token_file.meta['num_documents']} documents, {token_file.num_tokens} tokens to {token_file.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
