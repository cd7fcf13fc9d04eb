"""The communication of the tensor-parallel regions, on hybrid's TP group (``hybrid.comm.Group``),
on any device (gloo or NCCL): megatron-core's five mappings, and the only collectives the model
issues (megatron's layers are built to issue none of their own: ``megatron_adapter``).

Without sequence parallelism a column-parallel layer's input is copied into the region (its
gradient all-reduced: ``copy_to_tensor_region``) and a row-parallel layer's partial products
are summed out of it (``reduce_from_tensor_region``).

Activations are ``[s, b, h]``; with sequence parallelism each TP rank holds ``s / tp``
consecutive positions (rank r holds rows ``r*s/tp .. (r+1)*s/tp``). Between the
tensor-parallel regions the layer norms and residual adds run on these shards; entering a
column-parallel layer the shards are all-gathered, leaving a row-parallel layer the partial
sums are reduce-scattered. megatron-core has the same three mappings but allocates on
``torch.cuda.current_device()``, so these are device-neutral equivalents.

Parameters that act on sequence shards (norms, row-parallel biases) see only this rank's tokens,
so their gradients are partial sums: their ``ParamSpec`` says ``sequence_partial`` and
``allreduce_sequence_parallel_grads`` completes them once per step.
"""

from __future__ import annotations

from typing import Iterable

import torch

from hybrid.comm import Group


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The sum over ``group``, in place (as megatron's ``_reduce``)."""
    if group.size() == 1:
        return x
    x = x.contiguous()
    group.all_reduce(x)
    return x


def _all_gather_first_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    world = group.size()
    if world == 1:
        return x
    out = torch.empty((x.shape[0] * world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    group.all_gather_into(out, x.contiguous())
    return out


def _reduce_scatter_first_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    world = group.size()
    if world == 1:
        return x
    assert x.shape[0] % world == 0, f"sequence {x.shape[0]} not divisible by tp={world}"
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    group.reduce_scatter_into(out, x.contiguous())
    return out


def _split_first_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    world = group.size()
    if world == 1:
        return x
    assert x.shape[0] % world == 0, f"sequence {x.shape[0]} not divisible by tp={world}"
    # A first-dimension chunk is already contiguous, so .contiguous() would return a view
    # that keeps the whole replicated tensor alive for as long as the shard is saved for
    # backward (by the first layer's norm): clone, to hold only the shard.
    return x.chunk(world, dim=0)[group.rank()].clone()


class _CopyToTensorRegion(torch.autograd.Function):
    """Forward: the input as it is. Backward: all-reduce (each rank's input gradient is the
    partial sum its column slice contributes)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorRegion(torch.autograd.Function):
    """Forward: all-reduce the partial products. Backward: the gradient as it is."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequenceParallel(torch.autograd.Function):
    """Forward: all-gather the sequence shards. Backward: reduce-scatter (the consumer is a
    tensor-parallel layer, so each rank's input gradient is a partial sum)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_first_dim(grad, ctx.group), None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Forward: sum the partial products and keep this rank's shard. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_first_dim(grad, ctx.group), None


class _ScatterToSequenceParallel(torch.autograd.Function):
    """Forward: keep this rank's shard of a replicated tensor. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_first_dim(grad, ctx.group), None


def copy_to_tensor_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a column-parallel layer: identity forward, gradient all-reduced over ``group``."""
    return _CopyToTensorRegion.apply(x, group)


def reduce_from_tensor_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave a row-parallel layer: the partial products summed over ``group``."""
    return _ReduceFromTensorRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``[s/tp, b, h]`` shards -> full ``[s, b, h]``; the gradient is reduce-scattered back."""
    return _GatherFromSequenceParallel.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Partial sums ``[s, b, h]`` -> this rank's summed shard ``[s/tp, b, h]``."""
    return _ReduceScatterToSequenceParallel.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Replicated ``[s, b, h]`` -> this rank's shard ``[s/tp, b, h]``."""
    return _ScatterToSequenceParallel.apply(x, group)


def sequence_parallel_params(modules: Iterable[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """The distinct parameters whose spec says ``sequence_partial`` (their gradient is a partial
    sum over TP), in a stable order."""
    seen, found = set(), []
    for module in modules:
        for param in module.parameters():
            spec = getattr(param, "spec", None)
            if spec is not None and spec.sequence_partial and id(param) not in seen:
                seen.add(id(param))
                found.append(param)
    return found


def allreduce_sequence_parallel_grads(blocks: Iterable[torch.nn.Module],
                                      tp_group: Group) -> None:
    """Sum the partial gradients of sequence-parallel parameters over the TP group.

    Call once per optimizer step, after the last micro-batch's backward and before the DP
    gradient sync (the order does not matter for the result, both are sums). All TP ranks must
    call it with the same blocks; parameters without a gradient are skipped on every rank alike,
    because TP ranks run the same graph. One flat all-reduce, not one per parameter.
    """
    if tp_group.size() == 1:
        return
    grads = [p.grad for p in sequence_parallel_params(blocks) if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    tp_group.all_reduce(flat)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()
