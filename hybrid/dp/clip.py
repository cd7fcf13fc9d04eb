"""Global gradient-norm clipping over the whole model, whatever the layout.

The norm must equal the 1-process model's, so every gradient element of the 1-process model is
counted exactly once across the job:

- a TP-sharded parameter (its spec has a ``tp_dim``) holds a different slice on every TP
  rank: each TP rank counts its shard;
- a TP-replicated parameter (norms, row-parallel biases, the position table) has the same
  gradient on every TP rank: only TP rank 0 counts it;
- with pipeline stages, a tied embedding (``spec.tied``) has a copy on the last stage whose gradient, after the embedding-group sum, equals
  the first stage's: only the first stage counts it;
- under ZeRO-1 each DP rank holds the reduced gradient of its own shard only, so shards add up
  over DP as well; without ZeRO every DP rank holds the same full gradient and counts it.

Each rank sums the squares it counts; the sums are all-reduced over ``groups.model`` (the
ranks that hold one copy of the model: TP x PP), and also over ``groups.sharding`` under ZeRO.
Clipping then follows ``torch.nn.utils.clip_grad_norm_``: gradients are scaled by ``max_norm / (norm + 1e-6)`` when
that is below 1.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hybrid.optim import spec_of


def counts_in_norm(param: torch.Tensor, groups) -> bool:
    """Whether this rank adds ``param``'s gradient to the global norm (see module doc)."""
    spec = spec_of(param)
    if spec.tied and groups.layout.pp > 1 and not groups.is_first_stage:
        return False
    if spec.tp_dim is not None:
        return True
    return groups.tp_rank == 0


def global_grad_norm(grads: Sequence[torch.Tensor], groups, *, sharded_over_dp: bool) -> float:
    """The L2 norm of the whole model's gradient; ``grads`` are the tensors this rank counts.

    Collective over ``groups.model`` (and ``groups.sharding`` when ``sharded_over_dp``): every
    rank of those groups must call it. Each tensor's sum of squares is added up in float64, across
    tensors and ranks.
    """
    device = grads[0].device if grads else groups.device
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        flat = grad.reshape(-1)
        squares += torch.dot(flat, flat).double()
    if groups.model.size() > 1:
        groups.model.all_reduce(squares)
    if sharded_over_dp and groups.sharding.size() > 1:
        groups.sharding.all_reduce(squares)
    return float(squares.sqrt())


def clip_coefficient(norm: float, max_norm: float) -> float:
    """Factor to scale gradients by: ``torch.nn.utils.clip_grad_norm_``'s, 1.0 when unclipped
    (``max_norm <= 0`` disables clipping)."""
    if max_norm <= 0:
        return 1.0
    return min(max_norm / (norm + 1e-6), 1.0)


def scale_grads_(buffers: Sequence[torch.Tensor], coefficient: float) -> None:
    if coefficient < 1.0:
        for buffer in buffers:
            buffer.mul_(coefficient)
