"""The schedule registry: one ``ScheduleSpec`` per pipeline schedule (pure; no torch).

A spec holds everything the rest of hybrid needs to know about a schedule, so that nothing
branches on a schedule's name: how it builds its per-rank action lists, where it places its
stages, how many chunks per rank it runs and what else it requires of the layout and the batch
(``validate`` words the refusals from these fields), its unit-cost bubble and peak activations
in closed form (searches of thousands of layouts), its warm-up cost for the step-time model,
how many micro-batches the last stage holds at once, and which chunk counts the layout search
tries. The simulator, the checker and the runtime need nothing more: they run any action list.

A new schedule is one module that builds its lists and calls ``register_schedule`` with its
spec (``gpipe.py`` is the shortest); ``tests/test_extension_points.py`` registers one from a
test file and trains with it. ``parallel.schedule`` accepts every registered name.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

from hybrid.planning.schedules.actions import (
    BACKWARD_INPUT, Action, ScheduleError,
)
from hybrid.planning.schedules.stage_map import LOOP, STAGE_RULES

ONE, TWO_OR_MORE, TWO = "one", "two or more", "two"
"""How many virtual chunks per pipeline rank a schedule runs (``ScheduleSpec.chunks``)."""
Builder = Callable[[int, int, int], list[list[Action]]]


def _one_microbatch_held(m: int) -> int:
    return 1


@dataclass(frozen=True)
class ScheduleSpec:
    """What hybrid knows of one schedule (see the module doc)."""

    name: str
    build: Builder
    """``build(pp, m, vpp)``: compute-only action lists (F/B/I/W), one per pipeline rank."""
    closed_form: Callable[[int, int, int], tuple[float, tuple[int, ...]]]
    """``(pp, m, vpp)`` -> (bubble fraction, peak in-flight micro-batches per rank) with unit
    costs F=1, B=2, I=W=1, equal to the simulation's (``tests/test_simulate.py``)."""
    warmup_step: Callable[[float, float, int], float]
    """``(forward, backward, vpp)`` of the slowest stage -> the time one warm-up step of the
    pipeline leaves idle (the step-time model's closed-form bubble is ``(pp - 1)`` of them)."""
    chunks: str = ONE
    """``ONE``, ``TWO_OR_MORE`` or ``TWO`` virtual chunks per rank (``parallel.vpp``)."""
    instead: str = "1f1b"
    """The schedule a refusal suggests instead."""
    placement: Placement = LOOP
    """Its stage map's name (``stage_map.STAGE_RULES``): ``loop``, ``v`` (ZB-V, DualPipeV),
    or a shape its module registers with ``register_stage_rule`` before its spec."""
    min_pp: int = 1
    microbatches_multiple_of_pp: bool = False
    min_microbatches_per_pp: int = 0
    """Micro-batches per step must be at least this many times ``pp`` (DualPipeV: 2, one
    per stage, as torch's ``ScheduleDualPipeV`` requires)."""
    tag_matched: bool = False
    """Its lists post a pair's messages out of order, so they must be matched by tag: gloo
    does, NCCL does not (``p2p.fifo_mismatches``)."""
    last_stage_holds: Callable[[int], int] = _one_microbatch_held
    """``m`` -> micro-batches whose head activations the last stage holds at once."""
    steps: Optional[Builder] = None
    """``steps(pp, m, vpp)``: the lists with the schedule's composite actions whole (what a
    two-stream runtime runs and the cost model prices as overlapped on a GPU); None: its
    ``build`` lists have none."""
    pairs: Optional[Callable[[int, int, int], list]] = None
    """``pairs(pp, m, vpp)``: per rank, (forward stage, backward stage, count) of the F+B
    composites of ``steps``, counted without building them (the search prices hundreds of
    shapes); None: counted from ``steps``."""
    search_vpps: tuple[int, ...] = ()
    """Chunk counts the layout search tries with this schedule (none: it is not searched)."""
    doc: str = ""
    """One line for ``docs/pipeline.md`` and the config reference."""

    def __post_init__(self) -> None:
        if self.chunks not in (ONE, TWO_OR_MORE, TWO) or self.placement not in STAGE_RULES:
            raise ScheduleError(f"schedule {self.name!r}: chunks={self.chunks!r} or "
                                f"placement={self.placement!r} is not a known kind")


SCHEDULES: dict[str, ScheduleSpec] = {}
"""Every registered schedule, by name, in registration order."""


def register_schedule(spec: ScheduleSpec) -> ScheduleSpec:
    """Make ``spec`` known by its name (a second registration of a name replaces the first:
    a module imported twice, in a test, registers the same spec again)."""
    SCHEDULES[spec.name] = spec
    return spec


def schedule_names() -> tuple[str, ...]:
    return tuple(SCHEDULES)


def schedule_spec(name: str) -> ScheduleSpec:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ScheduleError(f"unknown schedule {name!r}; use one of "
                            f"{', '.join(SCHEDULES)}") from None


def schedule_placement(name: str) -> str:
    """The name of schedule ``name``'s stage map (``stage_map.STAGE_RULES``)."""
    return schedule_spec(name).placement


def schedule_splits_backward(name: str) -> bool:
    """Whether schedule ``name`` splits backwards into input (I) and weight (W) gradients,
    as its lists at the smallest shape it runs show (the cost model's bound needs to know)."""
    return _splits_backward(schedule_spec(name))


@functools.lru_cache(maxsize=None)
def _splits_backward(spec: ScheduleSpec) -> bool:
    vpp = 1 if spec.chunks == ONE else 2
    pp = max(2, spec.min_pp)
    return any(action.kind == BACKWARD_INPUT for actions in spec.build(pp, pp, vpp)
               for action in actions)


def build_schedule(name: str, pp: int, m: int, vpp: int = 1) -> list[list[Action]]:
    """Compute-only action lists (one per pipeline rank) of schedule ``name``: ``pp``
    pipeline ranks, ``m`` micro-batches, ``vpp`` virtual chunks per rank. Stage ``s`` runs
    on rank ``stage_rank(s, pp, schedule_placement(name))``."""
    spec = schedule_spec(name)
    for field, value in (("pp", pp), ("micro-batches", m), ("vpp", vpp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} needs {field} to be an integer >= 1, got {value!r}")
    problem = _chunk_problem(spec, vpp, prefix="", field="vpp")
    if problem is None and spec.microbatches_multiple_of_pp and m % pp:
        problem = (f"{name} needs micro-batches ({m}) to be a multiple of pp ({pp}); use "
                   f"{m + (-m) % pp} micro-batches or another schedule")
    if problem is None and m < spec.min_microbatches_per_pp * pp:
        problem = (f"{name} needs at least {spec.min_microbatches_per_pp * pp} micro-batches "
                   f"({spec.min_microbatches_per_pp} x pp={pp}), got {m}; use more "
                   f"micro-batches or another schedule")
    if problem is not None:
        raise ScheduleError(problem)
    return spec.build(pp, m, vpp)


def _multi_chunk_names() -> list[str]:
    return [name for name, spec in SCHEDULES.items() if spec.chunks != ONE]


def _chunk_problem(spec: ScheduleSpec, vpp: int, *, prefix: str, field: str) -> Optional[str]:
    """The refusal of ``vpp`` chunks per rank for ``spec``, as a builder (``prefix=""``) or
    the config (``prefix="parallel."``) words it."""
    name = f"{prefix}schedule={spec.name}" if prefix else spec.name
    if spec.chunks == TWO_OR_MORE and vpp < 2:
        return (f"{name} needs {prefix}{field} >= 2 virtual chunks per rank (got {vpp}); set "
                f"{prefix}{field}=2 or use schedule={spec.instead}")
    if spec.chunks == TWO and vpp != 2:
        return (f"{name} runs exactly 2 chunks per rank, got {prefix}{field}={vpp}; set "
                f"{prefix}{field}=2 or use schedule={spec.instead}")
    if spec.chunks == ONE and vpp != 1:
        if prefix:
            return (f"{prefix}{field}={vpp} needs {prefix}schedule="
                    f"{' or '.join(_multi_chunk_names())} (got {spec.name}); set the schedule "
                    f"or {prefix}{field}=1")
        return (f"{spec.name} runs one chunk per rank, got {field}={vpp}; set {field}=1 or use "
                f"{_multi_chunk_names()[0]}")
    return None


def layout_problem(name: str, *, pp: int, vpp: int, device: str) -> Optional[str]:
    """Why ``parallel.schedule=name`` cannot run ``pp`` ranks of ``vpp`` chunks on
    ``train.device=device``, in one line with the fix; None when it can."""
    spec = schedule_spec(name)
    if spec.tag_matched and device == "cuda":
        return (f"parallel.schedule={name} runs on train.device=cpu only (got {device}): its "
                f"messages are matched by tag; use schedule={spec.instead} on {device}")
    problem = _chunk_problem(spec, vpp, prefix="parallel.", field="vpp")
    if problem is None and pp < spec.min_pp:
        problem = (f"parallel.schedule={name} needs parallel.pp >= {spec.min_pp}; use "
                   f"schedule={spec.instead} for pp={pp}")
    return problem


def batch_problem(name: str, *, pp: int, m: int, how: str) -> Optional[str]:
    """Why ``m`` micro-batches per step (``how``: the arithmetic that gives them) cannot run
    schedule ``name`` on ``pp`` ranks; None when they can."""
    spec = schedule_spec(name)
    if spec.microbatches_multiple_of_pp and m % pp:
        return (f"parallel.schedule={name} needs micro-batches per step ({m} = {how}) to be a "
                f"multiple of parallel.pp={pp}; change global_batch or micro_batch")
    if m < spec.min_microbatches_per_pp * pp:
        return (f"parallel.schedule={name} needs at least {spec.min_microbatches_per_pp * pp} "
                f"micro-batches per step ({spec.min_microbatches_per_pp} x parallel.pp={pp}), "
                f"got {m} = {how}; raise global_batch or lower micro_batch")
    return None
