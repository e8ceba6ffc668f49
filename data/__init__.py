"""The data layer: token files on disk -> deterministic, resumable batches.

`tokenizer` (bytes), `text_tokenizer` (byte or any tokenizer.json), `token_file`
(memmapped single-file format), `token_shards` (the sharded format and `open_tokens`
for both), `corpus` (the default corpus built from Python's stdlib), `prepare` (CLI:
text in many formats -> token shards, with `text_sources` and `shard_worker`),
`train_tokenizer` (CLI: a byte-level BPE),
`iterator` (the simple seeded batches), and the clairvoyant loader: `access_plan`
(the seed's whole future), `cache_plan` (Belady placement across processes),
`tiers`, `peers`, `sources` (sharded / throttled datasets), `perf_model` (per-tier timings:
routing and the keep-up prediction), `loader`; `mixture` (several datasets at weights and stages as one
plan) and `mixture_data`. Imports
numpy (and jax only inside `loader.jax_exchange`), never jaxlm: higher layers
depend on this one, not the reverse.
"""

from data.access_plan import AccessPlan, FeistelPermutation
from data.corpus import default_corpus
from data.iterator import Batch, BatchIterator, SeededBatchIterator, eval_batches, segment_ids, split_train_val
from data.loader import ClairvoyantLoader, LoaderError, file_exchange, jax_exchange
from data.perf_model import TierModel
from data.sources import (
    SampleSource,
    ShardedSource,
    SourceError,
    ThrottledSource,
    TokenWindowSource,
    open_source,
    write_shards,
)
from data.token_file import TokenFile, TokenFileError, write_token_file
from data.token_shards import ShardedTokens, TokenShards, open_tokens
from data.tokenizer import BYTE_TOKENIZER_VOCAB_SIZE, EOS_ID, decode, encode

__all__ = [
    "AccessPlan",
    "ClairvoyantLoader",
    "FeistelPermutation",
    "LoaderError",
    "SampleSource",
    "ShardedSource",
    "SourceError",
    "ThrottledSource",
    "TierModel",
    "TokenWindowSource",
    "file_exchange",
    "jax_exchange",
    "open_source",
    "write_shards",
    "BYTE_TOKENIZER_VOCAB_SIZE",
    "EOS_ID",
    "Batch",
    "BatchIterator",
    "SeededBatchIterator",
    "ShardedTokens",
    "TokenFile",
    "TokenFileError",
    "TokenShards",
    "decode",
    "default_corpus",
    "encode",
    "eval_batches",
    "open_tokens",
    "segment_ids",
    "split_train_val",
    "write_token_file",
]
