"""A schedule's shape with unit costs (F=1, B=2, I=W=1): its bubble and peak activations,
simulated or in closed form (pure; no torch)."""

from __future__ import annotations

import functools

from hybrid.planning.schedules.registry import build_schedule, schedule_spec
from hybrid.planning.schedules.simulate import Costs, SimResult, simulate


@functools.lru_cache(maxsize=64)
def simulate_unit_costs(schedule: str, pp: int, m: int, vpp: int) -> SimResult:
    """The schedule simulated with unit costs (no p2p time); one simulation per schedule
    shape, since the memory check's candidate layouts share most."""
    return simulate(build_schedule(schedule, pp, m, vpp=vpp), pp, m, vpp=vpp, costs=Costs(),
                    placement=schedule_spec(schedule).placement)


def closed_form_schedule(schedule: str, pp: int, m: int, vpp: int) -> tuple[float, tuple]:
    """(bubble fraction, peak in-flight micro-batches per rank) with unit costs, without
    simulating: the spec's closed forms (``tests/test_simulate.py`` checks them against the
    simulation), for searching thousands of layouts whose simulations would take seconds."""
    return schedule_spec(schedule).closed_form(pp, m, vpp)
