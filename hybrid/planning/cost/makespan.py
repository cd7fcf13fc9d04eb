"""The pipeline's makespan three ways (pure: no torch): simulated on the stages' times, its
closed-form bubble (for ranking thousands of layouts), and a lower bound no order of the
schedule's actions can beat (what makes the layout search exact). ``times``: one entry per
virtual stage with ``forward`` and ``backward`` seconds (``stage_time.StageTimes``).

``overlap``: the device runs a composite action's parts on two streams (a GPU; never a CPU
host, where they run in order), so each part's communication hides under the other's
compute (``pair_time``); the simulation and the ranks' busy time then count the pair so."""

from __future__ import annotations

import functools

from hybrid.planning.job import JobPlan
from hybrid.planning.schedules import schedule_spec
from hybrid.planning.schedules.actions import BACKWARD, FORWARD, Action, Composite, stage_rank
from hybrid.planning.schedules.registry import schedule_splits_backward
from hybrid.planning.schedules.replay import replay
from hybrid.planning.schedules.shapes import checked_schedule, schedule_steps
from hybrid.planning.schedules.simulate import StageCosts


def pair_time(forward, backward) -> float:
    """One composite of a forward (``StageTimes`` of its stage) and another stage's full
    backward on two streams: both computes, and of each part's communication what the
    other part's compute does not cover."""
    compute_f = forward.forward - forward.comm_forward
    compute_b = backward.backward - backward.comm_backward
    return (compute_f + compute_b + max(0.0, forward.comm_forward - compute_b)
            + max(0.0, backward.comm_backward - compute_f))


def _composite_pairs(schedule: str, pp: int, m: int, vpp: int) -> tuple:
    """(rank, forward stage, the backward part) of every F+B composite of a schedule's
    steps (most schedules have none)."""
    pairs = []
    for rank, steps in enumerate(schedule_steps(schedule, pp, m, vpp)):
        for step in steps:
            if isinstance(step, Composite) and [p.kind for p in step.parts] == [FORWARD,
                                                                                BACKWARD]:
                f, b = step.parts
                pairs.append((rank, f.stage, b))
    return tuple(pairs)


def _overlapped_pairs(plan: JobPlan, times: list) -> list[tuple[int, Action, float]]:
    """(rank, the pair's backward part, seconds the overlap saves) of every F+B composite."""
    layout = plan.layout
    pairs = []
    for rank, f_stage, b in _composite_pairs(plan.schedule.name, layout.pp,
                                             plan.schedule.microbatches, layout.vpp):
        whole = times[f_stage].forward + times[b.stage].backward
        pairs.append((rank, b, whole - pair_time(times[f_stage], times[b.stage])))
    return pairs


@functools.lru_cache(maxsize=1024)
def _pair_counts(schedule: str, pp: int, m: int, vpp: int) -> tuple:
    """(rank, forward stage, backward stage, how many) of the F+B composites: a pair's
    saving depends on its two stages only, so each distinct pair is priced once; cached per
    shape, as the search prices thousands of layouts of a few hundred shapes."""
    pairs = schedule_spec(schedule).pairs
    if pairs is not None:
        return tuple((rank, f, b, n) for rank, held in enumerate(pairs(pp, m, vpp))
                     for f, b, n in held)
    counts: dict[tuple[int, int, int], int] = {}
    for rank, f_stage, b in _composite_pairs(schedule, pp, m, vpp):
        key = (rank, f_stage, b.stage)
        counts[key] = counts.get(key, 0) + 1
    return tuple((*key, n) for key, n in counts.items())


def overlap_savings(plan: JobPlan, times: list) -> list[float]:
    """Per pipeline rank, the seconds a step's composites save on a two-stream device."""
    layout = plan.layout
    saved = [0.0] * layout.pp
    for rank, f_stage, b_stage, n in _pair_counts(plan.schedule.name, layout.pp,
                                                  plan.schedule.microbatches, layout.vpp):
        f, b = times[f_stage], times[b_stage]
        saved[rank] += n * (f.forward + b.backward - pair_time(f, b))
    return saved


def simulated_makespan(plan: JobPlan, times: list, p2p: float, overlap: bool = False) -> float:
    """The pipeline's time with the schedule simulated on these per-stage times (its action
    lists built and checked once per shape: ``simulate`` would check them on every call).
    ``overlap``: a composite runs its parts in order, the backward part shortened by what
    the overlap saves (so the forward's output leaves when it would, the pair ends when
    both parts have)."""
    layout, m = plan.layout, plan.schedule.microbatches
    costs = StageCosts(F=tuple(t.forward for t in times), B=tuple(t.backward for t in times),
                       I=tuple(t.backward / 2 for t in times),
                       W=tuple(t.backward / 2 for t in times), p2p=p2p)
    lists = checked_schedule(plan.schedule.name, layout.pp, m, layout.vpp)
    duration = costs.of
    if overlap:
        saved = {action: saving for _, action, saving in _overlapped_pairs(plan, times)}
        duration = lambda action: costs.of(action) - saved.get(action, 0.0)  # noqa: E731
    timed = replay([list(actions) for actions in lists], layout.pp, layout.vpp, duration,
                   costs.p2p, layout.stage_placement)
    return max((t.end for t in timed), default=0)


def makespan_lower_bound(plan: JobPlan, times: list, p2p: float, busy: list[float]) -> float:
    """The longest, over pipeline ranks, of a rank's own work plus what must run before its
    first action (the first micro-batch's forward through the stages below it) and, where a
    backward is not split, after its last (a backward of its first stage, which the stages
    below must then run too)."""
    layout = plan.layout
    rank_of = [stage_rank(k, layout.pp, layout.stage_placement) for k in range(len(times))]
    splits = schedule_splits_backward(plan.schedule.name)
    # sums over the stages below each stage, added in model order as sum() would (one pass:
    # a search bounds layouts of hundreds of stages)
    crossings, forward, backward = [0], [0], [0]
    for k, t in enumerate(times[:-1]):
        crossings.append(crossings[-1] + (rank_of[k + 1] != rank_of[k]))
        forward.append(forward[-1] + t.forward)
        backward.append(backward[-1] + t.backward)
    firsts: dict[int, int] = {}
    for k, r in enumerate(rank_of):
        firsts.setdefault(r, k)
    bound = 0.0
    for r in range(layout.pp):
        first = firsts[r]
        head = forward[first] + crossings[first] * p2p
        tail = 0.0 if splits else backward[first] + crossings[first] * p2p
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
