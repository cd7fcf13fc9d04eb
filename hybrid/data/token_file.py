"""``data.source=tokens``: a flat ``uint16``/``uint32`` token file (nanoGPT's format; make one
with ``hybrid-data``), and the recognition of a file read the wrong way.

Sample ``i`` is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``: the stride is ``seq_len``
(Megatron's GPTDataset convention), so input windows never overlap, label windows never
overlap, and every adjacent pair of the file is a target exactly once per epoch; a trailing
remainder shorter than one sample is not used.

A text file passed as a token file, or a file written as uint16 and read as uint32 (or the
other way round), would otherwise be reported as token ids beyond the vocabulary, with a
suggested ``model.vocab`` in the tens of thousands or millions: ``misread_file`` says what
happened instead.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from hybrid.data.file_kinds import not_a_token_file
from hybrid.data.dataset import DataError

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
VOCAB_SCAN_CHUNK = 1 << 24
"""Tokens read per chunk when a file is scanned for its largest id."""


class TokenFileDataset:
    """Windows of ``seq_len + 1`` tokens at stride ``seq_len`` over a memory-mapped token file."""

    ordered = False

    def __init__(self, *, path: str, dtype: str, vocab: int, seq_len: int):
        self.path, self.vocab, self.seq_len = path, vocab, seq_len
        self.num_tokens = token_count(path, dtype)
        self.dtype = TOKEN_DTYPES[dtype]
        if self.num_tokens < seq_len + 1:
            raise DataError(
                f"data.path={path} holds {self.num_tokens} tokens, fewer than "
                f"model.seq_len+1={seq_len + 1} for one sample; use a longer file or lower "
                f"model.seq_len")
        self.tokens = np.memmap(path, dtype=self.dtype, mode="r")

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.seq_len

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        start = index * self.seq_len
        window = np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64)
        # A per-window check is cheap and keeps a bad file from reaching the embedding
        # even when the launcher's scan was skipped.
        largest = int(window.max())
        if largest >= self.vocab:
            raise vocab_error(self.path, largest, self.vocab)
        return window

    def __getstate__(self) -> dict:
        # Pickle the path, not the mapped tokens: a worker re-opens the file.
        return {key: value for key, value in self.__dict__.items() if key != "tokens"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.tokens = np.memmap(self.path, dtype=self.dtype, mode="r")


def vocab_error(path: str, token: int, vocab: int) -> DataError:
    return DataError(f"data.path={path} holds token id {token} >= model.vocab={vocab}; "
                     f"set model.vocab={token + 1} or more, or retokenize the file")


def token_count(path: Optional[str], dtype: str) -> int:
    """Tokens in the file at ``path`` read as ``dtype``, after checking it can be read so."""
    if dtype not in TOKEN_DTYPES:
        raise DataError(f"data.dtype={dtype!r} is unknown; choose uint16 (vocab <= 65536) or "
                        f"uint32, the type the token file was written with")
    if not path:
        raise DataError("data.source=tokens needs data.path; make a token file with "
                        "`hybrid-data INPUT.txt OUTPUT.bin` and pass data.path=OUTPUT.bin")
    if os.path.isdir(path):
        raise DataError(f"data.path={path} is a directory; pass one token file made with "
                        f"`hybrid-data INPUT.txt OUTPUT.bin`")
    if not os.path.isfile(path):
        raise DataError(f"data.path={path} does not exist; fix the path or make the file "
                        f"with `hybrid-data INPUT.txt {path}`")
    wrong_kind = not_a_token_file(path)
    if wrong_kind:
        raise DataError(wrong_kind)
    size, itemsize = os.path.getsize(path), np.dtype(TOKEN_DTYPES[dtype]).itemsize
    if size % itemsize:
        text = text_file_message(path)  # an odd length is more often text than a wrong dtype
        if text:
            raise DataError(text)
        raise DataError(f"data.path={path} has {size} bytes, not a multiple of {itemsize} "
                        f"(data.dtype={dtype}); set data.dtype to the type the file was "
                        f"written with (uint16 or uint32)")
    return size // itemsize


def check_token_file(path: str, dtype: str, vocab: int) -> None:
    """Scan the file for ids >= ``vocab`` and for signs it is read the wrong way."""
    largest = max_token(np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r"))
    if largest >= vocab:
        misread = misread_file(path, dtype, vocab)
        raise DataError(misread) if misread else vocab_error(path, largest, vocab)
    misread = misread_file(path, dtype, vocab, uint16_of_uint32=True)
    if misread:
        raise DataError(misread)


def max_token(tokens: np.ndarray, chunk: int = VOCAB_SCAN_CHUNK) -> int:
    """The largest id in ``tokens``, read ``chunk`` tokens at a time (bounded memory)."""
    return max(int(tokens[start:start + chunk].max()) for start in range(0, len(tokens), chunk))


SNIFF_BYTES = 1 << 16


def text_file_message(path: str, head: Optional[bytes] = None) -> Optional[str]:
    """The message for a text file given as a token file (its first bytes nearly all
    printable ASCII), or None."""
    if head is None:
        with open(path, "rb") as handle:
            head = handle.read(SNIFF_BYTES)
    printable = sum(32 <= b < 127 or b in (9, 10, 13) for b in head)
    if head and printable >= 0.95 * len(head):
        return (f"data.path={path} looks like a text file, not a token file; make one with "
                f"`hybrid-data {path} tokens.bin` and pass data.path=tokens.bin")
    return None


def misread_file(path: str, dtype: str, vocab: int, *,
                 uint16_of_uint32: bool = False) -> Optional[str]:
    """The message for a token file read the wrong way, or None: a text file, a uint16 file
    read as uint32, or (``uint16_of_uint32``) a uint32 file read as uint16, whose every other
    token is the zero high half of an id."""
    with open(path, "rb") as handle:
        head = handle.read(SNIFF_BYTES)
    if uint16_of_uint32:
        halves = np.frombuffer(head[:len(head) // 4 * 4], dtype=np.uint16)
        if dtype == "uint16" and len(halves) >= 64 and not halves[1::2].any() \
                and halves[0::2].any():
            return (f"data.path={path} reads as uint16 with every other token 0: it was "
                    f"written as uint32; set data.dtype=uint32")
        return None
    text = text_file_message(path, head)
    if text:
        return text
    if dtype == "uint32":
        as16 = np.frombuffer(head[:len(head) // 2 * 2], dtype=np.uint16)
        if len(as16) and int(as16.max()) < vocab:
            return (f"data.path={path} holds ids >= model.vocab={vocab} as uint32 but all "
                    f"fit as uint16: it was written as uint16; set data.dtype=uint16")
    return None
