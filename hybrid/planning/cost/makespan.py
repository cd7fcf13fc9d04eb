"""The pipeline's makespan three ways (pure: no torch): simulated on the stages' times, its
closed-form bubble (for ranking thousands of layouts), and a lower bound no order of the
schedule's actions can beat (what makes the layout search exact). ``times``: one entry per
virtual stage with ``forward`` and ``backward`` seconds (``steptime._StageTimes``)."""

from __future__ import annotations

import functools

from hybrid.planning.job import JobPlan
from hybrid.planning.schedules import build_schedule, schedule_spec
from hybrid.planning.schedules.actions import stage_rank
from hybrid.planning.schedules.registry import schedule_splits_backward
from hybrid.planning.schedules.check import check_schedule
from hybrid.planning.schedules.replay import replay
from hybrid.planning.schedules.simulate import StageCosts


def simulated_makespan(plan: JobPlan, times: list, p2p: float) -> float:
    """The pipeline's time with the schedule simulated on these per-stage times (its action
    lists built and checked once per shape: ``simulate`` would check them on every call)."""
    layout, m = plan.layout, plan.schedule.microbatches
    costs = StageCosts(F=tuple(t.forward for t in times), B=tuple(t.backward for t in times),
                       I=tuple(t.backward / 2 for t in times),
                       W=tuple(t.backward / 2 for t in times), p2p=p2p)
    lists = _checked_lists(plan.schedule.name, layout.pp, m, layout.vpp,
                           layout.stage_placement)
    timed = replay([list(actions) for actions in lists], layout.pp, layout.vpp, costs.of,
                   costs.p2p, layout.stage_placement)
    return max((t.end for t in timed), default=0)


@functools.lru_cache(maxsize=64)
def _checked_lists(name: str, pp: int, m: int, vpp: int, placement: str) -> tuple:
    lists = build_schedule(name, pp, m, vpp=vpp)
    check_schedule(lists, pp, m, vpp, placement)
    return tuple(tuple(actions) for actions in lists)


def makespan_lower_bound(plan: JobPlan, times: list, p2p: float, busy: list[float]) -> float:
    """The longest, over pipeline ranks, of a rank's own work plus what must run before its
    first action (the first micro-batch's forward through the stages below it) and, where a
    backward is not split, after its last (a backward of its first stage, which the stages
    below must then run too)."""
    layout = plan.layout
    rank_of = [stage_rank(k, layout.pp, layout.stage_placement) for k in range(len(times))]
    splits = schedule_splits_backward(plan.schedule.name)
    bound = 0.0
    for r in range(layout.pp):
        first = rank_of.index(r)
        crossings = sum(1 for k in range(1, first + 1) if rank_of[k] != rank_of[k - 1])
        head = sum(t.forward for t in times[:first]) + crossings * p2p
        tail = 0.0 if splits else (sum(t.backward for t in times[:first])
                                   + crossings * p2p)
        bound = max(bound, head + busy[r] + tail)
    return bound


def closed_form_bubble(plan: JobPlan, times: list, p2p: float) -> float:
    """Warm-up and drain of the slowest stage: ``(pp - 1)`` of what one warm-up step leaves
    idle (the schedule's ``warmup_step``: 1F1B a forward and backward, ``/ vpp``
    interleaved; zero-bubble H1 the forward, ZB-V one chunk's forward), plus the messages."""
    pp = plan.layout.pp
    if pp == 1:
        return 0.0
    slowest = max(times, key=lambda t: t.forward + t.backward)
    per_step = schedule_spec(plan.schedule.name).warmup_step(slowest.forward, slowest.backward,
                                                              plan.layout.vpp)
    return (pp - 1) * (per_step + 2 * p2p)
