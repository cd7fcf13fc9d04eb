"""``plan.json``: a ``JobPlan`` as JSON, written beside ``config.json`` before any worker starts
and read by every rank (pure: no torch).

It holds every resolved fact of the run: the config as composed, the layout and the ranks per
node, the stages and where they run, the schedule's shape and every pipeline rank's lowered
action list, the memory per pipeline rank, the
DP strategies, every role's groups, the checkpoint directory and the checkpoint to resume
from. ``load_plan(save_plan(plan))`` gives back an equal plan; the DP strategies and the
groups are written for people and tools to read and are derived again on loading.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from hybrid.errors import UserError
from hybrid.files import write_text
from hybrid.planning.config import from_dict, to_dict
from hybrid.planning.cost.sizes import MemoryEstimate
from hybrid.planning.job import JobPlan, SchedulePlan, Stage
from hybrid.planning.layout import COORD_ORDER, Layout
from hybrid.planning.schedules.actions import Action

FILE = "plan.json"
FORMAT = 5
"""2: the run's indexed data (data_prefixes, data_cache_dir); 3: init_from, tokenizer,
peak_flops; 4: the layout's cp; 5: the lowered per-rank action lists."""


class PlanFileError(UserError):
    """A ``plan.json`` that this hybrid did not write: a run directory of another version."""


def plan_to_dict(plan: JobPlan) -> dict:
    layout = plan.layout
    return {
        "format": FORMAT,
        "config": to_dict(plan.cfg),
        "layout": {**{axis: layout.size(axis) for axis in COORD_ORDER}, "order": layout.order,
                   "vpp": layout.vpp, "stage_placement": layout.stage_placement,
                   "ep": layout.ep},
        "ranks_per_node": plan.ranks_per_node,
        "priced_ranks_per_node": plan.priced_ranks_per_node,
        "stages": [{"index": s.index, "pp_rank": s.pp_rank, "chunk": s.chunk,
                    "blocks": [s.blocks.start, s.blocks.stop]} for s in plan.stages],
        "by_rank": [list(ranks) for ranks in plan.by_rank],
        "lowered": [[str(action) for action in actions] for actions in plan.lowered],
        "schedule": asdict(plan.schedule),
        "memory": [asdict(est) for est in plan.memory],
        "block_costs": None if plan.block_costs is None else list(plan.block_costs),
        "costs_measured": plan.costs_measured,
        "checkpoint_dir": plan.checkpoint_dir,
        "resume_from": plan.resume_from,
        "init_from": plan.init_from,
        "peak_flops": plan.peak_flops,
        "tokenizer": plan.tokenizer,
        "data_prefixes": list(plan.data_prefixes),
        "data_cache_dir": plan.data_cache_dir,
        "dp_strategies": dict(zip(("sharding", "reduction"), plan.dp_strategies)),
        "groups": plan.role_groups(),
    }


def plan_from_dict(data: dict) -> JobPlan:
    if data.get("format") != FORMAT:
        raise PlanFileError(f"plan format {data.get('format')!r}, this hybrid reads {FORMAT}")
    schedule = data["schedule"]
    return JobPlan(
        cfg=from_dict(data["config"]), layout=Layout(**data["layout"]),
        ranks_per_node=data["ranks_per_node"],
        stages=tuple(Stage(index=s["index"], pp_rank=s["pp_rank"], chunk=s["chunk"],
                           blocks=range(*s["blocks"])) for s in data["stages"]),
        schedule=SchedulePlan(**{**schedule,
                                 "bubble_per_rank": tuple(schedule["bubble_per_rank"]),
                                 "peak_inflight": tuple(schedule["peak_inflight"])}),
        memory=tuple(MemoryEstimate(**est) for est in data["memory"]),
        by_rank=tuple(tuple(ranks) for ranks in data["by_rank"]),
        lowered=tuple(tuple(Action.parse(text) for text in actions)
                      for actions in data["lowered"]),
        priced_ranks_per_node=data["priced_ranks_per_node"],
        block_costs=None if data["block_costs"] is None else tuple(data["block_costs"]),
        costs_measured=data["costs_measured"], checkpoint_dir=data["checkpoint_dir"],
        resume_from=data["resume_from"], init_from=data["init_from"],
        peak_flops=data["peak_flops"],
        tokenizer=data["tokenizer"], data_prefixes=tuple(data["data_prefixes"]),
        data_cache_dir=data["data_cache_dir"])


def save_plan(plan: JobPlan, run_dir: Path) -> Path:
    path = Path(run_dir) / FILE
    write_text(path, json.dumps(plan_to_dict(plan), indent=1) + "\n")
    return path


def load_plan(path: Path) -> JobPlan:
    """The plan in ``path`` (a ``plan.json`` or the run directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / FILE
    return plan_from_dict(json.loads(path.read_text()))
