"""One micro-batch of one pipeline stage on one rank: its forward and backward seconds
(pure: no torch; ``hybrid.planning.cost.steptime`` sums them per rank and simulates the
schedule on them).

The multiplies run at the device's achieved rate for the work's width per TP rank and its
tokens per micro-batch (on CPU, the threads each rank gets); memory-bound kernels at the
memory bandwidth (``memory_bound``); TP collectives (``tp_time``), context parallelism's ring
(``context_time``) and the experts' all-to-all (``moe_traffic``) over the link each group
crosses (``link_for``: inside a node, or between nodes on as many NICs as the group has
members a node).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.planning.cost.context_time import ring_times
from hybrid.planning.cost.devices import Device, Link
from hybrid.planning.cost.flops import (
    attention_core_flops, block_forward_flops, head_forward_flops,
)
from hybrid.planning.cost.memory_bound import stage_memory_bound
from hybrid.planning.cost.moe_traffic import a2a_times
from hybrid.planning.cost.sizes import BYTES
from hybrid.planning.cost.tp_time import tp_traffic
from hybrid.planning.job import JobPlan


def link_for(plan: JobPlan, device: Device, axis: str) -> Link:
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
class StageTimes:
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
    comm_forward: float = 0.0
    """Of ``forward``, communication (TP collectives, the experts' all-to-all, the exposed
    CP ring): what another stream's compute can hide (``makespan.pair_time``)."""
    comm_backward: float = 0.0
    """Likewise of ``backward``."""
    backward_matmul: float = 0.0
    """Of ``backward``, the multiplies (a recomputed forward's too): what runs slower beside
    a collective that holds some of the SMs (``Device.collective_sm_share``)."""


def stage_times(plan: JobPlan, device: Device, blocks: range, split: bool = False
                 ) -> StageTimes:
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
    compute = sum(n * (flops / tp / cp / rate * device.tp_compute_factor(tp))
                  for flops, n in _layer_flops(m, b, blocks).items())  # each layer its kind's
    layers_compute = compute
    ring = ring_times(cfg, plan.layout, link_for(plan, device, "cp"),
                      attention_core_flops(m, b) / tp / cp / rate, overlaps=not device.cores)
    if m.layers + 1 in blocks:
        compute += head_forward_flops(m, b) / tp / cp / rate
    traffic = tp_traffic(plan, device, link_for(plan, device, "tp"), blocks, act, layers)
    fwd_wire, fwd_calls, bwd_wire, bwd_calls = traffic.forward + traffic.backward
    call, call_cpu = (device.tp_call(tp, cfg.parallel.sequence_parallel) if tp > 1
                      else (0.0, 0.0))
    recompute_wire = recompute_calls = 0.0
    extra = 0.0
    bound = stage_memory_bound(cfg, tp, cp, device, blocks, layers,
                               attention_core_flops(m, b) / tp / cp / rate)
    matmul, recomputed = compute, 0.0
    compute += bound.forward
    if m.recompute == "full":
        recomputed = layers_compute
        extra = recomputed + bound.forward
        recompute_wire, recompute_calls = traffic.layers
    elif m.recompute == "selective" and cp == 1:  # context attention is not recomputed
        recomputed = layers * attention_core_flops(m, b) / tp / rate
        extra = recomputed + bound.scores
    tp_fwd, tp_bwd = fwd_wire + fwd_calls * call, bwd_wire + bwd_calls * call
    a2a_fwd, a2a_bwd = _a2a_times(plan, device, blocks)  # the experts' all-to-all (ep > 1)
    recompute_comm = recompute_wire + recompute_calls * call
    all_calls = fwd_calls + bwd_calls + recompute_calls
    factor = device.split_backward_factor if split else 1.0
    backward_compute = (2 * matmul + bound.backward) * factor
    return StageTimes(forward=compute + tp_fwd + layers * ring.forward_exposed_s + a2a_fwd,
                       backward=(backward_compute + tp_bwd + extra + recompute_comm
                                 + layers * ring.backward_exposed_s + a2a_bwd),
                       tp_comm=tp_fwd + tp_bwd + recompute_comm,
                       tp_wire=(fwd_wire + bwd_wire + recompute_wire
                                + all_calls * (call - call_cpu)),
                       cp_ring=layers * (ring.forward_s + ring.backward_s),
                       cp_exposed=layers * (ring.forward_exposed_s + ring.backward_exposed_s),
                       comm_forward=tp_fwd + a2a_fwd + layers * ring.forward_exposed_s,
                       comm_backward=(tp_bwd + recompute_comm + a2a_bwd
                                      + layers * ring.backward_exposed_s),
                       backward_matmul=2 * matmul * factor + recomputed)


def _layer_flops(m, b: int, blocks: range) -> dict[float, int]:
    """How many of ``blocks``' layers have each forward FLOP count (dense and MoE layers
    differ; alike layers are summed as a product, as they were before layers had kinds)."""
    if not m.moe.experts:  # every layer alike
        layers = sum(1 for block in blocks if 1 <= block <= m.layers)
        return {block_forward_flops(m, b, 1): layers} if layers else {}
    counts: dict[float, int] = {}
    for block in blocks:
        if 1 <= block <= m.layers:
            flops = block_forward_flops(m, b, block)
            counts[flops] = counts.get(flops, 0) + 1
    return counts


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


def threads_per_rank(plan: JobPlan, device: Device) -> int:
    """The threads each rank computes with: ``launcher.omp_threads``, else the node's cores
    shared out as ``hybrid-train`` does (one on a device of its own)."""
    if not device.cores:
        return 1
    return plan.cfg.launcher.omp_threads or max(1, device.cores // plan.priced_ranks_per_node)
