"""GPipe (Huang et al. 2019): every forward, then every backward. The shortest schedule
module, and the pattern for a new one: a builder of per-rank action lists and its spec."""

from __future__ import annotations

from hybrid.planning.schedules.actions import BACKWARD, FORWARD, Action
from hybrid.planning.schedules.registry import ScheduleSpec, register_schedule


def _gpipe_rank(rank: int, m: int) -> list[Action]:
    """All forwards, then all backwards (in micro-batch order, as torch's ScheduleGPipe)."""
    return ([Action(rank, FORWARD, mb) for mb in range(m)]
            + [Action(rank, BACKWARD, mb) for mb in range(m)])


def _lists(pp: int, m: int, vpp: int) -> list[list[Action]]:
    return [_gpipe_rank(rank, m) for rank in range(pp)]


def _closed_form(pp: int, m: int, vpp: int) -> tuple[float, tuple[int, ...]]:
    return (pp - 1) / (m * vpp + pp - 1), tuple([m] * pp)  # every micro-batch held at once


GPIPE = register_schedule(ScheduleSpec(
    name="gpipe", build=_lists, closed_form=_closed_form,
    warmup_step=lambda forward, backward, vpp: (forward + backward) / vpp,
    last_stage_holds=lambda m: m,  # every forward runs before the first backward
    doc="all forwards, then all backwards: 1F1B's bubble, every micro-batch's activations"))
