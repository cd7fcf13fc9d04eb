"""Every pipeline rank's lowered action list, as the runtime runs it (pure: no torch).

The schedule's compute lists (``build_schedule``), with the sends and receives the lowering
adds, ZeRO-3's gathers and releases where the config shards parameters, and proved complete
and deadlock-free by the checker. ``plan_job`` holds the training step's lists in the
``JobPlan`` (and so in ``plan.json``); an evaluation (forwards only) and a replica's own
micro-batch count under ``parallel.dp_balance=dynamic`` lower theirs on the rank, the same way.
"""

from __future__ import annotations

from hybrid.planning.config import Config
from hybrid.planning.cost.gathered import gather_policy
from hybrid.planning.layout import Layout
from hybrid.planning.schedules import add_communication, build_schedule, forward_only
from hybrid.planning.schedules.actions import Action
from hybrid.planning.schedules.check import check_schedule
from hybrid.planning.schedules.gathers import add_gathers


def lowered_lists(cfg: Config, layout: Layout, m: int, forward: bool = False
                  ) -> list[list[Action]]:
    """Every pipeline rank's checked list of ``m`` micro-batches (``forward``: an
    evaluation's, forwards and their messages only)."""
    pp, vpp, placement = layout.pp, layout.vpp, layout.stage_placement
    lists = add_communication(build_schedule(cfg.parallel.schedule, pp, m, vpp=vpp), pp, vpp,
                              placement)
    if forward:
        lists = forward_only(lists)
    policy = gather_policy(cfg)
    if policy is not None:
        lists = add_gathers(lists, policy)
    check_schedule(lists, pp, m, vpp, placement, forward_only=forward)
    return lists
