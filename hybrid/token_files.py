"""Recognise a token file read the wrong way, from its first bytes (numpy only, no torch).

A text file passed as a token file, or a file written as uint16 and read as uint32 (or the
other way round), would otherwise be reported as token ids beyond the vocabulary, with a
suggested ``model.vocab`` in the tens of thousands or millions.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

SNIFF_BYTES = 1 << 16


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
    printable = sum(32 <= b < 127 or b in (9, 10, 13) for b in head)
    if head and printable >= 0.95 * len(head):
        return (f"data.path={path} looks like a text file, not a token file; make one with "
                f"`hybrid-data {path} tokens.bin` and pass data.path=tokens.bin")
    if dtype == "uint32":
        as16 = np.frombuffer(head[:len(head) // 2 * 2], dtype=np.uint16)
        if len(as16) and int(as16.max()) < vocab:
            return (f"data.path={path} holds ids >= model.vocab={vocab} as uint32 but all "
                    f"fit as uint16: it was written as uint16; set data.dtype=uint16")
    return None
