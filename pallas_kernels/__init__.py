"""Pallas kernels (block-sparse attention, low-precision matmuls) with their masks, references and custom_vjp
wrappers. Imports nothing from jaxlm; jaxlm.attention picks an implementation from here by config.

Shape suffixes follow the legend in docs/architecture.md; a module that adds kernel-only letters (block sizes, block
list slots, matmul dims) lists them in its own docstring."""

from .block_mask import EMPTY, FULL, PARTIAL, BlockMask, BlockSizes, make_block_mask
from .masks import (
    Mask,
    ScoreMod,
    alibi,
    alibi_slopes,
    at_positions,
    causal,
    chain,
    chunked_causal,
    document,
    full,
    global_tokens,
    prefix_lm,
    sliding_window,
    soft_cap,
)
from .pallas_attention import block_sparse_attention
from .reference import reference_attention
from .score_tables import learned_alibi, relative_bias
from .xla_attention import block_sparse_attention_xla
from .xla_tiled_attention import tiled_attention_xla

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "BlockMask",
    "BlockSizes",
    "make_block_mask",
    "Mask",
    "ScoreMod",
    "alibi",
    "alibi_slopes",
    "at_positions",
    "causal",
    "chain",
    "chunked_causal",
    "document",
    "full",
    "global_tokens",
    "prefix_lm",
    "sliding_window",
    "soft_cap",
    "learned_alibi",
    "relative_bias",
    "reference_attention",
    "block_sparse_attention",
    "block_sparse_attention_xla",
    "tiled_attention_xla",
]
