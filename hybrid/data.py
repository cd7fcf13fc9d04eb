"""Training data: a generated Markov-chain data set, memory-mapped token files, and the loader.

Every sample is ``seq_len + 1`` token ids (inputs = ``[:-1]``, labels = ``[1:]``) and is
computable on its own from its index, so any rank can build any micro-batch without talking
to the others. The loader turns ``(seed, step)`` into a global batch that does not depend on
the layout; DP rank ``d`` of ``dp`` takes the ``d``-th contiguous share of it.

Two sources (``data.source``):

- ``synthetic``: a seeded sparse Markov chain over the vocabulary. Each token has
  ``len(SUCCESSOR_PROBS)`` successors with fixed probabilities, so a small GPT's loss falls
  from ln(vocab) towards the chain's entropy (``markov_entropy()``, about 1.13 nats).
- ``tokens``: a flat ``uint16``/``uint32`` array on disk (nanoGPT's and Megatron's format; make
  one with ``hybrid-data``). Sample ``i`` is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``:
  the stride is ``seq_len`` (Megatron's GPTDataset convention), so input windows never overlap,
  label windows never overlap, and every adjacent pair of the file is a target exactly once
  per epoch; a trailing remainder shorter than one sample is not used.

Epochs: step ``t`` (0-based) lies in epoch ``t // steps_per_epoch`` with
``steps_per_epoch = len(dataset) // global_batch``. Each epoch visits the samples in a
permutation seeded by ``(seed, epoch)``; the last incomplete global batch of an epoch is
dropped, so within an epoch every sample is seen at most once and all but fewer than
``global_batch`` samples are seen exactly once.

Only numpy is needed at import time: ``validate_data`` runs in the launcher before any worker
starts; torch is imported inside ``rank_microbatches``.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Protocol

import numpy as np

from hybrid.token_files import misread_file
from hybrid.errors import UserError

SOURCES = ("synthetic", "tokens")
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SUCCESSOR_PROBS = (0.55, 0.25, 0.12, 0.08)
"""Probabilities of a token's successors in the synthetic chain, most likely first."""
VOCAB_SCAN_CHUNK = 1 << 24
"""Tokens read per chunk when ``validate_data`` scans a file for its largest id."""

# Independent random streams derived from the one config seed.
_STREAM_CHAIN, _STREAM_SAMPLE, _STREAM_ORDER = 0, 1, 2


class DataError(UserError):
    """A data setting or data file that cannot work; the message names the field and the fix."""


class TokenDataset(Protocol):
    """What the loader needs: ``len``, and sample ``i`` as int64 ``[seq_len + 1]``."""

    seq_len: int

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> np.ndarray: ...


def markov_entropy() -> float:
    """Entropy in nats per token of the synthetic chain: the loss floor a model can reach."""
    return -sum(p * math.log(p) for p in SUCCESSOR_PROBS)


class MarkovDataset:
    """``samples`` sequences from a sparse Markov chain over ``vocab`` tokens, seeded by ``seed``.

    The first token of a sample is uniform; each next token is one of the current token's
    successors, chosen with ``SUCCESSOR_PROBS``. Successors of one token are distinct, so the
    per-token entropy is exactly ``markov_entropy()`` whenever vocab > len(SUCCESSOR_PROBS).
    """

    def __init__(self, *, vocab: int, seq_len: int, samples: int, seed: int):
        if vocab < 2:
            raise DataError(f"model.vocab={vocab} is too small for data.source=synthetic; "
                            f"use model.vocab >= 2")
        self.vocab, self.seq_len, self.samples = vocab, seq_len, samples
        self.seed = seed % 2**64
        self.probs = np.array(SUCCESSOR_PROBS[:vocab - 1], dtype=np.float64)
        self.probs /= self.probs.sum()
        self.successors = self._make_successors()  # [vocab, successors per token]
        self._successor_rows = self.successors.tolist()  # plain ints: the walk is a python loop

    def _make_successors(self) -> np.ndarray:
        # Strictly increasing offsets in [1, vocab] are distinct modulo vocab, so every token
        # gets distinct successors without a per-row sample-without-replacement loop.
        rng = np.random.default_rng((self.seed, _STREAM_CHAIN))
        k = len(self.probs)
        gaps = rng.integers(1, self.vocab // k + 1, size=(self.vocab, k))
        offsets = np.cumsum(gaps, axis=1)
        return (np.arange(self.vocab)[:, None] + offsets) % self.vocab

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self.samples:
            raise IndexError(f"sample {index} out of range for {self.samples} samples")
        rng = np.random.default_rng((self.seed, _STREAM_SAMPLE, index))
        choices = rng.choice(len(self.probs), size=self.seq_len, p=self.probs).tolist()
        token = int(rng.integers(self.vocab))
        walk = [token]
        for choice in choices:
            token = self._successor_rows[token][choice]
            walk.append(token)
        return np.array(walk, dtype=np.int64)


class TokenFileDataset:
    """Windows of ``seq_len + 1`` tokens at stride ``seq_len`` over a memory-mapped token file."""

    def __init__(self, *, path: str, dtype: str, vocab: int, seq_len: int):
        self.path, self.vocab, self.seq_len = path, vocab, seq_len
        self.dtype = TOKEN_DTYPES[dtype]
        self.num_tokens = _token_count(path, dtype)
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
        # even when validate_data was skipped.
        largest = int(window.max())
        if largest >= self.vocab:
            raise _vocab_error(self.path, largest, self.vocab)
        return window

    def __getstate__(self) -> dict:
        # Pickle the path, not the mapped tokens: a worker re-opens the file.
        return {key: value for key, value in self.__dict__.items() if key != "tokens"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.tokens = np.memmap(self.path, dtype=self.dtype, mode="r")


def _vocab_error(path: str, token: int, vocab: int) -> DataError:
    return DataError(f"data.path={path} holds token id {token} >= model.vocab={vocab}; "
                     f"set model.vocab={token + 1} or more, or retokenize the file")


def _check_source_and_dtype(data_cfg: Any) -> None:
    if data_cfg.source not in SOURCES:
        raise DataError(f"data.source={data_cfg.source!r} is unknown; "
                        f"choose one of {', '.join(SOURCES)}")
    if data_cfg.source == "tokens" and data_cfg.dtype not in TOKEN_DTYPES:
        raise DataError(f"data.dtype={data_cfg.dtype!r} is unknown; choose uint16 "
                        f"(vocab <= 65536) or uint32, the type the token file was written with")


def _token_count(path: str | None, dtype: str) -> int:
    if not path:
        raise DataError("data.source=tokens needs data.path; make a token file with "
                        "`hybrid-data INPUT.txt OUTPUT.bin` and pass data.path=OUTPUT.bin")
    if os.path.isdir(path):
        raise DataError(f"data.path={path} is a directory; pass one token file made with "
                        f"`hybrid-data INPUT.txt OUTPUT.bin`")
    if not os.path.isfile(path):
        raise DataError(f"data.path={path} does not exist; fix the path or make the file "
                        f"with `hybrid-data INPUT.txt {path}`")
    size, itemsize = os.path.getsize(path), np.dtype(TOKEN_DTYPES[dtype]).itemsize
    if size % itemsize:
        raise DataError(f"data.path={path} has {size} bytes, not a multiple of {itemsize} "
                        f"(data.dtype={dtype}); set data.dtype to the type the file was "
                        f"written with (uint16 or uint32)")
    return size // itemsize


def make_dataset(data_cfg: Any, model_cfg: Any, seed: int) -> TokenDataset:
    """The data set ``data_cfg`` describes, for ``model_cfg.seq_len`` and ``model_cfg.vocab``.

    Cheap checks only (no scan of a token file; windows are checked as they are read).
    """
    _check_source_and_dtype(data_cfg)
    if data_cfg.source == "synthetic":
        if data_cfg.samples < 1:
            raise DataError(f"data.samples={data_cfg.samples} must be >= 1 for "
                            f"data.source=synthetic; raise data.samples")
        return MarkovDataset(vocab=model_cfg.vocab, seq_len=model_cfg.seq_len,
                             samples=data_cfg.samples, seed=seed)
    return TokenFileDataset(path=data_cfg.path, dtype=data_cfg.dtype,
                            vocab=model_cfg.vocab, seq_len=model_cfg.seq_len)


def validate_data(data_cfg: Any, model_cfg: Any, train_cfg: Any) -> int:
    """Check the data before any worker starts; return the number of samples.

    Raises ``DataError`` for an unknown source or dtype, a missing or mis-sized token file,
    a file shorter than one global batch, or token ids >= ``model.vocab`` (a chunked scan).
    """
    dataset = make_dataset(data_cfg, model_cfg, seed=0)
    if len(dataset) < train_cfg.global_batch:
        raise _too_few_samples_error(data_cfg, model_cfg, len(dataset), train_cfg.global_batch)
    if isinstance(dataset, TokenFileDataset):
        largest = max_token(dataset.tokens)
        if largest >= model_cfg.vocab:
            misread = misread_file(data_cfg.path, data_cfg.dtype, model_cfg.vocab)
            raise DataError(misread) if misread else \
                _vocab_error(data_cfg.path, largest, model_cfg.vocab)
        misread = misread_file(data_cfg.path, data_cfg.dtype, model_cfg.vocab,
                               uint16_of_uint32=True)
        if misread:
            raise DataError(misread)
    return len(dataset)


def _too_few_samples_error(data_cfg: Any, model_cfg: Any, samples: int,
                           global_batch: int) -> DataError:
    if data_cfg.source == "synthetic":
        return DataError(f"data.samples={samples} is fewer than train.global_batch="
                         f"{global_batch}; raise data.samples or lower train.global_batch")
    return DataError(f"data.path={data_cfg.path} holds {samples} samples of "
                     f"model.seq_len+1={model_cfg.seq_len + 1} tokens (stride "
                     f"{model_cfg.seq_len}), fewer than train.global_batch={global_batch}; "
                     f"use a longer file or lower train.global_batch")


def max_token(tokens: np.ndarray, chunk: int = VOCAB_SCAN_CHUNK) -> int:
    """The largest id in ``tokens``, read ``chunk`` tokens at a time (bounded memory)."""
    return max(int(tokens[start:start + chunk].max()) for start in range(0, len(tokens), chunk))


def steps_per_epoch(num_samples: int, global_batch: int) -> int:
    """Whole global batches in one pass over the data (the incomplete last one is dropped)."""
    if not 1 <= global_batch <= num_samples:
        raise DataError(f"train.global_batch={global_batch} must be between 1 and the "
                        f"{num_samples} samples of the data set; lower train.global_batch "
                        f"or use more data")
    return num_samples // global_batch


@functools.lru_cache(maxsize=2)
def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The order of the samples in ``epoch``: a pure function of its arguments (read-only)."""
    order = np.random.default_rng((seed % 2**64, _STREAM_ORDER, epoch)).permutation(num_samples)
    order.flags.writeable = False
    return order


def global_batch_indices(step: int, *, num_samples: int, global_batch: int,
                         seed: int) -> np.ndarray:
    """Sample indices of the global batch of 0-based ``step``: the same for every layout."""
    if step < 0:
        raise ValueError(f"step={step} must be >= 0 (steps are 0-based)")
    per_epoch = steps_per_epoch(num_samples, global_batch)
    epoch, step_in_epoch = divmod(step, per_epoch)
    start = step_in_epoch * global_batch
    return epoch_permutation(num_samples, seed, epoch)[start:start + global_batch]


def rank_microbatches(dataset: TokenDataset, step: int, *, global_batch: int,
                      micro_batch: int, dp: int, dp_rank: int,
                      seed: int) -> list[tuple[Any, Any]]:
    """DP rank ``dp_rank``'s micro-batches of 0-based ``step``: ``(tokens, labels)`` pairs.

    Each tensor is ``torch.int64 [micro_batch, seq_len]``. The rank's share is the
    ``dp_rank``-th contiguous ``global_batch // dp`` slice of the step's global batch, so the
    concatenation over DP ranks (in rank order) is the 1-process global batch.
    """
    import torch

    if dp < 1 or not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank={dp_rank} is outside 0..{dp - 1} (dp={dp})")
    if global_batch % dp or (global_batch // dp) % micro_batch:
        raise DataError(f"train.global_batch={global_batch} is not divisible by "
                        f"dp*train.micro_batch={dp}*{micro_batch}; choose a global batch "
                        f"that is a multiple of {dp * micro_batch}")
    indices = global_batch_indices(step, num_samples=len(dataset),
                                   global_batch=global_batch, seed=seed)
    share = global_batch // dp
    mine = indices[dp_rank * share:(dp_rank + 1) * share]
    samples = torch.from_numpy(np.stack([dataset[int(i)] for i in mine]))  # [share, seq_len+1]
    return [(chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous())
            for chunk in samples.split(micro_batch)]
