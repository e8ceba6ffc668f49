"""The data layer: token files on disk -> deterministic, resumable batches.

`tokenizer` (bytes), `token_file` (memmapped on-disk format), `corpus` (the
default corpus built from Python's stdlib), `prepare` (CLI: text -> token file),
`iterator` (seeded batches whose position is three integers). Imports numpy
only, never jaxlm: higher layers depend on this one, not the reverse.
"""

from data.corpus import default_corpus
from data.iterator import Batch, BatchIterator, SeededBatchIterator, eval_batches, segment_ids, split_train_val
from data.token_file import TokenFile, TokenFileError, write_token_file
from data.tokenizer import BYTE_TOKENIZER_VOCAB_SIZE, EOS_ID, decode, encode

__all__ = [
    "BYTE_TOKENIZER_VOCAB_SIZE", "EOS_ID", "Batch", "BatchIterator", "SeededBatchIterator", "TokenFile",
    "TokenFileError", "decode", "default_corpus", "encode", "eval_batches", "segment_ids", "split_train_val",
    "write_token_file",
]
