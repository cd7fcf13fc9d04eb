"""``hybrid-data``'s work: documents in, tokens out, in one of two formats, atomically.

- ``tokens``: one flat ``uint16``/``uint32`` array (``data.source=tokens``).
- ``indexed``: Megatron's ``PREFIX.bin`` + ``PREFIX.idx`` (``data.source=indexed``).

Beside either go ``DATA.meta.json`` and, for an HF tokenizer, ``DATA.tokenizer.json``
(``hybrid.data.metadata``). Chunks of documents (``hybrid.data.documents``) are tokenized by
``workers`` processes (``spawn``ed, each single-threaded, so N workers use N cores), at most
``2 * workers`` chunks in flight so memory stays bounded on any input, and written in input
order: the output does not depend on the number of workers. Everything is written to hidden
temporary files beside the outputs and renamed over them only when complete, the record
last; an error or Ctrl-C removes the temporary files and leaves any previous output as it
was.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from hybrid.data.documents import (Chunk, InputError, ReadOptions, chunk_documents,
                                   expand_inputs)
from hybrid.data.indexed import optimal_dtype, write_index
from hybrid.data.metadata import META_SUFFIX, TOKENIZER_SUFFIX
from hybrid.data.readers import read_chunks
from hybrid.data.tokenizer import TokenizerInfo, load_tokenizer, tokenizer_from_json
from hybrid.errors import UserError
from hybrid.files import AtomicFiles

FORMATS = ("tokens", "indexed")
DTYPES = {"tokens": ("uint16", "uint32"), "indexed": ("uint16", "int32")}


class OutputError(UserError):
    """The output cannot be written where it was asked for; the message names the folder."""


@contextlib.contextmanager
def writing(output: str) -> Iterator[None]:
    """Turn an ``OSError`` of writing ``output`` (a read-only or full disk, a folder that
    takes no files) into one line naming the output and its folder, not a temporary file."""
    try:
        yield
    except OSError as err:
        folder = os.path.dirname(os.path.abspath(output))
        raise OutputError(f"cannot write {output} in the folder {folder} "
                          f"({err.strerror or err}); choose a folder you can write to, with "
                          f"room for the output") from None


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, as a container or taskset sets
    it), which is what bounds worker processes."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Request:
    inputs: list[str]
    output: str
    tokenizer: str = "bytes"
    eod: Optional[str] = None
    format: str = "tokens"
    dtype: Optional[str] = None
    """None: the smallest that holds the vocabulary (uint16 below 65536 ids for tokens,
    megatron-core's choice for indexed)."""
    workers: int = 1
    """Processes tokenizing; more than ``usable_cores()`` is capped to it."""
    read: ReadOptions = field(default_factory=ReadOptions)
    force: bool = False
    progress: bool = True


@dataclass
class Report:
    documents: int = 0
    tokens: int = 0
    empty: int = 0
    replaced: int = 0
    seconds: float = 0.0
    dtype: str = ""
    info: Optional[TokenizerInfo] = None
    outputs: list[str] = field(default_factory=list)


def data_files(fmt: str, output: str, with_tokenizer: bool) -> list[str]:
    """The files an output is: the data, then the tokenizer, then the record (written last)."""
    data = [f"{output}.bin", f"{output}.idx"] if fmt == "indexed" else [output]
    return data + ([f"{output}{TOKENIZER_SUFFIX}"] if with_tokenizer else []) + \
        [f"{output}{META_SUFFIX}"]


def choose_dtype(fmt: str, dtype: Optional[str], vocab_size: int) -> str:
    """The output's dtype; ``InputError`` when ``dtype`` cannot hold the vocabulary."""
    if fmt not in FORMATS:
        raise InputError(f"--format {fmt} is unknown; choose one of {', '.join(FORMATS)}")
    if dtype is None:
        if fmt == "indexed":
            return np.dtype(optimal_dtype(vocab_size)).name
        return "uint16" if vocab_size <= 65536 else "uint32"
    if dtype not in DTYPES[fmt]:
        raise InputError(f"--dtype {dtype} is not one of --format {fmt}'s "
                         f"({', '.join(DTYPES[fmt])})")
    largest = int(np.iinfo(np.dtype(dtype)).max)
    if vocab_size - 1 > largest:
        raise InputError(f"--dtype {dtype} holds ids up to {largest} but the tokenizer has "
                         f"{vocab_size}; drop --dtype (hybrid-data then picks one that fits)")
    return dtype


def check_outputs(fmt: str, output: str, files: list[str], inputs: list[Path],
                  force: bool) -> None:
    """``InputError`` for an output that is an input, exists without ``force``, has no folder,
    or (indexed) names a file instead of a prefix."""
    if fmt == "indexed" and output.endswith((".bin", ".idx")):
        raise InputError(f"--format indexed writes PREFIX.bin and PREFIX.idx: pass the output "
                         f"without its extension ({output[:-4]})")
    for path in files:
        for source in inputs:
            if os.path.exists(path) and os.path.samefile(path, source):
                raise InputError(f"output {path} is the input file; write the tokens to "
                                 f"another path (e.g. {source}.bin)")
    existing = [path for path in files if os.path.exists(path)]
    if existing and not force:
        raise InputError(f"output {existing[0]} exists; choose another path or pass --force "
                         f"to replace it")
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise InputError(f"output folder {folder} does not exist; create it or choose "
                         f"another output path")


def prepare_data(request: Request) -> Report:
    """Tokenize ``request.inputs`` into ``request.output``; returns what was written."""
    started = time.perf_counter()
    inputs = expand_inputs(request.inputs)
    tokenizer = load_tokenizer(request.tokenizer, request.eod)
    info, tokenizer_json = tokenizer.info, tokenizer.to_json()
    dtype = choose_dtype(request.format, request.dtype, info.vocab_size)
    files = data_files(request.format, request.output, tokenizer_json is not None)
    check_outputs(request.format, request.output, files, inputs, request.force)
    if request.workers < 1:
        raise InputError(f"--workers {request.workers} must be >= 1")
    read = ReadOptions(**{**request.read.__dict__, "as_bytes": tokenizer.wants_bytes})
    report = Report(dtype=dtype, info=info, outputs=files)
    with AtomicFiles(files) as out, ExitStack() as stack:
        with writing(request.output):
            handle = out.handle(files[0])
        lengths = _write_tokens(handle, inputs, read, request, tokenizer, dtype, report, stack)
        if report.tokens == 0:
            raise InputError(f"the inputs hold no text ({report.empty} empty documents); "
                             f"check --json-key and --documents")
        with writing(request.output):
            if request.format == "indexed":
                write_index(out.handle(files[1]), np.dtype(dtype), lengths)
            if tokenizer_json is not None:
                out.handle(files[-2]).write(tokenizer_json.encode("utf-8"))
            out.handle(files[-1]).write(_record(request, inputs, report).encode("utf-8"))
            out.commit(stale=_stale(request.output, tokenizer_json is not None))
    report.seconds = time.perf_counter() - started
    return report


def _write_tokens(handle, inputs, read, request, tokenizer, dtype, report,
                  stack) -> np.ndarray:
    """Stream every chunk's tokens into ``handle``; the documents' lengths."""
    from tqdm import tqdm

    total = sum(path.stat().st_size for path in inputs)
    bar = stack.enter_context(tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing",
                                   disable=None if request.progress else True, leave=False))
    lengths: list[np.ndarray] = []
    chunks = read_chunks(inputs, read)
    workers = min(request.workers, usable_cores())
    if workers > 1:
        results = _encode_in_workers(chunks, workers, stack, read, tokenizer.info,
                                     tokenizer.to_json(), dtype)
    else:
        encoder = _Encoder(read, tokenizer, dtype)
        results = (_encode(chunk, encoder) for chunk in chunks)
    for result in results:
        with writing(request.output):
            result.tokens.tofile(handle)
        lengths.append(result.lengths)
        report.documents += len(result.lengths)
        report.tokens += len(result.tokens)
        report.empty += result.empty
        report.replaced += result.replaced
        bar.update(result.size)
        if bar.format_dict["elapsed"] > 0:
            bar.set_postfix(docs=report.documents,
                            tok_s=f"{report.tokens / bar.format_dict['elapsed']:.3g}",
                            refresh=False)
    return np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)


@dataclass
class _Encoded:
    lengths: np.ndarray
    tokens: np.ndarray
    empty: int
    replaced: int
    size: int


class _Encoder:
    """What a worker holds: the read options, the tokenizer and the output's dtype (a worker
    sends its tokens back as that: 2 bytes a token for uint16, not 8)."""

    def __init__(self, read: ReadOptions, tokenizer, dtype: str):
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
        self.read, self.tokenizer, self.dtype = read, tokenizer, dtype


def _encode(chunk: Chunk, encoder: _Encoder) -> _Encoded:
    found = chunk_documents(chunk, encoder.read)
    lengths, tokens = encoder.tokenizer.encode(found.texts)
    return _Encoded(lengths, tokens.astype(encoder.dtype), found.empty, found.replaced,
                    chunk.progress)


_WORKER: dict = {}  # the pool worker's encoder (its process only; set by _start_worker)


def _start_worker(read: ReadOptions, info: TokenizerInfo, tokenizer_json: Optional[str],
                  dtype: str) -> None:
    """A pool worker's encoder, its tokenizer rebuilt from the JSON the parent sent."""
    tokenizer = load_tokenizer("bytes") if tokenizer_json is None else \
        tokenizer_from_json(tokenizer_json, info)
    _WORKER["encoder"] = _Encoder(read, tokenizer, dtype)


def _worker_encode(chunk: Chunk) -> _Encoded:
    return _encode(chunk, _WORKER["encoder"])


def _encode_in_workers(chunks: Iterator[Chunk], workers: int, stack: ExitStack,
                       *encoder_args) -> Iterator[_Encoded]:
    """Each chunk's tokens, in order, from ``workers`` processes, at most 2 chunks per worker
    in flight (``map`` would read the whole input ahead). A worker that dies or cannot start
    breaks the pool (an error here), where ``multiprocessing.Pool`` would wait forever."""
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker,
                               initargs=encoder_args)
    stack.callback(pool.shutdown, wait=True, cancel_futures=True)
    pending: deque = deque()
    for chunk in chunks:
        pending.append(pool.submit(_worker_encode, chunk))
        if len(pending) >= 2 * workers:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _record(request: Request, inputs: list[Path], report: Report) -> str:
    import json

    return json.dumps({
        "format": request.format, "dtype": report.dtype, "documents": report.documents,
        "tokens": report.tokens, "empty_documents": report.empty,
        "replaced_bytes": report.replaced, "tokenizer": report.info.to_dict(),
        "inputs": [str(path) for path in inputs], "read": request.read.__dict__,
    }, indent=2) + "\n"


def _stale(output: str, with_tokenizer: bool) -> list[str]:
    """A previous output's tokenizer file that the new one (bytes) does not replace."""
    return [] if with_tokenizer else [f"{output}{TOKENIZER_SUFFIX}"]
