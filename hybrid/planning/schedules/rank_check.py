"""Checks of one rank's action list before the runtime runs it, and the plan it runs (pure;
no torch).

``check.check_schedule`` proves a whole schedule (all ranks) deadlock-free and is the check to
run once when a job starts. The runtime sees only its own rank's list; these checks catch what
a single list can get wrong (a stage held elsewhere, a missing or repeated action, a SEND or
RECV too many or too few, an action before one it needs) before any message is posted, so a
bad list fails at once with one line instead of leaving a peer waiting for a timeout.

The checks cost Python time that grows with the list (about 15 ms for one rank of pp=8,
vpp=4, m=64, measured), so ``plan_rank`` runs them once and keeps the result as a ``RankPlan``:
a trainer makes one per list and hands it to every step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

from hybrid.planning.schedules.stage_map import Placement
from hybrid.planning.schedules.actions import (
    check_and_strip_extras, flatten,
    BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, LOOP, RECV_B, RECV_F, Action,
    ScheduleError, rank_stages,
)
from hybrid.planning.schedules.gathers import check_gathers, strip_gathers, unshard_directions
from hybrid.planning.schedules.replay import dependencies, describe_key, result_key
from hybrid.planning.schedules.lowering import add_communication


Posting = tuple[tuple[Action, ...], Optional[Action]]


@dataclass(frozen=True)
class RankPlan:
    """The ``posting_plan`` of one rank's lowered and checked action list, with what it was
    checked for (``run_pipeline_step`` refuses it for another rank, layout or batch)."""

    posting: tuple[Posting, ...]
    stages: tuple[int, ...]
    rank: int
    pp: int
    vpp: int
    m: int
    placement: Placement
    recv_lookahead: int
    forward_only: bool = False
    unshard_directions: tuple[int, ...] = ()
    """ZeRO-3: per ``UNSHARD`` in order, the way its stage's next compute walks the blocks
    (``gathers.unshard_directions``), found once here rather than every step."""

    def check_made_for(self, *, rank: int, pp: int, vpp: int, m: int, placement: Placement,
                       stages: Sequence[int], recv_lookahead: int,
                       forward_only: bool = False) -> None:
        """Raise ``ScheduleError`` (one line) unless the plan was made for this step."""
        made = (self.rank, self.pp, self.vpp, self.m, self.placement, self.stages,
                self.recv_lookahead, self.forward_only)
        step = (rank, pp, vpp, m, placement, tuple(sorted(stages)), recv_lookahead,
                forward_only)
        if made != step:
            raise ScheduleError(
                f"the rank plan was made for (rank, pp, vpp, m, placement, stages, lookahead, "
                f"forward only)={made} but this step is {step}; make it with prepare_rank for "
                f"this rank and batch")


def plan_rank(actions: Sequence[Action], stages: Sequence[int], *, rank: int, pp: int,
              vpp: int, m: int, placement: Placement = LOOP, recv_lookahead: int = 0,
              forward_only: bool = False) -> RankPlan:
    """Lower ``actions`` (when compute-only), check them for this rank and plan the posting of
    their messages; raises ``ScheduleError`` with the first problem. ``forward_only``: an
    evaluation's list (forwards and their messages only). A composite action runs as its
    parts in order (the CPU path; ``actions.Composite``)."""
    actions = flatten([list(actions)])[0]
    if pp > 1 and not any(action.is_comm for action in actions):
        actions = lower_rank_actions(actions, rank, pp, vpp, placement)
    check_rank_actions(actions, stages, rank=rank, pp=pp, vpp=vpp, m=m, placement=placement,
                       forward_only=forward_only)
    posting = tuple((tuple(posts), action)
                    for posts, action in posting_plan(actions, recv_lookahead))
    return RankPlan(posting, tuple(sorted(stages)), rank, pp, vpp, m, placement,
                    recv_lookahead, forward_only, tuple(unshard_directions(actions)))


def posting_plan(actions: Sequence[Action], recv_lookahead: int = 0
                 ) -> list[tuple[list[Action], Optional[Action]]]:
    """``(SEND/RECV actions to post as one batch, action to run next)`` per step: a compute,
    or a ZeRO-3 gather or release.

    The SEND/RECV actions listed between two such actions are posted together before the
    second; a RECV moves ``recv_lookahead`` compute actions earlier than its consumer (never
    before the first). The last step posts what follows the last compute action.
    """
    steps: list[tuple[list[Action], Optional[Action]]] = [
        ([], action) for action in actions if _runs(action)] + [([], None)]
    computes_before = 0
    for action in actions:
        if _runs(action):
            computes_before += 1
            continue
        at = computes_before
        if action.kind in (RECV_F, RECV_B):
            at = max(at - recv_lookahead, 0)
        steps[at][0].append(action)
    return [(posts, action) for posts, action in steps if posts or action is not None]


def _runs(action: Action) -> bool:
    """Run by the rank itself in list order: computes, ZeRO-3's gathers and releases, and the
    actions of registered kinds (``actions.register_action_kind``)."""
    return action.is_compute or action.is_shard or action.is_extra


def lower_rank_actions(actions: Sequence[Action], rank: int, pp: int, vpp: int,
                       placement: Placement = LOOP) -> list[Action]:
    """``add_communication`` for one rank's compute-only list."""
    lists: list[list[Action]] = [[] for _ in range(pp)]
    lists[rank] = list(actions)
    return add_communication(lists, pp, vpp, placement)[rank]


def check_rank_actions(actions: Sequence[Action], stages: Sequence[int], *, rank: int, pp: int,
                       vpp: int, m: int, placement: Placement = LOOP,
                       forward_only: bool = False) -> None:
    """Raise ``ScheduleError`` unless ``actions`` is a complete, ordered list for this rank."""
    expected_stages = rank_stages(rank, pp, vpp, placement)
    if sorted(stages) != expected_stages:
        raise ScheduleError(f"pipeline rank {rank} of pp={pp}, vpp={vpp} holds stages "
                            f"{expected_stages} but was given modules for stages "
                            f"{sorted(stages)}; pass one module per stage it holds")
    for action in actions:
        if action.stage not in expected_stages:
            raise ScheduleError(f"{action} is for stage {action.stage}, which rank {rank} does "
                                f"not hold (it holds {expected_stages}); pass this rank's list")
        if action.mb >= m:
            raise ScheduleError(f"{action} names micro-batch {action.mb} but the step has {m} "
                                f"micro-batches; build the schedule with m={m}")
    actions = check_and_strip_extras([list(actions)])[0]
    if any(action.is_shard for action in actions):
        check_gathers(actions, rank)
        actions = strip_gathers([list(actions)])[0]
    repeated = [str(a) for a, count in Counter(actions).items() if count > 1]
    if repeated:
        raise ScheduleError(f"rank {rank} runs {', '.join(repeated)} more than once")
    _check_complete(actions, expected_stages, rank, pp, vpp, m, placement, forward_only)
    _check_order(actions, rank, pp, vpp, placement)


def _check_complete(actions: Sequence[Action], stages: list[int], rank: int, pp: int,
                    vpp: int, m: int, placement: Placement, forward_only: bool = False) -> None:
    present = set(actions)
    compute = [a for a in actions if a.is_compute]
    required = set(compute) | set(lower_rank_actions(compute, rank, pp, vpp, placement))
    for stage in stages:
        for mb in range(m):
            split = {Action(stage, BACKWARD_INPUT, mb), Action(stage, BACKWARD_WEIGHT, mb)}
            backward = split if split & present else {Action(stage, BACKWARD, mb)}
            required |= {Action(stage, FORWARD, mb)} | (set() if forward_only else backward)
    missing, extra = required - present, present - required
    if missing:
        raise ScheduleError(f"rank {rank}'s list lacks {', '.join(map(str, sorted(missing)))}; "
                            f"every forward needs its backward (B, or I and W) and every "
                            f"cross-rank edge its SEND and RECV")
    if extra:
        raise ScheduleError(f"rank {rank}'s list has {', '.join(map(str, sorted(extra)))}, "
                            f"which no stage needs; drop them")


def _check_order(actions: Sequence[Action], rank: int, pp: int, vpp: int, placement: Placement
                 ) -> None:
    lowered = any(action.is_comm for action in actions)
    done: set = set()
    for step, action in enumerate(actions):
        for dep in dependencies(action, pp, pp * vpp, lowered, placement):
            if dep.rank == rank and dep.key not in done:
                raise ScheduleError(f"rank {rank} step {step}: {action} runs before "
                                    f"{describe_key(dep.key)}, which it needs; move it later")
        done.add(result_key(action))
