"""Gathering TP-sharded parameters (or their gradients) to full tensors: tests, checkpoints."""

from __future__ import annotations

from typing import Iterable

import torch

from hybrid.errors import UserError
from hybrid.optim import spec_of


class WeightsError(UserError):
    """Weights by global name that do not fit the model they are loaded into."""


def gather_tp_param(tensor: torch.Tensor, param: torch.Tensor, groups) -> torch.Tensor:
    """The full tensor of which ``tensor`` (``param`` itself, or its gradient) is this rank's
    TP shard; a replicated parameter's tensor is returned as is.

    Collective over ``groups.tensor`` for sharded parameters: every TP rank must call it for the
    same parameters in the same order. Reads the parameter's ``ParamSpec``.
    """
    spec = spec_of(param)
    if spec.tp_dim is None or groups.tensor.size() == 1:
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(groups.tensor.size())]
    groups.tensor.all_gather(shards, tensor.contiguous())
    return torch.cat(shards, dim=spec.tp_dim)


def load_global_weights(params: Iterable[torch.nn.Parameter], weights: dict[str, torch.Tensor],
                        groups) -> None:
    """Copy full tensors keyed by global name (``hybrid-ckpt export``'s file) into
    ``params``, each taking its own TP shard. Every parameter must find its tensor, of its
    global shape, and every tensor must be used: nothing is silently left or dropped."""
    tp, tp_rank = groups.layout.tp, groups.tp_rank
    used = set()
    for param in params:
        spec = spec_of(param)
        full = weights.get(spec.name)
        if full is None or tuple(full.shape) != spec.shape:
            got = None if full is None else tuple(full.shape)
            raise WeightsError(f"{spec.name}: the weights hold {got}, the model needs "
                             f"{spec.shape}; export the checkpoint of this model")
        ep, ep_rank = groups.layout.ep, groups.expert.rank()
        local, start = spec.local_shape(tp, ep), spec.local_offset(tp_rank, tp, ep_rank, ep)
        for dim in {spec.tp_dim, spec.ep_dim} - {None}:  # this rank's TP slice of its experts
            full = full.narrow(dim, start[dim], local[dim])
        with torch.no_grad():
            param.copy_(full)
        used.add(spec.name)
    unused = sorted(set(weights) - used)
    if unused:
        raise WeightsError(f"{len(unused)} tensors have no parameter here (first: {unused[0]}); "
                         f"build the model the checkpoint was saved from")
