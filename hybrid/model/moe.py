"""The mixture-of-experts MLP (Mixtral's sparse MLP), the torch side of
``hybrid.planning.models.moe``: a router picks ``experts_topk`` of ``experts`` SwiGLU experts
per token and the token's output is their outputs weighted by the router. Written in torch
(megatron-core 0.16's router and grouped MLP assume CUDA). See docs/moe.md.

Tensor parallelism (experts' tensor parallelism = tp): every TP rank routes all of the
micro-batch's tokens (gathered under sequence parallelism) with the same replicated router and
holds ``F/tp`` of each expert's inner units, as the dense SwiGLU does; the weighted expert
outputs are partial sums over TP, summed (or reduce-scattered) on the way out. So the router's
gradient is a partial sum over TP too (its spec says ``sequence_partial``), and the
load-balancing loss, the same on every TP rank, sends ``1/tp`` of its gradient from each.

The load-balancing loss (Switch Transformer, GShard; megatron's ``switch_load_balancing``):
``E / (T k) * sum_e count_e * mean_t p_te`` over the micro-batch's ``T`` tokens, ``count_e`` the
token slots routed to expert ``e`` (before any dropping), ``p`` the router's softmax: 1 when the
load is even. It adds ``moe_aux_loss`` times its gradient in the backward
(``AuxLossGradient``), scaled by ``aux_scale`` (the trainer sets ``1 / micro-batches``, as the
language-model loss is scaled), and changes no reported loss.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.comm import Group
from hybrid.model.blocks import normal_init, output_init
from hybrid.model.mappings import (copy_to_tensor_region, gather_from_sequence_parallel_region,
                                   reduce_from_tensor_region,
                                   reduce_scatter_to_sequence_parallel_region)
from hybrid.planning.config import ModelConfig


class AuxLossGradient(torch.autograd.Function):
    """Forward: ``output`` as it is. Backward: ``output``'s gradient, and ``scale`` as the
    gradient of ``aux`` (a scalar the loss does not otherwise reach): megatron's
    ``MoEAuxLossAutoScaler``, with the scale passed in instead of held by the class."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float):
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


def _tp_slice(full: torch.Tensor, dim: int, tp_group: Group) -> torch.Tensor:
    """This TP rank's slice of ``full`` along ``dim`` (the 1-process tensor's values)."""
    size = full.shape[dim] // tp_group.size()
    return full.narrow(dim, tp_group.rank() * size, size).clone()


def route(logits: torch.Tensor, k: int, router: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, k]``, expert ids ``[T, k]``) from fp32 router logits ``[T, E]``:
    ``softmax_topk`` (Mixtral: softmax, top-k, renormalised) or ``topk_softmax`` (top-k of the
    logits, softmax over them)."""
    if router == "topk_softmax":
        top, ids = torch.topk(logits, k, dim=-1)
        return top.softmax(dim=-1), ids
    top, ids = torch.topk(logits.softmax(dim=-1), k, dim=-1)
    return top / top.sum(dim=-1, keepdim=True), ids


def kept_slots(ids: torch.Tensor, experts: int, capacity: Optional[int]) -> torch.Tensor:
    """``[T, k]`` booleans: which token slots their expert computes. Dropless (``capacity``
    None): all; else each expert's first ``capacity`` slots in token order."""
    if capacity is None:
        return torch.ones_like(ids, dtype=torch.bool)
    onehot = F.one_hot(ids.reshape(-1), experts)  # [T k, E], token-major
    position = (onehot.cumsum(dim=0) * onehot).sum(dim=-1) - 1
    return (position < capacity).reshape(ids.shape)


def load_balancing_loss(probs: torch.Tensor, ids: torch.Tensor, experts: int) -> torch.Tensor:
    """The Switch/GShard loss of one micro-batch (see the module doc)."""
    tokens, k = ids.shape
    counts = torch.bincount(ids.reshape(-1), minlength=experts).to(probs.dtype)
    return experts / (tokens * k) * (counts * probs.mean(dim=0)).sum()


class Router(nn.Module):
    """``weight [E, h]``, replicated over TP."""

    def __init__(self, cfg: ModelConfig, generator: torch.Generator):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.experts, cfg.hidden))
        normal_init(cfg.init_std, generator)(self.weight.data)


class Experts(nn.Module):
    """Every expert's SwiGLU, stacked: ``gate``/``up`` ``[E, F/tp, h]``, ``down [E, h, F/tp]``
    (drawn whole, then this TP rank's slice kept: the same values on any layout)."""

    def __init__(self, cfg: ModelConfig, tp_group: Group, generator: torch.Generator):
        super().__init__()
        e, f, h = cfg.experts, cfg.moe_ffn, cfg.hidden
        shapes = {"gate": ((e, f, h), 1, normal_init(cfg.init_std, generator)),
                  "up": ((e, f, h), 1, normal_init(cfg.init_std, generator)),
                  "down": ((e, h, f), 2, output_init(cfg, generator))}
        for name, (shape, dim, init) in shapes.items():
            full = torch.empty(shape)
            init(full)
            setattr(self, name, nn.Parameter(_tp_slice(full, dim, tp_group)))

    def forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``expert``'s output on tokens ``x [n, h]``: a partial sum over TP."""
        hidden = F.silu(x @ self.gate[expert].t()) * (x @ self.up[expert].t())
        return hidden @ self.down[expert].t()


class MoeMLP(nn.Module):
    """The sparse MLP: ``[s(/tp), b, h]`` in and out, as ``SwiGLU``'s."""

    def __init__(self, cfg: ModelConfig, tp_group: Group, *, generator: torch.Generator,
                 sequence_parallel: bool):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.num_experts, self.topk, self.router_kind = cfg.experts, cfg.experts_topk, \
            cfg.moe_router
        self.capacity_factor, self.aux_coeff = cfg.moe_capacity_factor, cfg.moe_aux_loss
        self.router = Router(cfg, generator)
        self.experts = Experts(cfg, tp_group, generator)
        self.aux_scale = 1.0
        """What the load-balancing loss's gradient is multiplied by besides its coefficient:
        the trainer sets ``1 / micro-batches`` (``set_aux_loss_scale``)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, self.tp_group)
        else:
            hidden = copy_to_tensor_region(hidden, self.tp_group)
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])  # [T, h]
        logits = (x @ self.router.weight.t()).float()
        weights, ids = route(logits, self.topk, self.router_kind)
        keep = kept_slots(ids, self.num_experts, self._capacity(x.shape[0]))
        out = torch.zeros_like(x)
        for expert in range(self.num_experts):
            token, slot = torch.nonzero((ids == expert) & keep, as_tuple=True)
            if token.numel():
                y = self.experts(expert, x[token]) * weights[token, slot, None]
                out = out.index_add(0, token, y.to(out.dtype))  # bf16 under autocast
        out = out.view(shape)
        if self.aux_coeff > 0 and torch.is_grad_enabled():
            aux = load_balancing_loss(logits.softmax(dim=-1), ids, self.num_experts)
            scale = self.aux_coeff * self.aux_scale / self.tp_group.size()
            out = AuxLossGradient.apply(out, aux, scale)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        return reduce_from_tensor_region(out, self.tp_group)

    def _capacity(self, tokens: int) -> Optional[int]:
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.topk / self.num_experts)


def set_aux_loss_scale(modules: Iterable[nn.Module], scale: float) -> None:
    """Scale every MoE MLP's load-balancing gradient in ``modules`` by ``scale`` (the trainer:
    ``1 / micro-batches per step``, the language-model loss's own scale)."""
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, MoeMLP):
                sub.aux_scale = scale
