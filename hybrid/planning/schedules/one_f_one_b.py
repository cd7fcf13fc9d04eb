"""1F1B (PipeDream-Flush; Narayanan et al. 2021): warm-up forwards, then one forward per
backward, so a rank holds at most ``pp - rank`` micro-batches."""

from __future__ import annotations

from hybrid.planning.schedules.actions import BACKWARD, FORWARD, Action
from hybrid.planning.schedules.registry import ScheduleSpec, register_schedule


def _one_f_one_b_rank(rank: int, pp: int, m: int) -> list[Action]:
    """PipeDream-Flush 1F1B: ``pp - rank - 1`` warm-up forwards, then alternate F and B.

    At most ``min(pp - rank, m)`` micro-batches are in flight on a rank, whatever ``m`` is.
    """
    warmup = min(pp - rank - 1, m)
    order = [Action(rank, FORWARD, mb) for mb in range(warmup)]
    for mb in range(m):
        if warmup + mb < m:
            order.append(Action(rank, FORWARD, warmup + mb))
        order.append(Action(rank, BACKWARD, mb))
    return order


def _lists(pp: int, m: int, vpp: int) -> list[list[Action]]:
    return [_one_f_one_b_rank(rank, pp, m) for rank in range(pp)]


def _closed_form(pp: int, m: int, vpp: int) -> tuple[float, tuple[int, ...]]:
    return (pp - 1) / (m * vpp + pp - 1), tuple(min(pp - r, m) for r in range(pp))


ONE_F_ONE_B = register_schedule(ScheduleSpec(
    name="1f1b", build=_lists, closed_form=_closed_form,
    warmup_step=lambda forward, backward, vpp: (forward + backward) / vpp,
    search_vpps=(1,), doc="warm-up forwards, then one forward per backward (the default)"))
