"""Memory-mapped token files: a directory with `tokens.bin` and `meta.json`.

`tokens.bin` is one flat little-endian array of ids (documents concatenated, each
followed by EOS), so training reads any window straight from the page cache with
no parsing. `meta.json` says how to read it and lets `open` catch truncated or
mismatched files with a one-line error instead of a garbage batch hours later.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from data.atomic_dir import DirKind
from data.tokenizer import EOS_ID

FORMAT = "jaxlm-tokens"
VERSION = 1
TOKENS_NAME = "tokens.bin"
META_NAME = "meta.json"
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


class TokenFileError(ValueError):
    """A token file is missing, malformed, or does not fit the model."""


_KIND = DirKind(
    "token file",
    META_NAME,
    FORMAT,
    TokenFileError,
    "pass overwrite=True / --overwrite to replace it",
    files=f"{TOKENS_NAME}|{META_NAME}",
)


def dtype_for_vocab(vocab_size: int) -> str:
    """The smallest stored dtype holding every id below `vocab_size`."""
    if not 0 < vocab_size <= 2**32:
        raise TokenFileError(f"vocab_size must be in [1, 2**32], got {vocab_size}")
    return "uint16" if vocab_size <= 2**16 else "uint32"


def write_token_file(
    out_dir: str | os.PathLike,
    documents: Iterable[np.ndarray],
    *,
    vocab_size: int,
    tokenizer: str = "bytes",
    sources: Sequence[str] = (),
    overwrite: bool = False,
    eos_id: int = EOS_ID,
) -> Path:
    """Streams `documents` (1-D id arrays) into a token file at `out_dir`, EOS after each.

    The file is built in a temp dir beside `out_dir` and renamed into place, so a
    killed process never leaves a half-written token file where readers look.
    """
    out_dir = Path(out_dir)
    dtype_name = dtype_for_vocab(vocab_size)
    dtype = _DTYPES[dtype_name]
    if not 0 <= eos_id < vocab_size:
        raise TokenFileError(f"{out_dir}: eos_id {eos_id} is outside vocab_size {vocab_size}")
    with _KIND.build(out_dir, overwrite) as tmp:
        num_tokens = num_documents = max_id = 0
        eos = np.array([eos_id], dtype=dtype)
        with open(tmp / TOKENS_NAME, "wb") as f:
            for doc in documents:
                ids = np.asarray(doc)
                if ids.ndim != 1 or not (ids.dtype.kind in "iu" or ids.size == 0):
                    raise TokenFileError(
                        f"{out_dir}: document {num_documents} must be a 1-D integer array, "
                        f"got shape {ids.shape} dtype {ids.dtype}"
                    )
                if ids.size:
                    lo, hi = int(ids.min()), int(ids.max())
                    if lo < 0 or hi >= vocab_size:
                        bad = lo if lo < 0 else hi
                        raise TokenFileError(
                            f"{out_dir}: document {num_documents} has token id {bad} "
                            f"outside [0, vocab_size={vocab_size})"
                        )
                    max_id = max(max_id, hi)
                f.write(ids.astype(dtype).tobytes())
                f.write(eos.tobytes())
                num_tokens += ids.size + 1
                num_documents += 1
            f.flush()
            os.fsync(f.fileno())
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": dtype_name,
            "num_tokens": num_tokens,
            "vocab_size": vocab_size,
            "tokenizer": tokenizer,
            "num_documents": num_documents,
            "max_token_id": max(max_id, eos_id),
            "eos_id": eos_id,
            "sources": list(sources),
        }
        (tmp / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
    return out_dir


def fingerprint_tokens(tokens, *, tokenizer, vocab_size: int, samples: int = 64, window: int = 1 << 14) -> dict:
    """Token count, tokenizer, vocabulary and a SHA-256 of `samples` evenly spaced windows of `window` tokens (the
    first and last included; all of small data): cheap for any size. `tokens` needs only len() and slices."""
    n, digest = len(tokens), hashlib.sha256()
    if n <= samples * window:
        digest.update(np.ascontiguousarray(tokens[0:n]).tobytes())
    else:
        for start in np.linspace(0, n - window, samples).astype(np.int64):
            digest.update(np.ascontiguousarray(tokens[start : start + window]).tobytes())
    return {"tokens": n, "tokenizer": tokenizer, "vocab_size": vocab_size, "sample_sha256": digest.hexdigest()[:16]}


@dataclasses.dataclass(frozen=True, eq=False)
class TokenFile:
    """An opened, validated token file; `tokens` is a read-only 1-D memmap."""

    path: Path
    meta: dict
    tokens: np.memmap

    @property
    def num_tokens(self) -> int:
        return int(self.meta["num_tokens"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def tokenizer_id(self) -> str:
        """The tokenizer the ids were written with, as the fingerprint names it."""
        return self.meta.get("tokenizer", "?")

    def fingerprint(self, samples: int = 64, window: int = 1 << 14) -> dict:
        """What identifies this data, cheaply for any size: token count, tokenizer, vocabulary and a SHA-256 of
        `samples` evenly spaced windows of `window` tokens (the first and last included; all of a small file).
        A checkpoint stores it, so resuming on other data is caught (jaxlm.trainer)."""
        return fingerprint_tokens(
            self.tokens,
            tokenizer=self.tokenizer_id,
            vocab_size=self.vocab_size,
            samples=samples,
            window=window,
        )

    @classmethod
    def open(cls, path: str | os.PathLike) -> "TokenFile":
        """Opens the directory (or its meta.json); raises TokenFileError naming the problem."""
        path = Path(path)
        if path.name == META_NAME and not path.is_dir():
            path = path.parent

        def fail(problem: str):
            raise TokenFileError(f"token file {path}: {problem}")

        if not path.exists():
            fail("directory does not exist")
        what = f"a token file is a directory with {TOKENS_NAME} and {META_NAME} (python -m data.prepare writes one)"
        if not path.is_dir():
            fail(f"not a directory: {what}")
        if not any(path.iterdir()):
            fail(f"empty directory: {what}")
        bin_path = path / TOKENS_NAME
        try:
            meta = _KIND.read_marker(path, VERSION)
        except TokenFileError as e:  # its message starts with the bare path
            raise TokenFileError(f"token file {e}") from None
        for key in ("num_tokens", "vocab_size", "max_token_id"):
            if not isinstance(meta.get(key), int) or meta[key] < 0:
                fail(f"{META_NAME} field {key!r} must be a non-negative integer, got {meta.get(key)!r}")
        dtype = _DTYPES.get(meta.get("dtype"))
        if dtype is None:
            fail(f"unknown dtype {meta.get('dtype')!r}, expected one of {sorted(_DTYPES)}")
        if not bin_path.is_file():
            fail(f"{TOKENS_NAME} is not a file" if bin_path.exists() else f"missing {TOKENS_NAME}")
        try:
            with open(bin_path, "rb"):
                pass
        except OSError as e:
            fail(f"cannot read {TOKENS_NAME}: {e}")
        n = meta["num_tokens"]
        expected, actual = n * dtype.itemsize, bin_path.stat().st_size
        if actual != expected:
            kind = "truncated" if actual < expected else "size mismatch"
            fail(f"{kind}: {META_NAME} says {n} tokens ({expected} bytes) but {TOKENS_NAME} has {actual} bytes")
        if n == 0:
            fail("empty (0 tokens)")
        if meta["max_token_id"] >= meta["vocab_size"]:
            fail(f"max_token_id {meta['max_token_id']} >= vocab_size {meta['vocab_size']}")
        tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(n,))
        return cls(path=path, meta=meta, tokens=tokens)

    def validate_ids(
        self, vocab_size: int, *, deep: bool = False, chunk_size: int = 1 << 24, max_chunks: int = 0
    ) -> int:
        """Checks every id fits a model with `vocab_size`; returns meta.json's max_token_id.

        meta.json's max_token_id is trusted unless `deep`, which scans tokens.bin
        in chunks (bounded memory) and also catches a meta.json that lies.
        `max_chunks` > 0 bounds the scan of a huge file to that many chunks spread
        evenly over it: a sample, but one that still catches a systematic lie
        (ids from another tokenizer) without reading the whole file.
        """
        max_id = int(self.meta["max_token_id"])
        if deep:
            starts = range(0, self.num_tokens, chunk_size)
            if 0 < max_chunks < len(starts):
                starts = [starts[i * len(starts) // max_chunks] for i in range(max_chunks)]
            scanned = max(int(self.tokens[i : i + chunk_size].max()) for i in starts)
            if scanned > max_id:
                raise TokenFileError(
                    f"token file {self.path}: {TOKENS_NAME} holds token id {scanned} but "
                    f"{META_NAME} says max_token_id {max_id}; the file is damaged or mislabelled"
                )
        if max_id >= vocab_size:
            raise TokenFileError(
                f"token file {self.path}: token id {max_id} does not fit model vocab_size {vocab_size}"
            )
        return max_id
