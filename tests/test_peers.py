"""Tests for data/peers.py: peer-to-peer sample transfer and the file rendezvous."""

import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from data.peers import PeerClient, PeerError, PeerServer, all_gather_via_files

REPO = Path(__file__).resolve().parents[1]
SAMPLE_LEN = 16
DTYPE = np.int32


def random_rows(ids, seed=0):
    rng = np.random.default_rng(seed)
    return {i: rng.integers(-(2**31), 2**31 - 1, SAMPLE_LEN, dtype=DTYPE) for i in ids}


def dict_lookup(rows):
    return lambda sample_id, timeout_s: rows.get(sample_id)


@pytest.fixture
def client():
    with PeerClient(sample_len=SAMPLE_LEN, dtype=DTYPE, timeout_s=1.0) as c:
        yield c


def serve(lookup, **kw):
    return PeerServer(lookup, sample_len=kw.pop("sample_len", SAMPLE_LEN), dtype=kw.pop("dtype", DTYPE), **kw).start()


def expected(rows, ids):
    found = np.array([i in rows for i in ids], dtype=bool)
    out = np.zeros((len(ids), SAMPLE_LEN), DTYPE)
    for k, i in enumerate(ids):
        if i in rows:
            out[k] = rows[i]
    return out, found


# --- round trip -----------------------------------------------------------------------------


def test_round_trip_and_stats(client):
    rows = random_rows(range(0, 20, 2))
    with serve(dict_lookup(rows)) as server:
        requests = [[0, 1, 2, 2, 99, 18, 0], [], [5], list(range(20))]
        for ids in requests:
            got, found = client.fetch(server.address, ids)
            want, want_found = expected(rows, ids)
            assert got.shape == (len(ids), SAMPLE_LEN) and got.dtype == DTYPE and found.dtype == bool
            np.testing.assert_array_equal(found, want_found)
            np.testing.assert_array_equal(got, want)
        got, found = client.fetch(list(server.address), np.array([4], np.uint32))  # JSON-style address
        np.testing.assert_array_equal(got[0], rows[4])

        held = sum(i in rows for ids in requests for i in ids) + 1
        total = sum(len(ids) for ids in requests) + 1
        cs, ss = client.stats(), server.stats()
        # The empty request is answered locally, without a round trip.
        assert cs == {
            "requests": 4,
            "samples_received": held,
            "samples_missing": total - held,
            "bytes_received": cs["bytes_received"],
            "errors": 0,
        }
        assert ss["requests"] == 4 and ss["samples_served"] == held and ss["samples_missing"] == total - held
        assert ss["bytes_sent"] == cs["bytes_received"] == 4 * 20 + total + held * SAMPLE_LEN * 4
        assert ss["connections"] == 1 and ss["lookup_errors"] == 0 and ss["bad_requests"] == 0


def test_lookup_errors_count_as_missing(client):
    rows = random_rows(range(3))

    def lookup(sample_id, timeout_s):
        if sample_id == 1:
            raise KeyError(sample_id)
        if sample_id == 2:
            return rows[2][:-1]  # wrong shape: must not be served
        if sample_id == 3:
            return rows[0].astype(np.int64)  # wrong dtype
        return rows[sample_id]

    with serve(lookup) as server:
        got, found = client.fetch(server.address, [0, 1, 2, 3, 0])
        assert found.tolist() == [True, False, False, False, True]
        np.testing.assert_array_equal(got[[0, 4]], [rows[0], rows[0]])
        assert not got[1:4].any()
        assert server.stats()["lookup_errors"] == 3 and server.stats()["samples_missing"] == 3


def test_bad_arguments(client):
    with serve(dict_lookup({})) as server:
        with pytest.raises(ValueError, match="integers"):
            client.fetch(server.address, [1.5])
        with pytest.raises(ValueError, match="wait_s"):
            client.fetch(server.address, [1], wait_s=-1.0)


# --- waiting for a sample a peer is about to insert -----------------------------------------


def test_wait_s_sees_a_late_insert_and_times_out_quickly(client):
    rows = random_rows([7])
    inserted = threading.Event()
    timeouts = []

    def lookup(sample_id, timeout_s):
        timeouts.append(timeout_s)
        return rows[7] if sample_id == 7 and inserted.wait(timeout_s) else None

    with serve(lookup) as server:
        threading.Timer(0.05, inserted.set).start()
        t0 = time.monotonic()
        got, found = client.fetch(server.address, [7], wait_s=1.0)
        assert found.tolist() == [True] and time.monotonic() - t0 < 0.9
        np.testing.assert_array_equal(got[0], rows[7])
        assert 0.9 < timeouts[0] <= 1.0

        # Never inserted: not found once the wait runs out, and wait_s bounds the whole request.
        t0 = time.monotonic()
        got, found = client.fetch(server.address, [8, 9, 10], wait_s=0.1)
        assert found.tolist() == [False] * 3 and not got.any()
        assert time.monotonic() - t0 < 0.5


# --- concurrency ----------------------------------------------------------------------------


def test_many_threads_one_client_two_servers(client):
    held = [random_rows(range(0, 100), seed=1), random_rows(range(50, 150), seed=2)]
    servers = [serve(dict_lookup(rows)) for rows in held]

    def worker(seed):
        rng = np.random.default_rng(seed)
        for _ in range(25):
            s = int(rng.integers(2))
            ids = rng.integers(0, 160, int(rng.integers(1, 12))).tolist()
            got, found = client.fetch(servers[s].address, ids)
            want, want_found = expected(held[s], ids)
            np.testing.assert_array_equal(found, want_found)
            np.testing.assert_array_equal(got, want)

    try:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(worker, range(8)))  # re-raises a worker's assertion
        assert client.stats()["requests"] == 8 * 25 and client.stats()["errors"] == 0
        assert sum(s.stats()["connections"] for s in servers) == 2  # persistent, one per peer
    finally:
        for s in servers:
            s.close()


# --- failures -------------------------------------------------------------------------------


def test_closed_and_unreachable_servers_raise_peer_error(client):
    rows = random_rows([1])
    server = serve(dict_lookup(rows))
    host, port = server.address
    client.fetch(server.address, [1])  # a live persistent connection...
    server.close()
    server.close()  # idempotent
    t0 = time.monotonic()
    with pytest.raises(PeerError, match=f"{host}:{port}"):
        client.fetch(server.address, [1])  # ...whose peer went away
    with pytest.raises(PeerError, match=f"{host}:{port}"):
        client.fetch(server.address, [1])  # and nothing listens there any more
    assert time.monotonic() - t0 < 1.0 and client.stats()["errors"] == 2


def test_silent_peer_times_out(client):
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never answers
        address = silent.getsockname()[:2]
        t0 = time.monotonic()
        with pytest.raises(PeerError, match=f"{address[0]}:{address[1]}.*timed out"):
            client.fetch(address, [1])
        assert 0.9 < time.monotonic() - t0 < 3.0


def test_mismatched_sample_len_is_peer_error(client):
    with serve(dict_lookup({}), sample_len=SAMPLE_LEN * 2) as server:
        with pytest.raises(PeerError, match="128-byte rows, this client expects 64"):
            client.fetch(server.address, [1])


def fake_peer(response: bytes):
    """A one-shot peer that reads one request and answers `response`, then closes."""
    listener = socket.create_server(("127.0.0.1", 0))

    def run():
        conn, _ = listener.accept()
        with conn:
            conn.recv(1 << 16)
            conn.sendall(response)
        listener.close()

    threading.Thread(target=run, daemon=True).start()
    return listener.getsockname()[:2]


@pytest.mark.parametrize(
    "response, message",
    [
        (
            b"JLR1"
            + np.array([2, 64], "<u4").tobytes()
            + np.array([2 + 64], "<u8").tobytes()
            + b"\x01\x00"
            + b"x" * 10,
            "connection closed",
        ),  # body shorter than announced
        (
            b"JLR1"
            + np.array([2, 64], "<u4").tobytes()
            + np.array([2 + 64], "<u8").tobytes()
            + b"\x01\x01"
            + b"x" * 64,
            "2 found rows need 130",
        ),  # flags disagree with the length
        (b"JLR1" + np.array([2, 64], "<u4").tobytes() + np.array([10**12], "<u8").tobytes(), "does not fit"),
        (b"HTTP/1.1 400 Bad Request\r\n\r\n", "malformed response header"),
    ],
)
def test_wrong_length_response_is_peer_error(client, response, message):
    address = fake_peer(response)
    with pytest.raises(PeerError, match=message):
        client.fetch(address, [1, 2])


def closed_by_peer(sock):
    """True once the peer closed: EOF, or a reset when it closed with our unread bytes still queued."""
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def test_server_survives_garbage(client):
    rows = random_rows(range(4))
    with serve(dict_lookup(rows)) as server:
        for garbage in [
            b"GET / HTTP/1.1\r\n\r\n",
            b"JLP1" + np.array([2**31], "<u4").tobytes() + b"\0" * 4,
            b"JLP1" + np.array([1], "<u4").tobytes() + np.array([-1.0], "<f4").tobytes(),
        ]:
            with socket.create_connection(server.address, timeout=1.0) as raw:
                raw.sendall(garbage)
                assert closed_by_peer(raw)  # the server closed this connection only
        with socket.create_connection(server.address, timeout=1.0) as raw:
            raw.sendall(b"JLP1\x01\x00")  # half a header, then hang up
        got, found = client.fetch(server.address, [3, 5])
        assert found.tolist() == [True, False]
        np.testing.assert_array_equal(got[0], rows[3])
        assert server.stats()["bad_requests"] == 3 and server.stats()["requests"] == 1


# --- rendezvous over files ------------------------------------------------------------------


def gather_in_threads(directory, count, key, timeout_s=5.0):
    results = [None] * count

    def run(i):
        results[i] = all_gather_via_files(
            directory, i, count, {"rank": i, "address": ("h", 1000 + i)}, key, timeout_s=timeout_s
        )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_all_gather_via_files(tmp_path):
    results = gather_in_threads(tmp_path / "rdv", 3, "run-a/0")
    want = [{"rank": i, "address": ["h", 1000 + i]} for i in range(3)]
    assert results == [want] * 3
    assert not list((tmp_path / "rdv").rglob("*.tmp"))  # no temp file left, in any round folder


def test_all_gather_missing_participant_times_out(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(PeerError, match=r"process indices \[1, 2\]"):
        all_gather_via_files(tmp_path, 0, 3, {}, "k", timeout_s=0.5)
    assert time.monotonic() - t0 < 1.5


def test_all_gather_ignores_stale_files(tmp_path):
    gather_in_threads(tmp_path, 2, "run-old")  # leaves peer-0.json and peer-1.json behind
    with pytest.raises(PeerError, match=r"process indices \[1\]"):
        all_gather_via_files(tmp_path, 0, 2, {"rank": 0}, "run-new", timeout_s=0.3)
    results = gather_in_threads(tmp_path, 2, "run-new")
    assert results[0] == results[1] == [{"rank": 0, "address": ["h", 1000]}, {"rank": 1, "address": ["h", 1001]}]


# --- real processes -------------------------------------------------------------------------

CHILD = """
import sys
import numpy as np
from data.peers import PeerClient, PeerServer, all_gather_via_files

directory, index, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def rows_of(i):  # process i holds ids i*100 .. i*100+9; every process can compute what the others hold
    rng = np.random.default_rng(i)
    return {i * 100 + j: rng.standard_normal(32).astype(np.float32) for j in range(10)}

mine = rows_of(index)
with PeerServer(lambda sid, timeout_s: mine.get(sid), sample_len=32, dtype=np.float32).start() as server, \\
        PeerClient(sample_len=32, dtype=np.float32, timeout_s=2.0) as client:
    addresses = all_gather_via_files(directory, index, count, {"address": server.address}, "addr", timeout_s=8)
    for peer in range(count):
        theirs = rows_of(peer)
        ids = sorted(theirs) + [999]
        got, found = client.fetch(addresses[peer]["address"], ids)
        assert found.tolist() == [True] * 10 + [False], found
        np.testing.assert_array_equal(got[:10], np.stack([theirs[i] for i in sorted(theirs)]))
    # Keep serving until every process has fetched from us.
    all_gather_via_files(directory, index, count, {"done": True}, "done", timeout_s=8)
    served = server.stats()["samples_served"]
assert served == 10 * count, served
print("ok", index)
"""


def test_real_processes_exchange_rows(tmp_path):
    count = 3
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tmp_path), str(i), str(count)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(count)
    ]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=20)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and out.strip() == f"ok {i}", out
