"""bf16 compression (pure): the exact reduction's collectives on bf16 copies of the gradients,
half the bytes, accumulated back into fp32 (``parallel.dp_compress=bf16``; with ZeRO-1 the
reduce-scatter is bf16, the parameter all-gather stays fp32). Runtime:
``hybrid.dp.reduce.Bf16Mean``."""

from __future__ import annotations

import math
from dataclasses import replace

from hybrid.planning.strategies.base import BF16, ReductionSpec
from hybrid.planning.strategies.registry import register_reduction


class Bf16(ReductionSpec):
    name, runtime = "bf16", "hybrid.dp.reduce:Bf16Mean"
    grad_width, shardings = BF16, (0, 1)
    doc = "the same collectives on bf16 copies: half the bytes, one rounding per contribution"

    def setting(self, options):
        return "dp_compress=bf16" if options.compress == self.name else None

    def time(self, traffic, timing, options, sharding):
        params = sum(math.prod(shape) for shape, _ in traffic.shapes)
        return sharding.time(traffic, replace(timing, params=params), self.grad_width)

    def choices(self):
        return [("bf16", {"dp_compress": "bf16"})]


BF16_COMPRESSION = register_reduction(Bf16())
