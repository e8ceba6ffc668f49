"""A run's data when it reads a mixture: the sources side by side as one sample space (`ConcatSource`), the
seeded batches of a `MixturePlan` for the simple loader (`PlannedBatches`), and `open_mixture`, which opens and
checks the datasets of `data.mixture` and builds the training iterator and each source's eval batches."""

from __future__ import annotations

import numpy as np

from data.access_plan import checked_rows, process_rows, resume_step, stream_state
from data.iterator import Batch, batch_from_windows, num_windows, split_train_val, validation_batches
from data.mixture import MixtureError, MixturePlan, parse_mixture, parse_stages
from data.sources import SourceError, TokenWindowSource, _check_indices
from data.token_file import TokenFileError
from data.token_shards import open_tokens


class ConcatSource:
    """Sources of equal sample length as one: sample `offsets[s] + i` is sample i of source s."""

    def __init__(self, sources: list):
        lengths = {s.sample_len for s in sources}
        if len(lengths) != 1:
            raise SourceError(f"sources of one mixture need one sample length, got {sorted(lengths)}")
        self.sources = sources
        self.sizes = np.array([s.num_samples for s in sources], np.int64)
        self.ends = np.cumsum(self.sizes)
        self.num_samples, self.sample_len = int(self.ends[-1]), lengths.pop()
        self.dtype = np.result_type(*(s.dtype for s in sources))

    @property
    def sample_nbytes(self) -> int:
        return self.sample_len * self.dtype.itemsize

    def read(self, indices) -> np.ndarray:
        idx_K = _check_indices(indices, self.num_samples)
        which = np.searchsorted(self.ends, idx_K, side="right")
        out = np.empty((len(idx_K), self.sample_len), self.dtype)
        for s in np.unique(which):
            at = which == s
            out[at] = self.sources[s].read(idx_K[at] - (self.ends[s] - self.sizes[s]))
        return out


class PlannedBatches:
    """The simple loader over a plan: each batch reads its rows' samples from the source in the calling thread
    (no cache, no prefetch); its state is the step, as the clairvoyant loader's, so either resumes the other."""

    def __init__(self, plan, source, *, eos_id: int | None = None, process_index: int = 0, process_count: int = 1):
        self.plan, self.source, self.eos_id = plan, source, eos_id
        self.batch_size, self.seed, self.step = plan.global_batch, plan.seed, 0
        self.set_rows(*process_rows(self.batch_size, process_index, process_count))

    def set_rows(self, start: int, stop: int) -> None:
        self.rows = checked_rows(start, stop, self.batch_size)
        self.local_batch_size = self.rows[1] - self.rows[0]

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        samples = self.plan.samples(self.step, self.step + 1, self.rows)[0]
        self.step += 1
        return batch_from_windows(self.source.read(samples), self.eos_id)

    def skip(self) -> None:
        self.step += 1

    def get_state(self) -> dict[str, int]:
        return stream_state(self.plan, self.step)

    def set_state(self, state: dict[str, int]) -> None:
        self.step, self.plan = resume_step(self.plan, state), self.plan.resumed(state)


def _short(tokenizer: str) -> str:
    """A tokenizer's name in a message: a sha256 (data.token_shards' fingerprint) cut to 12 hex digits."""
    return f"sha256 {tokenizer[:12]}" if len(tokenizer) == 64 else tokenizer


def mixture_fingerprint(d) -> dict:
    """What identifies a mixture's data: each source's fingerprint by name (weights may change on resume)."""
    return {"mixture": {c.name: open_tokens(c.path).fingerprint() for c in parse_mixture(d.mixture)}}


def open_mixture(d, *, vocab_size: int, seed: int, eos_id_needed: bool, loader):
    """(train iterator, {source name: eval batches}) for a data section with `mixture` set.

    `loader(source, eos_id, plan)` builds the clairvoyant loader (data.setup's); `eos_id_needed`: batches carry
    segment ids. Every source is checked: a token dataset, the tokenizer of the first, ids within `vocab_size`,
    and enough tokens for a batch and (with eval) a validation split."""
    components = parse_mixture(d.mixture)
    stages = parse_stages(d.mixture_stages, len(components))
    opened = []
    for c in components:
        try:
            opened.append(open_tokens(c.path))
        except TokenFileError as e:
            raise TokenFileError(f"data.mixture dataset {c.path}: {e}") from None
    first = opened[0].tokenizer_id
    for c, tokens in zip(components, opened):
        theirs = tokens.tokenizer_id
        if theirs != first:
            raise MixtureError(
                f"data.mixture dataset {c.path} was written with tokenizer {_short(theirs)}, {components[0].path} "
                f"with {_short(first)}: prepare every dataset of a mixture with one tokenizer "
                f"(python -m data.prepare --tokenizer)"
            )
    train_sources, evals, eos_ids = [], {}, set()
    for c, tokens in zip(components, opened):
        if tokens.vocab_size > vocab_size:
            raise ValueError(
                f"dataset {c.path} has vocab_size {tokens.vocab_size} but model.vocab_size is {vocab_size}"
            )
        tokens.validate_ids(vocab_size, deep=True, chunk_size=1 << 22, max_chunks=16)
        try:
            (lo, hi), (val_lo, val_hi) = split_train_val(tokens.num_tokens, d.val_fraction, d.seq_len)
        except ValueError as e:
            raise ValueError(
                f"data.mixture dataset {c.path}: {e}; adjust data.val_fraction (0: no validation)"
            ) from None
        eos_id = tokens.meta.get("eos_id") if eos_id_needed else None
        if eos_id_needed and eos_id is None:
            raise ValueError(f"data.mixture dataset {c.path} records no eos_id to find document boundaries")
        eos_ids.add(eos_id)
        train_sources.append(TokenWindowSource(tokens.tokens, seq_len=d.seq_len, start=lo, stop=hi))
        if d.eval_batches and val_hi > val_lo:
            if num_windows(val_lo, val_hi, d.seq_len) < d.batch_size:
                raise ValueError(
                    f"data.mixture dataset {c.path}: its validation split ({val_hi - val_lo} tokens at "
                    f"data.val_fraction {d.val_fraction}) holds fewer than data.batch_size {d.batch_size} sequences"
                )
            evals[c.name] = validation_batches(d, tokens.tokens, val_lo, val_hi, eos_id)
    if len(eos_ids) > 1:
        raise MixtureError(f"data.mixture datasets record different eos ids {sorted(eos_ids)}")
    source = ConcatSource(train_sources)
    plan = MixturePlan(
        [c.name for c in components],
        [s.num_samples for s in train_sources],
        [c.weight for c in components],
        global_batch=d.batch_size,
        seed=seed,
        stages=stages,
    )
    eos_id = eos_ids.pop()
    if d.loader == "simple":
        return PlannedBatches(plan, source, eos_id=eos_id), evals
    return loader(source, eos_id, plan), evals
