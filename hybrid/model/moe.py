"""The mixture-of-experts MLP (Mixtral's sparse MLP), the torch side of
``hybrid.planning.models.moe``: a router picks ``model.moe.topk`` of ``model.moe.experts`` SwiGLU experts
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
load is even. It adds ``model.moe.aux_loss`` times its gradient in the backward
(``AuxLossGradient``), scaled by ``aux_scale`` (the trainer sets ``1 / micro-batches``, as the
language-model loss is scaled), and changes no reported loss.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.comm import Group
from hybrid.model.blocks import Context, normal_init, output_init
from hybrid.model.mappings import (copy_to_tensor_region, gather_from_sequence_parallel_region,
                                   reduce_from_tensor_region,
                                   reduce_scatter_to_sequence_parallel_region)
from hybrid.model.moe_dispatch import ALONE, all_to_all, plan_dispatch, run_experts
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


def route(logits: torch.Tensor, k: int, router: str, bias: Optional[torch.Tensor] = None,
          normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, k]``, expert ids ``[T, k]``) from fp32 router logits ``[T, E]``:
    ``softmax_topk`` (Mixtral: softmax, top-k, renormalised; with ``normalize`` False the
    chosen experts' softmax probabilities as they are: Qwen2-MoE's ``norm_topk_prob=False``)
    or ``topk_softmax`` (top-k of the logits, softmax over them). ``bias`` (``[E]``, the
    aux-loss-free expert bias) is added to the softmax probabilities to choose the top k
    only: the weights are the chosen experts' unbiased ones, renormalised (DeepSeek-V3;
    torchtitan's scores + bias), the same for both routers in exact arithmetic."""
    if bias is not None:
        probs = logits.softmax(dim=-1)
        ids = torch.topk(probs + bias, k, dim=-1).indices
        if router == "topk_softmax":
            return logits.gather(-1, ids).softmax(dim=-1), ids
        top = probs.gather(-1, ids)
        return (top / top.sum(dim=-1, keepdim=True) if normalize else top), ids
    if router == "topk_softmax":
        top, ids = torch.topk(logits, k, dim=-1)
        return top.softmax(dim=-1), ids
    top, ids = torch.topk(logits.softmax(dim=-1), k, dim=-1)
    return (top / top.sum(dim=-1, keepdim=True) if normalize else top), ids


def kept_slots(ids: torch.Tensor, experts: int, capacity: Optional[int]) -> torch.Tensor:
    """``[T, k]`` booleans: which token slots their expert computes. Dropless (``capacity``
    None): all; else each expert's first ``capacity`` slots in token order."""
    if capacity is None:
        return torch.ones_like(ids, dtype=torch.bool)
    onehot = F.one_hot(ids.reshape(-1), experts)  # [T k, E], token-major
    position = (onehot.cumsum(dim=0) * onehot).sum(dim=-1) - 1
    return (position < capacity).reshape(ids.shape)


def load_balancing_loss(probs: torch.Tensor, ids: torch.Tensor, experts: int,
                        context: Optional[Group] = None) -> torch.Tensor:
    """The Switch/GShard loss of one micro-batch (see the module doc). Under context
    parallelism (``context``: the ranks holding the other chunks of the same sequences) the
    counts and token total are the whole micro-batch's (summed there, no gradient) and the
    probabilities' mean this rank's: the context ranks' losses then average to the whole
    micro-batch's, as their gradients are averaged."""
    tokens, k = ids.shape
    counts = torch.bincount(ids.reshape(-1), minlength=experts).to(probs.dtype)
    if context is not None and context.size() > 1:
        context.all_reduce(counts)
        tokens *= context.size()
    return experts / (tokens * k) * (counts * probs.mean(dim=0)).sum()


class Router(nn.Module):
    """``weight [E, h]``, replicated over TP."""

    def __init__(self, cfg: ModelConfig, generator: torch.Generator):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.moe.experts, cfg.hidden))
        normal_init(cfg.init_std, generator)(self.weight.data)


class Experts(nn.Module):
    """This expert-parallel rank's ``E/ep`` experts' SwiGLUs, stacked: ``gate``/``up``
    ``[E/ep, F/tp, h]``, ``down [E/ep, h, F/tp]`` (every expert drawn whole, then this rank's
    experts and TP slice kept: the same values on any layout)."""

    def __init__(self, cfg: ModelConfig, tp_group: Group, generator: torch.Generator,
                 ep_rank: int = 0, ep: int = 1):
        super().__init__()
        e, f, h = cfg.moe.experts, cfg.moe_ffn, cfg.hidden
        shapes = {"gate": ((e, f, h), 1, normal_init(cfg.init_std, generator)),
                  "up": ((e, f, h), 1, normal_init(cfg.init_std, generator)),
                  "down": ((e, h, f), 2, output_init(cfg, generator))}
        local = e // ep
        for name, (shape, dim, init) in shapes.items():
            full = torch.empty(shape)
            init(full)
            mine = full.narrow(0, ep_rank * local, local)
            setattr(self, name, nn.Parameter(_tp_slice(mine, dim, tp_group)))

    def forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``expert``'s output on tokens ``x [n, h]``: a partial sum over TP."""
        hidden = F.silu(x @ self.gate[expert].t()) * (x @ self.up[expert].t())
        return hidden @ self.down[expert].t()


class SharedGate(nn.Module):
    """The shared expert's gate ``weight [1, h]``, replicated over TP (a module of its own so
    that it is named, and yielded, after the shared expert: ``mlp.shared_gate.weight``)."""

    def __init__(self, cfg: ModelConfig, generator: torch.Generator):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, cfg.hidden))
        normal_init(cfg.init_std, generator)(self.weight.data)


class SharedExpert(nn.Module):
    """The shared expert every token goes through (Qwen2-MoE): a SwiGLU ``gate``/``up``
    ``[S/tp, h]``, ``down [h, S/tp]`` (drawn whole, then this TP rank's slice kept). The layer
    scales its output by ``sigmoid(x shared_gate^T)``: a partial sum over TP as the experts'
    outputs are (so the gate's gradient is one too)."""

    def __init__(self, cfg: ModelConfig, size: int, tp_group: Group,
                 generator: torch.Generator):
        super().__init__()
        shapes = {"gate": ((size, cfg.hidden), 0, normal_init(cfg.init_std, generator)),
                  "up": ((size, cfg.hidden), 0, normal_init(cfg.init_std, generator)),
                  "down": ((cfg.hidden, size), 1, output_init(cfg, generator))}
        for name, (shape, dim, init) in shapes.items():
            full = torch.empty(shape)
            init(full)
            setattr(self, name, nn.Parameter(_tp_slice(full, dim, tp_group)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ self.gate.t()) * (x @ self.up.t())) @ self.down.t()


class MoeMLP(nn.Module):
    """The sparse MLP: ``[s(/tp), b, h]`` in and out, as ``SwiGLU``'s; with
    ``shared_ffn`` > 0 (the layer's spec) a gated shared expert besides the routed ones."""

    def __init__(self, cfg: ModelConfig, tp_group: Group, *, generator: torch.Generator,
                 sequence_parallel: bool, expert_group: Optional[Group] = None,
                 context: Context = Context(), shared_ffn: int = 0):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.expert_group = expert_group
        """The ranks holding the other experts (``ParallelGroups.expert``); None: all here."""
        self.context_group = context.group if context.on else None
        self.num_experts, self.topk, self.router_kind = cfg.moe.experts, cfg.moe.topk, \
            cfg.moe.router
        self.capacity_factor, self.aux_coeff = cfg.moe.capacity_factor, cfg.moe.aux_loss
        self.router = Router(cfg, generator)
        ep = expert_group.size() if expert_group is not None else 1
        ep_rank = expert_group.rank() if expert_group is not None else 0
        self.local_experts = cfg.moe.experts // ep
        self.experts = Experts(cfg, tp_group, generator, ep_rank, ep)
        self.normalize = cfg.moe.norm_topk_prob
        self.shared = SharedExpert(cfg, shared_ffn, tp_group, generator) if shared_ffn \
            else None
        self.shared_gate = SharedGate(cfg, generator) if shared_ffn else None
        self.stats = MoeStats(cfg.moe.experts)
        """This step's training forwards (``moe_step_stats`` reads and resets it)."""
        self.bias_rate = cfg.moe.expert_bias_rate
        on = self.bias_rate > 0
        self.register_buffer("expert_bias", torch.zeros(cfg.moe.experts) if on else None)
        """``[E]`` fp32, the same on every rank (None when off): added to the router's
        probabilities to choose the top k (``route``); ``update_expert_biases`` moves it."""
        self.register_buffer("routed_slots", torch.zeros(cfg.moe.experts, dtype=torch.int64)
                             if on else None)
        """Token slots routed to each expert in this step's training forwards, before any
        dropping (the bias balances the router's choice), on this rank's tokens."""
        self.aux_scale = 1.0
        """What the load-balancing loss's gradient is multiplied by besides its coefficient:
        the trainer sets ``1 / micro-batches`` (``set_aux_loss_scale``)."""
        self.counting = True
        """Whether a training forward adds to ``stats`` and ``routed_slots``; off only inside
        ``uncounted``. A flag on the layer rather than a global: it is this layer's forward
        that runs twice, and ``uncounted`` sets and clears it around that second run alone."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, self.tp_group)
        else:
            hidden = copy_to_tensor_region(hidden, self.tp_group)
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])  # [T, h]
        logits = (x @ self.router.weight.t()).float()
        weights, ids = route(logits, self.topk, self.router_kind, self.expert_bias,
                             self.normalize)
        if self.routed_slots is not None and self._counts():
            self.routed_slots += torch.bincount(ids.reshape(-1), minlength=self.num_experts)
        keep = kept_slots(ids, self.num_experts, self._capacity(x.shape[0]))
        out = self._experts_out(x, weights, ids, keep)
        if self.shared is not None:
            out = out + torch.sigmoid(x @ self.shared_gate.weight.t()) * self.shared(x)
        out = out.view(shape)
        if self.aux_coeff > 0 and torch.is_grad_enabled():
            aux = load_balancing_loss(logits.softmax(dim=-1), ids, self.num_experts,
                                      self.context_group)
            if self._counts():
                self.stats.aux += float(aux.detach())
            scale = self.aux_coeff * self.aux_scale / self.tp_group.size()
            out = AuxLossGradient.apply(out, aux, scale)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        return reduce_from_tensor_region(out, self.tp_group)

    def _experts_out(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                     keep: torch.Tensor) -> torch.Tensor:
        """``[T, h]``: each token's kept experts' outputs weighted by the router, summed; the
        rows travel to the experts' ranks and back (``hybrid.model.moe_dispatch``)."""
        plan = plan_dispatch(ids, keep, self.num_experts, self._group())
        rows = all_to_all(x[plan.token], self._group(), plan.recv, plan.send)
        y = run_experts(rows, plan.local_expert, self.local_experts, self.experts)
        back = all_to_all(y, self._group(), plan.send, plan.recv)
        back = back * weights[plan.token, plan.slot, None]
        if self._counts():
            self.stats.add(plan.tokens_per_expert, keep.numel() - plan.token.numel())
        return torch.zeros_like(x).index_add(0, plan.token, back.to(x.dtype))

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Forwards inside count nothing: a full recompute's second run of a forward already
        counted (``LlamaLayer.recompute_contexts``), which routes the same tokens the same way
        (the bias moves only after the step) and would count every slot twice."""
        self.counting = False
        try:
            yield
        finally:
            self.counting = True

    def _counts(self) -> bool:
        """Whether this forward adds to the step's figures: training, and not a recompute."""
        return self.counting and torch.is_grad_enabled()

    def _group(self) -> Group:
        return self.expert_group if self.expert_group is not None else ALONE

    def _capacity(self, tokens: int) -> Optional[int]:
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.topk / self.num_experts)


class MoeStats:
    """One MoE layer's training forwards in a step: kept token slots per expert, dropped
    slots, and the sum of its load-balancing losses."""

    def __init__(self, experts: int):
        self.load = torch.zeros(experts, dtype=torch.int64)
        self.dropped, self.aux, self.forwards = 0, 0.0, 0

    def add(self, load: torch.Tensor, dropped: int) -> None:
        self.load += load.detach().cpu()
        self.dropped += int(dropped)
        self.forwards += 1


def moe_step_stats(modules: Iterable[nn.Module]) -> Optional[dict]:
    """This rank's MoE layers' step (None without any), and a fresh start for the next:
    ``tokens_per_expert`` (kept slots summed over its layers and micro-batches),
    ``load_max_over_mean`` (a layer's busiest expert's slots in the step over its mean,
    1.0 when even; the worst layer's), ``dropped`` slots and the mean ``aux_loss``."""
    layers = [sub for module in modules for sub in module.modules() if isinstance(sub, MoeMLP)]
    if not layers:
        return None
    total = torch.zeros_like(layers[0].stats.load)
    worst, dropped, aux, forwards = 0.0, 0, 0.0, 0
    for layer in layers:
        stats = layer.stats
        total += stats.load
        if stats.forwards and stats.load.sum() > 0:
            worst = max(worst, float(stats.load.max() / stats.load.float().mean()))
        dropped, aux, forwards = dropped + stats.dropped, aux + stats.aux, \
            forwards + stats.forwards
        layer.stats = MoeStats(layer.num_experts)
    return {"tokens_per_expert": total.tolist(), "load_max_over_mean": worst,
            "dropped": dropped, "aux_loss": aux / forwards if forwards else 0.0}


def set_aux_loss_scale(modules: Iterable[nn.Module], scale: float) -> None:
    """Scale every MoE MLP's load-balancing gradient in ``modules`` by ``scale`` (the trainer:
    ``1 / micro-batches per step``, the language-model loss's own scale)."""
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, MoeMLP):
                sub.aux_scale = scale
