"""Compile every Pallas kernel for TPU v5e / v5p / v6e (and v4), on a machine without a TPU.

    python -m experiments.tpu_compile                          # every generation, mask, head dim, dtype, T 8k-128k
    python -m experiments.tpu_compile --core                   # v5p, head dim 128, bf16, T 8k and 32k, 4 masks
    python -m experiments.tpu_compile --generations v6e --seqs 131072 --json out.json

Mosaic compiles each kernel for the generation and XLA checks its VMEM and SMEM, so a kernel that would not fit a
TPU fails here, with XLA's first line (e.g. "Ran out of memory in memory space vmem"). Attention: every mask kind
(document ids known on the host, and traced as in training), forward + dQ + dK/dV in one program, GQA; a case that
fails is compiled again kernel by kernel to name the one that does not fit. Matmuls: int8, fp8, mixed and
weight-only, per tensor / channel / block, and the training custom_vjp. libtpu (jax's own pin) is installed on first
use into a cache directory of its own (pallas_kernels.targets). Exit 0 when everything compiles, 1 when something
does not, 2 on bad flags or when libtpu cannot be set up.
"""

from __future__ import annotations

import argparse
import json
import sys

from experiments.cli import csv_of, exit_with
from experiments.gpu_compile import MATMULS, Case, attention_masks, matmul_program, run

TPU_CALL = "tpu_custom_call"
GENERATIONS = ("v5e", "v5p", "v6e")
SEQS = (8192, 32768, 131072)
HEAD_DIMS = (64, 128, 256)
DTYPES = ("bfloat16", "float32")
HEADS, KV_HEADS, BLOCK = 4, 2, 128
TRACED_DOCUMENT = "document, ids traced"
TABLE = "causal, relative_bias (T5 table as an input)"
# A kernel's VMEM holds its tiles and the operands it loads, whatever the mask's expression: causal stands for the
# masks that load nothing more (window, prefix, global tokens, full); documents load ids, from the host or traced;
# a table is a score mod's array. Its lookup compiles in time growing with its buckets (v5p: 8 in 13 s, 32 in 40 s):
# `--core` compiles an 8-bucket table, the full run T5's 32.
CORE_MASKS = ("causal", "document", TRACED_DOCUMENT, TABLE)
TABLE_BUCKETS, CORE_TABLE_BUCKETS = 32, 8


def _kernels_in(compiled, expected: int) -> str:
    """Check the program calls at least `expected` Mosaic kernels (nothing fell back to interpret mode) and say how
    much temporary memory it needs."""
    found = compiled.as_text().count(f'custom_call_target="{TPU_CALL}"')
    if found < expected:
        raise RuntimeError(f"expected {expected} Mosaic kernels in the compiled program, found {found}")
    temp = compiled.memory_analysis().temp_size_in_bytes
    return f"{found} Mosaic kernels, {temp / 2**20:.0f} MiB temporaries"


def _attention_fns(mask, T: int, E: int, dtype: str, buckets: int = TABLE_BUCKETS):
    """(forward, dQ, dK/dV, all three) as functions of q, k, v, segment ids (``TABLE``: a T5 bias table
    [H, buckets], whose gradient dQ forms), and their argument specs."""
    import jax
    import jax.numpy as jnp

    import pallas_kernels as pk

    sizes = pk.BlockSizes(BLOCK, BLOCK)
    table = mask == TABLE
    host = None if mask is None else pk.make_block_mask(pk.causal() if table else mask, T, T, sizes)

    def attention(q, k, v, ids):  # mask None: causal documents whose ids arrive with the batch, as in training
        bm = host if mask is not None else pk.make_block_mask(pk.causal() & pk.document(ids), T, T, sizes)
        return pk.block_sparse_attention(q, k, v, bm, score_mod=pk.relative_bias(ids) if table else None)

    def loss(q, k, v, ids):
        out, lse = attention(q, k, v, ids)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

    fns = {
        "forward": attention,
        "dQ": jax.grad(loss, argnums=(0, 3) if table else 0),
        "dK/dV": jax.grad(loss, argnums=(1, 2)),
        "all": jax.value_and_grad(loss, argnums=(0, 1, 2, 3) if table else (0, 1, 2)),
    }
    q = jax.ShapeDtypeStruct((1, HEADS, T, E), jnp.dtype(dtype))
    kv = jax.ShapeDtypeStruct((1, KV_HEADS, T, E), jnp.dtype(dtype))
    ids = jax.ShapeDtypeStruct((HEADS, buckets), jnp.float32) if table else jax.ShapeDtypeStruct((1, T), jnp.int32)
    return fns, (q, kv, kv, ids)


def _compile_attention(generation: str, mask, T: int, E: int, dtype: str, buckets: int = TABLE_BUCKETS) -> str:
    from pallas_kernels.targets import compile_for_tpu, first_line

    fns, args = _attention_fns(mask, T, E, dtype, buckets)
    try:
        compiled = compile_for_tpu(fns["all"], *args, generation=generation)
    except Exception:  # name the kernel that does not compile
        failing = []
        for kernel in ("forward", "dQ", "dK/dV"):
            try:
                compile_for_tpu(fns[kernel], *args, generation=generation)
            except Exception as e:
                failing.append(f"{kernel}: {first_line(e)}")
        raise RuntimeError("; ".join(failing) or "fails only when the three kernels compile together") from None
    return _kernels_in(compiled, expected=3)


def attention_cases(generations, seqs, head_dims, dtypes, core: bool = False) -> list[Case]:
    """Every mask at each generation, length, head dim and dtype (`core`: CORE_MASKS, the table of 8 buckets)."""
    cases, buckets = [], CORE_TABLE_BUCKETS if core else TABLE_BUCKETS
    for generation in generations:
        for T in seqs:
            masks = {**attention_masks(1, T), TRACED_DOCUMENT: None}
            for E in head_dims:
                for dtype in dtypes:
                    extra = {TABLE: TABLE} if (E, dtype) == (128, "bfloat16") else {}  # a score mod's array
                    for name, mask in {**masks, **extra}.items():
                        if core and name not in CORE_MASKS:
                            continue
                        if name == TABLE:
                            name = name.replace("T5 table", f"T5 table of {buckets} buckets")
                        cases.append(
                            Case(
                                "attention",
                                f"{generation}, T {T}, {name}, head dim {E}, {dtype}",
                                lambda g=generation, m=mask, T=T, E=E, d=dtype: _compile_attention(
                                    g, m, T, E, d, buckets
                                ),
                            )
                        )
    return cases


def _compile_matmul(generation: str, spec) -> str:
    from pallas_kernels.targets import compile_for_tpu

    matmul, args = matmul_program(spec)
    return _kernels_in(compile_for_tpu(matmul, *args, generation=generation), expected=1)


def matmul_cases(generations) -> list[Case]:
    return [
        Case("matmul", f"{generation}, {name}", lambda g=generation, spec=spec: _compile_matmul(g, spec))
        for generation in generations
        for name, spec in MATMULS.items()
    ]


def main(argv=None) -> int:
    from pallas_kernels import targets

    p = argparse.ArgumentParser(prog="python -m experiments.tpu_compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--generations", type=csv_of(str, tuple(targets.TPU_GENERATIONS)), default=GENERATIONS)
    p.add_argument("--seqs", type=csv_of(int), help=f"sequence lengths (comma-separated; default {SEQS})")
    p.add_argument("--head-dims", type=csv_of(int, HEAD_DIMS), default=HEAD_DIMS)
    p.add_argument("--dtypes", type=csv_of(str, DTYPES), default=DTYPES)
    p.add_argument(
        "--core",
        action="store_true",
        help="v5p, head dim 128, bfloat16, T 8192 and 32768 unless --seqs, and the masks that load different operands "
        "(causal, documents on the host and traced, a T5 table of 8 buckets)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--no-install", action="store_true", help="fail instead of installing libtpu with pip")
    args = p.parse_args(argv)
    if args.core:
        args.generations, args.head_dims, args.dtypes = ("v5p",), (128,), ("bfloat16",)
        args.seqs = args.seqs or (8192, 32768)
    args.seqs = args.seqs or SEQS
    bad = [T for T in args.seqs if T < 1]
    if bad:
        p.error(f"--seqs: {bad[0]} is not a positive length")

    try:
        toolchain = targets.libtpu()
        directory = targets.toolchain_dir(toolchain)
        if not args.no_install:
            directory = targets.install(toolchain, directory)
        targets.enable(toolchain, directory)
    except targets.TargetError as e:
        print(f"tpu_compile: error: {e}", file=sys.stderr)
        return 2
    print(f"tpu_compile: compiling for TPU {', '.join(args.generations)}, libtpu {directory}")
    attention = attention_cases(args.generations, args.seqs, args.head_dims, args.dtypes, core=args.core)
    cases = attention + matmul_cases(args.generations)
    rows = run(cases)
    failed = [r for r in rows if not r["ok"]]
    print(f"tpu_compile: {len(rows) - len(failed)} of {len(rows)} compile for TPU {', '.join(args.generations)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "failed": len(failed)}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    exit_with(main())
