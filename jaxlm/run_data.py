"""A run's data from its config: `data.setup.open_data` told what the rest of the config implies (the model's
vocabulary, whether the attention mask needs document boundaries, DiLoCo's data partitions)."""

from __future__ import annotations

from data.setup import data_fingerprint, open_data
from jaxlm.config import TrainConfig
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


def run_data_fingerprint(cfg: TrainConfig) -> dict:
    """What identifies the run's token data (data.token_file.TokenFile.fingerprint): stored with each checkpoint."""
    return data_fingerprint(cfg.data)


def run_tokenizer(cfg: TrainConfig):
    """The run's tokenizer (data.text_tokenizer.TextTokenizer): the one its token data was written with."""
    from data.corpus import default_corpus
    from data.text_tokenizer import tokenizer_of_data

    return tokenizer_of_data(cfg.data.path or default_corpus())
