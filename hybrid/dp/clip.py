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
from hybrid.planning.param_spec import PLACEMENTS


def counts_in_norm(param: torch.Tensor, groups) -> bool:
    """Whether this rank adds ``param``'s gradient to the global norm (see module doc)."""
    spec = spec_of(param)
    if spec.tied and groups.layout.pp > 1 and not groups.is_first_stage:
        return False
    if spec.tp_dim is not None:
        return True
    return groups.tp_rank == 0


def global_grad_norm(grads: dict, groups, *, sharded_over_dp: bool) -> float:
    """The L2 norm of the whole model's gradient; ``grads``: the tensors this rank counts, by
    their ``Placement``.

    Each placement's squares are summed over its ``norm_role`` group (the model group for dense
    parameters, ``tp x ep x pp`` for experts) and, when ``sharded_over_dp``, its
    ``shard_role`` group; placements whose groups have the same ranks share one sum (one
    all-reduce: at ``ep=1`` the experts' are the dense ones'). Every placement takes part on
    every rank, in ``PLACEMENTS`` order, whether or not this rank holds any of it. Sums of
    squares are float64, across tensors and ranks.
    """
    sums: dict[tuple, list] = {}
    for placement in PLACEMENTS:
        model, shard = groups.role(placement.norm_role), groups.role(placement.shard_role)
        key = (tuple(model.ranks), tuple(shard.ranks))
        entry = sums.setdefault(key, [torch.zeros((), dtype=torch.float64, device=groups.device),
                                      model, shard])
        for grad in grads.get(placement, ()):
            flat = grad.reshape(-1)
            entry[0] += torch.dot(flat, flat).double().to(entry[0].device)
    total = 0.0
    for squares, model, shard in sums.values():
        if model.size() > 1:
            model.all_reduce(squares)
        if sharded_over_dp and shard.size() > 1:
            shard.all_reduce(squares)
        total += float(squares)
    return total ** 0.5


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
