"""The pipeline part of a job's plan (``hybrid.job``): which blocks each stage holds and the
schedule's simulated shape. Pure (no torch).
"""

from __future__ import annotations

import functools

from hybrid.config import Config
from hybrid.cost import block_params
from hybrid.pipeline.partition import partition
from hybrid.pipeline.schedules import build_schedule
from hybrid.pipeline.simulate import Costs, simulate


def block_costs(cfg: Config) -> list[float]:
    """Per-block cost for the balanced partitioner: parameters on one TP rank (the head's
    output matrix counts even when tied, since the last stage computes with it)."""
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
    return simulate(build_schedule(schedule, pp, m, vpp=vpp), pp, m, vpp=vpp, costs=Costs())
