"""AdamW with weight-decay groups, and the learning-rate schedule (a pure function).

Which parameters are decayed is part of each parameter's ``ParamSpec`` (``hybrid.planning.params``):
the matrices of the model (linear weights and the word-embedding table, which is also the
output layer when tied), not biases, layer norms or the learned position table (each row is
seen only at its own position, so decay would shrink rarely-updated rows). A parameter of a
plain module that hybrid did not build gets ``replicated_spec``: decayed when it is a matrix.
This follows GPT-2 / nanoGPT practice.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

from hybrid.errors import UserError
from hybrid.planning.config import ADAMW_IMPLEMENTATIONS, OptimConfig
from hybrid.planning.params import ParamSpec, replicated_spec


def build_adamw(pieces: Sequence[tuple[torch.Tensor, bool]], optim: OptimConfig
                ) -> torch.optim.AdamW:
    """AdamW over ``(tensor, decays)`` pairs: two parameter groups, decayed and not decayed.

    The tensors are model parameters, or (ZeRO-1) views of this rank's shard of them; both
    groups always exist (possibly empty), so group 0 is decayed and group 1 is not.
    """
    if optim.name != "adamw":
        raise UserError(f"optim.name={optim.name!r} is not supported; use optim.name=adamw")
    if optim.implementation not in ADAMW_IMPLEMENTATIONS:
        raise UserError(f"optim.implementation={optim.implementation!r} is unknown; choose "
                        f"one of {', '.join(ADAMW_IMPLEMENTATIONS)}")
    decayed = [t for t, decays in pieces if decays]
    plain = [t for t, decays in pieces if not decays]
    return torch.optim.AdamW(
        [{"params": decayed, "weight_decay": optim.weight_decay},
         {"params": plain, "weight_decay": 0.0}],
        lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
        **_IMPLEMENTATION_FLAGS[optim.implementation],
    )


_IMPLEMENTATION_FLAGS = {"fused": {"fused": True}, "foreach": {"foreach": True},
                         "for-loop": {"foreach": False}}  # by ADAMW_IMPLEMENTATIONS


def step_count(saved: torch.Tensor, param: torch.Tensor, optimizer: torch.optim.Optimizer
               ) -> torch.Tensor:
    """A loaded AdamW step count where the optimizer keeps its own: on ``param``'s device
    when fused or capturable, on the CPU otherwise (as ``Optimizer.load_state_dict`` would)."""
    on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
    device = param.device if on_device else torch.device("cpu")
    return saved.detach().to(device=device, dtype=torch.float32, copy=True)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (1-based: the first step is 1).

    Linear warm-up to ``optim.lr`` over ``optim.warmup_steps`` steps (step ``k <= warmup``
    gets ``lr·k/warmup``), then a half cosine from ``optim.lr`` down to ``optim.min_lr``,
    reached exactly at ``total_steps``; steps past ``total_steps`` stay at ``min_lr``.
    """
    if step < 1:
        raise ValueError(f"lr_at step={step}: steps are 1-based; pass the number of the "
                         f"optimizer step about to be taken (1 for the first)")
    if total_steps < 1:
        raise ValueError(f"train.steps={total_steps} must be >= 1")
    warmup = optim.warmup_steps
    if step <= warmup:
        return optim.lr * step / warmup
    if step >= total_steps:
        return optim.min_lr if total_steps > warmup else optim.lr
    progress = (step - warmup) / (total_steps - warmup)
    return optim.min_lr + 0.5 * (optim.lr - optim.min_lr) * (1.0 + math.cos(math.pi * progress))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the optimizer's state tensors, counted exactly.

    ``per_element``: state tensors shaped like their parameter (AdamW's ``exp_avg`` and
    ``exp_avg_sq``): the part that ZeRO-1 divides by the DP size. ``scalars``: the rest (one
    4-byte ``step`` counter per tensor the optimizer holds).
    """
    per_element = scalars = 0
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            size = value.numel() * value.element_size()
            if key != "step" and value.shape == param.shape:
                per_element += size
            else:
                scalars += size
    return {"per_element": per_element, "scalars": scalars}


def spec_of(param: torch.Tensor, name: str = "") -> ParamSpec:
    """``param.spec`` when hybrid built it; a plain module's parameter is replicated."""
    spec = getattr(param, "spec", None)
    return spec if spec is not None else replicated_spec(name, tuple(param.shape))


def unique_parameters(modules: Iterable[torch.nn.Module]
                      ) -> list[tuple[ParamSpec, torch.nn.Parameter]]:
    """``(spec, param)`` of the trainable parameters of ``modules``, each Parameter once (a tied
    weight held by two modules is one Parameter), in registration order. A parameter without a
    spec is named by its place: ``"{i}."`` + its name in module ``i`` when there are several."""
    modules = list(modules)
    seen: set[int] = set()
    found = []
    for index, module in enumerate(modules):
        prefix = f"{index}." if len(modules) > 1 else ""
        for name, param in module.named_parameters(remove_duplicate=False):
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                found.append((spec_of(param, prefix + name), param))
    return found
