"""Simulate a schedule with per-action costs: makespan, bubble, peak in-flight micro-batches
and the timed events for drawing (pure; no torch).

Cost convention: ``Costs`` are the times of one action of ONE VIRTUAL STAGE (one chunk),
used exactly as given, whatever ``vpp`` is. To model the same model cut into ``vpp`` times
more, thinner stages, pass ``costs.per_chunk(vpp)`` (compute divided by ``vpp``, the
point-to-point latency unchanged). Any numbers that support ``+`` and ``max`` work;
``fractions.Fraction`` costs give exact results.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hybrid.planning.schedules.stage_map import Placement
from hybrid.planning.schedules.actions import (
    BACKWARD, BACKWARD_WEIGHT, FORWARD, LOOP, Action, flatten,
)
from hybrid.planning.schedules.check import check_schedule
from hybrid.planning.schedules.replay import replay

Event = tuple[int, Action, float, float]  # (rank, action, start, end)


@dataclass(frozen=True)
class Costs:
    """Time of one action of one virtual stage; ``p2p`` is the latency of one message."""

    F: float = 1
    """forward"""
    B: float = 2
    """full backward (input gradient + weight gradient)"""
    I: float = 1  # noqa: E741 - the action's own letter
    """backward for the input gradient only"""
    W: float = 1
    """weight gradient only"""
    p2p: float = 0
    """from the end of the producing action to the data being usable on the neighbour rank"""

    def per_chunk(self, vpp: int) -> Costs:
        """The costs of one of ``vpp`` chunks when a stage is cut into ``vpp`` equal chunks."""
        return replace(self, F=self.F / vpp, B=self.B / vpp, I=self.I / vpp, W=self.W / vpp)

    def of(self, action: Action) -> float:
        """Rank time taken by ``action``; SEND/RECV take none (their waits are modelled)."""
        return getattr(self, action.kind) if action.is_compute else 0


@dataclass(frozen=True)
class StageCosts:
    """Per-stage action times (one entry per virtual stage, model order): what the cost
    model feeds the simulator when stages differ (the embedding, the head, uneven splits)."""

    F: tuple[float, ...]
    B: tuple[float, ...]
    I: tuple[float, ...]  # noqa: E741 - the action's own letter
    W: tuple[float, ...]
    p2p: float = 0

    def of(self, action: Action) -> float:
        return getattr(self, action.kind)[action.stage] if action.is_compute else 0


@dataclass(frozen=True)
class SimResult:
    makespan: float
    """from the first action's start to the last action's end (all ranks start at 0)"""
    busy: tuple[float, ...]
    """compute time per rank"""
    bubble_time: tuple[float, ...]
    """idle time per rank: makespan - busy"""
    bubble_per_rank: tuple[float, ...]
    """idle / makespan per rank"""
    bubble_fraction: float
    """the overall bubble fraction: the mean of ``bubble_per_rank``"""
    peak_inflight: tuple[int, ...]
    """per rank: most (chunk, micro-batch) pairs with forward run and B/I not yet run"""
    events: list[Event]
    """(rank, action, start, end) of every action, per rank in list order"""


def simulate(lists: list[list[Action]], pp: int, m: int, vpp: int = 1,
             costs: Costs | StageCosts = Costs(F=1, B=2, I=1, W=1, p2p=0),
             placement: Placement = LOOP, checked: bool = False) -> SimResult:
    """Check ``lists`` (compute-only or lowered; ``checked``: already), then time it with
    ``costs``. A composite action runs its parts in order, as the CPU runtime does (its
    events are its parts')."""
    lists = flatten(lists)
    if not checked:
        check_schedule(lists, pp, m, vpp, placement)
    timed = sorted(replay(lists, pp, vpp, costs.of, costs.p2p, placement),
                   key=lambda t: (t.rank, t.step))
    makespan = max((t.end for t in timed), default=0)
    busy = [0] * pp
    for t in timed:
        busy[t.rank] += t.end - t.start if t.action.is_compute else 0
    idle = [makespan - b for b in busy]
    per_rank = [i / makespan if makespan else 0 for i in idle]
    return SimResult(
        makespan=makespan,
        busy=tuple(busy),
        bubble_time=tuple(idle),
        bubble_per_rank=tuple(per_rank),
        bubble_fraction=sum(per_rank) / pp,
        peak_inflight=tuple(peak_inflight(actions) for actions in lists),
        events=[(t.rank, t.action, t.start, t.end) for t in timed],
    )


def peak_inflight(actions: list[Action]) -> int:
    """Most (stage, micro-batch) pairs of one rank whose F has run and whose backward has not
    finished: B, or W when the backward is split (the runtime keeps the graph, and with it
    the saved activations, from I until W). This bounds the stored activations.
    """
    inflight: set[tuple[int, int]] = set()
    peak = 0
    for action in actions:
        if action.kind == FORWARD:
            inflight.add((action.stage, action.mb))
            peak = max(peak, len(inflight))
        elif action.kind in (BACKWARD, BACKWARD_WEIGHT):
            inflight.discard((action.stage, action.mb))
    return peak
