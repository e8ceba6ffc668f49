"""Compile every Pallas kernel and a training step for an H100, on a machine without a GPU.

    python -m experiments.gpu_compile                  # every case; installs the CUDA plugin on first use
    python -m experiments.gpu_compile --core           # causal documents at head dims 128 and 256, bf16
    python -m experiments.gpu_compile --quick          # head dim 128, bfloat16, three masks, two matmuls
    python -m experiments.gpu_compile --json out.json  # also the rows as JSON

Triton and Mosaic GPU compile each kernel for sm_90 and XLA checks its shared memory against the H100's 227 KiB per
block, so a kernel change is done only when this passes (pallas_kernels.targets says how it works). Each case
counts the kernels of each kind it must contain (docs/gpu.md, Backends, says which runs where). Attention: every
mask kind, forward + dQ + dK/dV, head dims 64 / 128 / 256, float32 and bfloat16, GQA; a case that fails is compiled
again kernel by kernel to name the one that does not fit. Matmuls: int8, fp8, mixed fp8 and weight-only, per
tensor / channel / block, and the training custom_vjp. Then whole train steps: a small Llama with Pallas attention
and fp8 Pallas matmuls, and the GPU report's 1B Llama, whose state and temporaries must fit the H100's memory.
Exit 0 when everything compiles, 1 when something does not, 2 when the plugin cannot be set up.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import sys
import time
from collections.abc import Callable

from experiments.cli import exit_with

TRITON_CALL = "__gpu$xla.gpu.triton"
# A Mosaic GPU kernel's custom call target: "mosaic_gpu_v2" in jax 0.10 ("mosaic_gpu" before); any version counts.
MOSAIC_CALL = re.compile(r'custom_call_target="mosaic_gpu(_v\d+)?"')
HEAD_DIMS = (64, 128, 256)
DTYPES = ("bfloat16", "float32")
SEQ, BLOCK, HEADS, KV_HEADS = 512, 128, 4, 2


@dataclasses.dataclass
class Case:
    group: str  # attention | matmul | train step
    name: str
    compile: Callable[[], str]  # compiles; returns a detail for the report, raises when it does not compile


def attention_masks(B: int, T: int) -> dict:
    import numpy as np

    import pallas_kernels as pk
    from pallas_kernels.masks import at_positions

    segments = np.repeat(np.arange(4, dtype=np.int32), T // 4)[None].repeat(B, 0)
    zigzag = np.concatenate([np.arange(T // 2, T), np.arange(T // 2)]).astype(np.int32)  # a context shard's order
    return {
        "causal": pk.causal(),
        "sliding_window(256)": pk.sliding_window(256),
        "document": pk.causal() & pk.document(segments),
        # two id slots, documents and positions, as context parallelism's shards load them
        "document at positions": at_positions(pk.causal() & pk.document(segments), zigzag, zigzag),
        f"prefix_lm({T // 4})": pk.prefix_lm(T // 4),
        "global_tokens(4) | sliding_window(256)": pk.global_tokens(4) | pk.sliding_window(256),
        "full": pk.full(),
    }


def _attention_fns(mask, E: int, dtype: str, deterministic: bool = True):
    """(forward, dQ, dK/dV, all three) as functions of q, k, v, and their argument specs; not ``deterministic``, the
    Mosaic backward sums dQ across dK/dV's programs where it can (one kernel for both)."""
    import jax
    import jax.numpy as jnp

    import pallas_kernels as pk

    B = 1
    bm = pk.make_block_mask(mask, SEQ, SEQ, pk.BlockSizes(BLOCK, BLOCK))

    def loss(q, k, v):
        out, lse = pk.block_sparse_attention(q, k, v, bm, deterministic=deterministic)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

    fns = {
        "forward": lambda q, k, v: pk.block_sparse_attention(q, k, v, bm),
        "dQ": jax.grad(loss, argnums=0),
        "dK/dV": jax.grad(loss, argnums=(1, 2)),
        "all": jax.value_and_grad(loss, argnums=(0, 1, 2)),
    }
    q = jax.ShapeDtypeStruct((B, HEADS, SEQ, E), jnp.dtype(dtype))
    kv = jax.ShapeDtypeStruct((B, KV_HEADS, SEQ, E), jnp.dtype(dtype))
    return fns, (q, kv, kv)


def _compile_attention(mask, E: int, dtype: str, deterministic: bool = True) -> str:
    from pallas_kernels.targets import compile_for_gpu, first_line

    fns, args = _attention_fns(mask, E, dtype, deterministic)
    try:
        compiled = compile_for_gpu(fns["all"], *args)
    except Exception:  # name the kernel that does not compile
        failing = []
        for kernel in ("forward", "dQ", "dK/dV"):
            try:
                compile_for_gpu(fns[kernel], *args)
            except Exception as e:
                failing.append(f"{kernel}: {first_line(e)}")
        raise RuntimeError("; ".join(failing) or "fails only when the three kernels compile together") from None
    # float32 runs all three on Triton (wgmma takes 16-bit floats); in bfloat16 block_sparse_attention's auto
    # lowering puts on Mosaic GPU what its kernels take (which masks and head dims: pallas_attention), so there the
    # three are counted of either kind; dQ summed in dK/dV (not deterministic), two Mosaic GPU kernels at least
    if not deterministic:
        return _kernels_in(compiled, mosaic=2)
    return _kernels_in(compiled, triton=3) if dtype == "float32" else _kernels_in(compiled, total=3)


def _compile_cudnn_attention() -> str:
    """cuDNN's fused attention, the GPU report's peer (``jax.nn.dot_product_attention``), causal with GQA in the
    model's [B, T, H, E], forward and backward: traced for the H100 without one (``targets.tracing_for``), it
    compiles to cuDNN's two custom calls."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.targets import compile_for_gpu
    from sharding.hlo import custom_kernels

    def loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return jnp.sum(out.astype(jnp.float32))

    q = jax.ShapeDtypeStruct((1, SEQ, HEADS, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, SEQ, KV_HEADS, 128), jnp.bfloat16)
    compiled = compile_for_gpu(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
    found = custom_kernels(compiled.as_text())["cuDNN attention"]
    if found != 2:
        raise RuntimeError(f"expected cuDNN's forward and backward attention calls, found {found}")
    return f"{found} cuDNN attention kernels"


def _compile_relative_bias(E: int = 128, slopes: bool = False, batch: int = 1, kv_heads: int = KV_HEADS) -> str:
    """Causal attention with T5's relative bias table [H, 32] as an input (``slopes``: chained with learned ALiBi
    slopes [H], 33 entries a head), gradients to it included: on sm_90 the forward, dQ (which forms the arrays'
    gradients) and dK/dV are Mosaic GPU kernels (the arrays' head rows in shared memory); at head dim 256 dQ and
    dK/dV run as two launches each (halves of the head dim)."""
    import jax
    import jax.numpy as jnp

    import pallas_kernels as pk
    from pallas_kernels.targets import compile_for_gpu

    bm = pk.make_block_mask(pk.causal(), SEQ, SEQ, pk.BlockSizes(BLOCK, BLOCK))

    def loss(q, k, v, table, *learned_slopes):
        mod = pk.relative_bias(table)
        mod = pk.chain(mod, pk.learned_alibi(*learned_slopes)) if slopes else mod
        out, _ = pk.block_sparse_attention(q, k, v, bm, score_mod=mod)
        return jnp.sum(out.astype(jnp.float32))

    q = jax.ShapeDtypeStruct((batch, HEADS, SEQ, E), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, kv_heads, SEQ, E), jnp.bfloat16)
    arrays = (jax.ShapeDtypeStruct((HEADS, 32), jnp.float32), jax.ShapeDtypeStruct((HEADS,), jnp.float32))
    argnums = tuple(range(4 + slopes))
    compiled = compile_for_gpu(jax.grad(loss, argnums=argnums), q, kv, kv, *arrays[: 1 + slopes])
    return _kernels_in(compiled, triton=0, mosaic=5 if E == 256 else 3)


def kernel_counts(hlo_text: str) -> tuple[int, int]:
    """(Triton kernels, Mosaic GPU kernels) that a compiled program's HLO text calls; the Triton kernels that only
    transpose an 8-bit operand for a Mosaic GPU product (``byte_transpose``) are not counted: they multiply nothing."""
    calls = [line for line in hlo_text.splitlines() if f'custom_call_target="{TRITON_CALL}"' in line]
    transposes = re.compile(r'op_name="[^"]*\bbyte_transpose\b')  # its name scope, under any transform
    return sum(not transposes.search(line) for line in calls), len(MOSAIC_CALL.findall(hlo_text))


def _kernels_in(compiled, *, triton: int = 0, mosaic: int = 0, total: int | None = None) -> str:
    """Check the compiled program calls at least `triton` Triton kernels, `mosaic` Mosaic GPU kernels and `total`
    of either kind (default: the two added), so nothing fell back to interpret mode (which would compile as plain
    XLA and prove nothing) and the kernels that must take a lowering on sm_90 took it. Returns the counts."""
    total = triton + mosaic if total is None else total
    found_triton, found_mosaic = kernel_counts(compiled.as_text())
    found = f"{found_triton} Triton + {found_mosaic} Mosaic GPU kernels"
    if found_triton < triton or found_mosaic < mosaic or found_triton + found_mosaic < total:
        want = f"{triton} Triton + {mosaic} Mosaic GPU" + ("" if total == triton + mosaic else f", {total} in all")
        raise RuntimeError(f"expected at least {want} kernels in the compiled program, found {found}")
    return found


# What a kernel's shared memory and registers depend on: its tiles (head dim, dtype) and the operands it loads
# (segment ids with a document mask), not the mask's elementwise expression: every static mask takes one path
# through a kernel (but a full mask over whole blocks, built without the masked loop it never runs: that loop's code
# cost dK/dV registers at head dim 64; the full run checks every mask's spills), and causal documents are causal's
# kernels loading ids as well. So --core compiles causal documents
# at each head dim in bfloat16 (float32 only causal at 256: its largest tiles; head dim 64 in bfloat16 is
# tests/test_mosaic_attention.py's compile).
CORE_MASKS = ("document",)


def attention_cases(quick: bool, core: bool = False) -> list[Case]:
    all_masks = attention_masks(1, SEQ)
    cases = []
    for E in (128,) if quick else HEAD_DIMS:
        for dtype in DTYPES[:1] if quick else DTYPES:
            masks = all_masks
            if quick:
                masks = {k: all_masks[k] for k in ("causal", "document", "full")}
            elif core and dtype == "float32" and E < 256:
                continue  # float32 tiles at 64 and 128 are smaller than at 256, which bounds their shared memory
            elif core and (E, dtype) == (64, "bfloat16"):
                continue  # its Mosaic kernels compile, spills checked, in tests/test_mosaic_attention.py
            elif core and (E, dtype) == (256, "float32"):
                masks = {"causal": all_masks["causal"]}  # documents add ids to what the kernels load: 128 and 256 bf16
            elif core:
                masks = {k: all_masks[k] for k in CORE_MASKS}
            for name, mask in masks.items():
                cases.append(
                    Case(
                        "attention",
                        f"{name}, head dim {E}, {dtype}",
                        lambda mask=mask, E=E, dtype=dtype: _compile_attention(mask, E, dtype),
                    )
                )
    name = "cuDNN's fused attention (the report's peer), causal, GQA, head dim 128"
    cases.append(Case("attention", name, _compile_cudnn_attention))
    if not quick:  # the default suite's interpreter tests cover its math; this, the sm_90 lowering (--core: at 256,
        # where dQ runs in head-dim halves beside the table's gradient tile)
        for E in (256,) if core else (128, 256):
            name = f"causal, relative_bias (T5 table as an input), head dim {E}, bfloat16"
            cases.append(Case("attention", name, functools.partial(_compile_relative_bias, E)))
        if not core:  # 33 entries a head: a 64-wide gradient tile in dQ (at 128 it spills 8 bytes, once a program
            # outside the loops: the test allows that kernel those alone); at 128 two sequences and no GQA, where
            # dK/dV held its heavy-first rows in a register (4 bytes of spills, docs/results/mosaic-program-line-*)
            name = "causal, relative_bias chained with learned_alibi, head dim 128, bfloat16, batch 2, 4 kv heads"
            chain = functools.partial(_compile_relative_bias, 128, slopes=True, batch=2, kv_heads=HEADS)
            cases.append(Case("attention", name, chain))
            name = "causal, relative_bias chained with learned_alibi, head dim 256, bfloat16"
            cases.append(Case("attention", name, functools.partial(_compile_relative_bias, 256, slopes=True)))
    if not quick:  # dQ summed across dK/dV's programs (TMA reduce-adds): --core causal documents at 128 (GQA; at 64
        # tests/test_mosaic_attention.py's compile), the full run every mask at both
        fused = {k: all_masks[k] for k in CORE_MASKS} if core else all_masks
        for E in (128,) if core else (64, 128):
            for name, mask in fused.items():
                case = f"{name}, head dim {E}, bfloat16, dQ summed across programs"
                compile_fused = functools.partial(_compile_attention, mask, E, "bfloat16", deterministic=False)
                cases.append(Case("attention", case, compile_fused))
    return cases


# On sm_90 the first two run as the Mosaic GPU kernel (same 8-bit dtype, per tensor / channel), the rest as Triton's.
MATMULS = {  # name: x dtype, x scale shape (None: weight-only), w dtype, w scale shape, k_block
    "int8 x int8, per channel": ("int8", "rows", "int8", "cols", None),
    "fp8 x fp8, per tensor": ("float8_e4m3fn", "tensor", "float8_e4m3fn", "tensor", None),
    "fp8 e5m2 x e4m3 (mixed), per block of 128": ("float8_e5m2", "blocks", "float8_e4m3fn", "blocks", 128),
    "int8 x int8, per block of 128": ("int8", "blocks", "int8", "blocks", 128),
    "bf16 x int8 weight-only, per channel": ("bfloat16", None, "int8", "cols", None),
    "bf16 x fp8 weight-only, per channel": ("bfloat16", None, "float8_e4m3fn", "cols", None),
}
MATMUL_SHAPE = (512, 1024, 768)  # X, C, Y


def _scale_shape(kind, X, C, Y, k_block, side):
    n = 1 if k_block is None else -(-C // k_block)
    return {
        "rows": (X, 1),
        "cols": (1, Y),
        "tensor": (1, 1),
        "blocks": (X, n) if side == "x" else (n, Y),
    }[kind]


def matmul_program(spec):
    """(the Pallas scaled matmul of one MATMULS entry, its argument specs at MATMUL_SHAPE): what gpu_compile and
    tpu_compile compile."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.quantized_matmul import scaled_matmul

    x_dtype, xs, w_dtype, ws, k_block = spec
    X, C, Y = MATMUL_SHAPE
    args = (
        jax.ShapeDtypeStruct((X, C), jnp.dtype(x_dtype)),
        None if xs is None else jax.ShapeDtypeStruct(_scale_shape(xs, X, C, Y, k_block, "x"), jnp.float32),
        jax.ShapeDtypeStruct((C, Y), jnp.dtype(w_dtype)),
        jax.ShapeDtypeStruct(_scale_shape(ws, X, C, Y, k_block, "w"), jnp.float32),
    )

    def matmul(x, x_scale, w, w_scale):
        return scaled_matmul(x, x_scale, w, w_scale, k_block=k_block, impl="pallas", out_dtype=jnp.bfloat16)

    return matmul, args


def matmul_on_mosaic(spec) -> bool:
    """Whether scaled_matmul's auto lowering runs this MATMULS entry on Mosaic GPU (sm_90)."""
    x_dtype, xs, w_dtype, _, k_block = spec
    return xs is not None and x_dtype == w_dtype and k_block is None


def _compile_matmul(spec) -> str:
    from pallas_kernels.targets import compile_for_gpu

    matmul, args = matmul_program(spec)
    mosaic = matmul_on_mosaic(spec)
    return _kernels_in(compile_for_gpu(matmul, *args), triton=1 - mosaic, mosaic=int(mosaic))


def _compile_quantized_dot(recipe_name: str, delayed: bool) -> str:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.quantized_training import QuantRecipe, new_amax_history, quantized_dot
    from pallas_kernels.targets import compile_for_gpu

    recipe = getattr(QuantRecipe, recipe_name)(impl="pallas")
    X, C, Y = MATMUL_SHAPE

    def loss(x, w, history):
        return jnp.sum(quantized_dot(x, w, history, recipe).astype(jnp.float32))

    history = jax.ShapeDtypeStruct(new_amax_history(16).shape, jnp.float32) if delayed else None
    step = jax.value_and_grad(loss, argnums=(0, 1) + ((2,) if delayed else ()))
    x, w = jax.ShapeDtypeStruct((X, C), jnp.bfloat16), jax.ShapeDtypeStruct((C, Y), jnp.bfloat16)
    # forward, dX and dW are three quantized products; weight-only quantizes the forward alone (its dX and dW are
    # float products of the dequantized weight and of x). On Mosaic GPU: all three for int8 and for fp8 with e4m3
    # gradients, fp8's forward (its backward multiplies e5m2 by e4m3: Triton), not weight-only.
    mosaic = {"int8": 3, "fp8_e4m3": 3, "fp8": 1}.get(recipe_name, 0)
    total = 1 if recipe.weight_only else 3
    return _kernels_in(compile_for_gpu(step, x, w, history), triton=total - mosaic, mosaic=mosaic)


def matmul_cases(quick: bool) -> list[Case]:
    names = list(MATMULS)[:2] if quick else list(MATMULS)
    cases = [Case("matmul", name, lambda spec=MATMULS[name]: _compile_matmul(spec)) for name in names]
    trains = [("fp8", True), ("fp8", False), ("fp8_e4m3", True), ("int8", False), ("int8_weight_only", False)]
    for recipe, delayed in trains[:1] if quick else trains:
        name = {"fp8_e4m3": "fp8 (dY in e4m3)"}.get(recipe, recipe)
        label = f"quantized_dot {name} forward + backward, {'delayed' if delayed else 'current'} scaling"
        cases.append(Case("matmul", label, lambda r=recipe, d=delayed: _compile_quantized_dot(r, d)))
    return cases


def small_llama():
    """A 2-layer Llama with head dim 128, Pallas attention and fp8 Pallas matmuls, in bfloat16."""
    from jaxlm.config import DataConfig, ModelConfig, OptimConfig, TrainConfig

    return TrainConfig(
        model=ModelConfig(
            vocab_size=1024,
            d_model=512,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            mlp_dim=1024,
            max_seq_len=SEQ,
            dtype="bfloat16",
            scan_layers=True,  # one layer body: each kernel is compiled once
            attention_impl="pallas",
            matmul_precision="fp8",
            matmul_impl="pallas",
        ),
        optim=OptimConfig(warmup_steps=1),
        data=DataConfig(seq_len=SEQ, batch_size=2),
        steps=10,
    )


def compile_step(cfg):
    import jax
    import jax.numpy as jnp

    from jaxlm.config import validate
    from jaxlm.train import Program
    from pallas_kernels.targets import h100_mesh, tracing_for
    from sharding import MeshLayout, build_mesh

    validate(cfg)
    program = Program(cfg, build_mesh(MeshLayout(data=1), devices=list(h100_mesh().devices.flat)))
    B, T = cfg.data.batch_size, cfg.data.seq_len
    batch = {
        name: jax.ShapeDtypeStruct((B, T), dtype, sharding=program.batch_sharding)
        for name, dtype in (("inputs", jnp.int32), ("targets", jnp.int32), ("loss_mask", jnp.float32))
    }
    with tracing_for("gpu"):
        return program.train_step.lower(program.abstract_with_shardings(), batch).compile()


def _compile_small_step(quant_backward: str = "quantized") -> str:
    # the scanned layer body once: 3 attention kernels (causal bf16: the forward on Mosaic GPU, dQ and dK/dV on
    # either) and 4 fp8 matmuls x (forward on Mosaic GPU; dX, dW, mixed e5m2 x e4m3, on Triton); the lm_head's 3.
    # With fp8's dY in e4m3 every matmul product is on Mosaic GPU (so at most attention's dQ and dK/dV on Triton)
    from experiments.gpu_report import with_model

    cfg = with_model(small_llama(), {"quant_backward": quant_backward})
    if quant_backward == "e4m3":
        return _kernels_in(compile_step(cfg), mosaic=1 + 4 * 3 + 3, total=3 + 4 * 3 + 3)
    return _kernels_in(compile_step(cfg), triton=4 * 2 + 2, mosaic=1 + 4 + 1, total=3 + 4 * 3 + 3)


def _compile_report_step(overrides: dict, mosaic: int = 3, cudnn: int = 0) -> str:
    """The GPU report's 1B model: it must compile, hold at least ``mosaic`` Mosaic GPU kernels (sm_90) and ``cudnn``
    cuDNN attention calls, and its state plus temporaries fit the H100's memory."""
    from experiments.gpu_report import llama_1b, with_model
    from pallas_kernels.targets import H100_MEMORY
    from sharding.hlo import custom_kernels

    base = llama_1b()
    compiled = compile_step(with_model(base, overrides))
    memory = compiled.memory_analysis()
    used = memory.argument_size_in_bytes + memory.temp_size_in_bytes
    if used > H100_MEMORY:
        raise RuntimeError(f"needs {used / 1e9:.1f} GB, more than the H100's {H100_MEMORY / 1e9:.1f} GB")
    # attention's forward, dQ and dK/dV (and with Pallas matmuls their fp8 forwards) on Mosaic GPU
    kernels = _kernels_in(compiled, mosaic=mosaic)
    if cudnn:
        found = custom_kernels(compiled.as_text())["cuDNN attention"]
        if found < cudnn:
            raise RuntimeError(f"expected at least {cudnn} cuDNN attention calls, found {found}")
        kernels += f" + {found} cuDNN attention"
    return f"{kernels}, {used / 1e9:.1f} of {H100_MEMORY / 1e9:.1f} GB"


def train_cases(core: bool = False, quick: bool = False) -> list[Case]:
    """The small step and the report's 1B steps (each ~6 s more on 2 cores); `quick` the small step only, `core`
    none."""
    pallas = {"attention_impl": "pallas"}
    small = Case("train step", "2-layer Llama, head dim 128, bf16, Pallas attention + fp8 matmuls", _compile_small_step)
    if core:  # the kernels compile one by one above; the slow run adds the steps that hold them all
        return []
    if quick:
        return [small]
    e4m3 = Case(
        "train step",
        "2-layer Llama, head dim 128, bf16, Pallas attention + fp8 matmuls with e4m3 gradients",
        lambda: _compile_small_step("e4m3"),
    )
    return [
        small,
        e4m3,
        Case(
            "train step",
            "the report's 1.01B Llama, cuDNN attention (the report's peer)",
            # 20 layers' forward and backward (jax asks no GPU: targets.tracing_for)
            lambda: _compile_report_step({"attention_impl": "jax"}, mosaic=0, cudnn=40),
        ),
        Case("train step", "the report's 1.01B Llama, Pallas attention", lambda: _compile_report_step(pallas)),
        Case(
            "train step",
            "the report's 1.01B Llama, Pallas attention, dQ summed across programs",
            # the forward and one backward kernel (model.attention_deterministic=false)
            lambda: _compile_report_step({**pallas, "attention_deterministic": False}, mosaic=2),
        ),
        Case(
            "train step",
            "the report's 1.01B Llama, Pallas attention + fp8 Pallas matmuls",
            # the Mosaic kernels: attention's three and each layer shape's fp8 forward; the fp8 backward (e5m2 x
            # e4m3) is Triton's
            lambda: _compile_report_step({**pallas, "matmul_precision": "fp8", "matmul_impl": "pallas"}, mosaic=8),
        ),
    ]


def run(cases: list[Case], log=print) -> list[dict]:
    from pallas_kernels.targets import first_line

    rows = []
    for case in cases:
        t0 = time.perf_counter()
        try:
            detail, ok = case.compile(), True
        except Exception as e:
            detail, ok = first_line(e), False
        row = {"group": case.group, "case": case.name, "ok": ok, "detail": detail, "seconds": time.perf_counter() - t0}
        rows.append(row)
        log(f"{'ok  ' if ok else 'FAIL'} {row['seconds']:5.1f}s  {case.group}: {case.name}: {detail}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.gpu_compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few cases: head dim 128, bfloat16, three masks")
    p.add_argument(
        "--core",
        action="store_true",
        help="causal documents at head dims 128 and 256 in bfloat16, causal at 256 in float32, every matmul (what the "
        "default test suite runs)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--no-install", action="store_true", help="fail instead of installing the plugin with pip")
    args = p.parse_args(argv)

    from pallas_kernels import targets

    try:
        directory = targets.set_up_plugin(install_missing=not args.no_install)
    except targets.TargetError as e:
        print(f"gpu_compile: error: {e}", file=sys.stderr)
        return 2
    print(f"gpu_compile: compiling for {targets.h100_mesh().devices.flat[0].device_kind} (sm_90), plugin {directory}")
    rows = run(attention_cases(args.quick, args.core) + matmul_cases(args.quick) + train_cases(args.core, args.quick))
    failed = [r for r in rows if not r["ok"]]
    print(f"gpu_compile: {len(rows) - len(failed)} of {len(rows)} compile for the H100")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "failed": len(failed)}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    exit_with(main())
