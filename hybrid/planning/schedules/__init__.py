"""Pipeline schedules as data (pure): actions, the schedule registry with one module per
schedule, the lowering that adds sends and receives, the checker, the simulator, the per-rank
plan and the stage partitioner.

Import schedules from here: importing the package registers the built-in ones (``gpipe``,
``1f1b``, ``interleaved-1f1b``, ``zb-h1``, ``zb-v``, ``dualpipev``), in that order.
"""

# Each import registers its schedules; this order is the order of parallel.schedule's choices.
from hybrid.planning.schedules import gpipe  # noqa: F401  (registers)
from hybrid.planning.schedules import one_f_one_b  # noqa: F401  (registers)
from hybrid.planning.schedules import interleaved  # noqa: F401  (registers)
from hybrid.planning.schedules import zero_bubble  # noqa: F401  (registers)
from hybrid.planning.schedules import dualpipev  # noqa: F401  (registers)
from hybrid.planning.schedules.lowering import add_communication, forward_only
from hybrid.planning.schedules.registry import (
    SCHEDULES, ScheduleSpec, batch_problem, build_schedule, layout_problem, register_schedule,
    schedule_names, schedule_placement, schedule_spec,
)

BUILT_IN = (gpipe, one_f_one_b, interleaved, zero_bubble, dualpipev)

__all__ = ["SCHEDULES", "ScheduleSpec", "add_communication", "batch_problem", "build_schedule",
           "forward_only",
           "layout_problem", "register_schedule", "schedule_names", "schedule_placement",
           "schedule_spec"]
