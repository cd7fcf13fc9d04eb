"""Prove a schedule complete, in dependency order and deadlock-free (pure; no torch).

``check_schedule`` accepts compute-only lists (cross-rank data moves as implicit messages) and
lowered lists (with SEND/RECV; then every cross-rank edge must have its SEND and its RECV).
A failure raises ``ScheduleError``: one line saying what is wrong, then the step x rank table
of the schedule with the offending cells marked ``>>``.
"""

from __future__ import annotations

from collections import Counter

from hybrid.planning.schedules.stage_map import Placement
from hybrid.planning.schedules.actions import (
    BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, RECV_B, RECV_F, SEND_B, SEND_F, Action,
    LOOP, ScheduleError, check_and_strip_extras, flatten, stage_rank,
)
from hybrid.planning.schedules.gathers import check_gathers, strip_gathers
from hybrid.planning.schedules.replay import Deadlock, OrderViolation, describe_key, replay

MARK = ">>"

Cell = tuple[int, int]  # (rank, step)


def format_table(lists: list[list[Action]], marks: set[Cell] | None = None) -> str:
    """The schedule as a step x rank table; cells in ``marks`` are prefixed with ``>>``."""
    marks = marks or set()
    n_steps = max((len(actions) for actions in lists), default=0)

    def cell(rank: int, step: int) -> str:
        if step >= len(lists[rank]):
            return ""
        return (MARK if (rank, step) in marks else "") + str(lists[rank][step])

    width = max([len(f"rank {len(lists) - 1}")]
                + [len(cell(r, i)) for r in range(len(lists)) for i in range(n_steps)])
    header = "step | " + " | ".join(f"rank {r}".ljust(width) for r in range(len(lists)))
    rows = [f"{step:4d} | " + " | ".join(cell(r, step).ljust(width) for r in range(len(lists)))
            for step in range(n_steps)]
    return "\n".join([header.rstrip(), "-" * len(header)] + [row.rstrip() for row in rows])


def check_schedule(lists: list[list[Action]], pp: int, m: int, vpp: int = 1,
                   placement: Placement = LOOP, forward_only: bool = False) -> None:
    """Raise ``ScheduleError`` unless ``lists`` is a complete, ordered, deadlock-free schedule
    (composite actions count as their parts in order).

    ZeRO-3's gathers and releases, where present, must bracket every compute that needs the
    weights (``gathers.check_gathers``). Complete: every (stage, mb) has one F and (unless
    ``forward_only``: evaluation) either one B or one I and one W, nothing else,
    each on the rank ``stage_rank(stage, pp, placement)`` gives; lowered lists also carry exactly the SEND/RECV pairs of
    every cross-rank edge. Ordered and deadlock-free: replaying all ranks with the runtime's
    semantics (SEND posted without waiting, RECV blocks until posted) runs every action.
    """
    if len(lists) != pp:
        raise ScheduleError(f"schedule has {len(lists)} rank lists but pp={pp}; "
                            f"give one list per pipeline rank")
    lists = flatten(lists)  # a composite runs its parts in order (``actions.Composite``)
    _check_placement(lists, pp, m, vpp, placement)
    lists = check_and_strip_extras(lists)  # registered kinds: local, no data, no time
    if any(action.is_shard for actions in lists for action in actions):
        for rank, actions in enumerate(lists):
            check_gathers(actions, rank)
        lists = strip_gathers(lists)  # local to each rank: no part in a deadlock
    _check_complete(lists, pp, m, vpp, placement, forward_only)
    try:
        replay(lists, pp, vpp, duration=lambda action: 0, placement=placement)
    except OrderViolation as bad:
        _fail(f"rank {bad.rank} step {bad.step}: {bad.action} runs before "
              f"{describe_key(bad.missing)} that it needs from its own rank; move it later",
              lists, {(bad.rank, bad.step)})
    except Deadlock as stuck:
        waits = "; ".join(f"rank {r} at {a} waits for {describe_key(k)}"
                          for r, _, a, k in stuck.waiting)
        _fail(f"deadlock: {waits}", lists, {(r, i) for r, i, _, _ in stuck.waiting})


def _fail(reason: str, lists: list[list[Action]], marks: set[Cell]) -> None:
    raise ScheduleError(f"{reason}\n{format_table(lists, marks)}")


def _locate(lists: list[list[Action]], wanted: Action) -> set[Cell]:
    return {(r, i) for r, actions in enumerate(lists)
            for i, action in enumerate(actions) if action == wanted}


def _check_placement(lists: list[list[Action]], pp: int, m: int, vpp: int, placement: Placement
                     ) -> None:
    n_stages = pp * vpp
    for rank, actions in enumerate(lists):
        for step, action in enumerate(actions):
            if action.stage >= n_stages or action.mb >= m:
                _fail(f"{action} is out of range: stages are 0..{n_stages - 1} and "
                      f"micro-batches 0..{m - 1}", lists, {(rank, step)})
            home = stage_rank(action.stage, pp, placement)
            if home != rank:
                _fail(f"{action} is on rank {rank} but stage {action.stage} lives on rank "
                      f"{home}", lists, {(rank, step)})


def _check_complete(lists: list[list[Action]], pp: int, m: int, vpp: int, placement: Placement,
                    forward_only: bool) -> None:
    counts = Counter(action for actions in lists for action in actions)
    for action, count in counts.items():
        if count > 1:
            _fail(f"{action} appears {count} times; keep exactly one", lists,
                  _locate(lists, action))
    required = _required_actions(lists, pp, m, vpp, placement, forward_only)
    missing = sorted(required.difference(counts))
    if missing:
        action = missing[0]
        _fail(f"{action} is missing; add it to rank {stage_rank(action.stage, pp, placement)}",
              lists, set())
    for action in counts:
        if action not in required:
            _fail(f"{action} is not needed: {_why_extra(action)}", lists,
                  _locate(lists, action))


def _required_actions(lists: list[list[Action]], pp: int, m: int, vpp: int, placement: Placement,
                      forward_only: bool = False) -> set[Action]:
    """Every action a complete schedule must have; B vs I+W follows what each (s, mb) uses
    (``forward_only``: forwards and their messages only)."""
    n_stages = pp * vpp
    present = {action for actions in lists for action in actions}
    lowered = any(action.is_comm for action in present)
    required: set[Action] = set()
    for s in range(n_stages):
        here = stage_rank(s, pp, placement)
        prev_remote = s > 0 and stage_rank(s - 1, pp, placement) != here
        next_remote = s < n_stages - 1 and stage_rank(s + 1, pp, placement) != here
        for mb in range(m):
            required.add(Action(s, FORWARD, mb))
            if forward_only:
                if lowered:
                    required |= ({Action(s, RECV_F, mb)} if prev_remote else set()) | (
                        {Action(s, SEND_F, mb)} if next_remote else set())
                continue
            split = (Action(s, BACKWARD_INPUT, mb) in present
                     or Action(s, BACKWARD_WEIGHT, mb) in present)
            required |= ({Action(s, BACKWARD_INPUT, mb), Action(s, BACKWARD_WEIGHT, mb)}
                         if split else {Action(s, BACKWARD, mb)})
            if lowered:
                kinds = ((RECV_F, SEND_B) if prev_remote else ()) + (
                    (SEND_F, RECV_B) if next_remote else ())
                required |= {Action(s, kind, mb) for kind in kinds}
    return required


def _why_extra(action: Action) -> str:
    if action.kind == BACKWARD:
        return "this (stage, micro-batch) already splits its backward into I and W; drop the B"
    if action.is_comm:
        return "no neighbour on another rank sends or receives it; drop it"
    return "drop it"
