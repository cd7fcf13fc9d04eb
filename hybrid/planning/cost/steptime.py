"""Predicted step time of a planned job on a device (pure: no torch).

Each stage's compute (``stage_time``: one micro-batch's forward and backward on one rank)
comes from its FLOPs at the device's achieved rate; tensor-parallel collectives (``tp_time``: the calls hybrid's layers make, each at the device's cost per call
beyond its ring time), pipeline sends, context parallelism's ring (``context_time``) and the
data-parallel gradient reduction from their volumes over the link they cross (inside a node
or between nodes). The pipeline's makespan, bubbles included, is hybrid's own simulator run on
those per-stage times (a zero-bubble split backward at the device's ``split_backward_factor``);
the DP reduction overlaps the last micro-batch's backward and only what sticks out counts
(ZeRO-1's parameter all-gather after the step never overlaps; on a CPU host gloo reduces on
the cores that compute, so none of it hides); the optimizer step follows. The achieved rate
depends on the work's width per TP rank and its tokens per micro-batch, and on CPU on the
threads each rank gets and the cores the node's ranks share (``hybrid.planning.cost.devices``):
a node with more ranks than cores cannot finish before its cores have done every rank's work.

FLOPs come from ``hybrid.planning.cost.flops``. ``tflops_per_device`` counts the model's FLOPs
as Narayanan et al. 2021 do (their Eq. 3: with full recompute the extra forward counts;
selective recompute's is not counted, as Korthikanti et al. 2022's model FLOPs do not), so it
compares with their tables.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from dataclasses import replace as dc_replace
from typing import Optional, Sequence

from hybrid.planning.cost.collectives import ring_gather
from hybrid.planning.cost.devices import Device
from hybrid.planning.cost.dp_time import dp_times
from hybrid.planning.cost.flops import paper_flops_per_step
from hybrid.planning.cost.pipe_engine import blocking_exchanges_s, tied_grads_s
from hybrid.planning.cost.sizes import BYTES
from hybrid.planning.cost.stage_time import (
    StageTimes, link_for, stage_times,
)
from hybrid.planning.job import JobPlan
from hybrid.planning.schedules.registry import schedule_splits_backward
from hybrid.planning.cost.makespan import (
    closed_form_bubble, makespan_lower_bound, overlap_savings, simulated_makespan,
)


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
    optimizer_s: float
    """The optimizer step of the rank where it is longest (after the reduction)."""
    tflops_per_device: float
    mem_bytes_per_rank: int
    cp_s: float = 0.0
    """Context parallelism's ring time per step on the busiest rank, and below what of it
    is not hidden behind attention (inside ``compute_s``)."""
    cp_exposed_s: float = 0.0
    dp_contention_s: float = 0.0
    """What the multiplies beside the hidden part of the DP reduction lose to the SMs it
    holds (``Device.collective_sm_share``)."""
    tied_s: float = 0.0
    """The tied embedding's gradient all-reduce where the software exposes it
    (``Device.tied_after_backward``)."""
    schedule_simulated: bool = True
    """The makespan comes from simulating the schedule (else from its closed form)."""

    def to_dict(self) -> dict:
        return asdict(self)


SIMULATE_UP_TO = 4096
"""Virtual stages x micro-batches up to which ``predict_step`` simulates the schedule (about
0.1 s); above, it prices the closed-form bubble, in ``hybrid-plan`` and the search alike."""


@dataclass(frozen=True)
class _RankSums:
    """One pipeline rank's stages summed: what the pricing reads per rank."""

    busy: float
    """Its actions' seconds for the step (``microbatches`` times its chunks')."""
    cpu_busy: float
    wire: float
    last_backward: float
    """One micro-batch's backward over its chunks."""
    last_backward_matmul: float
    """Of which multiplies."""
    tp: float
    cp_ring: float
    cp_exposed: float


def _rank_sums(times: list[StageTimes], m: int) -> _RankSums:
    return _RankSums(busy=m * sum(t.forward + t.backward for t in times),
                     cpu_busy=m * sum(t.forward + t.backward - t.tp_wire for t in times),
                     wire=m * sum(t.tp_wire for t in times),
                     last_backward=sum(t.backward for t in times),
                     last_backward_matmul=sum(t.backward_matmul for t in times),
                     tp=m * sum(t.tp_comm for t in times),
                     cp_ring=m * sum(t.cp_ring for t in times),
                     cp_exposed=m * sum(t.cp_exposed for t in times))


@dataclass(frozen=True)
class _Parts:
    """What every pricing of a plan shares: per-stage times and per-pipeline-rank sums."""

    times: list[StageTimes]
    p2p: float
    """What a pipeline message adds between two ranks' actions (0 where it blocks a rank:
    then it is in the actions' times)."""
    message: float
    ranks: list[_RankSums]
    busy: list[float]
    cpu_busy: list[float]
    wire: list[float]
    optimizer: list[float]


def _parts(plan: JobPlan, device: Device, rank_devices: Optional[Sequence[Device]] = None
           ) -> _Parts:
    # Zero-bubble schedules split every stage's backward but the first's (it has no input
    # gradient to hurry: its I is empty and its W the whole backward).
    splits = schedule_splits_backward(plan.schedule.name)
    edges = (0, plan.cfg.model.layers + 1)
    on = rank_devices or [device] * plan.layout.pp  # each pipeline rank's device
    known: dict = {}  # stages alike in layers, edges and split cost alike (searches: 128)
    keys = []
    for stage in plan.stages:
        split = splits and stage.index > 0
        key = (len(stage.blocks), *(edge in stage.blocks for edge in edges), split,
               on[stage.pp_rank].name)
        if key not in known:
            known[key] = stage_times(plan, on[stage.pp_rank], stage.blocks, split=split)
        keys.append(key)
    message, gather = _p2p_time(plan, device)
    link_p2p = message
    if device.blocking_p2p and plan.layout.pp > 1:
        # the rank waits for each exchange: one after each forward and backward of a chunk
        forward, backward = blocking_exchanges_s(plan, device, message, gather)
        known = {key: dc_replace(t, forward=t.forward + forward,
                                 backward=t.backward + backward)
                 for key, t in known.items()}
        link_p2p = 0.0
    m = plan.schedule.microbatches
    alike: dict = {}  # ranks whose stages are alike sum alike (a search's pp=128: 2-3 kinds)
    ranks = []
    for stage_indices in plan.by_rank:
        kinds = tuple(keys[s] for s in stage_indices)
        if kinds not in alike:
            alike[kinds] = _rank_sums([known[kind] for kind in kinds], m)
        ranks.append(alike[kinds])
    times = [known[key] for key in keys]
    saved = overlap_savings(plan, times) if not device.host else [0.0] * len(ranks)
    return _Parts(
        times=times, p2p=link_p2p, message=message, ranks=ranks,
        busy=[r.busy - s for r, s in zip(ranks, saved)], cpu_busy=[r.cpu_busy for r in ranks],
        wire=[r.wire for r in ranks],
        optimizer=[est.optimizer_bytes / 8 * d.optimizer_s_per_param
                   for est, d in zip(plan.memory, on)])


def simulates(plan: JobPlan) -> bool:
    """Whether ``predict_step`` simulates this plan's schedule (else: its closed form)."""
    return plan.layout.pp * plan.layout.vpp * plan.schedule.microbatches <= SIMULATE_UP_TO


def predict_step(plan: JobPlan, device: Device, simulated: bool = True,
                 rank_devices: Optional[Sequence[Device]] = None) -> StepPrediction:
    """The step time of ``plan`` on ``device``: the simulated pipeline (above
    ``SIMULATE_UP_TO``, or with ``simulated=False`` for ranking many layouts fast, its
    closed-form bubble) plus the DP reduction that the backward does not hide and the
    optimizer step; on shared CPU cores, at least the node's work over its cores.
    ``rank_devices``: one device per pipeline rank whose stages compute on it
    (``cost.node_devices``); the links stay ``device``'s."""
    parts = _parts(plan, device, rank_devices)
    if simulated and simulates(plan):
        makespan = simulated_makespan(plan, parts.times, parts.p2p, overlap=not device.host)
    else:
        makespan = max(parts.busy) + closed_form_bubble(plan, parts.times, parts.p2p)
    return _prediction(plan, device, parts, makespan,
                       simulated=simulated and simulates(plan))


def step_lower_bound(plan: JobPlan, device: Device) -> float:
    """A step time no schedule of this plan can beat, for any order of its actions, and so
    never above ``predict_step``'s simulated time: the search simulates layouts in the order
    of this bound and stops when it passes the best found (an exact search, without
    simulating them all). ``tests/test_search.py`` checks the bound against the simulation."""
    return closed_form_and_bound(plan, device)[1]


def closed_form_and_bound(plan: JobPlan, device: Device) -> tuple[StepPrediction, float]:
    """``predict_step(plan, device, simulated=False)`` and ``step_lower_bound``, sharing the
    per-stage times (the search prices thousands of layouts)."""
    parts = _parts(plan, device)
    closed = _prediction(plan, device, parts,
                         max(parts.busy) + closed_form_bubble(plan, parts.times, parts.p2p),
                         simulated=False)
    lowest = makespan_lower_bound(plan, parts.times, parts.p2p, parts.busy)
    bound = _prediction(plan, device, parts, lowest, simulated=False)
    return closed, bound.step_time_s


def _prediction(plan: JobPlan, device: Device, parts: _Parts, makespan: float,
                simulated: bool) -> StepPrediction:
    cfg, layout = plan.cfg, plan.layout
    busiest = max(range(layout.pp), key=parts.busy.__getitem__)
    dp_link = link_for(plan, device, "dp")
    last_backward = [r.last_backward for r in parts.ranks]
    dp_s, dp_exposed, dp_rank = dp_times(plan, device, dp_link, last_backward, makespan)
    if device.cores or device.dp_after_backward:
        # gloo reduces on the cores that compute (the link was measured with every rank of
        # the node reducing at once), and some software reduces only after the last
        # backward: nothing of it hides behind the backward.
        dp_exposed = dp_s
    contention = _contention(parts.ranks[dp_rank], dp_s - dp_exposed, device)
    optimizer = parts.optimizer
    tied = tied_grads_s(plan, device)
    step = max(makespan + dp_exposed + contention + tied + max(optimizer),
               _shared_cores_time(plan, device,
                                  [b + o for b, o in zip(parts.cpu_busy, optimizer)],
                                  max(parts.wire)) + dp_exposed)
    return StepPrediction(
        step_time_s=step, compute_s=parts.busy[busiest],
        bubble_s=makespan - parts.busy[busiest],
        tp_s=parts.ranks[busiest].tp, pp_s=parts.message, dp_s=dp_s,
        dp_exposed_s=dp_exposed, optimizer_s=max(optimizer), dp_contention_s=contention,
        tied_s=tied,
        tflops_per_device=(paper_flops_per_step(cfg) / step / layout.world_size / 1e12
                           if step else 0.0),
        mem_bytes_per_rank=max(est.total_bytes for est in plan.memory),
        cp_s=parts.ranks[busiest].cp_ring, cp_exposed_s=parts.ranks[busiest].cp_exposed,
        schedule_simulated=simulated)


def _contention(rank: _RankSums, hidden: float, device: Device) -> float:
    """The multiplies' time lost beside ``hidden`` seconds of reduction: the SMs the collective
    holds, over the share of the backward that multiplies (element-wise kernels are bound by
    memory, which the remaining SMs still saturate). A reduction delayed a step hides behind
    the next step's forward too; the backward's share stands for both."""
    if not hidden or not device.collective_sm_share or not rank.last_backward:
        return 0.0
    return hidden * device.collective_sm_share * rank.last_backward_matmul / rank.last_backward


def _shared_cores_time(plan: JobPlan, device: Device, work: list[float], wire: float
                       ) -> float:
    """With more ranks on a node than cores (``device.cores``), the node cannot finish before
    its cores have done every rank's work: each pipeline rank's compute, TP call overheads
    and optimizer step (the same for all its DP and TP peers), and gloo's CPU for each
    pipeline message, over the cores at the share of their throughput that many ranks keep.
    Waiting on a TP ring is not work, but the ranks of one TP group wait together: only the
    node's other TP groups (or, in a group larger than the cores, its members that are not
    running) can use the cores meanwhile, so ``wire / groups`` of it stays exposed."""
    if not device.cores or plan.priced_ranks_per_node <= device.cores:
        return 0.0
    layout = plan.layout
    nodes = max(1, layout.world_size // plan.priced_ranks_per_node)
    groups = max(1.0, plan.priced_ranks_per_node / min(layout.tp, device.cores))
    rate = device.cores * device.sharing_efficiency(plan.priced_ranks_per_node)
    # one message each way per micro-batch across each boundary between virtual stages
    messages = 2 * plan.schedule.microbatches * (layout.pp * layout.vpp - 1)
    replica = sum(work) + messages * device.collective_cpu_s
    return layout.dp * layout.cp * layout.tp * replica / nodes / rate + wire / groups


def _p2p_time(plan: JobPlan, device: Device) -> tuple[float, float]:
    """One activation (or its gradient) to the next stage, and the gather in it. With
    sequence parallelism a TP rank holds and sends ``1 / tp`` of it; without, between nodes,
    software that scatters it (``p2p_scatter_gather``: each TP rank sends ``1 / tp`` over its
    own NIC) gathers it back over the node's link (Narayanan et al. 2021, section 4.1); some
    sends each tensor's shape first (``p2p_meta_messages``: a latency each)."""
    if plan.layout.pp == 1:
        return 0.0, 0.0
    cfg, tp = plan.cfg, plan.layout.tp
    nbytes = (cfg.train.micro_batch * cfg.model.seq_len // plan.layout.cp * cfg.model.hidden
              * BYTES[cfg.train.precision])
    link = link_for(plan, device, "pp")
    gather = 0.0
    if cfg.parallel.sequence_parallel:
        nbytes /= tp
    elif device.p2p_scatter_gather and tp > 1 and link is device.inter:
        nbytes /= tp
        gather = ring_gather(nbytes * tp, tp, device.intra_for(tp))
    per_message = link.latency + device.collective_overhead_s
    return (nbytes / link.bandwidth + per_message * (1 + device.p2p_meta_messages) + gather,
            gather)
