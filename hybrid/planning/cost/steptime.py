"""Predicted step time of a planned job on a device (pure: no torch).

Each stage's compute comes from its FLOPs at the device's achieved rate; tensor-parallel
collectives (``tp_time``: the calls hybrid's layers make, each at the device's cost per call
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

from hybrid.planning.cost.collectives import ring_gather
from hybrid.planning.cost.context_time import ring_times
from hybrid.planning.cost.moe_traffic import a2a_times
from hybrid.planning.cost.devices import Device, Link
from hybrid.planning.cost.dp_time import dp_times
from hybrid.planning.cost.flops import (
    attention_core_flops, head_forward_flops, layer_forward_flops, paper_flops_per_step,
)
from hybrid.planning.cost.memory_bound import stage_memory_bound
from hybrid.planning.cost.sizes import BYTES
from hybrid.planning.cost.tp_time import tp_traffic
from hybrid.planning.job import JobPlan
from hybrid.planning.schedules.registry import schedule_splits_backward
from hybrid.planning.cost.makespan import (
    closed_form_bubble, makespan_lower_bound, simulated_makespan,
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
    schedule_simulated: bool = True
    """The makespan comes from simulating the schedule (else from its closed form)."""

    def to_dict(self) -> dict:
        return asdict(self)


def _link(plan: JobPlan, device: Device, axis: str) -> Link:
    """Between nodes, or inside one: there, as measured with as many processes as the node
    runs (on shared CPU cores the ranks that are not in the group still compete). A GPU
    group with ``g`` members on each node it spans crosses between nodes on ``g`` NICs at
    once (a DGX A100 has one 200 Gb/s HCA per GPU; NCCL spreads its rings over them), so
    its ring runs at ``g`` NICs' bandwidth, at most the node's own link's."""
    per_node = plan.priced_ranks_per_node
    if not plan.layout.crosses_nodes(axis, per_node):
        return device.intra_for(per_node)
    if device.cores or axis == "pp":  # a pipeline message leaves on its sender's NIC only
        return device.inter
    layout = plan.layout
    stride = layout.rank(**{axis: 1})  # consecutive members' distance in ranks
    members = min(layout.size(axis), per_node // stride) if stride < per_node else 1
    if members <= 1:
        return device.inter
    return Link(bandwidth=min(device.intra.bandwidth, members * device.inter.bandwidth),
                latency=device.inter.latency)


@dataclass(frozen=True)
class _StageTimes:
    forward: float
    backward: float
    tp_comm: float
    """TP collectives in both passes: their ring time and per-call overhead."""
    tp_wire: float
    """Of which waiting (ring time, and the calls' time that is not CPU work), which other
    ranks can fill on shared cores."""
    cp_ring: float = 0.0
    """Context parallelism's ring in both passes (its exposed part is in forward/backward)."""
    cp_exposed: float = 0.0


def _stage_times(plan: JobPlan, device: Device, blocks: range, split: bool = False
                 ) -> _StageTimes:
    """One micro-batch of one stage on one TP rank: forward and full backward seconds
    (``split``: as ``I`` + ``W``, at the device's ``split_backward_factor``). Under
    context parallelism a rank works on ``seq_len / cp`` tokens (zigzag: a ``1 / cp`` share of
    the attention too) and passes keys and values around its ring."""
    cfg, tp, cp = plan.cfg, plan.layout.tp, plan.layout.cp
    m, b = cfg.model, cfg.train.micro_batch
    rate = device.compute_rate(cfg.train.precision, m.hidden / tp, b * m.seq_len / cp,
                               threads_per_rank(plan, device))
    act = b * m.seq_len * m.hidden * BYTES[cfg.train.precision] / cp
    layers = sum(1 for block in blocks if 1 <= block <= m.layers)
    layer = layer_forward_flops(m, b) / tp / cp / rate * device.tp_compute_factor(tp)
    compute = layers * layer
    ring = ring_times(cfg, plan.layout, _link(plan, device, "cp"),
                      attention_core_flops(m, b) / tp / cp / rate, overlaps=not device.cores)
    if m.layers + 1 in blocks:
        compute += head_forward_flops(m, b) / tp / cp / rate
    traffic = tp_traffic(plan, device, _link(plan, device, "tp"), blocks, act, layers)
    fwd_wire, fwd_calls, bwd_wire, bwd_calls = traffic.forward + traffic.backward
    call, call_cpu = (device.tp_call(tp, cfg.parallel.sequence_parallel) if tp > 1
                      else (0.0, 0.0))
    recompute_wire = recompute_calls = 0.0
    extra = 0.0
    bound = stage_memory_bound(cfg, tp, cp, device, blocks, layers,
                               attention_core_flops(m, b) / tp / cp / rate)
    compute += bound.forward
    if m.recompute == "full":
        extra = layers * layer + bound.forward
        recompute_wire, recompute_calls = traffic.layers
    elif m.recompute == "selective" and cp == 1:  # context attention is not recomputed
        extra = layers * attention_core_flops(m, b) / tp / rate + bound.scores
    tp_fwd, tp_bwd = fwd_wire + fwd_calls * call, bwd_wire + bwd_calls * call
    a2a_fwd, a2a_bwd = _a2a_times(plan, device, blocks)  # the experts' all-to-all (ep > 1)
    recompute_comm = recompute_wire + recompute_calls * call
    all_calls = fwd_calls + bwd_calls + recompute_calls
    backward_compute = ((2 * (compute - bound.forward) + bound.backward)
                        * (device.split_backward_factor if split else 1.0))
    return _StageTimes(forward=compute + tp_fwd + layers * ring.forward_exposed_s + a2a_fwd,
                       backward=(backward_compute + tp_bwd + extra + recompute_comm
                                 + layers * ring.backward_exposed_s + a2a_bwd),
                       tp_comm=tp_fwd + tp_bwd + recompute_comm,
                       tp_wire=(fwd_wire + bwd_wire + recompute_wire
                                + all_calls * (call - call_cpu)),
                       cp_ring=layers * (ring.forward_s + ring.backward_s),
                       cp_exposed=layers * (ring.forward_exposed_s + ring.backward_exposed_s))


def _a2a_times(plan: JobPlan, device: Device, blocks: range) -> tuple[float, float]:
    """The experts' all-to-all in one micro-batch's forward and backward of ``blocks``
    (``hybrid.planning.cost.moe_traffic``), on the link its expert groups use."""
    m, layout = plan.cfg.model, plan.layout
    if layout.ep == 1:
        return 0.0, 0.0
    moe = sum(m.is_moe_layer(b) for b in blocks if 1 <= b <= m.layers)
    per_node = plan.priced_ranks_per_node
    crosses = any(len({r // per_node for r in g}) > 1 for g in layout.groups("ep"))
    link = device.inter if crosses else device.intra_for(per_node)
    return a2a_times(plan.cfg, layout, link, moe)


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
    tp: float
    cp_ring: float
    cp_exposed: float


def _rank_sums(times: list[_StageTimes], m: int) -> _RankSums:
    return _RankSums(busy=m * sum(t.forward + t.backward for t in times),
                     cpu_busy=m * sum(t.forward + t.backward - t.tp_wire for t in times),
                     wire=m * sum(t.tp_wire for t in times),
                     last_backward=sum(t.backward for t in times),
                     tp=m * sum(t.tp_comm for t in times),
                     cp_ring=m * sum(t.cp_ring for t in times),
                     cp_exposed=m * sum(t.cp_exposed for t in times))


@dataclass(frozen=True)
class _Parts:
    """What every pricing of a plan shares: per-stage times and per-pipeline-rank sums."""

    times: list[_StageTimes]
    p2p: float
    """What a pipeline message adds between two ranks' actions (0 where it blocks a rank:
    then it is in the actions' times)."""
    message: float
    ranks: list[_RankSums]
    busy: list[float]
    cpu_busy: list[float]
    wire: list[float]
    optimizer: list[float]


def _parts(plan: JobPlan, device: Device) -> _Parts:
    # Zero-bubble schedules split every stage's backward but the first's (it has no input
    # gradient to hurry: its I is empty and its W the whole backward).
    splits = schedule_splits_backward(plan.schedule.name)
    edges = (0, plan.cfg.model.layers + 1)
    known: dict = {}  # stages alike in layers, edges and split cost alike (searches: 128)
    keys = []
    for stage in plan.stages:
        split = splits and stage.index > 0
        key = (len(stage.blocks), *(edge in stage.blocks for edge in edges), split)
        if key not in known:
            known[key] = _stage_times(plan, device, stage.blocks, split=split)
        keys.append(key)
    message = _p2p_time(plan, device)
    link_p2p = message
    if device.blocking_p2p and plan.layout.pp > 1:
        # the rank waits for each exchange: one after each forward and backward of a chunk
        known = {key: dc_replace(t, forward=t.forward + message, backward=t.backward + message)
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
    return _Parts(
        times=[known[key] for key in keys], p2p=link_p2p, message=message, ranks=ranks,
        busy=[r.busy for r in ranks], cpu_busy=[r.cpu_busy for r in ranks],
        wire=[r.wire for r in ranks],
        optimizer=[est.optimizer_bytes / 8 * device.optimizer_s_per_param
                   for est in plan.memory])


def simulates(plan: JobPlan) -> bool:
    """Whether ``predict_step`` simulates this plan's schedule (else: its closed form)."""
    return plan.layout.pp * plan.layout.vpp * plan.schedule.microbatches <= SIMULATE_UP_TO


def predict_step(plan: JobPlan, device: Device, simulated: bool = True) -> StepPrediction:
    """The step time of ``plan`` on ``device``: the simulated pipeline (above
    ``SIMULATE_UP_TO``, or with ``simulated=False`` for ranking many layouts fast, its
    closed-form bubble) plus the DP reduction that the backward does not hide and the
    optimizer step; on shared CPU cores, at least the node's work over its cores."""
    parts = _parts(plan, device)
    if simulated and simulates(plan):
        makespan = simulated_makespan(plan, parts.times, parts.p2p)
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
    dp_link = _link(plan, device, "dp")
    last_backward = [r.last_backward for r in parts.ranks]
    dp_s, dp_exposed = dp_times(plan, device, dp_link, last_backward, makespan)
    if device.cores or device.dp_after_backward:
        # gloo reduces on the cores that compute (the link was measured with every rank of
        # the node reducing at once), and some software reduces only after the last
        # backward: nothing of it hides behind the backward.
        dp_exposed = dp_s
    optimizer = parts.optimizer
    step = max(makespan + dp_exposed + max(optimizer),
               _shared_cores_time(plan, device,
                                  [b + o for b, o in zip(parts.cpu_busy, optimizer)],
                                  max(parts.wire)) + dp_exposed)
    return StepPrediction(
        step_time_s=step, compute_s=parts.busy[busiest],
        bubble_s=makespan - parts.busy[busiest],
        tp_s=parts.ranks[busiest].tp, pp_s=parts.message, dp_s=dp_s,
        dp_exposed_s=dp_exposed, optimizer_s=max(optimizer),
        tflops_per_device=(paper_flops_per_step(cfg) / step / layout.world_size / 1e12
                           if step else 0.0),
        mem_bytes_per_rank=max(est.total_bytes for est in plan.memory),
        cp_s=parts.ranks[busiest].cp_ring, cp_exposed_s=parts.ranks[busiest].cp_exposed,
        schedule_simulated=simulated)


def threads_per_rank(plan: JobPlan, device: Device) -> int:
    """The threads each rank computes with: ``launcher.omp_threads``, else the node's cores
    shared out as ``hybrid-train`` does (one on a device of its own)."""
    if not device.cores:
        return 1
    return plan.cfg.launcher.omp_threads or max(1, device.cores // plan.priced_ranks_per_node)


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


def _p2p_time(plan: JobPlan, device: Device) -> float:
    """One activation (or its gradient) to the next stage. With sequence parallelism a TP rank
    holds and sends ``1 / tp`` of it; without, between nodes, software that scatters it
    (``p2p_scatter_gather``: each TP rank sends ``1 / tp`` over its own NIC) gathers it back
    over the node's link (Narayanan et al. 2021, section 4.1)."""
    if plan.layout.pp == 1:
        return 0.0
    cfg, tp = plan.cfg, plan.layout.tp
    nbytes = (cfg.train.micro_batch * cfg.model.seq_len // plan.layout.cp * cfg.model.hidden
              * BYTES[cfg.train.precision])
    link = _link(plan, device, "pp")
    gather = 0.0
    if cfg.parallel.sequence_parallel:
        nbytes /= tp
    elif device.p2p_scatter_gather and tp > 1 and link is device.inter:
        nbytes /= tp
        gather = ring_gather(nbytes * tp, tp, device.intra_for(tp))
    return nbytes / link.bandwidth + link.latency + device.collective_overhead_s + gather
