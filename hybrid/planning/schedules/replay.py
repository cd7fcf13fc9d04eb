"""Replay a schedule on all pipeline ranks at once: the one engine behind the checker (zero
durations, logical order only) and the simulator (real durations) (pure; no torch).

Semantics, as the runtime behaves: each rank runs its list in order; a SEND is posted without
waiting; a RECV blocks until the peer has posted the matching SEND; a compute action waits only
for its data. In compute-only lists (no SEND/RECV at all) a dependency on another rank is an
implicit message that arrives when the producing action ends.

Because no action ever waits for a *later* action of the same rank, a dependency on the same
rank that has not run yet can never run in time: that is an order error, found at once. A
cross-rank dependency that has not run yet is a wait; when every unfinished rank waits, the
schedule deadlocks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from hybrid.planning.schedules.stage_map import Placement
from hybrid.planning.schedules.actions import (
    BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, RECV_B, RECV_F, SEND_B, SEND_F, Action,
    LOOP, stage_rank,
)

# What an action leaves behind for others to wait on: (stage, token, mb). B and I both leave
# the input gradient, so they share the token "I"; nothing waits on a W.
ResultKey = tuple[int, str, int]


def result_key(action: Action) -> ResultKey:
    token = BACKWARD_INPUT if action.is_backward_input else action.kind
    return (action.stage, token, action.mb)


def describe_key(key: ResultKey) -> str:
    stage, token, mb = key
    if token == BACKWARD_INPUT:
        return f"{stage}B{mb}/{stage}I{mb}"
    return f"{stage}{token}{mb}"


@dataclass(frozen=True)
class Dependency:
    key: ResultKey
    rank: int  # the rank that produces it
    is_message: bool  # crosses ranks, so it pays the point-to-point latency


def dependencies(action: Action, pp: int, n_stages: int, lowered: bool,
                 placement: Placement = LOOP) -> list[Dependency]:
    """What ``action`` needs done before it can start (see the module docstring)."""
    return _dependencies(action, _rank_table(pp, n_stages, placement), lowered)


@functools.lru_cache(maxsize=256)
def _rank_table(pp: int, n_stages: int, placement: Placement) -> tuple[int, ...]:
    """Each virtual stage's pipeline rank (a replay asks hundreds of thousands of times)."""
    return tuple(stage_rank(s, pp, placement) for s in range(n_stages))


def _dependencies(action: Action, rank_of: tuple[int, ...], lowered: bool) -> list[Dependency]:
    s, mb = action.stage, action.mb
    here = rank_of[s]

    def local(key: ResultKey) -> Dependency:
        return Dependency(key, here, False)

    def neighbour(other: int, kind: str, recv_kind: str) -> Dependency:
        """Data computed by stage ``other``: via our RECV when lowered and remote."""
        other_rank = rank_of[other]
        if other_rank == here:
            return local((other, kind, mb))
        if lowered:
            return local((s, recv_kind, mb))
        return Dependency((other, kind, mb), other_rank, True)

    kind = action.kind
    if kind == FORWARD:
        return [neighbour(s - 1, FORWARD, RECV_F)] if s > 0 else []
    if action.is_backward_input:
        deps = [local((s, FORWARD, mb))]
        if s < len(rank_of) - 1:
            deps.append(neighbour(s + 1, BACKWARD_INPUT, RECV_B))
        return deps
    if kind == BACKWARD_WEIGHT:
        return [local((s, BACKWARD_INPUT, mb))]
    if kind == SEND_F:
        return [local((s, FORWARD, mb))]
    if kind == SEND_B:
        return [local((s, BACKWARD_INPUT, mb))]
    if kind == RECV_F:
        return [Dependency((s - 1, SEND_F, mb), rank_of[s - 1], True)]
    return [Dependency((s + 1, SEND_B, mb), rank_of[s + 1], True)]  # RECV_B


class OrderViolation(Exception):
    """An action needs a result of its own rank that has not been produced before it."""

    def __init__(self, rank: int, step: int, action: Action, missing: ResultKey):
        super().__init__(f"rank {rank} step {step}: {action} needs {describe_key(missing)}")
        self.rank, self.step, self.action, self.missing = rank, step, action, missing


class Deadlock(Exception):
    """Every unfinished rank waits for a message that no rank can still send."""

    def __init__(self, waiting: list[tuple[int, int, Action, ResultKey]]):
        super().__init__("; ".join(f"rank {r} step {i} {a} waits for {describe_key(k)}"
                                   for r, i, a, k in waiting))
        self.waiting = waiting  # (rank, step, action, missing result) per blocked rank


@dataclass(frozen=True)
class Timed:
    rank: int
    step: int
    action: Action
    start: float
    end: float


def replay(lists: list[list[Action]], pp: int, vpp: int,
           duration: Callable[[Action], float], p2p: float = 0, placement: Placement = LOOP
           ) -> list[Timed]:
    """Run every rank as far as it can, repeatedly, until all finish or all wait.

    Returns the timed actions, per rank in list order. A RECV starts when its rank reaches it
    and ends when the data arrives, so its length is the time spent waiting. ZeRO-3's gathers
    and releases are left out (local to a rank, they wait on no other; the cost model prices
    their time), and so are the actions of registered kinds (``actions.register_action_kind``).
    """
    lists = [[a for a in actions if not (a.is_shard or a.is_extra)] for actions in lists]
    n_stages = pp * vpp
    lowered = any(action.is_comm for actions in lists for action in actions)
    rank_of = _rank_table(pp, n_stages, placement)
    needs = [[_dependencies(action, rank_of, lowered) for action in actions]
             for actions in lists]  # once: a waiting action is visited again
    finished: dict[ResultKey, float] = {}
    clock, cursor = [0] * len(lists), [0] * len(lists)
    timed: list[Timed] = []
    progress = True
    while progress:
        progress = False
        for rank, actions in enumerate(lists):
            while cursor[rank] < len(actions):
                action = actions[cursor[rank]]
                ready = _ready_time(rank, cursor[rank], action, clock[rank], finished,
                                    needs[rank][cursor[rank]], p2p)
                if ready is None:
                    break  # waits for another rank; try the others
                start = clock[rank] if action.kind in (RECV_F, RECV_B) else ready
                end = ready + duration(action)
                timed.append(Timed(rank, cursor[rank], action, start, end))
                finished[result_key(action)] = end
                clock[rank], cursor[rank], progress = end, cursor[rank] + 1, True
    waiting = [(rank, cursor[rank], actions[cursor[rank]],
                _first_missing(actions[cursor[rank]], finished, pp, n_stages, lowered,
                               placement))
               for rank, actions in enumerate(lists) if cursor[rank] < len(actions)]
    if waiting:
        raise Deadlock(waiting)
    return timed


def _ready_time(rank: int, step: int, action: Action, clock: float,
                finished: dict[ResultKey, float], deps: list[Dependency], p2p: float
                ) -> float | None:
    """When ``action`` can start, or None while it waits for another rank."""
    ready = clock
    for dep in deps:
        end = finished.get(dep.key)
        if end is None:
            if dep.rank == rank:
                raise OrderViolation(rank, step, action, dep.key)
            return None
        ready = max(ready, end + (p2p if dep.is_message else 0))
    return ready


def _first_missing(action: Action, finished: dict[ResultKey, float], pp: int, n_stages: int,
                   lowered: bool, placement: Placement) -> ResultKey:
    deps = dependencies(action, pp, n_stages, lowered, placement)
    return next(dep.key for dep in deps if dep.key not in finished)
