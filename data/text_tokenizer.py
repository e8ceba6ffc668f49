"""Tokenizers as preparation, training, generation and export see them: `byte` or any `tokenizer.json`.

Both kinds are `TextTokenizer`s backed by the `tokenizers` library (the format MaxText, Levanter, torchtitan and
Hugging Face read), so one object encodes a corpus, decodes samples, counts the UTF-8 bytes behind each token for
bits per byte, and is saved beside token data or an exported model. The byte tokenizer is expressed as a
byte-level BPE with no merges, whose ids are the byte values (0..255) and 256 ends a document: the ids the token
files of `data.tokenizer` always held, now loadable by `transformers.AutoTokenizer` too.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np

from data.tokenizer import BYTE_TOKENIZER_VOCAB_SIZE, EOS_ID

BYTE = "byte"
TOKENIZER_JSON = "tokenizer.json"
BYTE_EOS_TOKEN = "<|endoftext|>"
# Special tokens that end (or begin) a document, in the order tried, across the families people bring:
# GPT-2 / Qwen / our BPE, Llama 3, Llama 2 / Mistral, Gemma, OLMo / others.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|bos|>", "[CLS]")


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or lacks what training needs: one line for the user."""


class TextTokenizer:
    """A `tokenizers.Tokenizer` plus what training needs of it: the EOS / BOS ids and a stable identity.

    Encoding never adds special tokens by itself (a tokenizer.json's post-processor may add BOS); documents get
    EOS (and BOS if `add_bos`) from the code that joins them, so the policy is one explicit setting.
    """

    def __init__(self, hf_tokenizer, *, name: str, eos_id: int, bos_id: int | None = None, add_bos: bool = False):
        self.hf = hf_tokenizer
        self.name = name
        self.vocab_size = int(hf_tokenizer.get_vocab_size(with_added_tokens=True))
        if not 0 <= eos_id < self.vocab_size:
            raise TokenizerError(f"tokenizer {name}: eos id {eos_id} is outside its vocabulary of {self.vocab_size}")
        if add_bos and bos_id is None:
            raise TokenizerError(f"tokenizer {name}: BOS asked for, but it has no BOS token ({BOS_CANDIDATES})")
        self.eos_id, self.bos_id, self.add_bos = int(eos_id), bos_id, bool(add_bos)

    @property
    def is_byte(self) -> bool:
        return self.name == BYTE

    @property
    def eos_token(self) -> str:
        return self.hf.id_to_token(self.eos_id)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_id is None else self.hf.id_to_token(self.bos_id)

    @functools.cached_property
    def json(self) -> str:
        """The tokenizer.json text (what `save` writes and `sha256` hashes)."""
        return self.hf.to_str()

    @functools.cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.json.encode()).hexdigest()

    def describe(self) -> dict:
        """What token data and checkpoints record of the tokenizer, to catch a mismatch later."""
        return {
            "name": self.name,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "bos_id": self.bos_id,
            "add_bos": self.add_bos,
        }

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text (no special tokens added), as int64 arrays; parallel in the Rust library."""
        if self.is_byte:  # the ids are the bytes: numpy is exact and ~100x faster than BPE with no merges
            return [np.frombuffer(t.encode("utf-8", "surrogatepass"), np.uint8).astype(np.int64) for t in texts]
        encodings = self.hf.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def document(self, text: str) -> np.ndarray:
        """A document as training sees it: [BOS] ids (no EOS; token data writes it after each document)."""
        ids = self.encode(text)
        return np.concatenate([[self.bos_id], ids]) if self.add_bos else ids

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        """Text of `ids` (anything a model samples: invalid UTF-8 becomes U+FFFD, ids past the vocabulary dropped)."""
        ids = [int(i) for i in np.asarray(ids).ravel() if 0 <= int(i) < self.vocab_size]
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes each id stands for (int32, [vocab_size]; 0 for special tokens): bits per byte's denominator.

        Exact for byte-level BPE (GPT-2, Llama 3, Qwen, ours) and for SentencePiece-style vocabularies (Llama 2:
        `▁` is a space, `<0xNN>` one byte); otherwise the UTF-8 length of the token decoded alone."""
        vocab = self.hf.get_vocab(with_added_tokens=True)
        special = {t.content for t in self.hf.get_added_tokens_decoder().values() if t.special}
        counts = np.zeros(self.vocab_size, np.int32)
        byte_level = _uses_byte_level(json.loads(self.json))
        unicode_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
        for token, i in vocab.items():
            if token in special or i >= self.vocab_size:
                continue
            if byte_level and all(c in unicode_to_byte for c in token):
                counts[i] = len(token)
            elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
                counts[i] = 1
            elif "\u2581" in token:
                counts[i] = len(token.replace("\u2581", " ").encode())
            else:
                counts[i] = len(self.hf.decode([i]).encode())
        return counts

    def save(self, directory: str | os.PathLike) -> Path:
        """Writes `directory/tokenizer.json`; returns its path."""
        path = Path(directory) / TOKENIZER_JSON
        path.write_text(self.json)
        return path


def byte_tokenizer() -> TextTokenizer:
    """The byte tokenizer (ids = UTF-8 bytes, 256 = `<|endoftext|>`) as a byte-level BPE without merges."""
    return TextTokenizer(_byte_level_hf(), name=BYTE, eos_id=EOS_ID)


@functools.lru_cache(maxsize=1)
def _byte_level_hf():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    to_unicode = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={to_unicode[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BYTE_EOS_TOKEN])
    assert tok.get_vocab_size() == BYTE_TOKENIZER_VOCAB_SIZE and tok.token_to_id(BYTE_EOS_TOKEN) == EOS_ID
    return tok


def load_tokenizer(
    spec: str | os.PathLike, *, eos_token: str | None = None, bos_token: str | None = None, add_bos: bool = False
) -> TextTokenizer:
    """`byte` (also `bytes`), a tokenizer.json, or a directory holding one; TokenizerError names what is wrong.

    EOS / BOS are found among the special tokens (EOS_CANDIDATES / BOS_CANDIDATES) unless named."""
    if str(spec) in (BYTE, "bytes"):
        if eos_token not in (None, BYTE_EOS_TOKEN) or bos_token is not None or add_bos:
            raise TokenizerError(f"the byte tokenizer's only special token is {BYTE_EOS_TOKEN} (no BOS)")
        return byte_tokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / TOKENIZER_JSON
    if not path.is_file():
        raise TokenizerError(f"tokenizer {spec}: no such file (give 'byte', a tokenizer.json or a directory with one)")
    from tokenizers import Tokenizer

    try:
        hf = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust library raises a bare Exception with a serde message
        raise TokenizerError(f"tokenizer {path} does not load: {str(e).splitlines()[0] if str(e) else e!r}") from None
    eos_id = _special_id(hf, path, eos_token, EOS_CANDIDATES, "EOS", required=True)
    bos_id = _special_id(hf, path, bos_token, BOS_CANDIDATES, "BOS", required=add_bos)
    return TextTokenizer(hf, name=str(path), eos_id=eos_id, bos_id=bos_id, add_bos=add_bos)


def tokenizer_from_record(record: dict | str, directory: str | os.PathLike | None) -> TextTokenizer:
    """The tokenizer token data or a checkpoint recorded (`TextTokenizer.describe()`, or the old name "bytes"),
    loaded from `directory/tokenizer.json` unless it is the byte tokenizer; its hash must match the record."""
    if isinstance(record, str):
        record = {"name": BYTE if record in (BYTE, "bytes") else record}
    if record.get("name") == BYTE:
        return byte_tokenizer()
    if directory is None or not (Path(directory) / TOKENIZER_JSON).is_file():
        raise TokenizerError(f"{directory}: the data's tokenizer {record.get('name')} is not saved beside it")
    tok = load_tokenizer(directory)
    if record.get("sha256") not in (None, tok.sha256):
        raise TokenizerError(f"{directory}/{TOKENIZER_JSON} changed since the data was written (sha256 differs)")
    eos_id, bos_id = record.get("eos_id", tok.eos_id), record.get("bos_id", tok.bos_id)
    return TextTokenizer(tok.hf, name=tok.name, eos_id=eos_id, bos_id=bos_id, add_bos=bool(record.get("add_bos")))


def _special_id(hf, path: Path, named: str | None, candidates, what: str, *, required: bool) -> int | None:
    if named is not None:
        token_id = hf.token_to_id(named)
        if token_id is None:
            raise TokenizerError(f"tokenizer {path}: no token {named!r} for {what}")
        return token_id
    special = {t.content for t in hf.get_added_tokens_decoder().values() if t.special}
    # A candidate counts when it is a special token; the three most common names (GPT-2 / Llama 3 / Llama 2) also
    # when they are only in the vocabulary, as some converted tokenizer.json files leave them.
    for token in candidates:
        if token in special or (token in candidates[:3] and hf.token_to_id(token) is not None):
            return hf.token_to_id(token)
    if required:
        names = sorted(special)[:8]
        raise TokenizerError(
            f"tokenizer {path}: no {what} token among {list(candidates)}; name one with --{what.lower()}-token "
            f"(its special tokens: {names or 'none'})"
        )
    return None


def _uses_byte_level(spec: dict) -> bool:
    parts = [spec.get("pre_tokenizer") or {}, spec.get("decoder") or {}]
    for part in list(parts):
        parts += part.get("pretokenizers", []) + part.get("decoders", [])
    return any(part.get("type") == "ByteLevel" for part in parts)


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which every byte-level BPE's vocabulary is written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tokenizer_of_data(path: str | os.PathLike) -> TextTokenizer:
    """The tokenizer that wrote the token data at `path` (what its meta.json or, for token shards, manifest.json
    records; `byte` for older files)."""
    from data.token_file import META_NAME
    from data.token_shards import MANIFEST_NAME

    path = Path(path)
    directory = path if path.is_dir() else path.parent
    meta_path = directory / META_NAME
    if not meta_path.exists() and (directory / MANIFEST_NAME).exists():  # token shards (data.prepare)
        meta_path = directory / MANIFEST_NAME
    try:
        record = json.loads(meta_path.read_text()).get("tokenizer", BYTE)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"token data {directory}: cannot read {META_NAME}: {e}") from None
    return tokenizer_from_record(record, directory)


def check_data_tokenizer(data: str | os.PathLike, tokenizer: TextTokenizer, fix: str, flag: str = "--data") -> None:
    """Token data read by a model must have been written with its own tokenizer (same tokenizer.json): its ids mean
    other text otherwise. TokenizerError naming both tokenizers and `fix`, or why the data's cannot be read."""
    try:
        theirs = tokenizer_of_data(data)
    except (TokenizerError, ValueError, OSError) as e:
        raise TokenizerError(f"{flag} {data}: {e}") from None
    if theirs.sha256 != tokenizer.sha256:
        raise TokenizerError(
            f"{flag} {data} was written with tokenizer {theirs.name} (sha256 {theirs.sha256[:12]}), not the "
            f"model's {tokenizer.name} (sha256 {tokenizer.sha256[:12]}); {fix}"
        )
