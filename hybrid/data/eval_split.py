"""How many evaluation batches an indexed validation split holds, from its ``.idx`` alone.

megatron-core's ``GPTDataset`` cuts each data set's documents into train, validation and test
parts (``data.split``), and packs a part's tokens into samples of ``seq_len + 1`` tokens, each
starting where the previous one ended: one pass over a part of ``T`` tokens gives
``(T - 1) // seq_len`` samples. Asked for more, it builds further passes (epochs) over the same
documents, so an evaluation of more batches than that reads the same text again. A blend asks
each data set for its weight's share of the samples, plus megatron's surplus of 0.5%. The
document lengths are in the index, so this is known before megatron builds anything, in
milliseconds.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np

from hybrid.data.dataset import DataError
from hybrid.data.indexed import HEADER, read_index
from hybrid.planning.data_sources import (blend_of, evaluates, has_validation_split,
                                          split_documents)

MID_LEVEL_SURPLUS = 0.005
"""megatron-core's ``mid_level_dataset_surplus`` (its default): the share more samples a blend
asks of each data set than the weights give."""


def validation_samples(prefix: str, split: Any, seq_len: int) -> int:
    """Samples of ``seq_len + 1`` tokens that one pass over ``prefix``'s validation part
    gives (megatron's ``GPTDataset``)."""
    info = read_index(prefix)
    train, valid, _ = split_documents(split, info.documents)
    lengths = np.memmap(f"{prefix}.idx", dtype=np.int32, mode="r", offset=HEADER.size,
                        shape=(info.documents,))
    tokens = int(lengths[train:train + valid].sum(dtype=np.int64))
    del lengths  # close the map
    return max(0, (tokens - 1) // seq_len)


def fits(samples: int, held: Sequence[int], weights: Optional[Sequence[float]]) -> bool:
    """Whether ``samples`` validation samples read every data set's part at most once."""
    if weights is None:
        return samples <= held[0]
    return all(math.ceil(math.ceil(samples * w) * (1 + MID_LEVEL_SURPLUS)) <= s
               for w, s in zip(weights, held))


def most_batches(held: Sequence[int], weights: Optional[Sequence[float]],
                 global_batch: int) -> int:
    """The most global batches the validation parts hold, each read once."""
    # a blend's weights sum to 1, so no more than all parts together fit
    low, high = 0, sum(held) // global_batch + 1

    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle * global_batch, held, weights) else \
            (low, middle)
    return low


def check_eval_split(cfg: Any, prefixes: Sequence[str]) -> None:
    """``DataError`` when ``eval.batches`` global batches are more than the validation split
    of the indexed data sets at ``prefixes`` holds (read once); nothing to check when the run
    does not evaluate on an indexed split."""
    if not prefixes or not has_validation_split(cfg.data) or not evaluates(cfg.eval, cfg.data):
        return
    seq_len, batch, batches = cfg.model.seq_len, cfg.train.global_batch, cfg.eval.batches
    held = [validation_samples(prefix, cfg.data.split, seq_len) for prefix in prefixes]
    weights = blend_of(cfg.data).weights  # None for one data set (no surplus asked)
    if fits(batches * batch, held, weights):
        return
    most = most_batches(held, weights, batch)
    where = (f"the validation split of {prefixes[0]} holds {held[0]:,} samples" if weights is None
             else "the validation splits of the blend hold " + ", ".join(
                 f"{s:,} ({w:.0%} of the samples)" for s, w in zip(held, weights)))
    fix = (f"choose eval.batches <= {most}" if most else
           f"give the validation part more documents (data.split) or turn evaluation off with "
           f"eval.every=0 eval.at_end=false")
    raise DataError(f"eval.batches={batches} x train.global_batch={batch} = {batches * batch:,} "
                    f"samples per evaluation, and {where} of model.seq_len+1={seq_len + 1} "
                    f"tokens: it would read them more than once; {fix}")
