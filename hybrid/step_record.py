"""What a training step reports, its ``metrics.jsonl`` record (docs/metrics.md), and the stop
when its loss or gradient norm is not finite."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from hybrid.errors import UserError
from hybrid.planning.cost.flops import hardware_flops_per_step, model_flops_per_step
from hybrid.planning.job import JobPlan, rank_dp_bytes
from hybrid.planning.layout import COORD_ORDER as AXES
from hybrid.planning.strategies import DpOptions

COUNTED = (*AXES, "ep")
"""The traffic a step record reports: every axis's, and the experts' all-to-all."""



@dataclass
class StepReport:
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    comm: dict
    cpu_s: float
    """CPU seconds of the step summed over all ranks (the cost of parallelism on CPUs)."""
    peak_mem_bytes: int
    """The largest peak memory of any rank so far."""
    compute_s: list[float]
    """Per rank: wall time of the step minus the time blocked in waits."""
    wait_s: dict[str, list[float]]
    """Per axis, per rank: seconds blocked in collectives and pipeline receives."""
    data_s: float = 0.0
    """The slowest rank's seconds building its micro-batches before the step (not in
    ``step_time_s``; Megatron-LM's batch-generator time)."""
    pipeline_s: Optional[list[float]] = None
    """Per rank: the part of ``compute_s`` in the micro-batches' forward and backward (the
    rest is the step's fixed cost: the optimizer, the gradient reduction's own work)."""
    dp_shares: Optional[list[int]] = None
    """Micro-batches each DP replica ran (``parallel.dp_balance=dynamic``; else None)."""
    moe: Optional[dict] = None
    """Rank 0's MoE layers in the step (``hybrid.model.moe.moe_step_stats``); None without."""
    dp_group_bytes: Optional[dict] = None
    """Rank 0's DP bytes per group label (``CommCounter.axis_group_bytes("dp")``)."""


def metrics_record(plan: JobPlan, step: int, report: StepReport, summary: dict) -> dict:
    """The step's record (``summary``: the stragglers' per-step figures)."""
    cfg = plan.cfg
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
    return {
        "step": step, "loss": report.loss, "lr": report.lr, "grad_norm": report.grad_norm,
        "tokens_per_s": tokens_per_step / report.step_time_s,
        "step_time_s": report.step_time_s, "cpu_s": report.cpu_s, "data_s": report.data_s,
        "comm_bytes": {axis: report.comm[axis]["bytes"] for axis in COUNTED},
        "comm_bytes_dp_uncompressed": exact_dp_bytes(plan, step, report.dp_shares),
        "comm_calls": {axis: report.comm[axis]["calls"] for axis in COUNTED},
        "peak_mem_bytes": report.peak_mem_bytes,
        "layout": {axis: plan.layout.size(axis) for axis in AXES}, **summary,
        **utilisation(plan, report.step_time_s),
        **({"dp_shares": report.dp_shares} if report.dp_shares is not None else {}),
        **({"moe": report.moe} if report.moe is not None else {}),
        **({"comm_bytes_dp_groups": report.dp_group_bytes}
           if plan.layout.ep > 1 and report.dp_group_bytes is not None else {}),
    }


def utilisation(plan: JobPlan, step_time_s: float) -> dict:
    """Model FLOPs of the step (the same on every layout), model TFLOP/s per device, and MFU
    and HFU against the plan's device peak (``hybrid.planning.cost.flops``)."""
    cfg, world = plan.cfg, plan.world_size
    model, hardware = model_flops_per_step(cfg), hardware_flops_per_step(cfg)
    out = {"model_flops": model, "model_tflops_per_device": model / step_time_s / world / 1e12}
    if plan.peak_flops:
        out["mfu"] = model / step_time_s / world / plan.peak_flops
        out["hfu"] = hardware / step_time_s / world / plan.peak_flops
    return out


def exact_dp_bytes(plan: JobPlan, step: int, shares: Optional[list[int]] = None) -> float:
    """What rank 0 would send over DP this step with exact reduction (same ZeRO stage;
    ``shares``: the replicas' micro-batches under ``parallel.dp_balance=dynamic``)."""
    exact = DpOptions.of(plan.cfg.parallel).uncompressed()
    return rank_dp_bytes(plan.cfg, plan, 0, step, exact, rounds=max(shares) if shares else None)


class NonFiniteError(UserError):
    """The loss or the gradient norm of a step is NaN or infinite; the update was not applied."""


def stop_if_not_finite(step: int, loss: float, grad_norm: float, lr: float) -> None:
    """Raise on a non-finite loss or gradient norm (every rank has both, reduced)."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    raise NonFiniteError(f"step {step}: loss {loss}, gradient norm {grad_norm}; the update was "
                         f"not applied and training stopped. Lower optim.lr (this step's lr "
                         f"{lr:.3g}) or resume from an earlier checkpoint")
