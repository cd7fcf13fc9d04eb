"""What a file given to the wrong data source is, from its first bytes, and which setting
reads it: a Parquet, zstd or gzip file is ``hybrid-data``'s input (tokenize it first), a
Megatron index ``PREFIX.idx`` or its ``PREFIX.bin`` belongs to ``data=indexed``, a flat token
file to ``data=tokens``. Each message is one line with the setting that fits."""

from __future__ import annotations

import os
from typing import Optional

INPUT_CONTAINERS = ((b"PAR1", "a Parquet file"), (b"\x28\xb5\x2f\xfd", "a zstd-compressed file"),
                    (b"\x1f\x8b", "a gzip-compressed file"))
"""Magic bytes of hybrid-data's inputs, which no data source reads as they are."""
INDEX_MAGIC = b"MMIDIDX"


def _head(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read(8)


def _indexed_prefix(path: str) -> Optional[str]:
    """The PREFIX of an indexed pair that ``path`` is one half of (``PREFIX.bin`` or
    ``PREFIX.idx`` with the other beside it), or None."""
    stem, ext = os.path.splitext(path)
    if ext in (".bin", ".idx") and os.path.isfile(f"{stem}.idx") and os.path.isfile(f"{stem}.bin"):
        return stem
    return None


def _looks_like_text(path: str, sniff: int = 1 << 16) -> bool:
    with open(path, "rb") as handle:
        head = handle.read(sniff)
    return bool(head) and sum(32 <= b < 127 or b in (9, 10, 13) for b in head) >= 0.95 * len(head)


def input_container(path: str) -> Optional[str]:
    """``"a Parquet file"`` etc. when ``path`` is one of hybrid-data's inputs, else None."""
    head = _head(path)
    return next((what for magic, what in INPUT_CONTAINERS if head.startswith(magic)), None)


def _tokenize_it(path: str, what: str, field: str) -> str:
    return (f"{field}={path} is {what}, not tokens: no data source reads it as it is; "
            f"tokenize it with `hybrid-data {path} OUTPUT` and train with the `use:` line "
            f"it prints")


def not_a_token_file(path: str) -> Optional[str]:
    """For ``data=tokens``: the message when ``path`` is not a flat token file but an input
    to tokenize or one half of an indexed pair; None when it may be one."""
    what = input_container(path)
    if what:
        return _tokenize_it(path, what, "data.path")
    prefix = _indexed_prefix(path)
    if _head(path).startswith(INDEX_MAGIC) or (prefix and path.endswith(".idx")):
        prefix = prefix or os.path.splitext(path)[0]
        return (f"data.path={path} is a Megatron index (PREFIX.idx), not a token file; it "
                f"is read with its .bin by data=indexed data.path={prefix}")
    return None


def not_an_indexed_prefix(prefix: str) -> Optional[str]:
    """For ``data=indexed``, whose ``data.path`` is a PREFIX: the message when ``prefix`` is
    itself a file (a half of the pair, an input, a token file); None otherwise."""
    if not os.path.isfile(prefix):
        return None
    stem = _indexed_prefix(prefix)
    if stem:
        return (f"data.path={prefix} is one file of the indexed pair {stem}.bin/.idx; "
                f"data=indexed takes the PREFIX without extension: data.path={stem}")
    what = input_container(prefix) or ("a text file" if _looks_like_text(prefix) else None)
    if what:
        return _tokenize_it(prefix, what, "data.path")
    return (f"data.path={prefix} is a single file, and data=indexed takes the PREFIX of a "
            f"PREFIX.bin/PREFIX.idx pair; a flat token file (hybrid-data's default "
            f"--format tokens) is read by data=tokens data.path={prefix}")
