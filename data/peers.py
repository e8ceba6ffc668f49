"""Peer-to-peer sample transfer for a distributed data loader.

Each data-loading process caches some samples (fixed-size numpy rows). Reading a
sample from another process's memory over TCP is much cheaper than reading it
again from a slow shared filesystem, so every process runs a `PeerServer` over
its cache and fetches what it lacks through a `PeerClient`. A peer is only an
optimisation: whatever it does not hold, or cannot deliver in time, the caller
reads from the source, so every failure here is either "not found" or a
`PeerError`, never wrong data.

Wire protocol (all integers little-endian; one request, one response, repeated
on a persistent connection):

    request  = b"JLP1" | uint32 count | float32 wait_s | count x int64 sample id
    response = b"JLR1" | uint32 count | uint32 row_nbytes | uint64 body_nbytes | body
    body     = count x uint8 found flag | the found rows' raw bytes, in request order

The response repeats `count` and `row_nbytes` so a client talking to a peer of
another configuration (sample_len, dtype) fails loudly instead of misreading
rows, and `body_nbytes` lets it check the length before reading the body.
Rows travel in the dtype's own byte order: peers are processes of one job.

`all_gather_via_files` is a rendezvous over a shared directory for processes
that have no jax.distributed (tests, benchmarks) to exchange server addresses.

Numpy and the stdlib only: the data layer never imports jax or jaxlm.
"""

from __future__ import annotations

import json
import math
import socket
import struct
import threading
import time
import urllib.parse
from pathlib import Path

import numpy as np

from data.atomic_file import write_atomic

REQUEST_HEADER = struct.Struct("<4sIf")
RESPONSE_HEADER = struct.Struct("<4sIIQ")
REQUEST_MAGIC = b"JLP1"
RESPONSE_MAGIC = b"JLR1"
MAX_IDS_PER_REQUEST = 1 << 20  # bounds what a garbage header can make the server allocate
MAX_WAIT_S = 3600.0


class PeerError(RuntimeError):
    """A peer could not deliver: the caller falls back to the source."""


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray | None:
    """Reads exactly n bytes. Returns None on a clean EOF before the first byte
    (the peer closed between messages); an EOF mid-message is ConnectionError.
    With a deadline (time.monotonic), the whole read is bounded, not just each recv."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(remaining)
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


class _Stats:
    """Thread-safe counters: connections update them concurrently."""

    def __init__(self, *names: str):
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(names, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._counts)


class PeerServer:
    """Serves samples from this process's cache to other processes over TCP.

    `lookup(sample_id, timeout_s)` returns the row ([sample_len] of dtype) or None
    if not held; it may block up to timeout_s because a sample may be about to be
    inserted. It runs in the connection's thread, so one slow lookup delays only
    the peer that asked. A request's wait_s bounds the whole request: each lookup
    gets what is left of it, so a request for k ids waits at most wait_s, not k x.

    A lookup that raises, or returns a row of the wrong shape or dtype, counts as
    "not found" (and in stats' lookup_errors): serving a misshapen row would
    corrupt training data silently, while not-found only costs a source read.

    Bind `host` to an address the other processes can reach: `address` is what
    they should connect to, and "0.0.0.0" is not connectable.
    """

    def __init__(self, lookup, *, host: str = "127.0.0.1", port: int = 0, sample_len: int, dtype):
        self.lookup = lookup
        self.sample_len = int(sample_len)
        self.dtype = np.dtype(dtype)
        self.row_nbytes = self.sample_len * self.dtype.itemsize
        # Bound and listening now, so `address` is known (and connections queue) before start().
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(0.1)  # the accept loop polls its stop flag this often
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._stats = _Stats(
            "requests",
            "samples_served",
            "samples_missing",
            "bytes_sent",
            "lookup_errors",
            "bad_requests",
            "connections",
        )
        self._closed = threading.Event()
        self._accept_thread: threading.Thread | None = None
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._conns_lock = threading.Lock()

    def __enter__(self) -> PeerServer:
        return self  # `with PeerServer(...).start() as server:` closes it on exit

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> PeerServer:
        if self._closed.is_set() or self._accept_thread is not None:
            raise RuntimeError("PeerServer.start: already started or closed")
        self._accept_thread = threading.Thread(
            target=self._accept_loop, daemon=True, name=f"peer-server-{self.address[1]}"
        )
        self._accept_thread.start()
        return self

    def close(self) -> None:
        """Stops accepting, closes connections, joins threads; idempotent.

        Waits at most a few seconds for threads inside a lookup: they are daemon
        threads whose connection is already shut, so they end on their own."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._accept_thread is not None:
            self._accept_thread.join()  # after this no connection is added
        self._listener.close()
        with self._conns_lock:
            conns = list(self._conns.items())
        for conn, _ in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in recv
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        for _, thread in conns:
            thread.join(max(0.0, deadline - time.monotonic()))

    def stats(self) -> dict:
        """requests, samples_served, samples_missing, bytes_sent (headers included), plus
        lookup_errors (a subset of samples_missing), bad_requests and connections."""
        return self._stats.snapshot()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            thread = threading.Thread(
                target=self._serve_connection, args=(conn,), daemon=True, name=f"peer-conn-{self.address[1]}"
            )
            with self._conns_lock:
                self._conns[conn] = thread
            self._stats.add(connections=1)
            thread.start()

    def _serve_connection(self, conn: socket.socket) -> None:
        """Answers requests until the peer closes, sends something malformed, or we close.
        Any failure ends this connection only: the server keeps serving the others."""
        try:
            while not self._closed.is_set():
                ids, wait_s = self._read_request(conn)
                if ids is None:
                    return
                conn.sendall(self._answer(ids, wait_s))
        except (OSError, ValueError):
            pass  # a dropped or malformed connection ends here; the server and other connections carry on
        finally:
            with self._conns_lock:
                self._conns.pop(conn, None)
            conn.close()

    def _read_request(self, conn: socket.socket) -> tuple[np.ndarray | None, float]:
        header = _recv_exact(conn, REQUEST_HEADER.size)
        if header is None:
            return None, 0.0
        magic, count, wait_s = REQUEST_HEADER.unpack(header)
        if magic != REQUEST_MAGIC or count > MAX_IDS_PER_REQUEST or not 0.0 <= wait_s <= MAX_WAIT_S:
            self._stats.add(bad_requests=1)
            raise ValueError(f"malformed request header {bytes(header)!r}")
        body = _recv_exact(conn, 8 * count) if count else bytearray()
        if body is None:
            raise ConnectionError("connection closed before the request's ids")
        return np.frombuffer(body, dtype="<i8"), float(wait_s)

    def _answer(self, ids: np.ndarray, wait_s: float) -> bytes:
        deadline = time.monotonic() + wait_s
        found = np.zeros(len(ids), dtype=np.uint8)
        rows, errors = [], 0
        for i, sample_id in enumerate(ids.tolist()):
            try:
                row = self.lookup(sample_id, max(0.0, deadline - time.monotonic()))
            except Exception:
                row, errors = None, errors + 1
            if row is None:
                continue
            row = np.asarray(row)
            if row.shape != (self.sample_len,) or row.dtype != self.dtype:
                errors += 1
                continue
            found[i] = 1
            rows.append(row)
        body = found.tobytes() + (np.stack(rows).tobytes() if rows else b"")
        header = RESPONSE_HEADER.pack(RESPONSE_MAGIC, len(ids), self.row_nbytes, len(body))
        self._stats.add(
            requests=1,
            samples_served=len(rows),
            samples_missing=len(ids) - len(rows),
            bytes_sent=len(header) + len(body),
            lookup_errors=errors,
        )
        return header + body


class _Connection:
    """One persistent connection to one peer; its lock keeps a request and its response together."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None

    def drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class PeerClient:
    """Fetches samples from peers; keeps one persistent connection per peer.

    Thread-safe: a lock per connection, so threads fetching from different peers
    run in parallel and threads fetching from one peer take turns. After any
    failure the connection is dropped (its stream position is unknown) and the
    next fetch reconnects.
    """

    def __init__(self, *, sample_len: int, dtype, timeout_s: float = 5.0):
        self.sample_len = int(sample_len)
        self.dtype = np.dtype(dtype)
        self.row_nbytes = self.sample_len * self.dtype.itemsize
        self.timeout_s = float(timeout_s)
        self._conns: dict[tuple[str, int], _Connection] = {}
        self._conns_lock = threading.Lock()
        self._closed = False
        self._stats = _Stats("requests", "samples_received", "samples_missing", "bytes_received", "errors")

    def __enter__(self) -> PeerClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def fetch(self, address, sample_ids, wait_s: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """Returns (rows [k, sample_len] dtype, found [k] bool).

        Rows of samples the peer does not hold are zeros with found=False: the
        caller then falls back to the source. `wait_s` is passed to the server's
        lookup as timeout_s (a peer may be about to insert it); the response may
        take up to timeout_s + wait_s. Connection failures, timeouts and
        malformed responses raise PeerError naming the address."""
        address = (str(address[0]), int(address[1]))  # a JSON round trip turns the tuple into a list
        ids = np.asarray(sample_ids)
        if ids.size == 0:
            ids = ids.astype(np.int64).reshape(0)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(f"sample_ids must be a 1-D sequence of integers, got {ids.dtype} {ids.shape}")
        if len(ids) > MAX_IDS_PER_REQUEST:
            raise ValueError(f"at most {MAX_IDS_PER_REQUEST} sample ids per request, got {len(ids)}")
        if not (math.isfinite(wait_s) and 0.0 <= wait_s <= MAX_WAIT_S):
            raise ValueError(f"wait_s must be in [0, {MAX_WAIT_S}], got {wait_s}")
        rows = np.zeros((len(ids), self.sample_len), dtype=self.dtype)
        found = np.zeros(len(ids), dtype=bool)
        if len(ids) == 0:
            return rows, found
        request = REQUEST_HEADER.pack(REQUEST_MAGIC, len(ids), wait_s) + ids.astype("<i8").tobytes()
        conn = self._connection(address)
        with conn.lock:
            try:
                body, nbytes = self._round_trip(conn, address, request, len(ids), wait_s)
            except (OSError, PeerError) as e:
                conn.drop()
                self._stats.add(errors=1)
                if isinstance(e, PeerError):
                    raise
                raise PeerError(f"peer {address[0]}:{address[1]}: {type(e).__name__}: {e}") from e
        found[:] = np.frombuffer(body, dtype=np.uint8, count=len(ids)).astype(bool)
        rows[found] = np.frombuffer(body, dtype=self.dtype, offset=len(ids)).reshape(-1, self.sample_len)
        n_found = int(found.sum())
        self._stats.add(requests=1, samples_received=n_found, samples_missing=len(ids) - n_found, bytes_received=nbytes)
        return rows, found

    def close(self) -> None:
        """Closes every connection (waiting for fetches in flight); idempotent."""
        with self._conns_lock:
            self._closed = True
            conns = list(self._conns.values())
            self._conns.clear()
        for conn in conns:
            with conn.lock:
                conn.drop()

    def stats(self) -> dict:
        """requests, samples_received, samples_missing, bytes_received (headers included), errors."""
        return self._stats.snapshot()

    def _connection(self, address: tuple[str, int]) -> _Connection:
        with self._conns_lock:
            if self._closed:
                raise PeerError(f"peer {address[0]}:{address[1]}: client is closed")
            return self._conns.setdefault(address, _Connection())

    def _round_trip(self, conn: _Connection, address, request: bytes, count: int, wait_s: float):
        """Sends one request and reads its response under conn.lock; returns (body, bytes read)."""
        where = f"peer {address[0]}:{address[1]}"
        if conn.sock is None:
            sock = socket.create_connection(address, timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sock = sock
        deadline = time.monotonic() + self.timeout_s + wait_s
        conn.sock.settimeout(self.timeout_s)
        conn.sock.sendall(request)
        header = _recv_exact(conn.sock, RESPONSE_HEADER.size, deadline)
        if header is None:
            raise PeerError(f"{where}: connection closed by the peer")
        magic, n, row_nbytes, body_nbytes = RESPONSE_HEADER.unpack(header)
        if magic != RESPONSE_MAGIC or n != count:
            raise PeerError(f"{where}: malformed response header {bytes(header)!r} for {count} ids")
        if row_nbytes != self.row_nbytes:
            raise PeerError(
                f"{where}: peer serves {row_nbytes}-byte rows, this client expects "
                f"{self.row_nbytes} (sample_len={self.sample_len}, dtype={self.dtype})"
            )
        if body_nbytes < count or (body_nbytes - count) % max(row_nbytes, 1) or body_nbytes > count * (1 + row_nbytes):
            raise PeerError(f"{where}: response body of {body_nbytes} bytes does not fit {count} ids")
        body = _recv_exact(conn.sock, body_nbytes, deadline)
        if body is None:
            raise PeerError(f"{where}: connection closed before the response body")
        n_found = int(np.count_nonzero(np.frombuffer(body, dtype=np.uint8, count=count)))
        if body_nbytes != count + n_found * row_nbytes:
            raise PeerError(
                f"{where}: response has {body_nbytes} bytes, {n_found} found rows need {count + n_found * row_nbytes}"
            )
        return body, len(header) + body_nbytes


def all_gather_via_files(
    directory, process_index: int, process_count: int, payload: dict, key: str, timeout_s: float = 60.0
) -> list[dict]:
    """Every process contributes `payload`; returns all payloads ordered by process index.

    A rendezvous over a shared directory for processes without jax.distributed
    (tests, benchmarks). Each writes `directory/round-KEY/peer-{i}.json` atomically
    (temp file + os.replace, so a reader never sees half a file) and polls until
    all exist. `key` names this rendezvous (a run id plus a generation) and its
    folder, so successive rounds never overwrite a file a slower process has yet
    to read, and files of an earlier run are never mistaken for a live peer.
    Files are left in place, since this process cannot know when the others have
    read its own; a process that times out withdraws its file, so a retry with
    the same key does not meet it. Payloads must be JSON-serialisable
    and come back as JSON (tuples become lists), the same in every process.
    """
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    directory = Path(directory) / f"round-{urllib.parse.quote(key, safe='')}"  # any key, one plain folder name
    directory.mkdir(parents=True, exist_ok=True)
    record = {"key": key, "process_index": process_index, "process_count": process_count, "payload": payload}
    text = json.dumps(record)
    mine = directory / f"peer-{process_index}.json"
    write_atomic(mine, text)

    deadline = time.monotonic() + timeout_s
    payloads: dict[int, dict] = {}
    while True:
        for i in range(process_count):
            if i not in payloads:
                record = _read_record(directory / f"peer-{i}.json", key)
                if record is not None:
                    if record["process_count"] != process_count:
                        raise PeerError(
                            f"{directory}/peer-{i}.json (key {key!r}) says process_count="
                            f"{record['process_count']}, this process says {process_count}"
                        )
                    payloads[i] = record["payload"]
        if len(payloads) == process_count:
            return [payloads[i] for i in range(process_count)]
        if time.monotonic() >= deadline:
            mine.unlink(missing_ok=True)
            missing = [i for i in range(process_count) if i not in payloads]
            raise PeerError(
                f"all_gather_via_files({directory}, key={key!r}): timed out after {timeout_s}s "
                f"waiting for process indices {missing}"
            )
        time.sleep(0.01)


def _read_record(path: Path, key: str) -> dict | None:
    """The record at path if it belongs to this rendezvous, else None (absent, stale, or unreadable)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("key") != key:
        return None
    return record
