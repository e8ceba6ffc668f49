"""The clairvoyant loader: prefetches exactly what the seed says comes next, from the fastest place that has it.

Threads around one bounded window of upcoming positions:

- a planner plans the next chunk of the stream (placement: `cache_plan`) while
  this one is read, and the timing model (`perf_model`) routes each position:
  the plan's place, or the source where that is measured much faster;
- fetch workers (W of them, round-robin over a chunk's remote positions) read
  what comes from a peer process's cache or the (slow) source; a peer that
  cannot deliver falls back to the source, so a batch is never wrong, only
  slower;
- the assembler takes positions strictly in stream order: it reads local hits
  from this process's RAM and disk tiers itself (every earlier store is applied
  by then, so no waiting and no hand-off), takes the rest from the workers,
  applies the plan's drops, demotions and stores (so the cache always matches
  the plan at that point of the stream), builds the batch, optionally puts it
  on devices, and queues it;
- the training thread takes batches; the time it waits is the stall time.

The loader's checkpoint state is the step number (plus what identifies the
stream), so resuming is O(1) and yields exactly the batches an uninterrupted run
would have seen, for any number of workers. Caches are rebuilt after a resume.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from typing import Callable

import numpy as np

from data.access_plan import AccessPlan, checked_rows, process_rows, resume_step, stream_state
from data.cache_plan import DEMOTE, DISK, PEER, RAM, SOURCE, TIER_NAMES, PlacementPlanner, ProcessPlan
from data.iterator import Batch, batch_from_windows
from data.perf_model import TierModel
from data.tiers import TieredCache

Exchange = Callable[[dict], list]  # all-gather of one JSON-able dict per process, in process order


class LoaderError(RuntimeError):
    """The loader could not produce the next batch (the cause is chained)."""


class ClairvoyantLoader:
    """Globally shuffled batches of `source` samples (windows of seq_len + 1 tokens); `batch_size` is global.

    ram_bytes / disk_bytes: this process's tier capacities (0 disables a tier).
    exchange: an all-gather across the loader's processes (`file_exchange`,
    `jax_exchange`); with it, processes share one de-duplicated placement and
    serve each other's misses over TCP. Without it each process caches alone.
    model: the per-tier timing model that routes reads and predicts whether the loader keeps up (learned as it
    runs; pass one to seed or inspect it).
    plan: which sample every (step, row) reads (default: an AccessPlan over `source`; data.mixture.MixturePlan
    over a data.mixture.ConcatSource for a mixture).
    """

    def __init__(
        self,
        source,
        *,
        batch_size: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
        ram_bytes: int = 256 << 20,
        disk_bytes: int = 0,
        disk_dir: str | None = None,
        workers: int = 16,
        prefetch_steps: int = 4,
        plan_chunk_steps: int | None = None,
        eos_id: int | None = None,
        exchange: Exchange | None = None,
        peer_host: str = "127.0.0.1",
        peer_wait_s: float = 0.5,
        model: TierModel | None = None,
        plan=None,
    ):
        for name, value, low in (
            ("workers", workers, 1),
            ("prefetch_steps", prefetch_steps, 1),
            ("ram_bytes", ram_bytes, 0),
            ("disk_bytes", disk_bytes, 0),
        ):
            if value < low:
                raise ValueError(f"ClairvoyantLoader: {name} must be >= {low}, got {value}")
        self._threads: list[threading.Thread] = []
        self.source, self.eos_id = source, eos_id
        self.plan = plan or AccessPlan(source.num_samples, batch_size, seed)
        if (self.plan.num_samples, self.plan.global_batch) != (source.num_samples, batch_size):
            raise ValueError(
                f"the plan is for {self.plan.num_samples} samples in batches of {self.plan.global_batch}, the source "
                f"holds {source.num_samples} and batches are {batch_size}"
            )
        self.batch_size, self.seed = batch_size, seed
        self.process_index, self.process_count = process_index, process_count
        self.set_rows(*process_rows(batch_size, process_index, process_count))
        self.capacity = (ram_bytes // source.sample_nbytes, disk_bytes // source.sample_nbytes)
        self.disk_dir, self.workers, self.prefetch_steps = disk_dir, workers, prefetch_steps
        # chunks of at most ~32k samples: a short run does not plan a whole large epoch before its first batch
        self.plan_chunk_steps = plan_chunk_steps or max(1, min(self.plan.steps_per_epoch, 32768 // batch_size))
        self.exchange, self.peer_host, self.peer_wait_s = exchange, peer_host, peer_wait_s
        self.batches_per_epoch = self.plan.steps_per_epoch
        self.step = 0
        self._to_device = None
        self.model = model or TierModel()
        self._last_return: float | None = None
        self._upcoming_mix: dict[int, float] = {}  # samples per batch from each tier in the plan chunk being read
        self._counts = {k: 0 for k in ("ram", "disk", "peer", "source", "fallback", "rerouted", "batches")}
        self._bytes = {k: 0 for k in ("local", "peer", "source")}
        self._stall_s = 0.0
        self._planned = {k: 0 for k in TIER_NAMES.values()}
        self._count_lock = threading.Lock()

    # ------------------------------------------------------------------ the iterator interface

    def set_rows(self, start: int, stop: int) -> None:
        """Read rows [start, stop) of each global batch from now on (a multi-process trainer's share)."""
        start, stop = checked_rows(start, stop, self.batch_size)
        self._stop_pipeline()
        self.rows = (start, stop)
        self.local_batch_size = stop - start

    def set_device_put(self, to_device: Callable[[Batch], Batch] | None) -> None:
        """Put batches on devices in the assembler thread, so the host-to-device copy overlaps training."""
        self._stop_pipeline()
        self._to_device = to_device

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if not self._threads:
            self._start()
        t0 = time.perf_counter()
        if self._last_return is not None:
            self.model.observe_step(t0 - self._last_return)
        item = self._ready.get()
        self._last_return = time.perf_counter()
        self._stall_s += self._last_return - t0
        if isinstance(item, BaseException):
            self._stop_pipeline()
            raise LoaderError(f"data loader failed at step {self.step}: {item}") from item
        batch, counts = item
        counts[("_counts", "batches")] = 1
        self._add_counts(counts)
        self.step += 1
        return batch

    def get_state(self) -> dict[str, int]:
        return stream_state(self.plan, self.step)

    def set_state(self, state: dict[str, int]) -> None:
        step = resume_step(self.plan, state)
        self._stop_pipeline()
        self.step, self.plan = step, self.plan.resumed(state)

    def metrics(self) -> dict[str, float]:
        """Cumulative counters since construction: samples per tier, bytes, stall time, hit rates."""
        with self._count_lock:
            c, b = dict(self._counts), dict(self._bytes)
        served = c["ram"] + c["disk"] + c["peer"] + c["source"]
        planned = sum(self._planned.values())
        return {
            "data_batches": c["batches"],
            "data_stall_s": self._stall_s,
            **{f"data_samples_{k}": c[k] for k in ("ram", "disk", "peer", "source", "fallback", "rerouted")},
            **{f"data_bytes_{k}": b[k] for k in ("local", "peer", "source")},
            "data_hit_rate": (served - c["source"]) / served if served else 0.0,
            "data_planned_hit_rate": (planned - self._planned["source"]) / planned if planned else 0.0,
            **self.model.metrics(self._upcoming_mix, self.workers),
        }

    def close(self) -> None:
        self._stop_pipeline()

    def __del__(self):
        try:
            self._stop_pipeline()
        except Exception:
            pass

    # ------------------------------------------------------------------ the pipeline

    def _start(self) -> None:
        lo, hi = self.rows
        self._cache = TieredCache(*self.capacity, (self.source.sample_len,), self.source.dtype, self.disk_dir)
        self._server = self._client = None
        self._peer_addresses: list = []
        all_rows, capacities, me = [self.rows], [self.capacity], 0
        if self.exchange is not None:
            from data.peers import PeerClient, PeerServer

            self._server = PeerServer(
                self._serve, host=self.peer_host, sample_len=self.source.sample_len, dtype=self.source.dtype
            ).start()
            infos = self.exchange(
                {
                    "rows": [lo, hi],
                    "capacity": list(self.capacity),
                    "step": self.step,
                    "address": list(self._server.address),
                    "fingerprint": self.plan.fingerprint(),
                }
            )
            for p, info in enumerate(infos):
                if info["fingerprint"] != self.plan.fingerprint() or info["step"] != self.step:
                    raise LoaderError(
                        f"loader process {p} reads stream {info['fingerprint']} from step "
                        f"{info['step']}, but process {self.process_index} reads "
                        f"{self.plan.fingerprint()} from step {self.step}: they must agree"
                    )
            all_rows = [tuple(i["rows"]) for i in infos]
            capacities = [tuple(i["capacity"]) for i in infos]
            self._peer_addresses = [tuple(i["address"]) for i in infos]
            me = self.process_index
            self._client = PeerClient(sample_len=self.source.sample_len, dtype=self.source.dtype)
        self._me = me
        self._planner = PlacementPlanner(self.plan, all_rows, capacities)
        self._chunks: dict[int, tuple[ProcessPlan, np.ndarray, np.ndarray]] = {}
        self._next_chunk = 0
        self._plan_lock = threading.Lock()
        self._start_step = self.step
        self._per_chunk = self.local_batch_size * self.plan_chunk_steps  # positions per plan chunk
        self._fetched: dict[int, object] = {}
        self._consumed = 0  # local positions (from _start_step) the assembler has taken
        self._awaited = -1  # the position the assembler sleeps on, if any
        lock = threading.Lock()  # one lock, two queues of waiters: the assembler, and workers waiting for room
        self._fetched_cond, self._room_cond = threading.Condition(lock), threading.Condition(lock)
        self._stopping = threading.Event()
        self._ready: queue.Queue = queue.Queue(maxsize=self.prefetch_steps)
        self._threads = [
            threading.Thread(target=self._fetch_loop, args=(w,), daemon=True, name=f"jaxlm-fetch-{w}")
            for w in range(self.workers)
        ]
        self._threads.append(threading.Thread(target=self._assemble_loop, daemon=True, name="jaxlm-assemble"))
        self._threads.append(threading.Thread(target=self._plan_ahead_loop, daemon=True, name="jaxlm-plan"))
        for t in self._threads:
            t.start()

    def _stop_pipeline(self) -> None:
        if not self._threads:
            return
        self._stopping.set()
        with self._room_cond:
            self._room_cond.notify_all()
            self._fetched_cond.notify_all()
        while True:  # unblock an assembler waiting on a full queue
            try:
                self._ready.get_nowait()
            except queue.Empty:
                break
        for t in self._threads:
            t.join()
        self._threads = []
        for closable in (self._server, self._client, self._cache):
            if closable is not None:
                closable.close()

    def _chunk(self, chunk: int) -> tuple[ProcessPlan, np.ndarray, np.ndarray]:
        """Plan chunk `chunk` (planning chunks in order up to it), where each position is read from (the plan's
        place, or the source where the model measures it faster), and the remote positions: those read from a
        peer or the source, which the fetch workers handle; the assembler reads this process's tiers itself."""
        with self._plan_lock:
            while self._next_chunk <= chunk:
                first = self._start_step + self._next_chunk * self.plan_chunk_steps
                plan = self._planner.plan_chunk(first, first + self.plan_chunk_steps)[self._me]
                routed = self.model.route(plan.fetch_from)
                remote = np.flatnonzero((routed == SOURCE) | (routed == PEER))
                self._chunks[self._next_chunk] = (plan, routed, remote)
                self._next_chunk += 1
            return self._chunks[chunk]

    def _plan_ahead_loop(self) -> None:
        """Plans chunk c + 1 while chunk c is being read, so an epoch boundary does not wait for the planner."""
        try:
            while not self._stopping.is_set():
                with self._room_cond:
                    while (self._next_chunk > self._consumed // self._per_chunk + 1) and not self._stopping.is_set():
                        self._room_cond.wait()
                if self._stopping.is_set():
                    return
                self._chunk(self._consumed // self._per_chunk + 1)
        except Exception:  # noqa: BLE001 - the fetch workers plan on demand and report the error
            return

    def _fetch_loop(self, worker: int) -> None:
        """Worker w reads the w-th, (w+W)-th, ... remote position of each chunk, at most `prefetch_steps`
        batches ahead of the assembler."""
        window = self.prefetch_steps * self.local_batch_size
        chunk, pos, reads = 0, None, 0
        try:
            while not self._stopping.is_set():
                plan, routed, remote = self._chunk(chunk)
                base = chunk * self._per_chunk
                for i in remote[worker :: self.workers].tolist():
                    pos = base + i
                    if pos >= self._consumed + window:
                        with self._room_cond:
                            while pos >= self._consumed + window and not self._stopping.is_set():
                                self._room_cond.wait()
                    if self._stopping.is_set():
                        return
                    reads += 1
                    timed = reads % 8 == 0  # CPU time of every 8th read: the thread clock is a syscall
                    cpu0 = time.thread_time() if timed else 0.0
                    try:
                        row = self._fetch_remote(int(plan.samples[i]), int(routed[i]), int(plan.peer[i]))
                    except Exception as e:  # noqa: BLE001 - handed to the training thread
                        row = e
                    self._hand_over(pos, row)
                    if timed:
                        self.model.observe_worker_cpu(time.thread_time() - cpu0)
                chunk += 1
        except Exception as e:  # noqa: BLE001 - e.g. the planner failed: the assembler raises it
            self._hand_over(self._consumed if pos is None else pos, e)

    def _hand_over(self, pos: int, row) -> None:
        self._fetched[pos] = row
        if self._awaited == pos:  # set under the lock before the assembler's last look, so this cannot miss it
            with self._fetched_cond:
                self._fetched_cond.notify()

    def _fetch_remote(self, sample: int, where: int, peer: int) -> tuple[np.ndarray, str, bool]:
        """(row, where it came from, whether a peer failed and the source stood in); times each request.

        A peer is first asked for what it holds now (that round trip is the peer's speed), then, if the sample
        has not arrived there yet, asked again to wait for it: processes drift a few steps apart, and that wait
        is the drift, not the link. A peer that fails or never delivers is timed in full: a slow peer."""
        t0 = time.perf_counter()
        if where == PEER:
            from data.peers import PeerError

            address = self._peer_addresses[peer]
            try:
                rows, ok = self._client.fetch(address, [sample], wait_s=0.0)
                if ok[0]:
                    self.model.observe(PEER, time.perf_counter() - t0)
                    return rows[0], "peer", False
                rows, ok = self._client.fetch(address, [sample], wait_s=self.peer_wait_s)
                if ok[0]:
                    return rows[0], "peer", False
            except PeerError:
                pass
            self.model.observe(PEER, time.perf_counter() - t0)
            t0 = time.perf_counter()
        row = self.source.read(np.array([sample]))[0]
        self.model.observe(SOURCE, time.perf_counter() - t0)
        return row, "source", where != SOURCE

    def _take_fetched(self, pos: int):
        row = self._fetched.pop(pos, None)
        if row is None:
            with self._fetched_cond:
                self._awaited = pos
                while pos not in self._fetched and not self._stopping.is_set():
                    self._fetched_cond.wait()
                self._awaited = -1
                if self._stopping.is_set():
                    return None
            row = self._fetched.pop(pos)
        if isinstance(row, BaseException):
            raise row
        return row

    def _add_counts(self, counts: dict) -> None:
        """Adds a delivered batch's counts (batches still in the prefetch queue do not count yet)."""
        with self._count_lock:
            for (group, name), value in counts.items():
                getattr(self, group)[name] += value

    def _serve(self, sample: int, timeout_s: float):
        """Peer lookups: wait for a sample about to arrive, never for one this process already dropped."""
        found = self._cache.wait_get(sample, timeout_s, give_up_if_dropped=True)
        return None if found is None else found[0]

    def _assemble_loop(self) -> None:
        """Takes positions in stream order: local hits from the tiers (every earlier store is applied, so the
        plan's local hits are there), the rest from the workers; then applies the position's cache ops."""
        b, cache, nbytes = self.local_batch_size, self._cache, self.source.sample_nbytes
        pos = 0
        try:
            while not self._stopping.is_set():
                chunk, i0 = divmod(pos, self._per_chunk)
                plan, routed, _ = self._chunk(chunk)
                if i0 == 0:
                    with self._plan_lock:
                        self._chunks.pop(chunk - 1, None)
                    per_batch = np.bincount(routed, minlength=len(TIER_NAMES)) / self.plan_chunk_steps
                    self._upcoming_mix = {t: float(per_batch[t]) for t in TIER_NAMES}
                batch_start = time.perf_counter()
                waited = 0.0  # for remote rows: the workers' time, not the assembler's
                samples, fetch_from = plan.samples[i0 : i0 + b].tolist(), routed[i0 : i0 + b].tolist()
                stores, ops = plan.store[i0 : i0 + b].tolist(), plan.ops
                rows = np.empty((b, self.source.sample_len), self.source.dtype)
                served = dict.fromkeys(("ram", "disk", "peer", "source", "fallback"), 0)
                served["rerouted"] = int(np.count_nonzero(routed[i0 : i0 + b] != plan.fetch_from[i0 : i0 + b]))
                for k in range(b):
                    sample, where = samples[k], fetch_from[k]
                    if where == RAM or where == DISK:
                        t0 = time.perf_counter()
                        found = cache.get(sample)
                        if found is None:  # its store failed (disk full or error): the source stands in
                            row, tier = self.source.read(np.array([sample]))[0], "source"
                            served["fallback"] += 1
                        else:
                            row, tier = found[0], TIER_NAMES[found[1]]
                            self.model.observe(found[1], time.perf_counter() - t0)
                    else:
                        t0 = time.perf_counter()
                        fetched = self._take_fetched(pos)
                        waited += time.perf_counter() - t0
                        if fetched is None:
                            return
                        row, tier, fell_back = fetched
                        served["fallback"] += fell_back
                    served[tier] += 1
                    for op, victim, victim_tier in ops.get(i0 + k, ()):
                        cache.demote(victim) if op == DEMOTE else cache.drop(victim, victim_tier)
                    if stores[k]:
                        cache.store(sample, row, stores[k])
                    rows[k] = row
                    pos += 1
                self.model.observe_assembler((time.perf_counter() - batch_start - waited) / b)
                with self._room_cond:
                    self._consumed = pos
                    self._room_cond.notify_all()  # room for a batch more: wake the workers once per batch
                planned = np.bincount(plan.fetch_from[i0 : i0 + b], minlength=len(TIER_NAMES))
                counts = {("_counts", k): v for k, v in served.items()}
                counts.update({("_planned", TIER_NAMES[t]): int(planned[t]) for t in TIER_NAMES})
                counts.update(
                    {
                        ("_bytes", "local"): (served["ram"] + served["disk"]) * nbytes,
                        ("_bytes", "peer"): served["peer"] * nbytes,
                        ("_bytes", "source"): served["source"] * nbytes,
                    }
                )
                batch = batch_from_windows(rows, self.eos_id)
                if self._to_device is not None:
                    batch = self._to_device(batch)
                self._put((batch, counts))
        except BaseException as e:  # noqa: BLE001 - surfaces in __next__
            self._put(e)

    def _put(self, item) -> None:
        while not self._stopping.is_set():
            try:
                self._ready.put(item, timeout=0.1)
                return
            except queue.Full:
                continue


def file_exchange(directory, process_index: int, process_count: int, key: str) -> Exchange:
    """An all-gather over a shared directory (for processes without jax.distributed: tests, benchmarks)."""
    from data.peers import all_gather_via_files

    calls = [0]

    def exchange(payload: dict) -> list:
        calls[0] += 1  # a restart (resume, new rows) is a new round
        return all_gather_via_files(directory, process_index, process_count, payload, f"{key}-{calls[0]}")

    return exchange


def jax_exchange(max_bytes: int = 4096) -> Exchange:
    """An all-gather over jax.distributed (the processes of a multi-process training run)."""

    def exchange(payload: dict) -> list:
        from jax.experimental import multihost_utils

        raw = json.dumps(payload).encode()
        if len(raw) > max_bytes:
            raise LoaderError(f"loader exchange payload is {len(raw)} bytes, more than {max_bytes}")
        buf = np.zeros(max_bytes + 4, np.uint8)
        buf[:4] = np.frombuffer(np.uint32(len(raw)).tobytes(), np.uint8)
        buf[4 : 4 + len(raw)] = np.frombuffer(raw, np.uint8)
        gathered = np.asarray(multihost_utils.process_allgather(buf))
        return [
            json.loads(bytes(g[4 : 4 + int(np.frombuffer(g[:4].tobytes(), np.uint32)[0])]).decode()) for g in gathered
        ]

    return exchange
