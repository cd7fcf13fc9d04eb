"""PowerSGD (pure; Vogels et al. 2019, the algorithm of torch DDP's ``powerSGD_hook``):
``parallel.dp_compress=powersgd``. Per bucket, one all-reduce of the tensors left
uncompressed and one each of the low-rank factors ``P`` (``n x r``) and ``Q`` (``m x r``) of
every matrix that compression shrinks at least ``MIN_COMPRESSION`` times (torch's rule, with a
tensor viewed as ``shape[0] x rest``); exact for the first ``powersgd_warmup`` steps. The
rest and ``P`` overlap the backward; the ``Q`` all-reduce and the factor arithmetic (three
``n x m x r`` products per matrix) come after it. Runtime: ``hybrid.dp.powersgd.PowerSGD``."""

from __future__ import annotations

import math

from hybrid.planning.cost.state_bytes import FP32
from hybrid.planning.strategies.base import ReductionSpec, Shape, all_reduce_bytes
from hybrid.planning.strategies.registry import register_reduction

MIN_COMPRESSION = 2


def as_matrix(shape: Shape) -> tuple[int, int]:
    """How PowerSGD views a gradient: ``shape[0]`` rows, everything else as columns."""
    return shape[0], math.prod(shape[1:])


def compresses(shape: Shape, rank: int) -> bool:
    """Whether PowerSGD factors this gradient: a matrix whose two factors are at least
    ``MIN_COMPRESSION`` times smaller than it."""
    if len(shape) < 2:
        return False
    n, m = as_matrix(shape)
    return (n + m) * rank * MIN_COMPRESSION < n * m


class PowerSGD(ReductionSpec):
    name, runtime = "powersgd", "hybrid.dp.powersgd:PowerSGD"
    grad_width, shardings = None, (0,)
    checkpoint_fields = ("dp_compress", "powersgd_rank")
    doc = "rank-r factors of each gradient matrix with error feedback (Vogels et al. 2019)"

    def setting(self, options):
        return "dp_compress=powersgd" if options.compress == self.name else None

    def field_problem(self, options):
        for name, value, low in (("powersgd_rank", options.powersgd_rank, 1),
                                 ("powersgd_warmup", options.powersgd_warmup, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                return f"parallel.{name}={value!r} must be an integer >= {low}"
        return None

    def step_bytes(self, traffic, options, step, sharding):
        if not options.compressing(step):
            return sharding.gradient_bytes(traffic, FP32)
        return sum(_bucket_bytes(bucket, traffic.dp, options.powersgd_rank)
                   for bucket in traffic.buckets())

    def time(self, traffic, timing, options, sharding):
        dp, link, rank = traffic.dp, timing.link, options.powersgd_rank
        latency = 2 * (dp - 1) * link.latency * max(1, len(traffic.buckets()))
        first, second = _phases(traffic, rank)
        first, second = first / link.bandwidth + latency, second / link.bandwidth + latency
        flops = sum(6.0 * math.prod(s) * rank for s, _ in traffic.shapes if compresses(s, rank))
        arithmetic = flops / timing.device.compute_rate("fp32", timing.matmul_width, rank)
        return first + second + arithmetic, max(0.0, first - timing.backward) + second + arithmetic

    def state_bytes(self, traffic, options):
        """Error feedback (``n x m``) and warm-start ``Q`` (``m x r``) per compressed matrix."""
        r = options.powersgd_rank
        return sum(FP32 * (math.prod(s) + as_matrix(s)[1] * r) for s, _ in traffic.shapes
                   if compresses(s, r))

    def choices(self):
        return [(f"powersgd r{r}", {"dp_compress": "powersgd", "powersgd_rank": r})
                for r in (1, 2, 4)]


def _bucket_bytes(bucket: list[Shape], dp: int, rank: int) -> float:
    rest = sum(math.prod(s) for s in bucket if not compresses(s, rank))
    factors = [as_matrix(s) for s in bucket if compresses(s, rank)]
    total = all_reduce_bytes(FP32 * rest, dp) if rest else 0.0
    if factors:
        total += all_reduce_bytes(FP32 * rank * sum(n for n, _ in factors), dp)
        total += all_reduce_bytes(FP32 * rank * sum(m for _, m in factors), dp)
    return total


def _phases(traffic, rank: int) -> tuple[float, float]:
    """Wire bytes of (the exact rest and every ``P``, every ``Q``)."""
    first = second = 0.0
    for bucket in traffic.buckets():
        packed = [as_matrix(s) for s in bucket if compresses(s, rank)]
        rest = sum(math.prod(s) for s in bucket if not compresses(s, rank))
        first += all_reduce_bytes(FP32 * (rest + rank * sum(n for n, _ in packed)), traffic.dp)
        second += all_reduce_bytes(FP32 * rank * sum(m for _, m in packed), traffic.dp)
    return first, second


POWERSGD = register_reduction(PowerSGD())
