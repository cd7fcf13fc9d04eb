"""Megatron's indexed format, MMIDIDX version 1, in numpy: ``PREFIX.bin`` + ``PREFIX.idx``.

``PREFIX.bin`` is every document's tokens back to back, in the dtype the index names, with no
header. ``PREFIX.idx`` (little-endian) is::

    9 bytes  magic b"MMIDIDX\\x00\\x00"
    <Q       version (1)
    <B       dtype code of the tokens (megatron-core's DType: uint8=1 ... uint16=8)
    <Q       sequence count N
    <Q       document count D + 1 (the boundaries, with a leading 0)
    int32[N] sequence lengths in tokens
    int64[N] sequence pointers: byte offsets into PREFIX.bin
    int64[D+1] document boundaries as sequence indices (GPT data: 0, 1, ..., N)

megatron-core's ``IndexedDataset`` reads these files and ``IndexedDatasetBuilder`` writes
them (tests/test_indexed.py proves both directions). hybrid writes them itself, streaming,
because megatron-core's builder wants a torch tensor per document and costs a 5 s import in
a command that needs neither; training reads them with megatron-core. ``read_index`` checks a
pair before launch so that a bad file is one line, not an assertion inside a rank.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from hybrid.data.file_kinds import not_an_indexed_prefix
from hybrid.data.dataset import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float64, 7: np.float32, 8: np.uint16}
"""megatron-core's ``DType`` codes."""
INTEGER_CODES = (1, 2, 3, 4, 5, 8)
SCAN_ENTRIES = 1 << 22
"""Index entries checked per step (bounded memory on an index of any size)."""
MAKE_ONE = ("make the pair with `hybrid-data --format indexed INPUT... PREFIX` (or Megatron's "
            "preprocess_data.py)")


def code_of(dtype: np.dtype | type) -> int:
    """The index's code for a token dtype."""
    for code, known in DTYPE_CODES.items():
        if np.dtype(known) == np.dtype(dtype):
            return code
    raise ValueError(f"dtype {np.dtype(dtype)} has no MMIDIDX code")


def optimal_dtype(vocab_size: int) -> type:
    """megatron-core's choice (``DType.optimal_dtype``): uint16 below 65500 ids, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


@dataclass(frozen=True)
class IndexInfo:
    """A checked ``PREFIX.bin``/``PREFIX.idx`` pair."""

    prefix: str
    dtype: np.dtype
    documents: int
    tokens: int


def read_index(prefix: str) -> IndexInfo:
    """Check the pair at ``prefix`` (both files there, magic, version, dtype, sizes, the
    ``.bin`` as long as the index says); ``DataError`` with one line naming the file."""
    idx, bin_path = f"{prefix}.idx", f"{prefix}.bin"
    wrong_kind = not_an_indexed_prefix(prefix)
    if wrong_kind and not os.path.isfile(idx):
        raise DataError(wrong_kind)
    for path in (idx, bin_path):
        if not os.path.isfile(path):
            raise DataError(f"{path} does not exist; pass the PREFIX of PREFIX.bin and "
                            f"PREFIX.idx (no extension), or {MAKE_ONE}")
    with open(idx, "rb") as handle:
        head = handle.read(HEADER.size)
    if len(head) < HEADER.size or not head.startswith(MAGIC):
        raise DataError(f"{idx} is not a Megatron index (its first bytes are {head[:9]!r}, "
                        f"not {MAGIC!r}); {MAKE_ONE}")
    _, version, code, sequences, boundaries = HEADER.unpack(head)
    if version != VERSION:
        raise DataError(f"{idx} is MMIDIDX version {version}; hybrid and megatron-core read "
                        f"version {VERSION}: rewrite it with a current preprocess_data.py")
    if code not in INTEGER_CODES:
        raise DataError(f"{idx} names token dtype code {code}, not an integer type "
                        f"({', '.join(f'{c}={np.dtype(DTYPE_CODES[c])}' for c in INTEGER_CODES)}); "
                        f"{MAKE_ONE}")
    expected = HEADER.size + 12 * sequences + 8 * boundaries
    if os.path.getsize(idx) != expected or boundaries < 1:
        raise DataError(f"{idx} has {os.path.getsize(idx)} bytes but its header describes "
                        f"{expected} ({sequences} sequences, {boundaries - 1} documents): it "
                        f"is truncated or not GPT data; {MAKE_ONE}")
    if sequences == 0:
        raise DataError(f"{idx} indexes no documents; tokenize some text into it")
    dtype = np.dtype(DTYPE_CODES[code])
    lengths = np.memmap(idx, dtype=np.int32, mode="r", offset=HEADER.size, shape=(sequences,))
    tokens = int(lengths.sum(dtype=np.int64))
    del lengths  # close the map
    size = os.path.getsize(bin_path)
    if size != tokens * dtype.itemsize:
        raise DataError(f"{bin_path} has {size} bytes but {idx} indexes {tokens} {dtype} tokens "
                        f"({tokens * dtype.itemsize} bytes): the pair does not belong together "
                        f"or one is truncated; {MAKE_ONE}")
    _check_pointers(idx, bin_path, dtype, sequences, boundaries, size)
    return IndexInfo(prefix=prefix, dtype=dtype, documents=boundaries - 1, tokens=tokens)


def _check_pointers(idx: str, bin_path: str, dtype: np.dtype, sequences: int, boundaries: int,
                    size: int) -> None:
    """Every sequence where the ones before it end, inside the ``.bin``, and the document
    boundaries rising from 0 to the last sequence: a damaged pointer would otherwise train
    until its document is read (megatron reads where the pointer says, unchecked)."""
    maps = _index_arrays(idx, sequences, boundaries)
    end = 0  # where the sequences read so far end, in bytes
    for start in range(0, sequences, SCAN_ENTRIES):
        lengths = maps["lengths"][start:start + SCAN_ENTRIES].astype(np.int64) * dtype.itemsize
        pointers = np.asarray(maps["pointers"][start:start + SCAN_ENTRIES])
        expected = end + np.concatenate(([0], np.cumsum(lengths[:-1])))
        wrong = np.flatnonzero((pointers != expected) | (lengths < 0))
        if len(wrong):
            at = int(wrong[0])
            raise DataError(f"{idx}: sequence {start + at} points to byte {int(pointers[at])} "
                            f"of {bin_path} ({size} bytes), where the sequences before it end "
                            f"at byte {int(expected[at])}: the index is damaged or belongs to "
                            f"other data; {MAKE_ONE}")
        end = int(expected[-1] + lengths[-1])
    documents = maps["documents"]
    falling = any((np.diff(documents[start:start + SCAN_ENTRIES + 1]) < 0).any()
                  for start in range(0, boundaries, SCAN_ENTRIES))
    if documents[0] != 0 or documents[-1] != sequences or falling:
        raise DataError(f"{idx}: its document boundaries do not rise from 0 to its {sequences} "
                        f"sequences: the index is damaged; {MAKE_ONE}")


def _index_arrays(idx: str, sequences: int, boundaries: int) -> dict[str, np.memmap]:
    """The index's three arrays, mapped read-only."""
    lengths_at = HEADER.size
    pointers_at = lengths_at + 4 * sequences
    documents_at = pointers_at + 8 * sequences
    return {"lengths": np.memmap(idx, np.int32, "r", lengths_at, (sequences,)),
            "pointers": np.memmap(idx, np.int64, "r", pointers_at, (sequences,)),
            "documents": np.memmap(idx, np.int64, "r", documents_at, (boundaries,))}


def write_index(handle: BinaryIO, dtype: np.dtype | type, lengths: np.ndarray) -> None:
    """Write the ``.idx`` of documents of ``lengths`` tokens (one sequence per document)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
        raise ValueError("a document length does not fit the index's int32")
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1] * itemsize, out=pointers[1:])
    handle.write(HEADER.pack(MAGIC, VERSION, code_of(dtype), len(lengths), len(lengths) + 1))
    handle.write(lengths.astype(np.int32).tobytes(order="C"))
    handle.write(pointers.tobytes(order="C"))
    handle.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes(order="C"))


def document_tokens(prefix: str, info: IndexInfo) -> np.memmap:
    """Every token of the pair as one flat read-only map (for a scan of the largest id)."""
    return np.memmap(f"{prefix}.bin", dtype=info.dtype, mode="r", shape=(info.tokens,))
