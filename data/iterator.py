"""Deterministic, seeded batches whose position is a few integers.

The token stream is cut into fixed windows; each epoch visits them in a
permutation drawn from (seed, epoch). A batch is therefore a pure function of
(seed, epoch, batch_in_epoch), so resuming from a checkpoint is O(1) with no
replay, and every process computes the same global batch and keeps its rows.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from data.access_plan import checked_rows, process_rows
from data.token_shards import ShardedTokens

Batch = dict[str, np.ndarray]  # inputs/targets [B, T] int32, loss_mask [B, T] float32, segment_ids [B, T] int32


@runtime_checkable
class BatchIterator(Protocol):
    """What the trainer needs from a loader; a clairvoyant prefetcher can replace it."""

    def __next__(self) -> Batch: ...
    def __iter__(self): ...
    def get_state(self) -> dict[str, int]: ...
    def set_state(self, state: dict[str, int]) -> None: ...


def as_token_array(tokens):
    """`tokens` as an array that indexes like a 1-D ndarray: memmaps and sharded token data stay lazy (read only
    what a batch indexes), anything else (a list) becomes an ndarray."""
    return tokens if isinstance(tokens, (np.ndarray, ShardedTokens)) else np.asarray(tokens)


def num_windows(start: int, stop: int, seq_len: int) -> int:
    """Non-overlapping windows of seq_len + 1 tokens (consecutive ones share one token)."""
    return max(0, (stop - start - 1) // seq_len)


def split_train_val(num_tokens: int, val_fraction: float, seq_len: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Splits [0, num_tokens) into train and validation (the stream's last fraction).

    Returns ((train_start, train_stop), (val_start, val_stop)); the splits share no
    token. val_fraction=0 gives the empty validation range (num_tokens, num_tokens).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    window = seq_len + 1
    num_val = int(num_tokens * val_fraction)
    if val_fraction > 0 and num_val < window:
        raise ValueError(
            f"val_fraction={val_fraction} of {num_tokens} tokens gives {num_val} validation tokens, "
            f"fewer than one window of seq_len+1={window}"
        )
    num_train = num_tokens - num_val
    if num_train < window:
        raise ValueError(
            f"{num_tokens} tokens leave {num_train} for training after val_fraction={val_fraction}, "
            f"fewer than one window of seq_len+1={window}"
        )
    return (0, num_train), (num_train, num_tokens)


def segment_ids(inputs_BT: np.ndarray, eos_id: int) -> np.ndarray:
    """Document index of every input token within its window: an EOS ends its document, the next token starts one.

    Feeds the model's ``document`` attention mask (packed sequences attend only within their document)."""
    is_eos = inputs_BT == eos_id
    return (np.cumsum(is_eos, axis=1) - is_eos).astype(np.int32)


def _gather(tokens: np.ndarray, window_ids_B: np.ndarray, start: int, seq_len: int, eos_id: int | None) -> Batch:
    """Reads windows with one fancy index of shape [B, T+1] (one pass over the memmap)."""
    index_BT1 = start + window_ids_B[:, None].astype(np.int64) * seq_len + np.arange(seq_len + 1)
    return batch_from_windows(np.asarray(tokens[index_BT1]), eos_id)


def batch_from_windows(windows_BT1: np.ndarray, eos_id: int | None) -> Batch:
    """Windows of seq_len + 1 tokens -> a training batch (inputs, next-token targets, mask, documents)."""
    windows_BT1 = np.asarray(windows_BT1).astype(np.int32)
    inputs_BT = np.ascontiguousarray(windows_BT1[:, :-1])
    batch = {
        "inputs": inputs_BT,
        "targets": np.ascontiguousarray(windows_BT1[:, 1:]),
        "loss_mask": np.ones(inputs_BT.shape, np.float32),
    }
    if eos_id is not None:
        batch["segment_ids"] = segment_ids(inputs_BT, eos_id)
    return batch


def _check_region(tokens, start: int, stop: int | None, seq_len: int, batch_size: int) -> tuple[int, int, int]:
    stop = len(tokens) if stop is None else stop
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got batch_size={batch_size} seq_len={seq_len}")
    if not 0 <= start <= stop <= len(tokens):
        raise ValueError(f"need 0 <= start <= stop <= len(tokens), got start={start} stop={stop} len={len(tokens)}")
    n = num_windows(start, stop, seq_len)
    if n < batch_size:
        raise ValueError(
            f"tokens[{start}:{stop}] ({stop - start} tokens) hold {n} windows of seq_len={seq_len}, "
            f"fewer than batch_size={batch_size}"
        )
    return start, stop, n


class SeededBatchIterator:
    """Infinite shuffled batches over tokens[start:stop]; `batch_size` is global.

    Epoch e visits windows in `default_rng([seed, e]).permutation(num_windows)`,
    B at a time, dropping the remainder. Each call returns rows [start, stop) of
    the global batch: process p of P gets [p*B/P, (p+1)*B/P), unless `set_rows`
    (which a multi-process trainer calls with the rows its devices hold) says
    otherwise. Rows do not affect the state: every process keeps the same position.
    """

    def __init__(
        self,
        tokens,
        *,
        batch_size: int,
        seq_len: int,
        seed: int,
        start: int = 0,
        stop: int | None = None,
        process_index: int = 0,
        process_count: int = 1,
        eos_id: int | None = None,
    ):
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.tokens = as_token_array(tokens)
        self.start, self.stop, self.num_windows = _check_region(self.tokens, start, stop, seq_len, batch_size)
        self.batch_size, self.seq_len, self.seed, self.eos_id = batch_size, seq_len, seed, eos_id
        self.set_rows(*process_rows(batch_size, process_index, process_count))
        self.batches_per_epoch = self.num_windows // batch_size
        self.epoch = self.batch_in_epoch = 0
        self._perm_epoch, self._perm = -1, None

    def set_rows(self, start: int, stop: int) -> None:
        """Return rows [start, stop) of each global batch from now on."""
        start, stop = checked_rows(start, stop, self.batch_size)
        self.rows = (start, stop)
        self.local_batch_size = self.rows[1] - self.rows[0]

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._perm_epoch = epoch
        return self._perm

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        first = self.batch_in_epoch * self.batch_size + self.rows[0]
        window_ids_B = self._permutation(self.epoch)[first : first + self.local_batch_size]
        batch = _gather(self.tokens, window_ids_B, self.start, self.seq_len, self.eos_id)
        self.skip()
        return batch

    def skip(self) -> None:
        """Moves past one batch without reading it (a process that holds none of its rows)."""
        self.batch_in_epoch += 1
        if self.batch_in_epoch == self.batches_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def get_state(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def set_state(self, state: dict[str, int]) -> None:
        missing = {"seed", "epoch", "batch_in_epoch"} - set(state)
        if missing:
            raise ValueError(f"iterator state lacks {sorted(missing)}: {state}")
        seed, epoch, batch = (int(state[k]) for k in ("seed", "epoch", "batch_in_epoch"))
        if seed != self.seed:
            raise ValueError(f"iterator state has seed {seed} but this iterator was built with seed {self.seed}")
        if epoch < 0 or not 0 <= batch < self.batches_per_epoch:
            raise ValueError(
                f"iterator state epoch={epoch} batch_in_epoch={batch} is out of range "
                f"({self.batches_per_epoch} batches per epoch)"
            )
        self.epoch, self.batch_in_epoch = epoch, batch


def eval_batches(
    tokens,
    *,
    batch_size: int,
    seq_len: int,
    start: int,
    stop: int,
    max_batches: int,
    process_index: int = 0,
    process_count: int = 1,
    eos_id: int | None = None,
) -> list[Batch]:
    """Sequential, unshuffled batches from tokens[start:stop]: the same every eval."""
    tokens = as_token_array(tokens)
    start, stop, n = _check_region(tokens, start, stop, seq_len, batch_size)
    lo, hi = process_rows(batch_size, process_index, process_count)
    if max_batches < 1:
        raise ValueError(f"max_batches must be >= 1, got {max_batches}")
    batches = []
    for b in range(min(max_batches, n // batch_size)):
        batches.append(_gather(tokens, np.arange(b * batch_size + lo, b * batch_size + hi), start, seq_len, eos_id))
    return batches


def validation_batches(d, tokens, start: int, stop: int, eos_id: int | None) -> list[Batch]:
    """The eval batches a run's data section `d` (DataConfig's fields) asks for from tokens[start:stop]."""
    return eval_batches(
        tokens,
        batch_size=d.batch_size,
        seq_len=d.seq_len,
        start=start,
        stop=stop,
        max_batches=d.eval_batches,
        eos_id=eos_id,
    )
