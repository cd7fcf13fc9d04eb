"""Shares of a step's micro-batches per data-parallel replica, from their measured speed (pure).

``parallel.dp_balance=dynamic`` (issue 40): every ``parallel.dp_balance_every`` steps the
ranks decide, from the same all-gathered measurements, how many of the step's ``M``
micro-batches each DP replica runs. The global batch is unchanged (replica ``r`` runs the
``r``-th contiguous run of ``shares[r]`` micro-batches); only who computes what moves.

The model of a replica's step: ``fixed_r + u_r * (m_r + bubble)`` seconds. ``u_r`` is its
seconds per micro-batch: the pipeline part of its slowest rank's compute in a step (the
forward and backward, waits excluded) divided by the micro-batches it ran; ``fixed_r`` the
rest of that rank's compute, what a step costs whatever its share (the optimizer, the gradient
reduction's own work, the schedule's set-up); ``bubble`` the pipeline's fill and drain in
micro-batches (``(pp - 1) / vpp``). Both are measured in the same step, so a disturbance that
slows a replica slows both alike. Counting the fixed part per micro-batch, as a first version
did, made a replica that gave up micro-batches look slower per micro-batch each window, so a
half-speed replica was pushed from 8/4 of 12 micro-batches on to 9/3 and 10/2. Priced apart,
a replica's seconds per micro-batch do not depend on its share, so the estimate spans the
last ``HISTORY_WINDOWS`` decision windows, across changes of the shares: on a shared machine a
replica's compute moves by half from one step to the next, and one window's median was
enough to send a half-speed replica's micro-batches back to it. (A line fitted through the
counts a replica ran was tried too: one disturbed window made a replica's extra micro-batches
look nearly free.) The step ends when the slowest replica does, so the shares that minimise
the largest predicted time are found greedily: every replica starts at the least the schedule needs, and each further
unit goes to the replica that would finish it soonest.

Hysteresis: new shares are taken only when they are predicted to save at least
``min_saving`` of the current shares' predicted step, and when two decisions in a row ask
for a change. Scheduling noise on a shared machine moves a replica's time by some percent; with micro-batches as the unit, a move must save a
whole micro-batch of the slowest replica, so an undisturbed run keeps even shares.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from hybrid.planning.layout import LayoutError
from hybrid.planning.schedules.gathers import AFTER_STEP

BALANCE_MODES = ("even", "dynamic")
DEFAULT_EVERY = 5
DEFAULT_MIN_SAVING = 0.1
CHECKPOINT_KEY = "train.dp_shares"
"""The shares' tensor in a checkpoint (int64, one count per replica)."""
BALANCED_RESHARD = AFTER_STEP
"""The ZeRO-3 release policy dynamic shares run with: the weights gathered once a step, so a
replica's share does not change how many gathers it issues (``after_forward`` gathers per
micro-batch)."""


@dataclass(frozen=True)
class BalanceDecision:
    shares: tuple[int, ...]
    """Micro-batches per replica from the next step on."""
    current_s: float
    """The current shares' predicted step (seconds)."""
    predicted_s: float
    """The best shares' predicted step (seconds)."""

    @property
    def saving(self) -> float:
        """The share of the current step the best shares would save."""
        return 1 - self.predicted_s / self.current_s if self.current_s > 0 else 0.0


def even_shares(total: int, replicas: int) -> tuple[int, ...]:
    """``total`` micro-batches over ``replicas`` (the even layout: ``total % replicas == 0``)."""
    if replicas < 1 or total % replicas:
        raise ValueError(f"{total} micro-batches do not split evenly over {replicas} replicas")
    return (total // replicas,) * replicas


Offset = Union[float, Sequence[float]]
"""The pipeline's fill and drain in micro-batches of a replica's own (one number for all
replicas, or one each)."""


def _per_replica(value: Offset, replicas: int) -> list[float]:
    return [float(value)] * replicas if isinstance(value, (int, float)) else list(value)


def _finish_s(u: float, m: float, bubble: float, fixed: float) -> float:
    return fixed + u * (m + bubble)


def predicted_step_s(per_mb_s: Sequence[float], shares: Sequence[int],
                     bubble: Offset = 0.0, fixed_s: Offset = 0.0) -> float:
    """The step's predicted seconds: the slowest replica's ``fixed_r + u_r * (m_r +
    bubble_r)``."""
    n = len(shares)
    return max(map(_finish_s, per_mb_s, shares, _per_replica(bubble, n),
                   _per_replica(fixed_s, n)))


def best_shares(per_mb_s: Sequence[float], total: int, *, unit: int = 1,
                bubble: Offset = 0.0, fixed_s: Offset = 0.0) -> tuple[int, ...]:
    """Shares of ``total`` micro-batches (in steps of ``unit``, each at least ``unit``) that
    minimise the predicted step; ties go to the lower replica index (the same on every rank)."""
    replicas = len(per_mb_s)
    if total % unit or total // unit < replicas:
        raise ValueError(f"{total} micro-batches cannot give {replicas} replicas {unit} each")
    bubbles, fixed = _per_replica(bubble, replicas), _per_replica(fixed_s, replicas)
    shares = [unit] * replicas
    for _ in range(total // unit - replicas):
        finish = [_finish_s(u, m + unit, b, f)
                  for u, m, b, f in zip(per_mb_s, shares, bubbles, fixed)]
        shares[finish.index(min(finish))] += unit
    return tuple(shares)


def decide_shares(per_mb_s: Sequence[float], current: Sequence[int], *, unit: int = 1,
                  bubble: Offset = 0.0, fixed_s: Offset = 0.0,
                  min_saving: float = DEFAULT_MIN_SAVING) -> BalanceDecision:
    """Keep ``current`` unless the best shares save at least ``min_saving`` of its predicted
    step (the hysteresis of the module doc)."""
    best = best_shares(per_mb_s, sum(current), unit=unit, bubble=bubble, fixed_s=fixed_s)
    now = predicted_step_s(per_mb_s, current, bubble, fixed_s)
    then = predicted_step_s(per_mb_s, best, bubble, fixed_s)
    if then <= (1 - min_saving) * now:
        return BalanceDecision(best, now, then)
    return BalanceDecision(tuple(current), now, now)


def window_medians(replica_s: Sequence[Sequence[float]]) -> list[float]:
    """Each replica's seconds over a window: ``replica_s[step][r]`` is replica ``r``'s in
    that step; the median over the window, so that one disturbed step does not move the
    shares."""
    replicas = len(replica_s[0])
    return [statistics.median(step[r] for step in replica_s) for r in range(replicas)]


def replica_compute(compute_s: Sequence[float], dp_of_rank: Sequence[int],
                    replicas: int) -> list[float]:
    """The slowest compute (seconds) among each replica's ranks, from every rank's."""
    out = [0.0] * replicas
    for rank, seconds in enumerate(compute_s):
        out[dp_of_rank[rank]] = max(out[dp_of_rank[rank]], seconds)
    return out


def replica_split(compute_s: Sequence[float], pipeline_s: Sequence[float],
                  dp_of_rank: Sequence[int], replicas: int) -> tuple[list[float], list[float]]:
    """Per replica, its slowest rank's compute split into (pipeline part, fixed rest), from
    every rank's compute and the pipeline part of it (the forward and backward, waits
    excluded)."""
    slowest: list[Optional[int]] = [None] * replicas
    for rank, seconds in enumerate(compute_s):
        r = dp_of_rank[rank]
        if slowest[r] is None or seconds > compute_s[slowest[r]]:
            slowest[r] = rank
    pipeline = [min(pipeline_s[k], compute_s[k]) if k is not None else 0.0 for k in slowest]
    fixed = [compute_s[k] - p if k is not None else 0.0 for k, p in zip(slowest, pipeline)]
    return pipeline, fixed


HISTORY_WINDOWS = 3
"""Decision windows the speeds are estimated over (see the module doc)."""


@dataclass
class Balancer:
    """The decision state every rank keeps alike: the shares and the recent steps' seconds.
    Fed the same all-gathered times on every rank, it decides the same on every rank."""

    shares: tuple[int, ...]
    every: int
    unit: int = 1
    bubble: float = 0.0
    min_saving: float = DEFAULT_MIN_SAVING

    def __post_init__(self) -> None:
        self.history: deque = deque(maxlen=HISTORY_WINDOWS * self.every)
        """Per step: (seconds per micro-batch, fixed seconds), per replica."""
        self.since_decision = 0
        self.last: Optional[BalanceDecision] = None
        self.proposed: Optional[tuple[int, ...]] = None
        """The shares the last decision asked for, if it asked for a change (``observe``)."""

    def observe(self, pipeline_s: Sequence[float], decide: Optional[bool] = None,
                fixed_s: Optional[Sequence[float]] = None) -> bool:
        """One step's per-replica seconds: the pipeline part (the micro-batches' forward and
        backward, at the current shares) and the fixed rest (none: all of it is per
        micro-batch); then decide when ``decide`` says so (default: every ``every`` steps).
        A decision asks for a change when the steps kept and the last window alone both do;
        new shares are taken when two decisions in a row ask (a burst of scheduling noise
        passes, a slow replica stays): the kept steps' choice. Returns whether the shares
        changed (from the next step on)."""
        per_mb = [seconds / m for seconds, m in zip(pipeline_s, self.shares)]
        self.history.append((per_mb, list(fixed_s or [0.0] * len(pipeline_s))))
        self.since_decision += 1
        if not (self.since_decision >= self.every if decide is None else decide):
            return False
        self.since_decision = 0
        self.last = self.decision()
        recent = self.decision(steps=self.every)
        asked = self.shares not in (self.last.shares, recent.shares)
        wanted = self.last.shares if asked else None
        confirmed = wanted is not None and self.proposed is not None
        self.proposed = None if confirmed else wanted
        if confirmed:
            self.shares = wanted
        return confirmed

    def decision(self, steps: Optional[int] = None) -> BalanceDecision:
        """What the last ``steps`` steps (default: all those kept) ask for: each replica's
        median seconds per micro-batch and median fixed seconds over them
        (``decide_shares``)."""
        kept = list(self.history)[-steps:] if steps else list(self.history)
        per_mb = window_medians([u for u, _ in kept])
        fixed = window_medians([f for _, f in kept])
        return decide_shares(per_mb, self.shares, unit=self.unit, bubble=self.bubble,
                             fixed_s=fixed, min_saving=self.min_saving)

    def restore(self, shares: Sequence[int]) -> bool:
        """Shares read back from a checkpoint, if they fit this run (as many replicas, the
        same micro-batches, multiples of the unit); the window starts afresh."""
        fits = len(shares) == len(self.shares) and sum(shares) == sum(self.shares) and \
            all(s >= self.unit and s % self.unit == 0 for s in shares)
        if fits:
            self.shares, self.proposed = tuple(int(s) for s in shares), None
            self.history.clear()
            self.since_decision = 0
        return fits


def pipeline_bubble(pp: int, vpp: int) -> float:
    """Fill and drain of a pipeline in micro-batches of one rank's compute."""
    return (pp - 1) / vpp


def share_unit(schedule: str, pp: int) -> int:
    """What a replica's micro-batch count must be a multiple of under ``schedule``."""
    from hybrid.planning.schedules import schedule_spec

    return pp if schedule_spec(schedule).microbatches_multiple_of_pp else 1


def balance_problem(parallel) -> Optional[str]:
    """Why ``parallel``'s dp_balance settings cannot run (one line with the fix), else None."""
    mode = parallel.dp_balance
    if mode not in BALANCE_MODES:
        return f"parallel.dp_balance={mode!r} is unknown; choose one of {', '.join(BALANCE_MODES)}"
    every = parallel.dp_balance_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        return (f"parallel.dp_balance_every={every!r} must be an integer >= 1 (steps between "
                f"decisions; {DEFAULT_EVERY} is the default)")
    saving = parallel.dp_balance_min_saving
    if not 0 < saving < 1:
        return (f"parallel.dp_balance_min_saving={saving} must be in (0, 1) (the share of the "
                f"step a change must save; {DEFAULT_MIN_SAVING} is the default)")
    if mode == "even":
        return None
    equal_shares_assumed = {"parallel.dp_sync_every": parallel.dp_sync_every != 1,
                            "parallel.dp_compress": parallel.dp_compress == "powersgd",
                            "parallel.dp_delay": parallel.dp_delay != 0}
    for field, used in equal_shares_assumed.items():
        if used:
            value = getattr(parallel, field.split(".")[1])
            return (f"parallel.dp_balance=dynamic cannot run with {field}={value}: its maths "
                    f"assume equal shares per replica; use parallel.dp_balance=even or the "
                    f"default {field}")
    if parallel.zero >= 2 and parallel.pp > 1:
        # seen on dp2 x pp2 1F1B at shares 7/1 (a hang): the small replica's last stage waited
        # in its rounds of zeros for the other replica's last stage, which waited for its
        # first stage's activations, which waited in a reduce-scatter for the small replica's
        # first stage, which waited for the backward its last stage had not sent yet
        return (f"parallel.dp_balance=dynamic with parallel.zero={parallel.zero} needs "
                f"parallel.pp=1: a replica with fewer micro-batches matches the others' "
                f"per-micro-batch reduce-scatters inside its backward, where the other "
                f"replicas' stages can wait on its own pipeline; use parallel.zero=1 with "
                f"pipelines")
    if parallel.zero == 3 and parallel.zero3_reshard != BALANCED_RESHARD:
        return (f"parallel.dp_balance=dynamic with parallel.zero=3 needs "
                f"parallel.zero3_reshard={BALANCED_RESHARD}: with {parallel.zero3_reshard} "
                f"each micro-batch gathers the weights over DP, so unequal shares would issue "
                f"unequal gathers; set parallel.zero3_reshard={BALANCED_RESHARD}")
    return None


def balance_warnings(cfg) -> list[str]:
    """Dynamic balancing that can never move anything: one line each."""
    parallel = cfg.parallel
    if parallel.dp_balance != "dynamic":
        return []
    if parallel.dp == 1:
        return ["parallel.dp_balance=dynamic with parallel.dp=1: one replica has nothing to "
                "balance against; set parallel.dp > 1 or drop dp_balance"]
    microbatches = cfg.train.global_batch // cfg.train.micro_batch
    if microbatches // share_unit(parallel.schedule, parallel.pp) <= parallel.dp:
        return [f"parallel.dp_balance=dynamic with {microbatches} micro-batches per step over "
                f"parallel.dp={parallel.dp} replicas: no replica can give one up; raise "
                f"train.global_batch or lower train.micro_batch"]
    return []


def replica_speed_problem(speeds: Optional[Sequence[float]], dp: int) -> Optional[str]:
    """Why ``cost.replica_speed`` cannot be priced on ``dp`` replicas (one line), else None."""
    if speeds is None:
        return None
    values = list(speeds)
    if len(values) != dp:
        return (f"cost.replica_speed={values} names {len(values)} replicas but parallel.dp="
                f"{dp}; give one speed per DP replica (1 = the device's)")
    if not all(isinstance(s, (int, float)) and math.isfinite(s) and s > 0 for s in values):
        return f"cost.replica_speed={values} must be finite numbers > 0 (1 = the device's)"
    return None


def check_balance(parallel) -> None:
    problem = balance_problem(parallel)
    if problem:
        raise LayoutError(problem)
