"""Vocab-parallel cross entropy on an explicit TP group, with one collective.

Each rank holds logits for a contiguous slice of the (padded) vocabulary. megatron-core's
``vocab_parallel_cross_entropy`` (which also reads a global TP group) all-reduces three times
in a row: the max, the target's logit, the sum of exponentials. Here each rank reduces its own
slice first, to three numbers per token: its max ``m_r``, its sum ``s_r = sum exp(x - m_r)``
and the target's raw logit ``t_r`` (0 where the target is not in its slice); one all-gather of
those ``[3, tokens]`` gives every rank every slice's numbers, from which the exact loss
follows with no further traffic::

    M = max_r m_r      S = sum_r s_r exp(m_r - M)      loss = log S + M - sum_r t_r

Each rank still shifts by its own max before exponentiating, so no exponential overflows;
``exp(m_r - M) <= 1``. On one rank the gather is skipped. A collective costs far more than the
arithmetic on a few numbers per token (on gloo, around a millisecond of CPU each), so one
instead of three is what this buys. The loss is computed in fp32 whatever the logits' dtype
(bf16 under autocast).

Padding: the vocabulary is padded (``model.vocab_pad_multiple``) so that TP splits it evenly;
the padding columns are no tokens, so their logits are set to the most negative float before
the softmax. They then add nothing to the loss and get exactly zero gradient, and the loss is
the cross entropy over the real vocabulary, as HF's GPT-2 (which has no padding) computes it.
Not -inf: a rank whose whole slice is padding would compute ``exp(-inf - -inf)`` = NaN.
"""

from __future__ import annotations

import torch

from hybrid.comm import Group


def _gather_stats(stats: torch.Tensor, group: Group) -> torch.Tensor:
    """``[3, tokens]`` per rank -> ``[tp, 3, tokens]``, every rank's, in rank order."""
    if group.size() == 1:
        return stats.unsqueeze(0)
    out = stats.new_empty((group.size() * stats.size(0), stats.size(1)))
    group.all_gather_into(out, stats)  # gloo wants the ranks along dim 0
    return out.view(group.size(), *stats.shape)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, group, vocab):
        logits = vocab_parallel_logits.float()  # [tokens, V/tp]; a copy only when bf16
        width, rank = logits.size(-1), group.rank()
        padding = (rank + 1) * width - max(vocab, rank * width)  # this slice's padding columns
        if padding > 0:  # out of place: the input may be the autograd input itself
            logits = logits.clone()
            logits[:, width - padding:] = torch.finfo(logits.dtype).min
        local_max = logits.max(dim=-1).values
        exp_logits = (logits - local_max.unsqueeze(-1)).exp_()
        in_shard = (target >= rank * width) & (target < (rank + 1) * width)
        local_target = (target - rank * width).clamp_(0, width - 1)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * in_shard
        stats = _gather_stats(torch.stack([local_max, exp_logits.sum(-1), target_logit]), group)
        maxes, sums, target_logits = stats.unbind(1)  # each [tp, tokens]
        global_max = maxes.max(dim=0).values
        scale = (maxes - global_max).exp_()  # this slice's sum, in units of exp(M)
        total = (sums * scale).sum(0)
        loss = total.log() + global_max - target_logits.sum(0)
        softmax = exp_logits.mul_((scale[rank] / total).unsqueeze(-1))
        ctx.save_for_backward(softmax, in_shard, local_target)
        ctx.logits_dtype = vocab_parallel_logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, in_shard, local_target = ctx.saved_tensors
        # d loss / d logits = softmax - one_hot(target), the one-hot on the target's slice only.
        grad = softmax.scatter_add(-1, local_target.unsqueeze(-1),
                                   -in_shard.unsqueeze(-1).to(softmax.dtype))
        grad.mul_(grad_output.float().unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 group: Group, vocab: int) -> torch.Tensor:
    """Per-token loss ``[s, b]`` (fp32) from logits ``[s, b, V/tp]`` and targets ``[s, b]``
    over the first ``vocab`` columns of the padded vocabulary (the rest are padding)."""
    device_type = vocab_parallel_logits.device.type
    shape = target.shape
    with torch.autocast(device_type, enabled=False):
        loss = _VocabParallelCrossEntropy.apply(
            vocab_parallel_logits.reshape(-1, vocab_parallel_logits.size(-1)),
            target.reshape(-1), group, vocab)
    return loss.view(shape)
