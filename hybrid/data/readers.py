"""How ``hybrid-data`` opens its inputs and cuts them into chunks of whole documents.

What a file is comes from its name, checked against its first bytes:

- ``*.parquet``: Parquet, one document per row in the column ``--json-key`` names (a string or
  binary column; read with pyarrow);
- ``*.jsonl``/``*.json``: JSON Lines; anything else: text (``--documents``);
- ``*.gz`` (gzip) or ``*.zst``/``*.zstd`` (zstd) after either: the same, compressed
  (``corpus.jsonl.zst``). A compressed file whose name does not say so is recognised by its
  magic bytes and read; a name that promises what the bytes deny (a ``.gz`` that is not gzip, a
  ``.parquet`` that is not Parquet) is refused, and so is a stream cut short or damaged.

``--input-format`` overrides the guess of the format (not of the compression). This process
decompresses and reads Parquet's column in record batches (a gzip or zstd stream cannot be
split); the workers decode and tokenize each chunk exactly as for a plain JSONL file, so the
same documents give the same tokens whatever the container. Decompressing runs at hundreds of
MB/s, tokenizing at a few MB/s a core: one reader keeps many workers busy.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np

from hybrid.data.documents import Chunk, InputError, ReadOptions

CHUNK_BYTES = 1 << 20
"""About this many bytes of whole documents per chunk (a worker's unit of work)."""
PARQUET_BATCH_ROWS = 256
JSONL_SUFFIXES = (".jsonl", ".json")
CODECS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
MAGIC = {"gzip": b"\x1f\x8b", "zstd": b"\x28\xb5\x2f\xfd", "parquet": b"PAR1"}
STREAM_ERRORS = (EOFError, OSError, zlib.error)
"""What a damaged gzip stream raises (``zstandard.ZstdError`` is added where it is read)."""


@dataclass(frozen=True)
class Input:
    """One input file: how it is compressed (``""``: not) and what it holds."""

    path: Path
    codec: str
    kind: str
    """file or blank-lines (text), jsonl, or parquet."""


def describe(path: Path, options: ReadOptions) -> Input:
    """What ``path`` is, by its name and its first bytes (``InputError`` when they differ)."""
    head = _head(path)
    named = CODECS.get(path.suffix.lower(), "")
    sniffed = next((codec for codec in ("gzip", "zstd") if head.startswith(MAGIC[codec])), "")
    if named and named != sniffed:
        raise InputError(f"{path} is named {path.suffix} but is not {named} (its first bytes "
                         f"are {head!r}); rename it, or compress it again with {named}")
    codec = named or sniffed
    inner = (path.with_suffix("") if named else path).suffix.lower()
    if codec and (inner == ".parquet" or options.input_format == "parquet"):
        raise InputError(f"{path} is a {codec}-compressed Parquet file; Parquet compresses its "
                         f"own pages: decompress it with {codec} first")
    return Input(path=path, codec=codec, kind=_kind(path, inner, b"" if codec else head,
                                                    options))


def _kind(path: Path, suffix: str, head: bytes, options: ReadOptions) -> str:
    wanted = options.input_format
    if wanted == "parquet" or (wanted == "auto" and suffix == ".parquet"):
        if not head.startswith(MAGIC["parquet"]):
            raise InputError(f"{path} is not a Parquet file (its first bytes are {head!r}, not "
                             f"{MAGIC['parquet']!r}); pass a Parquet file, or --input-format "
                             f"text or jsonl for what it is")
        return "parquet"
    if wanted == "jsonl" or (wanted == "auto" and suffix in JSONL_SUFFIXES):
        return "jsonl"
    if wanted == "auto" and head.startswith(MAGIC["parquet"]) and _tail(path) == MAGIC["parquet"]:
        return "parquet"  # a Parquet file by another name: its first and last bytes say so
    return options.documents


def _head(path: Path) -> bytes:
    with open(path, "rb") as handle:
        return handle.read(4)


def _tail(path: Path) -> bytes:
    with open(path, "rb") as handle:
        handle.seek(max(0, path.stat().st_size - 4))
        return handle.read(4)


def read_chunks(paths: list[Path], options: ReadOptions) -> Iterator[Chunk]:
    """The inputs as chunks of whole documents, in order."""
    for path in paths:
        source = describe(path, options)
        try:
            if source.kind == "parquet":
                yield from _parquet_chunks(source, options.json_key)
            else:
                yield from _stream_chunks(source)
        except InputError:
            raise
        except OSError as err:  # the file itself (permissions, I/O); the stream's are below
            raise InputError(f"cannot read {path}: {err.strerror or err}; check the file and "
                             f"its permissions") from None


def _stream_chunks(source: Input) -> Iterator[Chunk]:
    """A text or JSONL input's chunks, decompressed as it is read."""
    with open(source.path, "rb") as raw, _decompressed(source, raw) as stream:
        errors = STREAM_ERRORS + _zstd_errors(source)
        line = 0
        try:
            if source.kind == "file":
                yield Chunk(str(source.path), 1, "file", stream.read(), codec=source.codec,
                            progress=source.path.stat().st_size)
                return
            for chunk in _line_chunks(source, stream, raw):
                line = chunk.first_line + chunk.payload.count(b"\n") - 1
                yield chunk
        except errors as err:
            if not source.codec:
                raise  # a plain file's read error: read_chunks names it
            raise InputError(f"{source.path}: its {source.codec} stream is damaged or cut short "
                             f"after line {line} ({err}); download or compress it again"
                             ) from None


@contextlib.contextmanager
def _decompressed(source: Input, raw: BinaryIO) -> Iterator[BinaryIO]:
    if source.codec == "gzip":
        with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
            yield stream
    elif source.codec == "zstd":
        yield io.BufferedReader(_ZstdReader(raw, source.path), buffer_size=CHUNK_BYTES)
    else:
        yield raw


def _line_chunks(source: Input, stream: BinaryIO, raw: BinaryIO) -> Iterator[Chunk]:
    """Chunks of whole lines: a chunk ends at a line boundary (JSONL) or after a blank line
    (text); ``progress`` counts the file's (compressed) bytes read for each."""
    lines: list[bytes] = []
    size, first, offset, read = 0, 1, 0, 0

    def chunk() -> Chunk:
        nonlocal read
        done, read = read, raw.tell()
        return Chunk(str(source.path), first, source.kind, b"".join(lines), offset=offset,
                     codec=source.codec, progress=read - done)

    number = 0
    for number, line in enumerate(stream, start=1):
        lines.append(line)
        size += len(line)
        if size >= CHUNK_BYTES and (source.kind == "jsonl" or not line.strip()):
            yield chunk()
            lines, first, offset, size = [], number + 1, offset + size, 0
    if lines:
        yield chunk()


class _ZstdReader(io.RawIOBase):
    """The decompressed bytes of concatenated zstd frames. A frame cut short is an
    ``EOFError``: zstandard's own ``stream_reader`` ends such a stream without a word."""

    def __init__(self, raw: BinaryIO, path: Path):
        zstandard = _import("zstandard", path)
        self._raw = raw
        self._decompressor = zstandard.ZstdDecompressor(max_window_size=1 << 31)  # --long=31
        self._frame = self._decompressor.decompressobj()
        self._in_frame = False
        self._out, self._at = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._at == len(self._out):
            data = self._raw.read(1 << 16)
            if not data:
                if self._in_frame:
                    raise EOFError("the stream ends inside a zstd frame")
                return 0
            self._out, self._at = self._feed(data), 0
        size = min(len(buffer), len(self._out) - self._at)
        buffer[:size] = self._out[self._at:self._at + size]
        self._at += size
        return size

    def _feed(self, data: bytes) -> bytes:
        out = []
        while data:
            out.append(self._frame.decompress(data))
            self._in_frame = not self._frame.eof
            if self._in_frame:
                break
            data = self._frame.unused_data
            self._frame = self._decompressor.decompressobj()
        return b"".join(out)


def _zstd_errors(source: Input) -> tuple:
    return (_import("zstandard", source.path).ZstdError,) if source.codec == "zstd" else ()


def _parquet_chunks(source: Input, column: str) -> Iterator[Chunk]:
    """A Parquet input's ``column`` in chunks of whole rows: the UTF-8 bytes of the rows back
    to back, and where each row ends."""
    pa = _import("pyarrow", source.path)
    try:
        with _open_parquet(source, column) as parquet:
            rows, size = max(1, parquet.metadata.num_rows), source.path.stat().st_size
            pieces, ends, first, row, reported = [], [np.zeros(1, np.int64)], 0, 0, 0
            for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[column]):
                payload, batch_ends = _column_bytes(source, batch.column(0), column, row)
                ends.append(batch_ends + ends[-1][-1])
                pieces.append(payload)
                row += batch.num_rows
                if ends[-1][-1] >= CHUNK_BYTES or row == rows:
                    done = size * row // rows if row < rows else size
                    yield Chunk(str(source.path), first, "parquet", b"".join(pieces),
                                offsets=np.concatenate(ends), progress=done - reported)
                    pieces, ends, first, reported = [], [np.zeros(1, np.int64)], row, done
            if pieces:  # rows beyond what the footer counts: still every one of them
                yield Chunk(str(source.path), first, "parquet", b"".join(pieces),
                            offsets=np.concatenate(ends), progress=size - reported)
    except pa.ArrowException as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InputError(f"{source.path}: a damaged Parquet file ({reason}); download or "
                         f"write it again") from None


def _open_parquet(source: Input, column: str):
    """The open Parquet file (``InputError``, closed, without a text column ``column``)."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(str(source.path))
    schema = parquet.schema_arrow
    if column not in schema.names or not _is_text(schema.field(column).type):
        parquet.close()
    if column not in schema.names:
        raise InputError(f"{source.path}: no column {column!r} (found: "
                         f"{', '.join(schema.names)}); pass --json-key COLUMN")
    kind = schema.field(column).type
    if not _is_text(kind):
        raise InputError(f"{source.path}: column {column!r} holds {kind}, not text; pass "
                         f"--json-key naming a string column")
    return parquet


def _is_text(kind) -> bool:
    import pyarrow as pa

    return any(test(kind) for test in (
        pa.types.is_string, pa.types.is_large_string, pa.types.is_binary,
        pa.types.is_large_binary, pa.types.is_string_view, pa.types.is_binary_view))


def _column_bytes(source: Input, values, column: str, first_row: int
                  ) -> tuple[bytes, np.ndarray]:
    """A batch's values back to back, and where each ends (``InputError`` for a null)."""
    import pyarrow as pa

    if values.null_count:
        null = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        raise InputError(f"{source.path}: row index {first_row + null} has no {column!r} "
                         f"(null); drop the rows without text, or pass --json-key COLUMN")
    values = values.cast(pa.large_binary())
    _, offsets, data = values.buffers()
    offsets = np.frombuffer(offsets, dtype=np.int64)[values.offset:values.offset + len(values) + 1]
    start, end = int(offsets[0]), int(offsets[-1])
    payload = bytes(memoryview(data)[start:end]) if data is not None and end > start else b""
    return payload, (offsets[1:] - start).astype(np.int64)


def _import(name: str, path: Path):
    """A reader's library (both are dependencies; a broken install is one line too)."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise InputError(f"reading {path} needs the package {name}, a dependency of hybrid; "
                         f"pip install {name}") from None
