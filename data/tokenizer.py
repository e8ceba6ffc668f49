"""Byte-level tokenizer: ids 0..255 are UTF-8 bytes, 256 ends a document.

Bytes need no trained vocabulary and no download, encode every file on every
machine, and can always be decoded, which makes them the right default for a
corpus that must exist everywhere.
"""

from __future__ import annotations

import numpy as np

BYTE_VOCAB = 256
EOS_ID = 256
BYTE_TOKENIZER_VOCAB_SIZE = 257


def encode(text_or_bytes: str | bytes | bytearray | memoryview) -> np.ndarray:
    """Returns the UTF-8 bytes as uint16 ids (no EOS: the token file adds it)."""
    if isinstance(text_or_bytes, str):
        text_or_bytes = text_or_bytes.encode("utf-8")
    return np.frombuffer(bytes(text_or_bytes), dtype=np.uint8).astype(np.uint16)


def decode(ids, *, eos: str = "\n\n") -> str:
    """Inverse of `encode`, tolerant of anything a model may sample.

    EOS becomes `eos` (a blank line by default, so documents stay apart); other
    ids >= 256 are dropped; invalid UTF-8 becomes U+FFFD (errors="replace").
    """
    ids = np.asarray(ids).ravel()
    pieces = np.split(ids, np.flatnonzero(ids == EOS_ID))
    texts = [_decode_bytes(pieces[0])]
    texts += [_decode_bytes(piece[1:]) for piece in pieces[1:]]  # drop the EOS itself
    return eos.join(texts)


def _decode_bytes(ids: np.ndarray) -> str:
    ids = ids[(ids >= 0) & (ids < BYTE_VOCAB)]
    return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
