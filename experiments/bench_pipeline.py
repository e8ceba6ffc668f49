"""Pipeline schedules against each other in one run: the idle share of each schedule's table, and its compiled train
step's time, scratch memory and program size, relative to 1F1B.

    python -m experiments.bench_pipeline                          # P = 4 on 8 simulated CPU devices, M = 8
    python -m experiments.bench_pipeline --microbatches 16 --schedules 1f1b,zbv

A small Llama (8 layers, d 64) with `data x pipeline` = 2 x 4 over 8 simulated CPU devices. On a CPU the simulated
stages share the machine's cores, so a schedule's idle ticks are not free time and step times are noisy: the idle
share from the table is the figure that holds; the step time shows what a schedule's extra work costs (ZB-H1 and ZB-V
recompute each chunk's forward in both B and W). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench_pipeline", description=__doc__.split("\n")[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--schedules", default="gpipe,1f1b,interleaved-1f1b,zb-h1,zbv")
    p.add_argument("--steps", type=int, default=5, help="steps per timed window (the best of 3 windows)")
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np

    from jaxlm.config import DataConfig, ModelConfig, TrainConfig, validate
    from jaxlm.train import Program
    from sharding import LayoutError, MeshLayout, build_mesh
    from sharding.schedules import ScheduleError, make

    names = [s.strip() for s in args.schedules.split(",") if s.strip()]
    P, M = args.stages, args.microbatches
    cfg = validate(
        TrainConfig(
            model=ModelConfig(
                vocab_size=512, d_model=64, num_layers=8, num_heads=4, num_kv_heads=2, mlp_dim=128, max_seq_len=64
            ),
            data=DataConfig(seq_len=64, batch_size=2 * M * 2, microbatches=1),
        )
    )
    try:
        layouts = {
            n: MeshLayout(data=8 // P, pipeline=P, pipeline_schedule=n, pipeline_microbatches=M).validate(8)
            for n in names
        }
        tables = {n: make(n, P, M) for n in names}
    except (LayoutError, ScheduleError) as e:
        print(f"bench_pipeline: error: {e}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    B, T, V = cfg.data.batch_size, cfg.data.seq_len, cfg.model.vocab_size
    tokens = rng.integers(0, V, size=(B, T + 1), dtype=np.int32)
    host_batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": np.ones((B, T), np.float32)}
    rows = {}
    print(f"P = {P} stages, M = {M} microbatches, data = {8 // P}; 8 simulated CPU devices")
    print(
        f"{'schedule':18s} {'idle':>6s} {'compile s':>9s} {'step s':>7s} {'/1f1b':>6s} {'temp MiB':>8s} {'HLO KiB':>8s}"
    )
    for name in names:
        program = Program(cfg, build_mesh(layouts[name]), layouts[name])
        batch, state = program.device_batch(host_batch), program.init()
        t0 = time.perf_counter()
        step = program.train_step.lower(state, batch).compile()
        compile_s = time.perf_counter() - t0
        state, _ = step(state, batch)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(args.steps):
                state, metrics = step(state, batch)
            jax.block_until_ready((state, metrics))
            best = min(best, (time.perf_counter() - t0) / args.steps)
        rows[name] = {
            "idle": round(tables[name].bubble_fraction, 4),
            "compile_s": round(compile_s, 2),
            "step_s": round(best, 4),
            "temp_mib": round(step.memory_analysis().temp_size_in_bytes / 2**20, 2),
            "hlo_kib": round(len(step.as_text()) / 1024),
        }
    base = rows.get("1f1b", next(iter(rows.values())))["step_s"]
    for name, r in rows.items():
        r["vs_1f1b"] = round(r["step_s"] / base, 3)
        print(
            f"{name:18s} {r['idle']:6.1%} {r['compile_s']:9.1f} {r['step_s']:7.3f} {r['vs_1f1b']:6.2f} "
            f"{r['temp_mib']:8.2f} {r['hlo_kib']:8d}"
        )
    print(json.dumps({"stages": P, "microbatches": M, "rows": rows}))
    return 0


if __name__ == "__main__":
    from experiments.cli import exit_with

    exit_with(main())
