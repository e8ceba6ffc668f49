"""Data setup for a run: open its token data (a token file or token shards), check it against the model, and build
the training iterator and the eval batches (the simple seeded iterator, the clairvoyant loader, or a disjoint
partition per DiLoCo replica).

Takes the run's `data` section as any object with DataConfig's fields, and the few facts of the rest of the run it
needs as arguments, so this package imports nothing of jaxlm.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from data.corpus import default_corpus
from data.iterator import SeededBatchIterator, num_windows, split_train_val, validation_batches
from data.sources import ThrottledSource, TokenWindowSource
from data.token_file import TokenFileError
from data.token_shards import open_tokens

# data.prepare's input formats, as --pattern globs (it reads *.txt unless told)
TEXT_GLOBS = ("*.txt", "*.jsonl", "*.jsonl.gz", "*.ndjson", "*.ndjson.gz", "*.parquet")


def data_path(d) -> str:
    """The token data data section `d` reads: `d.path`, or the default corpus with `d.corpus_tokenizer`; for a
    mixture its first dataset (all share its tokenizer)."""
    if getattr(d, "mixture", None):
        from data.mixture import parse_mixture

        return parse_mixture(d.mixture)[0].path
    return d.path or str(default_corpus(tokenizer=d.corpus_tokenizer))


def open_data_path(d):
    """The token data data section `d` reads (`open_tokens`); a TokenFileError naming data.path otherwise, which
    says how to prepare it when it is a directory of text."""
    from data.ownership import DATASET, kind_of

    path = data_path(d)
    try:
        return open_tokens(path)
    except TokenFileError:
        kind = kind_of(Path(path))
        if kind is not None and kind is not DATASET:
            raise TokenFileError(
                f"data.path {path} is {kind} ({kind.written_by}), not a token dataset; give a directory that "
                f"python -m data.prepare wrote"
            ) from None
        globs = text_globs(path)
        if not globs:
            raise
        out = tokens_dir_for(path)
        raise TokenFileError(
            f"data.path {path} holds text files ({', '.join(globs)}), not a token dataset; prepare it first: "
            f"{prepare_command(path, out, globs)}, then --set data.path={shlex.quote(str(out))}"
        ) from None


def text_globs(path, limit: int = 10_000) -> list[str]:
    """Which of TEXT_GLOBS files under directory `path` match (of its first `limit` files, recursively, as
    data.prepare walks it); [] when it is no directory, or one a command wrote (a training workdir's
    metrics.jsonl is no text to train on)."""
    import fnmatch

    from data.ownership import kind_of

    if not os.path.isdir(path) or kind_of(Path(path)) is not None:
        return []
    found, seen = set(), 0
    for _, _, names in os.walk(path):
        for name in names:
            found.update(g for g in TEXT_GLOBS if fnmatch.fnmatch(name.lower(), g))
            seen += 1
            if seen >= limit:
                break
        if seen >= limit:
            break
    return [g for g in TEXT_GLOBS if g in found]


def tokens_dir_for(path) -> Path:
    """Where to suggest writing the token data of text directory `path`: beside it (never inside it, where the
    next prepare would read the dataset as text)."""
    p = Path(path)
    if p.name in ("", ".", ".."):
        p = Path(os.path.abspath(p))
    return p.parent / f"{p.name or 'text'}-tokens"


def prepare_command(path, out, globs: list[str]) -> str:
    """The data.prepare command line that tokenizes the `globs` files of text directory `path` into `out`."""
    patterns = [] if globs == ["*.txt"] else [a for g in globs for a in ("--pattern", g)]
    return shlex.join(["python", "-m", "data.prepare", "--input", str(path), "--output", str(out), *patterns])


def data_vocab_size(d) -> int:
    """The vocabulary of the tokenizer the token data data section `d` reads was written with (its metadata)."""
    return open_data_path(d).vocab_size


def data_fingerprint(d) -> dict:
    """The fingerprint (TokenFile / TokenShards.fingerprint) of the token data data section `d` reads; a mixture's
    holds each dataset's by name."""
    if getattr(d, "mixture", None):
        from data.mixture_data import mixture_fingerprint

        return mixture_fingerprint(d)
    return open_data_path(d).fingerprint()


def open_data(d, *, vocab_size: int, seed: int, document_mask: str | None = None, partitions: int = 0):
    """(train batch iterator, eval batches) for data section `d`, checked against the model's `vocab_size`.

    `document_mask`: the attention mask spec, when it needs document boundaries (batches then carry segment ids,
    found at the token file's eos_id); `partitions` > 0: each of that many replicas reads its own slice.
    With `d.mixture` the eval batches are a dict, each source's by name (data.mixture_data.open_mixture)."""
    if getattr(d, "mixture", None):
        from data.mixture_data import open_mixture

        return open_mixture(
            d,
            vocab_size=vocab_size,
            seed=seed,
            eos_id_needed=bool(document_mask),
            loader=lambda source, eos_id, plan: clairvoyant_loader(d, source, seed, eos_id, plan),
        )
    token_file = open_data_path(d)  # a token file or token shards: one interface
    if token_file.vocab_size > vocab_size:
        raise ValueError(
            f"token file {token_file.path} has vocab_size {token_file.vocab_size} but "
            f"model.vocab_size is {vocab_size}; raise model.vocab_size"
        )
    # Scan the ids, not only meta.json's max_token_id: an id past model.vocab_size would embed as NaN (jnp.take fills
    # out-of-range rows), silently. Measured on 2 CPU cores: the default corpus (12M tokens = 3 chunks) scans in ~1 ms
    # from the page cache, ~20 ms cold; a file over 16 chunks (64M tokens) gets an evenly spread 16-chunk sample
    # instead (1G tokens: ~5 ms warm, vs ~120 ms warm and seconds cold for all of it).
    token_file.validate_ids(vocab_size, deep=True, chunk_size=1 << 22, max_chunks=16)
    path, n, batch_tokens = token_file.path, token_file.num_tokens, d.batch_size * d.seq_len + 1
    if n < batch_tokens:
        raise ValueError(
            f"token file {path} holds {n} tokens, fewer than one batch of data.batch_size x "
            f"data.seq_len + 1 = {batch_tokens}"
        )
    try:
        (train_lo, train_hi), (val_lo, val_hi) = split_train_val(n, d.val_fraction, d.seq_len)
    except ValueError as e:  # the validation split is shorter than a window, or leaves too little to train on
        raise ValueError(f"token file {path}: {e}; adjust data.val_fraction (0: no validation)") from None
    for split, lo, hi in (("training", train_lo, train_hi), ("validation", val_lo, val_hi)):
        windows = num_windows(lo, hi, d.seq_len)
        if (split == "training" or d.eval_batches and hi > lo) and windows < d.batch_size:
            raise ValueError(
                f"token file {path}: its {split} split ({hi - lo} tokens at data.val_fraction "
                f"{d.val_fraction}) holds {windows} sequences, fewer than data.batch_size {d.batch_size}"
            )
    eos_id = None  # given, batches carry segment_ids: only when the "document" attention mask needs them
    if document_mask:
        eos_id = token_file.meta.get("eos_id")
        if eos_id is None:
            raise ValueError(
                f"model.attention_mask {document_mask!r} uses document(), but token file "
                f"{token_file.path} records no eos_id to find document boundaries"
            )
    window = dict(batch_size=d.batch_size, seq_len=d.seq_len, seed=seed, start=train_lo, stop=train_hi, eos_id=eos_id)
    if partitions:
        from data.partitioned import PartitionedBatches

        train_iter = PartitionedBatches(token_file.tokens, parts=partitions, **window)
    elif d.loader == "simple":
        train_iter = SeededBatchIterator(token_file.tokens, **window)
    else:
        train_iter = clairvoyant_loader(
            d, TokenWindowSource(token_file.tokens, seq_len=d.seq_len, start=train_lo, stop=train_hi), seed, eos_id
        )
    eval_data = []
    if d.eval_batches and val_hi > val_lo:
        eval_data = validation_batches(d, token_file.tokens, val_lo, val_hi, eos_id)
    return train_iter, eval_data


def clairvoyant_loader(d, source, seed: int, eos_id=None, plan=None):
    """The plan-driven loader over `source` with the config's tiers, optionally behind a simulated remote filesystem.

    In a multi-process run the processes' loaders all-gather their plans over jax.distributed and serve each
    other's misses; each process reads the rows its devices hold (the trainer calls set_rows)."""
    import jax

    from data.loader import ClairvoyantLoader, jax_exchange

    if d.throttle_latency_ms or d.throttle_mb_per_s:
        source = ThrottledSource(
            source, latency_s=d.throttle_latency_ms / 1e3, bandwidth_bytes_per_s=d.throttle_mb_per_s * 1e6 or None
        )
    multi = jax.process_count() > 1
    return ClairvoyantLoader(
        source,
        batch_size=d.batch_size,
        seed=seed,
        ram_bytes=int(d.cache_ram_mb * 2**20),
        disk_bytes=int(d.cache_disk_mb * 2**20),
        disk_dir=d.cache_dir or None,
        workers=d.loader_workers,
        prefetch_steps=d.prefetch_steps,
        eos_id=eos_id,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        exchange=jax_exchange() if multi else None,
        plan=plan,
    )
