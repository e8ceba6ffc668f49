"""The Mosaic GPU attention kernels on a Hopper GPU: right numbers first, then speed against cuDNN and the Triton
kernels, measured in one run.

    python -m experiments.hopper_attention                      # check + speed (about 3 minutes on an H200)
    python -m experiments.hopper_attention --only check,speed,mods,documents,sweep --json out.json

``check`` compares the Mosaic kernels (``block_sparse_attention(..., lowering="mosaic")``), forward and gradients,
with the float32 reference on bfloat16 inputs for each static mask kind, packed documents, GQA, T != S, a ragged
length and score mods (a T5 bias table: the Mosaic forward, dQ with the table's gradient, and dK/dV).
``speed`` times forward and forward + backward for the full and causal masks at T = 2k and 8k, head dims 64 and 128
(``--head-dims``: 256 too, whose backward runs one consumer warpgroup), and prints the Mosaic rows' ratio to cuDNN and
Triton (``mosaic_fused``: the backward summing dQ across programs, ``deterministic=False``; ``check`` runs every
case's gradients through it too; ``--layout BTHE``: the kernels read q, k, v as the model holds them, as cuDNN's
does, in the checks too; ``--group 2 --seqs 2048``: the ~1B step's attention, GQA 2 heads a key / value head);
``mods`` times causal attention with a soft-cap and a T5 bias table against the same on Triton. ``documents`` does
the same for 8 packed documents per sequence against cuDNN given the equivalent dense mask; ``sweep`` times the
Mosaic kernels' candidate tiles at the last of ``--seqs``, each against cuDNN in the same run (``--head-dims``,
``--layout``).
Throughput counts the score pairs the mask keeps, as ``report_speed`` does. Exits 1 if a check fails, or a swept
tiling's result is not cuDNN's.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from experiments.bench_matmul import rel_err
from experiments.cli import csv_of, exit_with
from experiments.report_speed import _peer, kept_pairs
from experiments.timing import best_time
from pallas_kernels.kernel_inputs import LAYOUTS
from pallas_kernels.mosaic_attention import forward_candidates
from pallas_kernels.mosaic_backward_tiles import FUSED_BACKWARD_PRODUCTS, backward_candidates, backward_tiles
from pallas_kernels.targets import first_line

TOLERANCE = 2e-2  # relative L2 error of a bfloat16 attention output against the float32 reference
# speed's rows: the Mosaic kernels, the same with the backward summing dQ across programs, Triton's, cuDNN's
SPEED_IMPLS = ("mosaic", "mosaic_fused", "triton", "cudnn")


def check_cases() -> dict:
    """name -> (mask, T, S, H, K, E, score_mod)."""
    return {
        "causal": (pk.causal(), 1024, 1024, 4, 4, 128, None),
        "sliding_window(256)": (pk.sliding_window(256), 1024, 1024, 4, 4, 128, None),
        "prefix_lm(300)": (pk.prefix_lm(300), 1024, 1024, 4, 4, 64, None),
        "causal | global_tokens(4)": (pk.causal() | pk.global_tokens(4), 1024, 1024, 4, 4, 64, None),
        "full, GQA 8 on 2": (pk.full(), 1024, 1024, 8, 2, 128, None),
        "causal, T=1000 (ragged)": (pk.causal(), 1000, 1000, 4, 2, 128, None),
        "full, T=512 S=1024": (pk.full(), 512, 1024, 4, 4, 64, None),
        "causal, soft_cap(30)": (pk.causal(), 1024, 1024, 4, 4, 128, pk.soft_cap(30.0)),
        "causal, head dim 256": (pk.causal(), 1024, 1024, 2, 2, 256, None),
        "causal, relative_bias": (pk.causal(), 1024, 1024, 4, 2, 128, pk.relative_bias(_table(4, 32))),
        "causal & document(8)": (pk.causal() & pk.document(doc_ids(2, 1024, 8)), 1024, 1024, 4, 4, 128, None),
        "document(8), GQA 8 on 2": (pk.document(doc_ids(2, 1024, 8, seed=1)), 1024, 1024, 8, 2, 64, None),
        "causal & document(8), T=1000": (
            pk.causal() & pk.document(doc_ids(2, 1000, 8, seed=2)),
            1000,
            1000,
            4,
            2,
            128,
            None,
        ),
    }


def _table(H: int, n: int):
    return jnp.asarray(np.random.default_rng(7).normal(size=(H, n)), jnp.float32)


def _qkv(T: int, E: int, tokens: int, width: int):
    """(B, H, q, k, v): bfloat16 [B, H, T, E] inputs of ``tokens`` tokens per batch and ``width`` model width."""
    B, H = max(1, tokens // T), width // E
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=(B, H, T, E)), jnp.bfloat16) for _ in range(3))
    return B, H, q, k, v


def doc_ids(B: int, T: int, n_docs: int, seed: int = 0) -> np.ndarray:
    """[B, T] int32 segment ids: each row packs ``n_docs`` documents of seeded random lengths (each at least T / 4n)."""
    r = np.random.default_rng(seed)
    ids = np.empty((B, T), np.int32)
    for b in range(B):
        free = T - n_docs * (T // (4 * n_docs))
        cuts = np.sort(r.integers(0, free + 1, n_docs - 1)) + np.arange(1, n_docs) * (T // (4 * n_docs))
        ids[b] = np.searchsorted(cuts, np.arange(T), side="right")
    return ids


def causal_document_pairs(ids: np.ndarray) -> int:
    """Score pairs causal & document keeps over all rows: sum over documents of L (L + 1) / 2."""
    lengths = np.concatenate([np.bincount(row) for row in ids])
    return int((lengths * (lengths + 1) // 2).sum())


def _mosaic(bm, layout: str = "BHTE", **options):
    """The Mosaic kernels as a function of [B, H, T, E] q, k, v (and a score mod): with ``layout`` "BTHE" they take
    them in the model's layout, transposed outside the kernels, and give out back as [B, H, T, E]."""

    def attend(q, k, v, mod=None):
        kernels = functools.partial(pk.block_sparse_attention, block_mask=bm, score_mod=mod, lowering="mosaic")
        if layout == "BHTE":
            return kernels(q, k, v, **options)
        out, lse = kernels(*(x.swapaxes(1, 2) for x in (q, k, v)), layout=layout, **options)
        return out.swapaxes(1, 2), lse

    return attend


def _loss(fn, d_out, mod):
    """sum(fn(q, k, v, mod with ``arrays``) * d_out) as a function of (q, k, v, arrays)."""
    return lambda q, k, v, arrays: (fn(q, k, v, mod and mod.with_arrays(arrays)).astype(jnp.float32) * d_out).sum()


def _reference(q, k, v, mask, mod, d_out):
    """The float32 reference's (out, lse, grads to q, k, v and the mod's arrays), as one compiled program: run op by
    op, its dozens of primitives each compiled anew for a case's shapes took most of the check's time on a GPU."""
    arrays = mod.arrays() if mod is not None else ()

    def run(q, k, v, arrays):
        ref = _loss(lambda q, k, v, m: pk.reference_attention(q, k, v, mask, score_mod=m)[0], d_out, mod)
        m = mod and mod.with_arrays(arrays)
        return pk.reference_attention(q, k, v, mask, score_mod=m), jax.grad(ref, argnums=(0, 1, 2, 3))(q, k, v, arrays)

    return jax.jit(run)(*(x.astype(jnp.float32) for x in (q, k, v)), arrays)


def _grad_errors(q, k, v, bm, mod, want, d_out, deterministic: bool = True, layout: str = "BHTE") -> list[float]:
    """Relative L2 errors of dQ, dK, dV (Mosaic forward and backward; the Triton backward for a mod that captures
    arrays) against the float32 reference's ``want``, and of the gradients to the mod's captured arrays when it has
    some. Not ``deterministic``: the backward summing dQ across dK/dV's programs, where it takes the case."""
    arrays = mod.arrays() if mod is not None else ()
    attend = _mosaic(bm, layout, deterministic=deterministic)
    kernel = _loss(lambda q, k, v, m: attend(q, k, v, m)[0], d_out, mod)
    got = jax.jit(jax.grad(kernel, argnums=(0, 1, 2, 3)))(q, k, v, arrays)
    pairs = list(zip(got[:3], want[:3])) + list(zip(got[3], want[3]))
    return [rel_err(a, b) for a, b in pairs]


def run_check(layout: str = "BHTE", log=print) -> list[dict]:
    """Each case's output and gradients (both backwards) against the float32 reference; ``layout`` "BTHE": the
    kernels read and write the model's layout."""
    rows = []
    for name, (mask, T, S, H, K, E, mod) in check_cases().items():
        r = np.random.default_rng(len(rows))
        q = jnp.asarray(r.normal(size=(2, H, T, E)), jnp.bfloat16)
        k, v = (jnp.asarray(r.normal(size=(2, K, S, E)), jnp.bfloat16) for _ in range(2))
        bm = pk.make_block_mask(mask, T, S, pk.BlockSizes(128, 128))
        d_out = jax.random.normal(jax.random.key(1), q.shape, jnp.float32)
        try:
            out, lse = jax.jit(lambda q, k, v, bm=bm, mod=mod: _mosaic(bm, layout)(q, k, v, mod))(q, k, v)
            (ref_out, ref_lse), want = _reference(q, k, v, mask, mod, d_out)
            err = rel_err(out, ref_out)
            lse_err = float(jnp.max(jnp.abs(lse - ref_lse)))
            row = {"case": name, "layout": layout, "rel_error": err, "lse_max_error": lse_err}
            row["grad_rel_errors"] = _grad_errors(q, k, v, bm, mod, want, d_out, layout=layout)
            row["fused_grad_rel_errors"] = _grad_errors(
                q, k, v, bm, mod, want, d_out, deterministic=False, layout=layout
            )
            worst = max(err, *row["grad_rel_errors"], *row["fused_grad_rel_errors"])
            row["ok"] = worst < TOLERANCE and lse_err < 0.05 and bool(jnp.isfinite(out).all())
        except Exception as e:  # noqa: BLE001 - a failing case is recorded and the check goes on
            row = {"case": name, "ok": False, "error": first_line(e)}
        rows.append(row)
        detail = row.get("error") or f"out {row['rel_error']:.4f} grads " + " ".join(
            f"{e:.4f}" for e in row["grad_rel_errors"]
        ) + " fused " + " ".join(f"{e:.4f}" for e in row["fused_grad_rel_errors"])
        log(f"check {name:28s} {'ok  ' if row['ok'] else 'FAIL'} {detail}")
    return rows


def run_speed(
    seqs=(2048, 8192),
    head_dims=(64, 128),
    tokens=16384,
    width=2048,
    repeats=10,
    impls=SPEED_IMPLS,
    layout="BHTE",
    group=1,
    log=print,
) -> list[dict]:
    """``layout``: of the Pallas rows' q, k, v ("BTHE": the model's, which cuDNN's row reads too). ``group``: query
    heads per key / value head (GQA; the GPU report's ~1B model has 2)."""
    rows = []
    for T in seqs:
        for E in head_dims:
            B, H, q, k, v = _qkv(T, E, tokens, width)
            k, v = k[:, : H // group], v[:, : H // group]
            q_t, k_t, v_t = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
            pallas_args = (q, k, v) if layout == "BHTE" else (q_t, k_t, v_t)
            for mask_name, mask in {"full": pk.full(), "causal": pk.causal()}.items():
                bm = pk.make_block_mask(mask, T, T, pk.BlockSizes(128, 128))
                pallas = functools.partial(pk.block_sparse_attention, block_mask=bm, layout=layout)
                candidates = {
                    "mosaic": (lambda q, k, v, f=pallas: f(q, k, v, lowering="mosaic")[0], pallas_args),
                    "mosaic_fused": (  # the backward summing dQ across dK/dV's programs
                        lambda q, k, v, f=pallas: f(q, k, v, lowering="mosaic", deterministic=False)[0],
                        pallas_args,
                    ),
                    "triton": (lambda q, k, v, f=pallas: f(q, k, v, lowering="triton")[0], pallas_args),
                    "cudnn": (_peer("cudnn", mask_name, 0), (q_t, k_t, v_t)),
                }
                impls_here = {name: impl for name, impl in candidates.items() if name in impls}
                flops = kept_pairs(mask_name, T, 0) * B * H * E
                for impl, (fn, args) in impls_here.items():
                    row = {"T": T, "E": E, "B": B, "H": H, "K": H // group, "mask": mask_name, "impl": impl}
                    row["layout"] = layout
                    rows.append(_time_row(row, fn, args, flops, repeats, log))
    return rows


def run_documents(seqs=(2048, 8192), head_dims=(64, 128), tokens=16384, width=2048, n_docs=8, repeats=10, log=print):
    """causal & document (``n_docs`` per sequence) on the Mosaic and Triton kernels, against cuDNN given the same
    mask as a dense [B, 1, T, T] array (what a user of jax.nn.dot_product_attention would pass) and cuDNN's causal
    mask alone (more work than needed: its fastest path, for scale). Throughput counts the pairs the mask keeps."""
    rows = []
    for T in seqs:
        for E in head_dims:
            B, H, q, k, v = _qkv(T, E, tokens, width)
            ids = doc_ids(B, T, n_docs)
            mask = pk.causal() & pk.document(ids)
            bm = pk.make_block_mask(mask, T, T, pk.BlockSizes(128, 128))
            dense = jnp.asarray((ids[:, :, None] == ids[:, None, :]) & np.tril(np.ones((T, T), bool)))[:, None]
            bthe = tuple(x.transpose(0, 2, 1, 3) for x in (q, k, v))
            impls = {
                "mosaic": (lambda q, k, v: pk.block_sparse_attention(q, k, v, bm, lowering="mosaic")[0], (q, k, v)),
                "triton": (lambda q, k, v: pk.block_sparse_attention(q, k, v, bm, lowering="triton")[0], (q, k, v)),
                "cudnn_dense": (
                    lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=dense, implementation="cudnn"),
                    bthe,
                ),
                "cudnn_causal": (_peer("cudnn", "causal", 0), bthe),
            }
            flops = causal_document_pairs(ids) * H * E
            for impl, (fn, args) in impls.items():
                row = {"T": T, "E": E, "B": B, "H": H, "mask": f"causal & document({n_docs})", "impl": impl}
                rows.append(_time_row(row, fn, args, flops, repeats, log))
    return rows


def run_mods(T=4096, head_dims=(64, 128), tokens=16384, width=2048, repeats=10, log=print) -> list[dict]:
    """Causal attention with score mods on the Mosaic and Triton kernels: no mod, a soft-cap (elementwise) and a T5
    bias table of 32 buckets per head (captured arrays: the Mosaic kernels read the head's row, and dQ forms the
    table's gradient per query row), forward and forward + backward with the table's gradient left to XLA's sum of
    the kernels' parts."""
    rows = []
    for E in head_dims:
        B, H, q, k, v = _qkv(T, E, tokens, width)
        bm = pk.make_block_mask(pk.causal(), T, T, pk.BlockSizes(128, 128))
        flops = kept_pairs("causal", T, 0) * B * H * E
        for mod_name, mod in {
            "none": None,
            "soft_cap(30)": pk.soft_cap(30.0),
            "relative_bias(32)": pk.relative_bias(_table(H, 32)),
        }.items():
            for impl in ("mosaic", "triton"):
                fn = lambda q, k, v, mod=mod, impl=impl: pk.block_sparse_attention(  # noqa: E731
                    q, k, v, bm, score_mod=mod, lowering=impl
                )[0]
                row = {"T": T, "E": E, "B": B, "H": H, "mask": f"causal, {mod_name}", "impl": impl}
                rows.append(_time_row(row, fn, (q, k, v), flops, repeats, log))
    return rows


def _time_row(row: dict, fn, args, flops: int, repeats: int, log) -> dict:
    """``row`` with forward and forward + backward times and TFLOP/s (or the error)."""
    try:
        train = jax.grad(lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
        t_fwd = best_time(jax.jit(fn), *args, repeats=repeats)
        t_train = best_time(jax.jit(train), *args, repeats=repeats)
        row |= {
            "forward_ms": t_fwd * 1e3,
            "train_ms": t_train * 1e3,
            "forward_tflops": 4 * flops / t_fwd / 1e12,
            "train_tflops": 14 * flops / t_train / 1e12,
        }
        detail = f"forward {row['forward_tflops']:7.1f} fwd+bwd {row['train_tflops']:7.1f} TFLOP/s"
    except Exception as e:  # noqa: BLE001 - a failing row is recorded and the run goes on
        row["error"] = first_line(e)
        detail = f"FAILED {row['error']}"
    log(f"speed T={row['T']} E={row['E']} {row['mask']} {row['impl']} {detail}")
    return row


SWEEP_PASSES = ("forward", "backward", "fused")


def run_sweep(
    T=8192, head_dims=(64, 128), width=2048, tokens=16384, backward_top=4, repeats=10, layout="BHTE", log=print,
    on_row=lambda rows: None, passes=SWEEP_PASSES,
):  # fmt: skip
    """Every forward tiling (timed forward only) and the first ``backward_top`` backward tilings (timed forward +
    backward with the default forward) of the Mosaic kernels, full and causal masks; the same for the backward
    summing dQ across programs (``fused``). The first candidate of each list is what the kernels use today. Each
    (head dim, mask) starts with cuDNN's row (pass ``cudnn``: its forward and forward + backward), so every tiling
    has its peer in the same run, and each tiling's output (forward) or gradients (backward) are compared with cuDNN's
    on the same inputs (``err_vs_cudnn``, relative L2; over SWEEP_TOLERANCE the row says ok False): an option tried
    on a device for the first time is checked in the run that times it. ``layout``: the kernels' q, k, v (cuDNN reads
    [B, T, H, E]). ``on_row(rows)`` after every row: a sweep cut by a lease's timeout keeps what it timed.
    ``passes``: which of forward, backward and fused to time."""
    rows = []
    for E in head_dims:
        B, H, q, k, v = _qkv(T, E, tokens, width)
        bthe = tuple(x.transpose(0, 2, 1, 3) for x in (q, k, v))
        args = q, k, v = (q, k, v) if layout == "BHTE" else bthe
        for mask_name, mask in {"full": pk.full(), "causal": pk.causal()}.items():
            bm = pk.make_block_mask(mask, T, T, pk.BlockSizes(128, 128))
            flops = kept_pairs(mask_name, T, 0) * B * H * E
            peer = {"T": T, "E": E, "B": B, "H": H, "mask": mask_name, "impl": "cudnn", "pass": "cudnn"}
            cudnn = _peer("cudnn", mask_name, 0)
            rows.append(_time_row(peer, cudnn, bthe, flops, repeats, log))
            on_row(rows)
            wanted = {}  # cuDNN's output and gradients, [B, T, H, E], made when a pass first needs them
            fwd = forward_candidates(E, jnp.bfloat16, 128, 128)
            bwd = backward_candidates(E, jnp.bfloat16, 128, 128)[:backward_top]
            fused = backward_candidates(E, jnp.bfloat16, 128, 128, fused=True)[:backward_top]
            for kind, candidates in (("forward", fwd), ("backward", bwd), ("fused", fused)):
                if kind not in passes:
                    continue
                for rank, tiles in enumerate(candidates):
                    fn = functools.partial(_attend_with, bm, tiles, deterministic=kind != "fused", layout=layout)
                    if kind != "forward":
                        fn = jax.grad(lambda q, k, v, f=fn: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
                    row = {"T": T, "E": E, "mask": mask_name, "pass": kind, "rank": rank, "tiles": repr(tiles)}
                    row["layout"] = layout
                    try:
                        t = best_time(jax.jit(fn), *args, repeats=repeats)
                        row |= {"ms": t * 1e3, "tflops": (4 if kind == "forward" else 14) * flops / t / 1e12}
                        if base := peer.get("forward_ms" if kind == "forward" else "train_ms"):
                            row["vs_cudnn"] = base / row["ms"]
                        detail = f"{row['tflops']:7.1f} TFLOP/s" + (
                            f", {row['vs_cudnn']:.3f}x cuDNN" if "vs_cudnn" in row else ""
                        )
                        row["err_vs_cudnn"] = _error_against(cudnn, bthe, wanted, kind == "forward", fn, args, layout)
                        row["ok"] = row["err_vs_cudnn"] <= SWEEP_TOLERANCE
                        detail += f", err {row['err_vs_cudnn']:.1e}" + ("" if row["ok"] else " WRONG")
                    except Exception as e:  # noqa: BLE001
                        row["error"] = first_line(e)
                        detail = f"FAILED {row['error']}"
                    log(f"sweep E={E} {mask_name:6s} {kind:8s} #{rank} {tiles} {detail}")
                    rows.append(row)
                    on_row(rows)
    return rows


#: the largest relative L2 error of a tiling's output or gradients against cuDNN's the sweep accepts (bfloat16
#: kernels against a bfloat16 peer: the check's tolerance, ``run_check``)
SWEEP_TOLERANCE = 0.02


def _error_against(cudnn, bthe, wanted: dict, forward: bool, fn, args, layout: str) -> float:
    """The largest relative L2 error of ``fn(*args)`` (the output, or the gradients) against cuDNN's on the same
    inputs, each in [B, T, H, E]; cuDNN's kept in ``wanted``."""
    key = "forward" if forward else "grads"
    if key not in wanted:
        peer = cudnn if forward else jax.grad(lambda q, k, v: cudnn(q, k, v).astype(jnp.float32).sum(), (0, 1, 2))
        wanted[key] = jax.jit(peer)(*bthe)
    got = jax.jit(fn)(*args)
    pairs = [(got, wanted[key])] if forward else list(zip(got, wanted[key]))
    return max(rel_err(g.swapaxes(1, 2) if layout == "BHTE" else g, w) for g, w in pairs)


def _attend_with(bm, tiles, q, k, v, deterministic=True, layout="BHTE"):
    return pk.block_sparse_attention(q, k, v, bm, tiles=tiles, deterministic=deterministic, layout=layout)[0]


def ratios(rows: list[dict]) -> list[dict]:
    """Per (T, E, mask): Mosaic / cuDNN and Mosaic / Triton, forward and forward + backward; against cuDNN also the
    backward alone (its time: forward + backward less forward) and the backward's products per second, the Mosaic
    backward making ``BackwardTiles.products`` per pair to cuDNN's five (it sums dQ across programs). The same for
    the Mosaic backward summing dQ across programs (impl ``mosaic_fused``), its keys prefixed ``fused_``."""
    out = []
    keys = sorted({(r["T"], r["E"], r["mask"]) for r in rows})
    for T, E, mask in keys:
        by = {r["impl"]: r for r in rows if (r["T"], r["E"], r["mask"]) == (T, E, mask) and "forward_tflops" in r}
        if "mosaic" not in by and "mosaic_fused" not in by:
            continue
        entry = {"T": T, "E": E, "mask": mask}
        for mine, prefix, fused in (("mosaic", "", False), ("mosaic_fused", "fused_", True)):
            if mine not in by:
                continue
            for peer in ("cudnn", "triton", "cudnn_dense", "cudnn_causal"):
                if peer in by:
                    for key in ("forward_tflops", "train_tflops"):
                        entry[f"{prefix}{key.split('_')[0]}_vs_{peer}"] = by[mine][key] / by[peer][key]
            if "cudnn" in by and all("train_ms" in by[i] for i in (mine, "cudnn")):
                theirs, ours = (by[i]["train_ms"] - by[i]["forward_ms"] for i in ("cudnn", mine))
                # the fused backward takes head dims 64 and 128; at 256 ``mosaic_fused`` runs the two kernels
                tiles = backward_tiles(E, jnp.bfloat16, 128, 128, fused=fused)
                tiles = tiles or backward_tiles(E, jnp.bfloat16, 128, 128)
                entry[f"{prefix}backward_vs_cudnn"] = theirs / ours
                entry[f"{prefix}backward_products_vs_cudnn"] = theirs / ours * tiles.products / FUSED_BACKWARD_PRODUCTS
        out.append(entry)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.hopper_attention", description=__doc__.split("\n")[0])
    p.add_argument("--only", default="check,speed", help="check, speed, mods, documents, sweep, comma-separated")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--impls", default=",".join(SPEED_IMPLS), help="speed rows to time, comma-separated")
    p.add_argument(
        "--head-dims", type=csv_of(int, (64, 128, 256)), default=(64, 128), help="speed's and mods', comma-separated"
    )
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="BHTE",
        help="check's and speed's Pallas kernels: q, k, v as [B, H, T, E] or the model's [B, T, H, E] (which speed's "
        "cuDNN row reads)",
    )
    p.add_argument("--seqs", type=csv_of(int), default=(2048, 8192), help="speed's T, comma-separated (2048,8192)")
    p.add_argument(
        "--group", type=int, default=1, help="speed's query heads per key / value head (GQA; the ~1B step's: 2)"
    )
    p.add_argument(
        "--passes",
        type=csv_of(str, SWEEP_PASSES),
        default=SWEEP_PASSES,
        help="sweep's passes, comma-separated: forward, backward, fused (all)",
    )
    args = p.parse_args(argv)
    only = set(args.only.split(","))
    if not only or only - {"check", "speed", "mods", "documents", "sweep"}:
        print(
            f"hopper_attention: error: --only {args.only!r}: give check, speed, mods, documents or sweep",
            file=sys.stderr,
        )
        return 2
    impls = tuple(args.impls.split(","))
    if unknown := [i for i in impls if i not in SPEED_IMPLS]:
        print(f"hopper_attention: error: --impls {unknown[0]!r}: choose from {', '.join(SPEED_IMPLS)}", file=sys.stderr)
        return 2
    if args.group < 1 or any((2048 // E) % args.group for E in args.head_dims) or min(args.seqs) < 1:
        print(
            f"hopper_attention: error: --group {args.group} must divide the head count of every head dim "
            f"({', '.join(str(2048 // E) for E in args.head_dims)}) and --seqs be positive",
            file=sys.stderr,
        )
        return 2
    if jax.devices()[0].platform != "gpu":
        print(
            f"hopper_attention: error: no GPU here (the default device is {jax.devices()[0].platform}); the Mosaic "
            "kernels' CPU checks are tests/test_mosaic_attention.py",
            file=sys.stderr,
        )
        return 2
    print(f"hopper_attention: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}

    def save():
        # After every part, so a run stopped by a lease's timeout keeps the parts it finished.
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    if "check" in only:
        result["check"] = run_check(layout=args.layout)
        save()
    if "speed" in only:
        result["speed"] = run_speed(args.seqs, args.head_dims, impls=impls, layout=args.layout, group=args.group)
        result["ratios"] = ratios(result["speed"])
        save()
    if "mods" in only:
        result["mods"] = run_mods(head_dims=args.head_dims)
        result["ratios"] = result.get("ratios", []) + ratios(result["mods"])
        save()
    if "documents" in only:
        result["documents"] = run_documents()
        result["ratios"] = result.get("ratios", []) + ratios(result["documents"])
        save()
    for r in result.get("ratios", []):
        print("ratio", json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
    if "sweep" in only:

        def keep(rows):
            result["sweep"] = rows
            save()

        run_sweep(T=args.seqs[-1], head_dims=args.head_dims, layout=args.layout, on_row=keep, passes=args.passes)
    checked = result.get("check", []) + [r for r in result.get("sweep", []) if "ok" in r]
    return 0 if all(r["ok"] for r in checked) else 1


if __name__ == "__main__":
    exit_with(main())
