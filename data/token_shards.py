"""Token data as shards: a directory of `tokens-NNNNN.bin` files, `manifest.json` and the `tokenizer.json` copy.

`python -m data.prepare` writes it; each shard is one work unit's documents (each followed by EOS), a flat
little-endian uint16 / uint32 array, so shards can be written in parallel and a killed run keeps the ones it
finished. The manifest, written last, says how to read them: per-shard token counts and sha256, totals, the
sources and the tokenizer record. `open_tokens` opens this format and the single-file one (`data.token_file`)
behind one interface, so training takes either as `data.path`.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from pathlib import Path

import numpy as np

from data.atomic_dir import DirKind
from data.token_file import _DTYPES, META_NAME, TokenFile, TokenFileError, fingerprint_tokens

FORMAT = "jaxlm-token-shards"
VERSION = 1
MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"
SHARD_PATTERN = r"tokens-\d{5}\.bin"

KIND = DirKind(
    "token dataset",
    MANIFEST_NAME,
    FORMAT,
    TokenFileError,
    "pass --overwrite to replace it",
    files=rf"{MANIFEST_NAME}|{TOKENIZER_NAME}|{SHARD_PATTERN}",
)


def shard_name(index: int) -> str:
    return f"tokens-{index:05d}.bin"


class ShardWriter:
    """Streams token arrays into one shard file; the file appears under its name only when `finish` is called."""

    def __init__(self, path: Path, dtype: str):
        self.path, self.dtype = Path(path), _DTYPES[dtype]
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._file = open(self._tmp, "wb")
        self._sha = hashlib.sha256()
        self.num_tokens = self.max_id = 0

    def write(self, ids: np.ndarray) -> None:
        if not ids.size:
            return
        data = ids.astype(self.dtype, copy=False).tobytes()
        self._file.write(data)
        self._sha.update(data)
        self.num_tokens += ids.size
        self.max_id = max(self.max_id, int(ids.max()))

    def finish(self) -> dict:
        """Flushes, renames into place; returns the shard's manifest entry."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)
        return {"name": self.path.name, "num_tokens": self.num_tokens, "sha256": self._sha.hexdigest()}

    def abandon(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)


def file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            sha.update(block)
    return sha.hexdigest()


class ShardedTokens:
    """The shards' concatenation as a read-only 1-D array for what training does with it: `len`, slices with step 1
    and integer-array indexing of any shape (a window crossing a shard boundary reads from both). Each shard is a
    memmap, so nothing is read until indexed."""

    ndim = 1

    def __init__(self, shards: list[np.memmap]):
        self._shards = shards
        self._starts_array = np.cumsum([0] + [len(s) for s in shards])  # start of each shard, then the total
        self._starts = self._starts_array.tolist()
        self.dtype = shards[0].dtype
        self.shape = (self._starts[-1],)

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, key):
        if isinstance(key, slice):
            return self._slice(key)
        if isinstance(key, (int, np.integer)):
            i = int(key) + (len(self) if key < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"token index {key} is out of range for {len(self)} tokens")
            s = bisect.bisect_right(self._starts, i) - 1
            return self._shards[s][i - self._starts[s]]
        return self._take(np.asarray(key))

    def _slice(self, key: slice) -> np.ndarray:
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise IndexError("sharded tokens take slices with step 1 only")
        first = max(0, bisect.bisect_right(self._starts, start) - 1)
        parts = []
        for s in range(first, len(self._shards)):
            lo, hi = self._starts[s], self._starts[s + 1]
            if lo >= stop:
                break
            parts.append(self._shards[s][max(start, lo) - lo : min(stop, hi) - lo])
        if len(parts) == 1:
            return parts[0]  # a view, like slicing a memmap
        return np.concatenate(parts) if parts else np.empty(0, self.dtype)

    def _take(self, index: np.ndarray) -> np.ndarray:
        if index.dtype.kind not in "iu":
            raise IndexError(f"sharded tokens take integer indices, got dtype {index.dtype}")
        flat = index.ravel().astype(np.int64, copy=False)
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"token index out of range for {len(self)} tokens")
        shard_of = np.searchsorted(self._starts_array, flat, side="right") - 1
        out = np.empty(flat.shape, self.dtype)
        for s in np.unique(shard_of):
            hit = shard_of == s
            out[hit] = self._shards[s][flat[hit] - self._starts[s]]
        return out.reshape(index.shape)


class TokenShards:
    """An opened, validated shard directory with TokenFile's interface: `tokens`, `num_tokens`, `vocab_size`,
    `meta` (the manifest), `path`, `fingerprint()`, `validate_ids()`."""

    def __init__(self, path: Path, meta: dict, tokens: ShardedTokens):
        self.path, self.meta, self.tokens = path, meta, tokens

    @property
    def num_tokens(self) -> int:
        return int(self.meta["num_tokens"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def __len__(self) -> int:
        return self.num_tokens

    @classmethod
    def open(cls, path: str | os.PathLike) -> "TokenShards":
        """Opens the directory (or its manifest); TokenFileError names a missing, truncated or malformed part."""
        path = Path(path)
        if path.name == MANIFEST_NAME and not path.is_dir():
            path = path.parent

        def fail(problem: str):
            raise TokenFileError(f"token dataset {path}: {problem}")

        try:
            meta = KIND.read_marker(path, VERSION)
        except TokenFileError as e:
            raise TokenFileError(f"token dataset {e}") from None
        dtype = _DTYPES.get(meta.get("dtype"))
        if dtype is None:
            fail(f"unknown dtype {meta.get('dtype')!r}, expected one of {sorted(_DTYPES)}")
        for key in ("num_tokens", "vocab_size", "max_token_id", "eos_id"):
            if not isinstance(meta.get(key), int) or meta[key] < 0:
                fail(f"{MANIFEST_NAME} field {key!r} must be a non-negative integer, got {meta.get(key)!r}")
        shards = meta.get("shards")
        if not isinstance(shards, list) or not shards:
            fail(f"{MANIFEST_NAME} lists no shards")
        if sum(s.get("num_tokens", 0) for s in shards if isinstance(s, dict)) != meta["num_tokens"]:
            fail(f"{MANIFEST_NAME}: the shards' token counts do not add up to num_tokens {meta['num_tokens']}")
        if meta["max_token_id"] >= meta["vocab_size"]:
            fail(f"max_token_id {meta['max_token_id']} >= vocab_size {meta['vocab_size']}")
        maps = []
        for i, shard in enumerate(shards):
            name, n = shard.get("name"), shard.get("num_tokens")
            if not (isinstance(name, str) and name == Path(name).name and isinstance(n, int) and n > 0):
                fail(f"{MANIFEST_NAME} shard {i} is {shard!r}, expected a file name and num_tokens > 0")
            file = path / name
            if not file.is_file():
                fail(f"missing shard {name}")
            expected, actual = n * dtype.itemsize, file.stat().st_size
            if actual != expected:
                kind = "truncated" if actual < expected else "size mismatch"
                fail(f"shard {name} {kind}: {MANIFEST_NAME} says {n} tokens ({expected} bytes), it has {actual}")
            maps.append(np.memmap(file, dtype=dtype, mode="r", shape=(n,)))
        return cls(path, meta, ShardedTokens(maps))

    @property
    def tokenizer_id(self) -> str:
        """The tokenizer's sha256 ("byte" for the byte tokenizer), as the fingerprint names it."""
        record = self.meta.get("tokenizer") or {}
        return "byte" if record.get("name") == "byte" else record.get("sha256", "?")

    def fingerprint(self, samples: int = 64, window: int = 1 << 14) -> dict:
        """Like TokenFile.fingerprint; its "tokenizer" is `tokenizer_id`."""
        return fingerprint_tokens(
            self.tokens, tokenizer=self.tokenizer_id, vocab_size=self.vocab_size, samples=samples, window=window
        )

    # the same checks as a single file's: they read only meta, num_tokens, path and slices of tokens
    validate_ids = TokenFile.validate_ids


def is_token_shards(path: str | os.PathLike) -> bool:
    path = Path(path)
    return KIND.is_one(path.parent if path.name == MANIFEST_NAME else path)


def open_tokens(path: str | os.PathLike) -> TokenFile | TokenShards:
    """The token data at `path`, in either format: what training opens as `data.path`."""
    path = Path(path)
    if path.name in (MANIFEST_NAME, META_NAME) and not path.is_dir():
        path = path.parent
    if (path / MANIFEST_NAME).is_file() and not (path / META_NAME).exists():
        return TokenShards.open(path)
    return TokenFile.open(path)
