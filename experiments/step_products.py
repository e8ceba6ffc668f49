"""A compiled program's matrix products, each timed alone: the floor its dots set, and which of them run slowly.

`bench_train --products` prints them for the train step. A profile cannot say this: XLA:CPU runs independent ops at
once and its Eigen dots asynchronously, so their traced durations overlap and blame one op for another's time.
Timing every dot of the optimized HLO alone, at its shapes and contracted axes, and summing them times the number
of runs the program makes of each (a loop body's `known_trip_count` times) gives the time the products alone take
and each one's rate, to compare with the machine's matmul peak.

Operands are timed in row-major layout: a dot the HLO gives other layouts is marked in its row. Alone, a product
has every core to itself and its output is fresh memory each call, so it can run faster or slower than in the
program (the gpt-bench head's forward: 42-48 ms alone, ~32 ms in the step's profile): the sum is an estimate.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp

from experiments.timing import best_time
from sharding.hlo import computation_runs

_DTYPES = {
    "f32": jnp.float32,
    "bf16": jnp.bfloat16,
    "f16": jnp.float16,
    "f64": jnp.float64,
    "s8": jnp.int8,
    "s32": jnp.int32,
}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\](\{[\d,]*\})? (\S+?)\((.*)$", re.M)


@dataclasses.dataclass(frozen=True)
class Product:
    """One dot's shapes and dimension numbers, as `jax.lax.dot_general` takes them."""

    dtype: str  # the HLO's element type of the operands, e.g. "f32"
    out_dtype: str
    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    contracting: tuple[tuple[int, ...], tuple[int, ...]]
    batch: tuple[tuple[int, ...], tuple[int, ...]]
    row_major: bool  # all three arrays in the HLO's default layout
    name: str  # the jax op the dot came from (its metadata's op_name, last part)

    @property
    def flops(self) -> int:
        contracted = math.prod(self.lhs[i] for i in self.contracting[0])
        return 2 * contracted * math.prod(self.out_shape)

    @property
    def out_shape(self) -> tuple[int, ...]:
        (lc, rc), (lb, rb) = self.contracting, self.batch
        free_l = [d for i, d in enumerate(self.lhs) if i not in lc and i not in lb]
        free_r = [d for i, d in enumerate(self.rhs) if i not in rc and i not in rb]
        return tuple(self.lhs[i] for i in lb) + tuple(free_l) + tuple(free_r)

    def describe(self) -> str:
        (lc, rc), (lb, rb) = self.contracting, self.batch
        axes = f"contract {list(lc)}x{list(rc)}" + (f" batch {list(lb)}x{list(rb)}" if lb else "")
        layout = "" if self.row_major else " (other layout)"
        return f"{list(self.lhs)} x {list(self.rhs)} {axes} -> {list(self.out_shape)}{layout}"


def _dims(attrs: str, key: str) -> tuple[int, ...]:
    found = re.search(key + r"=\{([\d,]*)\}", attrs)
    return tuple(int(d) for d in found.group(1).split(",") if d) if found else ()


def _is_row_major(dims: str, layout: str | None) -> bool:
    rank = len([d for d in dims.split(",") if d])
    return layout is None or layout == "{" + ",".join(str(i) for i in reversed(range(rank))) + "}"


def products(hlo_text: str) -> dict[Product, int]:
    """Every dot in an optimized HLO module -> how many times one run of the program executes it (a loop body's
    ``known_trip_count`` times per run of the loop: sharding.hlo.computation_runs)."""
    computations, runs = computation_runs(hlo_text)
    counts: dict[Product, int] = {}
    for name, text in computations.items():
        shapes = {m.group(1): (m.group(2), m.group(3), m.group(4)) for m in _INSTRUCTION.finditer(text)}
        for inst in _INSTRUCTION.finditer(text):
            if inst.group(5) != "dot" or not runs.get(name):
                continue
            operands = re.findall(r"%([\w.\-]+)", inst.group(6).split(")", 1)[0])
            (lt, ld, ll), (_, rd, rl) = shapes[operands[0]], shapes[operands[1]]
            attrs = inst.group(6)
            op_name = re.search(r'op_name="([^"]*)"', attrs)
            product = Product(
                dtype=lt,
                out_dtype=inst.group(2),
                lhs=tuple(int(d) for d in ld.split(",") if d),
                rhs=tuple(int(d) for d in rd.split(",") if d),
                contracting=(_dims(attrs, "lhs_contracting_dims"), _dims(attrs, "rhs_contracting_dims")),
                batch=(_dims(attrs, "lhs_batch_dims"), _dims(attrs, "rhs_batch_dims")),
                row_major=all(_is_row_major(d, lay) for d, lay in ((ld, ll), (rd, rl), (inst.group(3), inst.group(4)))),
                name=op_name.group(1).rsplit("/", 2)[-2] if op_name and "/" in op_name.group(1) else "",
            )
            counts[product] = counts.get(product, 0) + runs[name]
    return counts


def time_product(product: Product, repeats: int = 5) -> float:
    """Best wall time of the product alone, compiled by itself, on the default device."""
    dtype, out = _DTYPES[product.dtype], _DTYPES.get(product.out_dtype, jnp.float32)
    lhs = jnp.ones(product.lhs, dtype)
    rhs = jnp.ones(product.rhs, dtype)
    dot = jax.jit(
        lambda a, b: jax.lax.dot_general(a, b, (product.contracting, product.batch), preferred_element_type=out)
    )
    return best_time(dot, lhs, rhs, repeats=repeats)


def print_products(hlo_text: str, peak_flops: float, step_s: float, top: int = 12, repeats: int = 5) -> dict:
    """Times every product of the program alone and prints the slowest in total, the sums for unbatched products (a
    model's projections) and batched ones (attention's), and how far each sum is from the peak. Returns the sums."""
    rows, untimed = [], set()
    for product, runs in products(hlo_text).items():
        if product.dtype not in _DTYPES:  # e.g. fp8: not one jnp.ones can make here
            untimed.add(product.dtype)
            continue
        seconds = time_product(product, repeats)
        rows.append((seconds * runs, runs, seconds, product))
    rows.sort(key=lambda row: -row[0])
    total = sum(row[0] for row in rows)
    print(f"the program's products timed alone: {total * 1e3:.0f} ms of the {step_s * 1e3:.0f} ms step")
    if untimed:
        print(f"  (not timed: the products in {', '.join(sorted(untimed))})")
    print(f"  {'ms a step':>9s} {'runs':>5s} {'GFLOP/s':>8s}  product")
    for spent, runs, seconds, product in rows[:top]:
        print(
            f"  {spent * 1e3:9.1f} {runs:5d} {product.flops / seconds / 1e9:8.1f}  {product.describe()}  {product.name}"
        )
    summary = {"step_ms": round(step_s * 1e3, 1), "products_ms": round(total * 1e3, 1)}
    for kind, batched in (("unbatched", False), ("batched", True)):
        chosen = [row for row in rows if bool(row[3].batch[0]) == batched]
        if not chosen:
            continue
        spent = sum(row[0] for row in chosen)
        at_peak = sum(row[1] * row[3].flops for row in chosen) / peak_flops
        print(f"  {kind}: {spent * 1e3:.0f} ms ({len(chosen)} shapes), {at_peak * 1e3:.0f} ms at the peak")
        summary[f"{kind}_ms"] = round(spent * 1e3, 1)
        summary[f"{kind}_at_peak_ms"] = round(at_peak * 1e3, 1)
    return summary
