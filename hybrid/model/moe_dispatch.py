"""Expert parallelism's token exchange (docs/moe.md): each rank of the expert group holds
``E / ep`` experts; a token slot routed to an expert travels to the rank holding it and its
output back, by two all-to-alls with uneven splits through ``hybrid.comm.Group`` (every byte
counted). The backward of each all-to-all is the reverse all-to-all.

Order of the rows: a rank sends its kept token slots sorted by expert (so by destination);
it receives them grouped by source rank, within a source by local expert. The expert
computes run on each local expert's rows, and the outputs go back in the order received.
At ``ep=1`` nothing moves and the same code computes every expert locally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.comm import Group


class _Alone:
    """The expert group of a layer built without one: this rank alone (nothing moves)."""

    @staticmethod
    def size() -> int:
        return 1

    @staticmethod
    def rank() -> int:
        return 0


ALONE = _Alone()


class _AllToAll(torch.autograd.Function):
    """Rows ``in_splits[j]`` to rank ``j``, ``out_splits[j]`` rows from it; the gradient
    goes back the same way reversed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, out_splits: list[int],
                in_splits: list[int]) -> torch.Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        group.all_to_all(out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        ctx.group.all_to_all(back, grad.contiguous(), ctx.in_splits, ctx.out_splits)
        return back, None, None, None


def all_to_all(x: torch.Tensor, group: Group, out_splits: list[int],
               in_splits: list[int]) -> torch.Tensor:
    """Differentiable all-to-all of ``x``'s rows (nothing moves on a 1-rank group)."""
    if group.size() == 1:
        return x
    return _AllToAll.apply(x, group, out_splits, in_splits)


@dataclass
class Dispatch:
    """One micro-batch's routing on this rank: the kept slots ``(token, slot)`` sorted by
    expert, how many go to (``send``) and come from (``recv``) each rank of the group, and
    the local expert of every received row."""

    token: torch.Tensor
    slot: torch.Tensor
    send: list[int]
    recv: list[int]
    local_expert: torch.Tensor
    tokens_per_expert: torch.Tensor
    """This rank's kept slots per (global) expert, ``[E]``."""


def plan_dispatch(ids: torch.Tensor, keep: torch.Tensor, experts: int,
                  group: Group) -> Dispatch:
    """Sort this rank's kept slots by expert and exchange the counts (an all-to-all of ``E``
    integers) so every rank knows how many rows it receives from each."""
    token, slot = torch.nonzero(keep, as_tuple=True)  # token-major
    expert = ids[token, slot]
    order = torch.argsort(expert, stable=True)
    token, slot, expert = token[order], slot[order], expert[order]
    counts = torch.bincount(expert, minlength=experts)
    ep = group.size()
    local = experts // ep
    if ep == 1:
        received = counts
    else:
        received = torch.empty_like(counts)
        group.all_to_all(received, counts, [local] * ep, [local] * ep)
    by_source = received.view(ep, local)
    local_expert = torch.repeat_interleave(
        torch.arange(local, device=ids.device).repeat(ep), by_source.reshape(-1))
    return Dispatch(token=token, slot=slot, send=counts.view(ep, local).sum(1).tolist(),
                    recv=by_source.sum(1).tolist(), local_expert=local_expert,
                    tokens_per_expert=counts)


def run_experts(rows: torch.Tensor, local_expert: torch.Tensor, local: int,
                compute) -> torch.Tensor:
    """``compute(j, x)`` on each local expert ``j``'s rows (every expert runs, on no rows if
    none came, so its weights always get a gradient), back in the order of ``rows``."""
    perm = torch.argsort(local_expert, stable=True)
    sizes = torch.bincount(local_expert, minlength=local).tolist()
    segments = rows.index_select(0, perm).split(sizes)
    out = torch.cat([compute(j, seg) for j, seg in enumerate(segments)])
    return out.index_select(0, torch.argsort(perm))
