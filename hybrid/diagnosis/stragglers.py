"""Which rank is slow: per-step compute and wait times of every rank, and a straggler warning.

Pure (no torch). Every step each rank measures its *compute* (wall time of the step minus the
time it was blocked in collectives and pipeline receives) and its waits per axis; rank 0 gets
everyone's (one all-gather) and feeds them to ``StragglerWatch``.

A rank is compared with its *peers*: the ranks holding the same pipeline stages (same ``pp``
coordinate), which do the same work. Comparing across stages would flag the stage that holds
the LM head on every step of an undisturbed run. A rank with no peer (``dp = tp = 1``) is
never flagged (its times are still in ``rank_times.jsonl``): slow and heavy look alike there.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from hybrid.files import JsonLines
from hybrid.planning.layout import COORD_ORDER

WAIT_AXES = (*COORD_ORDER, "ep", "other")
"""Where a rank waits: the axes, the expert all-to-all (ep) and the rest."""
DEFAULT_WINDOW = 12
"""Steps a rank is judged over."""
MIN_SLOW_STEPS = 9
"""... of which it must be slow in this many. Scheduling noise (8 ranks on 2 cores stretch a
rank's compute by 25% for a few steps) slows a rank now and then, not in nearly every step: a
sign test over the window, not a floor in seconds, tells the two apart, however short the
step."""
MIN_SHARE_OF_STEP = 0.1
"""In a slow step the rank's excess over its peers' median must be at least this share of the
step: what its peers spend waiting for it. (Undisturbed 2- and 8-rank runs on 2 cores, 6-12 ms
of compute, 80-560 steps: with 1.5x and 10%, no rank slow in more than 7 of any 12 steps,
though one was in 5 of 6; with 1.2x and 5%, in 10 of 12. A worker throttled to about twice
its peers' compute was slow in 9 of 12 at most.)"""


@dataclass(frozen=True)
class Straggler:
    rank: int
    compute_s: float
    peers_median_s: float
    steps: int

    @property
    def ratio(self) -> float:
        return self.compute_s / self.peers_median_s if self.peers_median_s > 0 else float("inf")


def peer_sets(pp_of_rank: Sequence[int]) -> list[list[int]]:
    """Per rank, the other ranks it is compared with (see the module doc)."""
    world = len(pp_of_rank)
    out = []
    for rank in range(world):
        out.append([r for r in range(world) if r != rank and pp_of_rank[r] == pp_of_rank[rank]])
    return out


def peer_medians(compute_s: Sequence[float], peers: list[list[int]]) -> list[float]:
    """Per rank, the median of its peers' compute (0.0 when it has none)."""
    return [statistics.median(compute_s[r] for r in others) if others else 0.0
            for others in peers]


def ratios(compute_s: Sequence[float], peers: list[list[int]]) -> list[float]:
    """Each rank's compute over the median of its peers' (1.0 when it has none)."""
    return [mine / median if median > 0 else 1.0
            for mine, median in zip(compute_s, peer_medians(compute_s, peers))]


@dataclass
class StragglerWatch:
    """Flags a rank that was slow in ``min_slow`` of the last ``window`` steps; it is flagged
    once until it has recovered (slow in at most a third of them: a throttled rank that is
    normal now and then is not named again and again).

    A step is slow for a rank when its compute is at least ``threshold`` times its peers'
    median and the excess is at least ``min_share`` of the step time: a rank that costs its
    peers a noticeable share of every step, whatever the step's length. A few slow steps (a
    page fault, another process taking the core) are not a straggler.
    """

    pp_of_rank: Sequence[int]
    threshold: float
    window: int = DEFAULT_WINDOW
    min_slow: int = MIN_SLOW_STEPS
    min_share: float = MIN_SHARE_OF_STEP
    _peers: list[list[int]] = field(init=False)
    _history: list[deque] = field(init=False)
    _flagged: set[int] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self._peers = peer_sets(self.pp_of_rank)
        self._history = [deque(maxlen=self.window) for _ in self.pp_of_rank]

    def update(self, compute_s: Sequence[float], step_time_s: float) -> list[Straggler]:
        """Feed one step's compute per rank and its wall time; returns the ranks newly
        flagged."""
        for rank, peers in enumerate(peer_medians(compute_s, self._peers)):
            slow = peers > 0 and compute_s[rank] >= self.threshold * peers \
                and compute_s[rank] - peers >= self.min_share * step_time_s
            self._history[rank].append((slow, compute_s[rank], peers))
        found = []
        for rank, history in enumerate(self._history):
            slow_steps = sum(slow for slow, _, _ in history)
            if slow_steps <= min(self.window // 3, self.min_slow - 1):  # recovered: normal in
                self._flagged.discard(rank)                             # most steps again
            elif slow_steps >= self.min_slow and rank not in self._flagged:
                self._flagged.add(rank)
                found.append(Straggler(rank, statistics.median(c for _, c, _ in history),
                                       statistics.median(p for _, _, p in history),
                                       slow_steps))
        return found


def step_summary(compute_s: Sequence[float], waits: dict[str, Sequence[float]],
                 peers: list[list[int]]) -> dict:
    """What ``metrics.jsonl`` records of a step's per-rank times: the slowest rank by compute
    (with its ratio to its peers' median) and the largest wait of any rank per axis."""
    slowest = max(range(len(compute_s)), key=lambda r: compute_s[r])
    return {
        "slowest_rank": {"rank": slowest, "compute_s": compute_s[slowest],
                         "ratio": ratios(compute_s, peers)[slowest]},
        "max_wait_s": {axis: max(waits[axis]) for axis in WAIT_AXES},
    }


def warning_line(straggler: Straggler, who: str) -> str:
    return (f"warning: straggler: {who} computes {straggler.ratio:.2f}x its peers' median "
            f"({straggler.compute_s:.3f}s vs {straggler.peers_median_s:.3f}s per step, median "
            f"of its last {DEFAULT_WINDOW}), slow in {straggler.steps} of them; the others "
            f"wait for it (per-rank times: rank_times.jsonl)")


class RankTimesLog:
    """Rank 0's view of every step's per-rank times: ``rank_times.jsonl`` (one line a step:
    ``{"step", "compute_s": [per rank], "wait_s": {axis: [per rank]}}``), the fields for
    ``metrics.jsonl`` and the stragglers to warn about (none when ``threshold`` is 0)."""

    def __init__(self, path: Path, pp_of_rank: Sequence[int], threshold: float, *,
                 append: bool = False):
        self.path = path
        self._file = JsonLines(path, append=append)
        self._peers = peer_sets(pp_of_rank)
        self._watch = StragglerWatch(pp_of_rank, threshold) if threshold else None

    def add(self, step: int, compute_s: Sequence[float], waits: dict[str, Sequence[float]],
            step_time_s: float) -> tuple[dict, list[Straggler]]:
        line = {"step": step, "compute_s": [round(t, 6) for t in compute_s],
                "wait_s": {axis: [round(t, 6) for t in waits[axis]] for axis in WAIT_AXES}}
        self._file.append(line)
        found = self._watch.update(compute_s, step_time_s) if self._watch is not None else []
        return step_summary(compute_s, waits, self._peers), found

    def close(self) -> None:
        self._file.close()
