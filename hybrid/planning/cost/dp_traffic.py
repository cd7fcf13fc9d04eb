"""What one rank sends over the gradient group and keeps for its DP strategies, per step
(pure: no torch). The strategies' specs (``hybrid.planning.strategies``) hold the rules; this
is where the job's numbers meet them.

Besides the gradients, every step all-reduces its loss (one float64) over the loss group, and
under a sharding stage the squared gradient norm (one float64) over the sharding group.
``hybrid.comm.CommCounter`` counts the same bytes (``wire_bytes``: ring all-reduce
``2(d-1)/d·n``, reduce-scatter and all-gather ``(d-1)/d·n``); the end-to-end tests assert they
agree every step.
"""

from __future__ import annotations

from typing import Optional

from hybrid.planning.strategies import (
    SCALAR, DpOptions, RankTraffic, all_reduce_bytes, reduction_of, sharding_of,
)

Shape = tuple[int, ...]


def traffic_of(shapes: list[tuple[Shape, str]], *, dp: int, microbatches: int,
               bucket_mb: float, gathers: Optional[list[int]] = None) -> RankTraffic:
    return RankTraffic(lambda: shapes, dp=dp, microbatches=microbatches, bucket_mb=bucket_mb,
                       gathers=gathers)


def step_bytes(shapes: list[tuple[Shape, str]], *, dp: int, options: DpOptions, step: int,
               microbatches: int, bucket_mb: float,
               gathers: Optional[list[int]] = None) -> float:
    """Bytes one rank sends over DP in optimizer step ``step`` (1-based), scalars included;
    ``gathers``: ZeRO-3's gathers per bucket (``hybrid.planning.cost.gathered``)."""
    if dp == 1:
        return 0.0
    scalars = all_reduce_bytes(SCALAR, dp) * (2 if sharding_of(options).shards_optimizer else 1)
    return scalars + gradient_bytes(shapes, dp=dp, options=options, step=step,
                                    microbatches=microbatches, bucket_mb=bucket_mb,
                                    gathers=gathers)


def gradient_bytes(shapes: list[tuple[Shape, str]], *, dp: int, options: DpOptions,
                   step: int, microbatches: int, bucket_mb: float,
                   gathers: Optional[list[int]] = None) -> float:
    """Bytes one rank sends over DP for its gradients (or parameters) in step ``step``."""
    traffic = traffic_of(shapes, dp=dp, microbatches=microbatches, bucket_mb=bucket_mb,
                         gathers=gathers)
    return reduction_of(options).step_bytes(traffic, options, step, sharding_of(options))


def dp_state_bytes(shapes: list[tuple[Shape, str]], *, dp: int, options: DpOptions) -> int:
    """Bytes the reduction keeps between steps besides weights, gradients and AdamW
    (PowerSGD's error feedback and warm start; a delayed mean in flight)."""
    if dp == 1:
        return 0
    traffic = traffic_of(shapes, dp=dp, microbatches=1, bucket_mb=25.0)
    return reduction_of(options).state_bytes(traffic, options)
