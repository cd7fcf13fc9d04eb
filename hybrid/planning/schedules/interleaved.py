"""Interleaved 1F1B (Narayanan et al. 2021, Megatron's virtual pipeline): ``vpp`` chunks per
rank, placed in a loop (stage ``s`` on rank ``s % pp``), which divides the bubble by ``vpp``."""

from __future__ import annotations

from hybrid.planning.schedules.actions import BACKWARD, FORWARD, Action
from hybrid.planning.schedules.registry import TWO_OR_MORE, ScheduleSpec, register_schedule


def _interleaved_rank(rank: int, pp: int, m: int, vpp: int) -> list[Action]:
    """Megatron's interleaved 1F1B (``forward_backward_pipelining_with_interleaving``).

    The ``k``-th forward of a rank runs chunk ``(k % (pp*vpp)) // pp`` on micro-batch
    ``(k // (pp*vpp)) * pp + k % pp``: groups of ``pp`` micro-batches go through chunk 0, then
    chunk 1, ...; backwards visit the chunks in reverse. Warm-up is Megatron's
    ``2 * (pp - rank - 1) + (vpp - 1) * pp`` forwards, then one forward per backward.
    """
    group = pp * vpp
    total = m * vpp

    def nth(k: int, kind: str) -> Action:
        chunk = (k % group) // pp
        if kind == BACKWARD:
            chunk = vpp - 1 - chunk
        mb = (k // group) * pp + k % pp
        return Action(chunk * pp + rank, kind, mb)

    warmup = min(2 * (pp - rank - 1) + (vpp - 1) * pp, total)
    order = [nth(k, FORWARD) for k in range(warmup)]
    for k in range(total):
        if warmup + k < total:
            order.append(nth(warmup + k, FORWARD))
        order.append(nth(k, BACKWARD))
    return order


def _lists(pp: int, m: int, vpp: int) -> list[list[Action]]:
    return [_interleaved_rank(rank, pp, m, vpp) for rank in range(pp)]


def _closed_form(pp: int, m: int, vpp: int) -> tuple[float, tuple[int, ...]]:
    peak = tuple(min(2 * (pp - r - 1) + (vpp - 1) * pp + 1, m * vpp) for r in range(pp))
    return (pp - 1) / (m * vpp + pp - 1), peak


INTERLEAVED = register_schedule(ScheduleSpec(
    name="interleaved-1f1b", build=_lists, closed_form=_closed_form,
    warmup_step=lambda forward, backward, vpp: (forward + backward) / vpp,
    chunks=TWO_OR_MORE, min_pp=2, microbatches_multiple_of_pp=True, search_vpps=(2, 4),
    doc="vpp >= 2 chunks per rank in a loop: the bubble divided by vpp, more messages"))
