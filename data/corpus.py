"""The default corpus: this Python's own standard library, tokenized byte-level.

It exists on every machine that can run us, needs no download, and is real,
varied code (~10 MB). Test suites are excluded: they are dominated by fixtures
and generated data rather than code people write.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import sysconfig
from pathlib import Path

from data.token_file import TokenFile, TokenFileError, write_token_file
from data.tokenizer import BYTE_TOKENIZER_VOCAB_SIZE, encode

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


def stdlib_sources(stdlib_dir: str | os.PathLike | None = None) -> tuple[Path, list[str]]:
    """Returns the stdlib root and its `*.py` files (relative posix paths, sorted)."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        rel_dir = Path(dirpath).relative_to(root)
        files += [(rel_dir / name).as_posix() for name in filenames if name.endswith(".py")]
    if not files:
        raise FileNotFoundError(f"{root}: no *.py files found for the default corpus")
    return root, sorted(files)


def default_cache_dir() -> Path:
    return Path(os.environ.get("JAXLM_CACHE_DIR") or Path.home() / ".cache" / "jaxlm")


def default_corpus(cache_dir: str | os.PathLike | None = None, tokenizer: str = "byte") -> Path:
    """Returns the path of the stdlib token data, building it on first use.

    `tokenizer`: "byte" (a token file of byte ids), or "bpe<N>": a byte-level BPE of N tokens trained on the
    corpus itself (deterministic), and token shards written with it (`data.prepare`'s pipeline) -- a few
    seconds on 2 cores, once. The name carries the Python version, a hash of (path, size) pairs and the
    tokenizer, so a different interpreter gets its own corpus. Concurrent builders are safe: each writes
    atomically and a loser of the final rename uses the winner's data.
    """
    root, files = stdlib_sources()
    sizes = [(rel, (root / rel).stat().st_size) for rel in files]
    digest = hashlib.sha256("\n".join(f"{rel}\t{size}" for rel, size in sizes).encode()).hexdigest()[:12]
    version = "{}{}.{}.{}".format(sys.implementation.name, *sys.version_info[:3])
    name = f"stdlib-{version}-{digest}" + ("" if tokenizer == "byte" else f"-{tokenizer}")
    path = Path(cache_dir or default_cache_dir()) / name
    if tokenizer != "byte":
        return _bpe_corpus(path, root, files, bpe_vocab_size(tokenizer))
    try:
        TokenFile.open(path)
        return path
    except TokenFileError:
        broken = path.exists()  # a damaged cache entry is replaced; a missing one is created

    print(f"data: building default corpus from {len(files)} files in {root} -> {path}", file=sys.stderr)
    documents = (encode((root / rel).read_bytes()) for rel in files)
    sources = [f"python {version} standard library at {root}", f"{len(files)} *.py files, tests excluded"]
    try:
        write_token_file(
            path, documents, vocab_size=BYTE_TOKENIZER_VOCAB_SIZE, tokenizer="bytes", sources=sources, overwrite=broken
        )
    except TokenFileError:
        TokenFile.open(path)  # another process won the race: fine if its file is valid
    return path


def bpe_vocab_size(tokenizer: str) -> int:
    """N of a default-corpus tokenizer name "bpe<N>"; ValueError naming the choices otherwise."""
    match = re.fullmatch(r"bpe(\d+)", tokenizer)
    if not match or not 512 <= int(match[1]) <= 65536:
        raise ValueError(f"corpus tokenizer {tokenizer!r}: use 'byte' or 'bpe<N>' with N in [512, 65536], e.g. bpe4096")
    return int(match[1])


def _bpe_corpus(path: Path, root: Path, files: list[str], vocab_size: int) -> Path:
    from data.prepare import Job, prepare
    from data.text_sources import ReadOptions
    from data.text_tokenizer import load_tokenizer
    from data.token_shards import TokenShards
    from data.train_tokenizer import special_tokens, train

    try:
        TokenShards.open(path)
        return path
    except (TokenFileError, ValueError, OSError):
        pass
    print(f"data: building the default corpus with a {vocab_size}-token BPE trained on it -> {path}", file=sys.stderr)
    work = path.with_name(f".{path.name}.{os.getpid()}")  # this builder's own: concurrent builders do not mix
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        texts = ((root / rel).read_text(errors="replace") for rel in files)
        train(texts, vocab_size=vocab_size, specials=special_tokens(bos=False, pad=False)).save(str(work / "bpe.json"))
        job = Job(
            [root / rel for rel in files],
            load_tokenizer(work / "bpe.json"),
            ReadOptions(utf8_errors="replace"),
            16 << 20,
        )
        prepare(job, work / "tokens", workers=os.cpu_count() or 1)
        if path.exists():  # damaged (it did not open): replaced
            shutil.rmtree(path)
        try:
            os.rename(work / "tokens", path)
        except OSError:
            TokenShards.open(path)  # another process won the race: fine if its data is valid
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path
