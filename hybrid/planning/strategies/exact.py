"""Exact reduction (pure): the fp32 mean of the replicas' gradients, every step, through the
sharding's collectives (all-reduce, or reduce-scatter under ZeRO). The default: selected when no
lossy option is. Runtime: ``hybrid.dp.reduce.ExactMean``."""

from __future__ import annotations

from hybrid.planning.cost.state_bytes import FP32
from hybrid.planning.strategies.base import ReductionSpec
from hybrid.planning.strategies.registry import register_reduction


class Exact(ReductionSpec):
    name, runtime = "exact", "hybrid.dp.reduce:ExactMean"
    exact, grad_width, shardings = True, FP32, (0, 1, 2, 3)
    doc = "the fp32 mean of every step's gradients (the 1-process model's)"


EXACT = register_reduction(Exact())
