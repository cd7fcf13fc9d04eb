"""The DP strategy registries (pure; no torch): one spec per way of sharding the DP state (the
ZeRO stage, ``parallel.zero``) and one per way of combining the replicas' gradients (the
reduction: exact, or a lossy option chosen by ``parallel.dp_compress``, ``dp_sync_every`` or
``dp_delay``).

A spec keeps together everything hybrid knows of its strategy, so that nothing branches on an
option's name: which runtime class runs it (``runtime``: a dotted name that ``hybrid.dp``
imports, or the class itself), the settings it accepts and the strategies it combines with
(``validate`` words the refusals), the bytes one rank sends per step (checked against what
the run counts), their time and what of it the backward hides, the bytes it keeps between
steps (checked against what the run holds), and what of it a checkpoint carries.

A new strategy is one spec (registered here) and its runtime class (``hybrid.dp``);
``tests/test_extension_points.py`` registers a reduction from a test file and trains with it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from hybrid.planning.strategies.base import DpOptions, ReductionSpec, ShardingSpec


SHARDINGS: dict[int, ShardingSpec] = {}
REDUCTIONS: dict[str, ReductionSpec] = {}


def register_sharding(spec: ShardingSpec) -> ShardingSpec:
    SHARDINGS[spec.stage] = spec
    return spec


def register_reduction(spec: ReductionSpec) -> ReductionSpec:
    REDUCTIONS[spec.name] = spec
    return spec


def sharding_of(options: DpOptions) -> ShardingSpec:
    return SHARDINGS[options.zero]


def selected(options: DpOptions) -> list[tuple[str, ReductionSpec]]:
    """(setting, reduction) of every lossy reduction the options select."""
    return [(setting, spec) for spec in REDUCTIONS.values()
            if (setting := spec.setting(options)) is not None]


def reduction_of(options: DpOptions) -> ReductionSpec:
    """The reduction the options select (the exact one when none does)."""
    chosen = selected(options)
    if chosen:
        return chosen[0][1]
    return next(spec for spec in REDUCTIONS.values() if spec.exact)


def compress_names() -> list[str]:
    """``parallel.dp_compress``'s choices: none and every reduction selected by a name."""
    return ["none"] + [spec.name for spec in REDUCTIONS.values()
                       if spec.setting(replace(DpOptions(), compress=spec.name)) is not None]


def option_problem(options: DpOptions, dp: int) -> Optional[str]:
    """The one-line problem with a combination of DP options, or None."""
    if options.zero not in SHARDINGS:
        return (f"parallel.zero={options.zero} is unknown; choose one of "
                f"{', '.join(map(str, SHARDINGS))}")
    if options.compress != "none" and options.compress not in compress_names():  # (cheap first)
        return (f"parallel.dp_compress={options.compress!r} is unknown; choose one of "
                f"{', '.join(compress_names())}")
    for spec in REDUCTIONS.values():
        problem = spec.field_problem(options)
        if problem:
            return problem
    chosen = selected(options)
    if chosen and dp == 1:
        return (f"parallel.{chosen[0][0]} changes how DP replicas combine, and parallel.dp=1 "
                f"has one replica: set parallel.dp > 1 or drop it")
    if len(chosen) > 1:
        return f"parallel.{chosen[0][0]} and parallel.{chosen[1][0]} do not combine; choose one"
    if not chosen:
        return None
    (setting, spec), stage = chosen[0], options.zero
    if stage not in spec.shardings:
        # name only the stages this reduction runs on: a stage another lossy reduction runs
        # on would be refused in turn
        runs_on = " or ".join(f"parallel.zero={s}" for s in sorted(spec.shardings, reverse=True))
        if _exact_only(stage):
            return (f"parallel.zero={stage} runs with exact reduction only, not "
                    f"parallel.{setting}; use {runs_on}, or drop parallel.{setting}")
        if max(spec.shardings) == 0:
            return f"parallel.{setting} needs unsharded optimizer state: set {runs_on}"
        return (f"parallel.{setting} runs with parallel.zero <= {max(spec.shardings)}: set "
                f"{runs_on}")
    return spec.problem(options, dp)


def _exact_only(stage: int) -> bool:
    return all(spec.exact for spec in REDUCTIONS.values() if stage in spec.shardings)
