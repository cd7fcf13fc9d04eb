"""The layer split of the pipeline stages, re-decided from their measured speed (pure).

``parallel.pp_balance=dynamic`` (issue 55): a slow worker that holds a pipeline stage slows
every micro-batch of every replica, and moving micro-batches between replicas
(``dp_balance``) cannot help; moving layers off its stage can. Every
``parallel.pp_balance_every`` steps the ranks decide, from the same all-gathered
measurements, how many layers each stage holds. The math does not change, only who computes
which layer.

The model of a stage: its seconds per micro-batch in the forward and backward are
``speed_s * cost(blocks)``, with ``cost`` the partitioner's per-block costs
(``parallel.partition=measured``'s measured seconds when the plan has them, else the cost
model's FLOPs) and ``speed_s`` the stage's measured seconds per unit of cost: its slowest
rank's pipeline seconds (the forward and backward, waits excluded) over its micro-batches
and the cost of the blocks it held. Priced per unit of cost, a stage's speed does not depend
on its split, so the estimate spans the last ``HISTORY_WINDOWS`` decision windows across
changes of the split (as ``planning.balance`` does for the replicas' shares). The best split
is the contiguous one whose slowest stage is fastest (``partition_per_stage``, the
partitioner ``cost.node_devices`` uses with one cost list per stage's device). The step is
priced as a pipeline whose every slot lasts the slowest stage's micro-batch:
``(m + pp - 1) * max_stage``.

Hysteresis, as for the replicas' shares: a new split is taken only when it is predicted to
save at least ``min_saving`` of the current split's predicted step, when the kept steps and
the last window alone both ask for it, and when two decisions in a row ask (a burst of
scheduling noise passes, a slow worker stays). A split that moves a layer must save a whole
layer's share of the slowest stage, so an undisturbed run keeps its split.

A move costs seconds of its own (the state travels, the stages are built again), and a
machine's load drifts: on pp4 a move once followed the cores' share from one stage to
another and back. So, once a move has been timed, the next must save ``PAYBACK`` times that
time over the run's steps left; and a move back to the split the last move left must save
``BACK_FACTOR`` times ``min_saving`` (a slowdown that ends saves far more than that).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

from hybrid.planning.layout import LayoutError
from hybrid.planning.schedules.partition import (partition_per_stage,
                                                 ranges_from_layer_counts)
from hybrid.planning.strategies import DpOptions, reduction_of

PP_BALANCE_MODES = ("static", "dynamic")
PP_BALANCE_MOVES = ("memory", "checkpoint")
"""How a new split's state moves (``hybrid.balance.stages.move_state``)."""
DEFAULT_EVERY = 5
DEFAULT_MIN_SAVING = 0.1
HISTORY_WINDOWS = 3
"""Decision windows the stages' speeds are estimated over."""
PAYBACK = 2.0
"""A move must save, over the steps left, this many times what the last move cost."""
BACK_FACTOR = 2.0
"""A move back to the split before the last move must save this many times ``min_saving``."""

Split = tuple[range, ...]
"""Block ids per stage, in model order (0 the embedding, 1..L the layers, L+1 the head)."""


def layer_counts(split: Sequence[range]) -> list[int]:
    """Layers per stage (the embedding and the head are not counted)."""
    last = split[-1].stop - 1
    return [sum(1 for b in blocks if 0 < b < last) for blocks in split]


def split_of_counts(counts: Sequence[int]) -> Split:
    """The block ranges of ``counts`` layers per stage (``layer_counts``' inverse: the
    embedding on the first stage, the head on the last)."""
    return ranges_from_layer_counts(counts, 1, sum(counts) + 2)


def stage_cost(blocks: range, costs: Sequence[float]) -> float:
    return sum(costs[b] for b in blocks)


def stage_speeds(per_mb_s: Sequence[float], split: Sequence[range],
                 costs: Sequence[float]) -> list[float]:
    """Each stage's seconds per unit of block cost, from its seconds per micro-batch."""
    return [t / max(stage_cost(blocks, costs), 1e-30) for t, blocks in zip(per_mb_s, split)]


def predicted_step_s(speeds: Sequence[float], split: Sequence[range], costs: Sequence[float],
                     m: int) -> float:
    """The step of ``m`` micro-batches on ``split``: ``(m + pp - 1)`` slots of the slowest
    stage's micro-batch."""
    slowest = max(s * stage_cost(blocks, costs) for s, blocks in zip(speeds, split))
    return (m + len(split) - 1) * slowest


def best_split(speeds: Sequence[float], costs: Sequence[float]) -> Split:
    """The contiguous split whose slowest stage is fastest at ``speeds``."""
    return tuple(partition_per_stage([[s * c for c in costs] for s in speeds]))


@dataclass(frozen=True)
class SplitDecision:
    split: Split
    """The split from the next step on (the current one when nothing moves)."""
    current_s: float
    """The current split's predicted step (seconds)."""
    predicted_s: float
    """The chosen split's predicted step (seconds)."""


def decide_split(speeds: Sequence[float], current: Split, costs: Sequence[float], m: int,
                 min_saving: float = DEFAULT_MIN_SAVING) -> SplitDecision:
    """Keep ``current`` unless the best split saves at least ``min_saving`` of its step."""
    best = best_split(speeds, costs)
    now = predicted_step_s(speeds, current, costs, m)
    then = predicted_step_s(speeds, best, costs, m)
    if best != tuple(current) and then <= (1 - min_saving) * now:
        return SplitDecision(best, now, then)
    return SplitDecision(tuple(current), now, now)


@dataclass
class StageBalancer:
    """The decision state every rank keeps alike. Fed the same all-gathered seconds on every
    rank, it decides the same split on every rank."""

    split: Split
    costs: tuple[float, ...]
    """Per block: the partitioner's cost (see the module doc)."""
    microbatches: int
    every: int = DEFAULT_EVERY
    min_saving: float = DEFAULT_MIN_SAVING

    def __post_init__(self) -> None:
        self.split = tuple(self.split)
        self.history: deque = deque(maxlen=HISTORY_WINDOWS * self.every)
        """Per step: each stage's seconds per unit of cost."""
        self.since_decision = 0
        self.proposed: Optional[Split] = None
        self.last: Optional[SplitDecision] = None
        self.before: Optional[Split] = None
        """The split the last move left (a move back to it is damped)."""
        self.move_s = 0.0
        """Seconds the last move took (``moved``); 0 until one is timed."""

    def observe(self, per_mb_s: Sequence[float], decide: Optional[bool] = None,
                steps_left: Optional[int] = None) -> bool:
        """One step's seconds per micro-batch of each stage (its slowest rank's forward and
        backward); decide when ``decide`` says so (default: every ``every`` steps);
        ``steps_left``: the run's steps after this one (None: unbounded). Returns whether
        the split changed (from the next step on)."""
        self.history.append(stage_speeds(per_mb_s, self.split, self.costs))
        self.since_decision += 1
        if not (self.since_decision >= self.every if decide is None else decide):
            return False
        self.since_decision = 0
        self.last = self.decision()
        recent = self.decision(steps=self.every)
        asked = self.last.split != self.split and recent.split != self.split \
            and self._pays_back(self.last, steps_left)
        wanted = self.last.split if asked else None
        confirmed = wanted is not None and self.proposed is not None
        self.proposed = None if confirmed else wanted
        if confirmed:
            self.before, self.split = self.split, wanted
        return confirmed

    def moved(self, seconds: float) -> None:
        """The last move took ``seconds`` (the state's travel and the stages' rebuild)."""
        self.move_s = seconds

    def _pays_back(self, decision: SplitDecision, steps_left: Optional[int]) -> bool:
        """Whether the saving over the steps left wins back ``PAYBACK`` times a move."""
        if steps_left is None or not self.move_s:
            return True
        return (decision.current_s - decision.predicted_s) * steps_left >= \
            PAYBACK * self.move_s

    def speeds(self, steps: Optional[int] = None) -> list[float]:
        """Each stage's median seconds per unit of cost over the last ``steps`` kept."""
        kept = list(self.history)[-steps:] if steps else list(self.history)
        return [statistics.median(step[s] for step in kept) for s in range(len(self.split))]

    def decision(self, steps: Optional[int] = None) -> SplitDecision:
        speeds = self.speeds(steps)
        chosen = decide_split(speeds, self.split, self.costs, self.microbatches,
                              self.min_saving)
        if chosen.split == self.before and chosen.split != self.split:  # a move back
            chosen = decide_split(speeds, self.split, self.costs, self.microbatches,
                                  min(BACK_FACTOR * self.min_saving, 0.99))
        return chosen

    def stage_ms(self, split: Optional[Split] = None) -> list[float]:
        """Each stage's median ms per micro-batch over the kept steps, on ``split`` (default:
        the current one)."""
        split = self.split if split is None else split
        return [s * stage_cost(b, self.costs) * 1e3 for s, b in zip(self.speeds(), split)]


def stage_seconds(per_rank_s: Sequence[float], pp_of_rank: Sequence[int],
                  microbatches_of_rank: Sequence[int], pp: int) -> list[float]:
    """Each stage's seconds per micro-batch: its slowest rank's (every rank's seconds over the
    micro-batches its replica ran, so that ``dp_balance``'s shares do not look like speed)."""
    out = [0.0] * pp
    for rank, seconds in enumerate(per_rank_s):
        stage = pp_of_rank[rank]
        out[stage] = max(out[stage], seconds / max(microbatches_of_rank[rank], 1))
    return out


def stage_balance_problem(parallel) -> Optional[str]:
    """Why ``parallel``'s pp_balance settings cannot run (one line with the fix), else None."""
    mode = parallel.pp_balance
    if mode not in PP_BALANCE_MODES:
        return (f"parallel.pp_balance={mode!r} is unknown; choose one of "
                f"{', '.join(PP_BALANCE_MODES)}")
    every = parallel.pp_balance_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        return (f"parallel.pp_balance_every={every!r} must be an integer >= 1 (steps between "
                f"decisions; {DEFAULT_EVERY} is the default)")
    saving = parallel.pp_balance_min_saving
    if not 0 < saving < 1:
        return (f"parallel.pp_balance_min_saving={saving} must be in (0, 1) (the share of the "
                f"step a change must save; {DEFAULT_MIN_SAVING} is the default)")
    move = parallel.pp_balance_move
    if move not in PP_BALANCE_MOVES:
        return (f"parallel.pp_balance_move={move!r} is unknown; choose one of "
                f"{', '.join(PP_BALANCE_MOVES)}")
    options = DpOptions.of(parallel)
    spec = reduction_of(options)
    if mode == "dynamic" and not spec.state_by_parameter:
        return (f"parallel.pp_balance=dynamic cannot move the {spec.name} DP reduction's "
                f"state between stages ({spec.setting(options)}: it is each "
                f"gradient bucket's, and the buckets change with the split); use "
                f"parallel.pp_balance=static or another DP strategy")
    if mode == "dynamic" and parallel.vpp > 1:
        return (f"parallel.pp_balance=dynamic needs one stage per pipeline rank, not "
                f"parallel.vpp={parallel.vpp} (schedule {parallel.schedule}): a rank's "
                f"chunks are not neighbours, so layers cannot move between them; use a "
                f"schedule with vpp=1 or parallel.pp_balance=static")
    return None


def stage_balance_warnings(cfg) -> list[str]:
    """Dynamic stage balancing that can never move anything: one line."""
    if cfg.parallel.pp_balance == "dynamic" and cfg.parallel.pp == 1:
        return ["parallel.pp_balance=dynamic with parallel.pp=1: one stage has nothing to "
                "balance against; set parallel.pp > 1 or drop pp_balance"]
    return []


def check_stage_balance(cfg, layout=None) -> None:
    problem = stage_balance_problem(cfg.parallel)
    if problem:
        raise LayoutError(problem)
