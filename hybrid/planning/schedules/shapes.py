"""A schedule's shape with unit costs (F=1, B=2, I=W=1): its bubble and peak activations,
simulated or in closed form (pure; no torch)."""

from __future__ import annotations

import functools

from hybrid.planning.schedules.check import check_schedule
from hybrid.planning.schedules.registry import build_schedule, schedule_spec
from hybrid.planning.schedules.simulate import Costs, SimResult, simulate


@functools.lru_cache(maxsize=64)
def checked_schedule(schedule: str, pp: int, m: int, vpp: int) -> tuple:
    """The schedule's action lists, built and checked once per shape (the unit-cost
    simulation and every pricing of a layout of that shape replay the same lists)."""
    lists = build_schedule(schedule, pp, m, vpp=vpp)
    check_schedule(lists, pp, m, vpp, schedule_spec(schedule).placement)
    return tuple(tuple(actions) for actions in lists)


@functools.lru_cache(maxsize=64)
def simulate_unit_costs(schedule: str, pp: int, m: int, vpp: int) -> SimResult:
    """The schedule simulated with unit costs (no p2p time); one simulation per schedule
    shape, since the memory check's candidate layouts share most."""
    lists = [list(actions) for actions in checked_schedule(schedule, pp, m, vpp)]
    return simulate(lists, pp, m, vpp=vpp, costs=Costs(),
                    placement=schedule_spec(schedule).placement, checked=True)


@functools.lru_cache(maxsize=64)
def schedule_steps(schedule: str, pp: int, m: int, vpp: int) -> tuple:
    """The schedule's lists with its composite actions whole (``ScheduleSpec.steps``), once
    per shape; () for a schedule without composites."""
    steps = schedule_spec(schedule).steps
    return () if steps is None else tuple(tuple(actions) for actions in steps(pp, m, vpp))


def closed_form_schedule(schedule: str, pp: int, m: int, vpp: int) -> tuple[float, tuple]:
    """(bubble fraction, peak in-flight micro-batches per rank) with unit costs, without
    simulating: the spec's closed forms (``tests/test_simulate.py`` checks them against the
    simulation), for searching thousands of layouts whose simulations would take seconds."""
    return schedule_spec(schedule).closed_form(pp, m, vpp)
