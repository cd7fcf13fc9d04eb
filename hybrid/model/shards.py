"""Gathering TP-sharded parameters (or their gradients) to full tensors: tests, checkpoints."""

from __future__ import annotations

import torch
import torch.distributed as dist


def gather_tp_param(tensor: torch.Tensor, param: torch.Tensor, groups) -> torch.Tensor:
    """The full tensor of which ``tensor`` (``param`` itself, or its gradient) is this rank's
    TP shard; a replicated parameter's tensor is returned as is.

    Collective over ``groups.tp`` for sharded parameters: every TP rank must call it for the
    same parameters in the same order. Uses megatron's ``tensor_model_parallel`` /
    ``partition_dim`` attributes, which every sharded parameter of ``build_blocks`` carries.
    """
    if not getattr(param, "tensor_model_parallel", False) or groups.tp.size() == 1:
        return tensor
    assert getattr(param, "partition_stride", 1) == 1, "strided shards are not used here"
    shards = [torch.empty_like(tensor) for _ in range(groups.tp.size())]
    dist.all_gather(shards, tensor.contiguous(), group=groups.tp)
    return torch.cat(shards, dim=param.partition_dim)
