"""Checks on input batches, before any communication happens.

A bad batch on one rank must not leave the other ranks of its model-parallel group waiting in
a collective that the bad rank never joins. ``validate_batch`` is purely local (no
communication); ``validate_batch_across`` runs it on every rank, then agrees on the outcome with
one tiny all-reduce that every rank makes *before* the model's first collective, so all ranks
raise together: the bad rank with the precise reason, the others naming the bad rank.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from hybrid.comm import Group
from hybrid.planning.config import ModelConfig
from hybrid.errors import UserError


class ModelInputError(UserError):
    """A batch the model cannot take (ids outside the vocabulary, too long, wrong dtype)."""


def _batch_problem(tokens, labels, cfg: ModelConfig, sequence_shards: int) -> Optional[str]:
    """The first thing wrong with the batch, as one line, or None."""
    for name, t in (("tokens", tokens), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
        if t.dtype != torch.int64:
            return f"{name} must be int64 token ids, got {t.dtype}; convert with .long()"
        if t.dim() != 2:
            return f"{name} must be [batch, seq], got shape {tuple(t.shape)}"
    if tokens.shape != labels.shape:
        return f"tokens {tuple(tokens.shape)} and labels {tuple(labels.shape)} differ in shape"
    if tokens.numel() == 0:
        return f"the batch is empty: tokens have shape {tuple(tokens.shape)}"
    seq = tokens.shape[1]
    if seq > cfg.seq_len:
        return (f"sequence length {seq} exceeds model.seq_len={cfg.seq_len} (the position "
                f"table); cut sequences to {cfg.seq_len} or raise model.seq_len")
    if seq % sequence_shards:
        return (f"sequence length {seq} is not a multiple of tp={sequence_shards} "
                f"(sequence parallelism shards the sequence); use a multiple of {sequence_shards}")
    for name, t in (("tokens", tokens), ("labels", labels)):
        low, high = int(t.min()), int(t.max())
        if low < 0 or high >= cfg.vocab:
            return (f"{name} hold ids in [{low}, {high}] but model.vocab={cfg.vocab} allows "
                    f"[0, {cfg.vocab - 1}]; check the tokenizer or raise model.vocab")
    return None


def validate_batch(tokens, labels, cfg: ModelConfig, *, sequence_shards: int = 1) -> None:
    """Raise ``ModelInputError`` unless ``tokens``/``labels`` are int64 ``[b, s]`` ids that fit.

    Local only: it never communicates, so it can run anywhere, but a rank that raises here
    leaves its peers behind; inside a parallel job use ``validate_batch_across``.
    """
    problem = _batch_problem(tokens, labels, cfg, sequence_shards)
    if problem is not None:
        raise ModelInputError(problem)


def validate_batch_across(tokens, labels, cfg: ModelConfig, group: Group, *,
                          sequence_shards: int = 1) -> None:
    """``validate_batch`` on every rank of ``group``, then all raise if any batch was bad.

    Collective: every rank of ``group`` must call it for the same micro-batch. Costs one
    all-reduce of one integer (and, on CUDA, a host sync for the id range check).
    """
    problem = _batch_problem(tokens, labels, cfg, sequence_shards)
    if group.size() > 1:
        # Highest bad rank + 1, or 0 when every rank's batch is fine.
        flag = torch.tensor([group.rank() + 1 if problem else 0], dtype=torch.int64,
                            device=group.transport.tensor_device())
        group.all_reduce(flag, op=dist.ReduceOp.MAX)
        bad_rank = int(flag.item()) - 1
        if problem is None and bad_rank >= 0:
            problem = (f"rank {bad_rank} of this rank's model-parallel group got an invalid batch "
                       f"(see that rank's error); every rank stops before the forward pass")
    if problem is not None:
        raise ModelInputError(problem)

