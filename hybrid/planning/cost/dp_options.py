"""Every DP strategy priced on one layout: what ``hybrid-plan`` prints beside a plan (pure).
The variants and their labels are the registered specs' ``choices``."""

from __future__ import annotations

from dataclasses import replace

from hybrid.planning.cost.devices import Device
from hybrid.planning.cost.steptime import predict_step
from hybrid.planning.job import plan_job, rank_dp_bytes
from hybrid.planning.layout import LayoutError
from hybrid.planning.strategies import REDUCTIONS, SHARDINGS, DpOptions, reduction_of

EXACT_BASE = {"zero": 0, "dp_compress": "none", "dp_sync_every": 1, "dp_delay": 0,
              "powersgd_warmup": 0}
"""Each variant alone, on top of the config's layout: the settings it starts from."""


def dp_choices() -> list[tuple[str, dict]]:
    """(label, settings) of every variant, shardings first, then the lossy reductions."""
    return [choice for spec in (*SHARDINGS.values(), *REDUCTIONS.values())
            for choice in spec.choices()]


def compare_dp_options(cfg, device: Device) -> list[dict]:
    """Each DP option on ``cfg``'s layout: predicted step time, DP time not hidden, DP bytes
    per step (steady state, rank 0) and memory per rank; whether it is exact. An option the
    layout cannot run (local SGD under context parallelism) is left out."""
    rows = []
    for name, fields in dp_choices():
        option_cfg = replace(cfg, parallel=replace(cfg.parallel, **{**EXACT_BASE, **fields}))
        options = DpOptions.of(option_cfg.parallel)
        try:
            plan = plan_job(option_cfg, simulated=False)
        except LayoutError:
            continue
        step = reduction_of(options).cycle(options)  # a step that sends the most
        predicted = predict_step(plan, device, simulated=False)
        rows.append({"option": name, "exact": reduction_of(options).exact,
                     "step_time_s": predicted.step_time_s,
                     "dp_exposed_s": predicted.dp_exposed_s,
                     "dp_contention_s": predicted.dp_contention_s,
                     "dp_bytes_per_step": rank_dp_bytes(option_cfg, plan, 0, step) / max(1, step),
                     "mem_bytes_per_rank": predicted.mem_bytes_per_rank})
    return rows
