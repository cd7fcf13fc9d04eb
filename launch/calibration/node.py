"""What ``hybrid-plan calibrate``'s ranks time of the node as a whole (``launch.calibration.calibrate``
fits the device to it): how much of the cores' throughput ranks sharing them keep, and what a
zero-bubble schedule's split backward costs over the whole one. Runs inside
``hybrid.testing.spawn``'s processes, like ``launch.calibration.ranks``."""

from __future__ import annotations

import statistics

from launch.calibration.ranks import ALTERNATIONS, SEQ, TP_SHAPE, median_seconds, own_group

STACK_LAYERS = 4
"""Layers in the stack timed for the node's sharing and the split backward: several, so that
each rank's weights and activations fill the caches as a model's do."""


def _stack(world: int, rank: int):
    """A stack of ``STACK_LAYERS`` of hybrid's layers at ``TP_SHAPE`` (one rank's own) and an
    input for it."""
    import torch

    from hybrid.planning.config import ModelConfig
    from hybrid.model.blocks import TransformerLayer

    hidden, rows = TP_SHAPE
    own = own_group(rank, world)
    m = ModelConfig(hidden=hidden, heads=hidden // 64, seq_len=SEQ)
    layers = torch.nn.Sequential(*(
        TransformerLayer(m, own, generator=torch.Generator().manual_seed(i),
                         sequence_parallel=False) for i in range(STACK_LAYERS)))
    return layers, torch.randn(SEQ, rows // SEQ, hidden, requires_grad=True)


def node_sharing(rank: int, world: int, min_seconds: float, cores: int) -> dict:
    """How the node's cores fare when ranks share them, on one thread per rank:

    - ``"efficiency"``: by ranks running (``cores``, ``2 * cores``, ... up to ``world``), the
      node's layer throughput over what ``cores`` ranks get (context switches, caches);
    - ``"split_backward"``: a stage's backward split into ``I`` and a later ``W`` (two
      micro-batches: both ``I``, then both ``W``, as a zero-bubble schedule defers them) over
      the whole backward ``B``, with every core busy.

    Each figure is timed in turn ``ALTERNATIONS`` times (the median kept); ranks not running
    wait in a barrier, which costs no CPU. Rank 0's answer is the one kept."""
    import torch
    import torch.distributed as dist

    from hybrid.pipeline.backward import full_backward, input_backward

    torch.set_num_threads(1)
    layers, x = _stack(world, rank)
    grad = torch.ones(SEQ, x.shape[1], x.shape[2])
    counts = [n for n in (cores * 2 ** k for k in range(8)) if n <= world]

    def fused() -> None:
        for _ in range(2):
            full_backward(layers(x), grad)

    def split() -> None:
        inputs = [x.detach().requires_grad_() for _ in range(2)]
        pending = [input_backward(layers(i), grad, i)[1] for i in inputs]
        for weights in pending:
            weights.run()

    fused()
    split()  # warm-up
    rates, ratios = {n: [] for n in counts}, []
    for _ in range(ALTERNATIONS):
        for n in counts:
            rates[n].append(_node_rate(fused, rank < n, min_seconds / ALTERNATIONS))
        dist.barrier()
        if rank < cores:
            ratios.append(median_seconds(split, min_seconds / ALTERNATIONS)
                          / median_seconds(fused, min_seconds / ALTERNATIONS))
        dist.barrier()
    base = statistics.median(rates[cores])
    return {"efficiency": {str(n): statistics.median(r) / base for n, r in rates.items()},
            "split_backward": statistics.median(ratios) if ratios else 1.0}


def _node_rate(work, running: bool, min_seconds: float) -> float:
    """Runs of ``work`` per second summed over the ranks that run it (the rest wait)."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    rate = torch.tensor([1.0 / median_seconds(work, min_seconds) if running else 0.0],
                        dtype=torch.float64)
    dist.all_reduce(rate)
    return float(rate.item())
