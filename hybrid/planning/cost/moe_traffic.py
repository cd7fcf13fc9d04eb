"""The experts' all-to-all (pure: no torch): the bytes a rank sends over its expert-parallel
group, as ``hybrid.comm.CommCounter`` counts them (``comm_bytes["ep"]``), at an even load.

Per MoE layer and micro-batch a rank routes its ``T`` tokens (every TP rank all of its
chunk's: gathered under sequence parallelism), ``k`` slots each; at an even load each of the
``E`` experts gets ``T k / E`` slots (capped by the capacity when tokens are dropped), and the
slots of the ``E (ep - 1) / ep`` experts held elsewhere travel. The forward sends them there
(dispatch: the hidden rows, fp32) and their outputs back (combine: fp32, bf16 under bf16
autocast), after an all-to-all of the ``E`` slot counts (int64); the backward sends the same
rows' gradients both ways. The real load is the router's, so a training step's figure differs
by how uneven it is (``metrics.jsonl``: ``moe.load_max_over_mean``); ``bench/moe_dispatch.py``
routes evenly and counts exactly this.
"""

from __future__ import annotations

import math

COUNT_BYTES = 8
"""An expert's slot count (int64)."""


def travelling_slots(tokens: int, topk: int, experts: int, ep: int,
                     capacity_factor=None) -> float:
    """Token slots a rank sends to other ranks per MoE layer and micro-batch, at an even
    load."""
    per_expert = tokens * topk / experts
    if capacity_factor is not None:
        per_expert = min(per_expert, math.ceil(capacity_factor * tokens * topk / experts))
    return per_expert * (experts - experts // ep)


def a2a_layer_bytes(*, tokens: int, hidden: int, topk: int, experts: int, ep: int,
                    out_bytes: int = 4, backward: bool = True, capacity_factor=None) -> float:
    """Bytes one rank sends over its expert group for one MoE layer and micro-batch: the
    counts, the dispatch (fp32 rows) and the combine (``out_bytes`` per element), and with
    ``backward`` their gradients back the other way."""
    if ep == 1:
        return 0.0
    rows = travelling_slots(tokens, topk, experts, ep, capacity_factor) * hidden
    counts = COUNT_BYTES * (experts - experts // ep)
    forward = counts + rows * (4 + out_bytes)
    return forward + (rows * (4 + out_bytes) if backward else 0.0)


def a2a_step_bytes(cfg, layout, moe_layers: int, microbatches: int) -> float:
    """Bytes a rank holding ``moe_layers`` MoE layers sends over its expert group in one
    training step at an even load (a full recompute runs each forward's exchange twice)."""
    m = cfg.model
    if layout.ep == 1 or not moe_layers:
        return 0.0
    tokens = cfg.train.micro_batch * m.seq_len // layout.cp
    out_bytes = 2 if cfg.train.precision == "bf16" else 4
    each = a2a_layer_bytes(tokens=tokens, hidden=m.hidden, topk=m.moe.topk,
                           experts=m.moe.experts, ep=layout.ep, out_bytes=out_bytes,
                           capacity_factor=m.moe.capacity_factor)
    if m.recompute == "full":
        each += a2a_layer_bytes(tokens=tokens, hidden=m.hidden, topk=m.moe.topk,
                                experts=m.moe.experts, ep=layout.ep, out_bytes=out_bytes,
                                backward=False, capacity_factor=m.moe.capacity_factor)
    return each * moe_layers * microbatches


def a2a_times(cfg, layout, link, moe_layers: int) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch's exchanges on a rank holding
    ``moe_layers`` MoE layers, at an even load over ``link`` (a ``devices.Link``): each
    all-to-all's bytes at the link's bandwidth and ``ep - 1`` latencies (a pairwise exchange);
    under a full recompute the backward holds the forward's exchange a second time.
    The experts' compute is in the layer's FLOPs already: dropless at an even load, a rank's
    experts compute as many slots as its own tokens have."""
    m, ep = cfg.model, layout.ep
    if ep == 1 or not moe_layers:
        return 0.0, 0.0
    tokens = cfg.train.micro_batch * m.seq_len // layout.cp
    out_bytes = 2 if cfg.train.precision == "bf16" else 4
    forward = a2a_layer_bytes(tokens=tokens, hidden=m.hidden, topk=m.moe.topk,
                              experts=m.moe.experts, ep=ep, out_bytes=out_bytes, backward=False,
                              capacity_factor=m.moe.capacity_factor)
    both = a2a_layer_bytes(tokens=tokens, hidden=m.hidden, topk=m.moe.topk,
                           experts=m.moe.experts, ep=ep, out_bytes=out_bytes,
                           capacity_factor=m.moe.capacity_factor)
    calls_forward, calls_backward = 3, 2  # counts, dispatch, combine; their gradients
    time_forward = forward / link.bandwidth + calls_forward * (ep - 1) * link.latency
    time_backward = (both - forward) / link.bandwidth + calls_backward * (ep - 1) * link.latency
    if m.recompute == "full":  # the backward re-runs the forward, its exchange included
        time_backward += time_forward
    return moe_layers * time_forward, moe_layers * time_backward
