"""Sample sources: random access to fixed-length samples, wherever they live.

A sample is one window of seq_len + 1 tokens (inputs and shifted targets).
Everything that feeds training reads through `SampleSource.read(indices)`, so
a loader that knows its future indices can batch, reorder and prefetch reads
the same way from a local token file, a directory of shards on a shared
filesystem, or a simulated slow store (`ThrottledSource`) in tests.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from data.atomic_dir import DirKind
from data.iterator import as_token_array, num_windows
from data.token_file import _DTYPES, META_NAME, TokenFile, TokenFileError
from data.token_shards import TokenShards, is_token_shards

FORMAT = "jaxlm-shards"
VERSION = 1
MANIFEST_NAME = "manifest.json"
_WRITE_CHUNK_BYTES = 16 << 20  # write_shards holds at most about this much sample data at once


class SourceError(ValueError):
    """A dataset source is missing, truncated, malformed, or was asked for something it lacks."""


_KIND = DirKind("shard dataset", MANIFEST_NAME, FORMAT, SourceError, files=rf"{MANIFEST_NAME}|shard-\d{{5}}\.bin")


class SampleIndexError(SourceError, IndexError):
    """A sample index outside [0, num_samples): a loader bug, never something to clamp."""


@runtime_checkable
class SampleSource(Protocol):
    """Random access to `num_samples` samples of `sample_len` tokens stored as `dtype`.

    `read` returns a fresh [k, sample_len] array (never a view into a memmap, so
    callers may keep or mutate it); duplicates are allowed and order is kept.
    """

    num_samples: int
    sample_len: int
    dtype: np.dtype

    @property
    def sample_nbytes(self) -> int: ...
    def read(self, indices) -> np.ndarray: ...


def _check_indices(indices, num_samples: int) -> np.ndarray:
    """Indices as a 1-D int64 array, each in [0, num_samples)."""
    idx = np.asarray(indices)
    if idx.size == 0:
        return np.zeros(0, np.int64)  # np.asarray([]) is float64; an empty read is still valid
    if idx.ndim != 1 or idx.dtype.kind not in "iu":
        raise SourceError(f"indices must be a 1-D integer array, got shape {idx.shape} dtype {idx.dtype}")
    idx = idx.astype(np.int64, copy=False)
    bad = idx[(idx < 0) | (idx >= num_samples)]
    if bad.size:
        raise SampleIndexError(f"sample index {int(bad[0])} is out of range for num_samples={num_samples}")
    return idx


def _stored_dtype_name(dtype: np.dtype) -> str | None:
    dtype = np.dtype(dtype)
    return f"uint{8 * dtype.itemsize}" if dtype.kind == "u" and dtype.itemsize in (2, 4) else None


# --- a token stream cut into windows -------------------------------------------------------------


class TokenWindowSource:
    """The non-overlapping windows of tokens[start:stop], exactly as data.iterator cuts them.

    Sample i is tokens[start + i*seq_len : start + i*seq_len + seq_len + 1]:
    consecutive samples share one token, so every token is a target once.
    """

    def __init__(self, tokens, *, seq_len: int, start: int = 0, stop: int | None = None):
        self.tokens = as_token_array(tokens)
        if self.tokens.ndim != 1 or self.tokens.dtype.kind not in "iu":
            raise SourceError(
                f"tokens must be a 1-D integer array, got shape {self.tokens.shape} dtype {self.tokens.dtype}"
            )
        stop = len(self.tokens) if stop is None else stop
        if not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
            raise SourceError(f"seq_len must be an integer >= 1, got {seq_len!r}")
        if not 0 <= start <= stop <= len(self.tokens):
            raise SourceError(
                f"need 0 <= start <= stop <= len(tokens), got start={start} stop={stop} len={len(self.tokens)}"
            )
        self.seq_len, self.start, self.stop = int(seq_len), int(start), int(stop)
        self.num_samples = num_windows(self.start, self.stop, self.seq_len)
        if self.num_samples == 0:
            raise SourceError(
                f"tokens[{start}:{stop}] ({stop - start} tokens) hold no window of seq_len+1={seq_len + 1} tokens"
            )
        self.sample_len = self.seq_len + 1
        self.dtype = self.tokens.dtype

    @property
    def sample_nbytes(self) -> int:
        return self.sample_len * self.dtype.itemsize

    def read(self, indices) -> np.ndarray:
        idx_K = _check_indices(indices, self.num_samples)
        index_KS = self.start + idx_K[:, None] * self.seq_len + np.arange(self.sample_len)
        return np.asarray(self.tokens[index_KS])  # fancy indexing copies: never a memmap view

    def __repr__(self) -> str:
        return (
            f"TokenWindowSource(num_samples={self.num_samples}, seq_len={self.seq_len}, "
            f"start={self.start}, stop={self.stop}, dtype={self.dtype})"
        )


# --- a directory of shards -----------------------------------------------------------------------


def _shard_name(i: int) -> str:
    return f"shard-{i:05d}.bin"


def write_shards(
    out_dir: str | os.PathLike, source: SampleSource, *, samples_per_shard: int, overwrite: bool = False
) -> Path:
    """Copies every sample of `source` into a shard dataset at `out_dir`; returns the path.

    Shards are built in a temp dir beside `out_dir` and renamed into place, so
    readers never see half a dataset; samples are streamed in bounded chunks.
    """
    out_dir = Path(out_dir)
    if not isinstance(samples_per_shard, (int, np.integer)) or samples_per_shard < 1:
        raise SourceError(f"samples_per_shard must be an integer >= 1, got {samples_per_shard!r}")
    n, sample_len = int(source.num_samples), int(source.sample_len)
    dtype_name = _stored_dtype_name(source.dtype)
    if dtype_name is None:
        raise SourceError(f"{out_dir}: shards store uint16 or uint32 tokens, source dtype is {source.dtype}")
    if n < 1 or sample_len < 1:
        raise SourceError(f"{out_dir}: source has num_samples={n} sample_len={sample_len}; nothing to write")
    dtype = _DTYPES[dtype_name]
    sample_nbytes = sample_len * dtype.itemsize
    chunk = max(1, _WRITE_CHUNK_BYTES // sample_nbytes)
    with _KIND.build(out_dir, overwrite) as tmp:
        shards = []
        for i, first in enumerate(range(0, n, samples_per_shard)):
            last = min(first + samples_per_shard, n)
            with open(tmp / _shard_name(i), "wb") as f:
                for a in range(first, last, chunk):
                    b = min(a + chunk, last)
                    samples = np.asarray(source.read(np.arange(a, b)))
                    if samples.shape != (b - a, sample_len):
                        raise SourceError(
                            f"{out_dir}: source.read of samples [{a}, {b}) returned shape "
                            f"{samples.shape}, expected {(b - a, sample_len)}"
                        )
                    f.write(np.ascontiguousarray(samples, dtype=dtype).tobytes())
                f.flush()
                os.fsync(f.fileno())
            shards.append(
                {"name": _shard_name(i), "num_samples": last - first, "bytes": (last - first) * sample_nbytes}
            )
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "num_samples": n,
            "sample_len": sample_len,
            "dtype": dtype_name,
            "samples_per_shard": int(samples_per_shard),
            "shards": shards,
        }
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return out_dir


class ShardedSource:
    """A shard dataset written by `write_shards`, validated at open and read with `os.pread`.

    pread (not a memmap) because a shard shortened under a memmap kills the
    process with SIGBUS, while a short pread is an error we can name. File
    descriptors open lazily, one per shard, shared by all threads (pread has no
    file position to race on). Each read re-checks the shards it touched, so a
    shard deleted or shortened after open raises SourceError, never garbage.
    """

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        if path.name == MANIFEST_NAME and not path.is_dir():
            path = path.parent
        self.path = path
        m = self._load_manifest()
        self.num_samples, self.sample_len = m["num_samples"], m["sample_len"]
        self.samples_per_shard, self.dtype = m["samples_per_shard"], _DTYPES[m["dtype"]]
        self.manifest = m
        self._shard_paths = [path / s["name"] for s in m["shards"]]
        self._shard_bytes = [s["bytes"] for s in m["shards"]]
        for shard_path, expected in zip(self._shard_paths, self._shard_bytes):
            try:
                actual = shard_path.stat().st_size
            except FileNotFoundError:
                raise SourceError(f"{shard_path}: shard is missing") from None
            self._check_size(shard_path, expected, actual)
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: str | os.PathLike) -> "ShardedSource":
        return cls(path)

    def _load_manifest(self) -> dict:
        def fail(problem: str):
            raise SourceError(f"{self.path}: {problem}")

        if not self.path.exists():
            fail("shard dataset directory does not exist")
        if not self.path.is_dir():
            fail(f"not a directory (a shard dataset is a directory with {MANIFEST_NAME} and shard files)")
        m = _KIND.read_marker(self.path, VERSION)
        for key, least in (("num_samples", 0), ("sample_len", 1), ("samples_per_shard", 1)):
            if not isinstance(m.get(key), int) or m[key] < least:
                fail(f"{MANIFEST_NAME} field {key!r} must be an integer >= {least}, got {m.get(key)!r}")
        if not isinstance(m.get("dtype"), str) or m["dtype"] not in _DTYPES:
            fail(f"unknown dtype {m.get('dtype')!r}, expected one of {sorted(_DTYPES)}")
        if m["num_samples"] == 0:
            fail("empty shard dataset (0 samples)")
        n, per = m["num_samples"], m["samples_per_shard"]
        sample_nbytes = m["sample_len"] * _DTYPES[m["dtype"]].itemsize
        shards = m.get("shards")
        if not isinstance(shards, list) or len(shards) != math.ceil(n / per):
            got = len(shards) if isinstance(shards, list) else repr(shards)
            fail(
                f"{MANIFEST_NAME} lists {got} shards, expected {math.ceil(n / per)} for {n} samples at {per} per shard"
            )
        for i, s in enumerate(shards):
            want = min(per, n - i * per)
            ok = (
                isinstance(s, dict)
                and isinstance(s.get("name"), str)
                and s["name"] == Path(s["name"]).name
                and s["name"] not in ("", ".", "..")
                and s.get("num_samples") == want
                and s.get("bytes") == want * sample_nbytes
            )
            if not ok:
                fail(
                    f"{MANIFEST_NAME} shard {i} is {s!r}, expected a plain file name with num_samples={want} "
                    f"and bytes={want * sample_nbytes}"
                )
        return m

    @staticmethod
    def _check_size(shard_path: Path, expected: int, actual: int) -> None:
        if actual != expected:
            kind = "truncated" if actual < expected else "size mismatch"
            raise SourceError(f"{shard_path}: shard {kind}: expected {expected} bytes, found {actual} bytes")

    @property
    def sample_nbytes(self) -> int:
        return self.sample_len * self.dtype.itemsize

    def _fd(self, shard: int) -> int:
        with self._lock:
            fd = self._fds.get(shard)
            if fd is None:
                try:
                    fd = self._fds[shard] = os.open(self._shard_paths[shard], os.O_RDONLY)
                except FileNotFoundError:
                    raise SourceError(f"{self._shard_paths[shard]}: shard is missing") from None
            return fd

    def _pread(self, shard: int, fd: int, nbytes: int, offset: int) -> bytes:
        parts = []
        while nbytes:  # one pread returns at most ~2 GiB on Linux
            part = os.pread(fd, nbytes, offset)
            if not part:
                self._check_size(self._shard_paths[shard], self._shard_bytes[shard], os.fstat(fd).st_size)
                raise SourceError(f"{self._shard_paths[shard]}: shard truncated: read past end of file")
            parts.append(part)
            nbytes, offset = nbytes - len(part), offset + len(part)
        return b"".join(parts)

    def read(self, indices) -> np.ndarray:
        idx_K = _check_indices(indices, self.num_samples)
        if not idx_K.size:
            return np.empty((0, self.sample_len), self.dtype)
        if idx_K.size == 1:  # the common request of a loader worker: skip the run-finding below
            shard, within = divmod(int(idx_K[0]), self.samples_per_shard)
            fd = self._fd(shard)
            data = self._pread(shard, fd, self.sample_nbytes, within * self.sample_nbytes)
            self._check_still_there(shard, fd)
            return np.frombuffer(data, self.dtype).reshape(1, self.sample_len).copy()
        unique_U, inverse_K = np.unique(idx_K, return_inverse=True)
        out_US = np.empty((len(unique_U), self.sample_len), self.dtype)
        shard_U = unique_U // self.samples_per_shard
        # runs of consecutive samples within one shard: one pread each
        breaks = np.flatnonzero((np.diff(unique_U) != 1) | (np.diff(shard_U) != 0)) + 1
        bounds = np.concatenate([[0], breaks, [len(unique_U)]])
        touched: dict[int, int] = {}
        for a, b in zip(bounds[:-1], bounds[1:]):
            shard = int(shard_U[a])
            if shard not in touched:
                touched[shard] = self._fd(shard)
            fd = touched[shard]
            offset = (int(unique_U[a]) - shard * self.samples_per_shard) * self.sample_nbytes
            data = self._pread(shard, fd, (b - a) * self.sample_nbytes, offset)
            out_US[a:b] = np.frombuffer(data, self.dtype).reshape(b - a, self.sample_len)
        for shard, fd in touched.items():
            self._check_still_there(shard, fd)
        return out_US[inverse_K]

    def _check_still_there(self, shard: int, fd: int) -> None:
        """An open fd still reads a deleted or rewritten file: check the shard is the one opened."""
        st = os.fstat(fd)
        if st.st_nlink == 0:
            raise SourceError(f"{self._shard_paths[shard]}: shard is missing (deleted after open)")
        self._check_size(self._shard_paths[shard], self._shard_bytes[shard], st.st_size)

    def close(self) -> None:
        """Closes the shard files; call it with no read in flight (a later read reopens them)."""
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> "ShardedSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:  # no module globals here: at interpreter exit they may already be gone
            self.close()
        except Exception:  # noqa: BLE001
            pass

    def __reduce__(self):
        return (type(self), (self.path,))  # file descriptors do not travel: reopen (and revalidate) there

    def __repr__(self) -> str:
        return (
            f"ShardedSource({str(self.path)!r}, num_samples={self.num_samples}, "
            f"sample_len={self.sample_len}, dtype={self.dtype}, shards={len(self._shard_paths)})"
        )


# --- a simulated remote store --------------------------------------------------------------------


class ThrottledSource:
    """Wraps a source to behave like a remote store: per-request latency plus one shared pipe.

    Each `read` is one request: it sleeps `latency_s` (overlapping with other
    requests, like round trips do), then its bytes take their turn through a
    single pipe of `bandwidth_bytes_per_s`, so concurrency hides latency but not
    bandwidth. `max_concurrency` caps requests in flight, like a connection pool.
    """

    def __init__(
        self,
        source: SampleSource,
        *,
        latency_s: float = 0.002,
        bandwidth_bytes_per_s: float | None = 50e6,
        max_concurrency: int | None = None,
    ):
        if not (isinstance(latency_s, (int, float)) and math.isfinite(latency_s) and latency_s >= 0):
            raise SourceError(f"latency_s must be a finite number >= 0, got {latency_s!r}")
        if bandwidth_bytes_per_s is None:
            bandwidth_bytes_per_s = math.inf
        if not (isinstance(bandwidth_bytes_per_s, (int, float)) and bandwidth_bytes_per_s > 0):
            raise SourceError(
                f"bandwidth_bytes_per_s must be > 0 (or None/inf for unlimited), got {bandwidth_bytes_per_s!r}"
            )
        if max_concurrency is not None and (not isinstance(max_concurrency, int) or max_concurrency < 1):
            raise SourceError(f"max_concurrency must be an integer >= 1 or None, got {max_concurrency!r}")
        self.source = source
        self.latency_s, self.bandwidth_bytes_per_s = float(latency_s), float(bandwidth_bytes_per_s)
        self.max_concurrency = max_concurrency
        self.num_samples, self.sample_len, self.dtype = source.num_samples, source.sample_len, source.dtype
        self._slots = threading.BoundedSemaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
        self._lock = threading.Lock()
        self._pipe_free_at = 0.0
        self.reset_stats()

    @property
    def sample_nbytes(self) -> int:
        return self.source.sample_nbytes

    def read(self, indices) -> np.ndarray:
        with self._slots:
            t0 = time.monotonic()
            time.sleep(self.latency_s)
            out = self.source.read(indices)
            if math.isfinite(self.bandwidth_bytes_per_s):
                with self._lock:
                    start = max(time.monotonic(), self._pipe_free_at)
                    self._pipe_free_at = end = start + out.nbytes / self.bandwidth_bytes_per_s
                while (wait := end - time.monotonic()) > 0:
                    time.sleep(wait)
            elapsed = time.monotonic() - t0
        with self._lock:
            self._stats["requests"] += 1
            self._stats["samples"] += len(out)
            self._stats["bytes"] += out.nbytes
            self._stats["busy_s"] += elapsed
        return out

    def stats(self) -> dict:
        """Requests served, samples and bytes sent, and busy_s: the sum of request service times
        (from getting a slot to the last byte), so busy_s / wall time is the mean concurrency."""
        with self._lock:
            return dict(self._stats)

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = {"requests": 0, "samples": 0, "bytes": 0, "busy_s": 0.0}

    def __repr__(self) -> str:
        return (
            f"ThrottledSource({self.source!r}, latency_s={self.latency_s}, "
            f"bandwidth_bytes_per_s={self.bandwidth_bytes_per_s}, max_concurrency={self.max_concurrency})"
        )


# --- opening whatever is at a path ---------------------------------------------------------------


def open_source(path: str | os.PathLike, seq_len: int | None = None) -> SampleSource:
    """A shard dataset as a ShardedSource, or token data (a token file or token shards) cut into windows of
    `seq_len` + 1.

    A shard dataset fixes its own sample_len, so a `seq_len` given for one must
    agree with it: a mismatch is a config error, better caught here than as a
    shape error deep in the step function.
    """
    path = Path(path)
    if path.is_file() and path.name in (MANIFEST_NAME, META_NAME):
        path = path.parent
    if not path.exists():
        raise SourceError(f"{path}: dataset path does not exist")
    if is_token_shards(path):  # token shards (data.prepare) are a token stream, cut into windows like a token file
        if seq_len is None:
            raise SourceError(f"{path}: is token data; pass seq_len to cut it into windows of seq_len+1 tokens")
        try:
            return TokenWindowSource(TokenShards.open(path).tokens, seq_len=seq_len)
        except TokenFileError as e:
            raise SourceError(str(e)) from e
    if (path / MANIFEST_NAME).exists():
        source = ShardedSource(path)
        if seq_len is not None and seq_len != source.sample_len - 1:
            raise SourceError(
                f"{path}: shard dataset has sample_len={source.sample_len} "
                f"(seq_len={source.sample_len - 1}) but seq_len={seq_len} was requested"
            )
        return source
    if (path / META_NAME).exists():
        if seq_len is None:
            raise SourceError(f"{path}: is a token file; pass seq_len to cut it into windows of seq_len+1 tokens")
        try:
            tokens = TokenFile.open(path).tokens
        except TokenFileError as e:
            raise SourceError(str(e)) from e
        return TokenWindowSource(tokens, seq_len=seq_len)
    raise SourceError(f"{path}: neither a shard dataset ({MANIFEST_NAME}) nor a token file ({META_NAME})")
