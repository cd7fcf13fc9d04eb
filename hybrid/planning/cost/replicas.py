"""Data-parallel replicas of unequal speed, priced: even shares against balanced ones (pure).

``cost.replica_speed=[1, 1, 0.5, 1]`` says each DP replica's compute speed relative to the
device (0.5: half as fast: a throttled node, an older GPU). The planned step's pipeline,
``u * (m + bubble)`` in the model of ``hybrid.planning.balance``, runs on replica ``r`` at
``u / speed_r`` per micro-batch. Under even shares the step waits for the slowest replica; under
``parallel.dp_balance=dynamic`` the shares the balancer would choose at these speeds are
priced the same way. What is not the pipeline (the DP reduction that sticks out, the optimizer
step) is added to both unchanged.
"""

from __future__ import annotations

import statistics
from typing import Sequence

from hybrid.planning.balance import (
    best_shares, pipeline_bubble, predicted_step_s, replica_compute, share_unit,
)
from hybrid.planning.cost.devices import Device
from hybrid.planning.cost.steptime import predict_step
from hybrid.planning.job import JobPlan


def replica_prediction(plan: JobPlan, device: Device, speeds: Sequence[float]) -> dict:
    """The predicted step under even and under balanced shares on replicas of ``speeds``."""
    layout, cfg = plan.layout, plan.cfg
    base = predict_step(plan, device)
    m = plan.schedule.microbatches
    bubble = pipeline_bubble(layout.pp, layout.vpp)
    pipeline_s = base.compute_s + base.bubble_s
    rest_s = max(0.0, base.step_time_s - pipeline_s)
    per_mb = [pipeline_s / (m + bubble) / s for s in speeds]
    even = (m,) * layout.dp
    balanced = best_shares(per_mb, m * layout.dp,
                           unit=share_unit(cfg.parallel.schedule, layout.pp), bubble=bubble)
    even_s = predicted_step_s(per_mb, even, bubble) + rest_s
    balanced_s = predicted_step_s(per_mb, balanced, bubble) + rest_s
    return {"replica_speed": list(speeds), "even_step_s": even_s, "balanced_step_s": balanced_s,
            "balanced_shares": list(balanced), "ratio": balanced_s / even_s}


def replica_line(p: dict) -> str:
    """``hybrid-plan``'s line for ``replica_prediction``."""
    return (f"replicas at speeds {p['replica_speed']} (cost.replica_speed): even shares step "
            f"{p['even_step_s']:.4g} s; parallel.dp_balance=dynamic's shares "
            f"{p['balanced_shares']} step {p['balanced_step_s']:.4g} s "
            f"(ratio={p['ratio']:.2f})")


def measured_speeds(compute_s: Sequence[Sequence[float]], dp_of_rank: Sequence[int],
                    replicas: int) -> list[float]:
    """Each replica's speed against the fastest one's, from per-step per-rank compute seconds
    under even shares (every replica does the same work): the inverse ratio of its slowest
    rank's median compute."""
    per_step = [replica_compute(step, dp_of_rank, replicas) for step in compute_s]
    medians = [statistics.median(step[r] for step in per_step) for r in range(replicas)]
    fastest = min(medians)
    return [round(fastest / m, 3) if m > 0 else 1.0 for m in medians]


def saving_clause(p: dict) -> str:
    """What ``parallel.dp_balance=dynamic`` would save, for ``replica_prediction``'s ``p``:
    the straggler warning's and the sweep report's words."""
    return (f"parallel.dp_balance=dynamic would save {1 - p['ratio']:.0%} of the step "
            f"(cost model at replica speeds {p['replica_speed']}: even "
            f"{p['even_step_s']:.3g} s, balanced {p['balanced_shares']} "
            f"{p['balanced_step_s']:.3g} s)")
