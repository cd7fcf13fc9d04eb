"""The pipeline part of a job's plan (``hybrid.planning.job``): which blocks each stage holds and the
schedule's simulated shape. Pure (no torch).
"""

from __future__ import annotations

import functools

from hybrid.planning.config import Config
from hybrid.planning.cost.sizes import block_params
from hybrid.planning.cost.block_costs import predicted_block_costs
from hybrid.planning.schedules.partition import partition
from hybrid.planning.schedules.builders import build_schedule, schedule_placement
from hybrid.planning.schedules.simulate import Costs, simulate


def block_costs(cfg: Config) -> list[float]:
    """Per-block cost for the partitioner. balanced: parameters on one TP rank (the head's
    output matrix counts even when tied, since the last stage computes with it). measured:
    the measured seconds of forward + backward, or the cost model's FLOPs until measured."""
    if cfg.parallel.partition == "measured":
        if cfg.parallel.block_costs is not None:
            return list(cfg.parallel.block_costs)
        return predicted_block_costs(cfg)
    m = cfg.model
    return [float(b.total) for b in block_params(m, head_owns_embedding_copy=True)]


def partition_for_config(cfg: Config) -> list[range]:
    """Contiguous block ranges, one per virtual stage in model order."""
    par = cfg.parallel
    return partition(block_costs(cfg), par.pp, par.vpp, mode=par.partition)


@functools.lru_cache(maxsize=64)
def simulate_unit_costs(schedule: str, pp: int, m: int, vpp: int):
    """The schedule simulated with unit costs (F=1, B=2, I=W=1, no p2p time); one simulation
    per schedule shape, since the memory check's candidate layouts share most."""
    return simulate(build_schedule(schedule, pp, m, vpp=vpp), pp, m, vpp=vpp, costs=Costs(),
                    placement=schedule_placement(schedule))


def closed_form_schedule(schedule: str, pp: int, m: int, vpp: int) -> tuple[float, tuple]:
    """(bubble fraction, peak in-flight micro-batches per rank) with unit costs, without
    simulating: what the simulator gives (tests/test_simulate.py checks them against it;
    zb-h1's bubble for m >= pp, zb-v's for m >= 2 * pp), for searching thousands of layouts whose simulations would
    take seconds each."""
    if schedule == "gpipe":
        peak = tuple([m] * pp)
    elif schedule == "interleaved-1f1b":
        peak = tuple(min(2 * (pp - r - 1) + (vpp - 1) * pp + 1, m * vpp) for r in range(pp))
    elif schedule == "zb-h1":
        peak = tuple([min(pp, m)] * pp)
    elif schedule == "zb-v":  # chunk pairs: 2 * pp of them are pp micro-batches of a stage
        peak = tuple(min(2 * pp, 2 * m, m + 1 + r) for r in range(pp))
    else:
        peak = tuple(min(pp - r, m) for r in range(pp))
    if schedule == "zb-h1":
        bubble = (pp - 1) / (3 * m + pp - 1)  # F=1 of each warm-up step stays idle
    elif schedule == "zb-v":
        bubble = (pp - 1) / (6 * m + pp - 1)  # one chunk's F per warm-up step, 2 chunks
    else:
        bubble = (pp - 1) / (m * vpp + pp - 1)
    return bubble, peak
