"""What context parallelism moves and costs (pure arithmetic, no torch).

Per layer and micro-batch a rank of a context group holds its keys and values for ``s / cp``
tokens: a block of ``2 * b * (s / cp) * (h / tp)`` fp32 values (``hybrid.model.context``
computes attention in fp32, so its blocks travel in fp32). Counted as ``hybrid.comm`` counts
(the bytes a rank sends):

- ``p2p``: the forward passes its block on ``cp - 1`` times; the backward passes keys and values
  ``cp - 1`` times and their gradients ``cp`` times (the last pass brings them home);
- ``allgather``: the forward all-gathers the blocks (``cp - 1`` blocks sent); the backward
  gathers them again and reduce-scatters their gradients (``cp - 1`` each).

Full recompute runs each layer's forward again in the backward, its ring included. Under
``p2p`` each pass runs behind one block of attention (``1 / cp`` of the rank's attention work)
and only what sticks out is exposed, plus the gradients' last pass, on devices whose messages
travel beside the compute (GPUs); on CPU cores nothing is hidden. The all-gather and the
reduce-scatter are exposed whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.planning.config import Config
from hybrid.planning.cost.collectives import ring_gather
from hybrid.planning.cost.devices import Link
from hybrid.planning.layout import Layout

BLOCK_DTYPE_BYTES = 4
"""The ring's blocks are fp32 whatever the precision (attention runs in fp32)."""


def kv_block_bytes(cfg: Config, layout: Layout) -> int:
    """One rank's keys and values of one layer and micro-batch."""
    m = cfg.model
    return (2 * cfg.train.micro_batch * (m.seq_len // layout.cp) * (m.hidden // layout.tp)
            * BLOCK_DTYPE_BYTES)


def blocks_sent(cfg: Config, layout: Layout) -> tuple[int, int]:
    """Blocks one rank sends per layer and micro-batch: (forward, backward)."""
    cp = layout.cp
    if cp == 1:
        return 0, 0
    forward = cp - 1
    backward = (cp - 1) + cp if cfg.parallel.cp_comm == "p2p" else 2 * (cp - 1)
    if cfg.model.recompute == "full":
        backward += forward
    return forward, backward


def cp_step_bytes(cfg: Config, layout: Layout, layers: int, microbatches: int,
                  moe_layers: int = 0) -> float:
    """Bytes a rank holding ``layers`` transformer layers (``moe_layers`` of them MoE layers)
    sends over its context group in one training step, as ``hybrid.comm.CommCounter`` counts
    them (``comm_bytes["cp"]``): the ring's, and with the load-balancing loss on, each MoE
    layer's sum of the experts' token counts over the sequence (``E`` fp32 per forward)."""
    forward, backward = blocks_sent(cfg, layout)
    ring = (forward + backward) * kv_block_bytes(cfg, layout) * layers * microbatches
    m, cp = cfg.model, layout.cp
    if cp == 1 or not (m.moe.experts and m.moe.aux_loss > 0):
        return float(ring)
    forwards = 2 if m.recompute == "full" else 1  # a recomputed forward sums them again
    counts = 2.0 * (cp - 1) / cp * 4 * m.moe.experts
    return float(ring) + counts * moe_layers * microbatches * forwards


@dataclass(frozen=True)
class RingTimes:
    """One layer and micro-batch: the ring's time in each pass, and what of it is exposed."""

    forward_s: float
    backward_s: float
    forward_exposed_s: float
    backward_exposed_s: float


def ring_times(cfg: Config, layout: Layout, link: Link, attention_s: float,
               overlaps: bool = True) -> RingTimes:
    """``attention_s``: this rank's forward attention-core seconds for one layer and
    micro-batch (the backward's is twice that). ``overlaps``: whether a message travels while
    the rank computes (a GPU's copy engines; not on CPU cores that gloo's transport shares
    with the compute: ``bench/cp_attention.py`` measures nothing hidden there)."""
    cp = layout.cp
    if cp == 1:
        return RingTimes(0.0, 0.0, 0.0, 0.0)
    block = kv_block_bytes(cfg, layout)
    if cfg.parallel.cp_comm == "allgather":
        gather = ring_gather(cp * block, cp, link)
        forward = gather
        backward = 2 * gather
        times = RingTimes(forward, backward, forward, backward)
    else:
        one_pass = block / link.bandwidth + link.latency
        per_block = attention_s / cp if overlaps else 0.0
        forward = (cp - 1) * one_pass
        backward = (2 * cp - 1) * one_pass  # keys and values, and their gradients, together
        times = RingTimes(
            forward, backward,
            forward_exposed_s=(cp - 1) * max(0.0, one_pass - per_block),
            backward_exposed_s=(cp - 1) * max(0.0, 2 * one_pass - 2 * per_block) + one_pass)
    if cfg.model.recompute == "full":
        times = RingTimes(times.forward_s, times.backward_s + times.forward_s,
                          times.forward_exposed_s,
                          times.backward_exposed_s + times.forward_exposed_s)
    return times
