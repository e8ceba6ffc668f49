"""The default corpus: this Python's own standard library, tokenized byte-level.

It exists on every machine that can run us, needs no download, and is real,
varied code (~10 MB). Test suites are excluded: they are dominated by fixtures
and generated data rather than code people write.
"""

from __future__ import annotations

import hashlib
import os
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


def default_corpus(cache_dir: str | os.PathLike | None = None) -> Path:
    """Returns the path of the stdlib token file, building it on first use.

    The name carries the Python version and a hash of (path, size) pairs, so a
    different interpreter gets its own corpus. Concurrent builders are safe: each
    writes atomically and a loser of the final rename uses the winner's file.
    """
    root, files = stdlib_sources()
    sizes = [(rel, (root / rel).stat().st_size) for rel in files]
    digest = hashlib.sha256("\n".join(f"{rel}\t{size}" for rel, size in sizes).encode()).hexdigest()[:12]
    version = "{}{}.{}.{}".format(sys.implementation.name, *sys.version_info[:3])
    path = Path(cache_dir or default_cache_dir()) / f"stdlib-{version}-{digest}"
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
