"""A run's data from its config: `data.setup.open_data` told what the rest of the config implies (the model's
vocabulary, whether the attention mask needs document boundaries, DiLoCo's data partitions)."""

from __future__ import annotations

import dataclasses

from data.setup import data_fingerprint, data_vocab_size, open_data
from jaxlm.config import VOCAB_MULTIPLE, ConfigError, TrainConfig
from pallas_kernels.mask_spec import parse_mask, uses_documents


def open_run_data(cfg: TrainConfig):
    """(train batch iterator, eval batches) for a validated config; ValueError / OSError name a bad data path."""
    mask = cfg.model.attention_mask
    return open_data(
        cfg.data,
        vocab_size=cfg.model.vocab_size,
        seed=cfg.seed,
        document_mask=mask if uses_documents(parse_mask(mask)) else None,
        partitions=cfg.diloco.data_partitions,
    )


def resolve_vocab(cfg: TrainConfig) -> TrainConfig:
    """The config with the model's vocabulary fitted to the data's tokenizer: `model.vocab_size` 0 becomes the
    tokenizer's vocabulary rounded up to a multiple of VOCAB_MULTIPLE (so `vocab` shards over `tensor`), and
    `model.tokenizer_vocab_size` the tokenizer's own, so padded ids are never predicted. An explicit vocab_size
    smaller than the tokenizer's is a ConfigError."""
    m = cfg.model
    tokens = data_vocab_size(cfg.data)  # the metadata's: no need to hash samples as the fingerprint does
    if m.vocab_size and m.vocab_size < tokens:
        raise ConfigError(
            f"model.vocab_size {m.vocab_size} is smaller than the data's tokenizer's {tokens} ids; raise it, or "
            f"leave it out (0) to follow the tokenizer"
        )
    if m.tokenizer_vocab_size not in (0, tokens):
        source = f"data.path {cfg.data.path}" if cfg.data.path else f"the default corpus ({cfg.data.corpus_tokenizer})"
        raise ConfigError(
            f"model.tokenizer_vocab_size {m.tokenizer_vocab_size} but the tokenizer of {source} has {tokens} ids: "
            "the model was trained with another tokenizer; write token data with it (its workdir's tokenizer.json: "
            "python -m data.prepare --tokenizer WORKDIR/tokenizer.json --input TEXT --output DIR) and pass "
            "--set data.path=DIR"
        )
    vocab = m.vocab_size or -(-tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    return dataclasses.replace(cfg, model=dataclasses.replace(m, vocab_size=vocab, tokenizer_vocab_size=tokens))


def run_data_fingerprint(cfg: TrainConfig) -> dict:
    """What identifies the run's token data (data.token_file.TokenFile.fingerprint): stored with each checkpoint."""
    return data_fingerprint(cfg.data)


def run_tokenizer(cfg: TrainConfig):
    """The run's tokenizer (data.text_tokenizer.TextTokenizer): the one its token data was written with."""
    from data.setup import data_path
    from data.text_tokenizer import tokenizer_of_data

    return tokenizer_of_data(data_path(cfg.data))
