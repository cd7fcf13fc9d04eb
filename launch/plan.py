"""``hybrid-plan``: print what a config would run, without starting anything.

Takes the same overrides as ``hybrid-train`` plus ``format=json``::

    hybrid-plan parallel.dp=2 parallel.tp=2 parallel.pp=2 format=json
"""

from __future__ import annotations

import json
import sys

import hydra
from omegaconf import DictConfig

from hybrid.config import PlanConfig
from hybrid.layout import LayoutError
from hybrid.memory import memory_verdict
from hybrid.plan import build_plan, format_plan
from hybrid.validate import config_problems
from launch.app import CONF_DIR, available_memory, exit_user_error, run_hydra_app, to_dataclass


@hydra.main(config_path=CONF_DIR, config_name="plan", version_base="1.3")
def _plan(dict_cfg: DictConfig) -> None:
    cfg = to_dataclass(dict_cfg, PlanConfig)
    if cfg.format not in ("text", "json"):
        exit_user_error(f"format={cfg.format!r} is unknown; choose text or json")
    problems = config_problems(cfg)
    if len(problems) > 1:  # all of them, one line each
        for problem in problems[:-1]:
            print(f"error: {problem}", file=sys.stderr)
        exit_user_error(problems[-1])
    try:
        plan = build_plan(cfg)
    except (LayoutError, ValueError) as err:
        exit_user_error(err)
    limit, device = available_memory(cfg)
    if limit is not None:
        plan["memory_check"] = memory_verdict(cfg, limit, device)
    if cfg.format == "json":
        print(json.dumps(plan, indent=1))
    else:
        print(format_plan(plan, full=cfg.full))
        if "memory_check" in plan:
            print(f"\nmemory check: {plan['memory_check']['line']}")


def main() -> None:
    run_hydra_app(_plan)


if __name__ == "__main__":
    main()
