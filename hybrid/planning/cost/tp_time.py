"""Tensor parallelism's collectives on one pipeline stage, as hybrid's layers make them
(pure: no torch; ``hybrid.planning.cost.steptime`` prices them with the device's cost per
call)."""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.planning.cost.collectives import ring_all_reduce, ring_gather
from hybrid.planning.cost.devices import Device, Link
from hybrid.planning.job import JobPlan


@dataclass(frozen=True)
class TpTraffic:
    """One micro-batch's TP collectives on one stage: (ring seconds, calls) of each pass."""

    forward: tuple[float, int]
    backward: tuple[float, int]
    layers: tuple[float, int]
    """The layers' share of one pass (what full recompute runs again)."""


def tp_traffic(plan: JobPlan, device: Device, link: Link, blocks: range, act: float,
               layers: int) -> TpTraffic:
    """The collectives hybrid's model makes (``act``: one activation's bytes): after attention
    and after the MLP an all-reduce, or with sequence parallelism an all-gather before and a
    reduce-scatter after, in each pass; the vocabulary-parallel embedding sums its shards
    (SP: reduce-scatters them, and all-gathers their gradient back); cross entropy gathers
    three figures per token from each vocabulary shard (SP: after the sequence is gathered
    for the head), and the head's input gradient is summed (SP: reduce-scattered). SP's one
    all-reduce a step of its norms' gradients is not counted."""
    cfg, tp, cp = plan.cfg, plan.layout.tp, plan.layout.cp
    if tp == 1:
        return TpTraffic((0.0, 0), (0.0, 0), (0.0, 0))
    m, b, sp = cfg.model, cfg.train.micro_batch, cfg.parallel.sequence_parallel
    gather = ring_gather(act, tp, link) * device.all_gather_factor
    scatter = ring_gather(act, tp, link) * device.reduce_scatter_factor
    reduce = ring_all_reduce(act, tp, link)
    per_layer = (2 * (gather + scatter), 4) if sp else (2 * reduce, 2)
    layer_part = (layers * per_layer[0], layers * per_layer[1])
    forward, backward = [list(layer_part), list(layer_part)]

    def add(to: list, seconds: float) -> None:
        to[0] += seconds
        to[1] += 1

    if 0 in blocks:
        add(forward, scatter if sp else reduce)
        if sp:
            add(backward, gather)
    if m.layers + 1 in blocks:
        if sp:
            add(forward, gather)
        add(forward, ring_gather(tp * 12 * b * m.seq_len / cp, tp, link)
            * device.all_gather_factor)
        add(backward, scatter if sp else reduce)
    return TpTraffic(tuple(forward), tuple(backward), layer_part)
