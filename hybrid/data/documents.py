"""The documents of ``hybrid-data``'s inputs, from chunks that ``hybrid.data.readers`` cuts.

- Text (``--documents file``, the default: each file is one document; ``--documents
  blank-lines``: a document is a run of non-blank lines, and one or more blank or
  whitespace-only lines separate documents).
- JSON Lines: one JSON object per line, the document under ``--json-key`` (default ``text``);
  empty lines are skipped.
- Parquet: one document per row of the column ``--json-key`` names.

Text must be UTF-8, whatever the tokenizer (the byte tokenizer too: an executable or a
Latin-1 file is not silently read as text). Undecodable bytes are refused, naming the file,
line and byte offset, unless ``--encoding-errors replace``: then each becomes U+FFFD and the
report counts them. Empty documents are skipped and counted. A chunk holds whole documents,
so any worker reads any chunk on its own and an error names where it came from.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from hybrid.errors import UserError

DOCUMENT_MODES = ("file", "blank-lines")
INPUT_FORMATS = ("auto", "text", "jsonl", "parquet")
ENCODING_ERRORS = ("strict", "replace")
_BLANK_LINES = re.compile(rb"\n(?:[ \t\r\f\v]*\n)+")
_LEADING_BLANK_LINES = re.compile(rb"(?:[ \t\r\f\v]*\n)+")
_REPLACEMENT = "\ufffd".encode("utf-8")
_SURROGATES = re.compile("[\ud800-\udfff]")


class InputError(UserError):
    """An input that cannot be read as documents; the message names the file (and line)."""


@dataclass(frozen=True)
class Chunk:
    """Whole documents of one input: ``payload`` starts at line ``first_line`` of ``path``
    (Parquet: at row index ``first_line``), byte ``offset`` of its (decompressed) text."""

    path: str
    first_line: int
    kind: str
    """file (one document), blank-lines, jsonl or parquet."""
    payload: bytes
    offset: int = 0
    codec: str = ""
    """The file's compression (gzip, zstd), or "" for none."""
    offsets: Optional[Any] = None
    """Parquet: where each row's bytes start and end in ``payload`` (numpy int64, rows + 1)."""
    progress: int = 0
    """Bytes of the input file this chunk accounts for (the progress bar's)."""


@dataclass(frozen=True)
class ReadOptions:
    documents: str = "file"
    input_format: str = "auto"
    json_key: str = "text"
    encoding_errors: str = "strict"
    as_bytes: bool = False
    """Documents as bytes (the byte tokenizer), not text."""


@dataclass
class Documents:
    """A chunk's documents, and what was skipped or replaced on the way."""

    texts: list[Union[str, bytes]]
    empty: int = 0
    replaced: int = 0


def expand_inputs(patterns: list[str]) -> list[Path]:
    """Every file the inputs name (globs expanded, sorted), each once; ``InputError`` for an
    input that names nothing, a folder, or an empty file."""
    paths: list[Path] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matched = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
            files = [Path(m) for m in matched if os.path.isfile(m)]
            if not files:
                raise InputError(f"input {pattern} matches no file; check the pattern (quote "
                                 f"it so that hybrid-data expands it, e.g. 'docs/**/*.txt')")
        else:
            files = [Path(pattern).expanduser()]
        paths.extend(files)
    for path in paths:
        if path.is_dir():
            raise InputError(f"input {path} is a folder; pass its files, e.g. '{path}/*.txt'")
        if not path.is_file():
            raise InputError(f"input file {path} does not exist; pass the path of a text or "
                             f"JSONL file")
        if path.stat().st_size == 0:
            raise InputError(f"input file {path} is empty; pass a file with some text")
    unique = {os.path.realpath(p): p for p in paths}
    return list(unique.values())


def chunk_documents(chunk: Chunk, options: ReadOptions) -> Documents:
    """The documents of ``chunk`` (``InputError`` naming its file and line)."""
    if chunk.kind == "jsonl":
        return _jsonl_documents(chunk, options)
    if chunk.kind == "parquet":
        return _row_documents(chunk, options)
    found = Documents(texts=[])
    for start, piece in _pieces(chunk):
        if not piece.strip():
            found.empty += chunk.kind == "file"  # blank lines between documents are no document
            continue
        _add(found, piece, _decode(piece, chunk, options, start), options)
    return found


def _add(found: Documents, piece: bytes, decoded: tuple[str, int], options: ReadOptions) -> None:
    """One document, as text or (the byte tokenizer) as its UTF-8 bytes."""
    text, replaced = decoded
    if options.as_bytes:
        found.texts.append(text.encode("utf-8") if replaced else piece)
    else:
        found.texts.append(text)
    found.replaced += replaced


def _pieces(chunk: Chunk) -> Iterator[tuple[int, bytes]]:
    """(offset in the payload, text) of each document of a text chunk."""
    if chunk.kind == "file":
        yield 0, chunk.payload
        return
    leading = _LEADING_BLANK_LINES.match(chunk.payload)
    start = leading.end() if leading else 0
    for separator in _BLANK_LINES.finditer(chunk.payload, start):
        yield start, chunk.payload[start:separator.start()].rstrip(b"\r")
        start = separator.end()
    yield start, chunk.payload[start:].rstrip(b"\r\n")


def _row_documents(chunk: Chunk, options: ReadOptions) -> Documents:
    """A Parquet chunk's rows: each one document, as a JSONL line's string would be."""
    found = Documents(texts=[])
    ends = chunk.offsets.tolist()
    for start, end in zip(ends[:-1], ends[1:]):
        if start == end:
            found.empty += 1
            continue
        piece = chunk.payload[start:end]
        _add(found, piece, _decode(piece, chunk, options, start), options)
    return found


def _jsonl_documents(chunk: Chunk, options: ReadOptions) -> Documents:
    found = Documents(texts=[])
    key, start = options.json_key, 0
    for number, line in enumerate(chunk.payload.split(b"\n"), start=chunk.first_line):
        line_start, start = start, start + len(line) + 1
        if not line.strip():
            continue
        where = f"{chunk.path}:{number}"
        text, replaced = _decode(line, chunk, options, line_start)
        try:
            record = json.loads(text)
        except ValueError as err:
            raise InputError(f"{where}: not JSON ({err.args[0].split(':')[0]}); a JSONL file "
                             f"holds one JSON object per line") from None
        if not isinstance(record, dict) or key not in record:
            keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(
                record).__name__
            raise InputError(f"{where}: no key {key!r} (found: {keys}); pass --json-key KEY")
        value = record[key]
        if not isinstance(value, str):
            raise InputError(f"{where}: {key!r} holds a {type(value).__name__}, not a string")
        if not value:
            found.empty += 1
            continue
        value, encoded, lone = _without_surrogates(value, where, key, options)
        found.texts.append(encoded if options.as_bytes else value)
        found.replaced += replaced + lone
    return found


def _without_surrogates(value: str, where: str, key: str, options: ReadOptions
                        ) -> tuple[str, bytes, int]:
    """(text, its UTF-8, surrogates replaced): JSON's ``\\ud800`` escape decodes to a lone
    surrogate, which no UTF-8 (and no tokenizer) holds."""
    try:
        return value, value.encode("utf-8"), 0
    except UnicodeEncodeError as err:
        if options.encoding_errors != "replace":
            raise InputError(f"{where}: {key!r} holds the lone surrogate "
                             f"{value[err.start]!r}, which is not text; fix the line, or pass "
                             f"--encoding-errors replace to read it as U+FFFD (counted)") from None
    value, count = _SURROGATES.subn("\ufffd", value)
    return value, value.encode("utf-8"), count


def _decode(piece: bytes, chunk: Chunk, options: ReadOptions, start: int) -> tuple[str, int]:
    """(text, bytes replaced by U+FFFD) of ``piece``, found at ``start`` of the payload."""
    if options.encoding_errors == "replace":
        text = piece.decode("utf-8", errors="replace")
        return text, text.count("\ufffd") - piece.count(_REPLACEMENT)
    try:
        return piece.decode("utf-8"), 0
    except UnicodeDecodeError as err:
        byte = piece[err.start:err.start + 1]
        where = _where(chunk, start + err.start)
        if piece.startswith(b"\x7fELF") or piece.find(b"\x00", 0, 4096) >= 0:
            raise InputError(f"{where}: byte {byte!r} is not UTF-8 and the file holds NUL "
                             f"bytes: it is binary, not text; pass only text files (e.g. "
                             f"'src/**/*.py', not 'src/**/*')") from None
        raise InputError(f"{where}: byte {byte!r} is not UTF-8; convert the file to UTF-8, or "
                         f"pass --encoding-errors replace to read each bad byte as U+FFFD "
                         f"(counted)") from None


def _where(chunk: Chunk, at: int) -> str:
    """Where byte ``at`` of ``chunk``'s payload is: file and line (and byte offset), or row."""
    if chunk.kind == "parquet":
        row = chunk.first_line + int((chunk.offsets <= at).sum()) - 1
        return f"{chunk.path}: row index {row}"
    line = chunk.first_line + chunk.payload.count(b"\n", 0, at)
    of = " of the decompressed text" if chunk.codec else ""
    return f"{chunk.path}:{line} (byte offset {chunk.offset + at}{of})"
