"""The documents of ``hybrid-data``'s inputs: text files and JSON Lines, read in chunks.

- Text (any file not named ``*.jsonl``/``*.json``, or ``--input-format text``): with
  ``--documents file`` (the default) each file is one document; with ``--documents
  blank-lines`` a document is a run of non-blank lines, and one or more blank (or
  whitespace-only) lines separate documents.
- JSON Lines (``*.jsonl``/``*.json``, or ``--input-format jsonl``): one JSON object per line,
  the document in ``--json-key`` (default ``text``); empty lines are skipped.

Text must be UTF-8. Undecodable bytes are refused, naming the file and line, unless
``--encoding-errors replace``: then each becomes U+FFFD and the report counts them. Empty
documents are skipped and counted. A chunk is about ``CHUNK_BYTES`` of whole documents (a
whole file with ``--documents file``), so any worker tokenizes any chunk on its own and an
error names the file and line it came from.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Union

from hybrid.errors import UserError

CHUNK_BYTES = 1 << 20
DOCUMENT_MODES = ("file", "blank-lines")
INPUT_FORMATS = ("auto", "text", "jsonl")
ENCODING_ERRORS = ("strict", "replace")
JSONL_SUFFIXES = (".jsonl", ".json")
_BLANK_LINES = re.compile(rb"\n(?:[ \t\r\f\v]*\n)+")
_LEADING_BLANK_LINES = re.compile(rb"(?:[ \t\r\f\v]*\n)+")
_REPLACEMENT = "\ufffd".encode("utf-8")


class InputError(UserError):
    """An input that cannot be read as documents; the message names the file (and line)."""


@dataclass(frozen=True)
class Chunk:
    """Whole documents of one input: ``payload`` starts at line ``first_line`` of ``path``."""

    path: str
    first_line: int
    kind: str
    """file (one document), blank-lines or jsonl."""
    payload: bytes


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


def kind_of(path: Path, options: ReadOptions) -> str:
    if options.input_format == "jsonl" or (options.input_format == "auto"
                                           and path.suffix.lower() in JSONL_SUFFIXES):
        return "jsonl"
    return options.documents


def read_chunks(paths: list[Path], options: ReadOptions) -> Iterator[Chunk]:
    """The inputs as chunks of whole documents, in order."""
    for path in paths:
        kind = kind_of(path, options)
        if kind == "file":
            yield Chunk(str(path), 1, kind, path.read_bytes())
            continue
        yield from _line_chunks(path, kind)


def _line_chunks(path: Path, kind: str) -> Iterator[Chunk]:
    lines: list[bytes] = []
    size, first, number = 0, 1, 0
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            lines.append(line)
            size += len(line)
            # a chunk ends at a line boundary (JSONL) or after a blank line (text)
            if size >= CHUNK_BYTES and (kind == "jsonl" or not line.strip()):
                yield Chunk(str(path), first, kind, b"".join(lines))
                lines, size, first = [], 0, number + 1
    if lines:
        yield Chunk(str(path), first, kind, b"".join(lines))


def chunk_documents(chunk: Chunk, options: ReadOptions) -> Documents:
    """The documents of ``chunk`` (``InputError`` naming its file and line)."""
    if chunk.kind == "jsonl":
        return _jsonl_documents(chunk, options)
    found = Documents(texts=[])
    for offset, piece in _pieces(chunk):
        if not piece.strip():
            found.empty += chunk.kind == "file"  # blank lines between documents are no document
            continue
        if options.as_bytes:
            found.texts.append(piece)
            continue
        text, replaced = _decode(piece, chunk, options, offset=offset)
        found.texts.append(text)
        found.replaced += replaced
    return found


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


def _jsonl_documents(chunk: Chunk, options: ReadOptions) -> Documents:
    found = Documents(texts=[])
    key = options.json_key
    for number, line in enumerate(chunk.payload.split(b"\n"), start=chunk.first_line):
        if not line.strip():
            continue
        where = f"{chunk.path}:{number}"
        text, replaced = _decode(line, chunk, options, line_number=number)
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
        found.texts.append(value.encode("utf-8") if options.as_bytes else value)
        found.replaced += replaced
    return found


def _decode(piece: bytes, chunk: Chunk, options: ReadOptions, offset: int = 0,
            line_number: int = 0) -> tuple[str, int]:
    """(text, bytes replaced by U+FFFD)."""
    if options.encoding_errors == "replace":
        text = piece.decode("utf-8", errors="replace")
        return text, text.count("\ufffd") - piece.count(_REPLACEMENT)
    try:
        return piece.decode("utf-8"), 0
    except UnicodeDecodeError as err:
        line = line_number or chunk.first_line + chunk.payload.count(b"\n", 0,
                                                                     offset + err.start)
        raise InputError(f"{chunk.path}:{line}: byte {piece[err.start:err.start + 1]!r} is "
                         f"not UTF-8; convert the file to UTF-8, or pass --encoding-errors "
                         f"replace to read each bad byte as U+FFFD (counted)") from None
