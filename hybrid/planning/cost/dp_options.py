"""Every DP option priced on one layout: what ``hybrid-plan`` prints beside a plan (pure)."""

from __future__ import annotations

from dataclasses import replace

from hybrid.planning.cost.devices import Device
from hybrid.planning.cost.dp_traffic import DpOptions
from hybrid.planning.cost.steptime import predict_step
from hybrid.planning.job import plan_job, rank_dp_bytes

DP_CHOICES = (
    ("exact", {}), ("zero=1", {"zero": 1}), ("zero=2", {"zero": 2}),
    ("bf16", {"dp_compress": "bf16"}),
    *((f"powersgd r{r}", {"dp_compress": "powersgd", "powersgd_rank": r}) for r in (1, 2, 4)),
    *((f"sync_every {h}", {"dp_sync_every": h}) for h in (2, 4, 8)),
    ("delay 1", {"dp_delay": 1}),
)
"""The options ``compare_dp_options`` prices (each alone on top of the config's layout)."""


def compare_dp_options(cfg, device: Device) -> list[dict]:
    """Each DP option on ``cfg``'s layout: predicted step time, DP time not hidden, DP bytes
    per step (steady state, rank 0) and memory per rank; whether it is exact."""
    rows = []
    for name, fields in DP_CHOICES:
        base = {"zero": 0, "dp_compress": "none", "dp_sync_every": 1, "dp_delay": 0,
                "powersgd_warmup": 0}
        option_cfg = replace(cfg, parallel=replace(cfg.parallel, **{**base, **fields}))
        plan = plan_job(option_cfg, simulated=False)
        step = DpOptions.of(option_cfg.parallel).sync_every  # a step that syncs
        syncs_every = max(1, step)
        predicted = predict_step(plan, device, simulated=False)
        rows.append({"option": name, "exact": DpOptions.of(option_cfg.parallel).exact,
                     "step_time_s": predicted.step_time_s,
                     "dp_exposed_s": predicted.dp_exposed_s,
                     "dp_bytes_per_step": rank_dp_bytes(option_cfg, plan, 0, step) / syncs_every,
                     "mem_bytes_per_rank": predicted.mem_bytes_per_rank})
    return rows
