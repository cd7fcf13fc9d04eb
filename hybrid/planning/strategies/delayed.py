"""One-step-delayed gradients (pure): ``parallel.dp_delay=1``. Step ``t`` starts its gradients'
all-reduce (the exact bytes) and applies step ``t-1``'s mean, so the reduction runs during the
whole next step and only what exceeds it shows; the mean in flight is one fp32 copy of the
gradients, kept between steps and checkpointed. Runtime: ``hybrid.dp.replicas.DelayedMean``."""

from __future__ import annotations

import math

from hybrid.planning.cost.collectives import ring_all_reduce
from hybrid.planning.cost.state_bytes import FP32
from hybrid.planning.strategies.base import ReductionSpec
from hybrid.planning.strategies.registry import register_reduction


class Delayed(ReductionSpec):
    name, runtime = "delayed", "hybrid.dp.replicas:DelayedMean"
    grad_width, shardings = FP32, (0,)
    checkpoint_fields = ("dp_delay",)
    state_by_parameter = False  # the mean in flight is each bucket's flat buffer
    doc = "the mean applied one step late, its all-reduce overlapping the next step"

    def setting(self, options):
        return f"dp_delay={options.delay}" if options.delay else None

    def field_problem(self, options):
        if options.delay not in (0, 1):
            return f"parallel.dp_delay={options.delay!r} is unknown; choose 0 or 1"
        return None

    def time(self, traffic, timing, options, sharding):
        params = sum(math.prod(shape) for shape, _ in traffic.shapes)
        total = ring_all_reduce(FP32 * params, traffic.dp, timing.link,
                                max(1, len(traffic.buckets())))
        return total, max(0.0, total - timing.makespan)

    def state_bytes(self, traffic, options):
        return FP32 * sum(math.prod(shape) for shape, _ in traffic.shapes)

    def choices(self):
        return [("delay 1", {"dp_delay": 1})]


DELAYED = register_reduction(Delayed())
