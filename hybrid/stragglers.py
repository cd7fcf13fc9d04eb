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

WAIT_AXES = (*COORD_ORDER, "other")
DEFAULT_PATIENCE = 3
"""Consecutive slow steps before a warning: one slow step is noise (a page fault, a GC)."""
DEFAULT_WINDOW = 5
"""Steps whose median is a rank's compute time."""
MIN_SHARE_OF_STEP = 0.05
"""A straggler's excess compute must cost at least this share of the step to be named."""
MIN_EXCESS_S = 0.1
"""... and at least this many seconds: on a busy CPU (8 ranks on 2 cores) a rank's 30 ms
compute is stretched by scheduling alone, 25% for several steps in a row (measured)."""


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
    """Flags a rank whose compute stays ``threshold`` times its peers' for ``patience`` steps
    in a row; it is flagged once until it falls back under the threshold.

    Each rank's compute is the median of its last ``window`` steps, so that a few slow steps
    (a page fault, another process taking the core) are not a straggler; and the excess must
    cost at least ``min_share`` of the step time, so that a 1 ms difference on a 5 ms compute
    in a 1 s step is not one either, nor anything under ``min_excess_s``.
    """

    pp_of_rank: Sequence[int]
    threshold: float
    patience: int = DEFAULT_PATIENCE
    window: int = DEFAULT_WINDOW
    min_share: float = MIN_SHARE_OF_STEP
    min_excess_s: float = MIN_EXCESS_S
    _peers: list[list[int]] = field(init=False)
    _streak: list[int] = field(init=False)
    _history: list[deque] = field(init=False)
    _flagged: set[int] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self._peers = peer_sets(self.pp_of_rank)
        self._streak = [0] * len(self.pp_of_rank)
        self._history = [deque(maxlen=self.window) for _ in self.pp_of_rank]

    def update(self, compute_s: Sequence[float], step_time_s: float) -> list[Straggler]:
        """Feed one step's compute per rank and its wall time; returns the ranks newly
        flagged."""
        for history, value in zip(self._history, compute_s):
            history.append(value)
        typical = [statistics.median(history) for history in self._history]
        found = []
        floor = max(self.min_share * step_time_s, self.min_excess_s)
        for rank, peers in enumerate(peer_medians(typical, self._peers)):
            if peers <= 0 or typical[rank] < self.threshold * peers \
                    or typical[rank] - peers < floor:
                self._streak[rank] = 0
                self._flagged.discard(rank)
                continue
            self._streak[rank] += 1
            if self._streak[rank] >= self.patience and rank not in self._flagged:
                self._flagged.add(rank)
                found.append(Straggler(rank, typical[rank], peers, self._streak[rank]))
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
            f"of its last {DEFAULT_WINDOW}) for {straggler.steps} steps; the others wait for it (per-rank times: "
            f"rank_times.jsonl)")


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
