"""Scoring held-out text with a trained model: mean next-token loss, perplexity and bits per byte.

The token stream is cut as training cuts it: windows of seq_len + 1 tokens at a stride of seq_len, so every token
after the first is a target exactly once, seen with the context its window gives it (up to seq_len - 1 tokens).
Rows go through one compiled program at one shape (the last batch padded, its padding masked), so a file of any
length compiles once. Bits per byte divides the summed loss by the UTF-8 bytes the targets stand for, as the
trainer's eval does, so it compares models across tokenizers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator

import jax
import numpy as np
from flax import nnx

from data.iterator import batch_from_windows
from jaxlm.generate import placement_of, traced_in
from jaxlm.model import Transformer
from jaxlm.train import Batch, cross_entropy_sums
from pallas_kernels.mask_spec import parse_mask, uses_documents


@dataclasses.dataclass(frozen=True)
class Score:
    tokens: int  # targets scored
    nats: float  # their summed next-token loss
    bytes: int  # the UTF-8 bytes they stand for (special tokens: 0)

    @property
    def loss(self) -> float:
        return self.nats / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def bits_per_byte(self) -> float | None:
        return self.nats / (math.log(2) * self.bytes) if self.bytes else None

    def record(self) -> dict:
        return {
            "tokens": self.tokens,
            "bytes": self.bytes,
            "loss": self.loss,
            "perplexity": self.perplexity,
            "bits_per_byte": self.bits_per_byte,
        }


def text_stream(tokenizer, documents: Iterable[str], limit: int = 0) -> np.ndarray:
    """The documents as token data holds them ([BOS] ids EOS each), after one EOS: every document's first token
    is then scored after an EOS, as it is in training, and the stream's first token is never a target. `limit`:
    the first `limit` tokens only, reading no more documents than they need."""
    eos = np.asarray([tokenizer.eos_id], np.int64)
    parts, length = [eos], 1
    for text in documents:
        if limit and length >= limit:
            break
        parts += [np.asarray(tokenizer.document(text), np.int64), eos]
        length += len(parts[-2]) + 1
    stream = np.concatenate(parts)
    return stream[:limit] if limit else stream


def num_windows(num_tokens: int, seq_len: int) -> int:
    return -(-(num_tokens - 1) // seq_len) if num_tokens > 1 else 0


def batches(stream, seq_len: int, batch_size: int, pad_id: int, eos_id: int | None = None) -> Iterator[Batch]:
    """Batches of `batch_size` windows covering every target of `stream` once; the last window and batch are
    filled with `pad_id` and masked. `eos_id`: batches carry segment ids (the `document` attention mask)."""
    total, window = len(stream), seq_len + 1
    starts = np.arange(num_windows(total, seq_len)) * seq_len
    for first in range(0, len(starts), batch_size):
        rows = np.full((batch_size, window), pad_id, np.int64)
        mask = np.zeros((batch_size, seq_len), np.float32)
        for r, start in enumerate(starts[first : first + batch_size]):
            piece = np.asarray(stream[start : start + window])
            rows[r, : len(piece)] = piece
            mask[r, : len(piece) - 1] = 1.0
        batch = batch_from_windows(rows, eos_id)
        batch["loss_mask"] = mask
        yield batch


def score(
    model: Transformer,
    stream,
    token_bytes: np.ndarray,
    *,
    seq_len: int,
    batch_size: int,
    pad_id: int,
    rules: dict | None = None,
    progress=None,
) -> Score:
    """The model's loss over `stream` (a 1-D array of token ids, memmap or in memory). `token_bytes` [vocab]:
    the UTF-8 bytes of each id (TextTokenizer.token_bytes). `progress(batches_done, batches_total)` if given."""
    if len(stream) < 2:
        raise ValueError(f"{len(stream)} token(s) leave nothing to score; give at least 2")
    cfg = model.cfg
    if seq_len > cfg.max_seq_len:
        raise ValueError(f"seq_len {seq_len} is longer than the model's max_seq_len {cfg.max_seq_len}")
    if int(np.max(stream)) >= len(token_bytes):
        raise ValueError(f"token id {int(np.max(stream))} is outside the tokenizer's {len(token_bytes)} ids")
    graphdef, params = nnx.split(model)
    where = placement_of(params, rules)

    @jax.jit
    def loss_sums(params, batch):
        with traced_in(where):
            logits_BTV = nnx.merge(graphdef, params)(batch["inputs"], segment_ids_BT=batch.get("segment_ids"))
            return cross_entropy_sums(logits_BTV, batch["targets"], batch["loss_mask"])

    eos_id = pad_id if uses_documents(parse_mask(cfg.attention_mask)) else None
    total_batches = -(-num_windows(len(stream), seq_len) // batch_size)
    nats = tokens = num_bytes = 0
    for done, batch in enumerate(batches(stream, seq_len, batch_size, pad_id, eos_id), start=1):
        loss_sum, count = jax.device_get(loss_sums(params, batch))
        nats, tokens = nats + float(loss_sum), tokens + int(count)
        num_bytes += int((token_bytes[batch["targets"]] * batch["loss_mask"]).sum())
        if progress is not None:
            progress(done, total_batches)
    return Score(tokens, nats, num_bytes)
