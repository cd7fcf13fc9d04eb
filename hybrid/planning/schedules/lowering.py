"""Lowering: the pure pass that adds point-to-point communication to compute-only action lists
(as torch.distributed.pipelining's ``_add_send_recv``). ``check.check_schedule`` proves either
form complete and deadlock-free."""

from __future__ import annotations

from hybrid.planning.schedules.stage_map import Placement
from hybrid.planning.schedules.actions import (
    FORWARD, LOOP, RECV_B, RECV_F, SEND_B, SEND_F, Action, ScheduleError, flatten, stage_rank,
)


def add_communication(compute_lists: list[list[Action]], pp: int, vpp: int = 1,
                      placement: Placement = LOOP) -> list[list[Action]]:
    """Insert SEND/RECV actions around the compute actions that cross ranks.

    A RECV goes right before the compute that consumes it and a SEND right after the compute
    that produced it. Under the runtime's semantics (SEND is posted and completes on its own;
    RECV blocks until the peer has posted the matching SEND) this is deadlock-free exactly when
    the compute-only lists are, so no RECV needs to move earlier. With ``pp == 1`` every
    neighbour is local and nothing is added. Composite actions are lowered as their parts in
    order (what the CPU runtime runs).
    """
    if len(compute_lists) != pp:
        raise ScheduleError(f"got {len(compute_lists)} rank lists for pp={pp}; pass one per rank")
    compute_lists = flatten(compute_lists)
    n_stages = pp * vpp
    lowered: list[list[Action]] = []
    for actions in compute_lists:
        out: list[Action] = []
        for action in actions:
            if action.is_comm:
                raise ScheduleError(f"{action} is already a communication action; "
                                    f"call add_communication on compute-only lists")
            before, after = _comms_around(action, pp, n_stages, placement)
            out += before + [action] + after
        lowered.append(out)
    return lowered


def _comms_around(action: Action, pp: int, n_stages: int, placement: Placement
                  ) -> tuple[list[Action], list[Action]]:
    """The RECVs to put before ``action`` and the SENDs after it."""
    s, mb = action.stage, action.mb
    here = stage_rank(s, pp, placement)
    has_prev = s > 0 and stage_rank(s - 1, pp, placement) != here
    has_next = s < n_stages - 1 and stage_rank(s + 1, pp, placement) != here
    if action.kind == FORWARD:
        return ([Action(s, RECV_F, mb)] if has_prev else [],
                [Action(s, SEND_F, mb)] if has_next else [])
    if action.is_backward_input:
        return ([Action(s, RECV_B, mb)] if has_next else [],
                [Action(s, SEND_B, mb)] if has_prev else [])
    return [], []  # W needs nothing from another rank


def forward_only(lists: list[list[Action]]) -> list[list[Action]]:
    """A schedule's forwards alone, with their sends and receives, in the same order: what
    evaluation runs. Every forward depends only on forwards, so dropping the backwards (and
    their messages) from a deadlock-free schedule leaves one (``check_schedule(...,
    forward_only=True)`` proves it)."""
    return [[a for a in actions if a.kind in (FORWARD, SEND_F, RECV_F)] for actions in lists]
