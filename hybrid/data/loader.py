"""Global batches that do not depend on the layout, and a DP rank's micro-batches of them.

Every sample is ``seq_len + 1`` token ids (inputs = ``[:-1]``, labels = ``[1:]``) and is
computable on its own from its index, so any rank can build any micro-batch without talking
to the others. The loader turns ``(seed, step)`` into a global batch; DP rank ``d`` of ``dp``
takes the ``d``-th contiguous share of it.

Order. A source that orders its samples itself (``ordered``: megatron-core's GPTDataset and
BlendedDataset, shuffled by their own seed, sized for the whole run) is read in order: step
``t`` takes samples ``t*global_batch ...``, as Megatron's pretraining sampler does, so a blend
keeps its weights in every prefix of the run. Any other source is visited in epochs: step
``t`` lies in epoch ``t // steps_per_epoch`` with ``steps_per_epoch = len(dataset) //
global_batch``; each epoch visits the samples in a permutation seeded by ``(seed, epoch)``
and drops its last incomplete global batch, so within an epoch every sample is seen at most
once and all but fewer than ``global_batch`` samples are seen exactly once.

Either way the data position is a function of the step, so a resumed run reads exactly what
the uninterrupted run read.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import numpy as np

from hybrid.data.dataset import DataError, TokenDataset

_STREAM_ORDER = 2  # the synthetic source's streams are 0 and 1


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


def global_batch_indices(step: int, *, num_samples: int, global_batch: int, seed: int,
                         ordered: bool = False) -> np.ndarray:
    """Sample indices of the global batch of 0-based ``step``: the same for every layout."""
    if step < 0:
        raise ValueError(f"step={step} must be >= 0 (steps are 0-based)")
    if ordered:
        start = step * global_batch
        if start + global_batch > num_samples:
            raise DataError(f"step {step + 1} needs samples up to {start + global_batch} but "
                            f"the data set was built with {num_samples}; the run's data is "
                            f"sized for train.steps x train.global_batch")
        return np.arange(start, start + global_batch)
    per_epoch = steps_per_epoch(num_samples, global_batch)
    epoch, step_in_epoch = divmod(step, per_epoch)
    start = step_in_epoch * global_batch
    return epoch_permutation(num_samples, seed, epoch)[start:start + global_batch]


def rank_microbatches(dataset: TokenDataset, step: int, *, global_batch: int,
                      micro_batch: int, dp: int, dp_rank: int, seed: int,
                      cp: int = 1, cp_rank: int = 0,
                      shares: Optional[Sequence[int]] = None) -> list[tuple[Any, Any]]:
    """DP rank ``dp_rank``'s micro-batches of 0-based ``step``: ``(tokens, labels)`` pairs.

    Each tensor is ``torch.int64 [micro_batch, seq_len]``. The rank's share is the
    ``dp_rank``-th contiguous ``global_batch // dp`` slice of the step's global batch, so the
    concatenation over DP ranks (in rank order) is the 1-process global batch. Under context
    parallelism every rank of a context group reads the same samples and keeps its own chunks
    of each sequence (``[micro_batch, seq_len / cp]``, ``hybrid.model.context.context_slice``).

    ``shares``: micro-batches per DP rank (``parallel.dp_balance=dynamic``), summing to the
    step's ``global_batch // micro_batch``; rank ``d`` then reads the ``d``-th contiguous run
    of ``shares[d]`` micro-batches, so the concatenation is still the global batch. None: even.
    """
    import torch

    from hybrid.model.context import context_slice

    if dp < 1 or not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank={dp_rank} is outside 0..{dp - 1} (dp={dp})")
    if global_batch % dp or (global_batch // dp) % micro_batch:
        raise DataError(f"train.global_batch={global_batch} is not divisible by "
                        f"dp*train.micro_batch={dp}*{micro_batch}; choose a global batch "
                        f"that is a multiple of {dp * micro_batch}")
    indices = global_batch_indices(step, num_samples=len(dataset), global_batch=global_batch,
                                   seed=seed, ordered=getattr(dataset, "ordered", False))
    start, stop = share_span(global_batch // micro_batch, dp, dp_rank, shares)
    mine = indices[start * micro_batch:stop * micro_batch]
    samples = torch.from_numpy(np.stack([dataset[int(i)] for i in mine]))  # [share, seq_len+1]
    return [(context_slice(chunk[:, :-1], cp, cp_rank), context_slice(chunk[:, 1:], cp, cp_rank))
            for chunk in samples.split(micro_batch)]


def share_span(microbatches: int, dp: int, dp_rank: int,
               shares: Optional[Sequence[int]] = None) -> tuple[int, int]:
    """The micro-batches ``[start, stop)`` of the step that DP rank ``dp_rank`` reads."""
    if shares is None:
        shares = [microbatches // dp] * dp
    if len(shares) != dp or sum(shares) != microbatches or min(shares) < 1:
        raise ValueError(f"shares {list(shares)} must be {dp} counts >= 1 summing to the "
                         f"step's {microbatches} micro-batches")
    start = sum(shares[:dp_rank])
    return start, start + shares[dp_rank]
