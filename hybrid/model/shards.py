"""Gathering TP-sharded parameters (or their gradients) to full tensors: tests, checkpoints."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybrid.optim import spec_of


def gather_tp_param(tensor: torch.Tensor, param: torch.Tensor, groups) -> torch.Tensor:
    """The full tensor of which ``tensor`` (``param`` itself, or its gradient) is this rank's
    TP shard; a replicated parameter's tensor is returned as is.

    Collective over ``groups.tp`` for sharded parameters: every TP rank must call it for the
    same parameters in the same order. Reads the parameter's ``ParamSpec``.
    """
    spec = spec_of(param)
    if spec.tp_dim is None or groups.tp.size() == 1:
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(groups.tp.size())]
    dist.all_gather(shards, tensor.contiguous(), group=groups.tp)
    return torch.cat(shards, dim=spec.tp_dim)
