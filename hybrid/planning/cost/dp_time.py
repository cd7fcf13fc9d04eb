"""The data-parallel part of a predicted step: each DP option's time and what of it shows
(pure: no torch; ``hybrid.planning.cost.steptime.predict_step`` calls it).

- exact, ``zero=0``: one all-reduce, hidden behind the last micro-batch's backward as far as
  it goes; ``zero=1``: the reduce-scatter there, then the parameter all-gather after the step;
  ``zero=2``: a reduce-scatter per micro-batch, each behind its own micro-batch's backward.
- ``bf16``: the same at half the bytes (ZeRO-1's all-gather stays fp32).
- ``powersgd``: the exact rest and ``P`` overlap the backward; the ``Q`` all-reduce and the
  factor arithmetic (three ``n x m x r`` products per matrix) come after it.
- ``dp_sync_every=H``: the parameter (and moment) all-reduce of every H-th step, not hidden,
  averaged over the H steps.
- ``dp_delay=1``: the all-reduce runs during the whole next step; only what exceeds it shows.

Bytes come from ``hybrid.planning.cost.dp_traffic`` (the same volumes the counter measures); per-call
latency is paid once per bucket and collective.
"""

from __future__ import annotations

import math

from hybrid.planning.cost.collectives import BUCKET_BYTES, ring_all_reduce, ring_gather
from hybrid.planning.cost.devices import Device, Link
from hybrid.planning.cost.dp_traffic import (
    BF16, DpOptions, all_reduce_bytes, as_matrix, bucket_shapes, gradient_bytes, powersgd_compresses,
)
from hybrid.planning.job import JobPlan
from hybrid.planning.cost.state_bytes import FP32, rank_shapes


def dp_times(plan: JobPlan, device: Device, link: Link, last_backward: list[float],
             makespan: float) -> tuple[float, float]:
    """(time of the DP communication per step, the part of it not hidden) for the pipeline
    rank where the hidden part is largest. ``last_backward``: one micro-batch's backward per
    pipeline rank; ``makespan``: the pipeline's time (what a delayed reduction can hide in)."""
    if plan.layout.dp == 1:
        return 0.0, 0.0
    options = DpOptions.of(plan.cfg.parallel)
    worst = (0.0, 0.0)
    for r, est in enumerate(plan.memory):
        if options.exact:
            pair = _exact(plan, device, link, est.params, last_backward[r])
        else:
            pair = _lossy(plan, device, link, r, last_backward[r], makespan)
        worst = max(worst, pair, key=lambda p: p[1])
    return worst


def _exact(plan: JobPlan, device: Device, link: Link, params: int, backward: float,
           grad_width: int = FP32) -> tuple[float, float]:
    """fp32 gradients whatever the compute precision (``grad_width``: bf16 compression)."""
    dp, zero = plan.layout.dp, plan.cfg.parallel.zero
    grads = grad_width * params
    buckets = max(1, math.ceil(grads / BUCKET_BYTES))
    if not zero:
        total = ring_all_reduce(grads, dp, link, buckets)
        return total, max(0.0, total - backward)
    scatter = ring_gather(grads, dp, link, buckets) * device.reduce_scatter_factor
    gather = ring_gather(FP32 * params, dp, link, buckets) * device.all_gather_factor
    if zero == 2:
        m = plan.schedule.microbatches
        return m * scatter + gather, m * max(0.0, scatter - backward) + gather
    return scatter + gather, max(0.0, scatter - backward) + gather


def _lossy(plan: JobPlan, device: Device, link: Link, pp_rank: int, backward: float,
           makespan: float) -> tuple[float, float]:
    cfg, dp = plan.cfg, plan.layout.dp
    options = DpOptions.of(cfg.parallel)
    shapes = rank_shapes(cfg.model, [b for st in plan.stages_of(pp_rank) for b in st.blocks],
                         tp=plan.layout.tp, sp=cfg.parallel.sequence_parallel,
                         pp=plan.layout.pp)
    buckets = max(1, len(bucket_shapes(shapes, cfg.parallel.bucket_mb)))
    latency = 2 * (dp - 1) * link.latency * buckets  # one ring all-reduce per bucket
    if options.compress == "powersgd":
        first, second = _powersgd_phases(shapes, dp, options.powersgd_rank,
                                         cfg.parallel.bucket_mb)
        first, second = first / link.bandwidth + latency, second / link.bandwidth + latency
        arithmetic = _powersgd_flops(shapes, options.powersgd_rank) / device.compute_rate(
            "fp32", cfg.model.hidden / plan.layout.tp, options.powersgd_rank)
        return first + second + arithmetic, max(0.0, first - backward) + second + arithmetic
    if options.sync_every > 1:
        sync = gradient_bytes(shapes, dp=dp, options=options, step=options.sync_every,
                              microbatches=plan.schedule.microbatches,
                              bucket_mb=cfg.parallel.bucket_mb)
        copies = 3 if options.sync_moments else 1
        each = (sync / link.bandwidth + latency * copies) / options.sync_every
        return each, each
    params = sum(math.prod(s) for s, _ in shapes)
    if options.compress == "bf16":
        return _exact(plan, device, link, params, backward, grad_width=BF16)
    total = ring_all_reduce(FP32 * params, dp, link, buckets)  # the delayed mean
    return total, max(0.0, total - makespan)


def _powersgd_phases(shapes, dp: int, rank: int, bucket_mb: float) -> tuple[float, float]:
    """Wire bytes of (the exact rest and every ``P``, every ``Q``)."""
    first = second = 0.0
    for bucket in bucket_shapes(shapes, bucket_mb):
        packed = [as_matrix(s) for s in bucket if powersgd_compresses(s, rank)]
        rest = sum(math.prod(s) for s in bucket if not powersgd_compresses(s, rank))
        first += all_reduce_bytes(FP32 * (rest + rank * sum(n for n, _ in packed)), dp)
        second += all_reduce_bytes(FP32 * rank * sum(m for _, m in packed), dp)
    return first, second


def _powersgd_flops(shapes, rank: int) -> float:
    """``P = MQ``, ``Q = M^T P`` and ``PQ^T``: ``2nmr`` each per compressed matrix."""
    return sum(6.0 * math.prod(s) * rank for s, _ in shapes if powersgd_compresses(s, rank))
