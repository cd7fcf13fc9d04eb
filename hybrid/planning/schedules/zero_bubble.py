"""The zero-bubble schedules of Qi et al. 2023 ("Zero Bubble Pipeline Parallelism"): the
backward split into the input gradient ``I`` (on the critical path) and the weight gradient
``W`` (deferred into the bubbles). ZB-H1 on 1F1B's placement; ZB-V with two chunks per rank in a
V, so that rank 0 holds the first and the last stage."""

from __future__ import annotations

from hybrid.planning.schedules.actions import (
    BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, V_SHAPE, Action,
)
from hybrid.planning.schedules.registry import TWO, ScheduleSpec, register_schedule


def _zero_bubble_h1_rank(rank: int, pp: int, m: int) -> list[Action]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B with B split in I+W.

    The critical path runs through F and I only, so each rank does its I as early as 1F1B
    does its B and delays W: rank ``r`` keeps ``r`` weight-gradients pending, which fills the
    cool-down bubble of the earlier ranks. Warm-up forwards plus pending W stay at ``pp - 1``,
    so every rank holds the activations of at most ``pp`` micro-batches: the first rank's
    peak, as in 1F1B, now on every rank (1F1B's later ranks hold fewer). The bubble shrinks
    to ``(pp-1)*(F+I-W)``.
    """
    warmup = min(pp - rank - 1, m)
    delay = rank
    order = [Action(rank, FORWARD, mb) for mb in range(warmup)]
    for mb in range(m):
        if warmup + mb < m:
            order.append(Action(rank, FORWARD, warmup + mb))
        order.append(Action(rank, BACKWARD_INPUT, mb))
        if mb >= delay:
            order.append(Action(rank, BACKWARD_WEIGHT, mb - delay))
    order += [Action(rank, BACKWARD_WEIGHT, mb) for mb in range(max(m - delay, 0), m)]
    return order


def _zero_bubble_v_rank(rank: int, pp: int, m: int) -> list[Action]:
    """ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): two chunks per rank in a
    V, chunk 0 = stage ``rank`` (going down the ranks), chunk 1 = stage ``2*pp - 1 - rank``
    (coming back up), so rank 0 holds the first and the last stage.

    Warm-up: ``2*(pp - rank) - 1`` chunk-0 forwards (the V's down leg must reach the last rank
    before any chunk-1 work arrives), then ``rank`` chunk-1/chunk-0 forward pairs, then
    ``pp - rank`` chunk-1 forwards each followed at once by its I and W (the up leg's
    backward starts on rank 0, where the loss is). Steady state: F, I, W of chunk 0 then of
    chunk 1. Cool-down: the remaining I of both chunks, the W left over fill the gaps. At
    most ``2*pp`` chunk activations are held per rank: ``pp`` micro-batches of a whole stage,
    1F1B's first-rank peak, with a bubble about half ZB-H1's (with F = I = W).
    """
    stages = (rank, 2 * pp - 1 - rank)
    done = {(kind, chunk): 0 for kind in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
            for chunk in (0, 1)}
    order: list[Action] = []

    def run(kind: str, chunk: int, limit: int) -> None:
        """Add the chunk's next ``kind`` action if fewer than ``limit`` have been added."""
        if done[(kind, chunk)] < limit:
            order.append(Action(stages[chunk], kind, done[(kind, chunk)]))
            done[(kind, chunk)] += 1

    def backward(chunk: int, weight_too: bool) -> None:
        run(BACKWARD_INPUT, chunk, done[(FORWARD, chunk)])
        if weight_too:
            run(BACKWARD_WEIGHT, chunk, done[(BACKWARD_INPUT, chunk)])

    for _ in range(2 * (pp - rank) - 1):
        run(FORWARD, 0, m)
    for _ in range(rank):
        run(FORWARD, 1, m)
        run(FORWARD, 0, m)
    for _ in range(pp - rank):
        run(FORWARD, 1, m)
        backward(1, weight_too=True)
    while done[(FORWARD, 0)] < m or done[(FORWARD, 1)] < m:
        for chunk in (0, 1):
            run(FORWARD, chunk, m)
            backward(chunk, weight_too=True)
    for _ in range(rank):
        backward(1, weight_too=False)
        backward(0, weight_too=False)
    while done[(BACKWARD_INPUT, 0)] < m or done[(BACKWARD_INPUT, 1)] < m:
        backward(1, weight_too=False)
        backward(0, weight_too=False)
        if done[(BACKWARD_WEIGHT, 1)] < done[(BACKWARD_INPUT, 1)]:
            run(BACKWARD_WEIGHT, 1, m)
        else:
            run(BACKWARD_WEIGHT, 0, m)
    for chunk in (1, 0):
        for _ in range(m):
            run(BACKWARD_WEIGHT, chunk, m)
    return order


def _h1_lists(pp: int, m: int, vpp: int) -> list[list[Action]]:
    return [_zero_bubble_h1_rank(rank, pp, m) for rank in range(pp)]


def _v_lists(pp: int, m: int, vpp: int) -> list[list[Action]]:
    return [_zero_bubble_v_rank(rank, pp, m) for rank in range(pp)]


def _h1_closed_form(pp: int, m: int, vpp: int) -> tuple[float, tuple[int, ...]]:
    # the simulation's for m >= pp: F=1 of each warm-up step stays idle
    return (pp - 1) / (3 * m + pp - 1), tuple([min(pp, m)] * pp)


def _v_closed_form(pp: int, m: int, vpp: int) -> tuple[float, tuple[int, ...]]:
    # the simulation's for m >= 2 * pp: one chunk's F per warm-up step, two chunks; chunk
    # pairs: 2 * pp of them are pp micro-batches of a whole stage
    return (pp - 1) / (6 * m + pp - 1), tuple(min(2 * pp, 2 * m, m + 1 + r) for r in range(pp))


ZB_H1 = register_schedule(ScheduleSpec(
    name="zb-h1", build=_h1_lists, closed_form=_h1_closed_form,
    warmup_step=lambda forward, backward, vpp: forward, search_vpps=(1,),
    doc="1F1B with the backward split in I and W, W deferred: bubble (pp-1)(F+I-W)"))
ZB_V = register_schedule(ScheduleSpec(
    name="zb-v", build=_v_lists, closed_form=_v_closed_form,
    warmup_step=lambda forward, backward, vpp: forward / vpp,
    chunks=TWO, instead="zb-h1", placement=V_SHAPE, tag_matched=True,
    doc="two chunks per rank in a V (rank 0 holds the first and last stage); gloo only"))
