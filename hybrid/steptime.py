"""Predicted step time of a planned job on a device (pure: no torch).

Each stage's compute comes from its FLOPs at the device's achieved rate; tensor-parallel
collectives, pipeline sends and the data-parallel gradient reduction from their ring volumes
over the link they cross (inside a node or between nodes). The pipeline's makespan, bubbles
included, is hybrid's own simulator run on those per-stage times; the DP reduction overlaps the
last micro-batch's backward and only what sticks out counts (ZeRO-1's parameter all-gather
after the step never overlaps).

FLOPs per layer and micro-batch (forward, b sequences of s tokens, hidden h, MLP f):
``8bsh² + 4bs²h + 4bshf`` (QKV and output projections, scores and their use, the MLP); the
head ``2bshV``; backward twice the forward; full recompute one more forward of the layers.
``tflops_per_device`` counts the model's FLOPs as Narayanan et al. 2021 do (their Eq. 3:
with recompute the extra forward counts), so it compares with their tables.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from hybrid.config import Config, ModelConfig
from hybrid.cost import BYTES
from hybrid.devices import Device, Link
from hybrid.job import JobPlan

BUCKET_BYTES = 25 * 2**20
"""DP gradient buckets (``parallel.bucket_mb``'s default order of size): one latency each."""


@dataclass(frozen=True)
class StepPrediction:
    step_time_s: float
    compute_s: float
    """The busiest pipeline rank's compute, TP collectives included."""
    bubble_s: float
    """Pipeline idle time of the busiest rank (makespan - its compute)."""
    tp_s: float
    """TP collective time per step on one rank (inside ``compute_s``)."""
    pp_s: float
    """One pipeline message's time (activations between neighbouring stages)."""
    dp_s: float
    """The DP gradient reduction's time, and below what of it is not hidden."""
    dp_exposed_s: float
    tflops_per_device: float
    mem_bytes_per_rank: int

    def to_dict(self) -> dict:
        return asdict(self)


def layer_forward_flops(m: ModelConfig, b: int) -> float:
    s, h = m.seq_len, m.hidden
    return 8 * b * s * h * h + 4 * b * s * s * h + 4 * b * s * h * m.ffn


def head_forward_flops(m: ModelConfig, b: int) -> float:
    return 2 * b * m.seq_len * m.hidden * m.padded_vocab


def model_flops_per_step(cfg: Config) -> float:
    """Narayanan et al. 2021, Eq. 3 generalised to any MLP width: layers 3x forward (4x with
    recompute), the head 3x."""
    m, batch = cfg.model, cfg.train.global_batch
    passes = 4 if m.recompute else 3
    return (passes * m.layers * layer_forward_flops(m, batch)
            + 3 * head_forward_flops(m, batch))


def ring_all_reduce(nbytes: float, n: int, link: Link, messages: int = 1) -> float:
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency * messages


def ring_gather(nbytes: float, n: int, link: Link, messages: int = 1) -> float:
    """A reduce-scatter or an all-gather of ``nbytes`` in total."""
    if n == 1:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency * messages


def _link(plan: JobPlan, device: Device, axis: str) -> Link:
    crossing = plan.layout.crosses_nodes(axis, plan.ranks_per_node)
    return device.inter if crossing else device.intra


@dataclass(frozen=True)
class _StageTimes:
    forward: float
    backward: float
    tp_comm: float


def _stage_times(plan: JobPlan, device: Device, blocks: range) -> _StageTimes:
    """One micro-batch of one stage on one TP rank: forward and full backward seconds."""
    cfg, tp = plan.cfg, plan.layout.tp
    m, b = cfg.model, cfg.train.micro_batch
    rate = device.flops[cfg.train.precision]
    act = b * m.seq_len * m.hidden * BYTES[cfg.train.precision]
    tp_link = _link(plan, device, "tp")
    layers = sum(1 for block in blocks if 1 <= block <= m.layers)
    compute = layers * layer_forward_flops(m, b) / tp / rate
    tp_fwd = layers * 2 * ring_all_reduce(act, tp, tp_link)  # after attention, after the MLP
    if 0 in blocks:  # the vocabulary-parallel embedding sums its shards
        tp_fwd += ring_all_reduce(act, tp, tp_link)
    if m.layers + 1 in blocks:
        compute += head_forward_flops(m, b) / tp / rate
        tp_fwd += 3 * ring_all_reduce(4 * b * m.seq_len, tp, tp_link)  # cross entropy
    forward = compute + tp_fwd
    backward = 2 * compute + tp_fwd
    if m.recompute:
        backward += layers * (layer_forward_flops(m, b) / tp / rate
                              + 2 * ring_all_reduce(act, tp, tp_link))
    return _StageTimes(forward, backward, tp_fwd * 2)


def predict_step(plan: JobPlan, device: Device, simulated: bool = True) -> StepPrediction:
    """The step time of ``plan`` on ``device``: the simulated pipeline (or, with
    ``simulated=False``, its closed-form bubble, for ranking many layouts fast) plus the DP
    reduction that the backward does not hide."""
    plan = priced_placement(plan)
    cfg, layout = plan.cfg, plan.layout
    times = [_stage_times(plan, device, stage.blocks) for stage in plan.stages]
    m = plan.schedule.microbatches
    p2p = _p2p_time(plan, device)
    per_rank = [[times[st.index] for st in plan.stages_of(r)] for r in range(layout.pp)]
    busy = [m * sum(t.forward + t.backward for t in ts) for ts in per_rank]
    if simulated:
        makespan = _simulated_makespan(plan, times, p2p)
    else:
        makespan = max(busy) + _closed_form_bubble(plan, times, p2p)
    busiest = max(range(layout.pp), key=busy.__getitem__)
    dp_s, dp_exposed = _dp_times(plan, device, [sum(t.backward for t in ts) for ts in per_rank])
    step = makespan + dp_exposed
    world = layout.world_size
    return StepPrediction(
        step_time_s=step, compute_s=busy[busiest], bubble_s=makespan - busy[busiest],
        tp_s=m * sum(t.tp_comm for t in per_rank[busiest]), pp_s=p2p, dp_s=dp_s,
        dp_exposed_s=dp_exposed,
        tflops_per_device=model_flops_per_step(cfg) / step / world / 1e12 if step else 0.0,
        mem_bytes_per_rank=max(est.total_bytes for est in plan.memory))


def priced_placement(plan: JobPlan) -> JobPlan:
    """Nodes as the cost model sees them: the launcher's when it places them, else
    ``cost.gpus_per_node`` ranks per node."""
    launcher = plan.cfg.launcher
    if launcher.nnodes > 1 or launcher.nproc_per_node is not None:
        return plan
    return replace(plan, ranks_per_node=min(plan.world_size, plan.cfg.cost.gpus_per_node))


def _p2p_time(plan: JobPlan, device: Device) -> float:
    if plan.layout.pp == 1:
        return 0.0
    cfg = plan.cfg
    nbytes = (cfg.train.micro_batch * cfg.model.seq_len * cfg.model.hidden
              * BYTES[cfg.train.precision])
    if cfg.parallel.sequence_parallel:
        nbytes /= plan.layout.tp
    link = _link(plan, device, "pp")
    return nbytes / link.bandwidth + link.latency


def _simulated_makespan(plan: JobPlan, times: list[_StageTimes], p2p: float) -> float:
    from hybrid.pipeline.schedules import build_schedule
    from hybrid.pipeline.simulate import StageCosts, simulate

    layout, m = plan.layout, plan.schedule.microbatches
    costs = StageCosts(F=tuple(t.forward for t in times), B=tuple(t.backward for t in times),
                       I=tuple(t.backward / 2 for t in times),
                       W=tuple(t.backward / 2 for t in times), p2p=p2p)
    lists = build_schedule(plan.schedule.name, layout.pp, m, vpp=layout.vpp)
    return simulate(lists, layout.pp, m, vpp=layout.vpp, costs=costs).makespan


def _closed_form_bubble(plan: JobPlan, times: list[_StageTimes], p2p: float) -> float:
    """Warm-up and drain of the slowest stage: ``(pp - 1)`` of its forward + backward
    (``/ vpp`` interleaved; zero-bubble H1 leaves the forward), plus the messages."""
    pp = plan.layout.pp
    if pp == 1:
        return 0.0
    slowest = max(times, key=lambda t: t.forward + t.backward)
    if plan.schedule.name == "zb-h1":
        per_step = slowest.forward
    else:
        per_step = (slowest.forward + slowest.backward) / plan.layout.vpp
    return (pp - 1) * (per_step + 2 * p2p)


def _dp_times(plan: JobPlan, device: Device, last_backward: list[float]) -> tuple[float, float]:
    """(time of the DP reduction, the part of it not hidden behind the last micro-batch's
    backward) for the pipeline rank where that is largest."""
    layout = plan.layout
    if layout.dp == 1:
        return 0.0, 0.0
    link = _link(plan, device, "dp")
    worst = (0.0, 0.0)
    for r, est in enumerate(plan.memory):
        grads = 4 * est.params  # fp32 gradients, whatever the compute precision
        buckets = max(1, math.ceil(grads / BUCKET_BYTES))
        if plan.cfg.parallel.zero >= 1:
            scatter = ring_gather(grads, layout.dp, link, buckets)
            gather = ring_gather(4 * est.params, layout.dp, link, buckets)
            total, exposed = scatter + gather, max(0.0, scatter - last_backward[r]) + gather
        else:
            total = ring_all_reduce(grads, layout.dp, link, buckets)
            exposed = max(0.0, total - last_backward[r])
        worst = max(worst, (total, exposed), key=lambda pair: pair[1])
    return worst
