"""The exchange protocol replica processes sync through (`jaxlm.diloco.exchange`), with threads standing in for
processes: every participant gets the same decision, a missing replica is left out after the timeout (at once when
its heartbeat stopped, but not while it beats), a late one learns it was left out, a decided sync replays unchanged,
and an announced replica is waited for."""

import threading
import time

import numpy as np
import pytest

from jaxlm.diloco.exchange import ExchangeError, ReplicaExchange


def post_all(root, replicas, indices, step=10, timeout_s=30.0):
    """Runs allreduce for `indices` concurrently; returns {index: SyncResult}."""
    results = {}

    def one(i):
        results[i] = ReplicaExchange(root, replicas, i, timeout_s).allreduce(step, 0, {"x": np.full(3, i, np.float32)})

    threads = [threading.Thread(target=one, args=(i,)) for i in indices]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_every_replica_gets_the_same_members_and_payloads(tmp_path):
    results = post_all(tmp_path, 3, [0, 1, 2])
    for r in results.values():
        assert r.members == (0, 1, 2)
        assert [float(r.payloads[m]["x"][0]) for m in r.members] == [0.0, 1.0, 2.0]
    assert not list(tmp_path.rglob("*.tmp"))  # every file was renamed into place


def test_a_missing_replica_is_left_out_after_the_timeout_and_learns_it_when_it_comes(tmp_path):
    t0 = time.monotonic()
    results = post_all(tmp_path, 3, [0, 2], timeout_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 20
    assert results[0].members == results[2].members == (0, 2)
    assert results[0].left_out == results[2].left_out == {1: "did not post within 0.3s"}
    late = ReplicaExchange(tmp_path, 3, 1, 30.0).allreduce(10, 0, {"x": np.ones(3, np.float32)})
    assert late.members == (0, 2) and sorted(late.payloads) == [0, 2]


def test_a_replica_whose_heartbeat_stopped_is_not_waited_for_and_one_that_beats_is(tmp_path):
    beating = ReplicaExchange(tmp_path, 3, 1, 60.0, heartbeat_s=1.0).beat()  # replica 1 lives
    ReplicaExchange(tmp_path, 3, 2, 60.0, heartbeat_s=1.0).beat().stop()  # replica 2 beat once, then died
    results = {}

    def sync(i, step):
        results[i, step] = ReplicaExchange(tmp_path, 3, i, 60.0, heartbeat_s=1.0).allreduce(
            step, 0, {"x": np.full(3, i, np.float32)}
        )

    waiting = threading.Thread(target=sync, args=(0, 2))
    t0 = time.monotonic()
    waiting.start()
    time.sleep(3.0)  # twelve of replica 1's heartbeat periods, three heartbeat_s: still waited for
    assert waiting.is_alive()
    sync(1, 2)
    waiting.join(timeout=30)
    assert time.monotonic() - t0 < 30  # far from the 60 s timeout: replica 2 was not waited for
    assert results[0, 2].members == results[1, 2].members == (0, 1)
    assert set(results[0, 2].left_out) == {2} and results[0, 2].left_out[2].startswith("no heartbeat for ")
    beating.stop()  # replica 1 dies too: the next sync waits for it only heartbeat_s
    time.sleep(0.5)
    t0 = time.monotonic()
    sync(0, 4)
    assert results[0, 4].members == (0,) and set(results[0, 4].left_out) == {1} and time.monotonic() - t0 < 30


def test_a_decided_sync_replays_the_recorded_payloads(tmp_path):
    post_all(tmp_path, 2, [0, 1])
    again = ReplicaExchange(tmp_path, 2, 1, 30.0).allreduce(10, 0, {"x": np.full(3, 99, np.float32)})
    assert again.members == (0, 1) and again.waited_s < 5
    assert float(again.payloads[1]["x"][0]) == 1.0  # what the others averaged, not the new payload


def test_the_next_sync_waits_only_for_the_last_members_and_announced_replicas(tmp_path):
    post_all(tmp_path, 2, [0], step=2, timeout_s=0.2)  # replica 1 never came: sync 2 is [0]
    t0 = time.monotonic()
    alone = post_all(tmp_path, 2, [0], step=4, timeout_s=30.0)  # replica 1 is not expected: no wait
    assert alone[0].members == (0,) and time.monotonic() - t0 < 10
    ReplicaExchange(tmp_path, 2, 1, 30.0).announce(6, 0)  # it comes back: the others wait for it at sync 6
    results = {}
    waiting = threading.Thread(
        target=lambda: results.update(
            {0: ReplicaExchange(tmp_path, 2, 0, 30.0).allreduce(6, 0, {"x": np.zeros(3, np.float32)})}
        )
    )
    waiting.start()
    time.sleep(0.5)
    assert waiting.is_alive()
    back = ReplicaExchange(tmp_path, 2, 1, 30.0).allreduce(6, 0, {"x": np.ones(3, np.float32)})
    waiting.join(timeout=30)
    assert back.members == results[0].members == (0, 1) and results[0].waited_s >= 0.4


def test_snapshots_and_tidying(tmp_path):
    ex = ReplicaExchange(tmp_path, 1, 0, 1.0)
    for step in (2, 4, 6):
        ex.allreduce(step, 0, {"x": np.zeros(1, np.float32)})
        ex.publish(step, {"w": np.full(2, step, np.float32)})
    ex.allreduce(8, 0, {"x": np.zeros(1, np.float32)})
    step, arrays = ex.latest_snapshot()
    assert step == 6 and arrays["w"].tolist() == [6.0, 6.0]
    ex.tidy(8, keep_steps=3)
    assert ex.snapshots() == [4, 6] and ex.syncs() == [(6, 0), (8, 0)]
    ex.tidy(8, keep_steps=None, keep_snapshots=1)
    assert ex.snapshots() == [6] and ex.syncs() == [(6, 0), (8, 0)]


def test_bad_replica_index_or_directory_is_refused(tmp_path):
    with pytest.raises(ExchangeError, match=r"replica index 2 is not in \[0, 2\)"):
        ReplicaExchange(tmp_path, 2, 2, 1.0)
    (tmp_path / "file").write_text("")
    with pytest.raises(ExchangeError, match="cannot create the exchange directory"):
        ReplicaExchange(tmp_path / "file" / "ex", 2, 0, 1.0)
