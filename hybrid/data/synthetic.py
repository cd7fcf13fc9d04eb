"""``data.source=synthetic``: a seeded sparse Markov chain over the vocabulary.

Each token has ``len(SUCCESSOR_PROBS)`` successors with fixed probabilities, so a small GPT's
loss falls from ln(vocab) towards the chain's entropy (``markov_entropy()``, about 1.13 nats).
"""

from __future__ import annotations

import math

import numpy as np

from hybrid.data.dataset import DataError

SUCCESSOR_PROBS = (0.55, 0.25, 0.12, 0.08)
"""Probabilities of a token's successors in the synthetic chain, most likely first."""

# Independent random streams derived from the one config seed (the loader's order is 2).
_STREAM_CHAIN, _STREAM_SAMPLE = 0, 1


def markov_entropy() -> float:
    """Entropy in nats per token of the synthetic chain: the loss floor a model can reach."""
    return -sum(p * math.log(p) for p in SUCCESSOR_PROBS)


class MarkovDataset:
    """``samples`` sequences from a sparse Markov chain over ``vocab`` tokens, seeded by ``seed``.

    The first token of a sample is uniform; each next token is one of the current token's
    successors, chosen with ``SUCCESSOR_PROBS``. Successors of one token are distinct, so the
    per-token entropy is exactly ``markov_entropy()`` whenever vocab > len(SUCCESSOR_PROBS).
    """

    ordered = False

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
        return self.walk(index)

    def walk(self, index: int) -> np.ndarray:
        """Walk ``index`` of the chain (any index >= 0: those >= ``samples`` are held out)."""
        rng = np.random.default_rng((self.seed, _STREAM_SAMPLE, index))
        choices = rng.choice(len(self.probs), size=self.seq_len, p=self.probs).tolist()
        token = int(rng.integers(self.vocab))
        walk = [token]
        for choice in choices:
            token = self._successor_rows[token][choice]
            walk.append(token)
        return np.array(walk, dtype=np.int64)


class HeldOutMarkov:
    """``count`` walks of the same chain that training never reads (indices ``samples ...``
    of the training set's seed): the synthetic source's validation data, read in order."""

    ordered = True

    def __init__(self, train: MarkovDataset, count: int):
        self.train, self.count, self.seq_len = train, count, train.seq_len

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self.count:
            raise IndexError(f"held-out sample {index} out of range for {self.count}")
        return self.train.walk(self.train.samples + index)
