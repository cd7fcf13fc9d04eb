"""The data-parallel part of a predicted step: the DP strategies' time and what of it shows
(pure: no torch; ``hybrid.planning.cost.steptime.predict_step`` calls it). Each strategy's spec
(``hybrid.planning.strategies``) prices its own traffic; bytes come from the same rules the
counter checks, per-call latency is paid once per bucket and collective.
"""

from __future__ import annotations

from hybrid.planning.cost.devices import Device, Link
from hybrid.planning.cost.state_bytes import MIB, rank_shapes
from hybrid.planning.job import JobPlan
from hybrid.planning.schedules.gathers import AFTER_STEP
from hybrid.planning.strategies import DpOptions, DpTime, RankTraffic, reduction_of, sharding_of


def dp_times(plan: JobPlan, device: Device, link: Link, last_backward: list[float],
             makespan: float) -> tuple[float, float, int]:
    """(time of the DP communication per step, the part of it not hidden, the pipeline rank)
    for the pipeline rank where the part not hidden is largest. ``last_backward``: one
    micro-batch's backward per pipeline rank; ``makespan``: the pipeline's time (what a
    delayed reduction can hide in)."""
    width = plan.layout.role_size("gradient")  # dp x cp
    if width == 1:
        return 0.0, 0.0, 0
    cfg = plan.cfg
    options = DpOptions.of(cfg.parallel)
    sharding, reduction = sharding_of(options), reduction_of(options)
    worst, worst_rank = (0.0, 0.0), 0
    seen = set()  # ranks alike in their weights, blocks and backward time (searches)
    head = cfg.model.layers + 1
    for r, est in enumerate(plan.memory):
        # what the reduction reads of a rank: its weights' count and shapes (its blocks: the
        # layers are alike, the embedding and head not) and its backward, not its activations
        stages = [plan.stages[s].blocks for s in plan.by_rank[r]]
        key = (est.params, sum(map(len, stages)), any(0 in b for b in stages),
               any(head in b for b in stages), last_backward[r])
        if key in seen:
            continue
        seen.add(key)
        traffic = RankTraffic(lambda r=r: _shapes(plan, r), dp=width,
                              microbatches=plan.schedule.microbatches,
                              bucket_mb=cfg.parallel.bucket_mb,
                              gathers=_gathers(plan) if sharding.gathers_params else None)
        timing = DpTime(device=device, link=link, params=est.params, backward=last_backward[r],
                        makespan=makespan, matmul_width=cfg.model.hidden / plan.layout.tp,
                        last_params=(cfg.model.padded_vocab * cfg.model.hidden / plan.layout.tp
                                     if any(0 in b for b in stages) else 0.0),
                        bucket_bytes=cfg.parallel.bucket_mb * MIB)
        pair = reduction.time(traffic, timing, options, sharding)
        if (pair[1], pair[0]) > (worst[1], worst[0]):  # ties: the longer
            worst, worst_rank = pair, r
    return (*worst, worst_rank)


def _shapes(plan: JobPlan, pp_rank: int):
    cfg = plan.cfg
    return rank_shapes(cfg.model, [b for st in plan.stages_of(pp_rank) for b in st.blocks],
                       tp=plan.layout.tp, sp=cfg.parallel.sequence_parallel, pp=plan.layout.pp)


def _gathers(plan: JobPlan) -> list[int]:
    """ZeRO-3's gathers of each weight a step, in closed form: one (``after_step``), or one
    per forward and one per backward of each micro-batch (``after_forward``)."""
    once = DpOptions.of(plan.cfg.parallel).reshard == AFTER_STEP
    return [1 if once else 2 * plan.schedule.microbatches]
