"""What ``hybrid-data`` records beside its output, and training's check of it before launch.

Beside ``DATA`` (the token file, or the ``PREFIX`` of an indexed pair) it writes
``DATA.meta.json``: the format, dtype, documents, tokens, inputs and the tokenizer
(``TokenizerInfo``), and for an HF tokenizer ``DATA.tokenizer.json``, the tokenizer itself,
so that a run (and generation) can decode what it trains on. Training checks ``model.vocab``
against the recorded vocabulary, and the data sets of a blend against each other, before any
worker starts. Files without a record (Megatron's own preprocessing, older token files) are
scanned for their largest id instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from hybrid.data.dataset import DataError
from hybrid.data.tokenizer import TokenizerInfo

META_SUFFIX = ".meta.json"
TOKENIZER_SUFFIX = ".tokenizer.json"


def meta_path(data: str) -> Path:
    return Path(f"{data}{META_SUFFIX}")


def tokenizer_path(data: str) -> Path:
    return Path(f"{data}{TOKENIZER_SUFFIX}")


def read_meta(data: str) -> Optional[dict]:
    """``DATA.meta.json``, or None when there is none (``DataError`` when it is unreadable)."""
    path = meta_path(data)
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
        TokenizerInfo.from_dict(meta["tokenizer"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{path} is not hybrid-data's record ({err}); remake the data with "
                        f"hybrid-data or delete the file to train without the check") from None
    return meta


def recorded_tokenizer(data: str) -> Optional[TokenizerInfo]:
    meta = read_meta(data)
    return None if meta is None else TokenizerInfo.from_dict(meta["tokenizer"])


def check_vocab(data: str, field: str, vocab: int) -> Optional[TokenizerInfo]:
    """``DataError`` when the recorded tokenizer's vocabulary exceeds ``model.vocab``;
    returns the record (None: nothing recorded, the caller scans the tokens)."""
    info = recorded_tokenizer(data)
    if info is not None and info.vocab_size > vocab:
        raise DataError(f"{field}={data} was tokenized with {info.source} (vocabulary "
                        f"{info.vocab_size}) but model.vocab={vocab}; set "
                        f"model.vocab={info.vocab_size}")
    return info


def check_same_tokenizer(records: dict[str, Optional[TokenizerInfo]]) -> None:
    """The data sets of a blend were tokenized alike (those with a record)."""
    known = {prefix: info for prefix, info in records.items() if info is not None}
    hashes = {info.sha256 for info in known.values()}
    if len(hashes) > 1:
        named = ", ".join(f"{prefix} ({info.source})" for prefix, info in known.items())
        raise DataError(f"data.blend mixes data sets made with different tokenizers: {named}; "
                        f"tokenize them all with one --tokenizer")
