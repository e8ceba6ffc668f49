"""The bytes of device memory one train step of the GPU report's ~1B model moves, by kind of kernel, for each matmul
recipe, compiled for an H100 on a machine without a GPU.

    python -m experiments.step_traffic                        # bf16 and the three fp8 recipes; installs the plugin
    python -m experiments.step_traffic --variants fp8-xla-e4m3,fp8-pallas-e4m3 --bandwidth 4.8e12

Why: on an H200 the step with fp8 products on the Pallas (Mosaic GPU) kernels ran at 0.85x the step with XLA's fp8
products (docs/results/hopper-h200-2026-11-27.md); the compiled programs say where the bytes around the products go
(``sharding.hlo.traffic``: an estimate, which says how it counts). ``--bandwidth`` (bytes per second) also prints
the time that much traffic takes at it: a bound on how much of two steps' gap the bytes explain. Attention is the
Pallas kernel in every variant but ``cudnn`` (cuDNN's fused attention, ``targets.tracing_for``; its custom
calls are counted by their operands and outputs, as the Pallas kernels are).
Exit 2 when an argument is wrong or the CUDA plugin cannot be set up.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from experiments.cli import csv_of, exit_with

FP8 = {"attention_impl": "pallas", "matmul_precision": "fp8"}
VARIANTS = {  # name: overrides of gpu_report.llama_1b's model
    "bf16": {"attention_impl": "pallas"},
    "cudnn": {"attention_impl": "jax"},  # the report's peer: cuDNN's fused attention, bf16 matmuls
    "bf16-dq-summed": {"attention_impl": "pallas", "attention_deterministic": False},  # one backward kernel
    "bf16-scanned": {"attention_impl": "pallas", "scan_layers": True},  # the layers in a scan (the base unrolls them)
    "fp8-xla": FP8,
    "fp8-xla-e4m3": {**FP8, "quant_backward": "e4m3"},
    "fp8-pallas-e4m3": {**FP8, "quant_backward": "e4m3", "matmul_impl": "pallas"},  # every product on Mosaic GPU
}


def step_traffic(overrides: dict) -> Counter:
    """Bytes per step by kind of kernel of the 1B step with ``overrides``, compiled for an H100."""
    from experiments.gpu_compile import compile_step
    from experiments.gpu_report import llama_1b, with_model
    from sharding.hlo import traffic

    base = llama_1b()
    compiled = compile_step(with_model(base, overrides))
    return traffic(compiled.as_text())


def report(results: dict[str, Counter], top: int, bandwidth: float | None) -> list[str]:
    """Per variant its total and largest kinds; then each variant's kinds that differ most from the first's."""
    lines = []
    for name, by_kind in results.items():
        total = sum(by_kind.values())
        at = f", {total / bandwidth * 1e3:.1f} ms at {bandwidth / 1e12:g} TB/s" if bandwidth else ""
        lines.append(f"{name}: {total / 1e9:.1f} GB a step{at}")
        lines += [f"  {nbytes / 1e9:8.1f} GB  {kind}" for kind, nbytes in by_kind.most_common(top)]
    first, *others = results
    for name in others:
        diff = Counter(results[name])
        diff.subtract(results[first])
        gap = sum(diff.values())
        at = f" ({gap / bandwidth * 1e3:+.1f} ms at {bandwidth / 1e12:g} TB/s)" if bandwidth else ""
        lines.append(f"{name} - {first}: {gap / 1e9:+.1f} GB{at}")
        largest = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]
        lines += [f"  {nbytes / 1e9:+8.1f} GB  {kind}" for kind, nbytes in largest if nbytes]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.step_traffic", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--variants",
        type=csv_of(str, VARIANTS),
        default=tuple(VARIANTS),
        help=f"comma-separated, the first the baseline: {', '.join(VARIANTS)}",
    )
    p.add_argument("--top", type=int, default=6, help="kinds of kernel listed per variant")
    p.add_argument("--bandwidth", type=float, default=None, help="bytes per second: also print the time at it")
    p.add_argument("--no-install", action="store_true", help="fail instead of installing the plugin with pip")
    args = p.parse_args(argv)
    if args.top < 1 or (args.bandwidth is not None and args.bandwidth <= 0):
        print("step_traffic: error: --top and --bandwidth must be positive", file=sys.stderr)
        return 2

    from pallas_kernels import targets

    try:
        targets.set_up_plugin(install_missing=not args.no_install)
    except targets.TargetError as e:
        print(f"step_traffic: error: {e}", file=sys.stderr)
        return 2
    results = {name: step_traffic(VARIANTS[name]) for name in args.variants}
    print("\n".join(report(results, args.top, args.bandwidth)))
    return 0


if __name__ == "__main__":
    exit_with(main())
