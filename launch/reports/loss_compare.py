"""Do two runs train alike? The pure part of ``hybrid-compare`` (no files, no torch).

A step stays within tolerance when ``|run - base| <= max(rtol * |base|, atol)``
(pytest.approx's rule, which the layout tests use); the default is DESIGN's fp32 layout
tolerance, relative 1e-4. Beyond it, float drift is told from a real divergence by how the
difference got there: rounding differences between layouts start near fp32's epsilon and grow
by a small factor a step as training amplifies them (the main job's 2x2x2 run: 1e-7 at step 1,
1e-4 by step 17, each step within 5x the largest before it), where a real divergence (other
data, a lost gradient, a wrong resume) jumps at once. A step beyond tolerance whose relative
difference is more than ``jump`` (10) times the largest before it parts from the baseline;
one that grew there is drift. ``numerics_differences`` says whether two resolved configs must
train alike at all: they may differ in layout, micro-batch, recomputation and how the run is
launched or watched, nothing else. ``launch/commands/compare.py`` (the command) and the sweep report's
``max_loss_dev`` column both use these functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union
from hybrid.errors import UserError
from hybrid.planning.dp_config import FLAT_KEYS, SECTION

RTOL = 1e-4  # DESIGN: fp32 layouts agree to 1e-5 at step 1 and to 1e-4 over 20 steps
JUMP = 10.0
"""How many times the largest relative difference before it a step's must be to part (a
jump); float drift grows by less a step (at most 5x on the main job's 2x2x2 run)."""
Losses = Union[Sequence[float], Mapping[int, float]]
"""Loss by step: a mapping, or a sequence whose first item is step 1."""

# Settings that choose how a run is split, launched, saved or watched (evaluation reads the
# model and changes no training number), not what it computes:
# runs that differ only in these must train alike (DESIGN's layout invariance). A setting not
# named here must match, so a new one errs towards "not comparable", never a false alarm.
LAYOUT_ONLY = ("parallel.", "train.micro_batch", "model.recompute", "launcher.", "cost.",
               "checkpoint.", "train.log_every", "train.timeline_step",
               "train.collective_timeout_s", "train.straggler_ratio",
               "train.skip_memory_check", "train.overwrite", "eval.")


LOSSY_DP = ("parallel.dp_compress", "parallel.powersgd_rank", "parallel.powersgd_warmup",
            "parallel.dp_sync_every", "parallel.dp_sync_moments", "parallel.dp_delay")
"""Layout settings that change what a step computes: the lossy DP options (a sweep still
compares their cells with the 1-process run, to show how far they drift)."""


def lossy_differences(base: dict, run: dict) -> list[str]:
    """The lossy DP options in which two resolved configs differ (``parallel.dp_delay: 0 vs
    1``)."""
    a, b = (_flat({**config, "parallel": _flat_dp(config.get("parallel", {}))})
            for config in (base, run))
    return [f"{key}: {a.get(key, '(unset)')} vs {b.get(key, '(unset)')}"
            for key in LOSSY_DP if a.get(key) != b.get(key)]


def _flat_dp(parallel: dict) -> dict:
    """A resolved ``parallel`` section with the DP strategies under their flat names (as
    ``LOSSY_DP`` says them); a flat key written beside them wins, as ``ParallelConfig``
    takes it."""
    dp = parallel.get(SECTION)
    moved = _flat(dp) if isinstance(dp, dict) else {}
    return {**{flat: moved[path] for flat, path in FLAT_KEYS.items() if path in moved},
            **parallel}


def resumed_from(config: Optional[dict]) -> Optional[str]:
    """The checkpoint a run resumed from, from its resolved config (None: it started fresh)."""
    return ((config or {}).get("checkpoint") or {}).get("resume_from")


class CompareError(UserError):
    """Input that cannot be compared: a user error, reported as one line."""


@dataclass(frozen=True)
class StepDiff:
    step: int
    base: float
    run: float
    abs_diff: float
    rel_diff: float
    """``abs_diff / |base|``; inf where a loss is not finite, or the baseline's is 0 and the
    run's is not."""
    within: bool


@dataclass(frozen=True)
class LossComparison:
    steps: tuple[StepDiff, ...]
    """The steps both runs have, in order."""
    rtol: float
    atol: float
    parted_at: Optional[StepDiff]
    """The first step beyond tolerance that jumped there (its relative difference more than
    ``jump`` times the largest before it; any at the first step); None when none did."""
    drifts_from: Optional[StepDiff]
    """The first step beyond tolerance when no step jumped there: float drift."""
    largest: StepDiff
    """The (first) step of the largest relative difference."""
    base_only: tuple[int, ...]
    run_only: tuple[int, ...]

    jump: float = JUMP

    @property
    def same(self) -> bool:
        """The runs train alike: every step within tolerance, or beyond it by drift only."""
        return self.parted_at is None


def compare_losses(base: Losses, run: Losses, *, rtol: float = RTOL, atol: float = 0.0,
                   jump: float = JUMP) -> LossComparison:
    """Compare ``run``'s loss with ``base``'s at every step both have."""
    base, run = _by_step(base), _by_step(run)
    common = sorted(base.keys() & run.keys())
    if not common:
        raise CompareError(f"no step in common: the baseline has steps {span(base)}, "
                           f"the run {span(run)}")
    diffs = tuple(_step_diff(step, base[step], run[step], rtol, atol) for step in common)
    parted = first_jump(diffs, jump)
    return LossComparison(steps=diffs, rtol=rtol, atol=atol, jump=jump, parted_at=parted,
                          drifts_from=None if parted else next(
                              (d for d in diffs if not d.within), None),
                          largest=max(diffs, key=lambda d: d.rel_diff),
                          base_only=tuple(sorted(base.keys() - run.keys())),
                          run_only=tuple(sorted(run.keys() - base.keys())))


def first_jump(diffs: Sequence[StepDiff], jump: float) -> Optional[StepDiff]:
    """The first step beyond tolerance whose relative difference is more than ``jump`` times
    the largest before it (the first compared step has nothing before it: any excess is a
    jump); None when every excess grew there."""
    before = 0.0
    for d in diffs:
        if not d.within and not d.rel_diff <= jump * before:  # a NaN difference jumps
            return d
        before = max(before, d.rel_diff)
    return None


def _by_step(losses: Losses) -> dict[int, float]:
    return dict(losses) if isinstance(losses, Mapping) else dict(enumerate(losses, 1))


def span(losses: Mapping[int, float]) -> str:
    """``1-10``: the first and last step."""
    return f"{min(losses)}-{max(losses)}" if losses else "(none)"


def _step_diff(step: int, base: float, run: float, rtol: float, atol: float) -> StepDiff:
    diff = abs(run - base)
    if not (math.isfinite(base) and math.isfinite(run)):
        rel = math.inf
    else:
        rel = diff / abs(base) if base else (0.0 if diff == 0 else math.inf)
    # written so that a NaN difference is never within tolerance
    return StepDiff(step, base, run, diff, rel, within=diff <= max(rtol * abs(base), atol))


def tolerance_line(rtol: float, atol: float, jump: float) -> str:
    """What the comparison counts as alike, with the options that set it."""
    within = f"relative {rtol:g}" if atol == 0 else f"max(rtol {rtol:g} x |loss|, atol {atol:g})"
    return (f"tolerance: a step is alike within {within} of the baseline (--rtol, --atol); "
            f"beyond it, a relative difference over {jump:g}x the largest before it is a "
            f"divergence (--jump), one that grew there is float drift")


def summary_line(name: str, base_name: str, c: LossComparison) -> str:
    if c.drifts_from is not None:
        d = c.drifts_from
        return (f"{name}: drifts from {base_name} beyond tolerance from step {d.step} "
                f"(relative difference {d.rel_diff:.3g}, grown there a step at a time, at most "
                f"{c.jump:g}x the largest before: float drift, not a divergence; largest "
                f"{c.largest.rel_diff:.3g} at step {c.largest.step})")
    if c.same:
        return (f"{name}: same as {base_name} over {len(c.steps)} steps (largest relative "
                f"difference {c.largest.rel_diff:.3g} at step {c.largest.step})")
    p = c.parted_at
    excess = (f"relative difference {p.rel_diff:.3g} > rtol {c.rtol:g}" if c.atol == 0 else
              f"difference {p.abs_diff:.3g} > max(rtol {c.rtol:g} x {abs(p.base):.4g}, "
              f"atol {c.atol:g})")
    return (f"{name}: parts from {base_name} at step {p.step} (loss {p.base:.9g} vs "
            f"{p.run:.9g}, {excess})")


def numerics_differences(base: dict, run: dict) -> list[str]:
    """The settings of two resolved configs that differ and change what a run computes
    (``seed: 7 vs 8``); empty when the runs must train alike."""
    a, b = _flat(base), _flat(run)
    return [f"{key}: {a.get(key, '(unset)')} vs {b.get(key, '(unset)')}"
            for key in sorted(a.keys() | b.keys())
            if not key.startswith(LAYOUT_ONLY) and a.get(key) != b.get(key)]


def _flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def is_single_process(config: dict) -> bool:
    parallel = config.get("parallel", {})
    return parallel.get("dp") == parallel.get("tp") == parallel.get("pp") == 1


@dataclass(frozen=True)
class Run:
    name: str
    losses: dict[int, float]
    config: Optional[dict]
    """The resolved ``config.json`` beside the metrics; None where there is none."""


def deviations_from_reference(runs: Sequence[Optional[Run]]) -> list[Optional[tuple]]:
    """For each run, (index of its reference, largest relative loss difference from it): the
    reference is the first 1-process run whose config computes the same (a sweep may vary the
    seed or the model too). None where there is no run, no reference or no common step."""
    singles = [i for i, r in enumerate(runs) if r and r.config and is_single_process(r.config)]
    out = []
    for run in runs:
        ref = next((i for i in singles if run and run.config
                    and not numerics_differences(runs[i].config, run.config)), None)
        try:
            out.append(None if ref is None else
                       (ref, compare_losses(runs[ref].losses, run.losses).largest.rel_diff))
        except CompareError:
            out.append(None)
    return out


