"""Which tiles and lowering the Mosaic GPU attention kernels take (``mosaic_backward_tiles``, ``gpu_tiles``), and
what they refuse, saying why: no kernel runs (the kernels themselves: tests/test_mosaic_attention.py)."""

import dataclasses
import logging

import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from pallas_kernels.gpu_tiles import mosaic_lowerings
from pallas_kernels.kernel_mask import split_documents
from pallas_kernels.mosaic_attention import MosaicTiles, forward_candidates, mosaic_tiles
from pallas_kernels.mosaic_backward_tiles import (
    BackwardTiles,
    backward_candidates,
    backward_tiles,
    supports_backward,
)

BLOCKS = pk.BlockSizes(128, 128)
_FUSED = BackwardTiles(64, 64, 2, 64, 64, 2, fused_dq=True)


@pytest.mark.parametrize(
    "dtype, E, blocks, reason",
    [
        (jnp.float32, 64, BLOCKS, "dtype float32"),
        (jnp.bfloat16, 96, BLOCKS, "head dim 96"),
        (jnp.bfloat16, 64, pk.BlockSizes(64, 128), "blocks 64x128"),
    ],
)
def test_unsupported_cases_are_refused_with_the_reason(dtype, E, blocks, reason):
    q = jnp.zeros((1, 1, 128, E), dtype)
    bm = pk.make_block_mask(pk.causal(), 128, 128, blocks)
    with pytest.raises(ValueError, match=f"Mosaic GPU forward cannot take .*{reason}"):
        pk.block_sparse_attention(q, q, q, bm, lowering="mosaic")


_TABLE = pk.relative_bias(jnp.zeros((1, 8), jnp.float32))


@pytest.mark.parametrize(
    "tiles, options, message",
    [
        (MosaicTiles(128, 128, 2), {}, "do not fit blocks 128x128"),
        (BackwardTiles(64, 96, 2, 64, 128, 2), {}, "do not fit blocks 128x128"),
        (MosaicTiles(64, 128, 2), {"lowering": "triton"}, "Mosaic tiles were given with lowering='triton'"),
        (_FUSED, {}, r"sums dQ in no fixed order; pass deterministic=False"),
        (
            _FUSED,
            {"deterministic": False, "score_mod": _TABLE},
            r"BackwardTiles\(fused_dq=True\) cannot take a score mod's captured arrays",
        ),
    ],
)
def test_mosaic_tiles_that_cannot_run_are_refused(tiles, options, message):
    q = jnp.zeros((1, 1, 128, 64), jnp.bfloat16)
    bm = pk.make_block_mask(pk.causal(), 128, 128, BLOCKS)
    with pytest.raises(ValueError, match=message):
        pk.block_sparse_attention(q, q, q, bm, tiles=tiles, **options)


def test_fused_backward_tiles_fit_beside_dq_s_stage_and_are_chosen_only_when_not_deterministic(monkeypatch, caplog):
    """No kernel runs: the fused backward's tilings (5 products a pair, not 7) at head dims 64 and 128 fit shared
    memory with dS^T double-buffered and dS K's float32 stage; none at 256, with captured arrays, or at 128 with two
    document / position slots (they spilled registers), where (as in the deterministic default) the two kernels'
    tiles are chosen."""
    for E in (64, 128):
        fused = backward_candidates(E, jnp.bfloat16, 128, 128, fused=True)
        assert fused and all(t.fused_dq and t.products == 5 for t in fused)
    assert backward_candidates(128, jnp.bfloat16, 128, 128, fused=True)[0].dkv_stages == 2  # 193 KB of 223
    assert backward_candidates(256, jnp.bfloat16, 128, 128, fused=True) == []
    assert backward_candidates(128, jnp.bfloat16, 128, 128, entries=8, fused=True) == []
    assert backward_candidates(128, jnp.bfloat16, 128, 128, slots=1, groups=2, fused=True)
    assert backward_candidates(128, jnp.bfloat16, 128, 128, slots=2, fused=True) == []
    assert backward_candidates(64, jnp.bfloat16, 128, 128, slots=2, groups=2, fused=True)
    assert backward_candidates(64, jnp.bfloat16, 128, 128, slots=1, groups=2, fused=True)
    with pytest.raises(ValueError, match="dQ is summed in dK/dV by two warpgroups over the whole head dim"):
        BackwardTiles(64, 64, 2, 64, 64, 2, consumers=1, dkv_parts=2, fused_dq=True)

    static = _Static256(None)
    static.backend = "gpu"
    monkeypatch.setattr("pallas_kernels.gpu_tiles._logged", set())  # which ran is logged once a process
    with caplog.at_level(logging.INFO, logger="jaxlm.kernels"):
        for E, deterministic, fused in ((128, True, False), (128, False, True), (256, False, False)):
            chosen = mosaic_lowerings(static, "mosaic", jnp.bfloat16, E, deterministic=deterministic)
            assert chosen["mosaic_bwd"].fused_dq == fused, (E, deterministic)
    assert "backward summing dQ across programs on Mosaic GPU (sm_90)" in caplog.text
    assert "block_sparse_attention backward on Mosaic GPU (sm_90)" in caplog.text


def test_tiles_make_room_for_captured_arrays():
    """No kernel runs: with a mod's captured arrays the forward walks 64-wide kv tiles at head dim 128 (128 without;
    a table's bucket tile takes registers), the backward 64-wide tiles at head dim 64 too (dQ's gradient tile takes
    registers), as with two document / position slots (their id tiles take registers); at head dim 128, 64 entries
    per head and a document slot, dQ and dK/dV keep the rings they have without them (dQ's gradient tile goes from
    registers to global memory, not through shared memory)."""
    assert [mosaic_tiles(E, jnp.bfloat16, 128, 128, n).kv for E in (64, 128) for n in (0, 33)] == [128, 128, 128, 64]
    # the table's pick takes turns in a CTA per program; the sweep's list follows it with each width's deepest ring
    # without turns, then the pick in resident CTAs, one per SM, then the other rings
    candidates = forward_candidates(64, jnp.bfloat16, 128, 128)
    first = mosaic_tiles(64, jnp.bfloat16, 128, 128)
    assert first.turns and not first.ctas
    assert candidates[:4] == [
        first,
        MosaicTiles(64, 128, 4, turns=False),
        MosaicTiles(64, 64, 4, turns=False),
        dataclasses.replace(first, ctas=132),
    ]
    assert all(t.turns and not t.ctas for t in candidates[4:])
    # the backward's lists (head dims 64 and 128): dK/dV in resident CTAs right after the pick
    for fused in (False, True):
        listed = backward_candidates(128, jnp.bfloat16, 128, 128, fused=fused)
        assert listed[1] == dataclasses.replace(listed[0], ctas=132) and not any(t.ctas for t in listed[2:])
    assert not any(t.ctas for t in backward_candidates(256, jnp.bfloat16, 128, 128))

    plain64, table64 = (backward_tiles(64, jnp.bfloat16, 128, 128, entries=n) for n in (0, 33))
    assert (plain64.dq_kv, plain64.dkv_q, table64.dq_kv, table64.dkv_q) == (128, 128, 64, 64)
    one, two = (backward_tiles(64, jnp.bfloat16, 128, 128, slots=n) for n in (1, 2))  # two slots: two id tile pairs
    assert (one.dq_kv, one.dkv_q, two.dq_kv, two.dkv_q) == (128, 128, 64, 64)
    plain = backward_tiles(128, jnp.bfloat16, 128, 128)
    wide = backward_tiles(128, jnp.bfloat16, 128, 128, slots=1, entries=64, groups=8)
    assert (plain.dq_stages, wide.dq_stages) == (4, 4) and wide.dkv_stages == plain.dkv_stages


def test_head_dim_256_takes_one_consumer_and_two_dkv_parts_and_with_arrays_two_dq_parts():
    """No kernel runs: at head dim 256 the backward's one tiling is one 64-row consumer warpgroup, 64-wide tiles,
    two-slot rings (its 192 KB of tiles leave no room for a third), dK/dV in two halves; with a document slot too;
    with a T5 table's 32 entries dQ in two halves as well (its gradient tile beside the whole accumulator spilled
    registers), and with a table chained with slopes (33 entries: a 64-wide gradient tile); that beside a document
    slot's ids spilled registers: Triton, saying why."""
    want = BackwardTiles(64, 64, 2, 64, 64, 2, consumers=1, dkv_parts=2)
    assert backward_candidates(256, jnp.bfloat16, 128, 128) == [want]
    assert backward_candidates(256, jnp.bfloat16, 128, 128, slots=1, groups=4) == [want]
    table = dataclasses.replace(want, dq_parts=2)
    assert backward_candidates(256, jnp.bfloat16, 128, 128, entries=32, groups=2) == [table]
    assert table.products == 11 and want.products == 9
    assert backward_candidates(192, jnp.bfloat16, 128, 128) == []
    with pytest.raises(ValueError, match="BackwardTiles: consumers, dkv_parts and dq_parts are 1 or 2"):
        BackwardTiles(64, 64, 2, 64, 64, 2, consumers=3)
    assert supports_backward(_Static256(pk.relative_bias(jnp.zeros((2, 32)))), jnp.bfloat16, 256) is None
    chained = pk.chain(pk.relative_bias(jnp.zeros((2, 32))), pk.learned_alibi(jnp.zeros(2)))  # 33 entries
    assert backward_candidates(256, jnp.bfloat16, 128, 128, entries=33, groups=2) == [table]
    assert supports_backward(_Static256(chained), jnp.bfloat16, 256) is None
    documents = _Static256(chained, pk.causal() & pk.document(jnp.zeros((1, 128), jnp.int32)))
    assert "1 document / position slots and 33 captured" in supports_backward(documents, jnp.bfloat16, 256)
    assert supports_backward(_Static256(None), jnp.bfloat16, 256) is None


class _Static256:
    """What supports_backward reads of a kernel's static description."""

    def __init__(self, score_mod, mask=None):
        self.score_mod, self.groups, self.block_q, self.block_kv = score_mod, 1, 128, 128
        self.template = split_documents(mask)[0] if mask is not None else pk.causal()
