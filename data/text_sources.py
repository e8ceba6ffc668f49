"""Documents out of text files, streamed: `.txt`, `.jsonl`, `.jsonl.gz`, `.json` arrays and `.parquet`.

Preparation and tokenizer training read the same documents through `documents(piece, options)`. A `Piece` is a
work unit a process can read on its own (a file, a byte range of a large `.jsonl`, or a run of parquet row groups),
so workers parallelise over files and within large ones. Memory is bounded by one piece's largest record: a line, a
parquet row group's column (Arrow's buffers; Python strings only per 256-row batch), a `.txt` document, or a whole
`.json` array file (arrays are parsed per file). Every bad record raises
`TextSourceError` naming the file and line (or element, row group / row, byte offset).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import gzip
import json
import os
from pathlib import Path
from typing import Iterator

from data.ownership import kind_of

TEXT, JSONL, JSONL_GZ, JSON, PARQUET = "txt", "jsonl", "jsonl.gz", "json", "parquet"
_SUFFIXES = ((".jsonl.gz", JSONL_GZ), (".ndjson.gz", JSONL_GZ), (".jsonl", JSONL), (".ndjson", JSONL))
_SUFFIXES += ((".json", JSON), (".parquet", PARQUET))
_READ_BYTES = 8 << 20  # separator-split text is read in chunks of this size
_PARQUET_ROWS = 256  # rows per record batch read from a parquet row group


class TextSourceError(ValueError):
    """Input text that cannot be read as documents: one line naming the file and where."""


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """How records become documents; part of a prepare job's identity (another value gives other tokens)."""

    text_field: str = "text"  # the jsonl / json / parquet field holding a document
    separator: str | None = None  # splits a text file into documents (None: one file is one document)
    utf8_errors: str = "strict"  # "strict": undecodable bytes are an error naming file and offset; or "replace"
    skip_bad: bool = False  # count and skip records that are not JSON or lack the field, instead of failing


@dataclasses.dataclass(frozen=True)
class Piece:
    """A work unit: `path` read as `fmt` over [start, stop) (byte offsets, or parquet row groups; None: all)."""

    path: str
    fmt: str
    start: int = 0
    stop: int | None = None
    size: int = 0  # input bytes it covers (progress and shard planning)


@dataclasses.dataclass
class Counts:
    """What a read skipped; summed over pieces into the token data's manifest."""

    bad_records: int = 0
    replaced_documents: int = 0  # documents in which undecodable bytes became U+FFFD


def format_of(path: str | os.PathLike) -> str:
    """The format a file is read as, by its name; anything unrecognised is plain text (`*.py`, `*.md`, ...)."""
    name = str(path).lower()
    return next((fmt for suffix, fmt in _SUFFIXES if name.endswith(suffix)), TEXT)


def find_inputs(inputs: list[str], patterns: list[str]) -> list[Path]:
    """Files named, plus files under directories matching any pattern (recursive); sorted per directory, deduped.

    A walk never enters what a command wrote (a token dataset, an HF export, a training workdir, a hidden build
    directory): an output kept beside its text is not read back as text by the next run."""
    found: dict[Path, None] = {}
    for raw in inputs:
        path = Path(raw)
        if path.is_file():
            found[path] = None
        elif path.is_dir():
            kind = kind_of(path)
            if kind is not None:
                raise TextSourceError(f"input {path} is {kind} ({kind.written_by}), not text")
            matches = sorted(
                Path(d) / name
                for d, _, names in _walk_text(path)
                for name in names
                if any(fnmatch.fnmatch(name, p) for p in patterns)
            )
            if not matches:
                raise TextSourceError(f"no files matching {' or '.join(map(repr, patterns))} under {path}")
            found.update(dict.fromkeys(matches))
        else:
            raise TextSourceError(f"input not found: {path}")
    return list(found)


def _walk_text(root: Path):
    """os.walk, pruning the directories a command wrote and prepare's unfinished builds (`.NAME.partial`)."""
    for d, dirs, names in os.walk(root):
        dirs[:] = [
            x for x in dirs if not (x.startswith(".") and x.endswith(".partial")) and kind_of(Path(d) / x) is None
        ]
        yield d, dirs, names


def plan_pieces(path: Path, options: ReadOptions, target_bytes: int) -> list[Piece]:
    """The work units of one file: a large `.jsonl` cut into byte ranges of about `target_bytes` (at line starts,
    found when read), parquet row groups grouped to about `target_bytes`, anything else whole."""
    fmt, size = format_of(path), path.stat().st_size
    if fmt == JSONL and size > target_bytes:
        cuts = list(range(0, size, target_bytes)) + [size]
        return [Piece(str(path), fmt, a, b, b - a) for a, b in zip(cuts[:-1], cuts[1:])]
    if fmt == PARQUET:
        return _parquet_pieces(path, options.text_field, target_bytes)
    return [Piece(str(path), fmt, 0, None, size)]


def documents(piece: Piece, options: ReadOptions, counts: Counts) -> Iterator[str]:
    """The documents of `piece` in order (empty ones included, for the caller to count); streamed."""
    read = {TEXT: _text_documents, JSONL: _jsonl_documents, JSONL_GZ: _jsonl_gz_documents}
    read |= {JSON: _json_documents, PARQUET: _parquet_documents}
    try:
        yield from read[piece.fmt](piece, options, counts)
    except OSError as e:
        raise TextSourceError(f"{piece.path}: cannot read: {e.strerror or e}") from None
    except EOFError as e:  # gzip: a truncated stream
        raise TextSourceError(f"{piece.path}: {e}") from None


def _decode(data: bytes, options: ReadOptions, counts: Counts, where) -> str:
    """UTF-8 text of `data`; `where(offset)` names a position for the error."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if options.utf8_errors != "replace":
            raise TextSourceError(
                f"{where(e.start)}: bytes that are not UTF-8 ({data[e.start : e.start + 4]!r}); "
                f"pass --utf8-errors replace to replace them"
            ) from None
        counts.replaced_documents += 1
        return data.decode("utf-8", "replace")


def _text_documents(piece: Piece, options: ReadOptions, counts: Counts) -> Iterator[str]:
    path = piece.path
    if options.separator is None:
        with open(path, "rb") as f:
            yield _decode(f.read(), options, counts, lambda at: f"{path}: byte offset {at}")
        return
    sep = options.separator.encode()
    with open(path, "rb") as f:
        buffer, buffer_at = b"", 0  # buffer_at: file offset of buffer[0]
        while chunk := f.read(_READ_BYTES):
            buffer += chunk
            *docs, buffer = buffer.split(sep)
            for doc in docs:
                yield _decode(doc, options, counts, lambda at, o=buffer_at: f"{path}: byte offset {o + at}")
                buffer_at += len(doc) + len(sep)
        yield _decode(buffer, options, counts, lambda at: f"{path}: byte offset {buffer_at + at}")


def _jsonl_documents(piece: Piece, options: ReadOptions, counts: Counts) -> Iterator[str]:
    """Lines whose first byte lies in [start, stop); a line number is counted only when an error needs it."""
    path, stop = piece.path, piece.stop if piece.stop is not None else float("inf")
    with open(path, "rb") as f:
        at = piece.start
        if at > 0:  # a range starting mid-line leaves that line to the range before
            f.seek(at - 1)
            if f.read(1) != b"\n":
                at += len(f.readline())
        while at < stop:
            line = f.readline()
            if not line:
                break
            text = _record(line, options, counts, lambda at=at: f"{path}: line {_line_number(path, at)}")
            at += len(line)
            if text is not None:
                yield text


def _jsonl_gz_documents(piece: Piece, options: ReadOptions, counts: Counts) -> Iterator[str]:
    with gzip.open(piece.path, "rb") as f:
        for number, line in enumerate(f, 1):
            text = _record(line, options, counts, lambda n=number: f"{piece.path}: line {n}")
            if text is not None:
                yield text


def _json_documents(piece: Piece, options: ReadOptions, counts: Counts) -> Iterator[str]:
    with open(piece.path, "rb") as f:
        raw = f.read()
    try:
        records = json.loads(_decode(raw, options, counts, lambda at: f"{piece.path}: byte offset {at}"))
    except json.JSONDecodeError as e:
        raise TextSourceError(f"{piece.path}: line {e.lineno}: not JSON ({e.msg})") from None
    if not isinstance(records, list):
        raise TextSourceError(f"{piece.path}: a .json input must be an array of objects, got {type(records).__name__}")
    for i, record in enumerate(records):
        text = _field(record, options, counts, lambda i=i: f"{piece.path}: element {i}")
        if text is not None:
            yield text


def _record(line: bytes, options: ReadOptions, counts: Counts, where) -> str | None:
    """The document of one jsonl line ("" for a blank line or a null field); None: a bad record skipped."""
    if not line.strip():
        return ""
    try:
        record = json.loads(_decode(line, options, counts, lambda at: f"{where()} (byte {at} of the line)"))
    except json.JSONDecodeError as e:
        if options.skip_bad:
            counts.bad_records += 1
            return None
        raise TextSourceError(f"{where()}: not JSON ({e.msg}); pass --skip-bad to skip such lines") from None
    return _field(record, options, counts, where)


def _field(record, options: ReadOptions, counts: Counts, where) -> str | None:
    value = record.get(options.text_field, ...) if isinstance(record, dict) else ...
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if options.skip_bad:
        counts.bad_records += 1
        return None
    problem = f"has no field {options.text_field!r}" if value is ... else f"field {options.text_field!r} is not text"
    if not isinstance(record, dict):
        problem = f"is a {type(record).__name__}, not an object with field {options.text_field!r}"
    raise TextSourceError(f"{where()}: {problem}; pass --text-field to name another or --skip-bad to skip it")


def _line_number(path: str, offset: int) -> int:
    """1-based number of the line starting at byte `offset` (counted only for an error message)."""
    count = 0
    with open(path, "rb") as f:
        while offset > 0:
            chunk = f.read(min(offset, _READ_BYTES))
            if not chunk:
                break
            count, offset = count + chunk.count(b"\n"), offset - len(chunk)
    return count + 1


def _parquet_file(path):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError with a long message
        raise TextSourceError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]})") from None


def _parquet_pieces(path: Path, field: str, target_bytes: int) -> list[Piece]:
    import pyarrow as pa

    pf = _parquet_file(path)
    schema = pf.schema_arrow
    if field not in schema.names:
        raise TextSourceError(f"{path}: parquet file has no column {field!r} (columns: {schema.names[:10]})")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)):
        raise TextSourceError(f"{path}: parquet column {field!r} holds {kind}, not text")
    pieces, first, size = [], 0, 0
    groups = pf.metadata.num_row_groups
    for g in range(groups):
        size += pf.metadata.row_group(g).total_byte_size
        if size >= target_bytes or g == groups - 1:
            pieces.append(Piece(str(path), PARQUET, first, g + 1, size))
            first, size = g + 1, 0
    return pieces


def _parquet_documents(piece: Piece, options: ReadOptions, counts: Counts) -> Iterator[str]:
    """Row group by row group, in record batches of _PARQUET_ROWS: only a batch's strings become Python objects."""
    pf = _parquet_file(piece.path)
    stop = pf.metadata.num_row_groups if piece.stop is None else piece.stop
    for group in range(piece.start, stop):
        batches, row = pf.iter_batches(_PARQUET_ROWS, row_groups=[group], columns=[options.text_field]), 0
        while True:
            try:
                batch = next(batches, None)
            except Exception as e:  # a damaged file: pyarrow's ArrowInvalid / OSError
                error = str(e).splitlines()[0]
                raise TextSourceError(f"{piece.path}: row group {group} does not read ({error})") from None
            if batch is None:
                break
            for value in batch.column(0).to_pylist():
                if isinstance(value, bytes):
                    where = f"{piece.path}: row group {group} row {row}"
                    value = _decode(value, options, counts, lambda at, w=where: f"{w} byte {at}")
                row += 1
                yield value or ""
