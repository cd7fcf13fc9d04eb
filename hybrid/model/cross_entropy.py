"""Vocab-parallel cross entropy on an explicit TP group.

megatron-core's ``vocab_parallel_cross_entropy`` reads its global TP group; this is the same
algorithm (megatron's own group-free math helpers) with the group passed in. Each rank holds
logits for a contiguous slice of the (padded) vocabulary; three all-reduces (max, target logit,
sum of exponentials) give every rank the exact full-vocabulary loss without gathering logits.
The loss is computed in fp32 whatever the logits' dtype (bf16 under autocast).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybrid.model.megatron_adapter import VocabParallelCrossEntropy, VocabUtility


def _all_reduce(t: torch.Tensor, group: dist.ProcessGroup, op=dist.ReduceOp.SUM) -> None:
    if group.size() > 1:
        dist.all_reduce(t, op=op, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, group):
        math = VocabParallelCrossEntropy
        # .float() copies bf16 logits; fp32 logits are cloned so the in-place math below never
        # touches the caller's tensor.
        logits = vocab_parallel_logits.float().clone()
        logits, logits_max = math.calculate_logits_max(logits)
        _all_reduce(logits_max, group, dist.ReduceOp.MAX)

        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            logits.size(-1), group.rank(), group.size())
        target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits = (
            math.calculate_predicted_logits(logits, target, logits_max, start, end))
        _all_reduce(predicted_logits, group)
        _all_reduce(sum_exp_logits, group)

        softmax, loss = math.calculate_cross_entropy_loss(exp_logits, predicted_logits,
                                                          sum_exp_logits)
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        ctx.logits_dtype = vocab_parallel_logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        math = VocabParallelCrossEntropy
        grad_2d, arange_1d, softmax_update, grad_input = (
            math.prepare_gradient_calculation_operands(softmax, target_mask))
        grad_input = math.calculate_gradients(grad_2d, arange_1d, masked_target_1d,
                                              softmax_update, grad_input, grad_output.float())
        return grad_input.to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 group: dist.ProcessGroup) -> torch.Tensor:
    """Per-token loss ``[s, b]`` (fp32) from logits ``[s, b, V/tp]`` and targets ``[s, b]``."""
    device_type = vocab_parallel_logits.device.type
    with torch.autocast(device_type, enabled=False):
        return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target.contiguous(), group)
