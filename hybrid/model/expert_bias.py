"""Auxiliary-loss-free load balancing (DeepSeek-V3, Wang et al. 2024; megatron-core's
``moe_router_enable_expert_bias`` with ``moe_router_bias_update_rate``, torchtitan's
``load_balance_coeff``): each MoE layer's ``expert_bias`` (``hybrid.model.moe.MoeMLP``)
steers the top-k choice, and after every optimizer step it moves by
``model.moe.expert_bias_rate`` toward an even load: ``bias += rate * sign(mean - load_e)``.

``load_e`` is the token slots the router sent to expert ``e`` in the whole step: every
micro-batch, summed over the ranks that saw different tokens (the ``loss`` role: dp x cp).
The TP ranks of a layer route the same tokens, so each TP rank reduces with its own dp x cp
group and none is counted twice; a pipeline stage reduces its own layers' counts only (its
dp x cp group holds the same layers). Every rank of a layer thus applies the same update, and
the bias is the 1-process run's on any layout. The one all-reduce per step goes through
``hybrid.comm.Group`` (DP traffic; ``hybrid.planning.job.rank_dp_bytes`` predicts it).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from hybrid.comm import Group
from hybrid.model.moe import MoeMLP
from hybrid.planning.models.moe import expert_bias_name, is_expert_bias


def updated_expert_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """``bias + rate * sign(mean(load) - load)`` (megatron's ``get_updated_expert_bias``):
    up for an expert below the mean load, down above it, unchanged at it."""
    load = load.to(torch.float64)
    step = torch.sign(load.mean(dim=-1, keepdim=True) - load)
    return bias + (rate * step).to(bias.dtype)


def bias_layers(modules: Iterable[nn.Module]) -> dict[str, MoeMLP]:
    """The MoE MLPs with an expert bias in ``modules`` (a rank's chunks, or a whole model),
    by the bias's global name, in block order."""
    found = {}
    for module in modules:
        for sub in module.modules():
            mlp = getattr(sub, "mlp", None)
            if isinstance(mlp, MoeMLP) and mlp.expert_bias is not None:
                found[sub.block_id] = mlp
    return {expert_bias_name(b): found[b] for b in sorted(found)}


def expert_biases(modules: Iterable[nn.Module]) -> dict[str, torch.Tensor]:
    """The bias buffers themselves, by global name (a checkpoint's ``model.`` entries)."""
    return {name: mlp.expert_bias for name, mlp in bias_layers(modules).items()}


def update_expert_biases(modules: Iterable[nn.Module], group: Group) -> None:
    """After the optimizer step (every rank of ``group``, the ranks with other tokens of the
    step, in the same order): sum each bias layer's routed slots over ``group`` in one
    all-reduce, move its bias, and start counting afresh."""
    layers = list(bias_layers(modules).values())
    if not layers:
        return
    load = torch.stack([mlp.routed_slots for mlp in layers])  # [layers, E] int64
    group.all_reduce(load)
    with torch.no_grad():
        for mlp, layer_load in zip(layers, load):
            mlp.expert_bias.copy_(updated_expert_bias(mlp.expert_bias, layer_load,
                                                      mlp.bias_rate))
            mlp.routed_slots.zero_()


def load_expert_biases(modules: Iterable[nn.Module],
                       weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy the biases among ``weights`` (global names, a checkpoint's model tensors) into
    ``modules``' layers that have one; returns ``weights`` without any bias. A layer whose
    bias ``weights`` lacks (a model saved without the bias, an HF import) keeps its own (zero
    at the start: unbiased routing, as that model was trained)."""
    layers = bias_layers(modules)
    for name, mlp in layers.items():
        if name in weights:
            with torch.no_grad():
                mlp.expert_bias.copy_(weights[name])
    return {name: t for name, t in weights.items() if not is_expert_bias(name)}
