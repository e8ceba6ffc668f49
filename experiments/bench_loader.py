"""Data-loader benchmark: the clairvoyant loader against grain, an LRU cache and the offline optimum.

    python -m experiments.bench_loader                     # 100k samples, 3 epochs, 2 ms / 50 MB/s source
    python -m experiments.bench_loader --samples 20000 --epochs 2 --skip-train   # quicker
    python -m experiments.bench_loader --mixture 0.6,0.3,0.1 --skip-peers --skip-model --skip-train

The dataset (windows of --seq-len + 1 tokens of the default corpus) is written as shards to a temporary directory
and read through a `ThrottledSource` that adds --latency-ms per request and shares --mb-per-s between concurrent
requests: a remote filesystem. All in one run:

  hit rates    over --epochs epochs at cache capacities of 10/25/50/100% of the dataset: this loader as measured
               (samples not read from the source / all samples), LRU and Belady's offline optimum simulated on the
               same stream; "after e1" counts epochs 2+ (epoch 1 is all compulsory misses for every policy).
  epoch times  grain's DataLoader with its default prefetch (16 read threads), grain over an LRU cache of 50%,
               and this loader at 25% and 50% (RAM tier; --workers fetch threads).
  4 processes  --procs local processes sharing one de-duplicated cache over TCP (file rendezvous), 10 epochs of a
               smaller dataset, each through its own throttled source: local + peer hit rate after epoch 1 vs
               min(1, capacity / dataset).
  model        the timing model's prediction (can the tiers keep up with a training step?) against the stall it
               measured, on --model-samples samples, epoch 2 behind a simulated step of --model-step-ms: a source it
               predicts fast enough, and one too slow (5x the latency, 1/8 of the workers).
  training     tiny_lm trained through the throttled source (a subprocess): the fraction of wall time the step
               loop waited for data.
With --mixture W,W,..., the dataset is cut into that many equal sources read at those weights (data.mixture's
plan: each row's source drawn by the seed); an "epoch" is then as many samples as the dataset holds, and grain
reads the very same stream of samples (its sampler unshuffled over the plan's order), so both load the same data.
The last line is a JSON summary.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from data import TokenFile, default_corpus
from data.access_plan import AccessPlan
from data.cache_policies import belady_hits, lru_hits
from data.loader import ClairvoyantLoader, file_exchange
from data.sources import ShardedSource, ThrottledSource, TokenWindowSource, write_shards
from experiments.cli import exit_with
from jaxlm.metrics import read_metrics

CAPACITIES = (0.1, 0.25, 0.5, 1.0)


def make_dataset(directory: Path, num_samples: int, seq_len: int) -> ShardedSource:
    tokens = TokenFile.open(default_corpus()).tokens
    windows = TokenWindowSource(tokens, seq_len=seq_len)
    if windows.num_samples < num_samples:
        raise SystemExit(
            f"bench_loader: the default corpus holds {windows.num_samples} windows of seq_len={seq_len}; "
            f"lower --samples or --seq-len"
        )
    windows = TokenWindowSource(tokens, seq_len=seq_len, stop=num_samples * seq_len + 1)
    return ShardedSource.open(write_shards(directory / "shards", windows, samples_per_shard=4096))


class LRUCachedSource:
    """A source behind an LRU cache of `capacity` samples: what a cache without knowledge of the future does."""

    def __init__(self, source, capacity: int):
        self.source, self.capacity = source, capacity
        self.num_samples, self.sample_len, self.dtype = source.num_samples, source.sample_len, source.dtype
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.reads = 0

    def read(self, indices):
        (i,) = np.asarray(indices).tolist()
        with self._lock:
            self.reads += 1
            if i in self._cache:
                self.hits += 1
                self._cache.move_to_end(i)
                return self._cache[i][None]
        row = self.source.read([i])[0]
        with self._lock:
            self._cache[i] = row
            if len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return row[None]


class _GrainSource:
    """grain's RandomAccessDataSource protocol over a SampleSource: one request per record."""

    def __init__(self, source):
        self.source = source

    def __len__(self):
        return self.source.num_samples

    def __getitem__(self, i):
        return self.source.read([int(i)])[0]


class _StreamSource(_GrainSource):
    """Record k is the k-th sample of a given stream (a mixture plan's order): grain then reads what we read."""

    def __init__(self, source, stream: np.ndarray):
        self.source, self.stream = source, stream

    def __len__(self):
        return len(self.stream)

    def __getitem__(self, k):
        return self.source.read([int(self.stream[k])])[0]


def grain_epoch_times(source, batch: int, seed: int, epochs: int, stream: np.ndarray | None = None) -> list[float]:
    """grain's DataLoader over `source` (its own shuffle), or over exactly the samples of `stream`, in order."""
    import grain.python as gp

    n = source.num_samples
    data = _GrainSource(source) if stream is None else _StreamSource(source, stream)
    loader = gp.DataLoader(
        data_source=data,
        sampler=gp.IndexSampler(
            len(data),
            shuffle=stream is None,
            seed=seed,
            num_epochs=1 if stream is not None else epochs,
            shard_options=gp.NoSharding(),
        ),
        operations=[gp.Batch(batch, drop_remainder=True)],
    )
    return _epoch_times(iter(loader), n // batch, epochs)


def _epoch_times(iterator, steps_per_epoch: int, epochs: int, on_epoch_end=lambda epoch: None) -> list[float]:
    times, t0 = [], time.perf_counter()
    for e in range(epochs):
        for _ in range(steps_per_epoch):
            next(iterator)
        now = time.perf_counter()
        times.append(now - t0)
        t0 = now
        on_epoch_end(e)
    return times


def ours(source, batch: int, seed: int, epochs: int, fraction: float, workers: int, plan=None):
    """(epoch times, hit rate over all epochs, hit rate of epochs 2+) of the clairvoyant loader with a RAM tier."""
    loader = ClairvoyantLoader(
        source,
        batch_size=batch,
        seed=seed,
        workers=workers,
        prefetch_steps=8,
        ram_bytes=int(fraction * source.num_samples) * source.sample_nbytes,
        plan=plan,
    )
    after_first = []
    times = _epoch_times(
        loader, loader.batches_per_epoch, epochs, lambda e: after_first.append(loader.metrics()) if e == 0 else None
    )
    m, after_first = loader.metrics(), after_first[0]
    loader.close()
    later = sum(m[f"data_samples_{k}"] - after_first[f"data_samples_{k}"] for k in ("ram", "disk", "peer", "source"))
    later_hits = later - (m["data_samples_source"] - after_first["data_samples_source"])
    return times, m["data_hit_rate"], later_hits / max(later, 1)


def _peer_worker(directory, index, procs, samples, seq_len, fraction, epochs, latency_s, bytes_per_s, out):
    tokens = TokenFile.open(default_corpus()).tokens
    source = ThrottledSource(
        TokenWindowSource(tokens, seq_len=seq_len, stop=samples * seq_len + 1),
        latency_s=latency_s,
        bandwidth_bytes_per_s=bytes_per_s,
    )
    capacity = int(fraction * samples / procs) * source.sample_nbytes
    loader = ClairvoyantLoader(
        source,
        batch_size=16 * procs,
        seed=0,
        process_index=index,
        process_count=procs,
        ram_bytes=capacity,
        workers=8,
        exchange=file_exchange(directory, index, procs, "bench"),
    )
    for step in range(epochs * loader.batches_per_epoch):
        next(loader)
        if step == loader.batches_per_epoch - 1:
            first = loader.metrics()
        if step % 50 == 49:  # training steps keep processes in lockstep
            file_exchange(directory, index, procs, f"step{step}")({})
    m = loader.metrics()
    file_exchange(directory, index, procs, "done")({})  # serve peers until all have finished
    loader.close()
    kinds = ("ram", "disk", "peer", "source")
    later = {k: m[f"data_samples_{k}"] - first[f"data_samples_{k}"] for k in kinds}
    out.put((index, later))


def four_processes(
    procs: int, samples: int, seq_len: int, fraction: float, epochs: int, latency_s: float, bytes_per_s: float
) -> dict:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as directory:
        workers = [
            ctx.Process(
                target=_peer_worker,
                args=(directory, i, procs, samples, seq_len, fraction, epochs, latency_s, bytes_per_s, out),
            )
            for i in range(procs)
        ]
        for w in workers:
            w.start()
        results = [out.get(timeout=900) for _ in workers]
        for w in workers:
            w.join(timeout=60)
    total = collections.Counter()
    for _, later in results:
        total.update(later)
    reads = sum(total.values())
    return {
        "local": (total["ram"] + total["disk"]) / reads,
        "peer": total["peer"] / reads,
        "hit": 1 - total["source"] / reads,
    }


def model_check(
    samples: int, seq_len: int, batch: int, step_s: float, latency_s: float, bytes_per_s: float, workers: int
) -> dict:
    """Epoch 1 fills a 50% RAM cache at full speed; epoch 2 runs behind a training step of `step_s`: what the
    loader's timing model predicts (time per batch vs step time) and the stall fraction it then measured."""
    tokens = TokenFile.open(default_corpus()).tokens
    source = ThrottledSource(
        TokenWindowSource(tokens, seq_len=seq_len, stop=samples * seq_len + 1),
        latency_s=latency_s,
        bandwidth_bytes_per_s=bytes_per_s,
    )
    loader = ClairvoyantLoader(
        source,
        batch_size=batch,
        seed=0,
        workers=workers,
        prefetch_steps=8,
        ram_bytes=samples // 2 * source.sample_nbytes,
    )
    steps = loader.batches_per_epoch
    for _ in range(steps):
        next(loader)
    stall_before, t0 = loader.metrics()["data_stall_s"], time.perf_counter()
    for _ in range(steps):
        time.sleep(step_s)  # the training step
        next(loader)
    wall = time.perf_counter() - t0
    m = loader.metrics()
    loader.close()
    return {
        "batch_s": m["data_model_batch_s"],
        "step_s": m["data_model_step_s"],
        "keeps_up": bool(m["data_model_keeps_up"]),
        "stall_frac": (m["data_stall_s"] - stall_before) / wall,
        "measured_s": wall / steps,
    }


def train_stall(workdir: Path, steps: int, latency_ms: float, mb_per_s: float) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "experiments.tiny_lm",
        "--workdir",
        str(workdir),
        "--steps",
        str(steps),
        "--no-progress",
        "--checkpoint-every",
        "0",
        "--set",
        f"data.throttle_latency_ms={latency_ms}",
        "--set",
        f"data.throttle_mb_per_s={mb_per_s}",
        "--set",
        "eval_every=0",
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    records = read_metrics(workdir / "metrics.jsonl")
    train = [r for r in records if "loss" in r and "data_stall_s" in r]
    first, last = train[0], train[-1]
    wall = (last["step"] - first["step"]) * 16 * 256 / np.mean([r["tokens_per_s"] for r in train[1:]])
    return {
        "steps": last["step"],
        "stall_s": last["data_stall_s"] - first["data_stall_s"],
        "wall_s": wall,
        "hit_rate": last["data_hit_rate"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench_loader", description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=100_000)
    p.add_argument("--seq-len", type=int, default=120)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--latency-ms", type=float, default=2.0)
    p.add_argument("--mb-per-s", type=float, default=50.0)
    p.add_argument("--workers", type=int, default=32, help="this loader's fetch threads")
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--peer-samples", type=int, default=20_000)
    p.add_argument("--peer-epochs", type=int, default=10)
    p.add_argument("--model-samples", type=int, default=4096)
    p.add_argument("--model-step-ms", type=float, default=10.0)
    p.add_argument("--train-steps", type=int, default=40)
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--skip-peers", action="store_true")
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--mixture", default="", help="W,W,...: equal sources of the dataset read at these weights")
    args = p.parse_args(argv)
    summary = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        raw = make_dataset(tmp, args.samples, args.seq_len)
        source = ThrottledSource(raw, latency_s=args.latency_ms / 1e3, bandwidth_bytes_per_s=args.mb_per_s * 1e6)
        print(
            f"dataset: {raw.num_samples} samples x {raw.sample_nbytes} B in {len(raw.manifest['shards'])} shards; "
            f"source: {args.latency_ms} ms per request, {args.mb_per_s} MB/s shared; batch {args.batch}, "
            f"{args.epochs} epochs"
        )

        plan = mixture_plan(args.mixture, raw.num_samples, args.batch) if args.mixture else None
        if plan is not None:
            print(f"mixture: {len(plan.names)} sources of {plan.sizes[0]} samples at weights {args.mixture}")
        plan = plan or AccessPlan(raw.num_samples, args.batch, 0)
        stream = plan.samples(0, args.epochs * (raw.num_samples // args.batch)).ravel()
        first_epoch = len(stream) // args.epochs
        measured = {}
        for fraction in (0.25, 0.5):
            measured[fraction] = ours(source, args.batch, 0, args.epochs, fraction, args.workers, plan)
        print("\nhit rate (all epochs | epochs 2+)")
        print(
            f"{'capacity':>9} {'this loader':>17} {'Belady (optimum)':>19} {'LRU':>17} {'ours/Belady':>12} "
            f"{'ours/LRU':>9}"
        )
        for fraction in CAPACITIES:
            cap = int(fraction * raw.num_samples)
            bel, lru = belady_hits(stream, cap), lru_hits(stream, cap)
            if fraction in measured:
                _, hit, hit_later = measured[fraction]
            else:  # the planner alone (what the loader realizes, as the measured rows show)
                hit, hit_later = _planned(plan, args.epochs, cap)
            row = (
                f"{fraction:>9.0%} {hit:>8.4f} | {hit_later:.4f} {bel.mean():>10.4f} | {bel[first_epoch:].mean():.4f}"
                f" {lru.mean():>8.4f} | {lru[first_epoch:].mean():.4f} {hit / max(bel.mean(), 1e-12):>12.4f} "
                f"{hit / max(lru.mean(), 1e-12):>9.1f}"
            )
            print(row + ("" if fraction in measured else "   (planned)"))
            summary[f"hit_{int(fraction * 100)}"] = round(hit, 4)
            summary[f"hit_vs_belady_{int(fraction * 100)}"] = round(hit / max(bel.mean(), 1e-12), 4)
            summary[f"hit_vs_lru_{int(fraction * 100)}"] = round(hit / max(lru.mean(), 1e-12), 2)

        print("\nepoch times (s)")
        same = stream if args.mixture else None  # a mixture: grain reads our stream
        rows = {"grain DataLoader (default prefetch)": grain_epoch_times(source, args.batch, 0, args.epochs, same)}
        lru_source = LRUCachedSource(source, raw.num_samples // 2)
        rows["grain + LRU cache 50%"] = grain_epoch_times(lru_source, args.batch, 0, args.epochs, same)
        rows[f"this loader 25% ({args.workers} workers)"] = measured[0.25][0]
        rows[f"this loader 50% ({args.workers} workers)"] = measured[0.5][0]
        grain_later = np.mean(rows["grain DataLoader (default prefetch)"][1:]) if args.epochs > 1 else float("nan")
        print(
            f"{'':>40} "
            + " ".join(f"{'epoch ' + str(e + 1):>9}" for e in range(args.epochs))
            + f" {'e2+ vs grain':>13}"
        )
        for name, times in rows.items():
            speedup = grain_later / np.mean(times[1:]) if args.epochs > 1 else float("nan")
            print(f"{name:>40} " + " ".join(f"{t:>9.2f}" for t in times) + f" {speedup:>12.2f}x")
        if args.epochs > 1:
            summary["speedup_e2_vs_grain_50"] = round(grain_later / np.mean(measured[0.5][0][1:]), 2)
            summary["speedup_e2_vs_grain_lru_50"] = round(
                np.mean(rows["grain + LRU cache 50%"][1:]) / np.mean(measured[0.5][0][1:]), 2
            )

    if not args.skip_peers:
        print(f"\n{args.procs} processes, {args.peer_samples} samples, {args.peer_epochs} epochs (epochs 2+)")
        print(f"{'aggregate capacity':>19} {'local':>7} {'peer':>7} {'hit':>7} {'target 0.95*min(1,c)':>21}")
        for fraction in (0.25, 0.5, 1.0):
            r = four_processes(
                args.procs,
                args.peer_samples,
                args.seq_len,
                fraction,
                args.peer_epochs,
                args.latency_ms / 1e3,
                args.mb_per_s * 1e6,
            )
            print(
                f"{fraction:>19.0%} {r['local']:>7.4f} {r['peer']:>7.4f} {r['hit']:>7.4f} "
                f"{0.95 * min(1, fraction):>21.4f}"
            )
            summary[f"peers_hit_{int(fraction * 100)}"] = round(r["hit"], 4)

    if not args.skip_model:
        print(
            f"\ntiming model vs measured stall: {args.model_samples} samples, 50% RAM, epoch 2 behind a "
            f"{args.model_step_ms:g} ms step"
        )
        print(
            f"{'source':>28} {'predicted s/batch':>18} {'step s':>8} {'keeps up':>9} {'measured s/batch':>17} "
            f"{'stall':>7}"
        )
        cases = {"fast": (args.latency_ms, args.workers), "slow": (5 * args.latency_ms, max(1, args.workers // 8))}
        for name, (latency_ms, workers) in cases.items():
            r = model_check(
                args.model_samples,
                args.seq_len,
                args.batch,
                args.model_step_ms / 1e3,
                latency_ms / 1e3,
                args.mb_per_s * 1e6,
                workers,
            )
            label = f"{name}: {latency_ms:g} ms, {workers} workers"
            print(
                f"{label:>28} {r['batch_s']:>18.4f} {r['step_s']:>8.4f} {str(r['keeps_up']):>9} "
                f"{r['measured_s']:>17.4f} {r['stall_frac']:>7.2%}"
            )
            summary[f"model_{name}_keeps_up"] = r["keeps_up"]
            summary[f"model_{name}_stall_frac"] = round(r["stall_frac"], 4)

    if not args.skip_train:
        with tempfile.TemporaryDirectory() as tmp:
            r = train_stall(Path(tmp), args.train_steps, args.latency_ms, args.mb_per_s)
        print(
            f"\ntiny_lm through the throttled source: {r['steps']} steps, waited {r['stall_s']:.3f} s for data "
            f"of ~{r['wall_s']:.1f} s ({r['stall_s'] / r['wall_s']:.2%})"
        )
        summary["train_stall_frac"] = round(r["stall_s"] / r["wall_s"], 4)
    print(json.dumps(summary))
    return 0


def mixture_plan(weights: str, num_samples: int, batch: int):
    """The plan of a mixture of equal contiguous sources of the dataset, read at `weights` ("W,W,...")."""
    from data.mixture import MixturePlan

    ws = [float(w) for w in weights.split(",")]
    size = num_samples // len(ws)
    sizes = [size] * (len(ws) - 1) + [num_samples - size * (len(ws) - 1)]
    return MixturePlan([f"s{i}" for i in range(len(ws))], sizes, ws, global_batch=batch, seed=0)


def _planned(plan, epochs: int, capacity: int) -> tuple[float, float]:
    from data.cache_plan import SOURCE, PlacementPlanner

    batch = plan.global_batch
    planner = PlacementPlanner(plan, [(0, batch)], [(capacity, 0)])
    spe = plan.steps_per_epoch
    fetched = [planner.plan_chunk(e * spe, (e + 1) * spe)[0].fetch_from for e in range(epochs)]
    hits = [np.mean(f != SOURCE) for f in fetched]
    return float(np.mean(hits)), float(np.mean(hits[1:])) if epochs > 1 else 0.0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    exit_with(main())
