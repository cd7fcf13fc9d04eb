"""The pipeline part of a job's plan: which blocks each stage holds and what the schedule costs.

Pure (no torch): used by ``hybrid-plan`` and by the training loop to build its stages.
"""

from __future__ import annotations

import functools

from hybrid.config import Config
from hybrid.cost import block_params
from hybrid.pipeline.partition import format_partition, partition
from hybrid.pipeline.schedules import build_schedule
from hybrid.pipeline.simulate import Costs, simulate
from hybrid.validate import microbatches


def block_costs(cfg: Config) -> list[float]:
    """Per-block cost for the balanced partitioner: parameters on one TP rank (the head's
    output matrix counts even when tied, since the last stage computes with it)."""
    m = cfg.model
    return [float(b.total) for b in block_params(m, head_owns_embedding_copy=True)]


def partition_for_config(cfg: Config) -> list[range]:
    """Contiguous block ranges, one per virtual stage (stage s on rank s % pp)."""
    par = cfg.parallel
    return partition(block_costs(cfg), par.pp, par.vpp, mode=par.partition)


@functools.lru_cache(maxsize=64)
def _unit_cost_simulation(schedule: str, pp: int, m: int, vpp: int):
    """One simulation per schedule shape: the memory check's candidate layouts share most."""
    return simulate(build_schedule(schedule, pp, m, vpp=vpp), pp, m, vpp=vpp, costs=Costs())


def schedule_summary(cfg: Config) -> dict:
    """Stage map and simulated schedule (unit costs F=1, B=2 / I=W=1, no p2p time)."""
    par = cfg.parallel
    stages = partition_for_config(cfg)
    m = microbatches(cfg)
    result = _unit_cost_simulation(par.schedule, par.pp, m, par.vpp)
    return {
        "stages": {"blocks": [list(r) for r in stages],
                   "lines": format_partition(stages, par.pp, cfg.model.layers).splitlines()},
        "schedule": {"name": par.schedule, "microbatches": m,
                     "bubble_fraction": result.bubble_fraction,
                     "bubble_fraction_per_rank": list(result.bubble_per_rank),
                     "peak_inflight": list(result.peak_inflight)},
    }
